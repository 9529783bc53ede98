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
    /// The label every job of this runner must name (see README "Labels").
    #[serde(default = "default_required_label")]
    pub required_label: String,
    /// Also accept and declare the previous implementation's `pod` and `vm-dev`.
    #[serde(default)]
    pub legacy_labels: bool,
    #[serde(default = "default_fetch_interval", with = "duration")]
    pub fetch_interval: Duration,
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
    Embedded { path: PathBuf },
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
    },
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig::Embedded { path: PathBuf::from("/var/lib/gitea-dynamic-runner/store.redb") }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FacadeConfig {
    /// File with at least 32 bytes of HMAC key for assignment capabilities (mode 0600).
    pub capability_key_file: PathBuf,
    #[serde(default = "default_capability_ttl", with = "duration")]
    pub capability_ttl: Duration,
    /// Unix socket for environments without SPIFFE (docker driver); capability only.
    pub unix_socket: Option<PathBuf>,
    /// mTLS listener for environments with SPIFFE, e.g. `0.0.0.0:9443`.
    pub listen: Option<String>,
    /// Development mode: a plain-TCP listener (HTTP/2, no TLS) authenticated by the
    /// capability alone, for environments that cannot mount the unix socket (sandbox
    /// VMs) where no SPIRE runs. Only a loopback or private address, e.g.
    /// `10.0.0.5:9444`; environments then get `url = "http://10.0.0.5:9444"`.
    pub insecure_listen: Option<String>,
    /// The Workload API of the controller itself (for its own SVID).
    pub spiffe_endpoint_socket: Option<String>,
    /// The facade's URL and SPIFFE ID as environments see them.
    pub url: String,
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
    Duration::from_secs(2)
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

/// Environment variables that override settings, and the setting each one names.
const OVERRIDES: &[(&str, &str)] = &[
    ("GDR_GITEA_URL", "gitea.url"),
    ("GDR_GITEA_REGISTRATION_TOKEN_FILE", "gitea.registration_token_file"),
    ("GDR_GITEA_ENVIRONMENT_URL", "gitea.environment_url"),
    ("GDR_GITEA_CREDENTIAL_DIR", "gitea.credential_dir"),
    ("GDR_GITEA_REQUIRED_LABEL", "gitea.required_label"),
    ("GDR_GITEA_RUNNER_NAME", "gitea.runner_name"),
    ("GDR_IDENTITY_TRUST_DOMAIN", "identity.trust_domain"),
    ("GDR_FACADE_CAPABILITY_KEY_FILE", "facade.capability_key_file"),
    ("GDR_FACADE_URL", "facade.url"),
    ("GDR_FACADE_UNIX_SOCKET", "facade.unix_socket"),
    ("GDR_FACADE_LISTEN", "facade.listen"),
    ("GDR_FACADE_INSECURE_LISTEN", "facade.insecure_listen"),
    ("GDR_HTTP_LISTEN", "http.listen"),
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
        if let Some(opensandbox) = &self.opensandbox
            && let Err((setting, message)) = opensandbox.validate()
        {
            return invalid(&setting, message);
        }
        if self.pools.iter().any(|p| p.placement == Placement::CONTAINER_KUBERNETES) && self.kubernetes.is_none() {
            return invalid("kubernetes", "pool container.kubernetes needs a [kubernetes] section with namespace and image".into());
        }
        if let Some(kubernetes) = &self.kubernetes
            && let Err((setting, message)) = kubernetes.validate()
        {
            return invalid(&setting, message);
        }
        if self.facade.unix_socket.is_none() && self.facade.listen.is_none() && self.facade.insecure_listen.is_none() {
            return invalid("facade", "set facade.unix_socket, facade.listen (SPIFFE mTLS) or facade.insecure_listen (development mode)".into());
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
        if let Err(message) = contract::facade::FacadeUrl::parse(&self.facade.url) {
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
        if self.gitea.reconcile_interval < Duration::from_secs(1) {
            return invalid("gitea.reconcile_interval", "must be at least 1s".into());
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(300)).contains(&self.gitea.lease_ttl) {
            return invalid("gitea.lease_ttl", format!("{:?} must be between 1s and 5m", self.gitea.lease_ttl));
        }
        if let StoreConfig::Jetstream { url, .. } = &self.store
            && !url.starts_with("nats://")
            && !url.starts_with("tls://")
        {
            return invalid("store.url", format!("{url:?} must be a nats:// or tls:// URL (several, comma-separated, for a cluster)"));
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
unix_socket = "/run/gdr/facade.sock"
url = "unix:///run/gdr/facade.sock"

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
        assert_eq!(config.gitea.fetch_interval, Duration::from_secs(2));
        assert!(matches!(config.store, StoreConfig::Embedded { .. }));
        assert_eq!(config.http.listen, "127.0.0.1:9100");
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
        let spire_without_socket = format!("{SANDBOX}\n{SPIRE}\n[[pool]]");
        let spire_bad_parent = format!("{SANDBOX}\n{}\n[facade]\nenvironment_spiffe_endpoint_socket = \"unix:///s\"", SPIRE.replace("spiffe://", ""));
        let table: &[Case] = &[
            ("url = \"https://gitea.example.com\"", "url = \"gitea.example.com\"", &[], "gitea.url"),
            ("trust_domain = \"example.org\"", "trust_domain = \"Example Org\"", &[], "identity.trust_domain"),
            ("capacity = 4", "capacity = 0", &[], "pool.capacity"),
            ("placement = \"container.docker\"", "placement = \"vm.docker\"", &[], "placement"),
            ("unix_socket = \"/run/gdr/facade.sock\"", "", &[], "facade"),
            ("[identity]", "[identity]\ncolour = \"blue\"", &[], "colour"),
            ("", "", &[("GDR_GITEA_REGISTRATION_TOKEN", "t")], "registration_token_file"),
            ("[docker]\nimage = \"gitea-dynamic-runner/runner:latest\"", "", &[], "docker"),
            ("", "", &[("GDR_FACADE_CAPABILITY_KEY", "k")], "capability_key_file"),
            ("unix_socket = \"/run/gdr/facade.sock\"", "listen = \"0.0.0.0:9443\"", &[], "facade.spiffe_endpoint_socket"),
            ("[[pool]]", "[store]\nkind = \"jetstream\"\nurl = \"http://nats\"\n[[pool]]", &[], "store.url"),
            ("[[pool]]", "[store]\nkind = \"jetstream\"\nurl = \"nats://a:4222\"\nreplicas = 2\n[[pool]]", &[], "store.replicas"),
            ("url = \"https://gitea.example.com\"", "url = \"https://gitea.example.com\"\nlease_ttl = \"500ms\"", &[], "gitea.lease_ttl"),
            ("url = \"https://gitea.example.com\"", "url = \"https://gitea.example.com\"\nrequired_label = \"docker\"", &[], "gitea.required_label"),
            ("url = \"https://gitea.example.com\"", "url = \"https://gitea.example.com\"\nenvironment_url = \"gitea:3000\"", &[], "gitea.environment_url"),
            ("unix_socket = \"/run/gdr/facade.sock\"", "insecure_listen = \"0.0.0.0:9444\"", &[], "facade.insecure_listen"),
            ("unix_socket = \"/run/gdr/facade.sock\"", "insecure_listen = \"203.0.113.7:9444\"", &[], "facade.insecure_listen"),
            ("unix_socket = \"/run/gdr/facade.sock\"", "insecure_listen = \"controller:9444\"", &[], "facade.insecure_listen"),
            ("url = \"unix:///run/gdr/facade.sock\"", "url = \"http://198.51.100.1:9444\"", &[], "facade.url"),
            ("url = \"unix:///run/gdr/facade.sock\"", "url = \"ftp://controller\"", &[], "facade.url"),
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
