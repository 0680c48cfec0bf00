//! Ctrl-C in `run` and `chat`: it stops the answer being generated, not the program. While no
//! answer is being generated, Ctrl-C ends the program as usual (exit status 130).
//!
//! The signal is awaited on a thread of its own through tokio's portable `ctrl_c` (SIGINT on
//! Unix, the console handler on Windows), so no signal-handler code runs outside that thread.

use std::sync::{Mutex, OnceLock};

use ember::engine::Canceller;

/// The request Ctrl-C cancels now, if any.
static CURRENT: Mutex<Option<Canceller>> = Mutex::new(None);
static INSTALLED: OnceLock<bool> = OnceLock::new();

/// Starts listening for Ctrl-C (once per process); `false` if that failed, in which case Ctrl-C
/// keeps its default effect.
pub fn install() -> bool {
    *INSTALLED.get_or_init(|| {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(r) => r,
            Err(_) => return false,
        };
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("ctrl-c".into())
            .spawn(move || {
                runtime.block_on(async move {
                    // The handler is registered before the caller goes on, so an early Ctrl-C
                    // is not lost to the default action.
                    #[cfg(unix)]
                    let mut interrupts = {
                        use tokio::signal::unix::{signal, SignalKind};
                        match signal(SignalKind::interrupt()) {
                            Ok(s) => s,
                            Err(_) => return,
                        }
                    };
                    let _ = ready_tx.send(());
                    loop {
                        #[cfg(unix)]
                        let received = interrupts.recv().await.is_some();
                        #[cfg(not(unix))]
                        let received = tokio::signal::ctrl_c().await.is_ok();
                        if !received {
                            return;
                        }
                        let current = CURRENT.lock().map(|mut c| c.take()).unwrap_or(None);
                        match current {
                            Some(canceller) => canceller.cancel(),
                            None => {
                                eprintln!();
                                std::process::exit(130);
                            }
                        }
                    }
                })
            });
        spawned.is_ok() && ready_rx.recv().is_ok()
    })
}

/// While the guard lives, Ctrl-C cancels this request instead of ending the program.
pub struct Guard;

pub fn cancel_on_interrupt(canceller: Canceller) -> Guard {
    if let Ok(mut current) = CURRENT.lock() {
        *current = Some(canceller);
    }
    Guard
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Ok(mut current) = CURRENT.lock() {
            *current = None;
        }
    }
}
