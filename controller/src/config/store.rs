//! `[store]`: where assignments are kept — one redb file on one host, or NATS
//! JetStream for several controllers.

use std::{path::PathBuf, time::Duration};

use serde::Deserialize;

use crate::setting::{Problems, duration};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, tag = "kind", rename_all = "lowercase")]
pub enum StoreConfig {
    /// One host: a redb file.
    Embedded {
        path: PathBuf,
        /// How long finished records (with the reason each ended) are kept.
        #[serde(default = "default_retention", with = "duration")]
        retention: Duration,
    },
    /// Several controllers: NATS JetStream.
    Jetstream {
        url: String,
        #[serde(default = "default_subject")]
        subject: String,
        #[serde(default = "default_bucket")]
        bucket: String,
        #[serde(default = "default_ack_wait", with = "duration")]
        ack_wait: Duration,
        /// Copies of the stream and the buckets: 1, or 3 (or 5) on a JetStream cluster of
        /// at least that many nodes, which then survives the loss of one (two).
        #[serde(default = "default_replicas")]
        replicas: usize,
        /// How long finished records (with the reason each ended) are kept.
        #[serde(default = "default_retention", with = "duration")]
        retention: Duration,
        /// A NATS credentials file (`.creds`), if the servers require one.
        credentials_file: Option<PathBuf>,
        /// A file holding a NATS token, if the servers require one.
        token_file: Option<PathBuf>,
    },
}

fn default_subject() -> String {
    "ci.assignments".into()
}
fn default_bucket() -> String {
    "ci-assignments".into()
}
fn default_replicas() -> usize {
    1
}
fn default_retention() -> Duration {
    crate::store::DEFAULT_RETENTION
}
fn default_ack_wait() -> Duration {
    Duration::from_secs(60)
}

impl StoreConfig {
    /// Where the records are, as one string (no credentials): part of the default
    /// installation name.
    pub fn location(&self) -> String {
        match self {
            StoreConfig::Embedded { path, .. } => format!("redb:{}", path.display()),
            StoreConfig::Jetstream { url, bucket, .. } => {
                let mut servers: Vec<String> = url
                    .split(',')
                    .map(|server| {
                        let server = server.trim();
                        let server = server.split_once("://").map_or(server, |(_, rest)| rest);
                        server.rsplit_once('@').map_or(server, |(_, host)| host).trim_end_matches('/').to_owned()
                    })
                    .collect();
                servers.sort();
                format!("nats:{}/{bucket}", servers.join(","))
            }
        }
    }

    pub fn retention(&self) -> Duration {
        match self {
            StoreConfig::Embedded { retention, .. } | StoreConfig::Jetstream { retention, .. } => *retention,
        }
    }

    pub fn validate(&self, problems: &mut Problems) {
        if let StoreConfig::Jetstream { url, replicas, .. } = self {
            let redacted = crate::store::jetstream::redact_url(url);
            if url.split(',').any(|server| !server.trim().starts_with("nats://") && !server.trim().starts_with("tls://")) {
                problems.add("store.url", format!("{redacted:?} must be a nats:// or tls:// URL (several, comma-separated, for a cluster)"));
            }
            if url.contains('@') {
                problems
                    .add("store.url", format!("{redacted:?} carries credentials, which would end up in logs: use store.credentials_file or store.token_file"));
            }
            if ![1, 3, 5].contains(replicas) {
                problems.add("store.replicas", format!("{replicas} must be 1, 3 or 5 (a JetStream cluster of at least that many nodes)"));
            }
        }
        if !(Duration::from_secs(60)..=Duration::from_secs(365 * 24 * 3600)).contains(&self.retention()) {
            problems.add("store.retention", format!("{:?} must be between 1m and 365d", self.retention()));
        }
    }
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig::Embedded { path: PathBuf::from("/var/lib/gitea-dynamic-runner/store.redb"), retention: default_retention() }
    }
}
