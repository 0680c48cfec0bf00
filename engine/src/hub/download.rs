//! One file into the blob store: resumable, hashed while written, renamed only once verified.
//!
//! The partial file is `blobs/SHA256.incomplete`, the name huggingface_hub gives its own partial
//! downloads, so an interrupted pull of either tool is resumed by the other. A blob under its
//! final name has been verified, so a blob of the right size is taken as it is.
//!
//! No file under its final name is ever written in place: a blob appears by a rename, so a
//! process that has the old file mapped keeps reading the old contents instead of dying with
//! SIGBUS. Two pulls of the same blob (two processes, or two threads of a server) take turns: the
//! writer of `SHA256.incomplete` holds an exclusive lock on `CACHE/.locks/models--OWNER--REPO/
//! SHA256.lock` (where huggingface_hub locks the same blob, with the same kind of lock on Unix),
//! and the one that waited finds the blob done.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::api::{is_sha256_hex, Client, RepoFile};
use super::{io_err, HubError, HubSpec};

/// The blob of `file` in `repo_dir`, downloaded and verified if it is not there yet.
/// `on_bytes` is told how many bytes of this file are on disk as they grow; `on_wait` is told
/// when another pull is writing the same blob and this one waits for it.
pub fn fetch_blob(
    client: &Client<'_>,
    spec: &HubSpec,
    commit: &str,
    file: &RepoFile,
    repo_dir: &Path,
    on_bytes: &mut dyn FnMut(u64),
    on_wait: &mut dyn FnMut(&str),
) -> Result<PathBuf, HubError> {
    let sha256 = file.sha256.as_deref().ok_or_else(|| HubError::NoChecksum {
        repo: spec.repo_id(),
        file: file.path.clone(),
    })?;
    if !is_sha256_hex(sha256) {
        return Err(HubError::BadResponse {
            url: file.path.clone(),
            message: format!(
                "expected an LFS SHA-256 of 64 hex digits, found {:?}",
                sha256.chars().take(80).collect::<String>()
            ),
        });
    }
    let blobs = repo_dir.join("blobs");
    let blob = blobs.join(sha256);
    let complete =
        |blob: &Path| fs::metadata(blob).is_ok_and(|m| m.is_file() && m.len() == file.size);
    if complete(&blob) {
        on_bytes(file.size);
        return Ok(blob);
    }
    let _lock = lock_blob(repo_dir, sha256, &file.path, on_wait)?;
    // Another pull may have finished the blob while this one waited.
    if complete(&blob) {
        on_bytes(file.size);
        return Ok(blob);
    }
    fs::create_dir_all(&blobs).map_err(io_err(&blobs))?;
    let partial = blobs.join(format!("{sha256}.incomplete"));
    let mut out = OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .open(&partial)
        .map_err(io_err(&partial))?;
    // What an earlier attempt left counts, after hashing it again.
    let mut hasher = Sha256::new();
    let mut written = hash_existing(&mut out, &partial, &mut hasher)?;
    if written > file.size {
        out.set_len(0).map_err(io_err(&partial))?;
        hasher = Sha256::new();
        written = 0;
    }
    on_bytes(written);
    let config = client_config(client);
    let mut attempts_without_progress = 0u32;
    let mut last_error: Option<HubError> = None;
    while written < file.size {
        if attempts_without_progress >= config.0 {
            return Err(last_error.unwrap_or(HubError::SizeMismatch {
                file: file.path.clone(),
                expected: file.size,
                found: written,
            }));
        }
        if attempts_without_progress > 0 {
            std::thread::sleep(config.1);
        }
        attempts_without_progress += 1;
        let response = match client.get_file(spec, commit, &file.path, written) {
            Ok(r) => r,
            // A broken connection or a server error may pass; a definite answer will not.
            Err(e @ (HubError::Network { .. } | HubError::Offline { .. })) => {
                last_error = Some(e);
                continue;
            }
            Err(e @ HubError::Http { status, .. }) if status >= 500 => {
                last_error = Some(e);
                continue;
            }
            Err(e) => return Err(e),
        };
        if response.start != written {
            // The server ignored the range and sends the whole file: start over.
            out.set_len(0).map_err(io_err(&partial))?;
            hasher = Sha256::new();
            written = 0;
            on_bytes(0);
        }
        let before = written;
        let mut body = response.body;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    last_error = Some(HubError::Network {
                        url: file.path.clone(),
                        message: format!("connection broken after {written} bytes: {e}"),
                    });
                    break;
                }
            };
            if written + n as u64 > file.size {
                drop(out);
                let _ = fs::remove_file(&partial);
                return Err(HubError::SizeMismatch {
                    file: file.path.clone(),
                    expected: file.size,
                    found: written + n as u64,
                });
            }
            out.write_all(&buf[..n]).map_err(io_err(&partial))?;
            hasher.update(&buf[..n]);
            written += n as u64;
            on_bytes(written);
        }
        if written > before {
            attempts_without_progress = 0;
        }
    }
    out.sync_all().map_err(io_err(&partial))?;
    drop(out);
    let found = hex::encode(hasher.finalize());
    if !found.eq_ignore_ascii_case(sha256) {
        let _ = fs::remove_file(&partial);
        return Err(HubError::ChecksumMismatch {
            file: file.path.clone(),
            expected: sha256.to_string(),
            found,
        });
    }
    fs::rename(&partial, &blob).map_err(io_err(&blob))?;
    Ok(blob)
}

/// `CACHE/.locks/models--OWNER--REPO/SHA256.lock` for the blob `sha256` of `repo_dir`.
pub fn lock_path(repo_dir: &Path, sha256: &str) -> PathBuf {
    let cache_dir = repo_dir.parent().unwrap_or(Path::new("."));
    let repo_folder = repo_dir.file_name().unwrap_or_default();
    cache_dir
        .join(".locks")
        .join(repo_folder)
        .join(format!("{sha256}.lock"))
}

/// Takes the exclusive lock of blob `sha256`, waiting (after telling `on_wait`) while another
/// pull holds it. The lock goes with the returned file. The lock file itself stays: removing it
/// while another pull waits on it would let a third one lock a new file beside it.
fn lock_blob(
    repo_dir: &Path,
    sha256: &str,
    file: &str,
    on_wait: &mut dyn FnMut(&str),
) -> Result<Option<File>, HubError> {
    let path = lock_path(repo_dir, sha256);
    let dir = path.parent().expect("a lock path has a folder");
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_err(&path))?;
    match lock.try_lock() {
        Ok(()) => Ok(Some(lock)),
        Err(TryLockError::WouldBlock) => {
            on_wait(&format!(
                "{file}: another pull is downloading it (lock {}); waiting",
                path.display()
            ));
            lock.lock().map_err(io_err(&path))?;
            Ok(Some(lock))
        }
        // A file system without locks: the download goes on unlocked, as before locks existed.
        Err(TryLockError::Error(e)) if e.kind() == io::ErrorKind::Unsupported => {
            tracing::warn!(path = %path.display(), "file locks are not supported here; downloading without one");
            Ok(None)
        }
        Err(TryLockError::Error(e)) => Err(io_err(&path)(e)),
    }
}

fn client_config(client: &Client<'_>) -> (u32, std::time::Duration) {
    let config = client.config();
    (config.max_attempts.max(1), config.retry_delay)
}

fn hash_existing(file: &mut File, path: &Path, hasher: &mut Sha256) -> Result<u64, HubError> {
    file.seek(SeekFrom::Start(0)).map_err(io_err(path))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        total += n as u64;
    }
    Ok(total)
}
