//! The huggingface_hub cache layout, which the Python tools read and write too:
//!
//! ```text
//! CACHE/models--OWNER--REPO/blobs/SHA256            file contents, named by their hash
//! CACHE/models--OWNER--REPO/refs/main               the commit main pointed at
//! CACHE/models--OWNER--REPO/snapshots/COMMIT/FILE   relative link to ../../blobs/SHA256
//! ```
//!
//! On systems where a link cannot be made (Windows without developer mode), the blob is
//! hard-linked, else copied, as huggingface_hub does. Links and refs are made under a temporary
//! name unique to the writer and renamed into place, never rewritten in place.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{io_err, select, HubError, HubSpec};

/// `CACHE/models--OWNER--REPO`.
pub fn repo_dir(cache_dir: &Path, spec: &HubSpec) -> PathBuf {
    cache_dir.join(format!("models--{}--{}", spec.owner, spec.repo))
}

/// Links `snapshots/COMMIT/FILE` to `blob`; the link's path.
pub fn link_snapshot(
    repo_dir: &Path,
    commit: &str,
    file: &str,
    blob: &Path,
) -> Result<PathBuf, HubError> {
    let components: Vec<&str> = file.split('/').collect();
    if components
        .iter()
        .any(|c| c.is_empty() || *c == "." || *c == ".." || c.contains('\\'))
    {
        return Err(HubError::BadResponse {
            url: file.to_string(),
            message: "expected a relative file path inside the repository".into(),
        });
    }
    let link = components
        .iter()
        .fold(repo_dir.join("snapshots").join(commit), |p, c| p.join(c));
    let parent = link.parent().expect("a snapshot link has a parent");
    fs::create_dir_all(parent).map_err(io_err(parent))?;
    // snapshots/COMMIT/a/b.gguf -> ../../../blobs/SHA: one `..` per folder below the repo.
    let mut target = PathBuf::new();
    for _ in 0..components.len() + 1 {
        target.push("..");
    }
    target.push("blobs");
    target.push(blob.file_name().expect("a blob has a file name"));
    // Made under a name of its own and renamed over the old link, so the snapshot path always
    // names a whole file and a reader of the old one keeps it.
    let tmp = temporary_name(&link);
    let _ = fs::remove_file(&tmp);
    make_link(&target, blob, &tmp)?;
    if let Err(error) = fs::rename(&tmp, &link) {
        let _ = fs::remove_file(&tmp);
        return Err(io_err(&link)(error));
    }
    Ok(link)
}

/// `DIR/.NAME.PID-N.tmp` beside `path`: unique to this process and call, so concurrent writers
/// (other processes, other threads) never share a temporary file.
fn temporary_name(path: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.{}-{n}.tmp", std::process::id()))
}

#[cfg(unix)]
fn make_link(target: &Path, _blob: &Path, link: &Path) -> Result<(), HubError> {
    std::os::unix::fs::symlink(target, link).map_err(io_err(link))
}

#[cfg(not(unix))]
fn make_link(target: &Path, blob: &Path, link: &Path) -> Result<(), HubError> {
    #[cfg(windows)]
    if std::os::windows::fs::symlink_file(target, link).is_ok() {
        return Ok(());
    }
    let _ = target;
    if fs::hard_link(blob, link).is_ok() {
        return Ok(());
    }
    fs::copy(blob, link).map(|_| ()).map_err(io_err(link))
}

/// Writes `refs/NAME` = `commit` (through a temporary file and a rename).
pub fn write_ref(repo_dir: &Path, name: &str, commit: &str) -> Result<(), HubError> {
    let refs = repo_dir.join("refs");
    fs::create_dir_all(&refs).map_err(io_err(&refs))?;
    let path = refs.join(name);
    let tmp = temporary_name(&path);
    fs::write(&tmp, commit).map_err(io_err(&tmp))?;
    if let Err(error) = fs::rename(&tmp, &path) {
        let _ = fs::remove_file(&tmp);
        return Err(io_err(&path)(error));
    }
    Ok(())
}

fn read_ref(repo_dir: &Path, name: &str) -> Option<String> {
    let text = crate::limits::read_text_file(&repo_dir.join("refs").join(name), 256).ok()?;
    let commit = text.trim().to_string();
    (!commit.is_empty() && commit.chars().all(|c| c.is_ascii_hexdigit())).then_some(commit)
}

/// Files of a snapshot folder, as repository paths with `/`, whose contents are present (a link
/// to a missing blob does not count).
fn snapshot_files(dir: &Path) -> Vec<String> {
    fn walk(dir: &Path, prefix: &str, out: &mut Vec<String>) {
        let Ok(entries) = fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            let rel = if prefix.is_empty() {
                name
            } else {
                format!("{prefix}/{name}")
            };
            // `metadata` follows the link: a dangling one is skipped.
            match fs::metadata(&path) {
                Ok(m) if m.is_dir() => walk(&path, &rel, out),
                Ok(m) if m.is_file() => out.push(rel),
                _ => {}
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, "", &mut out);
    out.sort();
    out
}

/// The cached (first) GGUF file of `spec`'s quant in the snapshot `refs/main` names, if every
/// file of its set is there.
pub fn find_cached(repo_dir: &Path, spec: &HubSpec) -> Option<PathBuf> {
    let commit = read_ref(repo_dir, "main")?;
    let snapshot = repo_dir.join("snapshots").join(commit);
    let files = snapshot_files(&snapshot);
    let set = select::pick_names(spec.quant.as_deref(), &files)?;
    Some(snapshot.join(&set[0]))
}

/// One cached GGUF file, as `ember list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedFile {
    /// `OWNER/REPO`.
    pub repo: String,
    /// The file's path in the repository.
    pub file: String,
    /// Its path in the snapshot.
    pub path: PathBuf,
    pub bytes: u64,
    /// Whether it is in the snapshot `refs/main` names (else an older commit's).
    pub current: bool,
}

/// Every GGUF file in the cache's model snapshots, by repository and file.
pub fn list(cache_dir: &Path) -> Vec<CachedFile> {
    let mut out = Vec::new();
    let Ok(entries) = fs::read_dir(cache_dir) else {
        return out;
    };
    let mut repos: Vec<(String, PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let rest = name.strip_prefix("models--")?;
            let (owner, repo) = rest.split_once("--")?;
            Some((format!("{owner}/{repo}"), e.path()))
        })
        .collect();
    repos.sort();
    for (repo, dir) in repos {
        let current = read_ref(&dir, "main");
        let Ok(snapshots) = fs::read_dir(dir.join("snapshots")) else {
            continue;
        };
        for snapshot in snapshots.flatten() {
            let commit = snapshot.file_name().to_string_lossy().into_owned();
            for file in snapshot_files(&snapshot.path()) {
                if !file.to_ascii_lowercase().ends_with(".gguf") {
                    continue;
                }
                let path = snapshot.path().join(&file);
                let bytes = fs::metadata(&path).map_or(0, |m| m.len());
                out.push(CachedFile {
                    repo: repo.clone(),
                    file,
                    path,
                    bytes,
                    current: current.as_deref() == Some(commit.as_str()),
                });
            }
        }
    }
    out
}

/// Removes `spec` from the cache: with a quant, that quant's files in every snapshot and the
/// blobs no other file links to; without one, the whole repository folder. The paths removed.
pub fn remove(cache_dir: &Path, spec: &HubSpec) -> Result<Vec<PathBuf>, HubError> {
    let dir = repo_dir(cache_dir, spec);
    if !dir.is_dir() {
        return Err(HubError::NotCached {
            spec: spec.to_string(),
            dir: cache_dir.to_owned(),
            offline: false,
        });
    }
    let Some(quant) = spec.quant.as_deref() else {
        fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
        return Ok(vec![dir]);
    };
    let mut removed = Vec::new();
    let mut blobs = Vec::new();
    let snapshots = dir.join("snapshots");
    for snapshot in fs::read_dir(&snapshots).into_iter().flatten().flatten() {
        for file in snapshot_files(&snapshot.path()) {
            if !file.to_ascii_lowercase().ends_with(".gguf") || !select::has_quant(&file, quant) {
                continue;
            }
            let link = snapshot.path().join(&file);
            blobs.extend(fs::canonicalize(&link).ok());
            fs::remove_file(&link).map_err(io_err(&link))?;
            removed.push(link);
        }
    }
    if removed.is_empty() {
        return Err(HubError::NotCached {
            spec: spec.to_string(),
            dir: cache_dir.to_owned(),
            offline: false,
        });
    }
    // A blob goes when no file of any snapshot still points at it (copies on systems without
    // links were removed with their snapshot file above).
    let still_linked: Vec<PathBuf> = fs::read_dir(&snapshots)
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|s| {
            let root = s.path();
            snapshot_files(&root)
                .into_iter()
                .filter_map(move |f| fs::canonicalize(root.join(f)).ok())
        })
        .collect();
    let blob_dir = fs::canonicalize(dir.join("blobs")).ok();
    for blob in blobs {
        let in_store = blob_dir.as_ref().is_some_and(|d| blob.starts_with(d));
        if in_store && !still_linked.contains(&blob) {
            fs::remove_file(&blob).map_err(io_err(&blob))?;
            removed.push(blob);
        }
    }
    Ok(removed)
}
