//! Prints a GGUF file's header: version, alignment, metadata and tensor table.
//!
//! `cargo run -p ember-gguf --example gguf_dump -- MODEL.gguf`

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use ember_gguf::Gguf;

fn main() -> ExitCode {
    let Some(path) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: gguf_dump FILE.gguf");
        return ExitCode::FAILURE;
    };
    let start = Instant::now();
    let gguf = match Gguf::open(&path) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let elapsed = start.elapsed();
    println!(
        "{}: GGUF v{}, {} bytes, alignment {}, data at {}, {} metadata entries, {} tensors, \
         parsed in {:.1} ms",
        path.display(),
        gguf.version(),
        gguf.file_size(),
        gguf.alignment(),
        gguf.data_offset(),
        gguf.metadata().len(),
        gguf.tensors().len(),
        elapsed.as_secs_f64() * 1e3
    );
    for (key, value) in gguf.metadata().iter() {
        println!("  {key} ({}) = {value}", value.type_name());
    }
    for t in gguf.tensors() {
        println!(
            "  {:<40} {:<8} {:?} offset {} bytes {}",
            t.name, t.ty, t.dims, t.offset, t.n_bytes
        );
    }
    ExitCode::SUCCESS
}
