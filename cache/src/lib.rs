//! The cache that survives the job: the HTTP service `actions/cache` speaks — the
//! legacy `_apis/artifactcache` API and the v2 Twirp `CacheService` with its blob
//! uploads — over an object store (a directory on one host, or an S3-compatible bucket
//! several controllers share), scoped the way GitHub scopes its cache.
//!
//! The cache holds no credential and trusts no client for its scope: the controller
//! serves it on the facade's own authenticated transport and hands every request the
//! [`Scope`] of the job that sent it (its repository, the ref it may write, the refs it
//! may read), derived from the task Gitea gave that job.
//!
//! Layout:
//! - [`lookup`]: which entry a restore gets (pure, table-tested).
//! - [`store`]: the objects on the store; the store is the index.
//! - [`v1`], [`v2`], [`download`]: the two APIs and the archive downloads.
//! - [`sweep`]: what goes — past the age limit, over the size limits (least recently
//!   used first), uploads never committed.
//! - [`backend`]: the storage opened (a directory, or an S3 bucket).
//! - [`http`], [`metrics`], [`error`]: the plumbing.

#![forbid(unsafe_code)]

pub mod backend;
pub mod download;
pub mod error;
pub mod http;
pub mod lookup;
pub mod metrics;
pub mod store;
pub mod sweep;
pub mod v1;
pub mod v2;

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use object_store::ObjectStore;

pub use crate::{
    error::CacheError,
    http::{BoxError, Response, ResponseBody},
    metrics::CacheMetrics,
};
use crate::{http::message, store::Storage};

/// Where a job's entries go and where its restores look: GitHub's rule. A job reads the
/// entries of its own ref, then those of its pull request's base branch, then those of
/// the default branch; it writes only to its own ref's. A pull request's job therefore
/// restores the default branch's entries, and what it saves stays in its own scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    /// `owner/name`: no entry is ever shared between repositories.
    pub repository: String,
    /// The ref the job saves under, e.g. `refs/pull/3/head`.
    pub write: String,
    /// The refs it restores from, in order, its own first.
    pub read: Vec<String>,
}

impl Scope {
    /// `write` first, then `others` in order, each once.
    pub fn new(repository: impl Into<String>, write: impl Into<String>, others: impl IntoIterator<Item = String>) -> Scope {
        let write = write.into();
        let mut read = vec![write.clone()];
        for other in others {
            if !other.is_empty() && !read.contains(&other) {
                read.push(other);
            }
        }
        Scope { repository: repository.into(), write, read }
    }
}

/// How much the cache keeps, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// All repositories together.
    pub max_total: u64,
    /// One repository's entries together; also the largest entry.
    pub max_repository: u64,
    /// An entry not used for this long goes.
    pub max_age: Duration,
}

impl Limits {
    /// The largest archive a save may have.
    pub fn max_entry(&self) -> u64 {
        self.max_total.min(self.max_repository)
    }
}

/// The cache service.
#[derive(Debug)]
pub struct Cache {
    storage: Storage,
    limits: Limits,
    metrics: Arc<CacheMetrics>,
    /// Set by a commit: the sweep loop enforces the limits soon after.
    committed: tokio::sync::Notify,
}

/// When a restore marks its entry used again at most (each mark is a write).
const TOUCH_AFTER_MS: i64 = 10 * 60 * 1000;

impl Cache {
    pub fn new(store: Arc<dyn ObjectStore>, limits: Limits, metrics: Arc<CacheMetrics>) -> Cache {
        Cache { storage: Storage::new(store), limits, metrics, committed: tokio::sync::Notify::new() }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    pub fn metrics(&self) -> &Arc<CacheMetrics> {
        &self.metrics
    }

    pub(crate) fn storage(&self) -> &Storage {
        &self.storage
    }

    /// Answers one request of a job in `scope`. `base` is the cache's URL as the job
    /// reaches it (the download and upload URLs it is given start with it).
    pub async fn handle<B>(&self, scope: &Scope, base: &str, request: ::http::Request<B>) -> Response
    where
        B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<BoxError>,
    {
        let (parts, body) = request.into_parts();
        let path = parts.uri.path().to_owned();
        let query = parts.uri.query().unwrap_or("").to_owned();
        let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let base = base.trim_end_matches('/');
        use ::http::Method;
        self.metrics.request(match segments.as_slice() {
            ["twirp", ..] | [_, _, "blobs", ..] => "v2",
            [_, _, "artifacts", ..] => "download",
            _ => "v1",
        });
        let response = match (&parts.method, segments.as_slice()) {
            (&Method::GET, ["_apis", "artifactcache", "cache"]) => v1::lookup(self, scope, base, &query).await,
            (&Method::POST, ["_apis", "artifactcache", "caches"]) => v1::reserve(self, scope, body).await,
            (&Method::PATCH, ["_apis", "artifactcache", "caches", id]) => v1::upload(self, scope, id, &parts.headers, body).await,
            (&Method::POST, ["_apis", "artifactcache", "caches", id]) => v1::commit(self, scope, id, body).await,
            (&Method::GET | &Method::HEAD, ["_apis", "artifactcache", "artifacts", id]) => {
                download::serve(self, scope, id, parts.method == Method::HEAD, &parts.headers).await
            }
            (&Method::PUT, ["_apis", "artifactcache", "blobs", id]) => v2::blob(self, scope, id, &query, &parts.headers, body).await,
            (&Method::POST, ["twirp", v2::SERVICE, method]) => v2::call(self, scope, base, method, body).await,
            _ => Ok(message(404, format!("the cache has no {} {path}", parts.method))),
        };
        response.unwrap_or_else(|error| {
            tracing::warn!(repository = %scope.repository, %path, error = %error_chain(&error), "cache request failed");
            message(500, format!("the cache failed: {}", error_chain(&error)))
        })
    }

    /// Resolves when a commit may have taken a repository over its limit.
    pub async fn committed(&self) {
        self.committed.notified().await;
    }

    pub(crate) fn note_commit(&self) {
        self.metrics.saved.inc();
        self.committed.notify_one();
    }

    /// The entry `keys` restore in `scope` (a hit marks it used), counted as a hit or a miss.
    pub(crate) async fn restore(&self, scope: &Scope, keys: &[String], version: &str) -> Result<Option<store::EntryMeta>, CacheError> {
        let mut scopes = Vec::with_capacity(scope.read.len());
        let mut used = std::collections::HashMap::new();
        for git_ref in &scope.read {
            let entries = self.storage.entries(&scope.repository, git_ref, version).await?;
            scopes.push(entries.iter().map(|(entry, _)| entry.clone()).collect::<Vec<_>>());
            used.extend(entries.into_iter().map(|(entry, used_ms)| ((entry.git_ref, entry.id), used_ms)));
        }
        let Some(found) = lookup::choose(&scopes, keys).cloned() else {
            self.metrics.misses.inc();
            return Ok(None);
        };
        self.metrics.hits.inc();
        let last_used = used.get(&(found.git_ref.clone(), found.id)).copied().unwrap_or(0);
        if now_ms() - last_used > TOUCH_AFTER_MS
            && let Err(error) = self.storage.touch(&found).await
        {
            tracing::warn!(repository = %scope.repository, key = %found.key, error = %error_chain(&error), "cannot mark a cache entry used");
        }
        Ok(Some(found))
    }
}

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
    fn a_scope_reads_its_own_ref_first_then_each_other_once() {
        let scope = Scope::new("o/r", "refs/pull/3/head", ["refs/heads/main".to_owned(), String::new(), "refs/heads/main".to_owned()]);
        assert_eq!(scope.read, ["refs/pull/3/head", "refs/heads/main"]);
        let on_main = Scope::new("o/r", "refs/heads/main", ["refs/heads/main".to_owned()]);
        assert_eq!(on_main.read, ["refs/heads/main"]);
        assert!(new_id().unwrap() < 1 << 53);
    }
}
