//! The docker driver: one container per assignment on a single Docker host, from the
//! shared runner image whose ENTRYPOINT is the supervisor.
//!
//! The container's name derives from the assignment id, so a repeated create finds the
//! first container (409 → inspect) instead of making a second one; its labels carry
//! the assignment for recovery. Privileged by default; hosts that refuse
//! `--privileged` (no CAP_SYS_RESOURCE in the bounding set, for example) configure an
//! explicit capability and device list instead — the supervisor needs loop devices
//! and mount for its storage and a nested dockerd. A terminal container is stopped and
//! removed with its storage (the loop-backed image lives in the container).

use std::collections::{BTreeMap, HashMap};

use async_trait::async_trait;
use bollard::{
    Docker,
    models::{ContainerCreateBody, HostConfig},
    query_parameters::{CreateContainerOptions, InspectContainerOptions, ListContainersOptions, RemoveContainerOptions, StopContainerOptions},
};
use serde::Deserialize;

use super::{Driver, DriverError, Environment, EnvironmentSpec, LABEL_ASSIGNMENT, LABEL_MANAGED, Phase};
use crate::assignment::placement::Placement;

/// How containers are made.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DockerConfig {
    /// The Docker API socket, e.g. `/var/run/docker.sock`.
    #[serde(default = "default_socket")]
    pub socket: String,
    /// The runner image (supervisor as ENTRYPOINT).
    pub image: String,
    /// `--privileged`; when false, the explicit lists below apply.
    #[serde(default = "default_true")]
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
    /// The facade's unix socket on the host, mounted at the same path inside.
    pub facade_socket: Option<String>,
    /// Docker network for the containers (default: Docker's default bridge).
    pub network: Option<String>,
    /// Seconds a terminal container gets to stop before it is killed.
    #[serde(default = "default_stop_seconds")]
    pub stop_seconds: i32,
}

fn default_socket() -> String {
    "/var/run/docker.sock".into()
}
fn default_true() -> bool {
    true
}
fn default_stop_seconds() -> i32 {
    10
}

impl DockerConfig {
    /// `--privileged` with the defaults.
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
            privileged: false,
            cap_add: vec!["ALL".into()],
            cap_drop: vec!["SYS_RESOURCE".into()],
            security_opt: vec!["seccomp=unconfined".into(), "apparmor=unconfined".into()],
            device_cgroup_rules: vec!["b 7:* rmw".into(), "c 10:237 rmw".into()],
            facade_socket: None,
            network: None,
            stop_seconds: default_stop_seconds(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct DockerDriver {
    placement: Placement,
    docker: Docker,
    config: DockerConfig,
}

impl DockerDriver {
    /// Connects to the Docker API and negotiates its version.
    ///
    /// # Errors
    /// When the socket is missing or the daemon does not answer.
    pub async fn connect(config: DockerConfig) -> Result<Self, DriverError> {
        let unavailable = |detail: String| DriverError::Unavailable { placement: Placement::CONTAINER_DOCKER.to_string(), detail };
        let docker = Docker::connect_with_unix(&config.socket, 120, bollard::API_DEFAULT_VERSION)
            .map_err(|e| unavailable(format!("cannot use the Docker socket {}: {e}", config.socket)))?
            .negotiate_version()
            .await
            .map_err(|e| unavailable(format!("the Docker daemon at {} does not answer: {e}", config.socket)))?;
        Ok(DockerDriver { placement: Placement::CONTAINER_DOCKER, docker, config })
    }

    /// Places its environments under `placement` in labels and errors (run-local runs a
    /// job of any container placement locally).
    pub fn for_placement(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }

    fn unavailable(&self, detail: impl Into<String>) -> DriverError {
        DriverError::Unavailable { placement: self.placement.to_string(), detail: detail.into() }
    }

    fn body(&self, spec: &EnvironmentSpec) -> ContainerCreateBody {
        let mut binds = Vec::new();
        if let Some(socket) = &self.config.facade_socket {
            binds.push(format!("{socket}:{socket}"));
        }
        let config = &self.config;
        let host_config = HostConfig {
            privileged: Some(config.privileged),
            cap_add: (!config.privileged && !config.cap_add.is_empty()).then(|| config.cap_add.clone()),
            cap_drop: (!config.privileged && !config.cap_drop.is_empty()).then(|| config.cap_drop.clone()),
            security_opt: (!config.security_opt.is_empty()).then(|| config.security_opt.clone()),
            device_cgroup_rules: (!config.privileged && !config.device_cgroup_rules.is_empty()).then(|| config.device_cgroup_rules.clone()),
            binds: (!binds.is_empty()).then_some(binds),
            network_mode: config.network.clone(),
            // An environment runs one job and is then removed by the controller.
            auto_remove: Some(false),
            ..Default::default()
        };
        ContainerCreateBody {
            image: Some(config.image.clone()),
            env: Some(spec.env.iter().map(|(k, v)| format!("{k}={v}")).collect()),
            labels: Some(spec.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect()),
            host_config: Some(host_config),
            ..Default::default()
        }
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
        let options = CreateContainerOptions { name: Some(spec.name.clone()), ..Default::default() };
        match self.docker.create_container(Some(options), self.body(spec)).await {
            Ok(_) => {}
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
