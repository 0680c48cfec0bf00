//! Prints a GGUF file's header: version, alignment, metadata and tensor table, and how long
//! parsing took.
//!
//! `cargo run --release -p ember-gguf --example gguf_dump -- MODEL.gguf`

use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use ember_gguf::Gguf;

fn dump(path: &Path, out: &mut impl Write) -> Result<(), Box<dyn std::error::Error>> {
    let start = Instant::now();
    let gguf = Gguf::open(path)?;
    let elapsed = start.elapsed();
    writeln!(
        out,
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
    )?;
    for (key, value) in gguf.metadata().iter() {
        writeln!(out, "  {key} ({}) = {value}", value.type_name())?;
    }
    for t in gguf.tensors() {
        writeln!(
            out,
            "  {:<40} {:<8} {:?} offset {} bytes {}",
            t.name, t.ty, t.dims, t.offset, t.n_bytes
        )?;
    }
    out.flush()?;
    Ok(())
}

fn main() -> ExitCode {
    let Some(path) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: gguf_dump FILE.gguf");
        return ExitCode::FAILURE;
    };
    match dump(&path, &mut BufWriter::new(io::stdout().lock())) {
        Ok(()) => ExitCode::SUCCESS,
        // A closed pipe (`| head`) is the reader's choice, not a failure.
        Err(e)
            if e.downcast_ref::<io::Error>()
                .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe) =>
        {
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
