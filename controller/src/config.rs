//! The controller's configuration: a TOML file (`--config FILE`), then environment
//! overrides (`GDR_<SECTION>_<KEY>`), validated at start with messages that name the
//! setting. Secrets are only ever read from files (`*_file` settings): the
//! registration token, the capability key.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use serde::Deserialize;

use crate::assignment::placement::Placement;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub gitea: GiteaConfig,
    pub identity: IdentityConfig,
    #[serde(default)]
    pub store: StoreConfig,
    pub facade: FacadeConfig,
    #[serde(default)]
    pub http: HttpConfig,
    /// One pool per enabled placement.
    #[serde(rename = "pool", default)]
    pub pools: Vec<PoolConfig>,
    /// The docker driver (placement container.docker).
    pub docker: Option<crate::driver::docker::DockerConfig>,
    /// The OpenSandbox driver (placement vm.opensandbox).
    pub opensandbox: Option<crate::driver::opensandbox::OpenSandboxConfig>,
    /// The Kubernetes driver (placement container.kubernetes).
    pub kubernetes: Option<crate::driver::kubernetes::KubernetesConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GiteaConfig {
    /// The instance URL, e.g. `https://gitea.example.com`.
    pub url: String,
    /// Gitea as environments reach it (CI_GITEA_URL), when it differs from `url`:
    /// jobs' checkout, artifacts and API calls go there through the supervisor.
    pub environment_url: Option<String>,
    /// File holding the registration token; only read when a placement has no stored
    /// credential yet.
    pub registration_token_file: Option<PathBuf>,
    /// Where the runner credentials are kept, one file per placement (mode 0600). Every
    /// replica of the controller must see the same files.
    pub credential_dir: PathBuf,
    /// Registrations are named `<runner_name>-<placement>`.
    #[serde(default = "default_runner_name")]
    pub runner_name: String,
    /// This installation's name (lower-case letters, digits and `-`, at most 20): every
    /// environment it makes carries it, and it removes and counts only its own. Default:
    /// derived from `url` and the store, so two installations — two Gitea instances, or
    /// one Gitea with two stores during a migration — never share it. Set it to keep it
    /// when the URL or the store's location changes.
    pub installation: Option<String>,
    /// The label every job of this runner must name (see README "Labels").
    #[serde(default = "default_required_label")]
    pub required_label: String,
    /// Also accept and declare the previous implementation's `pod` and `vm-dev`.
    #[serde(default)]
    pub legacy_labels: bool,
    /// The pause after an empty FetchTask right after work was seen (a task handed out,
    /// an assignment ended, a queued job's webhook); it doubles with each empty reply in
    /// a row up to `fetch_interval_max` (gitea-runner's two settings of the same names).
    #[serde(default = "default_fetch_interval", with = "duration")]
    pub fetch_interval: Duration,
    /// The longest pause while idle: what an idle controller costs Gitea, one FetchTask
    /// per fetch loop this often. Never below `fetch_interval`.
    #[serde(default = "default_fetch_interval_max", with = "duration")]
    pub fetch_interval_max: Duration,
    /// The secret of Gitea's `workflow_job` webhook (Gitea ≥ 1.24), in a file: with it,
    /// `POST /hooks/gitea` on `http.listen` takes signed deliveries and a queued job is
    /// fetched at once instead of at the next poll (which stays as the fallback).
    pub webhook_secret_file: Option<PathBuf>,
    /// How long one FetchTask may take (gitea-runner's `fetch_timeout`). A reply that
    /// comes later is lost with any task in it, so keep it well above Gitea's response
    /// time under load.
    #[serde(default = "default_fetch_timeout", with = "duration")]
    pub fetch_timeout: Duration,
    #[serde(default = "default_keepalive", with = "duration")]
    pub keepalive_interval: Duration,
    /// How often environments are compared with assignments (dead ones fail their task).
    #[serde(default = "default_reconcile", with = "duration")]
    pub reconcile_interval: Duration,
    /// How long a scheduler holds its registration after its last renewal: a standby
    /// replica takes over this long after the holder died (at once after a clean stop).
    #[serde(default = "default_lease_ttl", with = "duration")]
    pub lease_ttl: Duration,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentityConfig {
    pub trust_domain: String,
}

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
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig::Embedded { path: PathBuf::from("/var/lib/gitea-dynamic-runner/store.redb"), retention: default_retention() }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FacadeConfig {
    /// File with at least 32 bytes of HMAC key for assignment capabilities (mode 0600).
    pub capability_key_file: PathBuf,
    #[serde(default = "default_capability_ttl", with = "duration")]
    pub capability_ttl: Duration,
    /// Where every docker environment gets its own facade socket
    /// (`<dir>/<environment>/facade.sock`, the directory mounted into that environment
    /// alone), e.g. `/run/gitea-dynamic-runner/environments`.
    pub environment_socket_dir: Option<PathBuf>,
    /// mTLS listener for environments with SPIFFE, e.g. `0.0.0.0:9443`.
    pub listen: Option<String>,
    /// Development mode: a plain-TCP listener (HTTP/2, no TLS) authenticated by the
    /// capability alone, for environments that cannot mount the unix socket (sandbox
    /// VMs) where no SPIRE runs. Only a loopback or private address, e.g.
    /// `10.0.0.5:9444`; environments then get `url = "http://10.0.0.5:9444"`.
    pub insecure_listen: Option<String>,
    /// The Workload API of the controller itself (for its own SVID).
    pub spiffe_endpoint_socket: Option<String>,
    /// The facade's URL and SPIFFE ID as Pods and sandboxes see them (docker
    /// environments use their own socket).
    pub url: Option<String>,
    pub spiffe_id: Option<String>,
    /// SPIFFE_ENDPOINT_SOCKET inside environments; set means environments wait for
    /// their job's SVID before claiming.
    pub environment_spiffe_endpoint_socket: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// `/metrics`, `/healthz`, `/readyz`.
    pub listen: String,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig { listen: "127.0.0.1:9100".into() }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    pub placement: Placement,
    pub capacity: usize,
}

fn default_runner_name() -> String {
    "gitea-dynamic-runner".into()
}
fn default_required_label() -> String {
    crate::assignment::placement::DISPOSABLE.into()
}
fn default_fetch_interval() -> Duration {
    Duration::from_millis(500)
}
/// An idle controller polls as it always has (every 2 s, gitea-runner's `fetch_interval`).
fn default_fetch_interval_max() -> Duration {
    Duration::from_secs(2)
}
fn default_fetch_timeout() -> Duration {
    Duration::from_secs(5)
}
fn default_keepalive() -> Duration {
    crate::scheduler::keepalive::DEFAULT_INTERVAL
}
fn default_reconcile() -> Duration {
    Duration::from_secs(10)
}
fn default_lease_ttl() -> Duration {
    crate::scheduler::LEASE_TTL
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
fn default_capability_ttl() -> Duration {
    Duration::from_secs(24 * 3600)
}

/// `"90s"`, `"3h"` … for `#[serde(with = "crate::config::duration")]`.
pub mod duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(deserializer)?;
        super::parse_duration(&text).map_err(serde::de::Error::custom)
    }
}

pub use contract::units::parse_duration;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{setting}: {message}")]
    Invalid { setting: String, message: String },
}

impl ConfigError {
    /// `setting` (its full name, e.g. `kubernetes.namespace`) is wrong: `message` says
    /// why and what to write instead.
    pub fn invalid(setting: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid { setting: setting.into(), message: message.into() }
    }
}

/// Environment variables that override settings, and the setting each one names.
const OVERRIDES: &[(&str, &str)] = &[
    ("GDR_GITEA_URL", "gitea.url"),
    ("GDR_GITEA_REGISTRATION_TOKEN_FILE", "gitea.registration_token_file"),
    ("GDR_GITEA_ENVIRONMENT_URL", "gitea.environment_url"),
    ("GDR_GITEA_CREDENTIAL_DIR", "gitea.credential_dir"),
    ("GDR_GITEA_REQUIRED_LABEL", "gitea.required_label"),
    ("GDR_GITEA_RUNNER_NAME", "gitea.runner_name"),
    ("GDR_GITEA_INSTALLATION", "gitea.installation"),
    ("GDR_IDENTITY_TRUST_DOMAIN", "identity.trust_domain"),
    ("GDR_FACADE_CAPABILITY_KEY_FILE", "facade.capability_key_file"),
    ("GDR_FACADE_URL", "facade.url"),
    ("GDR_FACADE_ENVIRONMENT_SOCKET_DIR", "facade.environment_socket_dir"),
    ("GDR_FACADE_LISTEN", "facade.listen"),
    ("GDR_FACADE_INSECURE_LISTEN", "facade.insecure_listen"),
    ("GDR_HTTP_LISTEN", "http.listen"),
];

/// Settings of earlier versions, and what replaces them.
const REPLACED: &[(&str, &str, &str)] = &[
    (
        "facade",
        "unix_socket",
        "one socket shared by every container let any job reach the facade for any assignment and broke every running job when the controller \
         restarted: set facade.environment_socket_dir = \"/run/gitea-dynamic-runner/environments\" instead (each docker environment gets its own \
         socket there) and drop the unix:// facade.url",
    ),
    ("docker", "facade_socket", "remove it: each environment's own facade directory (facade.environment_socket_dir) is mounted automatically"),
];

/// Environment variables that must never carry secrets directly.
const FORBIDDEN: &[(&str, &str)] = &[
    ("GDR_GITEA_REGISTRATION_TOKEN", "gitea.registration_token_file (GDR_GITEA_REGISTRATION_TOKEN_FILE)"),
    ("GDR_FACADE_CAPABILITY_KEY", "facade.capability_key_file (GDR_FACADE_CAPABILITY_KEY_FILE)"),
];

impl Config {
    /// Reads `path`, applies overrides from `env`, validates.
    ///
    /// # Errors
    /// A message naming the setting that is wrong.
    pub fn load(path: &std::path::Path, env: &BTreeMap<String, String>) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        Self::parse(&text, path, env)
    }

    /// # Errors
    /// A message naming the setting that is wrong.
    pub fn parse(text: &str, path: &std::path::Path, env: &BTreeMap<String, String>) -> Result<Config, ConfigError> {
        for (variable, instead) in FORBIDDEN {
            if env.contains_key(*variable) {
                return Err(ConfigError::Invalid {
                    setting: (*variable).to_owned(),
                    message: format!("secrets are only read from files: unset it and use {instead}"),
                });
            }
        }
        let mut document: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Parse { path: path.to_owned(), message: e.to_string() })?;
        for (section, key, instead) in REPLACED {
            if document.get(*section).and_then(toml::Value::as_table).is_some_and(|table| table.contains_key(*key)) {
                return Err(ConfigError::Invalid { setting: format!("{section}.{key}"), message: format!("is no longer a setting: {instead}") });
            }
        }
        for (variable, setting) in OVERRIDES {
            if let Some(value) = env.get(*variable) {
                let (section, key) = setting.split_once('.').unwrap_or((setting, ""));
                let table = document.entry(section.to_owned()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
                if let toml::Value::Table(table) = table {
                    table.insert(key.to_owned(), toml::Value::String(value.clone()));
                }
            }
        }
        let config: Config =
            toml::Value::Table(document).try_into().map_err(|e: toml::de::Error| ConfigError::Parse { path: path.to_owned(), message: e.to_string() })?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |setting: &str, message: String| Err(ConfigError::Invalid { setting: setting.to_owned(), message });
        if !(self.gitea.url.starts_with("http://") || self.gitea.url.starts_with("https://")) {
            return invalid("gitea.url", format!("{:?} must be an http(s) URL of the Gitea instance", self.gitea.url));
        }
        if let Some(url) = &self.gitea.environment_url
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            return invalid("gitea.environment_url", format!("{url:?} must be an http(s) URL of the Gitea instance as environments reach it"));
        }
        if let Some(installation) = &self.gitea.installation
            && (installation.is_empty()
                || installation.len() > 20
                || !installation.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                || installation.starts_with('-')
                || installation.ends_with('-'))
        {
            return invalid(
                "gitea.installation",
                format!("{installation:?} must be 1 to 20 lower-case letters, digits and inner dashes (it is part of every environment's name)"),
            );
        }
        if let Err(message) = self.label_policy().validate() {
            return invalid("gitea.required_label", message);
        }
        if let Err(error) = crate::assignment::identity::validate_trust_domain(&self.identity.trust_domain) {
            return invalid("identity.trust_domain", error.to_string());
        }
        if self.pools.is_empty() {
            return invalid("pool", "at least one [[pool]] with placement and capacity is required".into());
        }
        let mut seen = std::collections::HashSet::new();
        for pool in &self.pools {
            if pool.capacity == 0 || pool.capacity > 10_000 {
                return invalid("pool.capacity", format!("{} for {} must be 1 to 10000", pool.capacity, pool.placement));
            }
            if !seen.insert(pool.placement) {
                return invalid("pool.placement", format!("{} is configured twice", pool.placement));
            }
        }
        if self.pools.iter().any(|p| p.placement == Placement::CONTAINER_DOCKER) && self.docker.is_none() {
            return invalid("docker", "pool container.docker needs a [docker] section with at least `image`".into());
        }
        if let Some(docker) = &self.docker {
            docker.validate_configured()?;
        }
        if self.pools.iter().any(|p| p.placement == Placement::VM_OPENSANDBOX) && self.opensandbox.is_none() {
            return invalid("opensandbox", "pool vm.opensandbox needs an [opensandbox] section with url, api_key_file and image".into());
        }
        // Environments wait for an SVID only when they are told where the agent is.
        let spire_sections = [
            ("opensandbox.spire", "sandboxes", self.opensandbox.as_ref().is_some_and(|o| o.spire.is_some())),
            ("kubernetes.spire", "Pods", self.kubernetes.as_ref().is_some_and(|k| k.spire.is_some())),
        ];
        for (section, environments, configured) in spire_sections {
            if configured && self.facade.environment_spiffe_endpoint_socket.is_none() {
                return invalid(
                    section,
                    format!(
                        "{environments} get SPIRE entries only when they wait for an SVID: set facade.environment_spiffe_endpoint_socket (the agent's socket inside {environments})"
                    ),
                );
            }
        }
        if let Some(opensandbox) = &self.opensandbox {
            opensandbox.validate()?;
        }
        if self.pools.iter().any(|p| p.placement == Placement::CONTAINER_KUBERNETES) && self.kubernetes.is_none() {
            return invalid("kubernetes", "pool container.kubernetes needs a [kubernetes] section with namespace and image".into());
        }
        if let Some(kubernetes) = &self.kubernetes {
            kubernetes.validate()?;
        }
        if self.facade.environment_socket_dir.is_none() && self.facade.listen.is_none() && self.facade.insecure_listen.is_none() {
            return invalid(
                "facade",
                "set facade.environment_socket_dir (docker), facade.listen (SPIFFE mTLS) or facade.insecure_listen (development mode)".into(),
            );
        }
        let socket_placements = crate::facade::sockets::PLACEMENTS;
        if self.facade.environment_socket_dir.is_none() && self.pools.iter().any(|p| socket_placements.contains(&p.placement)) {
            return invalid(
                "facade.environment_socket_dir",
                "pool container.docker needs it: each container gets its own facade socket there, e.g. \"/run/gitea-dynamic-runner/environments\"".into(),
            );
        }
        if let Some(dir) = &self.facade.environment_socket_dir
            && !dir.is_absolute()
        {
            return invalid("facade.environment_socket_dir", format!("{} must be an absolute path", dir.display()));
        }
        if self.facade.url.is_none() && self.pools.iter().any(|p| !socket_placements.contains(&p.placement)) {
            return invalid("facade.url", "required for Pods and sandboxes: the https:// (SPIFFE mTLS) or http:// (development mode) URL they reach".into());
        }
        if let Some(listen) = &self.facade.insecure_listen {
            let address: std::net::SocketAddr = match listen.parse() {
                Ok(address) => address,
                Err(_) => return invalid("facade.insecure_listen", format!("{listen:?} must be a literal ip:port, e.g. 10.0.0.5:9444")),
            };
            if let Err(message) = contract::facade::insecure_address(address) {
                return invalid("facade.insecure_listen", message);
            }
        }
        if let Some(url) = &self.facade.url
            && let Err(message) = contract::facade::FacadeUrl::parse(url)
        {
            return invalid("facade.url", message);
        }
        if self.facade.listen.is_some() && self.facade.spiffe_endpoint_socket.is_none() {
            return invalid("facade.spiffe_endpoint_socket", "required with facade.listen (the mTLS listener needs the controller's SVID)".into());
        }
        if self.facade.capability_ttl < Duration::from_secs(60) {
            return invalid("facade.capability_ttl", "must be at least 1m".into());
        }
        if self.gitea.keepalive_interval >= Duration::from_secs(600) || self.gitea.keepalive_interval.is_zero() {
            return invalid("gitea.keepalive_interval", "must be between 1s and 10m (Gitea's zombie timeout)".into());
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(60)).contains(&self.gitea.fetch_timeout) {
            return invalid("gitea.fetch_timeout", format!("{:?} must be between 1s and 60s", self.gitea.fetch_timeout));
        }
        if self.gitea.reconcile_interval < Duration::from_secs(1) {
            return invalid("gitea.reconcile_interval", "must be at least 1s".into());
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(300)).contains(&self.gitea.lease_ttl) {
            return invalid("gitea.lease_ttl", format!("{:?} must be between 1s and 5m", self.gitea.lease_ttl));
        }
        if let StoreConfig::Jetstream { url, .. } = &self.store {
            let redacted = crate::store::jetstream::redact_url(url);
            if url.split(',').any(|server| !server.trim().starts_with("nats://") && !server.trim().starts_with("tls://")) {
                return invalid("store.url", format!("{redacted:?} must be a nats:// or tls:// URL (several, comma-separated, for a cluster)"));
            }
            if url.contains('@') {
                return invalid(
                    "store.url",
                    format!("{redacted:?} carries credentials, which would end up in logs: use store.credentials_file or store.token_file"),
                );
            }
        }
        if !(Duration::from_secs(60)..=Duration::from_secs(365 * 24 * 3600)).contains(&self.store.retention()) {
            return invalid("store.retention", format!("{:?} must be between 1m and 365d", self.store.retention()));
        }
        if let StoreConfig::Jetstream { replicas, .. } = &self.store
            && ![1, 3, 5].contains(replicas)
        {
            return invalid("store.replicas", format!("{replicas} must be 1, 3 or 5 (a JetStream cluster of at least that many nodes)"));
        }
        Ok(())
    }

    /// Total capacity of all pools.
    pub fn total_capacity(&self) -> usize {
        self.pools.iter().map(|p| p.capacity).sum()
    }

    /// This installation's name (`gitea.installation`, or its default).
    pub fn installation(&self) -> String {
        self.gitea.installation.clone().unwrap_or_else(|| crate::driver::instance_of(&self.gitea.url, &self.store.location()))
    }

    pub fn label_policy(&self) -> crate::assignment::placement::LabelPolicy {
        crate::assignment::placement::LabelPolicy { required: self.gitea.required_label.clone(), legacy: self.gitea.legacy_labels }
    }

    pub fn rules(&self) -> crate::assignment::Rules {
        crate::assignment::Rules { trust_domain: self.identity.trust_domain.clone(), labels: self.label_policy() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[gitea]
url = "https://gitea.example.com"
registration_token_file = "/etc/gdr/registration-token"
credential_dir = "/var/lib/gdr/runners"

[identity]
trust_domain = "example.org"

[facade]
capability_key_file = "/etc/gdr/capability.key"
environment_socket_dir = "/run/gdr/environments"

[[pool]]
placement = "container.docker"
capacity = 4

[docker]
image = "gitea-dynamic-runner/runner:latest"
"#;

    fn parse(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let env = env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        Config::parse(text, std::path::Path::new("controller.toml"), &env)
    }

    #[test]
    fn minimal_config_and_defaults() {
        let config = parse(MINIMAL, &[]).unwrap();
        assert_eq!(config.total_capacity(), 4);
        assert_eq!((config.gitea.fetch_interval, config.gitea.fetch_interval_max), (Duration::from_millis(500), Duration::from_secs(2)));
        assert!(matches!(config.store, StoreConfig::Embedded { .. }));
        assert_eq!(config.http.listen, "127.0.0.1:9100");
    }

    #[test]
    fn installations_differ_by_gitea_and_by_store_unless_named() {
        let embedded = parse(MINIMAL, &[]).unwrap();
        let other_store = parse(&MINIMAL.replace("[[pool]]", "[store]\nkind = \"embedded\"\npath = \"/srv/other.redb\"\n[[pool]]"), &[]).unwrap();
        let other_gitea = parse(MINIMAL, &[("GDR_GITEA_URL", "https://gitea.other.example")]).unwrap();
        assert_ne!(embedded.installation(), other_store.installation());
        assert_ne!(embedded.installation(), other_gitea.installation());
        let jetstream =
            |url: &str| parse(&MINIMAL.replace("[[pool]]", &format!("[store]\nkind = \"jetstream\"\nurl = \"{url}\"\n[[pool]]")), &[]).unwrap().installation();
        assert_eq!(jetstream("nats://a:4222,nats://b:4222"), jetstream("nats://b:4222, nats://a:4222"), "the same cluster listed in another order");
        let named = parse(&MINIMAL.replace("credential_dir", "installation = \"prod\"\ncredential_dir"), &[]).unwrap();
        assert_eq!(named.installation(), "prod");
    }

    #[test]
    fn environment_overrides_win() {
        let config = parse(MINIMAL, &[("GDR_GITEA_URL", "http://other:3000"), ("GDR_IDENTITY_TRUST_DOMAIN", "ci.example")]).unwrap();
        assert_eq!(config.gitea.url, "http://other:3000");
        assert_eq!(config.identity.trust_domain, "ci.example");
    }

    const SANDBOX: &str = "[opensandbox]\nurl = \"http://sandbox:8080\"\napi_key_file = \"/k\"\nimage = \"runner\"";
    const SPIRE: &str = "[opensandbox.spire]\nserver_socket = \"/s\"\nparent_id = \"spiffe://example.org/node\"";

    /// Each mistake names its setting.
    #[test]
    fn invalid_settings_are_named() {
        type Case<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)], &'a str);
        const SOCKETS: &str = "environment_socket_dir = \"/run/gdr/environments\"";
        let spire_without_socket = format!("{SANDBOX}\n{SPIRE}\n[[pool]]");
        let sandbox_without_url = format!("{SANDBOX}\n[[pool]]\nplacement = \"vm.opensandbox\"\ncapacity = 1\n[[pool]]");
        let spire_bad_parent = format!("{SANDBOX}\n{}\n[facade]\nenvironment_spiffe_endpoint_socket = \"unix:///s\"", SPIRE.replace("spiffe://", ""));
        let table: &[Case] = &[
            ("url = \"https://gitea.example.com\"", "url = \"gitea.example.com\"", &[], "gitea.url"),
            ("trust_domain = \"example.org\"", "trust_domain = \"Example Org\"", &[], "identity.trust_domain"),
            ("capacity = 4", "capacity = 0", &[], "pool.capacity"),
            ("placement = \"container.docker\"", "placement = \"vm.docker\"", &[], "placement"),
            (SOCKETS, "", &[], "facade"),
            (SOCKETS, "listen = \"10.0.0.1:9443\"\nspiffe_endpoint_socket = \"unix:///s\"", &[], "facade.environment_socket_dir"),
            (SOCKETS, "environment_socket_dir = \"run/gdr\"", &[], "facade.environment_socket_dir"),
            (SOCKETS, "unix_socket = \"/run/gdr/facade.sock\"", &[], "facade.unix_socket"),
            ("[docker]", "[docker]\nfacade_socket = \"/run/gdr/facade.sock\"", &[], "docker.facade_socket"),
            ("[docker]", "[docker]\nmemory = \"100M\"", &[], "docker.memory"),
            ("[docker]", "[docker]\ncpus = \"many\"", &[], "docker.cpus"),
            ("[docker]", "[docker]\npids_limit = 10", &[], "docker.pids_limit"),
            ("[docker]", "[docker]\nstorage_size = \"1M\"", &[], "docker.storage_size"),
            ("[docker]", "[docker]\nstop_seconds = 10", &[], "docker.stop_seconds"),
            ("[identity]", "[identity]\ncolour = \"blue\"", &[], "colour"),
            ("", "", &[("GDR_GITEA_REGISTRATION_TOKEN", "t")], "registration_token_file"),
            ("[docker]\nimage = \"gitea-dynamic-runner/runner:latest\"", "", &[], "docker"),
            ("", "", &[("GDR_FACADE_CAPABILITY_KEY", "k")], "capability_key_file"),
            (SOCKETS, "environment_socket_dir = \"/e\"\nlisten = \"0.0.0.0:9443\"", &[], "facade.spiffe_endpoint_socket"),
            ("[[pool]]", "[store]\nkind = \"jetstream\"\nurl = \"http://nats\"\n[[pool]]", &[], "store.url"),
            ("[[pool]]", "[store]\nkind = \"jetstream\"\nurl = \"nats://user:pw@nats:4222\"\n[[pool]]", &[], "store.credentials_file"),
            ("[[pool]]", "[store]\nkind = \"embedded\"\npath = \"/s\"\nretention = \"10s\"\n[[pool]]", &[], "store.retention"),
            ("[[pool]]", "[store]\nkind = \"jetstream\"\nurl = \"nats://a:4222\"\nreplicas = 2\n[[pool]]", &[], "store.replicas"),
            ("url = \"https://gitea.example.com\"", "url = \"https://gitea.example.com\"\nlease_ttl = \"500ms\"", &[], "gitea.lease_ttl"),
            ("url = \"https://gitea.example.com\"", "url = \"https://gitea.example.com\"\ninstallation = \"Prod_1\"", &[], "gitea.installation"),
            ("url = \"https://gitea.example.com\"", "url = \"https://gitea.example.com\"\nrequired_label = \"docker\"", &[], "gitea.required_label"),
            ("url = \"https://gitea.example.com\"", "url = \"https://gitea.example.com\"\nenvironment_url = \"gitea:3000\"", &[], "gitea.environment_url"),
            (SOCKETS, "environment_socket_dir = \"/e\"\ninsecure_listen = \"0.0.0.0:9444\"", &[], "facade.insecure_listen"),
            (SOCKETS, "environment_socket_dir = \"/e\"\ninsecure_listen = \"203.0.113.7:9444\"", &[], "facade.insecure_listen"),
            (SOCKETS, "environment_socket_dir = \"/e\"\ninsecure_listen = \"controller:9444\"", &[], "facade.insecure_listen"),
            (SOCKETS, "environment_socket_dir = \"/e\"\nurl = \"http://198.51.100.1:9444\"", &[], "facade.url"),
            (SOCKETS, "environment_socket_dir = \"/e\"\nurl = \"ftp://controller\"", &[], "facade.url"),
            ("[[pool]]", &sandbox_without_url, &[], "facade.url"),
            ("[[pool]]", &spire_without_socket, &[], "opensandbox.spire"),
            ("[facade]", &spire_bad_parent, &[], "opensandbox.spire.parent_id"),
        ];
        for &(from, to, env, setting) in table {
            let text = if from.is_empty() { MINIMAL.to_owned() } else { MINIMAL.replacen(from, to, 1) };
            let error = parse(&text, env).expect_err(&format!("accepted {to:?} {env:?}")).to_string();
            assert!(error.contains(setting), "{to:?}: {error}");
        }
        let twice = format!("{MINIMAL}\n[[pool]]\nplacement = \"container.docker\"\ncapacity = 1\n");
        assert!(parse(&twice, &[]).unwrap_err().to_string().contains("twice"));
    }

    #[test]
    fn the_example_config_is_valid() {
        let text = include_str!("../../config/controller.example.toml");
        let config = parse(text, &[]).unwrap();
        assert_eq!(config.pools.len(), 1);
    }

    /// The controller.toml of the Kubernetes manifests (the ConfigMap) and the example's
    /// commented `[kubernetes]` sections are valid too.
    #[test]
    fn the_kubernetes_configs_are_valid() {
        let manifest = include_str!("../../config/kubernetes/controller.yaml");
        let start = manifest.find("controller.toml: |\n").unwrap() + "controller.toml: |\n".len();
        let text: String = manifest[start..].lines().take_while(|l| l.starts_with("    ") || l.is_empty()).map(|l| format!("{}\n", l.trim_start())).collect();
        let config = parse(&text, &[]).unwrap();
        assert_eq!(config.pools[0].placement, Placement::CONTAINER_KUBERNETES);
        let kubernetes = config.kubernetes.unwrap();
        assert_eq!(kubernetes.namespace, "gitea-jobs");
        assert!(kubernetes.spire.is_some() && kubernetes.workload_api.is_some());

        let example = include_str!("../../config/controller.example.toml");
        let (docker, commented) = example.split_once("# The Kubernetes driver").unwrap();
        let uncommented: String =
            commented.lines().filter_map(|l| l.strip_prefix("# ")).filter(|l| l.starts_with('[') || l.contains(" = ")).map(|l| format!("{l}\n")).collect();
        // Pods reach the facade over TCP: its URL (a commented line of the example) too.
        let docker = docker.replacen("environment_socket_dir", "url = \"https://gitea-dynamic-runner.ci.svc:9443\"\nenvironment_socket_dir", 1);
        let config = parse(&format!("{docker}\n{uncommented}"), &[]).unwrap();
        assert_eq!(config.pools.len(), 2);
        assert_eq!(config.kubernetes.unwrap().tolerations.len(), 1);
    }

    #[test]
    fn the_default_labels_do_not_attract_self_hosted_jobs() {
        let config = parse(MINIMAL, &[]).unwrap();
        assert_eq!(config.label_policy(), crate::assignment::placement::LabelPolicy::default());
        let seed = parse(&MINIMAL.replacen("[identity]", "required_label = \"self-hosted\"\nlegacy_labels = true\n\n[identity]", 1), &[]).unwrap();
        assert_eq!(seed.label_policy(), crate::assignment::placement::LabelPolicy::seed_compatible());
    }
}
