//! Errors as HTTP responses: every error the server sends is OpenAI's error object
//! (`{"error": {"message", "type", "param", "code"}}`) with a matching status code, and 429 and 503
//! carry `Retry-After`. Clients written against OpenAI, vLLM or llama-server read these without
//! special cases; the `type` strings are llama-server's, the `code` strings OpenAI's where it has
//! one.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::engine::SubmitError;

/// Seconds a client should wait before retrying when the queue is full.
pub const RETRY_AFTER_QUEUE_FULL_SECONDS: u64 = 1;
/// Seconds a client should wait before retrying while the model loads.
pub const RETRY_AFTER_LOADING_SECONDS: u64 = 5;
/// Seconds a client should wait before retrying while the server drains (another replica, or this
/// one restarted, will answer by then).
pub const RETRY_AFTER_DRAINING_SECONDS: u64 = 10;

/// An error answer: status, OpenAI error object, and the headers that go with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `rate_limit_error`, `unavailable_error` or `server_error`.
    pub kind: &'static str,
    /// The request field at fault, as a path (`messages[2].content`), when one is.
    pub param: Option<String>,
    /// A machine-readable reason (`model_not_found`, `context_length_exceeded`, ...).
    pub code: Option<&'static str>,
    /// `Retry-After` in seconds.
    pub retry_after: Option<u64>,
    /// Ask the client to close the connection (after a body too large to read through).
    pub close_connection: bool,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
            close_connection: false,
        }
    }

    /// 400: a value the server cannot accept, naming the field.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.into()),
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// 400: a field ember does not implement, naming it.
    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some("unsupported_parameter"),
            ..ApiError::invalid(param, message)
        }
    }

    /// 400: a problem with the request as a whole (its body is not JSON, ...).
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 401: a missing or wrong API key.
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(StatusCode::UNAUTHORIZED, "authentication_error", message)
        }
    }

    /// 404: a model this server does not serve.
    pub fn model_not_found(requested: &str, served: &[String]) -> ApiError {
        ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found_error",
                format!(
                    "the model {requested:?} does not exist on this server: expected one of {}",
                    served
                        .iter()
                        .map(|name| format!("{name:?}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )
        }
    }

    /// 404: a path no route serves.
    pub fn route_not_found(method: &str, path: &str) -> ApiError {
        ApiError {
            code: Some("unknown_route"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found_error",
                format!("no route for {method} {path}"),
            )
        }
    }

    /// 405: a known path with a method it does not take.
    pub fn method_not_allowed(method: &str, path: &str) -> ApiError {
        ApiError {
            code: Some("method_not_allowed"),
            ..ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                format!("{path} does not accept {method}"),
            )
        }
    }

    /// 413: a body over the limit.
    pub fn body_too_large(limit: usize, close_connection: bool) -> ApiError {
        ApiError {
            code: Some("request_too_large"),
            close_connection,
            ..ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("the request body is larger than the limit of {limit} bytes"),
            )
        }
    }

    /// 415: a body that says it is not JSON.
    pub fn unsupported_media_type(content_type: &str) -> ApiError {
        ApiError {
            code: Some("unsupported_media_type"),
            ..ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "invalid_request_error",
                format!("Content-Type {content_type:?}: expected application/json"),
            )
        }
    }

    /// 503 while the model loads.
    pub fn loading() -> ApiError {
        ApiError {
            code: Some("model_loading"),
            retry_after: Some(RETRY_AFTER_LOADING_SECONDS),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable_error",
                "the model is still loading",
            )
        }
    }

    /// 503 while draining before shutdown.
    pub fn draining() -> ApiError {
        ApiError {
            code: Some("server_draining"),
            retry_after: Some(RETRY_AFTER_DRAINING_SECONDS),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable_error",
                "the server is shutting down and admits no new requests",
            )
        }
    }

    /// 500: the engine failed on a request (not the client's fault).
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The error object, as the body of a response or an SSE `data:` line.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }

    /// Maps the engine's refusal of a request. `prompt_param` names the field the prompt came
    /// from (`messages` or `prompt`), `logprobs_param` the one that asked for alternatives.
    pub fn from_submit(error: SubmitError, prompt_param: &str, logprobs_param: &str) -> ApiError {
        let message = error.to_string();
        match error {
            SubmitError::EmptyPrompt | SubmitError::TokenOutOfRange { .. } => {
                ApiError::invalid(prompt_param, message)
            }
            SubmitError::PromptTooLong { .. } | SubmitError::NeverFits { .. } => ApiError {
                code: Some("context_length_exceeded"),
                ..ApiError::invalid(prompt_param, message)
            },
            SubmitError::TooManyLogprobs { .. } => ApiError::invalid(logprobs_param, message),
            SubmitError::InvalidSampling(e) => ApiError::invalid(e.param.field(), message),
            SubmitError::QueueFull { .. } => ApiError {
                code: Some("queue_full"),
                retry_after: Some(RETRY_AFTER_QUEUE_FULL_SECONDS),
                ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
            },
            SubmitError::Draining => ApiError::draining(),
            SubmitError::Stopped { .. } => ApiError {
                code: Some("engine_stopped"),
                retry_after: Some(RETRY_AFTER_DRAINING_SECONDS),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable_error",
                    message,
                )
            },
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.status.as_u16(), self.message)
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        let headers = response.headers_mut();
        if let Some(seconds) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if self.close_connection {
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_object_has_the_four_fields() {
        let error = ApiError::invalid("temperature", "temperature: expected 0 to 2, found 5");
        assert_eq!(
            error.body(),
            serde_json::json!({"error": {
                "message": "temperature: expected 0 to 2, found 5",
                "type": "invalid_request_error",
                "param": "temperature",
                "code": null,
            }})
        );
        assert_eq!(error.status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn submit_errors_map_to_statuses() {
        let full = ApiError::from_submit(
            SubmitError::QueueFull {
                waiting: 8,
                running: 4,
                max_queue: 8,
            },
            "prompt",
            "logprobs",
        );
        assert_eq!(full.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(full.retry_after, Some(RETRY_AFTER_QUEUE_FULL_SECONDS));
        let long = ApiError::from_submit(
            SubmitError::PromptTooLong {
                prompt_tokens: 10,
                n_ctx: 8,
            },
            "messages",
            "top_logprobs",
        );
        assert_eq!(long.status, StatusCode::BAD_REQUEST);
        assert_eq!(long.param.as_deref(), Some("messages"));
        assert_eq!(long.code, Some("context_length_exceeded"));
        let draining = ApiError::from_submit(SubmitError::Draining, "prompt", "logprobs");
        assert_eq!(draining.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(draining.retry_after.is_some());
        let response = draining.into_response();
        assert_eq!(
            response.headers().get(header::RETRY_AFTER).unwrap(),
            &RETRY_AFTER_DRAINING_SECONDS.to_string()
        );
    }
}
