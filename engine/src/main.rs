//! The `ember` command line: flags and terminal output in [`cli`], everything else in the
//! `ember` library.

mod cli;

/// The system allocator, counting what chat-template renders hold so that a template building
/// huge values is stopped at its budget ([`ember_tokenizer::RENDER_MEMORY_BYTES`]).
#[global_allocator]
static ALLOCATOR: ember_tokenizer::RenderBudgetAllocator = ember_tokenizer::RenderBudgetAllocator;

fn main() -> std::process::ExitCode {
    restore_default_sigpipe();
    cli::main()
}

/// Rust ignores SIGPIPE, so writing to a closed pipe (`ember info | head`) makes `println!` panic.
/// A command-line tool should end quietly there instead, as other Unix tools do.
#[cfg(unix)]
fn restore_default_sigpipe() {
    // SAFETY: called first thing in main, before any thread exists; SIG_DFL is a valid disposition
    // for SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(not(unix))]
fn restore_default_sigpipe() {}
