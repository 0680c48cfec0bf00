//! GGUF models from the Hugging Face hub: `ember pull hf://OWNER/REPO[:QUANT]` and `-m hf://…`.
//!
//! What a pull does, in order:
//! 1. asks the hub for the repository's files at `main` with their LFS metadata
//!    (`GET {endpoint}/api/models/OWNER/REPO/revision/main?blobs=true`: the commit and, per file,
//!    its size and SHA-256), see [`api`];
//! 2. picks the GGUF file(s) of the quant (`Q4_K_M` unless named; the parts of a split GGUF
//!    `-00001-of-0000N` as one set), see [`select`];
//! 3. downloads each file from `{endpoint}/OWNER/REPO/resolve/COMMIT/FILE` (redirects followed)
//!    into `blobs/SHA256.incomplete`, resuming with an HTTP range request after a cut connection
//!    or an earlier interrupted pull, hashing as it writes; the file is renamed to
//!    `blobs/SHA256` only when its size and SHA-256 match the hub's; one pull at a time writes a
//!    blob (a lock per blob), and no file is ever overwritten in place, see [`download`];
//! 4. links `snapshots/COMMIT/FILE` to the blob and records the commit in `refs/main`, see
//!    [`cache`].
//!
//! The cache is the huggingface_hub layout (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
//! `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`), so files are shared with
//! the Python tools. `HF_ENDPOINT` replaces the hub's address and `HF_TOKEN` (else the token file
//! `huggingface-cli login` writes) is sent as a bearer token. `HF_HUB_OFFLINE=1` uses the cache
//! only; an unreachable hub also falls back to a cached copy of the same quant.
//!
//! The `hf-hub` crate was considered: its 1.0 API is async over reqwest and tokio (a runtime for
//! a blocking download), and it does not check downloads against the hub's LFS SHA-256, which is
//! the check this module exists for. A plain blocking client (`ureq` with rustls, so no OpenSSL
//! and the Windows cross build keeps working) gives the range requests, hashing and error mapping
//! directly.

pub mod api;
pub mod cache;
pub mod download;
pub mod select;

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::models::PullProgress;

/// The hub's public address, unless `HF_ENDPOINT` says otherwise.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// The quant picked when a spec names none (llama.cpp's `-hf` default too).
pub const DEFAULT_QUANT: &str = "Q4_K_M";
/// The prefix of a hub model spec on the command line.
pub const SPEC_PREFIX: &str = "hf://";

/// Where and how to reach the hub, and where its files are kept.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// Base address, no trailing slash (`https://huggingface.co`).
    pub endpoint: String,
    /// Bearer token for private and gated repositories.
    pub token: Option<String>,
    /// The huggingface_hub cache root (the folder holding `models--OWNER--REPO`).
    pub cache_dir: PathBuf,
    /// Use the cache only, never the network.
    pub offline: bool,
    /// How often a download may be resumed after its connection broke without progress.
    pub max_attempts: u32,
    /// Pause before resuming a broken download.
    pub retry_delay: Duration,
}

impl HubConfig {
    /// The configuration the environment describes (`HF_ENDPOINT`, `HF_TOKEN`, `HF_HOME`,
    /// `HF_HUB_CACHE`, `HF_HUB_OFFLINE`, `XDG_CACHE_HOME`, `HOME`).
    pub fn from_env() -> Result<HubConfig, HubError> {
        let var = |key: &str| std::env::var(key).ok().filter(|v| !v.trim().is_empty());
        let endpoint = var("HF_ENDPOINT")
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
            .trim_end_matches('/')
            .to_string();
        let hf_home = var("HF_HOME").map(PathBuf::from).or_else(|| {
            var("XDG_CACHE_HOME")
                .map(|c| PathBuf::from(c).join("huggingface"))
                .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache/huggingface")))
        });
        let cache_dir = match var("HF_HUB_CACHE") {
            Some(dir) => PathBuf::from(dir),
            None => hf_home.as_ref().ok_or(HubError::NoCacheDir)?.join("hub"),
        };
        let token = var("HF_TOKEN").map(|t| t.trim().to_string()).or_else(|| {
            let path = var("HF_TOKEN_PATH")
                .map(PathBuf::from)
                .or_else(|| hf_home.as_ref().map(|h| h.join("token")))?;
            // The token file is a few dozen bytes; anything larger is not a token.
            let text = crate::limits::read_text_file(&path, 4096).ok()?;
            let token = text.trim().to_string();
            (!token.is_empty()).then_some(token)
        });
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
        });
        Ok(HubConfig {
            endpoint,
            token,
            cache_dir,
            offline,
            max_attempts: 5,
            retry_delay: Duration::from_secs(1),
        })
    }
}

/// A model on the hub as named on the command line: `hf://OWNER/REPO[:QUANT]` (or llama.cpp's
/// `-hf OWNER/REPO[:QUANT]`, without the prefix).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubSpec {
    pub owner: String,
    pub repo: String,
    /// The quant asked for, upper-cased; `None` for the default.
    pub quant: Option<String>,
}

impl HubSpec {
    /// Whether `text` names a hub model (starts with `hf://`).
    pub fn is_hub(text: &str) -> bool {
        text.starts_with(SPEC_PREFIX)
    }

    /// Parses `hf://OWNER/REPO[:QUANT]`, or `OWNER/REPO[:QUANT]` without the prefix.
    pub fn parse(text: &str) -> Result<HubSpec, HubError> {
        let bad = |why: &str| HubError::BadSpec {
            spec: text.to_string(),
            why: why.to_string(),
        };
        let rest = text.strip_prefix(SPEC_PREFIX).unwrap_or(text);
        let (path, quant) = match rest.rsplit_once(':') {
            Some((path, quant)) => (path, Some(quant)),
            None => (rest, None),
        };
        let (owner, repo) = path
            .split_once('/')
            .ok_or_else(|| bad("expected OWNER/REPO"))?;
        let valid = |s: &str| {
            !s.is_empty()
                && s.len() <= 96
                && s != "."
                && s != ".."
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        if !valid(owner) || !valid(repo) {
            return Err(bad(
                "expected OWNER/REPO made of letters, digits, '-', '_' and '.'",
            ));
        }
        let quant = match quant {
            None => None,
            Some("") => return Err(bad("expected a quant after ':'")),
            Some(q)
                if q.len() > 64
                    || !q
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')) =>
            {
                return Err(bad("expected a quant such as Q4_K_M after ':'"))
            }
            Some(q) => Some(q.to_ascii_uppercase()),
        };
        Ok(HubSpec {
            owner: owner.to_string(),
            repo: repo.to_string(),
            quant,
        })
    }

    /// `OWNER/REPO`.
    pub fn repo_id(&self) -> String {
        format!("{}/{}", self.owner, self.repo)
    }

    /// The quant to pick: the one asked for, else [`DEFAULT_QUANT`].
    pub fn quant_or_default(&self) -> &str {
        self.quant.as_deref().unwrap_or(DEFAULT_QUANT)
    }
}

impl std::fmt::Display for HubSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{SPEC_PREFIX}{}/{}", self.owner, self.repo)?;
        if let Some(q) = &self.quant {
            write!(f, ":{q}")?;
        }
        Ok(())
    }
}

/// Why a hub model could not be found, fetched or removed.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("{spec:?} is not a hub model: {why}")]
    BadSpec { spec: String, why: String },
    #[error("cannot find a cache directory: expected HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME or HOME to be set, found none")]
    NoCacheDir,
    #[error("cannot reach the hub at {endpoint}: {message} (offline?)")]
    Offline { endpoint: String, message: String },
    #[error("{url}: {message}")]
    Network { url: String, message: String },
    #[error("{url}: unauthorised (HTTP {status}): the repository is private or gated, or the token is wrong")]
    Unauthorized { url: String, status: u16 },
    #[error("{what} not found on the hub ({url}: HTTP 404)")]
    NotFound { what: String, url: String },
    #[error("{url}: unexpected HTTP {status}")]
    Http { url: String, status: u16 },
    #[error("{url}: the hub's answer is not what was expected: {message}")]
    BadResponse { url: String, message: String },
    #[error("{repo} has no GGUF file for {quant}: expected one of {available}")]
    QuantNotFound {
        repo: String,
        quant: String,
        available: String,
    },
    #[error("{repo} has no GGUF files")]
    NoGguf { repo: String },
    #[error("{repo}: {quant} matches several GGUF files ({matches}): name the quant more exactly")]
    Ambiguous {
        repo: String,
        quant: String,
        matches: String,
    },
    #[error("{repo}: split GGUF {file} has {found} of its {expected} parts on the hub")]
    IncompleteSplit {
        repo: String,
        file: String,
        expected: usize,
        found: usize,
    },
    #[error("{repo}: {file} has no LFS SHA-256 on the hub, so it cannot be verified")]
    NoChecksum { repo: String, file: String },
    #[error("{file}: expected {expected} bytes, the hub sent {found}")]
    SizeMismatch {
        file: String,
        expected: u64,
        found: u64,
    },
    #[error("{file}: checksum mismatch: expected SHA-256 {expected} (the hub's LFS metadata), found {found}; the partial download was deleted")]
    ChecksumMismatch {
        file: String,
        expected: String,
        found: String,
    },
    #[error("{spec} is not in the cache ({}){}", dir.display(), if *offline { " and HF_HUB_OFFLINE is set" } else { "" })]
    NotCached {
        spec: String,
        dir: PathBuf,
        offline: bool,
    },
    #[error("{}: {error}", path.display())]
    Io { path: PathBuf, error: io::Error },
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> HubError + '_ {
    move |error| HubError::Io {
        path: path.to_owned(),
        error,
    }
}

/// Makes sure the model `spec` names is in the cache, fetching and verifying what is missing;
/// the path of its (first) GGUF file in the snapshot. When the hub cannot be reached (or
/// `config.offline`), a cached copy of the same quant is used if there is one.
pub fn pull(
    spec: &HubSpec,
    config: &HubConfig,
    progress: &mut dyn PullProgress,
) -> Result<PathBuf, HubError> {
    let repo_dir = cache::repo_dir(&config.cache_dir, spec);
    if config.offline {
        return cache::find_cached(&repo_dir, spec).ok_or_else(|| HubError::NotCached {
            spec: spec.to_string(),
            dir: config.cache_dir.clone(),
            offline: true,
        });
    }
    let client = api::Client::new(config);
    let info = match client.repo_info(spec) {
        Ok(info) => info,
        Err(e @ HubError::Offline { .. }) => {
            return match cache::find_cached(&repo_dir, spec) {
                Some(path) => {
                    progress.message(&format!("{e}; using the cached copy"));
                    Ok(path)
                }
                None => Err(e),
            };
        }
        Err(e) => return Err(e),
    };
    let files = select::pick(&spec.repo_id(), spec.quant.as_deref(), &info.files)?;
    let total: u64 = files.iter().map(|f| f.size).sum();
    progress.message(&format!(
        "{}: {} at {} ({} file{}, {:.1} MiB)",
        spec.repo_id(),
        files[0].path,
        &info.commit[..info.commit.len().min(12)],
        files.len(),
        if files.len() == 1 { "" } else { "s" },
        total as f64 / (1024.0 * 1024.0)
    ));
    let mut done_before = 0u64;
    let mut first = None;
    for file in &files {
        // Both callbacks report to `progress`, one at a time.
        let progress_cell = std::cell::RefCell::new(&mut *progress);
        let blob = download::fetch_blob(
            &client,
            spec,
            &info.commit,
            file,
            &repo_dir,
            &mut |done| progress_cell.borrow_mut().bytes(done_before + done, total),
            &mut |text| progress_cell.borrow_mut().message(text),
        )?;
        let link = cache::link_snapshot(&repo_dir, &info.commit, &file.path, &blob)?;
        first.get_or_insert(link);
        done_before += file.size;
    }
    cache::write_ref(&repo_dir, "main", &info.commit)?;
    let path = first.expect("select::pick returns at least one file");
    progress.message(&format!("{spec}: verified, {}", path.display()));
    Ok(path)
}
