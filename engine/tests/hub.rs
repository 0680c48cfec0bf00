//! `ember pull hf://…` against a fake hub started by the test: a local HTTP server answering the
//! two endpoints ember uses (the repository's files with LFS metadata, and `resolve` with a
//! redirect to a storage URL that honours byte ranges). Covers a normal pull, a connection cut
//! mid-file that resumes, an interrupted pull resumed by the next one, a wrong checksum, 401,
//! 404, split files, the offline fallback, the cache layout, and `ember list`/`rm`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ember::hub::{self, HubConfig, HubError, HubSpec};
use ember::models::PullProgress;
use sha2::{Digest, Sha256};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

struct FakeFile {
    path: String,
    data: Vec<u8>,
    /// The SHA-256 the listing publishes (the real one unless a test corrupts it).
    published_sha256: String,
}

/// What the fake hub serves and what it saw.
struct HubState {
    owner: String,
    repo: String,
    files: Vec<FakeFile>,
    /// A request without `Authorization: Bearer TOKEN` gets 401.
    token: Option<String>,
    /// This many storage downloads are cut after half of their body.
    cuts_left: AtomicUsize,
    /// Once the cuts are used up, storage answers 503 (the storage went down mid-download).
    down_after_cuts: AtomicBool,
    /// "METHOD PATH range=RANGE auth=AUTH" for every request, in order.
    log: Mutex<Vec<String>>,
}

struct FakeHub {
    state: Arc<HubState>,
    endpoint: String,
}

fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// Bytes that differ from file to file and do not compress (a small LCG).
fn contents(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect()
}

fn file(path: &str, seed: u64, len: usize) -> FakeFile {
    let data = contents(seed, len);
    FakeFile {
        path: path.to_string(),
        published_sha256: sha256_hex(&data),
        data,
    }
}

impl FakeHub {
    fn start(files: Vec<FakeFile>, token: Option<&str>, cuts: usize) -> FakeHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(HubState {
            owner: "someone".into(),
            repo: "Tiny-GGUF".into(),
            files,
            token: token.map(str::to_string),
            cuts_left: AtomicUsize::new(cuts),
            down_after_cuts: AtomicBool::new(false),
            log: Mutex::new(Vec::new()),
        });
        let shared = state.clone();
        let base = endpoint.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let state = shared.clone();
                let base = base.clone();
                std::thread::spawn(move || serve(stream, &state, &base));
            }
        });
        FakeHub { state, endpoint }
    }

    fn log(&self) -> Vec<String> {
        self.state.log.lock().unwrap().clone()
    }

    fn storage_requests(&self) -> Vec<String> {
        self.log()
            .into_iter()
            .filter(|l| l.starts_with("GET /storage/"))
            .collect()
    }
}

fn serve(stream: TcpStream, state: &HubState, base: &str) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let range = headers.get("range").cloned().unwrap_or_default();
    let auth = headers.get("authorization").cloned().unwrap_or_default();
    state
        .log
        .lock()
        .unwrap()
        .push(format!("{method} {target} range={range} auth={auth}"));
    let mut out = stream;
    let respond = |out: &mut TcpStream, status: &str, extra: &str, body: &[u8]| {
        let _ = write!(
            out,
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n",
            body.len()
        );
        let _ = out.write_all(body);
    };
    let authorised = match &state.token {
        None => true,
        Some(t) => auth == format!("Bearer {t}"),
    };
    let repo_id = format!("{}/{}", state.owner, state.repo);
    if let Some(rest) = target.strip_prefix("/api/models/") {
        if !authorised {
            return respond(
                &mut out,
                "401 Unauthorized",
                "",
                b"{\"error\":\"unauthorised\"}",
            );
        }
        if rest != format!("{repo_id}/revision/main?blobs=true") {
            return respond(
                &mut out,
                "404 Not Found",
                "",
                b"{\"error\":\"Repository not found\"}",
            );
        }
        let siblings: Vec<serde_json::Value> = state
            .files
            .iter()
            .map(|f| {
                serde_json::json!({
                    "rfilename": f.path,
                    "size": f.data.len(),
                    "blobId": "feedface",
                    "lfs": {"sha256": f.published_sha256, "size": f.data.len(), "pointerSize": 134},
                })
            })
            .collect();
        let body = serde_json::json!({"id": repo_id, "sha": COMMIT, "siblings": siblings});
        return respond(
            &mut out,
            "200 OK",
            "Content-Type: application/json\r\n",
            body.to_string().as_bytes(),
        );
    }
    if let Some(rest) = target.strip_prefix(&format!("/{repo_id}/resolve/{COMMIT}/")) {
        if !authorised {
            return respond(&mut out, "401 Unauthorized", "", b"");
        }
        return match state.files.iter().position(|f| f.path == rest) {
            Some(i) => respond(
                &mut out,
                "302 Found",
                &format!("Location: {base}/storage/{i}\r\n"),
                b"",
            ),
            None => respond(&mut out, "404 Not Found", "", b"Entry not found"),
        };
    }
    if let Some(index) = target.strip_prefix("/storage/") {
        if state.down_after_cuts.load(Ordering::SeqCst)
            && state.cuts_left.load(Ordering::SeqCst) == 0
        {
            return respond(&mut out, "503 Service Unavailable", "", b"");
        }
        let data = &state.files[index.parse::<usize>().unwrap()].data;
        let start = range
            .strip_prefix("bytes=")
            .and_then(|r| r.strip_suffix('-'))
            .and_then(|s| s.parse::<usize>().ok());
        let (status, extra, body) = match start {
            Some(s) if s >= data.len() => {
                return respond(&mut out, "416 Range Not Satisfiable", "", b"");
            }
            Some(s) => (
                "206 Partial Content",
                format!(
                    "Content-Range: bytes {s}-{}/{}\r\n",
                    data.len() - 1,
                    data.len()
                ),
                &data[s..],
            ),
            None => ("200 OK", String::new(), &data[..]),
        };
        let cut = state
            .cuts_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if cut {
            // Promise the whole body, send half, hang up.
            let _ = write!(
                out,
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n",
                body.len()
            );
            let _ = out.write_all(&body[..body.len() / 2]);
            let _ = out.flush();
            return;
        }
        return respond(&mut out, status, &extra, body);
    }
    respond(&mut out, "404 Not Found", "", b"")
}

fn config(endpoint: &str, cache: &Path, token: Option<&str>) -> HubConfig {
    HubConfig {
        endpoint: endpoint.to_string(),
        token: token.map(str::to_string),
        cache_dir: cache.to_owned(),
        offline: false,
        max_attempts: 3,
        retry_delay: Duration::from_millis(10),
    }
}

/// Records the progress a pull reports.
#[derive(Default)]
struct Recorded {
    messages: Vec<String>,
    last_bytes: Option<(u64, u64)>,
}

impl PullProgress for Recorded {
    fn message(&mut self, text: &str) {
        self.messages.push(text.to_string());
    }
    fn bytes(&mut self, done: u64, total: u64) {
        assert!(done <= total, "{done} of {total}");
        self.last_bytes = Some((done, total));
    }
}

fn spec(text: &str) -> HubSpec {
    HubSpec::parse(text).unwrap()
}

fn repo_dir(cache: &Path) -> PathBuf {
    cache.join("models--someone--Tiny-GGUF")
}

fn blobs(cache: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(repo_dir(cache).join("blobs"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn standard_repo() -> Vec<FakeFile> {
    vec![
        file("README.md", 1, 100),
        file("tiny-Q4_K_M.gguf", 2, 300_000),
        file("tiny-Q8_0.gguf", 3, 200_000),
        file("mmproj-tiny-Q4_K_M.gguf", 4, 1000),
    ]
}

#[test]
fn a_pull_stores_the_quant_in_the_huggingface_layout() {
    let hub = FakeHub::start(standard_repo(), Some("secret"), 0);
    let cache = tempfile::tempdir().unwrap();
    let mut progress = Recorded::default();
    let path = hub::pull(
        &spec("hf://someone/Tiny-GGUF"),
        &config(&hub.endpoint, cache.path(), Some("secret")),
        &mut progress,
    )
    .unwrap();
    let wanted = &hub.state.files[1];
    let repo = repo_dir(cache.path());
    assert_eq!(
        path,
        repo.join("snapshots").join(COMMIT).join("tiny-Q4_K_M.gguf")
    );
    assert_eq!(std::fs::read(&path).unwrap(), wanted.data);
    #[cfg(unix)]
    assert_eq!(
        std::fs::read_link(&path).unwrap(),
        Path::new("../../blobs").join(&wanted.published_sha256)
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("refs/main")).unwrap(),
        COMMIT
    );
    // Only the default quant's blob, under its hash; nothing partial left behind.
    assert_eq!(blobs(cache.path()), vec![wanted.published_sha256.clone()]);
    assert_eq!(progress.last_bytes, Some((300_000, 300_000)));
    // The token went to the hub, through the redirect the storage was reached.
    let log = hub.log();
    assert!(
        log[0].starts_with("GET /api/models/someone/Tiny-GGUF/revision/main"),
        "{log:?}"
    );
    assert!(log[0].ends_with("auth=Bearer secret"), "{log:?}");
    assert_eq!(hub.storage_requests().len(), 1, "{log:?}");

    // A second pull finds the blob and downloads nothing.
    let again = hub::pull(
        &spec("hf://someone/Tiny-GGUF:q4_k_m"),
        &config(&hub.endpoint, cache.path(), Some("secret")),
        &mut Recorded::default(),
    )
    .unwrap();
    assert_eq!(again, path);
    assert_eq!(hub.storage_requests().len(), 1);

    // Another quant by name.
    let q8 = hub::pull(
        &spec("hf://someone/Tiny-GGUF:Q8_0"),
        &config(&hub.endpoint, cache.path(), Some("secret")),
        &mut Recorded::default(),
    )
    .unwrap();
    assert_eq!(std::fs::read(q8).unwrap(), hub.state.files[2].data);
    assert_eq!(blobs(cache.path()).len(), 2);
}

#[test]
fn a_cut_connection_resumes_with_a_range_request() {
    let hub = FakeHub::start(standard_repo(), None, 1);
    let cache = tempfile::tempdir().unwrap();
    let path = hub::pull(
        &spec("hf://someone/Tiny-GGUF"),
        &config(&hub.endpoint, cache.path(), None),
        &mut Recorded::default(),
    )
    .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), hub.state.files[1].data);
    let storage = hub.storage_requests();
    assert_eq!(storage.len(), 2, "{storage:?}");
    assert!(storage[0].contains("range= "), "{storage:?}");
    assert!(storage[1].contains("range=bytes=150000-"), "{storage:?}");
}

#[test]
fn an_interrupted_pull_is_resumed_by_the_next_one() {
    // The first pull is cut, then the storage goes down: it gives up, keeping what it got.
    let hub = FakeHub::start(standard_repo(), None, 1);
    hub.state.down_after_cuts.store(true, Ordering::SeqCst);
    let cache = tempfile::tempdir().unwrap();
    let mut cfg = config(&hub.endpoint, cache.path(), None);
    cfg.max_attempts = 1;
    let e = hub::pull(
        &spec("hf://someone/Tiny-GGUF"),
        &cfg,
        &mut Recorded::default(),
    )
    .unwrap_err();
    assert!(matches!(e, HubError::Http { status: 503, .. }), "{e}");
    let sha = &hub.state.files[1].published_sha256;
    let partial = repo_dir(cache.path())
        .join("blobs")
        .join(format!("{sha}.incomplete"));
    assert_eq!(std::fs::metadata(&partial).unwrap().len(), 150_000);
    assert!(!repo_dir(cache.path()).join("snapshots").exists());

    hub.state.down_after_cuts.store(false, Ordering::SeqCst);
    let path = hub::pull(
        &spec("hf://someone/Tiny-GGUF"),
        &config(&hub.endpoint, cache.path(), None),
        &mut Recorded::default(),
    )
    .unwrap();
    assert_eq!(std::fs::read(path).unwrap(), hub.state.files[1].data);
    let storage = hub.storage_requests();
    assert!(
        storage.last().unwrap().contains("range=bytes=150000-"),
        "{storage:?}"
    );
    assert!(!partial.exists());
}

#[test]
fn a_wrong_checksum_is_refused_and_nothing_is_kept() {
    let mut files = standard_repo();
    let real = files[1].published_sha256.clone();
    files[1].published_sha256 = sha256_hex(b"something else");
    let published = files[1].published_sha256.clone();
    let hub = FakeHub::start(files, None, 0);
    let cache = tempfile::tempdir().unwrap();
    let e = hub::pull(
        &spec("hf://someone/Tiny-GGUF"),
        &config(&hub.endpoint, cache.path(), None),
        &mut Recorded::default(),
    )
    .unwrap_err();
    match &e {
        HubError::ChecksumMismatch {
            expected, found, ..
        } => {
            assert_eq!(expected, &published);
            assert_eq!(found, &real);
        }
        other => panic!("expected a checksum mismatch, got {other}"),
    }
    assert!(e.to_string().contains("checksum mismatch"), "{e}");
    assert!(blobs(cache.path()).is_empty(), "{:?}", blobs(cache.path()));
    assert!(!repo_dir(cache.path()).join("snapshots").exists());
}

#[test]
fn unauthorised_and_not_found_say_so() {
    let hub = FakeHub::start(standard_repo(), Some("secret"), 0);
    let cache = tempfile::tempdir().unwrap();
    for token in [None, Some("wrong")] {
        let e = hub::pull(
            &spec("hf://someone/Tiny-GGUF"),
            &config(&hub.endpoint, cache.path(), token),
            &mut Recorded::default(),
        )
        .unwrap_err();
        assert!(
            matches!(e, HubError::Unauthorized { status: 401, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("unauthorised"), "{e}");
    }
    let e = hub::pull(
        &spec("hf://someone/No-Such-Repo"),
        &config(&hub.endpoint, cache.path(), Some("secret")),
        &mut Recorded::default(),
    )
    .unwrap_err();
    assert!(matches!(e, HubError::NotFound { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("repository someone/No-Such-Repo not found"),
        "{e}"
    );
    let e = hub::pull(
        &spec("hf://someone/Tiny-GGUF:Q2_K"),
        &config(&hub.endpoint, cache.path(), Some("secret")),
        &mut Recorded::default(),
    )
    .unwrap_err();
    assert!(matches!(e, HubError::QuantNotFound { .. }), "{e}");
    assert!(
        e.to_string().contains("tiny-Q4_K_M.gguf, tiny-Q8_0.gguf"),
        "{e}"
    );
}

#[test]
fn a_file_missing_behind_the_listing_is_not_found() {
    // The listing names a file that `resolve` does not have (a repository changed meanwhile).
    let hub = FakeHub::start(standard_repo(), None, 0);
    let cache = tempfile::tempdir().unwrap();
    let client_config = config(&hub.endpoint, cache.path(), None);
    let client = ember::hub::api::Client::new(&client_config);
    let e = client
        .get_file(&spec("hf://someone/Tiny-GGUF"), COMMIT, "gone.gguf", 0)
        .err()
        .unwrap();
    assert!(matches!(e, HubError::NotFound { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("gone.gguf in someone/Tiny-GGUF not found"),
        "{e}"
    );
}

#[test]
fn split_files_download_as_a_set() {
    let files = vec![
        file("Q4_K_M/big-Q4_K_M-00002-of-00003.gguf", 12, 70_000),
        file("Q4_K_M/big-Q4_K_M-00001-of-00003.gguf", 11, 90_000),
        file("Q4_K_M/big-Q4_K_M-00003-of-00003.gguf", 13, 50_000),
        file("big-Q8_0.gguf", 14, 1000),
    ];
    let hub = FakeHub::start(files, None, 0);
    let cache = tempfile::tempdir().unwrap();
    let mut progress = Recorded::default();
    let path = hub::pull(
        &spec("hf://someone/Tiny-GGUF"),
        &config(&hub.endpoint, cache.path(), None),
        &mut progress,
    )
    .unwrap();
    let snapshot = repo_dir(cache.path()).join("snapshots").join(COMMIT);
    assert_eq!(path, snapshot.join("Q4_K_M/big-Q4_K_M-00001-of-00003.gguf"));
    for f in &hub.state.files[..3] {
        assert_eq!(
            std::fs::read(snapshot.join(&f.path)).unwrap(),
            f.data,
            "{}",
            f.path
        );
    }
    assert_eq!(blobs(cache.path()).len(), 3);
    assert_eq!(progress.last_bytes, Some((210_000, 210_000)));
    // Parts are fetched in order.
    let order: Vec<String> = hub.storage_requests();
    assert!(order[0].starts_with("GET /storage/1 "), "{order:?}");
    assert!(order[1].starts_with("GET /storage/0 "), "{order:?}");
    assert!(order[2].starts_with("GET /storage/2 "), "{order:?}");
}

#[test]
fn an_unreachable_hub_is_offline_and_the_cache_still_serves() {
    let hub = FakeHub::start(standard_repo(), None, 0);
    let cache = tempfile::tempdir().unwrap();
    let path = hub::pull(
        &spec("hf://someone/Tiny-GGUF"),
        &config(&hub.endpoint, cache.path(), None),
        &mut Recorded::default(),
    )
    .unwrap();
    // A port nothing listens on.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let mut progress = Recorded::default();
    let again = hub::pull(
        &spec("hf://someone/Tiny-GGUF"),
        &config(&dead, cache.path(), None),
        &mut progress,
    )
    .unwrap();
    assert_eq!(again, path);
    assert!(
        progress.messages[0].contains("using the cached copy"),
        "{:?}",
        progress.messages
    );
    let e = hub::pull(
        &spec("hf://someone/Tiny-GGUF:Q8_0"),
        &config(&dead, cache.path(), None),
        &mut Recorded::default(),
    )
    .unwrap_err();
    assert!(matches!(e, HubError::Offline { .. }), "{e}");
    assert!(e.to_string().contains("cannot reach the hub"), "{e}");
    // HF_HUB_OFFLINE: the cache only.
    let mut offline = config(&dead, cache.path(), None);
    offline.offline = true;
    assert_eq!(
        hub::pull(
            &spec("hf://someone/Tiny-GGUF"),
            &offline,
            &mut Recorded::default()
        )
        .unwrap(),
        path
    );
    let e = hub::pull(
        &spec("hf://someone/Tiny-GGUF:Q8_0"),
        &offline,
        &mut Recorded::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("HF_HUB_OFFLINE"), "{e}");
}

#[test]
fn list_and_remove_the_cache() {
    let hub = FakeHub::start(standard_repo(), None, 0);
    let cache = tempfile::tempdir().unwrap();
    for quant in ["Q4_K_M", "Q8_0"] {
        hub::pull(
            &spec(&format!("hf://someone/Tiny-GGUF:{quant}")),
            &config(&hub.endpoint, cache.path(), None),
            &mut Recorded::default(),
        )
        .unwrap();
    }
    let listed = hub::cache::list(cache.path());
    let names: Vec<(&str, &str, u64, bool)> = listed
        .iter()
        .map(|f| (f.repo.as_str(), f.file.as_str(), f.bytes, f.current))
        .collect();
    assert_eq!(
        names,
        vec![
            ("someone/Tiny-GGUF", "tiny-Q4_K_M.gguf", 300_000, true),
            ("someone/Tiny-GGUF", "tiny-Q8_0.gguf", 200_000, true),
        ]
    );
    let removed = hub::cache::remove(cache.path(), &spec("hf://someone/Tiny-GGUF:Q8_0")).unwrap();
    assert_eq!(removed.len(), 2, "{removed:?}");
    assert_eq!(
        blobs(cache.path()),
        vec![hub.state.files[1].published_sha256.clone()]
    );
    let e = hub::cache::remove(cache.path(), &spec("hf://someone/Tiny-GGUF:Q8_0")).unwrap_err();
    assert!(matches!(e, HubError::NotCached { .. }), "{e}");
    hub::cache::remove(cache.path(), &spec("hf://someone/Tiny-GGUF")).unwrap();
    assert!(!repo_dir(cache.path()).exists());
    assert!(hub::cache::list(cache.path()).is_empty());
}

/// The command line: environment variables, messages on a stderr that is not a terminal, the
/// path on stdout, `-hf`, `list`, `rm`, and errors with hints.
#[test]
fn the_command_line_pulls_lists_and_removes() {
    let hub = FakeHub::start(standard_repo(), Some("secret"), 0);
    let home = tempfile::tempdir().unwrap();
    let ember = |args: &[&str], token: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ember"));
        cmd.args(args)
            .env("HF_ENDPOINT", &hub.endpoint)
            .env("HF_HOME", home.path())
            .env("EMBER_MODELS_DIR", home.path().join("ember"))
            .env_remove("HF_HUB_CACHE")
            .env_remove("HF_HUB_OFFLINE")
            .env_remove("HF_TOKEN_PATH");
        match token {
            Some(t) => cmd.env("HF_TOKEN", t),
            None => cmd.env_remove("HF_TOKEN"),
        };
        let out = cmd.output().unwrap();
        (
            out.status.code(),
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
        )
    };
    let (code, stdout, stderr) = ember(&["pull", "hf://someone/Tiny-GGUF"], None);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("unauthorised (HTTP 401)"), "{stderr}");
    assert!(stderr.contains("hint: set HF_TOKEN"), "{stderr}");
    assert!(stdout.is_empty());

    let (code, stdout, stderr) = ember(&["pull", "hf://someone/Tiny-GGUF"], Some("secret"));
    assert_eq!(code, Some(0), "{stderr}");
    let expected = home
        .path()
        .join("hub/models--someone--Tiny-GGUF/snapshots")
        .join(COMMIT)
        .join("tiny-Q4_K_M.gguf");
    assert_eq!(stdout.trim(), expected.display().to_string());
    // The messages reach a stderr that is not a terminal.
    assert!(
        stderr.contains("someone/Tiny-GGUF: tiny-Q4_K_M.gguf at 0123456789ab"),
        "{stderr}"
    );
    assert!(stderr.contains("verified"), "{stderr}");

    // The token file `huggingface-cli login` writes is read when HF_TOKEN is not set.
    std::fs::write(home.path().join("token"), "secret\n").unwrap();
    let (code, _, stderr) = ember(&["pull", "hf://someone/Tiny-GGUF:Q8_0"], None);
    assert_eq!(code, Some(0), "{stderr}");
    std::fs::remove_file(home.path().join("token")).unwrap();

    let (code, stdout, stderr) = ember(&["list"], None);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.contains("hf://someone/Tiny-GGUF  tiny-Q4_K_M.gguf"),
        "{stdout}"
    );
    assert!(
        stdout.contains("hf://someone/Tiny-GGUF  tiny-Q8_0.gguf"),
        "{stdout}"
    );

    let (code, stdout, stderr) = ember(&["rm", "hf://someone/Tiny-GGUF:Q8_0"], None);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("tiny-Q8_0.gguf"), "{stdout}");
    let (_, stdout, _) = ember(&["list"], None);
    assert!(!stdout.contains("Q8_0"), "{stdout}");

    // `-hf` resolves through the cache and the model loads as far as its contents allow (the
    // fake file is not a GGUF).
    let (code, _, stderr) = ember(&["info", "-hf", "someone/Tiny-GGUF"], Some("secret"));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("tiny-Q4_K_M.gguf"), "{stderr}");

    let (code, _, stderr) = ember(&["pull", "hf://someone/Nope"], Some("secret"));
    assert_eq!(code, Some(1));
    assert!(
        stderr.contains("repository someone/Nope not found"),
        "{stderr}"
    );
    assert!(stderr.contains("hint: check OWNER/REPO"), "{stderr}");
    let (code, _, stderr) = ember(&["pull", "hf://no-slash"], None);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("expected OWNER/REPO"), "{stderr}");
}

#[test]
fn specs_parse_as_llama_cpp_spells_them() {
    let s = HubSpec::parse("hf://bartowski/SmolLM2-135M-Instruct-GGUF:q4_k_m").unwrap();
    assert_eq!(s.repo_id(), "bartowski/SmolLM2-135M-Instruct-GGUF");
    assert_eq!(s.quant.as_deref(), Some("Q4_K_M"));
    assert_eq!(
        s.to_string(),
        "hf://bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M"
    );
    let s = HubSpec::parse("owner/repo").unwrap();
    assert_eq!((s.quant, s.owner.as_str()), (None, "owner"));
    for bad in [
        "hf://",
        "hf://x",
        "hf://a/b:",
        "hf://../b",
        "hf://a/b/c",
        "hf://a/b:Q4 K",
    ] {
        assert!(HubSpec::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn a_hash_that_is_not_hex_is_refused_before_it_names_a_file() {
    for bad in ["../../../outside", "zz", &"g".repeat(64), &"a".repeat(63)] {
        let mut files = standard_repo();
        files[1].published_sha256 = bad.to_string();
        let hub = FakeHub::start(files, None, 0);
        let cache = tempfile::tempdir().unwrap();
        let e = hub::pull(
            &spec("hf://someone/Tiny-GGUF"),
            &config(&hub.endpoint, cache.path(), None),
            &mut Recorded::default(),
        )
        .unwrap_err();
        assert!(matches!(e, HubError::BadResponse { .. }), "{e}");
        let text = e.to_string();
        assert!(
            text.contains(&format!(
                "expected the LFS SHA-256 of tiny-Q4_K_M.gguf as 64 hex digits, found {bad:?}"
            )),
            "{text}"
        );
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(hub.storage_requests().is_empty());
        // Nothing was written anywhere: not in the cache, not beside it.
        let entries: Vec<_> = std::fs::read_dir(cache.path()).unwrap().flatten().collect();
        assert!(entries.is_empty(), "{entries:?}");
    }
}

/// Holds the lock a pull of `sha256` takes, as another pull (or huggingface_hub) would.
fn hold_blob_lock(cache: &Path, sha256: &str) -> std::fs::File {
    let path = hub::download::lock_path(&repo_dir(cache), sha256);
    assert_eq!(
        path,
        cache
            .join(".locks/models--someone--Tiny-GGUF")
            .join(format!("{sha256}.lock"))
    );
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let lock = std::fs::File::create(&path).unwrap();
    lock.lock().unwrap();
    lock
}

/// Starts a pull in a thread; its result and progress come back through the handle.
fn pull_in_thread(
    endpoint: &str,
    cache: &Path,
) -> std::thread::JoinHandle<(Result<PathBuf, HubError>, Recorded)> {
    let cfg = config(endpoint, cache, None);
    std::thread::spawn(move || {
        let mut progress = Recorded::default();
        let result = hub::pull(&spec("hf://someone/Tiny-GGUF"), &cfg, &mut progress);
        (result, progress)
    })
}

#[test]
fn a_pull_waits_while_another_writes_the_same_blob() {
    let hub = FakeHub::start(standard_repo(), None, 0);
    let cache = tempfile::tempdir().unwrap();
    let sha = hub.state.files[1].published_sha256.clone();
    let lock = hold_blob_lock(cache.path(), &sha);
    let pull = pull_in_thread(&hub.endpoint, cache.path());
    // While the lock is held the pull downloads nothing and writes no partial file.
    std::thread::sleep(Duration::from_millis(500));
    assert!(!pull.is_finished());
    assert!(hub.storage_requests().is_empty(), "{:?}", hub.log());
    assert!(blobs(cache.path()).is_empty(), "{:?}", blobs(cache.path()));
    drop(lock);
    let (result, progress) = pull.join().unwrap();
    let path = result.unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), hub.state.files[1].data);
    assert_eq!(hub.storage_requests().len(), 1);
    assert!(
        progress.messages.iter().any(|m| m
            .starts_with("tiny-Q4_K_M.gguf: another pull is downloading it (lock ")
            && m.ends_with("); waiting")),
        "{:?}",
        progress.messages
    );
}

#[test]
fn a_pull_that_waited_takes_the_blob_the_other_finished() {
    let hub = FakeHub::start(standard_repo(), None, 0);
    let cache = tempfile::tempdir().unwrap();
    let wanted = &hub.state.files[1];
    let lock = hold_blob_lock(cache.path(), &wanted.published_sha256);
    let pull = pull_in_thread(&hub.endpoint, cache.path());
    std::thread::sleep(Duration::from_millis(300));
    // The other writer finishes: the blob appears under its final name, then the lock goes.
    let blob_dir = repo_dir(cache.path()).join("blobs");
    std::fs::create_dir_all(&blob_dir).unwrap();
    let tmp = blob_dir.join("other-writer.tmp");
    std::fs::write(&tmp, &wanted.data).unwrap();
    std::fs::rename(&tmp, blob_dir.join(&wanted.published_sha256)).unwrap();
    drop(lock);
    let (result, _) = pull.join().unwrap();
    assert_eq!(std::fs::read(result.unwrap()).unwrap(), wanted.data);
    assert!(hub.storage_requests().is_empty(), "{:?}", hub.log());
}

#[test]
fn concurrent_pulls_of_one_file_download_it_once() {
    let hub = FakeHub::start(standard_repo(), None, 0);
    let cache = tempfile::tempdir().unwrap();
    let sha = hub.state.files[1].published_sha256.clone();
    // Held until every pull has started, so they all meet at the lock.
    let lock = hold_blob_lock(cache.path(), &sha);
    let pulls: Vec<_> = (0..4)
        .map(|_| pull_in_thread(&hub.endpoint, cache.path()))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    drop(lock);
    for pull in pulls {
        let (result, _) = pull.join().unwrap();
        assert_eq!(
            std::fs::read(result.unwrap()).unwrap(),
            hub.state.files[1].data
        );
    }
    assert_eq!(hub.storage_requests().len(), 1, "{:?}", hub.log());
    assert_eq!(blobs(cache.path()), vec![sha]);
}

/// A blob of the wrong size under its final name (cut short by another tool, say) is replaced by
/// a rename, never rewritten: a process that has the old file open or mapped keeps its contents.
#[cfg(unix)]
#[test]
fn a_bad_blob_is_replaced_by_a_rename_not_rewritten() {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;

    let hub = FakeHub::start(standard_repo(), None, 0);
    let cache = tempfile::tempdir().unwrap();
    let wanted = &hub.state.files[1];
    let blob_dir = repo_dir(cache.path()).join("blobs");
    std::fs::create_dir_all(&blob_dir).unwrap();
    let blob = blob_dir.join(&wanted.published_sha256);
    let old_contents = b"a short file that is not the blob".to_vec();
    std::fs::write(&blob, &old_contents).unwrap();
    let mut reader = std::fs::File::open(&blob).unwrap();
    let old_inode = reader.metadata().unwrap().ino();

    let path = hub::pull(
        &spec("hf://someone/Tiny-GGUF"),
        &config(&hub.endpoint, cache.path(), None),
        &mut Recorded::default(),
    )
    .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), wanted.data);
    assert_ne!(std::fs::metadata(&blob).unwrap().ino(), old_inode);
    let mut seen = Vec::new();
    reader.read_to_end(&mut seen).unwrap();
    assert_eq!(seen, old_contents, "the open file kept its contents");
    // Pulling again relinks the snapshot by a rename too: the old link's target is untouched.
    let link_inode = std::fs::symlink_metadata(&path).unwrap().ino();
    hub::pull(
        &spec("hf://someone/Tiny-GGUF"),
        &config(&hub.endpoint, cache.path(), None),
        &mut Recorded::default(),
    )
    .unwrap();
    assert_ne!(std::fs::symlink_metadata(&path).unwrap().ino(), link_inode);
    assert_eq!(std::fs::read(&path).unwrap(), wanted.data);
    // No temporary names are left in the snapshot or refs.
    for dir in [
        repo_dir(cache.path()).join("snapshots").join(COMMIT),
        repo_dir(cache.path()).join("refs"),
    ] {
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
    }
}
