//! The cache's figures for the controller's `/metrics`: restores that hit and missed,
//! bytes in and out, entries saved, evictions by reason, and what is stored.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// Evictions: `age`, `repository_size`, `total_size`, `abandoned`; refusals: see
    /// `crate::refusal::Refusal::reason`.
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLabel {
    /// `v1` (`_apis/artifactcache`), `v2` (the Twirp service and its blob uploads),
    /// `download`.
    pub api: String,
}

#[derive(Debug, Default)]
pub struct CacheMetrics {
    /// Requests by API: which one jobs' clients speak.
    pub requests: Family<ApiLabel, Counter>,
    pub hits: Counter,
    pub misses: Counter,
    pub saved: Counter,
    /// Saves refused because the key exists already in the job's scope.
    pub save_conflicts: Counter,
    pub bytes_uploaded: Counter,
    pub bytes_downloaded: Counter,
    pub evictions: Family<ReasonLabel, Counter>,
    pub stored_bytes: Gauge,
    /// What the committed entries may hold in all (`max_total`): the quota the sweep keeps.
    pub max_bytes: Gauge,
    pub stored_entries: Gauge,
    /// Requests refused, by reason (`crate::refusal::Refusal::reason`).
    pub refusals: Family<ReasonLabel, Counter>,
    /// Bytes of uploads not committed (or committed, not yet swept): what the in-flight
    /// allowance holds.
    pub uploading_bytes: Gauge,
}

impl CacheMetrics {
    /// Adds the figures to `registry` as `gdr_cache_*`.
    pub fn register(&self, registry: &mut Registry) {
        let registry = registry.sub_registry_with_prefix("cache");
        registry.register("requests", "Requests of jobs' cache clients, by API", self.requests.clone());
        registry.register("hits", "Restores that found an entry", self.hits.clone());
        registry.register("misses", "Restores that found none", self.misses.clone());
        registry.register("saved", "Entries committed", self.saved.clone());
        registry.register("save_conflicts", "Saves of a key that exists already in the job's scope", self.save_conflicts.clone());
        registry.register("uploaded_bytes", "Archive bytes received", self.bytes_uploaded.clone());
        registry.register("downloaded_bytes", "Archive bytes served", self.bytes_downloaded.clone());
        registry.register("evictions", "Entries removed, by reason", self.evictions.clone());
        registry.register("stored_bytes", "Bytes stored in committed entries (at the last sweep)", self.stored_bytes.clone());
        registry.register("max_bytes", "What committed entries may hold in all (cache.max_size); the sweep evicts past it", self.max_bytes.clone());
        registry.register("stored_entries", "Committed entries (at the last sweep)", self.stored_entries.clone());
        registry.register("refusals", "Requests refused, by reason (docs/security.md lists them)", self.refusals.clone());
        registry.register("uploading_bytes", "Bytes of saves in flight, charged to the in-flight allowance", self.uploading_bytes.clone());
    }

    pub fn request(&self, api: &str) {
        self.requests.get_or_create(&ApiLabel { api: api.to_owned() }).inc();
    }

    pub fn refused(&self, reason: &str) {
        self.refusals.get_or_create(&ReasonLabel { reason: reason.to_owned() }).inc();
    }

    pub fn evicted(&self, reason: &str, entries: u64) {
        self.evictions.get_or_create(&ReasonLabel { reason: reason.to_owned() }).inc_by(entries);
    }
}
