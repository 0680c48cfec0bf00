//! A memory budget for chat-template renders. minijinja bounds the steps of a render (fuel) but
//! not the values it builds: `{% set b = a ~ a %}` doubles a string in one step, so thirty steps
//! reach gigabytes. [`RenderBudgetAllocator`], installed as a program's global allocator, counts
//! the bytes a render's thread holds; a render that passes its budget has its thread stopped
//! inside the allocation that would pass it (the thread sleeps forever, its memory bounded by the
//! budget), and the caller, waiting on the render, reports the template as the cause.
//!
//! Without the allocator installed (library users, unit tests) renders still run on their own
//! thread under the time limit, but their memory is not counted.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
use std::time::Duration;

/// The budget of one render, shared by its thread and its caller.
#[derive(Debug)]
pub(crate) struct RenderBudget {
    limit: isize,
    live: AtomicIsize,
    exceeded: AtomicBool,
}

impl RenderBudget {
    pub(crate) fn new(limit: usize) -> RenderBudget {
        RenderBudget {
            limit: limit.min(isize::MAX as usize) as isize,
            live: AtomicIsize::new(0),
            exceeded: AtomicBool::new(false),
        }
    }

    /// Whether the render passed its budget (its thread is stopped).
    pub(crate) fn exceeded(&self) -> bool {
        self.exceeded.load(Ordering::Acquire)
    }
}

thread_local! {
    // Const-initialized and without a destructor, so reading it never allocates and works until
    // the thread's very end.
    static CURRENT: Cell<*const RenderBudget> = const { Cell::new(std::ptr::null()) };
}

/// Charges this thread's render (if it runs one) from now on to `budget`; `None` stops charging.
/// The caller keeps `budget` alive while it is set.
pub(crate) fn set_current(budget: Option<&RenderBudget>) {
    let ptr = budget.map_or(std::ptr::null(), |b| b as *const RenderBudget);
    let _ = CURRENT.try_with(|c| c.set(ptr));
}

fn charge(bytes: usize) {
    let Ok(ptr) = CURRENT.try_with(Cell::get) else {
        return;
    };
    if ptr.is_null() {
        return;
    }
    // SAFETY: `set_current`'s caller keeps the budget alive while the pointer is set.
    let budget = unsafe { &*ptr };
    let bytes = bytes.min(isize::MAX as usize) as isize;
    let live = budget
        .live
        .fetch_add(bytes, Ordering::Relaxed)
        .saturating_add(bytes);
    if live > budget.limit {
        budget.exceeded.store(true, Ordering::Release);
        // The render cannot be unwound from inside an allocation: its thread stops here for good,
        // holding no more than the budget, and the caller reports the failure.
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

fn credit(bytes: usize) {
    let Ok(ptr) = CURRENT.try_with(Cell::get) else {
        return;
    };
    if ptr.is_null() {
        return;
    }
    // SAFETY: as in `charge`.
    let budget = unsafe { &*ptr };
    budget
        .live
        .fetch_sub(bytes.min(isize::MAX as usize) as isize, Ordering::Relaxed);
}

/// The system allocator, counting the bytes each chat-template render holds against its budget.
/// Install it with `#[global_allocator]` in a program that renders untrusted templates.
pub struct RenderBudgetAllocator;

// SAFETY: every call is forwarded to the system allocator unchanged; the bookkeeping around it
// neither allocates nor unwinds.
unsafe impl GlobalAlloc for RenderBudgetAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        charge(layout.size());
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        charge(layout.size());
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        credit(layout.size());
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            charge(new_size - layout.size());
        } else {
            credit(layout.size() - new_size);
        }
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
