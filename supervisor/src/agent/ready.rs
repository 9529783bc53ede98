//! The readiness protocol between the agent and `supervisor job-started`: one JSON
//! line each way over a unix socket owned by the runner uid.
//!
//! request:  `{"wait_ms": 30000}` — answer when everything is ready, something failed,
//!           or after `wait_ms`, whichever comes first;
//! response: `{"identity": {"state": "ready", "detail": "…"}, "docker": {…}}`.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", content = "detail", rename_all = "snake_case")]
pub enum Status {
    /// Not required in this environment.
    Off,
    Waiting(String),
    /// dockerd is starting behind its socket, which already takes connections: a
    /// `docker` call waits for dockerd instead of failing, so steps need not wait.
    Starting(String),
    Ready(String),
    Failed(String),
}

impl Status {
    /// Whether what needs it may go on (a starting dockerd counts: see [`Status::Starting`]).
    pub fn is_ready(&self) -> bool {
        matches!(self, Status::Off | Status::Starting(_) | Status::Ready(_))
    }

    /// Whether nothing more will change.
    pub fn is_final(&self) -> bool {
        matches!(self, Status::Off | Status::Ready(_) | Status::Failed(_))
    }

    pub fn is_failed(&self) -> bool {
        matches!(self, Status::Failed(_))
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Status::Off => f.write_str("off"),
            Status::Waiting(detail) => write!(f, "waiting ({detail})"),
            Status::Starting(detail) => write!(f, "starting ({detail})"),
            Status::Ready(detail) => write!(f, "ready ({detail})"),
            Status::Failed(detail) => write!(f, "failed ({detail})"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Readiness {
    pub identity: Status,
    pub docker: Status,
}

impl Readiness {
    pub fn is_ready(&self) -> bool {
        self.identity.is_ready() && self.docker.is_ready()
    }

    pub fn is_settled(&self) -> bool {
        self.is_ready() || self.identity.is_failed() || self.docker.is_failed()
    }

    /// "identity: waiting (…); dockerd: failed (…)" for what is not ready.
    pub fn missing(&self) -> String {
        let mut parts = Vec::new();
        if !self.identity.is_ready() {
            parts.push(format!("identity: {}", self.identity));
        }
        if !self.docker.is_ready() {
            parts.push(format!("dockerd: {}", self.docker));
        }
        parts.join("; ")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub wait_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format() {
        let readiness = Readiness { identity: Status::Ready("spiffe://example.org/ci/o/r/j".into()), docker: Status::Off };
        let json = serde_json::to_string(&readiness).unwrap();
        assert_eq!(json, r#"{"identity":{"state":"ready","detail":"spiffe://example.org/ci/o/r/j"},"docker":{"state":"off"}}"#);
        assert_eq!(serde_json::from_str::<Readiness>(&json).unwrap(), readiness);
        assert!(readiness.is_ready());
    }

    #[test]
    fn missing_names_what_is_not_ready() {
        let readiness = Readiness { identity: Status::Waiting("no identity issued".into()), docker: Status::Failed("dockerd exited with 1".into()) };
        assert!(!readiness.is_ready());
        assert!(readiness.is_settled());
        assert_eq!(readiness.missing(), "identity: waiting (no identity issued); dockerd: failed (dockerd exited with 1)");
    }

    #[test]
    fn a_starting_dockerd_holds_nothing_back() {
        let readiness = Readiness { identity: Status::Ready("spiffe://example.org/ci/o/r/j".into()), docker: Status::Starting("socket bound".into()) };
        assert!(readiness.is_ready() && readiness.is_settled());
        assert!(!readiness.docker.is_final());
        let json = serde_json::to_string(&readiness.docker).unwrap();
        assert_eq!(json, r#"{"state":"starting","detail":"socket bound"}"#);
    }
}
