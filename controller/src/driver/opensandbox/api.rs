//! The Lifecycle API's messages, as far as the driver reads and writes them, and its
//! errors with the server's own code and message.

use std::collections::BTreeMap;

use reqwest::StatusCode;
use serde::{Deserialize, Serialize};

/// A sandbox as the Lifecycle API describes it (only what the driver reads).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Sandbox {
    pub(super) id: String,
    #[serde(default)]
    pub(super) status: Status,
    #[serde(default)]
    pub(super) metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub(super) created_at: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub(super) struct Status {
    #[serde(default)]
    pub(super) state: String,
    #[serde(default)]
    pub(super) reason: Option<String>,
    #[serde(default)]
    pub(super) message: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Page {
    pub(super) items: Vec<Sandbox>,
    #[serde(default)]
    pub(super) pagination: Option<Pagination>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Pagination {
    #[serde(default)]
    pub(super) has_next_page: bool,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct CreateRequest<'a> {
    pub(super) image: ImageRef<'a>,
    pub(super) entrypoint: &'a [String],
    pub(super) resource_limits: BTreeMap<&'static str, &'a str>,
    pub(super) env: BTreeMap<&'a str, &'a str>,
    pub(super) metadata: &'a BTreeMap<String, String>,
    pub(super) timeout: u64,
}

#[derive(Debug, Serialize)]
pub(super) struct ImageRef<'a> {
    pub(super) uri: &'a str,
}

/// A failed call: the HTTP status and the server's own code and message.
#[derive(Debug)]
pub(super) struct ApiError {
    pub(super) status: Option<StatusCode>,
    pub(super) code: String,
    pub(super) message: String,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.status {
            Some(status) if self.code.is_empty() => write!(f, "HTTP {status}: {}", self.message),
            Some(status) => write!(f, "HTTP {status} {}: {}", self.code, self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl ApiError {
    /// Reads `{code, message}` (service errors) or FastAPI's `{detail: [...]}`
    /// (validation errors) from a failed response.
    pub(super) fn from_body(status: StatusCode, body: &str) -> ApiError {
        #[derive(Deserialize)]
        struct Body {
            code: Option<String>,
            message: Option<String>,
            detail: Option<serde_json::Value>,
        }
        match serde_json::from_str::<Body>(body) {
            Ok(Body { code, message, detail }) => {
                let message = match (message, detail) {
                    (Some(message), _) => message,
                    (None, Some(serde_json::Value::Array(items))) => items
                        .iter()
                        .map(|item| {
                            let location: Vec<String> = item["loc"]
                                .as_array()
                                .map(|l| l.iter().map(|p| p.as_str().map_or_else(|| p.to_string(), str::to_owned)).collect())
                                .unwrap_or_default();
                            format!("{}: {}", location.join("."), item["msg"].as_str().unwrap_or("invalid"))
                        })
                        .collect::<Vec<_>>()
                        .join("; "),
                    (None, Some(detail)) => detail.to_string(),
                    (None, None) => body.chars().take(300).collect(),
                };
                ApiError { status: Some(status), code: code.unwrap_or_default(), message }
            }
            Err(_) => ApiError { status: Some(status), code: String::new(), message: body.chars().take(300).collect() },
        }
    }

    /// Whether a retry later can succeed.
    pub(super) fn is_retryable(&self) -> bool {
        let Some(status) = self.status else { return true };
        match status {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN | StatusCode::TOO_MANY_REQUESTS | StatusCode::REQUEST_TIMEOUT => true,
            StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY | StatusCode::NOT_FOUND | StatusCode::CONFLICT => false,
            // A runner image that does not exist will not appear by retrying; a registry
            // that cannot be reached may come back.
            _ if self.code.ends_with("IMAGE_PULL_FAILED") => !["not found", "manifest unknown", "pull access denied", "does not exist"]
                .iter()
                .any(|needle| self.message.to_ascii_lowercase().contains(needle)),
            _ => status.is_server_error(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_errors_keep_their_words_and_say_whether_to_retry() {
        let cases: &[(u16, &str, &str, bool)] = &[
            (401, r#"{"code":"INVALID_API_KEY","message":"Invalid API key"}"#, "HTTP 401 Unauthorized INVALID_API_KEY: Invalid API key", true),
            (403, r#"{"code":"FORBIDDEN","message":"no"}"#, "FORBIDDEN: no", true),
            (404, r#"{"code":"DOCKER::SANDBOX_NOT_FOUND","message":"Sandbox x not found"}"#, "SANDBOX_NOT_FOUND", false),
            (409, r#"{"code":"CONFLICT","message":"exists"}"#, "CONFLICT", false),
            (
                422,
                r#"{"detail":[{"type":"missing","loc":["body","resourceLimits"],"msg":"Field required","input":{}}]}"#,
                "HTTP 422 Unprocessable Entity: body.resourceLimits: Field required",
                false,
            ),
            (400, r#"{"code":"SANDBOX::UNSUPPORTED_POOL_REF","message":"poolRef is Kubernetes only"}"#, "UNSUPPORTED_POOL_REF", false),
            (429, r#"{"code":"RATE_LIMITED","message":"slow down"}"#, "RATE_LIMITED", true),
            (503, r#"{"code":"DOCKER::SANDBOX_EXECD_START_FAILED","message":"execd"}"#, "EXECD_START_FAILED", true),
            (500, "Internal Server Error", "HTTP 500 Internal Server Error: Internal Server Error", true),
            (
                500,
                r#"{"code":"DOCKER::SANDBOX_IMAGE_PULL_FAILED","message":"pull access denied for x, repository does not exist"}"#,
                "IMAGE_PULL_FAILED",
                false,
            ),
            (500, r#"{"code":"DOCKER::SANDBOX_IMAGE_PULL_FAILED","message":"dial tcp: lookup registry-1.docker.io: no such host"}"#, "no such host", true),
        ];
        for &(status, body, shown, retry) in cases {
            let error = ApiError::from_body(StatusCode::from_u16(status).unwrap(), body);
            assert!(error.to_string().contains(shown), "{status} {body}: {error}");
            assert_eq!(error.is_retryable(), retry, "{status} {body}");
        }
        let down = ApiError { status: None, code: String::new(), message: "connection refused".into() };
        assert!(down.is_retryable());
    }
}
