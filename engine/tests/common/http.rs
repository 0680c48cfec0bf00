//! Helpers for testing `ember serve` as a client would: start the real binary, read the port it
//! bound from its stderr, and talk raw HTTP/1.1 over `std::net::TcpStream` (raw so that tests can
//! send what no client library would: broken JSON, invalid UTF-8, oversized bodies, dropped
//! connections).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long a server gets to print its port and load the model.
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// Read timeout of a client socket: a test fails rather than hangs on a server that stops
/// answering.
const READ_TIMEOUT: Duration = Duration::from_secs(120);

/// A running `ember serve`, killed when dropped.
pub struct ServerProcess {
    child: Child,
    pub port: u16,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl ServerProcess {
    /// Starts `ember serve -m MODEL --port 0 --device cpu -t 2` plus `args` (`--device cpu`
    /// only when `args` name no device), with `env` set, and waits for `listening on
    /// http://...`.
    pub fn start(model: &Path, args: &[&str], env: &[(&str, &str)]) -> ServerProcess {
        let mut command = Command::new(env!("CARGO_BIN_EXE_ember"));
        command
            .arg("serve")
            .arg("-m")
            .arg(model)
            .args(["--port", "0", "-t", "2"]);
        if !args.contains(&"--device") {
            command.args(["--device", "cpu"]);
        }
        command
            .args(args)
            .env_remove("EMBER_API_KEY")
            .env_remove("EMBER_FAULT_STALL_STEP")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().expect("start ember serve");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let (port_sender, port_receiver) = std::sync::mpsc::channel();
        let pipe = child.stderr.take().expect("stderr pipe");
        let lines = Arc::clone(&stderr);
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                if let Some(address) = line.strip_prefix("listening on http://") {
                    let port = address
                        .rsplit(':')
                        .next()
                        .and_then(|p| p.trim().parse::<u16>().ok());
                    let _ = port_sender.send(port);
                }
                lines.lock().unwrap().push(line);
            }
        });
        let port = match port_receiver.recv_timeout(START_TIMEOUT) {
            Ok(Some(port)) => port,
            _ => {
                let _ = child.kill();
                panic!(
                    "ember serve did not print its port; stderr:\n{}",
                    stderr.lock().unwrap().join("\n")
                );
            }
        };
        ServerProcess {
            child,
            port,
            stderr,
        }
    }

    /// [`ServerProcess::start`], then waits until `/health` answers 200.
    pub fn start_ready(model: &Path, args: &[&str], env: &[(&str, &str)]) -> ServerProcess {
        let server = ServerProcess::start(model, args, env);
        server.wait_healthy(START_TIMEOUT);
        server
    }

    /// Polls `/health` until it answers 200.
    pub fn wait_healthy(&self, limit: Duration) {
        let start = Instant::now();
        loop {
            if let Ok(response) = try_request(self.port, "GET", "/health", &[], b"") {
                if response.status == 200 {
                    return;
                }
            }
            assert!(
                start.elapsed() < limit,
                "/health did not answer 200 within {limit:?}; stderr:\n{}",
                self.stderr_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends a signal (`libc::SIGTERM`, ...).
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on the pid of a child this process started and has not reaped.
        let result = unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        assert_eq!(result, 0, "kill({}, {signal}) failed", self.child.id());
    }

    /// Waits for the process to exit, at most `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if start.elapsed() > limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Resident memory of the process in KiB, from /proc.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("read /proc/PID/status");
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/PID/status")
    }

    /// Everything the server printed on stderr so far.
    pub fn stderr_text(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    pub fn get(&self, path: &str) -> Response {
        request(self.port, "GET", path, &[], b"")
    }

    pub fn post_json(&self, path: &str, body: &Value) -> Response {
        request(
            self.port,
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        )
    }

    /// The `/metrics` series, by their full name with labels (`ember_kv_blocks{state="used"}`).
    pub fn metrics(&self) -> BTreeMap<String, f64> {
        let response = self.get("/metrics");
        assert_eq!(response.status, 200, "{}", response.text());
        parse_metrics(&response.text())
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Parses Prometheus text into series → value.
pub fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .filter_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// An HTTP response, read whole.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Header names in lower case.
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("response body is not JSON ({e}): {}", self.text()))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }
}

fn connect(port: u16) -> std::io::Result<TcpStream> {
    let stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(READ_TIMEOUT))?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// The bytes of a request with `Connection: close` and a Content-Length.
pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// Reads a status line and headers.
fn read_head(
    reader: &mut BufReader<TcpStream>,
) -> std::io::Result<(u16, BTreeMap<String, String>)> {
    let mut status_line = String::new();
    reader.read_line(&mut status_line)?;
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line {status_line:?}")))?;
    let mut headers = BTreeMap::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_string());
        }
    }
    Ok((status, headers))
}

/// Reads one chunk of a chunked body; `None` at the last chunk.
fn read_chunk(reader: &mut BufReader<TcpStream>) -> std::io::Result<Option<Vec<u8>>> {
    let mut size_line = String::new();
    if reader.read_line(&mut size_line)? == 0 {
        return Err(std::io::Error::other(
            "connection closed inside a chunked body",
        ));
    }
    let size_text = size_line.trim().split(';').next().unwrap_or("");
    let size = usize::from_str_radix(size_text, 16)
        .map_err(|_| std::io::Error::other(format!("bad chunk size {size_line:?}")))?;
    let mut chunk = vec![0; size];
    reader.read_exact(&mut chunk)?;
    let mut crlf = [0; 2];
    reader.read_exact(&mut crlf)?;
    Ok((size > 0).then_some(chunk))
}

/// Sends a request and reads the whole response.
pub fn try_request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Response> {
    let stream = connect(port)?;
    send_and_read(stream, &request_bytes(method, path, headers, body))
}

/// Writes raw request bytes and reads the whole response.
pub fn send_and_read(mut stream: TcpStream, bytes: &[u8]) -> std::io::Result<Response> {
    stream.write_all(bytes)?;
    let mut reader = BufReader::new(stream);
    let (status, headers) = read_head(&mut reader)?;
    let mut body = Vec::new();
    if headers
        .get("transfer-encoding")
        .is_some_and(|t| t.contains("chunked"))
    {
        while let Some(chunk) = read_chunk(&mut reader)? {
            body.extend_from_slice(&chunk);
        }
    } else if let Some(length) = headers.get("content-length") {
        let length: usize = length
            .parse()
            .map_err(|_| std::io::Error::other("bad content-length"))?;
        body.resize(length, 0);
        reader.read_exact(&mut body)?;
    } else {
        reader.read_to_end(&mut body)?;
    }
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// [`try_request`], failing the test on a transport error.
pub fn request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    try_request(port, method, path, headers, body)
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// A server-sent event stream being read.
pub struct EventStream {
    reader: BufReader<TcpStream>,
    pub status: u16,
    pub headers: BTreeMap<String, String>,
    /// Body bytes read but not yet split into events.
    pending: Vec<u8>,
    ended: bool,
}

impl EventStream {
    /// POSTs `body` to `path` and reads the response head. A non-200 answer's body is in
    /// [`EventStream::rest`].
    pub fn open(port: u16, path: &str, body: &Value, headers: &[(&str, &str)]) -> EventStream {
        let mut all_headers = vec![("Content-Type", "application/json")];
        all_headers.extend_from_slice(headers);
        let mut stream = connect(port).expect("connect");
        stream
            .write_all(&request_bytes(
                "POST",
                path,
                &all_headers,
                body.to_string().as_bytes(),
            ))
            .expect("send request");
        let mut reader = BufReader::new(stream);
        let (status, headers) = read_head(&mut reader).expect("response head");
        EventStream {
            reader,
            status,
            headers,
            pending: Vec::new(),
            ended: false,
        }
    }

    fn fill(&mut self) -> bool {
        if self.ended {
            return false;
        }
        match read_chunk(&mut self.reader) {
            Ok(Some(chunk)) => {
                self.pending.extend_from_slice(&chunk);
                true
            }
            Ok(None) => {
                self.ended = true;
                false
            }
            Err(e) => panic!("reading the event stream: {e}"),
        }
    }

    /// The next `data:` payload (comment lines skipped); `None` at the end of the body.
    pub fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = self.pending.drain(..end + 2).collect();
                let text = String::from_utf8(event).expect("events are UTF-8");
                let data: Vec<&str> = text
                    .lines()
                    .filter_map(|line| line.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                if data.is_empty() {
                    continue;
                }
                return Some(data.join("\n"));
            }
            if !self.fill() {
                return None;
            }
        }
    }

    /// Every remaining `data:` payload, up to and including `[DONE]`.
    pub fn collect_all(&mut self) -> Vec<String> {
        let mut all = Vec::new();
        while let Some(data) = self.next_data() {
            all.push(data);
        }
        all
    }

    /// The rest of a non-streaming body (an error answer).
    pub fn rest(&mut self) -> Vec<u8> {
        let mut body = std::mem::take(&mut self.pending);
        if self
            .headers
            .get("transfer-encoding")
            .is_some_and(|t| t.contains("chunked"))
        {
            while self.fill() {
                body.extend(std::mem::take(&mut self.pending));
            }
        } else {
            let _ = self.reader.read_to_end(&mut body);
        }
        body
    }
}
