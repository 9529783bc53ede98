//! The Connect error: a code and a message, carried as a JSON body on a non-200
//! response (`{"code":"…","message":"…"}`).

use bytes::Bytes;
use http::StatusCode;
use serde::{Deserialize, Serialize};

use crate::code::Code;

/// An RPC failure as both sides of the Connect protocol see it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

#[derive(Serialize, Deserialize)]
struct WireError<'a> {
    code: &'a str,
    #[serde(default, skip_serializing_if = "str::is_empty")]
    message: std::borrow::Cow<'a, str>,
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        ConnectError { code, message: message.into() }
    }

    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(Code::Unauthenticated, message)
    }

    pub fn permission_denied(message: impl Into<String>) -> Self {
        Self::new(Code::PermissionDenied, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(Code::Unavailable, message)
    }

    pub fn deadline_exceeded(message: impl Into<String>) -> Self {
        Self::new(Code::DeadlineExceeded, message)
    }

    /// The JSON body of an error response.
    pub fn to_json(&self) -> Bytes {
        let wire = WireError { code: self.code.as_str(), message: self.message.as_str().into() };
        // Serializing two strings cannot fail.
        Bytes::from(serde_json::to_vec(&wire).unwrap_or_default())
    }

    /// How a client reads a non-200 response: the Connect JSON error if the body is
    /// one, otherwise the code implied by the HTTP status with its reason phrase as
    /// the message (as connect-go does).
    pub fn from_response(status: StatusCode, body: &[u8]) -> Self {
        if let Ok(wire) = serde_json::from_slice::<WireError<'_>>(body)
            && let Ok(code) = wire.code.parse::<Code>()
        {
            return ConnectError::new(code, wire.message.into_owned());
        }
        ConnectError::new(
            Code::from_http_status(status),
            format!("HTTP status {} {}", status.as_u16(), status.canonical_reason().unwrap_or("")).trim_end().to_owned(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_body_round_trips() {
        let error = ConnectError::unauthenticated("unregistered runner");
        assert_eq!(error.to_json(), Bytes::from_static(br#"{"code":"unauthenticated","message":"unregistered runner"}"#));
        assert_eq!(ConnectError::from_response(StatusCode::UNAUTHORIZED, &error.to_json()), error);
    }

    #[test]
    fn non_connect_bodies_fall_back_to_the_http_status() {
        let table: &[(u16, &[u8], Code, &str)] = &[
            (401, b"Unauthorized", Code::Unauthenticated, "HTTP status 401 Unauthorized"),
            (502, b"<html>bad gateway</html>", Code::Unavailable, "HTTP status 502 Bad Gateway"),
            (404, b"404 page not found", Code::Unimplemented, "HTTP status 404 Not Found"),
            (500, br#"{"code":"no_such_code"}"#, Code::Unknown, "HTTP status 500 Internal Server Error"),
            (400, b"", Code::Internal, "HTTP status 400 Bad Request"),
        ];
        for &(status, body, code, message) in table {
            let error = ConnectError::from_response(StatusCode::from_u16(status).unwrap(), body);
            assert_eq!(error, ConnectError::new(code, message), "{status}");
        }
    }

    #[test]
    fn a_connect_body_wins_over_the_status() {
        let error = ConnectError::from_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            br#"{"code":"unknown","message":"rpc error: code = Unauthenticated desc = unregistered runner","details":[]}"#,
        );
        assert_eq!(error.code, Code::Unknown);
        assert_eq!(error.message, "rpc error: code = Unauthenticated desc = unregistered runner");
    }
}
