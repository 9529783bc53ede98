//! A request the cache does not serve, and why: the HTTP status (each API answers it in
//! its own format), the reason counted in `gdr_cache_refusals_total` and the message for
//! the job's log. docs/security.md lists every reason with its status.

use crate::budget::Exceeded;

/// Why the cache refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    pub status: u16,
    /// The metric's label, e.g. `job_uploading`.
    pub reason: &'static str,
    pub message: String,
}

impl Refusal {
    pub fn new(status: u16, reason: &'static str, message: impl Into<String>) -> Refusal {
        Refusal { status, reason, message: message.into() }
    }

    /// A request that is not what the API takes (400).
    pub fn malformed(message: impl Into<String>) -> Refusal {
        Refusal::new(400, "malformed", message)
    }

    /// More than the job, its repository or all jobs may have (429: the toolkit logs it and
    /// goes on without its cache).
    pub fn too_much(reason: &'static str, message: impl Into<String>) -> Refusal {
        Refusal::new(429, reason, message)
    }
}

impl From<Exceeded> for Refusal {
    fn from(exceeded: Exceeded) -> Refusal {
        Refusal::too_much(exceeded.reason(), exceeded.explain())
    }
}
