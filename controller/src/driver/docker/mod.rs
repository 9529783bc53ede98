//! The docker driver: one container per assignment on a single Docker host, from the
//! shared runner image whose ENTRYPOINT is the supervisor.
//!
//! The container's name derives from the assignment id, so a repeated create finds the
//! first container (409 → inspect) instead of making a second one; its labels carry
//! the assignment for recovery. A terminal container is stopped and removed with its
//! storage (the loop-backed image lives in the container).
//!
//! Three kinds of container (docs/security.md):
//! - by default an unprivileged one — Docker's default capabilities less those a job
//!   never needs, its default seccomp and AppArmor profiles, `no-new-privileges` — and no
//!   job-local dockerd: fit for untrusted code;
//! - with `rootless_dockerd = true` the same capabilities, and a dockerd that runs as the
//!   runner in user namespaces of its own: the operator's seccomp profile opened for
//!   namespace calls (`seccomp`), an unmasked /proc (a user namespace mounts its own only
//!   where the whole of it is visible), /dev/net/tun for slirp4netns, an anonymous volume
//!   for its images, and `no-new-privileges` off so that newuidmap's file capability
//!   works (the image has no setuid file): fit for untrusted code;
//! - with `job_dockerd = true` a container that can mount loop devices and run its own
//!   dockerd: `privileged`, or (hosts that refuse `--privileged`) an explicit capability
//!   and device list. A job step is root on the host there: trusted code only.
//!
//! Every container is bounded (memory, CPUs, processes, the size of its loop-backed
//! storage) and runs its job as a host uid of its own ([`ids`]): it shares the host with
//! the controller and the other jobs. Its own facade directory (`facade::sockets`) is
//! mounted at `contract::facade::ENVIRONMENT_DIR`.

pub mod ids;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::Arc,
};

use async_trait::async_trait;
use bollard::{
    Docker,
    models::{ContainerCreateBody, HostConfig},
    query_parameters::{CreateContainerOptions, InspectContainerOptions, ListContainersOptions, RemoveContainerOptions, StopContainerOptions},
};
use contract::environment::{JobDocker, supervisor};
use serde::Deserialize;

use self::ids::{RunnerIds, SUBORDINATE_COUNT, Slot};
use super::{Driver, DriverError, Environment, EnvironmentSpec, LABEL_ASSIGNMENT, LABEL_MANAGED, Phase};
use crate::{
    assignment::placement::Placement,
    setting::{Invalid, Problems},
};

/// How containers are made.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DockerConfig {
    /// The Docker API socket, e.g. `/var/run/docker.sock`.
    #[serde(default = "default_socket")]
    pub socket: String,
    /// The runner image (supervisor as ENTRYPOINT).
    pub image: String,
    /// Which Docker every job gets of its own: `"none"` (the default); `"rootless"`, a
    /// rootless dockerd (runner uid, user namespaces: `docker build`, `services:`,
    /// `container:` with no step root on this host; needs /dev/net/tun (mode 0666) and
    /// `seccomp_profile` on this host); or `"root"`, a dockerd as root, which needs
    /// `privileged = true` or the explicit lists below and makes a job step root on this
    /// host: for trusted code only.
    #[serde(default)]
    pub job_docker: Option<JobDocker>,
    /// `job_docker = "root"`, as older configurations say it.
    #[serde(default)]
    pub job_dockerd: bool,
    /// `job_docker = "rootless"`, as older configurations say it.
    #[serde(default)]
    pub rootless_dockerd: bool,
    /// The seccomp profile rootless environments start from (see `driver::seccomp`).
    #[serde(default = "default_seccomp_profile")]
    pub seccomp_profile: String,
    /// Registry mirrors every job dockerd pulls Docker Hub images through, e.g.
    /// `["https://mirror.example.org"]`.
    #[serde(default)]
    pub registry_mirrors: Vec<String>,
    /// `--privileged` (with `job_dockerd`); when false, the explicit lists below apply.
    #[serde(default)]
    pub privileged: bool,
    #[serde(default)]
    pub cap_add: Vec<String>,
    #[serde(default)]
    pub cap_drop: Vec<String>,
    #[serde(default)]
    pub security_opt: Vec<String>,
    /// e.g. `b 7:* rmw` (loop devices) and `c 10:237 rmw` (loop-control).
    #[serde(default)]
    pub device_cgroup_rules: Vec<String>,
    /// Docker network for the containers (default: Docker's default bridge).
    pub network: Option<String>,
    /// Seconds a terminal container gets to stop before it is killed: more than the
    /// supervisor's drain (25 s), so it ends the job's dockerd and storage itself.
    #[serde(default = "default_stop_seconds")]
    pub stop_seconds: i32,
    /// Memory of one container, job and its dockerd together (`--memory`), e.g. `4G`.
    #[serde(default = "default_memory")]
    pub memory: String,
    /// CPUs of one container (`--cpus`), e.g. `2` or `0.5`.
    #[serde(default = "default_cpus")]
    pub cpus: String,
    /// Processes of one container (`--pids-limit`): a fork bomb stops there.
    #[serde(default = "default_pids")]
    pub pids_limit: i64,
    /// The job's loop-backed storage for its dockerd (SUPERVISOR_STORAGE_SIZE): a sparse
    /// file in the container's writable layer that grows up to this.
    #[serde(default = "default_storage_size")]
    pub storage_size: String,
    /// A host uid (and subordinate range) of its own for each environment ([`ids`]).
    #[serde(default)]
    pub runner_ids: RunnerIds,
}

/// The label that records a container's runner uid ([`ids`]).
pub const LABEL_RUNNER_UID: &str = "gitea-dynamic-runner/runner-uid";

/// Capabilities of Docker's default set that an environment without a job-local dockerd
/// never needs (the supervisor keeps SETUID/SETGID/CHOWN/FOWNER/DAC_OVERRIDE/KILL to start
/// the agent as the runner uid).
const UNNEEDED_CAPABILITIES: [&str; 6] = ["NET_RAW", "MKNOD", "AUDIT_WRITE", "SETFCAP", "SYS_CHROOT", "NET_BIND_SERVICE"];

fn default_seccomp_profile() -> String {
    "/usr/share/containers/seccomp.json".into()
}
/// The rootless dockerd's socket in the environment: the runner's runtime directory.
fn rootless_socket(uid: u32) -> String {
    format!("/run/user/{uid}/docker.sock")
}
/// Where a rootless dockerd keeps its images: an anonymous volume, removed with the
/// container (a user namespace's overlay cannot stack on the container's own).
const ROOTLESS_DATA_ROOT: &str = "/var/lib/docker";

fn default_socket() -> String {
    "/var/run/docker.sock".into()
}
fn default_stop_seconds() -> i32 {
    30
}
fn default_memory() -> String {
    "4G".into()
}
fn default_cpus() -> String {
    "2".into()
}
fn default_pids() -> i64 {
    4096
}
fn default_storage_size() -> String {
    "10G".into()
}

impl DockerConfig {
    /// An unprivileged container without a job-local dockerd (the default).
    pub fn unprivileged(image: &str) -> DockerConfig {
        DockerConfig {
            job_dockerd: false,
            rootless_dockerd: false,
            cap_add: Vec::new(),
            cap_drop: Vec::new(),
            security_opt: Vec::new(),
            device_cgroup_rules: Vec::new(),
            ..DockerConfig::unprivileged_loop_capable(image)
        }
    }

    /// An unprivileged container with a rootless job-local dockerd.
    pub fn rootless(image: &str) -> DockerConfig {
        DockerConfig { rootless_dockerd: true, ..DockerConfig::unprivileged(image) }
    }

    /// `--privileged` with a job-local dockerd.
    pub fn privileged(image: &str) -> DockerConfig {
        DockerConfig {
            privileged: true,
            cap_add: Vec::new(),
            cap_drop: Vec::new(),
            security_opt: Vec::new(),
            device_cgroup_rules: Vec::new(),
            ..DockerConfig::unprivileged_loop_capable(image)
        }
    }

    /// The explicit set that works where `--privileged` is refused (all capabilities
    /// but SYS_RESOURCE, no seccomp/AppArmor confinement, loop devices allowed).
    pub fn unprivileged_loop_capable(image: &str) -> DockerConfig {
        DockerConfig {
            socket: default_socket(),
            image: image.to_owned(),
            job_docker: None,
            job_dockerd: true,
            rootless_dockerd: false,
            seccomp_profile: default_seccomp_profile(),
            registry_mirrors: Vec::new(),
            privileged: false,
            cap_add: vec!["ALL".into()],
            cap_drop: vec!["SYS_RESOURCE".into()],
            security_opt: vec!["seccomp=unconfined".into(), "apparmor=unconfined".into()],
            device_cgroup_rules: vec!["b 7:* rmw".into(), "c 10:237 rmw".into()],
            network: None,
            stop_seconds: default_stop_seconds(),
            memory: default_memory(),
            cpus: default_cpus(),
            pids_limit: default_pids(),
            storage_size: default_storage_size(),
            runner_ids: RunnerIds::SHARED,
        }
    }

    /// Which Docker its jobs have (`job_docker`, or its aliases).
    pub fn job_docker(&self) -> JobDocker {
        super::job_docker_of(self.job_docker, self.job_dockerd, self.rootless_dockerd)
    }

    /// The limits as Docker takes them: (memory bytes, nano-CPUs).
    ///
    /// # Errors
    /// The setting that is wrong, and why.
    pub fn limits(&self) -> Result<(i64, i64), Invalid> {
        let memory = contract::units::parse_size(&self.memory).map_err(|m| Invalid::new("docker.memory", m))?;
        if memory < 256 << 20 {
            return Err(Invalid::new("docker.memory", format!("{:?} is too little for a job and its dockerd: at least 256M", self.memory)));
        }
        let cpus: f64 = self.cpus.trim().parse().map_err(|_| Invalid::new("docker.cpus", format!("{:?} is not a number of CPUs, e.g. 2 or 0.5", self.cpus)))?;
        if !(0.01..=1024.0).contains(&cpus) {
            return Err(Invalid::new("docker.cpus", format!("{:?} must be between 0.01 and 1024", self.cpus)));
        }
        Ok((i64::try_from(memory).unwrap_or(i64::MAX), (cpus * 1e9) as i64))
    }

    pub fn validate(&self, problems: &mut Problems) {
        problems.take(self.limits());
        super::check_job_docker("docker", self.job_docker, self.job_dockerd, self.rootless_dockerd, problems);
        let mode = self.job_docker();
        if mode == JobDocker::Root && !self.privileged && self.cap_add.is_empty() {
            problems.add(
                "docker.job_docker",
                "a job-local dockerd needs a container that mounts loop devices: set privileged = true, or the capability and device lists \
                 (cap_add = [\"ALL\"], device_cgroup_rules = [\"b 7:* rmw\", \"c 10:237 rmw\"], security_opt = [\"seccomp=unconfined\", \"apparmor=unconfined\"])",
            );
        }
        super::check_registry_mirrors("docker.registry_mirrors", &self.registry_mirrors, mode.runs_dockerd(), problems);
        if mode != JobDocker::Root && (self.privileged || !self.cap_add.is_empty() || !self.device_cgroup_rules.is_empty()) {
            problems.add(
                "docker.privileged",
                "privileges and capability lists are for a root job dockerd only: set job_docker = \"root\" (trusted code only), or remove them",
            );
        }
        if self.pids_limit < 64 {
            problems.add("docker.pids_limit", format!("{} is too few for a job and its dockerd: at least 64", self.pids_limit));
        }
        match contract::units::parse_size(&self.storage_size) {
            Ok(storage) if storage < 1 << 30 => {
                problems.add("docker.storage_size", format!("{:?} is too small for a job's images: at least 1G", self.storage_size));
            }
            Ok(_) => {}
            Err(message) => problems.add("docker.storage_size", message),
        }
    }

    /// What a job step can reach in these containers, said once at start (docs/security.md).
    pub fn trust_notice(&self) -> Option<String> {
        (self.job_docker() == JobDocker::Root).then(|| {
            let how = if self.privileged { "privileged containers" } else { "containers with the capability list" };
            format!(
                "container.docker: jobs get their own dockerd in {how}: a job step can become root on this host and read the controller's \
                 credentials, capability key and store; run only trusted code here (docs/security.md)"
            )
        })
    }

    /// [`DockerConfig::validate`] and what only a configuration file must hold (tests and
    /// run-local stop their containers sooner).
    pub fn validate_configured(&self, problems: &mut Problems) {
        self.validate(problems);
        if self.stop_seconds < 30 {
            problems.add("docker.stop_seconds", format!("{} is shorter than the supervisor's drain (25 s): at least 30", self.stop_seconds));
        }
    }
}

#[derive(Debug, Clone)]
pub struct DockerDriver {
    placement: Placement,
    docker: Docker,
    config: DockerConfig,
    /// The seccomp profile of rootless environments, read once (`rootless_dockerd`).
    rootless_seccomp: Option<String>,
    /// Held from choosing a runner uid until the container that records it exists.
    choosing_ids: Arc<tokio::sync::Mutex<()>>,
}

impl DockerDriver {
    /// Connects to the Docker API and negotiates its version.
    ///
    /// # Errors
    /// When the socket is missing or the daemon does not answer.
    pub async fn connect(config: DockerConfig) -> Result<Self, DriverError> {
        let unavailable = |detail: String| DriverError::Unavailable { placement: Placement::CONTAINER_DOCKER.to_string(), detail };
        Problems::check(|problems| config.validate(problems)).map_err(|problems| unavailable(problems.to_string()))?;
        let rootless_seccomp = if config.job_docker().is_rootless() {
            Some(super::seccomp::read_rootless_profile(&config.seccomp_profile).map_err(|e| unavailable(format!("docker.seccomp_profile: {e}")))?)
        } else {
            None
        };
        let docker = Docker::connect_with_unix(&config.socket, 120, bollard::API_DEFAULT_VERSION)
            .map_err(|e| unavailable(format!("cannot use the Docker socket {}: {e}", config.socket)))?
            .negotiate_version()
            .await
            .map_err(|e| unavailable(format!("the Docker daemon at {} does not answer: {e}", config.socket)))?;
        Ok(DockerDriver { placement: Placement::CONTAINER_DOCKER, docker, config, rootless_seccomp, choosing_ids: Arc::default() })
    }

    /// Places its environments under `placement` in labels and errors (run-local runs a
    /// job of any container placement locally).
    pub fn for_placement(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }

    /// The host as the environments reach it: the IPv4 gateway of their network (a
    /// service of the host listening there is reachable from an environment).
    ///
    /// # Errors
    /// When the network cannot be inspected or has no IPv4 gateway.
    pub async fn host_address(&self) -> Result<std::net::IpAddr, DriverError> {
        let network = self.config.network.as_deref().unwrap_or("bridge");
        let inspected = self.docker.inspect_network(network, None).await.map_err(|e| self.unavailable(format!("cannot inspect the network {network}: {e}")))?;
        inspected
            .ipam
            .and_then(|ipam| ipam.config)
            .into_iter()
            .flatten()
            .find_map(|config| ipv4_gateway(config.gateway.as_deref(), config.subnet.as_deref()))
            .map(std::net::IpAddr::V4)
            .ok_or_else(|| self.unavailable(format!("the network {network} has no IPv4 gateway or subnet")))
    }

    fn unavailable(&self, detail: impl Into<String>) -> DriverError {
        DriverError::Unavailable { placement: self.placement.to_string(), detail: detail.into() }
    }

    fn body(&self, spec: &EnvironmentSpec, slot: Option<Slot>) -> ContainerCreateBody {
        let mut binds = Vec::new();
        if let Some(facade_dir) = &spec.facade_dir {
            // Read-write: PID 1 removes the capability file once it has read it.
            binds.push(format!("{}:{}", facade_dir.host.display(), contract::facade::ENVIRONMENT_DIR));
        }
        let config = &self.config;
        // Validated when the configuration was read.
        let (memory, nano_cpus) = config.limits().unwrap_or((4 << 30, 2_000_000_000));
        let mut env: Vec<String> = spec.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let mut labels: HashMap<String, String> = spec.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        if let Some(slot) = slot {
            use contract::environment::runner_user;
            env.extend([
                format!("{}={}", runner_user::UID, slot.uid),
                format!("{}={}", runner_user::GID, slot.uid),
                format!("{}={}:{SUBORDINATE_COUNT}", runner_user::SUBORDINATE_IDS, slot.subordinate),
            ]);
            labels.insert(LABEL_RUNNER_UID.to_owned(), slot.uid.to_string());
        }
        let mode = config.job_docker();
        env.extend(mode.supervisor_vars().iter().map(|(name, value)| format!("{name}={value}")));
        if !config.registry_mirrors.is_empty() {
            env.push(format!("{}={}", supervisor::REGISTRY_MIRRORS, config.registry_mirrors.join(",")));
        }
        // Docker's default set less what neither the supervisor nor a job needs.
        let unneeded = || UNNEEDED_CAPABILITIES.iter().map(|c| (*c).to_owned()).chain(config.cap_drop.iter().cloned()).collect::<Vec<_>>();
        let mut devices = None;
        let mut volumes = None;
        let mut unmasked = None;
        let (cap_drop, security_opt) = match (mode, &self.rootless_seccomp) {
            (JobDocker::Root, _) => {
                env.push(format!("{}={}", supervisor::STORAGE_SIZE, config.storage_size));
                (config.cap_drop.clone(), config.security_opt.clone())
            }
            // The profile is read at connect whenever the mode is rootless.
            (JobDocker::Rootless, Some(profile)) => {
                let socket = rootless_socket(slot.map_or(contract::environment::runner_user::IMAGE_ID, |slot| slot.uid));
                env.push(format!("{}={socket}", supervisor::DOCKER_SOCKET));
                devices = Some(vec![bollard::models::DeviceMapping {
                    path_on_host: Some("/dev/net/tun".into()),
                    path_in_container: Some("/dev/net/tun".into()),
                    cgroup_permissions: Some("rwm".into()),
                }]);
                volumes = Some(vec![ROOTLESS_DATA_ROOT.to_owned()]);
                // The CLI's `systempaths=unconfined`: an empty list of masked and read-only
                // paths under /proc and /sys (the API has no such option).
                unmasked = Some(Vec::new());
                // Without no-new-privileges: newuidmap's file capability must work; the
                // image has no setuid file that could raise a step to root instead.
                let confinement = [format!("seccomp={profile}"), "apparmor=unconfined".to_owned()];
                (unneeded(), confinement.into_iter().chain(config.security_opt.iter().cloned()).collect())
            }
            // No setuid binary may raise a step's privileges.
            _ => (unneeded(), std::iter::once("no-new-privileges".to_owned()).chain(config.security_opt.iter().cloned()).collect()),
        };
        let host_config = HostConfig {
            memory: Some(memory),
            // No swap beyond the memory limit: a job that needs more fails, not the host.
            memory_swap: Some(memory),
            nano_cpus: Some(nano_cpus),
            pids_limit: Some(config.pids_limit),
            privileged: Some(mode == JobDocker::Root && config.privileged),
            cap_add: (!config.privileged && !config.cap_add.is_empty()).then(|| config.cap_add.clone()),
            cap_drop: (!config.privileged && !cap_drop.is_empty()).then_some(cap_drop),
            security_opt: (!security_opt.is_empty()).then_some(security_opt),
            device_cgroup_rules: (!config.privileged && !config.device_cgroup_rules.is_empty()).then(|| config.device_cgroup_rules.clone()),
            binds: (!binds.is_empty()).then_some(binds),
            devices,
            masked_paths: unmasked.clone(),
            readonly_paths: unmasked,
            network_mode: config.network.clone(),
            // An environment runs one job and is then removed by the controller.
            auto_remove: Some(false),
            ..Default::default()
        };
        ContainerCreateBody {
            image: Some(config.image.clone()),
            env: Some(env),
            labels: Some(labels),
            volumes,
            host_config: Some(host_config),
            ..Default::default()
        }
    }

    /// A runner uid no container on this host holds ([`ids`]); the one a container of
    /// this name already holds when an earlier attempt made it.
    async fn free_slot(&self, spec: &EnvironmentSpec) -> Result<Slot, DriverError> {
        let ids = &self.config.runner_ids;
        let held = self.runner_uids(None).await?;
        if let Some(slot) = held.iter().find(|(name, _, _)| *name == spec.name).and_then(|(_, uid, _)| ids.slot_of(*uid)) {
            return Ok(slot);
        }
        let used: BTreeSet<u32> = held.iter().map(|(_, uid, _)| *uid).collect();
        ids.free(&used).ok_or_else(|| DriverError::Waiting {
            placement: self.placement.to_string(),
            name: spec.name.clone(),
            detail: format!(
                "every runner uid of docker.runner_ids ({} from {}) is held by a container on this host: the job waits for one to end \
                 (another controller's, or containers left behind: docker ps --filter label={LABEL_RUNNER_UID})",
                ids.count, ids.first_uid
            ),
        })
    }

    /// Another controller on this host may have chosen the same uid at the same moment: the
    /// container made first keeps it (then the lower name), the other is removed and made
    /// again later.
    async fn keep_slot_or_yield(&self, spec: &EnvironmentSpec, slot: Slot) -> Result<(), DriverError> {
        let mut holders = self.runner_uids(Some(slot.uid)).await?;
        holders.sort_by(|a, b| (a.2, &a.0).cmp(&(b.2, &b.0)));
        match holders.first() {
            Some((first, _, _)) if *first != spec.name => {
                self.delete(&spec.name).await?;
                Err(DriverError::Waiting {
                    placement: self.placement.to_string(),
                    name: spec.name.clone(),
                    detail: format!("runner uid {} was taken at the same moment by {first}; it is made again shortly", slot.uid),
                })
            }
            _ => Ok(()),
        }
    }

    /// (name, runner uid, created) of every container on this host that holds a runner
    /// uid (that holds `uid`, when given).
    async fn runner_uids(&self, uid: Option<u32>) -> Result<Vec<(String, u32, i64)>, DriverError> {
        let label = match uid {
            Some(uid) => format!("{LABEL_RUNNER_UID}={uid}"),
            None => LABEL_RUNNER_UID.to_owned(),
        };
        let options = ListContainersOptions { all: true, filters: Some(HashMap::from([("label".to_owned(), vec![label])])), ..Default::default() };
        let containers = self.docker.list_containers(Some(options)).await.map_err(|e| self.unavailable(format!("listing containers: {e}")))?;
        Ok(containers
            .into_iter()
            .filter_map(|container| {
                let name = container.names?.into_iter().next()?.trim_start_matches('/').to_owned();
                let uid = container.labels?.get(LABEL_RUNNER_UID)?.parse().ok()?;
                Some((name, uid, container.created.unwrap_or_default()))
            })
            .collect())
    }

    async fn inspect(&self, name: &str) -> Result<Option<Environment>, DriverError> {
        match self.docker.inspect_container(name, None::<InspectContainerOptions>).await {
            Ok(container) => {
                let labels: BTreeMap<String, String> = container.config.and_then(|c| c.labels).unwrap_or_default().into_iter().collect();
                let state = container.state.unwrap_or_default();
                let running = state.status.is_some_and(|s| {
                    use bollard::models::ContainerStateStatusEnum as S;
                    matches!(s, S::CREATED | S::RUNNING | S::RESTARTING | S::PAUSED)
                });
                let detail = if running { String::new() } else { exit_detail(&state) };
                Ok(Some(Environment {
                    name: name.to_owned(),
                    assignment_id: labels.get(LABEL_ASSIGNMENT).cloned().unwrap_or_default(),
                    labels,
                    phase: if running { Phase::Running } else { Phase::Exited },
                    detail,
                    exit_code: if running { None } else { state.exit_code },
                }))
            }
            Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => Ok(None),
            Err(error) => Err(self.unavailable(format!("inspecting {name}: {error}"))),
        }
    }
}

/// "exited with code 137 (OOM killed)", "…: <docker's error>".
fn exit_detail(state: &bollard::models::ContainerState) -> String {
    let mut detail = match state.exit_code {
        Some(code) => format!("the container exited with code {code}"),
        None => "the container is not running".to_owned(),
    };
    if state.oom_killed == Some(true) {
        detail.push_str(" (killed for using more memory than allowed)");
    }
    if let Some(error) = state.error.as_deref().filter(|e| !e.is_empty()) {
        detail.push_str(": ");
        detail.push_str(error);
    }
    detail
}

#[async_trait]
impl Driver for DockerDriver {
    fn placement(&self) -> Placement {
        self.placement
    }

    async fn create(&self, spec: &EnvironmentSpec) -> Result<Environment, DriverError> {
        let choosing = if self.config.runner_ids.is_shared() { None } else { Some(self.choosing_ids.lock().await) };
        let slot = match choosing {
            Some(_) => Some(self.free_slot(spec).await?),
            None => None,
        };
        let options = CreateContainerOptions { name: Some(spec.name.clone()), ..Default::default() };
        let created = self.docker.create_container(Some(options), self.body(spec, slot)).await;
        drop(choosing);
        match created {
            Ok(_) => {
                if let Some(slot) = slot {
                    self.keep_slot_or_yield(spec, slot).await?;
                }
            }
            // The name exists: an earlier attempt created it; use that one.
            Err(bollard::errors::Error::DockerResponseServerError { status_code: 409, .. }) => {}
            Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, message }) => {
                return Err(DriverError::Refused {
                    placement: self.placement.to_string(),
                    name: spec.name.clone(),
                    detail: format!("{message} (is the runner image {} present on this host?)", self.config.image),
                });
            }
            Err(error) => return Err(self.unavailable(format!("creating {}: {error}", spec.name))),
        }
        match self.docker.start_container(&spec.name, None::<bollard::query_parameters::StartContainerOptions>).await {
            Ok(()) => {}
            // 304: already started by the earlier attempt.
            Err(bollard::errors::Error::DockerResponseServerError { status_code: 304, .. }) => {}
            // The container of an earlier attempt, deleted a moment ago, still goes away:
            // the worker tries again shortly.
            Err(bollard::errors::Error::DockerResponseServerError { message, .. }) if message.contains("marked for removal") => {
                return Err(self.unavailable(format!("starting {}: an earlier container of that name is still being removed ({message})", spec.name)));
            }
            Err(bollard::errors::Error::DockerResponseServerError { status_code, message })
                if status_code < 500 || message.contains("permission") || message.contains("operation not permitted") =>
            {
                return Err(DriverError::Refused { placement: self.placement.to_string(), name: spec.name.clone(), detail: message });
            }
            Err(error) => return Err(self.unavailable(format!("starting {}: {error}", spec.name))),
        }
        self.inspect(&spec.name).await?.ok_or_else(|| self.unavailable(format!("{} vanished after it was created", spec.name)))
    }

    async fn get(&self, name: &str) -> Result<Option<Environment>, DriverError> {
        self.inspect(name).await
    }

    async fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<Environment>, DriverError> {
        let mut labels: Vec<String> = vec![format!("{LABEL_MANAGED}=true")];
        labels.extend(selector.iter().map(|(k, v)| format!("{k}={v}")));
        let options = ListContainersOptions { all: true, filters: Some(HashMap::from([("label".to_owned(), labels)])), ..Default::default() };
        let containers = self.docker.list_containers(Some(options)).await.map_err(|e| self.unavailable(format!("listing containers: {e}")))?;
        let mut found = Vec::new();
        for container in containers {
            let Some(name) = container.names.and_then(|n| n.into_iter().next()) else { continue };
            if let Some(environment) = self.inspect(name.trim_start_matches('/')).await? {
                found.push(environment);
            }
        }
        Ok(found)
    }

    async fn stop(&self, name: &str) -> Result<(), DriverError> {
        // Nothing more will run in it: stop it (the supervisor drains) and remove it.
        let stop = StopContainerOptions { t: Some(self.config.stop_seconds), ..Default::default() };
        match self.docker.stop_container(name, Some(stop)).await {
            Ok(()) => {}
            Err(bollard::errors::Error::DockerResponseServerError { status_code: 304 | 404, .. }) => {}
            Err(error) => return Err(self.unavailable(format!("stopping {name}: {error}"))),
        }
        self.delete(name).await
    }

    async fn changes(&self) -> Result<Option<super::Changes>, DriverError> {
        use futures_util::StreamExt as _;
        let filters = HashMap::from([
            ("type".to_owned(), vec!["container".to_owned()]),
            ("event".to_owned(), vec!["die".to_owned()]),
            ("label".to_owned(), vec![format!("{LABEL_MANAGED}=true")]),
        ]);
        let options = bollard::query_parameters::EventsOptions { filters: Some(filters), ..Default::default() };
        let driver = self.clone();
        let events = self.docker.events(Some(options));
        let changes = events
            .filter_map(move |event| {
                let driver = driver.clone();
                async move {
                    let name = event.ok()?.actor?.attributes?.get("name")?.clone();
                    // The event says little; inspect for the exit code and OOM state.
                    match driver.inspect(&name).await {
                        Ok(Some(environment)) if environment.phase != Phase::Running => Some(environment),
                        _ => None,
                    }
                }
            })
            .boxed();
        Ok(Some(changes))
    }

    async fn delete(&self, name: &str) -> Result<(), DriverError> {
        let options = RemoveContainerOptions { force: true, v: true, ..Default::default() };
        match self.docker.remove_container(name, Some(options)).await {
            Ok(()) => Ok(()),
            Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => Ok(()),
            // Removal already in progress (e.g. a concurrent delete).
            Err(bollard::errors::Error::DockerResponseServerError { status_code: 409, .. }) => Ok(()),
            Err(error) => Err(self.unavailable(format!("removing {name}: {error}"))),
        }
    }
}

/// The IPv4 gateway of one IPAM entry of a Docker network. A dockerd that made its default
/// bridge itself (the first start on a machine) reports the subnet alone; the bridge's
/// address is then the subnet's first host, which is the address Docker gives a bridge
/// whose gateway is not set.
fn ipv4_gateway(gateway: Option<&str>, subnet: Option<&str>) -> Option<std::net::Ipv4Addr> {
    if let Some(gateway) = gateway.and_then(|g| g.parse::<std::net::Ipv4Addr>().ok()) {
        return Some(gateway);
    }
    let subnet: ipnet::Ipv4Net = subnet?.parse().ok()?;
    // A /31 or /32 has no room for a bridge beside its containers.
    if subnet.prefix_len() > 30 {
        return None;
    }
    subnet.hosts().next()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `privileged = true` makes a privileged container in the root mode only, however
    /// the mode is spelled (`job_docker = "root"` or the older `job_dockerd = true`).
    #[test]
    fn privileged_follows_the_mode() {
        let cases: [(Option<JobDocker>, bool, bool, bool); 5] = [
            (Some(JobDocker::Root), false, true, true),
            (None, true, true, true),
            (Some(JobDocker::Root), false, false, false),
            (Some(JobDocker::None), false, true, false),
            (None, false, true, false),
        ];
        for (mode, job_dockerd, privileged, expected) in cases {
            let config = DockerConfig { job_docker: mode, job_dockerd, privileged, ..DockerConfig::unprivileged("gdr-runner:test") };
            // Never called: bollard only checks that the socket's path exists.
            let socket = tempfile::NamedTempFile::new().unwrap();
            let docker = Docker::connect_with_unix(&socket.path().display().to_string(), 1, bollard::API_DEFAULT_VERSION).unwrap();
            let driver = DockerDriver { placement: Placement::CONTAINER_DOCKER, docker, config, rootless_seccomp: None, choosing_ids: Arc::default() };
            let spec = EnvironmentSpec {
                assignment_id: "gitea-task-1".into(),
                name: "gdr-test-gitea-task-1".into(),
                labels: Default::default(),
                env: Default::default(),
                facade_dir: None,
            };
            let body = driver.body(&spec, None);
            assert_eq!(body.host_config.and_then(|h| h.privileged), Some(expected), "{mode:?} job_dockerd={job_dockerd} privileged={privileged}");
        }
    }

    #[test]
    fn the_gateway_is_the_one_docker_reports_else_the_subnets_first_host() {
        let cases: [(Option<&str>, Option<&str>, Option<&str>); 8] = [
            (Some("10.213.7.1"), Some("10.213.7.0/24"), Some("10.213.7.1")),
            (Some("10.213.7.254"), Some("10.213.7.0/24"), Some("10.213.7.254")),
            // A fresh default bridge: no gateway in the network's IPAM.
            (None, Some("172.17.0.0/16"), Some("172.17.0.1")),
            (None, Some("172.18.5.0/24"), Some("172.18.5.1")),
            // An IPv6 gateway is not one the environments' IPv4 reaches.
            (Some("fd00::1"), Some("172.19.0.0/16"), Some("172.19.0.1")),
            (None, Some("fd00::/64"), None),
            (None, Some("10.0.0.0/31"), None),
            (None, None, None),
        ];
        for (gateway, subnet, expected) in cases {
            let expected = expected.map(|e| e.parse().unwrap());
            assert_eq!(ipv4_gateway(gateway, subnet), expected, "{gateway:?} {subnet:?}");
        }
    }
}
