//! Restores, for both APIs: which committed entry a job's keys find in its scope (a hit
//! marks the entry used), and which archives a job may download — those of committed
//! entries of the refs it reads, never another ref's or an upload's (GitHub's ref scoping
//! holds for the archive URL too, not only for the lookup that hands it out).

use std::sync::Arc;

use contract::error_chain;

use crate::{
    error::CacheError,
    lookup::{self, check_key, check_version},
    metrics::CacheMetrics,
    refusal::Refusal,
    scope::Scope,
    store::{EntryMeta, Object, Storage, now_ms},
};

/// When a restore marks its entry used again at most (each mark is a write).
const TOUCH_AFTER_MS: i64 = 10 * 60 * 1000;

#[derive(Debug)]
pub struct Restores {
    storage: Arc<Storage>,
    metrics: Arc<CacheMetrics>,
}

impl Restores {
    pub fn new(storage: Arc<Storage>, metrics: Arc<CacheMetrics>) -> Restores {
        Restores { storage, metrics }
    }

    /// The entry `keys` restore in `scope` (a hit marks it used), counted as a hit or a
    /// miss; refused when a key or the version is not one a client may send.
    pub async fn restore(&self, scope: &Scope, keys: &[String], version: &str) -> Result<Option<EntryMeta>, CacheError> {
        if let Some(problem) = keys.iter().find_map(|key| check_key(key).err()).or_else(|| check_version(version).err()) {
            return Err(Refusal::malformed(problem).into());
        }
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

    /// The committed entry whose archive is `id`, if `scope` reads its ref.
    pub async fn readable(&self, scope: &Scope, id: u64) -> Result<Option<EntryMeta>, CacheError> {
        if let Some(entry) = self.storage.archive(&scope.repository, id) {
            return Ok(scope.read.contains(&entry.git_ref).then_some(entry));
        }
        // Not seen by this controller yet (another one committed it, or a restart came
        // between): the refs the job reads, listed once, tell.
        for git_ref in &scope.read {
            self.storage.read_ref(&scope.repository, git_ref).await?;
        }
        Ok(self.storage.archive(&scope.repository, id).filter(|entry| scope.read.contains(&entry.git_ref)))
    }

    /// The parts of archive `id` (as the client names it), in order, if `scope` may read
    /// it; refused alike whether it does not exist or is another ref's.
    pub async fn archive(&self, scope: &Scope, id: &str) -> Result<Vec<Object>, CacheError> {
        let Ok(id) = id.parse::<u64>() else { return Err(Refusal::malformed(format!("{id:?} is not an archive id")).into()) };
        let missing = || Refusal::new(404, "unknown_archive", format!("no archive {id} in the cache of {} that this job may read", scope.repository));
        if self.readable(scope, id).await?.is_none() {
            return Err(missing().into());
        }
        let parts = self.storage.parts(&scope.repository, id).await?;
        if parts.is_empty() {
            return Err(missing().into());
        }
        Ok(parts)
    }
}
