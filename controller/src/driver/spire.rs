//! SPIRE registration entries for environments that a shared node agent cannot tell
//! apart (OpenSandbox VMs: each guest runs its own agent), as a decorator of the
//! placement's driver ([`Registered`]). One entry per environment —
//! the job's exact SPIFFE ID, a parent and selectors from the configuration — made
//! before the environment, removed with it, and swept away when its environment is
//! gone (after a crash or a restart). This module is the only owner of those entries.
//!
//! The entries are written through SPIRE server's Entry API on its admin socket. Each
//! entry's id is the environment's name, so a retried registration finds the first one
//! and a deletion needs no lookup; its hint names the placement, so the sweep of one
//! placement never touches another's entries.

use std::{
    collections::{BTreeMap, HashSet},
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use async_trait::async_trait;
use hyper_util::rt::TokioIo;
use proto::spire_api::{
    server::entry::v1::{BatchCreateEntryRequest, BatchDeleteEntryRequest, ListEntriesRequest, entry_client::EntryClient, list_entries_request::Filter},
    types::{Entry, Selector, Spiffeid},
};
use serde::Deserialize;
use tonic::transport::{Channel, Endpoint};

use super::{Changes, Driver, DriverError, Environment, EnvironmentSpec};
use crate::{assignment::placement::Placement, setting::Problems};

/// gRPC status codes the Entry API answers in its per-entry results.
const CODE_OK: i32 = 0;
const CODE_NOT_FOUND: i32 = 5;
const CODE_ALREADY_EXISTS: i32 = 6;
const CODE_UNAVAILABLE: i32 = 14;
const CODE_DEADLINE_EXCEEDED: i32 = 4;
const CODE_RESOURCE_EXHAUSTED: i32 = 8;
const CODE_INTERNAL: i32 = 13;

const PLACEHOLDER: &str = "{environment}";

/// `[opensandbox.spire]`: how each sandbox's supervisor gets its job's identity.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpireConfig {
    /// SPIRE server's admin socket (`server.socket_path`), e.g. `/tmp/spire-server/private/api.sock`.
    pub server_socket: PathBuf,
    /// The entry's parent: the SPIFFE ID of the agent that attests the sandbox's
    /// workloads. `{environment}` is replaced by the environment's name, for agents
    /// that are one per sandbox.
    pub parent_id: String,
    /// `type:value` selectors of the supervisor's agent process inside the sandbox;
    /// `{environment}` is replaced as in `parent_id`.
    #[serde(default = "default_selectors")]
    pub selectors: Vec<String>,
    /// An entry whose environment is not listed is removed once it is this old (a
    /// younger one may belong to an environment being created right now).
    #[serde(default = "default_stale_after", with = "crate::setting::duration")]
    pub stale_after: Duration,
    /// How long one call to the server may take.
    #[serde(default = "default_request_timeout", with = "crate::setting::duration")]
    pub request_timeout: Duration,
}

fn default_selectors() -> Vec<String> {
    // The supervisor's job side runs as uid 2000 (the runner image's user).
    vec!["unix:uid:2000".into()]
}
fn default_stale_after() -> Duration {
    Duration::from_secs(300)
}
fn default_request_timeout() -> Duration {
    Duration::from_secs(10)
}

impl SpireConfig {
    /// Checks the templates with a sample environment name; `section` is where this
    /// table sits (e.g. `opensandbox.spire`).
    pub fn validate(&self, section: &str, problems: &mut Problems) {
        let mut invalid = |setting: &str, message: String| problems.add(format!("{section}.{setting}"), message);
        if let Err(message) = spiffe_id(&expand(&self.parent_id, "gdr-sample")) {
            invalid("parent_id", message);
        }
        if self.selectors.is_empty() {
            invalid("selectors", "at least one selector is needed (an entry without selectors matches nothing)".into());
        }
        if let Some(message) = self.selectors.iter().find_map(|selector| parse_selector(&expand(selector, "gdr-sample")).err()) {
            invalid("selectors", message);
        }
        if self.request_timeout.is_zero() {
            invalid("request_timeout", "must be positive".into());
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SpireError {
    #[error("SPIRE server at {socket} is unavailable: {detail} (check that it runs and that server_socket is its admin socket)")]
    Unavailable { socket: String, detail: String },
    #[error("SPIRE server refused the entry {id}: {message} (code {code})")]
    Refused { id: String, code: i32, message: String },
}

/// The entries of one placement of one installation.
#[derive(Debug, Clone)]
pub struct Registrar {
    client: EntryClient<Channel>,
    config: SpireConfig,
    placement: Placement,
    /// Entry ids of this installation start with this (environment names do).
    prefix: String,
}

impl Registrar {
    /// A registrar that connects on first use (a SPIRE server that is down at start
    /// only delays environments, like any unavailable backend). Needs a Tokio runtime.
    pub fn new(config: SpireConfig, placement: Placement, instance: &str) -> Self {
        let socket = config.server_socket.clone();
        // tonic needs a URI; the connector below ignores it and dials the unix socket.
        let endpoint = Endpoint::from_static("http://spire-server.invalid").timeout(config.request_timeout).connect_timeout(config.request_timeout);
        let channel = endpoint.connect_with_connector_lazy(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(socket).await?)) }
        }));
        Registrar { client: EntryClient::new(channel), config, placement, prefix: crate::driver::environment_name(instance, "") }
    }

    fn unavailable(&self, status: &tonic::Status) -> SpireError {
        SpireError::Unavailable { socket: self.config.server_socket.display().to_string(), detail: format!("{:?}: {}", status.code(), status.message()) }
    }

    /// The entry an environment's supervisor needs.
    fn entry_for(&self, name: &str, spiffe: &str) -> Result<Entry, SpireError> {
        let refused = |message: String| SpireError::Refused { id: name.to_owned(), code: 3, message };
        let selectors = self.config.selectors.iter().map(|s| parse_selector(&expand(s, name))).collect::<Result<Vec<_>, _>>().map_err(refused)?;
        Ok(Entry {
            id: name.to_owned(),
            spiffe_id: Some(spiffe_id(spiffe).map_err(refused)?),
            parent_id: Some(spiffe_id(&expand(&self.config.parent_id, name)).map_err(refused)?),
            selectors,
            hint: self.placement.to_string(),
            ..Entry::default()
        })
    }

    /// Registers the environment's workload; an existing entry for it is success.
    ///
    /// # Errors
    /// The server is unavailable (retry later) or refused the entry.
    pub async fn register(&self, name: &str, spiffe: &str) -> Result<(), SpireError> {
        let entry = self.entry_for(name, spiffe)?;
        let response = self
            .client
            .clone()
            .batch_create_entry(BatchCreateEntryRequest { entries: vec![entry], output_mask: None })
            .await
            .map_err(|status| self.unavailable(&status))?;
        let status = response.into_inner().results.into_iter().next().and_then(|r| r.status).unwrap_or_default();
        match status.code {
            CODE_OK | CODE_ALREADY_EXISTS => Ok(()),
            code => Err(self.result_error(name, code, status.message)),
        }
    }

    /// Removes the environment's entry; a missing one is not an error.
    ///
    /// # Errors
    /// The server is unavailable or refused the deletion.
    pub async fn unregister(&self, name: &str) -> Result<(), SpireError> {
        let response =
            self.client.clone().batch_delete_entry(BatchDeleteEntryRequest { ids: vec![name.to_owned()] }).await.map_err(|status| self.unavailable(&status))?;
        let status = response.into_inner().results.into_iter().next().and_then(|r| r.status).unwrap_or_default();
        match status.code {
            CODE_OK | CODE_NOT_FOUND => Ok(()),
            code => Err(self.result_error(name, code, status.message)),
        }
    }

    fn result_error(&self, id: &str, code: i32, message: String) -> SpireError {
        if matches!(code, CODE_UNAVAILABLE | CODE_DEADLINE_EXCEEDED | CODE_RESOURCE_EXHAUSTED | CODE_INTERNAL) {
            SpireError::Unavailable { socket: self.config.server_socket.display().to_string(), detail: format!("{id}: {message} (code {code})") }
        } else {
            SpireError::Refused { id: id.to_owned(), code, message }
        }
    }

    /// Ids of this placement's entries of this installation, with their creation times
    /// (seconds since the epoch).
    ///
    /// # Errors
    /// The server is unavailable.
    pub async fn entries(&self) -> Result<Vec<(String, i64)>, SpireError> {
        let mut found = Vec::new();
        let mut page_token = String::new();
        loop {
            let request = ListEntriesRequest {
                filter: Some(Filter { by_hint: Some(self.placement.to_string()), ..Filter::default() }),
                output_mask: None,
                page_size: 500,
                page_token,
            };
            let page = self.client.clone().list_entries(request).await.map_err(|status| self.unavailable(&status))?.into_inner();
            found.extend(page.entries.into_iter().filter(|e| e.id.starts_with(&self.prefix)).map(|e| (e.id, e.created_at)));
            if page.next_page_token.is_empty() {
                return Ok(found);
            }
            page_token = page.next_page_token;
        }
    }

    /// Removes the entries whose environment is not in `live` and that are older than
    /// `stale_after`; returns their ids.
    ///
    /// # Errors
    /// The server is unavailable.
    pub async fn sweep(&self, live: &HashSet<&str>) -> Result<Vec<String>, SpireError> {
        let now = crate::clock::now_secs();
        let cutoff = i64::try_from(now.saturating_sub(self.config.stale_after.as_secs())).unwrap_or(i64::MAX);
        let mut removed = Vec::new();
        for (id, created_at) in self.entries().await? {
            if live.contains(id.as_str()) || created_at > cutoff {
                continue;
            }
            self.unregister(&id).await?;
            removed.push(id);
        }
        Ok(removed)
    }
}

fn expand(template: &str, environment: &str) -> String {
    template.replace(PLACEHOLDER, environment)
}

/// `spiffe://td/path` as the Entry API wants it.
fn spiffe_id(id: &str) -> Result<Spiffeid, String> {
    let parsed = spiffe::SpiffeId::new(id).map_err(|e| format!("{id:?} is not a SPIFFE ID: {e}"))?;
    Ok(Spiffeid { trust_domain: parsed.trust_domain().to_string(), path: parsed.path().to_owned() })
}

/// `unix:uid:2000` → type `unix`, value `uid:2000`.
fn parse_selector(selector: &str) -> Result<Selector, String> {
    match selector.split_once(':') {
        Some((kind, value)) if !kind.is_empty() && !value.is_empty() => Ok(Selector { r#type: kind.to_owned(), value: value.to_owned() }),
        _ => Err(format!("{selector:?} is not a `type:value` selector, e.g. unix:uid:2000")),
    }
}

/// A driver whose environments each get their SPIRE entry: registered before the
/// environment is created (so the supervisor's wait ends as soon as its agent syncs),
/// removed after it is deleted, and swept when the environment is gone.
#[derive(Debug)]
pub struct Registered {
    inner: Arc<dyn Driver>,
    registrar: Registrar,
}

impl Registered {
    pub fn new(inner: Arc<dyn Driver>, registrar: Registrar) -> Self {
        Registered { inner, registrar }
    }

    /// The environment is gone: its entry goes too, or — when SPIRE cannot be reached —
    /// at the next sweep (the environment's deletion, and its pool slot, do not wait).
    async fn unregister_gone(&self, name: &str) {
        if let Err(error) = self.registrar.unregister(name).await {
            tracing::warn!(environment = %name, %error, "the SPIRE entry of a deleted environment stays until the next sweep");
        }
    }

    fn driver_error(&self, name: &str, error: &SpireError) -> DriverError {
        let placement = self.inner.placement().to_string();
        match error {
            SpireError::Unavailable { .. } => DriverError::Unavailable { placement, detail: error.to_string() },
            SpireError::Refused { .. } => DriverError::Refused { placement, name: name.to_owned(), detail: error.to_string() },
        }
    }
}

#[async_trait]
impl Driver for Registered {
    fn placement(&self) -> Placement {
        self.inner.placement()
    }

    async fn create(&self, spec: &EnvironmentSpec) -> Result<Environment, DriverError> {
        // Without an identity to wait for (SPIFFE off) there is nothing to register.
        if let Some(spiffe) = spec.env.get(contract::environment::SPIFFE_ID) {
            self.registrar.register(&spec.name, spiffe).await.map_err(|e| self.driver_error(&spec.name, &e))?;
        }
        match self.inner.create(spec).await {
            Ok(environment) => Ok(environment),
            Err(error) => {
                // A refused environment will not be tried again: leave no entry behind.
                // An unavailable backend keeps it for the retry (the sweep removes it if
                // the task ends instead).
                if error.is_refusal()
                    && let Err(cleanup) = self.registrar.unregister(&spec.name).await
                {
                    tracing::warn!(environment = %spec.name, "cannot remove the SPIRE entry of a refused environment: {cleanup}");
                }
                Err(error)
            }
        }
    }

    async fn get(&self, name: &str) -> Result<Option<Environment>, DriverError> {
        self.inner.get(name).await
    }

    async fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<Environment>, DriverError> {
        self.inner.list(selector).await
    }

    async fn stop(&self, name: &str) -> Result<(), DriverError> {
        self.inner.stop(name).await?;
        self.unregister_gone(name).await;
        Ok(())
    }

    async fn delete(&self, name: &str) -> Result<(), DriverError> {
        self.inner.delete(name).await?;
        self.unregister_gone(name).await;
        Ok(())
    }

    async fn changes(&self) -> Result<Option<Changes>, DriverError> {
        self.inner.changes().await
    }

    async fn sweep_leftovers(&self, listed: &[Environment]) -> Result<usize, DriverError> {
        let live: HashSet<&str> = listed.iter().map(|e| e.name.as_str()).collect();
        let removed = self.registrar.sweep(&live).await.map_err(|e| self.driver_error("(sweep)", &e))?;
        for id in &removed {
            tracing::info!(entry = %id, "SPIRE entry removed: its environment is gone");
        }
        Ok(removed.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(parent_id: &str, selectors: &[&str]) -> SpireConfig {
        SpireConfig {
            server_socket: "/run/spire/api.sock".into(),
            parent_id: parent_id.into(),
            selectors: selectors.iter().map(|s| (*s).to_owned()).collect(),
            stale_after: default_stale_after(),
            request_timeout: default_request_timeout(),
        }
    }

    #[test]
    fn templates_are_validated_with_their_setting_named() {
        let cases: &[(&str, &[&str], Option<&str>)] = &[
            ("spiffe://example.org/gdr/sandbox/{environment}", &["unix:uid:2000"], None),
            ("spiffe://example.org/ci-node", &["unix:uid:2000", "docker:label:gitea-dynamic-runner/environment:{environment}"], None),
            ("example.org/ci-node", &["unix:uid:2000"], Some("opensandbox.spire.parent_id")),
            ("spiffe:///ci-node", &["unix:uid:2000"], Some("opensandbox.spire.parent_id")),
            ("spiffe://example.org/a//b", &["unix:uid:2000"], Some("opensandbox.spire.parent_id")),
            ("spiffe://example.org/ci-node", &[], Some("opensandbox.spire.selectors")),
            ("spiffe://example.org/ci-node", &["uid2000"], Some("opensandbox.spire.selectors")),
            ("spiffe://example.org/ci-node", &[":2000"], Some("opensandbox.spire.selectors")),
        ];
        for (parent, selectors, expected) in cases {
            let result = Problems::check(|p| config(parent, selectors).validate("opensandbox.spire", p));
            let named = result.as_ref().err().map(|problems| problems.settings().concat());
            assert_eq!(named.as_deref(), *expected, "{parent} {selectors:?}: {result:?}");
        }
    }

    #[test]
    fn entries_are_named_after_their_environment_and_tagged_with_the_placement() {
        // Building the lazy channel needs a runtime.
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let registrar = runtime.block_on(async {
            Registrar::new(
                config("spiffe://example.org/gdr/sandbox/{environment}", &["unix:uid:2000", "docker:label:env:{environment}"]),
                Placement::VM_OPENSANDBOX,
                "0a1b2c3d",
            )
        });
        let entry = registrar.entry_for("gdr-0a1b2c3d-gitea-task-7", "spiffe://example.org/ci/o/r/build").unwrap();
        assert_eq!(entry.id, "gdr-0a1b2c3d-gitea-task-7");
        assert_eq!(entry.hint, "vm.opensandbox");
        assert_eq!(entry.spiffe_id, Some(Spiffeid { trust_domain: "example.org".into(), path: "/ci/o/r/build".into() }));
        assert_eq!(entry.parent_id.unwrap().path, "/gdr/sandbox/gdr-0a1b2c3d-gitea-task-7");
        assert_eq!(
            entry.selectors,
            vec![
                Selector { r#type: "unix".into(), value: "uid:2000".into() },
                Selector { r#type: "docker".into(), value: "label:env:gdr-0a1b2c3d-gitea-task-7".into() }
            ]
        );
        assert!(entry.id.starts_with(&registrar.prefix), "the sweep finds entries by this prefix");
        assert!(matches!(registrar.entry_for("x", "not-an-id"), Err(SpireError::Refused { .. })));
    }
}
