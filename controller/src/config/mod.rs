//! The controller's configuration: a TOML file (`--config FILE`), then environment
//! overrides (`GDR_<SECTION>_<KEY>`), validated at start with messages that name every
//! setting that is wrong at once. Secrets are only ever read from files (`*_file`
//! settings): the registration token, the capability key.
//!
//! Each section checks itself (its owner's `validate`: [`gitea`], [`store`], [`facade`],
//! the drivers' sections); this module checks what spans sections (a pool needs its
//! driver's section, SPIRE entries need environments that wait for an SVID).

pub mod cache;
pub mod facade;
pub mod gitea;
pub mod store;

use std::{collections::BTreeMap, path::PathBuf};

use serde::Deserialize;

pub use self::{
    cache::{CacheConfig, CacheStorage, S3Settings},
    facade::{FacadeConfig, HttpConfig},
    gitea::{GiteaConfig, IdentityConfig},
    store::StoreConfig,
};
use crate::{
    assignment::placement::Placement,
    driver::{docker::DockerConfig, kubernetes::KubernetesConfig, opensandbox::OpenSandboxConfig},
    setting::{Invalid, Problems},
};

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
    pub docker: Option<DockerConfig>,
    /// The OpenSandbox driver (placement vm.opensandbox).
    pub opensandbox: Option<OpenSandboxConfig>,
    /// The Kubernetes driver (placement container.kubernetes).
    pub kubernetes: Option<KubernetesConfig>,
    /// The jobs' cache (`actions/cache`).
    #[serde(default)]
    pub cache: CacheConfig,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    pub placement: Placement,
    pub capacity: usize,
}

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
    #[error(transparent)]
    Invalid(#[from] Problems),
}

impl From<Invalid> for ConfigError {
    fn from(invalid: Invalid) -> Self {
        let mut problems = Problems::default();
        problems.push(invalid);
        ConfigError::Invalid(problems)
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
    /// What cannot be read or parsed, or every setting that is wrong.
    pub fn load(path: &std::path::Path, env: &BTreeMap<String, String>) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        Self::parse(&text, path, env)
    }

    /// # Errors
    /// What cannot be parsed, or every setting that is wrong.
    pub fn parse(text: &str, path: &std::path::Path, env: &BTreeMap<String, String>) -> Result<Config, ConfigError> {
        Problems::check(|problems| {
            for (variable, instead) in FORBIDDEN.iter().filter(|(variable, _)| env.contains_key(*variable)) {
                problems.add(*variable, format!("secrets are only read from files: unset it and use {instead}"));
            }
        })?;
        let mut document: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Parse { path: path.to_owned(), message: e.to_string() })?;
        Problems::check(|problems| {
            for (section, key, instead) in REPLACED {
                if document.get(*section).and_then(toml::Value::as_table).is_some_and(|table| table.contains_key(*key)) {
                    problems.add(format!("{section}.{key}"), format!("is no longer a setting: {instead}"));
                }
            }
        })?;
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
        Problems::check(|problems| config.validate(problems))?;
        Ok(config)
    }

    /// Every section, then what spans sections.
    fn validate(&self, problems: &mut Problems) {
        self.gitea.validate(problems);
        self.identity.validate(problems);
        self.validate_pools(problems);
        if let Some(docker) = &self.docker {
            docker.validate_configured(problems);
            let capacity = self.pools.iter().find(|pool| pool.placement == Placement::CONTAINER_DOCKER).map(|pool| pool.capacity);
            docker.runner_ids.validate(capacity, problems);
        }
        if let Some(opensandbox) = &self.opensandbox {
            opensandbox.validate(problems);
        }
        if let Some(kubernetes) = &self.kubernetes {
            kubernetes.validate(problems);
        }
        self.validate_spire(problems);
        self.facade.validate(&self.pools, problems);
        self.store.validate(problems);
        self.cache.validate(problems);
    }

    /// At least one pool, each placement once, each with its driver's section.
    fn validate_pools(&self, problems: &mut Problems) {
        if self.pools.is_empty() {
            problems.add("pool", "at least one [[pool]] with placement and capacity is required");
        }
        let mut seen = std::collections::HashSet::new();
        for pool in &self.pools {
            if pool.capacity == 0 || pool.capacity > 10_000 {
                problems.add("pool.capacity", format!("{} for {} must be 1 to 10000", pool.capacity, pool.placement));
            }
            if !seen.insert(pool.placement) {
                problems.add("pool.placement", format!("{} is configured twice", pool.placement));
            }
        }
        let sections = [
            (Placement::CONTAINER_DOCKER, self.docker.is_some(), "docker", "pool container.docker needs a [docker] section with at least `image`"),
            (
                Placement::VM_OPENSANDBOX,
                self.opensandbox.is_some(),
                "opensandbox",
                "pool vm.opensandbox needs an [opensandbox] section with url, api_key_file and image",
            ),
            (
                Placement::CONTAINER_KUBERNETES,
                self.kubernetes.is_some(),
                "kubernetes",
                "pool container.kubernetes needs a [kubernetes] section with namespace and image",
            ),
        ];
        for (placement, configured, section, message) in sections {
            if !configured && self.pools.iter().any(|p| p.placement == placement) {
                problems.add(section, message);
            }
        }
    }

    /// Environments wait for an SVID only when they are told where the agent is.
    fn validate_spire(&self, problems: &mut Problems) {
        let spire_sections = [
            ("opensandbox.spire", "sandboxes", self.opensandbox.as_ref().is_some_and(|o| o.spire.is_some())),
            ("kubernetes.spire", "Pods", self.kubernetes.as_ref().is_some_and(|k| k.spire.is_some())),
        ];
        for (section, environments, configured) in spire_sections {
            if configured && self.facade.environment_spiffe_endpoint_socket.is_none() {
                problems.add(
                    section,
                    format!(
                        "{environments} get SPIRE entries only when they wait for an SVID: set facade.environment_spiffe_endpoint_socket (the agent's socket inside {environments})"
                    ),
                );
            }
        }
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
        self.gitea.label_policy()
    }

    /// Where the jobs' cache keeps its entries: `[cache]`'s choice; `None` when it is off
    /// or not configured.
    pub fn cache_storage(&self) -> Option<CacheStorage> {
        self.cache.storage()
    }

    /// The embedded store's directory, if the store is embedded.
    pub fn store_dir(&self) -> Option<&std::path::Path> {
        match &self.store {
            StoreConfig::Embedded { path, .. } => path.parent(),
            StoreConfig::Jetstream { .. } => None,
        }
    }

    pub fn rules(&self) -> crate::assignment::Rules {
        crate::assignment::Rules { trust_domain: self.identity.trust_domain.clone(), labels: self.label_policy() }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

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

    /// A file with several mistakes names them all, in the order of its sections.
    #[test]
    fn every_wrong_setting_is_named_at_once() {
        let text = MINIMAL
            .replacen("capacity = 4", "capacity = 0", 1)
            .replacen("trust_domain = \"example.org\"", "trust_domain = \"Example Org\"", 1)
            .replacen("[docker]", "[docker]\nmemory = \"1M\"", 1);
        let Err(ConfigError::Invalid(problems)) = parse(&text, &[]) else { panic!("accepted") };
        assert_eq!(problems.settings(), ["identity.trust_domain", "pool.capacity", "docker.memory"]);
    }

    #[test]
    fn the_example_config_is_valid() {
        let text = include_str!("../../../config/controller.example.toml");
        let config = parse(text, &[]).unwrap();
        assert_eq!(config.pools.len(), 1);
    }

    /// The controller.toml of the Kubernetes manifests (the ConfigMap) and the example's
    /// commented `[kubernetes]` sections are valid too.
    #[test]
    fn the_kubernetes_configs_are_valid() {
        let manifest = include_str!("../../../config/kubernetes/controller.yaml");
        let start = manifest.find("controller.toml: |\n").unwrap() + "controller.toml: |\n".len();
        let text: String = manifest[start..].lines().take_while(|l| l.starts_with("    ") || l.is_empty()).map(|l| format!("{}\n", l.trim_start())).collect();
        let config = parse(&text, &[]).unwrap();
        assert_eq!(config.pools[0].placement, Placement::CONTAINER_KUBERNETES);
        let kubernetes = config.kubernetes.unwrap();
        assert_eq!(kubernetes.namespace, "gitea-jobs");
        assert!(kubernetes.spire.is_some() && kubernetes.workload_api.is_some());

        let example = include_str!("../../../config/controller.example.toml");
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
