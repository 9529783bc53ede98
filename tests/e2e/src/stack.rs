//! The controller's components in this process (`controller::app::run_with`, exactly
//! what `controller run` runs), configured as a user would (a TOML file), with the
//! store handed in so tests can watch the assignments.

use std::{path::PathBuf, sync::Arc, time::Duration};

use controller::{
    app::{self, Components, Overrides},
    config::Config,
    store::{Record, Store},
};
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
        }
    }
}

pub struct Controller {
    pub config: Config,
    pub store: Arc<dyn Store>,
    pub state_dir: PathBuf,
    shutdown: CancellationToken,
    running: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    _dir: Option<tempfile::TempDir>,
}

/// A fresh state directory everyone may enter (the facade socket is used by uid 2000).
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
        std::fs::write(dir.join("registration-token"), &options.registration_token).unwrap();
        let key = dir.join("capability.key");
        if !key.exists() {
            use std::os::unix::fs::OpenOptionsExt;
            let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&key).unwrap();
            std::io::Write::write_all(&mut file, options.capability_key.as_bytes()).unwrap();
        }
        let socket_dir = options.socket_dir.clone().unwrap_or_else(|| dir.join("environments"));
        let store = options.store.clone().unwrap_or_else(|| format!("kind = \"embedded\"\npath = \"{}/store.redb\"", dir.display()));
        let environment_url = options.environment_gitea_url.as_ref().map(|u| format!("environment_url = \"{u}\"\n")).unwrap_or_default();
        let (placement, driver, facade) = match (&options.opensandbox, &options.kubernetes) {
            (None, Some(pods)) => (
                "container.kubernetes",
                format!(
                    r#"[kubernetes]
kubeconfig = "{kubeconfig}"
namespace = "{namespace}"
image = "{image}"
image_pull_policy = "Never"
termination_grace = "30s"
job_dockerd = {job_dockerd}
{extra}
{spire}"#,
                    kubeconfig = pods.kubeconfig.display(),
                    job_dockerd = options.job_dockerd,
                    namespace = pods.namespace,
                    image = options.image,
                    extra = pods.extra,
                    spire = pods.spire.as_ref().map_or_else(String::new, |spire| format!(
                        "[kubernetes.workload_api]\nhost_path = \"{dir}\"\nmount_path = \"{inside}\"\n[kubernetes.spire]\nserver_socket = \"{server}\"\nparent_id = \"{parent}\"\nselectors = [\"k8s:ns:{namespace}\", \"k8s:pod-name:{{environment}}\"]\n",
                        dir = spire.agent_socket.parent().unwrap().display(),
                        inside = PodSpire::SOCKET_DIR_IN_POD,
                        server = spire.server_socket.display(),
                        parent = spire.parent_id,
                        namespace = pods.namespace,
                    )),
                ),
                match &pods.spire {
                    None => format!("insecure_listen = \"{listen}\"\nurl = \"http://{listen}\"", listen = pods.facade_listen),
                    Some(spire) => mtls_facade(&pods.facade_listen, &spire.agent_socket, &spire.controller_id, &format!(
                        "{}/{}",
                        PodSpire::SOCKET_DIR_IN_POD,
                        spire.agent_socket.file_name().unwrap().to_string_lossy()
                    )),
                },
            ),
            (None, None) => (
                "container.docker",
                format!(
                    r#"[docker]
image = "{image}"
socket = "{docker}"
{privileges}
{extra}
"#,
                    image = options.image,
                    docker = options.docker_socket.display(),
                    extra = options.docker_extra,
                    // Docker's --privileged is refused on these hosts: the explicit list.
                    privileges = if options.job_dockerd {
                        "job_dockerd = true\ncap_add = [\"ALL\"]\ncap_drop = [\"SYS_RESOURCE\"]\nsecurity_opt = [\"seccomp=unconfined\", \"apparmor=unconfined\"]\ndevice_cgroup_rules = [\"b 7:* rmw\", \"c 10:237 rmw\"]"
                    } else {
                        ""
                    },
                ),
                format!("environment_socket_dir = \"{}\"", socket_dir.display()),
            ),
            (Some(sandbox), _) => (
                "vm.opensandbox",
                format!(
                    r#"[opensandbox]
url = "{url}"
api_key_file = "{key}"
image = "{image}"
cpu = "1"
memory = "2Gi"
timeout = "30m"
{extra}
{spire}"#,
                    url = sandbox.url,
                    key = sandbox.api_key_file.display(),
                    image = options.image,
                    extra = sandbox.extra,
                    spire = sandbox.spire.as_ref().map_or_else(String::new, |spire| format!(
                        "[opensandbox.spire]\nserver_socket = \"{}\"\nparent_id = \"{}\"\n",
                        spire.server_socket.display(),
                        spire.parent_id
                    )),
                ),
                match &sandbox.spire {
                    None => format!("insecure_listen = \"{listen}\"\nurl = \"http://{listen}\"", listen = sandbox.facade_listen),
                    Some(spire) => mtls_facade(&sandbox.facade_listen, &spire.agent_socket, &spire.controller_id, SandboxSpire::SOCKET_IN_SANDBOX),
                },
            ),
        };
        let text = format!(
            r#"[gitea]
url = "{gitea}"
{environment_url}registration_token_file = "{dir}/registration-token"
credential_dir = "{dir}/runners"
runner_name = "e2e"
{fetch_interval}reconcile_interval = "2s"
{extra}

[identity]
trust_domain = "e2e.test"

[store]
{store}

[facade]
capability_key_file = "{dir}/capability.key"
{facade}

[http]
listen = "{http_listen}"

[[pool]]
placement = "{placement}"
capacity = {capacity}

{driver}"#,
            gitea = options.gitea_url,
            dir = dir.display(),
            extra = options.extra_gitea,
            fetch_interval = options
                .fetch_interval
                .as_ref()
                .map(|interval| format!("fetch_interval = \"{interval}\"\nfetch_interval_max = \"{interval}\"\n"))
                .unwrap_or_default(),
            capacity = options.capacity,
            http_listen = options.http_listen,
        );
        std::fs::write(dir.join("controller.toml"), &text).unwrap();
        let config = Config::parse(&text, &dir.join("controller.toml"), &Default::default()).unwrap();
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
