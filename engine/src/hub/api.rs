//! The two hub endpoints ember uses, over a blocking HTTP client (ureq with rustls):
//! the repository's files with their LFS metadata, and a file's contents (with a byte range).

use std::io::Read;
use std::time::Duration;

use serde::Deserialize;

use super::{HubConfig, HubError, HubSpec};

/// A repository at one commit: its files as the hub lists them.
#[derive(Debug, Clone)]
pub struct RepoInfo {
    /// The commit `main` points at; files are fetched at this commit so a set stays consistent.
    pub commit: String,
    pub files: Vec<RepoFile>,
}

/// One file of a repository.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoFile {
    /// Path inside the repository (`Q4_K_M/model-Q4_K_M-00001-of-00002.gguf`).
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// SHA-256 of the contents (lower-case hex) from the LFS metadata; `None` for files kept in
    /// git itself.
    pub sha256: Option<String>,
}

#[derive(Deserialize)]
struct InfoJson {
    sha: Option<String>,
    #[serde(default)]
    siblings: Vec<SiblingJson>,
}

#[derive(Deserialize)]
struct SiblingJson {
    rfilename: String,
    size: Option<u64>,
    lfs: Option<LfsJson>,
}

#[derive(Deserialize)]
struct LfsJson {
    sha256: String,
    size: u64,
}

/// Whether `text` is a SHA-256 in hex (64 hex digits).
pub fn is_sha256_hex(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The JSON answer is small (a file list); a larger one is refused rather than read.
const MAX_INFO_BYTES: u64 = 16 << 20;

/// A connection to the hub.
pub struct Client<'a> {
    config: &'a HubConfig,
    agent: ureq::Agent,
}

/// A file's body as it starts to arrive.
pub struct FileResponse {
    /// HTTP status: 200 (the whole file) or 206 (from the range's start).
    pub status: u16,
    /// Where the body starts in the file.
    pub start: u64,
    pub body: Box<dyn Read + Send + Sync + 'static>,
}

impl<'a> Client<'a> {
    pub fn new(config: &'a HubConfig) -> Client<'a> {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(30))
            .timeout_read(Duration::from_secs(60))
            .redirects(8)
            .user_agent(concat!("ember/", env!("CARGO_PKG_VERSION")))
            .build();
        Client { config, agent }
    }

    /// The configuration this client was made with.
    pub fn config(&self) -> &HubConfig {
        self.config
    }

    fn get(&self, url: &str) -> ureq::Request {
        let request = self.agent.get(url);
        match &self.config.token {
            Some(token) => request.set("Authorization", &format!("Bearer {token}")),
            None => request,
        }
    }

    /// The files of `spec`'s repository at `main`, with sizes and LFS SHA-256s.
    pub fn repo_info(&self, spec: &HubSpec) -> Result<RepoInfo, HubError> {
        let url = format!(
            "{}/api/models/{}/revision/main?blobs=true",
            self.config.endpoint,
            spec.repo_id()
        );
        let response = self
            .get(&url)
            .call()
            .map_err(|e| self.error(e, &url, &format!("repository {}", spec.repo_id())))?;
        let mut text = String::new();
        response
            .into_reader()
            .take(MAX_INFO_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|e| HubError::Network {
                url: url.clone(),
                message: e.to_string(),
            })?;
        if text.len() as u64 > MAX_INFO_BYTES {
            return Err(HubError::BadResponse {
                url,
                message: format!("expected at most {MAX_INFO_BYTES} bytes of JSON"),
            });
        }
        let info: InfoJson = serde_json::from_str(&text).map_err(|e| HubError::BadResponse {
            url: url.clone(),
            message: e.to_string(),
        })?;
        let commit = info
            .sha
            .filter(|c| {
                !c.is_empty() && c.len() <= 64 && c.chars().all(|ch| ch.is_ascii_hexdigit())
            })
            .ok_or_else(|| HubError::BadResponse {
                url: url.clone(),
                message: "expected a commit id (\"sha\") in hex".into(),
            })?;
        let files = info
            .siblings
            .into_iter()
            .map(|s| {
                let (size, sha256) = match s.lfs {
                    Some(lfs) => (lfs.size, Some(lfs.sha256.to_ascii_lowercase())),
                    None => (s.size.unwrap_or(0), None),
                };
                // The hash names the blob's file in the cache: anything but a SHA-256 in hex
                // (a path, say) is refused before it reaches a file name.
                if let Some(sha256) = sha256.as_deref().filter(|h| !is_sha256_hex(h)) {
                    return Err(HubError::BadResponse {
                        url: url.clone(),
                        message: format!(
                            "expected the LFS SHA-256 of {} as 64 hex digits, found {:?}",
                            s.rfilename,
                            sha256.chars().take(80).collect::<String>()
                        ),
                    });
                }
                Ok(RepoFile {
                    path: s.rfilename,
                    size,
                    sha256,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(RepoInfo { commit, files })
    }

    /// Starts downloading `file` at `commit` from byte `start` (a range request when `start` is
    /// not 0). The hub answers with a redirect to its storage, which is followed.
    pub fn get_file(
        &self,
        spec: &HubSpec,
        commit: &str,
        file: &str,
        start: u64,
    ) -> Result<FileResponse, HubError> {
        let url = format!(
            "{}/{}/resolve/{commit}/{}",
            self.config.endpoint,
            spec.repo_id(),
            file
        );
        let mut request = self.get(&url);
        if start > 0 {
            request = request.set("Range", &format!("bytes={start}-"));
        }
        let response = match request.call() {
            Ok(r) => r,
            // The range starts at the end: nothing left to fetch.
            Err(ureq::Error::Status(416, _)) if start > 0 => {
                return Ok(FileResponse {
                    status: 206,
                    start,
                    body: Box::new(std::io::empty()),
                })
            }
            Err(e) => return Err(self.error(e, &url, &format!("{} in {}", file, spec.repo_id()))),
        };
        let status = response.status();
        let body_start = match status {
            200 => 0,
            206 => {
                // "bytes START-END/TOTAL": the body must start where it was asked to.
                let range = response.header("Content-Range").unwrap_or("");
                let found = range
                    .strip_prefix("bytes ")
                    .and_then(|r| r.split('-').next())
                    .and_then(|s| s.trim().parse::<u64>().ok());
                if found != Some(start) {
                    return Err(HubError::BadResponse {
                        url,
                        message: format!(
                            "asked for bytes from {start}, got Content-Range {range:?}"
                        ),
                    });
                }
                start
            }
            other => return Err(HubError::Http { url, status: other }),
        };
        Ok(FileResponse {
            status,
            start: body_start,
            body: Box::new(response.into_reader()),
        })
    }

    fn error(&self, e: ureq::Error, url: &str, what: &str) -> HubError {
        match e {
            ureq::Error::Status(401 | 403, response) => HubError::Unauthorized {
                url: url.to_string(),
                status: response.status(),
            },
            ureq::Error::Status(404, _) => HubError::NotFound {
                what: what.to_string(),
                url: url.to_string(),
            },
            ureq::Error::Status(status, _) => HubError::Http {
                url: url.to_string(),
                status,
            },
            ureq::Error::Transport(t) => match t.kind() {
                ureq::ErrorKind::Dns | ureq::ErrorKind::ConnectionFailed => HubError::Offline {
                    endpoint: self.config.endpoint.clone(),
                    message: t.to_string(),
                },
                _ => HubError::Network {
                    url: url.to_string(),
                    message: t.to_string(),
                },
            },
        }
    }
}
