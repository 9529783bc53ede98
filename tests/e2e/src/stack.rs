//! The controller's components in this process (`controller::app::run_with`, exactly
//! what `controller run` runs), configured as a user would (a TOML file), with the
//! store handed in so tests can watch the assignments.

use std::{path::PathBuf, sync::Arc, time::Duration};

use controller::{
    app::{self, Components, Overrides},
    config::Config,
    store::{Record, Store},
};
use testkit::controller_config::ControllerConfig;
use tokio_util::sync::CancellationToken;

/// How a test controller is set up.
#[derive(Debug, Clone)]
pub struct Options {
    pub gitea_url: String,
    /// Gitea as environments reach it.
    pub environment_gitea_url: Option<String>,
    pub registration_token: String,
    pub capacity: usize,
    pub image: String,
    pub docker_socket: PathBuf,
    /// TOML of the `[store]` section; default: an embedded store in the state dir.
    pub store: Option<String>,
    /// `--components`; default all.
    pub components: String,
    /// Share this state directory (credentials, key) with another controller.
    pub state_dir: Option<PathBuf>,
    /// Where the facade makes each docker environment's socket; default in the state dir.
    pub socket_dir: Option<PathBuf>,
    pub extra_gitea: String,
    /// `gitea.fetch_interval` and `fetch_interval_max` both (default 300 ms: a steady
    /// poll); None leaves the controller's defaults.
    pub fetch_interval: Option<String>,
    /// More `[docker]` settings (TOML lines).
    pub docker_extra: String,
    /// The capability key written into a new state directory (two installations have two).
    pub capability_key: String,
    /// `[http] listen` (default a free port of 127.0.0.1).
    pub http_listen: String,
    /// Docker and Kubernetes environments get a job-local dockerd (the tests' default:
    /// their jobs run `docker`); false is the unprivileged default of the product.
    pub job_dockerd: bool,
    /// Run jobs as OpenSandbox sandboxes (vm.opensandbox) instead of docker containers.
    pub opensandbox: Option<SandboxOptions>,
    /// Run jobs as Pods (container.kubernetes) instead of docker containers.
    pub kubernetes: Option<PodOptions>,
    /// More settings of any section (a TOML document merged last, e.g. `[cache]` limits).
    pub extra: String,
}

/// The container.kubernetes placement: a namespace of the real cluster, and the
/// facade's development-mode listener on the host address Pods reach.
#[derive(Debug, Clone)]
pub struct PodOptions {
    pub kubeconfig: PathBuf,
    pub namespace: String,
    /// `ip:port` Pods reach.
    pub facade_listen: String,
    /// More `[kubernetes]` settings (TOML lines).
    pub extra: String,
    /// SPIFFE instead of the development mode: the facade's mTLS listener, the agent's
    /// socket directory mounted into each Pod, and a SPIRE entry per Pod.
    pub spire: Option<PodSpire>,
}

/// How Pods get their identity in a test: the real SPIRE server, a node agent with the
/// `k8s` workload attestor whose socket directory every Pod mounts.
#[derive(Debug, Clone)]
pub struct PodSpire {
    pub server_socket: PathBuf,
    pub agent_socket: PathBuf,
    pub controller_id: String,
    pub parent_id: String,
}

impl PodSpire {
    pub const SOCKET_DIR_IN_POD: &str = "/run/spire/sockets";
}

impl PodOptions {
    /// A namespace of `cluster` and the facade on a free port of the Pods' host address.
    pub fn on(cluster: &crate::kubernetes::Cluster, namespace: &str) -> PodOptions {
        let host = crate::kubernetes::Cluster::HOST_IP;
        let port = testkit::free_port(host.into());
        PodOptions {
            kubeconfig: cluster.kubeconfig.clone(),
            namespace: namespace.to_owned(),
            facade_listen: format!("{host}:{port}"),
            extra: String::new(),
            spire: None,
        }
    }
}

/// The vm.opensandbox placement: the real opensandbox-server, and the facade's
/// development-mode listener on an address the sandboxes reach.
#[derive(Debug, Clone)]
pub struct SandboxOptions {
    pub url: String,
    pub api_key_file: PathBuf,
    /// `ip:port` on the sandboxes' network.
    pub facade_listen: String,
    /// More `[opensandbox]` settings (TOML lines).
    pub extra: String,
    /// SPIFFE instead of the development mode: the facade's mTLS listener, and a SPIRE
    /// entry per sandbox.
    pub spire: Option<SandboxSpire>,
}

/// How sandboxes get their identity in a test: the real SPIRE server, an agent whose
/// socket the sandboxes see at [`SandboxSpire::SOCKET_IN_SANDBOX`].
#[derive(Debug, Clone)]
pub struct SandboxSpire {
    /// The server's admin socket.
    pub server_socket: PathBuf,
    /// The agent's Workload API socket on the host (the controller's SVID comes from it).
    pub agent_socket: PathBuf,
    /// The facade's SPIFFE ID.
    pub controller_id: String,
    /// `[opensandbox.spire] parent_id`.
    pub parent_id: String,
}

impl SandboxSpire {
    pub const SOCKET_IN_SANDBOX: &str = "/run/spire/sockets/agent.sock";
}

impl SandboxOptions {
    /// `server` on the shared Docker host: the facade on a free port of the host's bridge,
    /// and no job-local dockerd (the Docker runtime's sandboxes are unprivileged).
    pub fn on_host(server: &testkit::opensandbox::OpenSandbox, docker: &crate::docker::HostDocker) -> SandboxOptions {
        let port = testkit::free_port(docker.bridge_ip.into());
        SandboxOptions {
            url: server.url(),
            api_key_file: server.api_key_file(),
            facade_listen: format!("{}:{port}", docker.bridge_ip),
            extra: "env = { SUPERVISOR_DOCKER = \"false\" }".into(),
            spire: None,
        }
    }
}

/// The `[facade]` lines of an mTLS listener on `listen` with the controller's SVID from
/// `agent` and environments' agent socket at `inside`.
fn mtls_facade(listen: &str, agent: &std::path::Path, controller_id: &str, inside: &str) -> String {
    format!(
        "listen = \"{listen}\"\nurl = \"https://{listen}\"\nspiffe_endpoint_socket = \"unix://{agent}\"\nspiffe_id = \"{controller_id}\"\nenvironment_spiffe_endpoint_socket = \"unix://{inside}\"",
        agent = agent.display(),
    )
}

impl Options {
    pub fn new(gitea_url: &str, registration_token: &str, image: &str, docker_socket: &std::path::Path) -> Options {
        Options {
            gitea_url: gitea_url.to_owned(),
            environment_gitea_url: None,
            registration_token: registration_token.to_owned(),
            capacity: 2,
            image: image.to_owned(),
            docker_socket: docker_socket.to_owned(),
            store: None,
            components: "scheduler,facade,worker".into(),
            state_dir: None,
            socket_dir: None,
            extra_gitea: String::new(),
            fetch_interval: Some("300ms".into()),
            docker_extra: String::new(),
            job_dockerd: true,
            http_listen: "127.0.0.1:0".into(),
            capability_key: "e2e-capability-key-0123456789abcdef0123456789".into(),
            opensandbox: None,
            kubernetes: None,
            extra: String::new(),
        }
    }
}

/// The job-local dockerd's privileges in `[docker]`: Docker's --privileged is refused
/// on these hosts, so the explicit list.
pub const JOB_DOCKERD_PRIVILEGES: &str = r#"[docker]
job_dockerd = true
cap_add = ["ALL"]
cap_drop = ["SYS_RESOURCE"]
security_opt = ["seccomp=unconfined", "apparmor=unconfined"]
device_cgroup_rules = ["b 7:* rmw", "c 10:237 rmw"]
"#;

impl Options {
    /// The controller's configuration for these options, with its files in `dir`.
    fn controller_config(&self, dir: &std::path::Path) -> ControllerConfig {
        let mut config = ControllerConfig::new(dir, &self.gitea_url, &self.registration_token)
            .set("gitea.runner_name", "e2e")
            .set("gitea.reconcile_interval", "2s")
            .set("identity.trust_domain", "e2e.test")
            .set("http.listen", self.http_listen.as_str());
        if let Some(url) = &self.environment_gitea_url {
            config = config.set("gitea.environment_url", url.as_str());
        }
        config = match &self.fetch_interval {
            Some(interval) => config.set("gitea.fetch_interval", interval.as_str()).set("gitea.fetch_interval_max", interval.as_str()),
            None => config.unset("gitea.fetch_interval").unset("gitea.fetch_interval_max"),
        }
        .merge_into("gitea", &self.extra_gitea);
        if let Some(store) = &self.store {
            config = config.replace("store", store);
        }
        match (&self.opensandbox, &self.kubernetes) {
            (None, Some(pods)) => {
                let facade = match &pods.spire {
                    None => format!("insecure_listen = \"{listen}\"\nurl = \"http://{listen}\"", listen = pods.facade_listen),
                    Some(spire) => mtls_facade(
                        &pods.facade_listen,
                        &spire.agent_socket,
                        &spire.controller_id,
                        &format!("{}/{}", PodSpire::SOCKET_DIR_IN_POD, spire.agent_socket.file_name().unwrap().to_string_lossy()),
                    ),
                };
                config = config
                    .pool("container.kubernetes", self.capacity)
                    .unset("facade.environment_socket_dir")
                    .merge_into("facade", &facade)
                    .set("kubernetes.kubeconfig", pods.kubeconfig.display().to_string())
                    .set("kubernetes.namespace", pods.namespace.as_str())
                    .set("kubernetes.image", self.image.as_str())
                    .set("kubernetes.image_pull_policy", "Never")
                    .set("kubernetes.termination_grace", "30s")
                    .set("kubernetes.job_dockerd", self.job_dockerd)
                    .merge_into("kubernetes", &pods.extra);
                if let Some(spire) = &pods.spire {
                    config = config
                        .set("kubernetes.workload_api.host_path", spire.agent_socket.parent().unwrap().display().to_string())
                        .set("kubernetes.workload_api.mount_path", PodSpire::SOCKET_DIR_IN_POD)
                        .set("kubernetes.spire.server_socket", spire.server_socket.display().to_string())
                        .set("kubernetes.spire.parent_id", spire.parent_id.as_str())
                        .set("kubernetes.spire.selectors", vec![format!("k8s:ns:{}", pods.namespace), "k8s:pod-name:{environment}".to_owned()]);
                }
            }
            (None, None) => {
                config = config
                    .pool("container.docker", self.capacity)
                    .set("facade.environment_socket_dir", self.socket_dir.clone().unwrap_or_else(|| dir.join("environments")).display().to_string())
                    .set("docker.image", self.image.as_str())
                    .set("docker.socket", self.docker_socket.display().to_string());
                if self.job_dockerd {
                    config = config.merge(JOB_DOCKERD_PRIVILEGES);
                }
                config = config.merge_into("docker", &self.docker_extra);
            }
            (Some(sandbox), _) => {
                let facade = match &sandbox.spire {
                    None => format!("insecure_listen = \"{listen}\"\nurl = \"http://{listen}\"", listen = sandbox.facade_listen),
                    Some(spire) => mtls_facade(&sandbox.facade_listen, &spire.agent_socket, &spire.controller_id, SandboxSpire::SOCKET_IN_SANDBOX),
                };
                config = config
                    .pool("vm.opensandbox", self.capacity)
                    .unset("facade.environment_socket_dir")
                    .merge_into("facade", &facade)
                    .set("opensandbox.url", sandbox.url.as_str())
                    .set("opensandbox.api_key_file", sandbox.api_key_file.display().to_string())
                    .set("opensandbox.image", self.image.as_str())
                    .set("opensandbox.cpu", "1")
                    .set("opensandbox.memory", "2Gi")
                    .set("opensandbox.timeout", "30m")
                    .merge_into("opensandbox", &sandbox.extra);
                if let Some(spire) = &sandbox.spire {
                    config = config
                        .set("opensandbox.spire.server_socket", spire.server_socket.display().to_string())
                        .set("opensandbox.spire.parent_id", spire.parent_id.as_str());
                }
            }
        }
        config.merge(&self.extra)
    }
}

impl Options {
    /// Writes the controller's configuration for these options into `dir` (and the
    /// capability key, unless one is there): the file `controller run --config` takes.
    pub fn write_config(&self, dir: &std::path::Path) -> PathBuf {
        let key = dir.join("capability.key");
        if !key.exists() {
            testkit::controller_config::write_secret(&key, &self.capability_key);
        }
        self.controller_config(dir).write("controller.toml")
    }
}

/// The configuration file at `path`, as the controller reads it.
pub fn read_config(path: &std::path::Path) -> Config {
    Config::parse(&std::fs::read_to_string(path).unwrap(), path, &Default::default()).unwrap()
}

pub struct Controller {
    pub config: Config,
    pub store: Arc<dyn Store>,
    pub state_dir: PathBuf,
    shutdown: CancellationToken,
    running: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    _dir: Option<tempfile::TempDir>,
}

/// A fresh state directory everyone may enter (the facade socket is used by the runner uid).
pub fn state_dir() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::Builder::new().prefix("gdr-e2e-controller-").tempdir_in("/tmp").unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

impl Controller {
    pub async fn start(options: Options) -> Controller {
        crate::init_logging();
        let (owned, dir) = match &options.state_dir {
            Some(dir) => (None, dir.clone()),
            None => {
                let owned = state_dir();
                let path = owned.path().to_owned();
                (Some(owned), path)
            }
        };
        let config = read_config(&options.write_config(&dir));
        let store = app::open_store(&config).await.unwrap();
        let components = Components::parse(&options.components).unwrap();
        let shutdown = CancellationToken::new();
        let overrides = Overrides { store: Some(Arc::clone(&store)), ..Overrides::default() };
        let running = tokio::spawn(app::run_with(config.clone(), components, overrides, shutdown.clone()));
        Controller { config, store, state_dir: dir, shutdown, running: Some(running), _dir: owned }
    }

    /// The label selecting this controller's environments (containers and sandboxes alike:
    /// OpenSandbox copies metadata to container labels).
    pub fn environment_label(&self) -> String {
        format!("{}={}", controller::driver::LABEL_INSTANCE, self.config.installation())
    }

    /// Every assignment record, live and finished.
    pub async fn records(&self) -> Vec<Record> {
        let live = self.store.list().await.unwrap().into_iter();
        live.chain(self.store.list_finished().await.unwrap()).map(|r| r.value).collect()
    }

    /// Waits until every assignment is terminal. Gitea shows a task finished as soon as
    /// the runner's last report reached it; the facade records the end only after Gitea
    /// answered that report, so a test that saw Gitea's status must wait for ours.
    pub async fn wait_until_all_terminal(&self, timeout: Duration) {
        let store = Arc::clone(&self.store);
        testkit::wait_until_async("every assignment is terminal", timeout, || {
            let store = Arc::clone(&store);
            async move { store.list().await.unwrap().iter().all(|r| r.value.is_terminal()) }
        })
        .await;
    }

    /// Stops the components (as SIGTERM would) and waits for them.
    pub async fn stop(&mut self) {
        self.shutdown.cancel();
        if let Some(running) = self.running.take() {
            match tokio::time::timeout(Duration::from_secs(60), running).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(error))) => panic!("the controller failed: {error:#}"),
                Ok(Err(error)) => panic!("the controller panicked: {error}"),
                Err(_) => panic!("the controller did not stop within 60 s"),
            }
        }
    }

    /// Fails the test if the controller stopped on its own with an error.
    pub fn assert_running(&self) {
        if let Some(running) = &self.running {
            assert!(!running.is_finished(), "the controller stopped on its own");
        }
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}
