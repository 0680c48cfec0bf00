//! A team of threads for the short parallel ops of decoding.
//!
//! A decode step is a few hundred small products (a 135M model's matvec is tens of
//! microseconds on one core). Handed to rayon, each one wakes the pool's workers, and a worker
//! idle for more than a few dozen microseconds has gone to sleep on a futex: waking sixteen of
//! them, one system call each, costs about as much as the product itself, and the step slows
//! down as threads are added. The team keeps its workers spinning on one shared word for a
//! short while after each op ([`SPIN`]), so the next op of the same step reaches them in well
//! under a microsecond; past that they park, and one `notify_all` wakes them all.
//!
//! A job of `n` indices is published as one 64-bit word: (epoch, n, next index). Workers and
//! the caller claim indices with a compare-and-swap on that word, so a worker that is late
//! (still looking at an earlier op) can never claim an index of an op it has not seen, and the
//! caller returns only when every claimed index has run. Which index runs on which thread never
//! changes a result: each index owns its outputs.
//!
//! [`Team::enter`] makes a team current on the calling thread; [`for_each_index`] runs on the
//! current team, or on rayon's current pool where none is (or where another thread is already
//! using the team, or from inside one of the team's jobs).

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// How long a worker spins for the next op before it parks. Covers the gaps inside a decode
/// step (norms, rope, the sampler between tokens), not the idle time of a server.
const SPIN: Duration = Duration::from_micros(300);

/// Indices of one op: at most this many (they share the published word with the epoch).
const MAX_JOBS: usize = u16::MAX as usize;

type Job = dyn Fn(usize) + Sync;

/// The published word: epoch in the high 32 bits, the op's index count and next index in
/// 16 bits each.
fn pack(epoch: u32, n: usize, next: usize) -> u64 {
    (u64::from(epoch) << 32) | ((n as u64) << 16) | next as u64
}

fn unpack(word: u64) -> (u32, usize, usize) {
    (
        (word >> 32) as u32,
        ((word >> 16) & 0xffff) as usize,
        (word & 0xffff) as usize,
    )
}

struct Inner {
    /// (epoch, indices, next index) of the op being run, see [`pack`].
    word: AtomicU64,
    /// The op's function; written by the caller only while no index of any op is claimable.
    job: UnsafeCell<Option<&'static Job>>,
    /// Indices of the current op that have finished.
    done: AtomicUsize,
    /// A panic of one of the op's indices, raised again on the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Held by the thread that publishes ops: one at a time.
    busy: AtomicBool,
    stop: AtomicBool,
    /// Workers parked on `wake`.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    /// Whether workers spin at all: not when the team has more threads than the machine has
    /// CPUs, where a spinning worker takes the core of the thread it waits for.
    spin: bool,
}

// SAFETY: `job` is written only by the thread holding `busy`, before it publishes an op's word
// (release) and after every claimed index of the previous op has finished; it is read only by
// a thread that has just claimed an index of the op it belongs to (acquire on `word`), and so
// strictly between those writes. Every other field is atomic or locked.
unsafe impl Sync for Inner {}
// SAFETY: as above; the `&'static Job` it holds is `Sync`, so it may be used from any thread.
unsafe impl Send for Inner {}

thread_local! {
    /// The team entered on this thread ([`Team::enter`]).
    static CURRENT: Cell<Option<*const Inner>> = const { Cell::new(None) };
    /// Set while this thread runs an index of a team's op: a nested op runs inline.
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

/// Threads that run the indices of an op together with the thread that publishes it.
pub struct Team {
    inner: Arc<Inner>,
    workers: Vec<JoinHandle<()>>,
    threads: usize,
}

impl std::fmt::Debug for Team {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Team")
            .field("threads", &self.threads)
            .finish()
    }
}

impl Team {
    /// A team of `threads` threads in all: the caller of each op and `threads - 1` workers.
    pub fn new(threads: usize) -> std::io::Result<Team> {
        let threads = threads.max(1);
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let inner = Arc::new(Inner {
            word: AtomicU64::new(pack(0, 0, 0)),
            job: UnsafeCell::new(None),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
            busy: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            spin: threads <= cpus,
        });
        let mut team = Team {
            inner,
            workers: Vec::with_capacity(threads - 1),
            threads,
        };
        for i in 1..threads {
            let inner = Arc::clone(&team.inner);
            // On failure `team` is dropped, which stops and joins the workers spawned so far.
            team.workers.push(
                std::thread::Builder::new()
                    .name(format!("ember-team-{i}"))
                    .spawn(move || worker(&inner))?,
            );
        }
        Ok(team)
    }

    /// Runs `f` with this team current on the calling thread: [`for_each_index`] inside it
    /// runs its indices on the team.
    pub fn enter<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore(Option<*const Inner>);
        impl Drop for Restore {
            fn drop(&mut self) {
                CURRENT.with(|c| c.set(self.0));
            }
        }
        let _restore = Restore(CURRENT.with(|c| c.replace(Some(Arc::as_ptr(&self.inner)))));
        f()
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        {
            let _guard = self
                .inner
                .lock
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            self.inner.wake.notify_all();
        }
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// Runs `f` with every [`for_each_index`] inside it run inline, on the calling thread: for a
/// caller that has already split its work between threads (one index of its own op computes
/// one part of a product, whose own split would only wake threads that are busy).
pub fn inline<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            IN_JOB.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(IN_JOB.with(|c| c.replace(true)));
    f()
}

/// Runs `job(0..n_jobs)`, each index once, on the current team ([`Team::enter`]) or else on
/// rayon's current pool. Returns when all have run; a panic of one is raised again here.
pub fn for_each_index(n_jobs: usize, job: impl Fn(usize) + Sync + Send) {
    if n_jobs <= 1 || IN_JOB.with(Cell::get) {
        (0..n_jobs).for_each(job);
        return;
    }
    if let Some(inner) = CURRENT.with(Cell::get) {
        // SAFETY: the pointer was set by `Team::enter` on this thread, whose `&self` borrow
        // (and so the `Arc<Inner>`) outlives every call made inside it; `enter` restores the
        // previous value before returning.
        let inner = unsafe { &*inner };
        if n_jobs <= MAX_JOBS && !inner.busy.swap(true, Ordering::Acquire) {
            /// Gives the team back also when `run` raises an index's panic again.
            struct Release<'a>(&'a AtomicBool);
            impl Drop for Release<'_> {
                fn drop(&mut self) {
                    self.0.store(false, Ordering::Release);
                }
            }
            let _release = Release(&inner.busy);
            run(inner, n_jobs, &job);
            return;
        }
    }
    if n_jobs == rayon::current_num_threads() {
        // Every thread handed its index at once: a parallel iterator would hand the work down
        // a tree of `join`s, each level waiting for one more thread to wake.
        rayon::broadcast(|ctx| job(ctx.index()));
    } else {
        (0..n_jobs).into_par_iter().for_each(job);
    }
}

/// Publishes an op, runs indices of it on the caller too, waits for the rest.
fn run(inner: &Inner, n_jobs: usize, job: &(dyn Fn(usize) + Sync)) {
    // SAFETY: only the lifetime is erased. The reference is stored in `inner.job` for the
    // duration of this call only: it is read by threads that claimed an index of this op, and
    // this call returns after every claimed index has finished (`done == n_jobs`); no index of
    // this op can be claimed afterwards (the next op's word has a new epoch), and the slot is
    // cleared before returning.
    let job: &'static Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), _>(job) };
    let (epoch, _, _) = unpack(inner.word.load(Ordering::Relaxed));
    let epoch = epoch.wrapping_add(1);
    // SAFETY: see `impl Sync for Inner`: `busy` is held and the previous op has finished.
    unsafe { *inner.job.get() = Some(job) };
    inner.done.store(0, Ordering::Relaxed);
    inner.word.store(pack(epoch, n_jobs, 0), Ordering::SeqCst);
    if inner.sleepers.load(Ordering::SeqCst) > 0 {
        let _guard = inner.lock.lock().unwrap_or_else(PoisonError::into_inner);
        inner.wake.notify_all();
    }
    work(inner, epoch);
    let mut spins = 0u32;
    while inner.done.load(Ordering::Acquire) < n_jobs {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(64) {
            // A worker descheduled mid-index (more threads than cores) needs the core.
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    // SAFETY: every index has finished; nothing reads the slot until the next op publishes.
    unsafe { *inner.job.get() = None };
    let panic = inner
        .panic
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    if let Some(payload) = panic {
        panic::resume_unwind(payload);
    }
}

/// Claims and runs indices of the op of `epoch` until none is left.
fn work(inner: &Inner, epoch: u32) {
    let mut word = inner.word.load(Ordering::Acquire);
    loop {
        let (e, n, next) = unpack(word);
        if e != epoch || next >= n {
            return;
        }
        match inner.word.compare_exchange_weak(
            word,
            pack(e, n, next + 1),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => {
                // SAFETY: an index of this op is claimed and not finished, so the caller is
                // inside `run` for this op and the slot holds its function.
                let job = unsafe { *inner.job.get() }.expect("a published op has a function");
                IN_JOB.with(|c| c.set(true));
                let result = panic::catch_unwind(AssertUnwindSafe(|| job(next)));
                IN_JOB.with(|c| c.set(false));
                if let Err(payload) = result {
                    let mut slot = inner.panic.lock().unwrap_or_else(PoisonError::into_inner);
                    slot.get_or_insert(payload);
                }
                inner.done.fetch_add(1, Ordering::AcqRel);
                word = inner.word.load(Ordering::Acquire);
            }
            Err(now) => word = now,
        }
    }
}

/// A worker: waits for each new epoch (spinning for [`SPIN`], then parked), then works on it.
fn worker(inner: &Inner) {
    let (mut seen, _, _) = unpack(inner.word.load(Ordering::Acquire));
    loop {
        let since = Instant::now();
        let mut spins = 0u32;
        let epoch = loop {
            let (epoch, _, _) = unpack(inner.word.load(Ordering::Acquire));
            if epoch != seen {
                break epoch;
            }
            if inner.stop.load(Ordering::Relaxed) {
                return;
            }
            spins = spins.wrapping_add(1);
            if inner.spin && (!spins.is_multiple_of(64) || since.elapsed() < SPIN) {
                if spins.is_multiple_of(64) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            let mut guard = inner.lock.lock().unwrap_or_else(PoisonError::into_inner);
            inner.sleepers.fetch_add(1, Ordering::SeqCst);
            while unpack(inner.word.load(Ordering::SeqCst)).0 == seen
                && !inner.stop.load(Ordering::SeqCst)
            {
                guard = inner
                    .wake
                    .wait(guard)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            inner.sleepers.fetch_sub(1, Ordering::SeqCst);
            drop(guard);
            spins = 0;
        };
        seen = epoch;
        work(inner, epoch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_index_runs_once_per_op_at_every_team_size() {
        for threads in [1, 2, 3, 8] {
            let team = Team::new(threads).unwrap();
            team.enter(|| {
                for n in [0, 1, 2, 5, 64, 1000] {
                    let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                    for _ in 0..50 {
                        for_each_index(n, |i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        });
                    }
                    assert!(
                        hits.iter().all(|h| h.load(Ordering::Relaxed) == 50),
                        "{threads} threads, {n} indices"
                    );
                }
            });
        }
    }

    #[test]
    fn ops_after_the_workers_park_still_run() {
        let team = Team::new(3).unwrap();
        let sum = AtomicUsize::new(0);
        team.enter(|| {
            for round in 0..3 {
                std::thread::sleep(SPIN * 4);
                for_each_index(10, |i| {
                    sum.fetch_add(i + round, Ordering::Relaxed);
                });
            }
        });
        assert_eq!(sum.load(Ordering::Relaxed), 3 * 45 + 10 * 3); // rounds 0, 1 and 2 add 10 * round
    }

    #[test]
    fn a_panicking_index_is_raised_on_the_caller_and_the_team_goes_on() {
        let team = Team::new(4).unwrap();
        team.enter(|| {
            let caught = panic::catch_unwind(AssertUnwindSafe(|| {
                for_each_index(16, |i| assert_ne!(i, 11, "index eleven"));
            }));
            assert!(caught.is_err());
            assert!(
                !team.inner.busy.load(Ordering::Acquire),
                "the team is free again after the panic"
            );
            let count = AtomicUsize::new(0);
            for_each_index(16, |_| {
                count.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(count.load(Ordering::Relaxed), 16);
        });
    }

    #[test]
    fn nested_ops_and_other_threads_fall_back_without_deadlock() {
        let team = Team::new(3).unwrap();
        let total = AtomicUsize::new(0);
        team.enter(|| {
            for_each_index(4, |_| {
                // Inside an index: runs inline.
                for_each_index(5, |_| {
                    total.fetch_add(1, Ordering::Relaxed);
                });
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 20);
        // Outside `enter`: rayon.
        let outside = AtomicUsize::new(0);
        for_each_index(7, |_| {
            outside.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(outside.load(Ordering::Relaxed), 7);
    }

    #[test]
    fn a_team_is_dropped_while_its_workers_are_parked() {
        let team = Team::new(4).unwrap();
        team.enter(|| for_each_index(8, |_| {}));
        std::thread::sleep(SPIN * 4);
        drop(team);
    }
}
