//! Just enough HTTP/1.1 for the smoke test to talk to the server in the image: one request per
//! connection (`Connection: close`), bodies framed by `Content-Length`, chunked transfer coding, or
//! the end of the connection, and server-sent events read as they arrive. xtask stays free of an
//! HTTP client crate (it is kept cheap to compile); the Python `openai` client does the thorough
//! checks.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// Headers and bodies larger than this are refused: a smoke test reads small answers only.
const MAX_HEADER_BYTES: usize = 64 * 1024;
const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

/// A response whose head has been read; the body is read on demand.
pub struct Response<R> {
    pub status: u16,
    reader: R,
    framing: Framing,
    body_read: usize,
}

#[derive(Debug, PartialEq)]
enum Framing {
    Length(usize),
    Chunked {
        remaining_in_chunk: usize,
        done: bool,
    },
    UntilClose,
}

/// Sends one request to `address` and reads the response head. `body` is sent as JSON.
pub fn request(
    address: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> Result<Response<BufReader<TcpStream>>> {
    let mut stream = TcpStream::connect_timeout(&address, timeout)
        .with_context(|| format!("connecting to {address}"))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\nAccept: */*\r\n"
    );
    if let Some(body) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    head.push_str("\r\n");
    stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(body.unwrap_or_default().as_bytes()))
        .with_context(|| format!("sending {method} {path} to {address}"))?;
    Response::read_head(BufReader::new(stream))
        .with_context(|| format!("reading the answer to {method} {path} from {address}"))
}

/// `GET path`, the whole body as text.
pub fn get(address: SocketAddr, path: &str, timeout: Duration) -> Result<(u16, String)> {
    let response = request(address, "GET", path, None, timeout)?;
    let status = response.status;
    Ok((status, response.text()?))
}

impl<R: BufRead> Response<R> {
    pub fn read_head(mut reader: R) -> Result<Response<R>> {
        let mut head_bytes = 0;
        let status_line = read_line(&mut reader, &mut head_bytes)?;
        let status = parse_status_line(&status_line)?;
        let mut content_length = None;
        let mut chunked = false;
        loop {
            let line = read_line(&mut reader, &mut head_bytes)?;
            if line.is_empty() {
                break;
            }
            let Some((name, value)) = line.split_once(':') else {
                bail!("expected a `name: value` header line, found {line:?}");
            };
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                content_length = Some(value.parse::<usize>().with_context(|| {
                    format!("expected a number in Content-Length, found {value:?}")
                })?);
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                chunked = value
                    .split(',')
                    .any(|coding| coding.trim().eq_ignore_ascii_case("chunked"));
            }
        }
        // Chunked coding takes precedence over a length (RFC 9112, section 6.3).
        let framing = match (chunked, content_length) {
            (true, _) => Framing::Chunked {
                remaining_in_chunk: 0,
                done: false,
            },
            (false, Some(length)) => Framing::Length(length),
            (false, None) => Framing::UntilClose,
        };
        Ok(Response {
            status,
            reader,
            framing,
            body_read: 0,
        })
    }

    /// The next piece of the body as it arrives, or `None` at its end.
    pub fn next_piece(&mut self) -> Result<Option<Vec<u8>>> {
        let piece = match &mut self.framing {
            Framing::Length(remaining) => {
                if *remaining == 0 {
                    return Ok(None);
                }
                let piece = read_some(&mut self.reader, *remaining)?;
                if piece.is_empty() {
                    bail!("the connection closed with {remaining} bytes of the body unread");
                }
                *remaining -= piece.len();
                piece
            }
            Framing::UntilClose => {
                let piece = read_some(&mut self.reader, 64 * 1024)?;
                if piece.is_empty() {
                    return Ok(None);
                }
                piece
            }
            Framing::Chunked {
                remaining_in_chunk,
                done,
            } => {
                if *done {
                    return Ok(None);
                }
                if *remaining_in_chunk == 0 {
                    let mut ignored = 0;
                    let size_line = read_line(&mut self.reader, &mut ignored)?;
                    let size_text = size_line.split(';').next().unwrap_or_default().trim();
                    let size = usize::from_str_radix(size_text, 16).with_context(|| {
                        format!("expected a hexadecimal chunk size, found {size_line:?}")
                    })?;
                    if size == 0 {
                        // Trailer fields, then the blank line that ends the message.
                        while !read_line(&mut self.reader, &mut ignored)?.is_empty() {}
                        *done = true;
                        return Ok(None);
                    }
                    *remaining_in_chunk = size;
                }
                let piece = read_some(&mut self.reader, *remaining_in_chunk)?;
                if piece.is_empty() {
                    bail!("the connection closed inside a chunk");
                }
                *remaining_in_chunk -= piece.len();
                if *remaining_in_chunk == 0 {
                    let mut ignored = 0;
                    let end = read_line(&mut self.reader, &mut ignored)?;
                    if !end.is_empty() {
                        bail!("expected CRLF after a chunk, found {end:?}");
                    }
                }
                piece
            }
        };
        self.body_read += piece.len();
        if self.body_read > MAX_BODY_BYTES {
            bail!("expected a body of at most {MAX_BODY_BYTES} bytes, found more");
        }
        Ok(Some(piece))
    }

    /// The rest of the body as text (invalid UTF-8 replaced).
    pub fn text(mut self) -> Result<String> {
        let mut body = Vec::new();
        while let Some(piece) = self.next_piece()? {
            body.extend_from_slice(&piece);
        }
        Ok(String::from_utf8_lossy(&body).into_owned())
    }
}

fn read_some<R: BufRead>(reader: &mut R, at_most: usize) -> Result<Vec<u8>> {
    let available = reader.fill_buf().context("reading the body")?;
    let take = available.len().min(at_most);
    let piece = available[..take].to_vec();
    reader.consume(take);
    Ok(piece)
}

/// One CRLF- (or LF-) terminated line without its terminator; counts bytes against the head limit.
fn read_line<R: BufRead>(reader: &mut R, head_bytes: &mut usize) -> Result<String> {
    let mut line = Vec::new();
    let limit = (MAX_HEADER_BYTES.saturating_sub(*head_bytes) + 1) as u64;
    reader
        .by_ref()
        .take(limit)
        .read_until(b'\n', &mut line)
        .context("reading the response head")?;
    *head_bytes += line.len();
    if *head_bytes > MAX_HEADER_BYTES {
        bail!("expected a response head of at most {MAX_HEADER_BYTES} bytes, found more");
    }
    if line.last() != Some(&b'\n') {
        bail!(
            "expected a line ending in LF, found the connection closed after {:?}",
            String::from_utf8_lossy(&line)
        );
    }
    line.pop();
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    String::from_utf8(line).context("expected a UTF-8 line in the response head")
}

fn parse_status_line(line: &str) -> Result<u16> {
    let mut parts = line.splitn(3, ' ');
    match (parts.next(), parts.next()) {
        (Some(version), Some(code)) if version.starts_with("HTTP/1.") && code.len() == 3 => code
            .parse()
            .with_context(|| format!("expected a status code, found {line:?}")),
        _ => bail!("expected an HTTP/1.x status line, found {line:?}"),
    }
}

/// Splits a stream of server-sent events into the `data` of each event, as pieces arrive.
#[derive(Default)]
pub struct EventReader {
    buffer: String,
}

impl EventReader {
    /// Adds bytes from the body; returns the data of every event they completed.
    pub fn push(&mut self, piece: &[u8]) -> Vec<String> {
        self.buffer
            .push_str(&String::from_utf8_lossy(piece).replace("\r\n", "\n"));
        let mut events = Vec::new();
        while let Some(end) = self.buffer.find("\n\n") {
            let event: String = self.buffer.drain(..end + 2).collect();
            let data: Vec<&str> = event
                .lines()
                .filter_map(|line| line.strip_prefix("data:"))
                .map(|data| data.strip_prefix(' ').unwrap_or(data))
                .collect();
            // Comment-only events (keep-alives) carry no data.
            if !data.is_empty() {
                events.push(data.join("\n"));
            }
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(raw: &str) -> (u16, Result<String>) {
        let response = Response::read_head(BufReader::new(raw.as_bytes())).unwrap();
        (response.status, response.text())
    }

    #[test]
    fn bodies_by_length_chunks_and_close() {
        let (status, text) = body("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello, and more");
        assert_eq!((status, text.unwrap()), (200, "hello".to_string()));
        let (status, text) = body(
            "HTTP/1.1 503 Service Unavailable\r\ntransfer-encoding: chunked\r\n\r\n4\r\nwait\r\n3;ext=1\r\ning\r\n0\r\nX-Trailer: 1\r\n\r\n",
        );
        assert_eq!((status, text.unwrap()), (503, "waiting".to_string()));
        let (status, text) = body("HTTP/1.0 200 OK\nServer: x\n\nuntil close");
        assert_eq!((status, text.unwrap()), (200, "until close".to_string()));
    }

    #[test]
    fn malformed_answers_are_errors() {
        let head_error = |raw: &str| {
            Response::read_head(BufReader::new(raw.as_bytes()))
                .err()
                .expect("expected an error")
                .to_string()
        };
        assert!(head_error("SSH-2.0-OpenSSH\r\n\r\n").contains("expected an HTTP/1.x status line"));
        assert!(head_error("HTTP/1.1 200 OK\r\nno colon\r\n\r\n").contains("`name: value`"));
        assert!(
            head_error("HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n").contains("Content-Length")
        );
        assert!(head_error("HTTP/1.1 200 OK\r\nServer").contains("connection closed"));
        let (_, text) = body("HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort");
        assert!(text
            .unwrap_err()
            .to_string()
            .contains("5 bytes of the body unread"));
        let (_, text) = body("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n");
        assert!(text
            .unwrap_err()
            .to_string()
            .contains("hexadecimal chunk size"));
    }

    #[test]
    fn events_split_across_pieces() {
        let mut events = EventReader::default();
        assert_eq!(events.push(b"data: {\"a\":"), Vec::<String>::new());
        assert_eq!(
            events.push(b"1}\n\n: keep-alive\n\ndata: [DO"),
            vec!["{\"a\":1}"]
        );
        assert_eq!(events.push(b"NE]\r\n\r\n"), vec!["[DONE]"]);
        assert_eq!(events.push(b"data:x\ndata: y\n\n"), vec!["x\ny"]);
    }
}
