//! Connect error codes and their mapping to and from HTTP status codes
//! (after connect-go's protocol_connect.go).

use std::{fmt, str::FromStr};

use http::StatusCode;

/// A Connect (gRPC) status code other than OK.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    pub const ALL: [Code; 16] = [
        Code::Canceled,
        Code::Unknown,
        Code::InvalidArgument,
        Code::DeadlineExceeded,
        Code::NotFound,
        Code::AlreadyExists,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Aborted,
        Code::OutOfRange,
        Code::Unimplemented,
        Code::Internal,
        Code::Unavailable,
        Code::DataLoss,
        Code::Unauthenticated,
    ];

    /// The gRPC status number (Connect codes are gRPC's, 1–16, in [`Code::ALL`]'s order).
    pub fn grpc(self) -> i32 {
        Code::ALL.iter().position(|c| *c == self).map_or(2, |i| i as i32 + 1)
    }

    /// The code of a gRPC status number; `None` for OK (0) and unknown numbers.
    pub fn from_grpc(number: i32) -> Option<Code> {
        usize::try_from(number).ok().and_then(|n| n.checked_sub(1)).and_then(|i| Code::ALL.get(i).copied())
    }

    /// The snake_case name used in Connect JSON error bodies.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status a Connect server answers with for this code.
    pub fn http_status(self) -> StatusCode {
        let status = match self {
            Code::Canceled => 499,
            Code::Unknown | Code::Internal | Code::DataLoss => 500,
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists | Code::Aborted => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::Unimplemented => 501,
            Code::Unavailable => 503,
            Code::Unauthenticated => 401,
        };
        // 499 is not a registered status, but every value here is in 100..=999.
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// The code a Connect client infers from an HTTP status when the body is not a
    /// Connect error (for example an error page from a proxy).
    pub fn from_http_status(status: StatusCode) -> Code {
        match status.as_u16() {
            400 => Code::Internal,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::Unimplemented,
            429 | 502 | 503 | 504 => Code::Unavailable,
            _ => Code::Unknown,
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The name is not one of the sixteen Connect codes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown Connect error code {0:?}")]
pub struct UnknownCode(pub String);

impl FromStr for Code {
    type Err = UnknownCode;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Code::ALL.into_iter().find(|code| code.as_str() == name).ok_or_else(|| UnknownCode(name.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_to_http_status_matches_connect_go() {
        let table: &[(Code, u16)] = &[
            (Code::Canceled, 499),
            (Code::Unknown, 500),
            (Code::InvalidArgument, 400),
            (Code::DeadlineExceeded, 504),
            (Code::NotFound, 404),
            (Code::AlreadyExists, 409),
            (Code::PermissionDenied, 403),
            (Code::ResourceExhausted, 429),
            (Code::FailedPrecondition, 400),
            (Code::Aborted, 409),
            (Code::OutOfRange, 400),
            (Code::Unimplemented, 501),
            (Code::Internal, 500),
            (Code::Unavailable, 503),
            (Code::DataLoss, 500),
            (Code::Unauthenticated, 401),
        ];
        assert_eq!(table.len(), Code::ALL.len());
        for &(code, status) in table {
            assert_eq!(code.http_status().as_u16(), status, "{code}");
        }
    }

    #[test]
    fn http_status_to_code_matches_connect_go() {
        let table: &[(u16, Code)] = &[
            (400, Code::Internal),
            (401, Code::Unauthenticated),
            (403, Code::PermissionDenied),
            (404, Code::Unimplemented),
            (429, Code::Unavailable),
            (502, Code::Unavailable),
            (503, Code::Unavailable),
            (504, Code::Unavailable),
            (500, Code::Unknown),
            (409, Code::Unknown),
            (418, Code::Unknown),
        ];
        for &(status, code) in table {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(Code::from_http_status(status), code, "{status}");
        }
    }

    #[test]
    fn grpc_numbers() {
        let table: &[(Code, i32)] = &[
            (Code::Canceled, 1),
            (Code::Unknown, 2),
            (Code::DeadlineExceeded, 4),
            (Code::PermissionDenied, 7),
            (Code::ResourceExhausted, 8),
            (Code::Unavailable, 14),
            (Code::Unauthenticated, 16),
        ];
        for &(code, number) in table {
            assert_eq!(code.grpc(), number, "{code}");
            assert_eq!(Code::from_grpc(number), Some(code));
        }
        for code in Code::ALL {
            assert_eq!(Code::from_grpc(code.grpc()), Some(code));
        }
        assert_eq!(Code::from_grpc(0), None);
        assert_eq!(Code::from_grpc(17), None);
        assert_eq!(Code::from_grpc(-1), None);
    }

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for code in Code::ALL {
            assert_eq!(code.as_str().parse::<Code>(), Ok(code));
        }
        for bad in ["", "OK", "ok", "Unauthenticated", "deadline-exceeded"] {
            assert_eq!(bad.parse::<Code>(), Err(UnknownCode(bad.to_owned())));
        }
    }
}
