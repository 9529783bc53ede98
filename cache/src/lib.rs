//! The cache that survives the job: the HTTP service `actions/cache` speaks — the
//! legacy `_apis/artifactcache` API and the v2 Twirp `CacheService` with its blob
//! uploads — over an object store (a directory on one host, or an S3-compatible bucket
//! several controllers share), scoped the way GitHub scopes its cache.
//!
//! The cache holds no credential and trusts no client for its scope: the controller
//! serves it on the facade's own authenticated transport and hands every request the
//! [`Scope`] of the job that sent it (its repository, the ref it may write, the refs it
//! may read, the job itself), derived from the task Gitea gave that job.
//!
//! One job costs the others little: what its requests may hold — bytes and objects of
//! uploads not committed, open uploads, requests at once, free space — is bounded per
//! job, per repository and in all, and refused with a status and a counted reason past
//! that ([`budget`], [`refusal`]).
//!
//! Layout:
//! - [`service`]: a request routed ([`api`]) to its API's adapter ([`v1`], [`v2`]), over
//!   the rooms that do the work: [`uploads`] (saves, bounded as they go), [`restore`]
//!   (which entry, which archive a job may read) and [`download`] (archives streamed).
//! - [`scope`], [`budget`]: who asks, and what they may hold.
//! - [`lookup`]: which entry a restore gets (pure, table-tested).
//! - [`store`]: the objects on the store; the store is the index.
//! - [`sweep`]: what goes — past the age limit, over the size limits (least recently
//!   used first), uploads never committed.
//! - [`backend`]: the storage opened (a directory, or an S3 bucket).
//! - [`http`], [`metrics`], [`error`]: the plumbing.

#![forbid(unsafe_code)]

pub mod api;
pub mod backend;
pub mod budget;
pub mod download;
pub mod error;
pub mod http;
pub mod lookup;
pub mod metrics;
pub mod refusal;
pub mod restore;
pub mod scope;
pub mod service;
pub mod store;
pub mod sweep;
pub mod uploads;
pub mod v1;
pub mod v2;

pub use crate::{
    error::CacheError,
    http::{BoxError, Response, ResponseBody},
    metrics::CacheMetrics,
    refusal::Refusal,
    scope::{Limits, Scope},
    service::{Cache, Io},
    uploads::KeepFree,
};

pub(crate) use contract::error_chain;

pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A new upload's id: random, unguessable enough for a name only its own job learns,
/// and below 2^53 because the v1 client keeps it in a JavaScript number.
pub(crate) fn new_id() -> Result<u64, CacheError> {
    use ring::rand::SecureRandom as _;
    let mut bytes = [0u8; 8];
    ring::rand::SystemRandom::new().fill(&mut bytes).map_err(|_| CacheError::Request("the system offers no randomness".to_owned()))?;
    Ok((u64::from_le_bytes(bytes) & ((1 << 53) - 1)).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_fit_a_javascript_number() {
        for _ in 0..64 {
            let id = new_id().unwrap();
            assert!((1..1 << 53).contains(&id));
        }
    }
}
