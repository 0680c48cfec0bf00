//! The `ember` command line; everything lives in the library's `cli` module.

fn main() -> std::process::ExitCode {
    ember::cli::main()
}
