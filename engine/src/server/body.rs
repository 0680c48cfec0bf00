//! Reading request bodies: the size limit, the content type and JSON parsing, all answered with
//! OpenAI error objects (axum's own extractors would answer some of these in plain text).
//!
//! A body over the limit is still read through, up to a bound, before the 413 goes out: a server
//! that answers and closes while the client is still sending makes the kernel reset the
//! connection, and the client then often loses the answer (the reason HTTP servers "linger" on
//! close). Past the bound the connection is closed.

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, HeaderMap};
use futures_util::StreamExt;
use serde_json::Value;

use super::error::ApiError;

/// The default body limit (llama-server and vLLM take larger bodies than OpenAI's limits need;
/// 16 MiB holds a full 128k-token context as text with room to spare).
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;

/// How much of an oversized body is read and thrown away before answering, beyond the limit.
const DISCARD_BYTES: usize = 64 << 20;
/// How long an oversized body is read for before answering anyway.
const DISCARD_TIME: Duration = Duration::from_secs(5);

/// Whether a Content-Type can hold a JSON body. Absent is taken as JSON, and so is
/// `application/x-www-form-urlencoded`, which is what `curl -d` sends unless told otherwise
/// (llama-server and ollama read such bodies as JSON too); types that clearly say something
/// else are refused.
fn json_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let text = value.to_str().unwrap_or("");
    let essence = text
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let accepted = essence == "application/json"
        || essence == "application/x-www-form-urlencoded"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
        || essence.is_empty();
    if accepted {
        Ok(())
    } else {
        Err(ApiError::unsupported_media_type(text))
    }
}

/// Reads the rest of an oversized body (bounded) and returns the 413.
async fn refuse_oversized(
    mut stream: axum::body::BodyDataStream,
    already_read: usize,
    limit: usize,
) -> ApiError {
    let start = Instant::now();
    let mut read = already_read;
    loop {
        if read > limit + DISCARD_BYTES || start.elapsed() > DISCARD_TIME {
            return ApiError::body_too_large(limit, true);
        }
        let remaining = DISCARD_TIME.saturating_sub(start.elapsed());
        match tokio::time::timeout(remaining, stream.next()).await {
            Ok(Some(Ok(chunk))) => read += chunk.len(),
            Ok(None) => return ApiError::body_too_large(limit, false),
            Ok(Some(Err(_))) | Err(_) => return ApiError::body_too_large(limit, true),
        }
    }
}

/// The body as bytes, at most `limit` of them.
pub async fn read_bytes(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<Vec<u8>, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let mut stream = body.into_data_stream();
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(refuse_oversized(stream, 0, limit).await);
    }
    let mut bytes = Vec::with_capacity(declared.map_or(0, |n| n as usize));
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            ApiError::bad_request(format!("the request body could not be read: {e}"))
        })?;
        if bytes.len() + chunk.len() > limit {
            let read = bytes.len() + chunk.len();
            return Err(refuse_oversized(stream, read, limit).await);
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

/// The body as a JSON value: content type checked, size limited, syntax and UTF-8 checked.
pub async fn read_json(headers: &HeaderMap, body: Body, limit: usize) -> Result<Value, ApiError> {
    json_content_type(headers)?;
    let bytes = read_bytes(headers, body, limit).await?;
    parse_json(&bytes)
}

/// Parses a body, with errors that say what is wrong and where.
pub fn parse_json(bytes: &[u8]) -> Result<Value, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(
            "the request body is empty: expected a JSON object",
        ));
    }
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(content_type: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(t) = content_type {
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_str(t).unwrap());
        }
        headers
    }

    #[test]
    fn content_types() {
        for ok in [
            None,
            Some("application/json"),
            Some("application/json; charset=utf-8"),
            Some("Application/JSON"),
            Some("application/x-www-form-urlencoded"),
            Some("application/merge-patch+json"),
        ] {
            assert!(json_content_type(&headers(ok)).is_ok(), "{ok:?}");
        }
        for bad in [
            "text/plain",
            "multipart/form-data; boundary=x",
            "application/xml",
        ] {
            let error = json_content_type(&headers(Some(bad))).unwrap_err();
            assert_eq!(error.status, axum::http::StatusCode::UNSUPPORTED_MEDIA_TYPE);
            assert!(error.message.contains(bad), "{}", error.message);
        }
    }

    #[test]
    fn json_errors_are_400s_that_say_why() {
        let empty = parse_json(b"  ").unwrap_err();
        assert_eq!(
            empty.message,
            "the request body is empty: expected a JSON object"
        );
        let broken = parse_json(b"{\"messages\": [").unwrap_err();
        assert!(
            broken
                .message
                .starts_with("the request body is not valid JSON: EOF"),
            "{}",
            broken.message
        );
        let utf8 = parse_json(b"{\"prompt\": \"\xff\xfe\"}").unwrap_err();
        assert_eq!(utf8.status, axum::http::StatusCode::BAD_REQUEST);
        assert!(utf8.message.contains("not valid JSON"), "{}", utf8.message);
        assert!(parse_json(b"{\"a\": 1}").is_ok());
    }

    #[tokio::test]
    async fn bodies_over_the_limit_are_413() {
        let body = Body::from(vec![b' '; 100]);
        let error = read_bytes(&HeaderMap::new(), body, 10).await.unwrap_err();
        assert_eq!(error.status, axum::http::StatusCode::PAYLOAD_TOO_LARGE);
        assert!(
            !error.close_connection,
            "a body read through keeps the connection"
        );
        let mut declared = HeaderMap::new();
        declared.insert(header::CONTENT_LENGTH, HeaderValue::from(100));
        let error = read_bytes(&declared, Body::from(vec![b' '; 100]), 10)
            .await
            .unwrap_err();
        assert_eq!(error.status, axum::http::StatusCode::PAYLOAD_TOO_LARGE);
        let fits = read_bytes(&HeaderMap::new(), Body::from("{}"), 10)
            .await
            .unwrap();
        assert_eq!(fits, b"{}");
    }
}
