//! The Kubernetes driver (placement `container.kubernetes`): one Pod per assignment in
//! one namespace, from the shared runner image with the supervisor as PID 1.
//!
//! - **Names.** The Pod's name is the environment's name (derived from the assignment),
//!   so a create repeated after a crash gets `AlreadyExists` and adopts the first Pod.
//! - **Contract.** The environment contract as env, `restartPolicy: Never` (a job runs
//!   once), no service-account token, no service links, `emptyDir` volumes for the loop
//!   image and the runner's work (they go with the Pod), the job's ceiling as
//!   `activeDeadlineSeconds`. Privileged by default; clusters whose nodes refuse it get
//!   an explicit capability list.
//! - **Ends.** A Pod that fails or cannot start reports why in the kubelet's words
//!   (image pull errors, `OOMKilled`, eviction, `DeadlineExceeded`, deletion by someone
//!   else); the worker fails the task with that as its last log line.
//! - **Deletion** is graceful (the supervisor drains within the grace period) and waits
//!   until the Pod is gone. A Pod counts against its placement's capacity until its job
//!   container has ended; the kubelet then needs a few seconds to tear down the rest.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use async_trait::async_trait;
use k8s_openapi::{
    api::core::v1::{
        CSIVolumeSource, Capabilities, Container, ContainerState, ContainerStatus, EmptyDirVolumeSource, EnvVar, HostPathVolumeSource, Pod, PodSpec,
        ResourceRequirements, SecurityContext, Toleration, Volume, VolumeMount,
    },
    apimachinery::pkg::api::resource::Quantity,
};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, ObjectMeta, PostParams},
};
use serde::Deserialize;

use super::{Driver, DriverError, Environment, EnvironmentSpec, LABEL_ASSIGNMENT, LABEL_MANAGED, LABEL_PLACEMENT, Phase};
use crate::assignment::placement::Placement;

/// The annotation naming the job's SPIFFE ID (for people reading the Pod).
pub const ANNOTATION_SPIFFE_ID: &str = "gitea-dynamic-runner/spiffe-id";

/// The container's name in every job Pod.
const CONTAINER: &str = "job";

/// Waiting reasons after which a container will not start without someone changing
/// something (the image, the Pod's configuration): the task fails with the kubelet's
/// message instead of waiting for the job's deadline.
const CANNOT_START: [&str; 7] =
    ["ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError", "RunContainerError"];

/// Waiting reasons a registry causes for a while (a rate limit, a registry restarting):
/// the kubelet retries the pull with a back-off, so the Pod counts as starting until it
/// is older than [`PULL_PATIENCE`].
const PULLING: [&str; 2] = ["ErrImagePull", "ImagePullBackOff"];
/// How long a Pod may wait for its image before its task is failed.
pub const PULL_PATIENCE: Duration = Duration::from_secs(5 * 60);

/// `[kubernetes]`: how job Pods are made.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    /// The namespace of the job Pods (the controller's ServiceAccount needs Pods there).
    pub namespace: String,
    /// A kubeconfig file; unset: the in-cluster ServiceAccount, else `KUBECONFIG` or
    /// `~/.kube/config`.
    pub kubeconfig: Option<PathBuf>,
    /// The runner image (supervisor as ENTRYPOINT).
    pub image: String,
    /// `Always`, `IfNotPresent` or `Never`.
    #[serde(default = "default_pull_policy")]
    pub image_pull_policy: String,
    /// The supervisor and the runner (the image's ENTRYPOINT and CMD by default).
    #[serde(default = "super::default_command")]
    pub command: Vec<String>,
    /// Every job gets its own dockerd (`docker build`, `docker run` in steps). That needs
    /// `privileged` or the `capabilities` list and makes a job step root on its node:
    /// trusted code only. Off by default: the Pod drops every capability but those the
    /// supervisor needs to start the runner, with the runtime's seccomp profile and no
    /// privilege escalation (the jobs namespace can enforce the `baseline` Pod Security
    /// level).
    #[serde(default)]
    pub job_dockerd: bool,
    /// `privileged: true` (with `job_dockerd`); when false, `capabilities` apply instead.
    #[serde(default = "default_true")]
    pub privileged: bool,
    /// Capabilities added when not privileged (the supervisor mounts its loop-backed
    /// storage and runs dockerd); the default is everything but SYS_RESOURCE.
    #[serde(default = "default_capabilities")]
    pub capabilities: Vec<String>,
    /// Requests and limits, Kubernetes quantities (e.g. `cpu = "2"`, `memory = "4Gi"`).
    pub cpu: Option<String>,
    pub memory: Option<String>,
    /// `sizeLimit` of the emptyDir holding the loop image and the runner's work.
    pub work_size_limit: Option<String>,
    /// `activeDeadlineSeconds`: the job's ceiling.
    #[serde(default = "default_deadline", with = "crate::config::duration")]
    pub active_deadline: Duration,
    /// `terminationGracePeriodSeconds`: longer than the supervisor's drain (25 s).
    #[serde(default = "default_grace", with = "crate::config::duration")]
    pub termination_grace: Duration,
    /// `runtimeClassName`, e.g. `kata` for a microVM per job.
    pub runtime_class: Option<String>,
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    /// As in a Pod spec: `{ key = "ci", operator = "Exists", effect = "NoSchedule" }`.
    #[serde(default)]
    pub tolerations: Vec<Toleration>,
    /// The Pods' ServiceAccount (its token is never mounted).
    pub service_account: Option<String>,
    /// More environment for the supervisor. Never secrets, never contract variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// How the supervisor reaches the SPIFFE Workload API inside the Pod.
    pub workload_api: Option<WorkloadApiVolume>,
    /// One SPIRE entry per Pod (selectors such as `k8s:ns:…` and
    /// `k8s:pod-name:{environment}` for the node agent's k8s workload attestor).
    pub spire: Option<crate::spire::SpireConfig>,
}

/// `[kubernetes.workload_api]`: the agent's socket directory in the Pod, from the node
/// (`host_path`) or from the SPIFFE CSI driver (`csi_driver = "csi.spiffe.io"`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadApiVolume {
    pub host_path: Option<String>,
    pub csi_driver: Option<String>,
    /// Where the directory appears in the Pod; `facade.environment_spiffe_endpoint_socket`
    /// names the socket in it.
    #[serde(default = "default_workload_mount")]
    pub mount_path: String,
}

fn default_pull_policy() -> String {
    "IfNotPresent".into()
}
fn default_true() -> bool {
    true
}
fn default_capabilities() -> Vec<String> {
    // Every capability Linux 6.x knows but SYS_RESOURCE, which container runtimes on
    // some hosts cannot grant (runc then fails every container).
    [
        "AUDIT_CONTROL",
        "AUDIT_READ",
        "AUDIT_WRITE",
        "BLOCK_SUSPEND",
        "BPF",
        "CHECKPOINT_RESTORE",
        "CHOWN",
        "DAC_OVERRIDE",
        "DAC_READ_SEARCH",
        "FOWNER",
        "FSETID",
        "IPC_LOCK",
        "IPC_OWNER",
        "KILL",
        "LEASE",
        "LINUX_IMMUTABLE",
        "MAC_ADMIN",
        "MAC_OVERRIDE",
        "MKNOD",
        "NET_ADMIN",
        "NET_BIND_SERVICE",
        "NET_BROADCAST",
        "NET_RAW",
        "PERFMON",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYSLOG",
        "SYS_ADMIN",
        "SYS_BOOT",
        "SYS_CHROOT",
        "SYS_MODULE",
        "SYS_NICE",
        "SYS_PACCT",
        "SYS_PTRACE",
        "SYS_RAWIO",
        "SYS_TIME",
        "SYS_TTY_CONFIG",
        "WAKE_ALARM",
    ]
    .map(str::to_owned)
    .to_vec()
}
fn default_deadline() -> Duration {
    // Gitea's own job timeout.
    Duration::from_secs(3 * 3600)
}
fn default_grace() -> Duration {
    Duration::from_secs(30)
}
fn default_workload_mount() -> String {
    "/run/spire/agent-sockets".into()
}

/// What the supervisor needs without a job-local dockerd: start the agent as the runner
/// uid and own its directories.
const SUPERVISOR_CAPABILITIES: [&str; 6] = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "SETGID", "SETUID"];

impl KubernetesConfig {
    /// What a job step can reach in these Pods, said once at start (docs/security.md).
    pub fn trust_notice(&self) -> Option<String> {
        self.job_dockerd.then(|| {
            let how = if self.privileged { "privileged Pods" } else { "Pods with the capability list and no seccomp" };
            format!(
                "container.kubernetes: jobs get their own dockerd in {how}: a job step can become root on its node and reach the Pods, \
                 SVIDs and capabilities of every job on that node; run only trusted code here (docs/security.md)"
            )
        })
    }

    /// # Errors
    /// The setting that is wrong, and why.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let invalid = |setting: &str, message: String| Err((format!("kubernetes.{setting}"), message));
        if !is_dns_label(&self.namespace) {
            return invalid("namespace", format!("{:?} is not a namespace name (lower-case letters, digits and '-', at most 63)", self.namespace));
        }
        if self.image.trim().is_empty() {
            return invalid("image", "the runner image is required".into());
        }
        if !["Always", "IfNotPresent", "Never"].contains(&self.image_pull_policy.as_str()) {
            return invalid("image_pull_policy", format!("{:?} must be Always, IfNotPresent or Never", self.image_pull_policy));
        }
        if self.command.is_empty() {
            return invalid("command", "must name the supervisor (the default does)".into());
        }
        if self.job_dockerd && !self.privileged && self.capabilities.is_empty() {
            return invalid("capabilities", "a job-local dockerd needs privileged = true or capabilities to mount its storage and run dockerd".into());
        }
        for (setting, value) in [("cpu", &self.cpu), ("memory", &self.memory), ("work_size_limit", &self.work_size_limit)] {
            if let Some(value) = value
                && !is_quantity(value)
            {
                return invalid(setting, format!("{value:?} is not a Kubernetes quantity (e.g. \"2\", \"500m\", \"4Gi\")"));
            }
        }
        if self.active_deadline < Duration::from_secs(60) {
            return invalid("active_deadline", "must be at least 1m".into());
        }
        if let Err(message) = super::check_extra_env(&self.env) {
            return invalid("env", message);
        }
        if let Some(volume) = &self.workload_api {
            match (&volume.host_path, &volume.csi_driver) {
                (Some(_), None) | (None, Some(_)) => {}
                _ => return invalid("workload_api", "set exactly one of host_path and csi_driver".into()),
            }
            if !volume.mount_path.starts_with('/') {
                return invalid("workload_api.mount_path", format!("{:?} must be an absolute path", volume.mount_path));
            }
        }
        if let Some(spire) = &self.spire {
            spire.validate("kubernetes.spire")?;
        }
        Ok(())
    }
}

/// DNS-1123 label.
fn is_dns_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// A plain quantity: digits with an optional fraction and suffix (what Pod resources
/// use); the API server has the last word.
fn is_quantity(value: &str) -> bool {
    let number_end = value.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(value.len());
    let (number, suffix) = value.split_at(number_end);
    !number.is_empty() && number.parse::<f64>().is_ok() && ["", "m", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"].contains(&suffix)
}

#[derive(Clone)]
pub struct KubernetesDriver {
    placement: Placement,
    pods: Api<Pod>,
    config: KubernetesConfig,
}

impl std::fmt::Debug for KubernetesDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesDriver").field("placement", &self.placement).field("namespace", &self.config.namespace).finish_non_exhaustive()
    }
}

impl KubernetesDriver {
    /// Connects with the configured kubeconfig (or the in-cluster ServiceAccount) and
    /// checks that Pods in the namespace can be listed.
    ///
    /// # Errors
    /// An invalid configuration, no usable credentials, an API server that does not
    /// answer, or no permission to list Pods.
    pub async fn connect(config: KubernetesConfig) -> Result<Self, DriverError> {
        let placement = Placement::CONTAINER_KUBERNETES;
        let unavailable = |detail: String| DriverError::Unavailable { placement: placement.to_string(), detail };
        config.validate().map_err(|(setting, message)| unavailable(format!("{setting}: {message}")))?;
        let client_config = match &config.kubeconfig {
            Some(path) => {
                let kubeconfig =
                    kube::config::Kubeconfig::read_from(path).map_err(|e| unavailable(format!("kubernetes.kubeconfig {}: {e}", path.display())))?;
                kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default())
                    .await
                    .map_err(|e| unavailable(format!("kubernetes.kubeconfig {}: {e}", path.display())))?
            }
            None => kube::Config::infer()
                .await
                .map_err(|e| unavailable(format!("no Kubernetes credentials (not in a cluster, no KUBECONFIG; set kubernetes.kubeconfig): {e}")))?,
        };
        let client = Client::try_from(client_config).map_err(|e| unavailable(format!("cannot build the Kubernetes client: {e}")))?;
        let pods: Api<Pod> = Api::namespaced(client, &config.namespace);
        let driver = KubernetesDriver { placement, pods, config };
        driver.pods.list_metadata(&ListParams::default().limit(1)).await.map_err(|e| driver.api_error("listing Pods in", &driver.config.namespace, &e))?;
        Ok(driver)
    }

    fn unavailable(&self, detail: impl Into<String>) -> DriverError {
        DriverError::Unavailable { placement: self.placement.to_string(), detail: detail.into() }
    }

    /// What the API server said, with what to check; `Refused` only where the Pod
    /// itself is invalid (a retry cannot help), `Unavailable` otherwise (the assignment
    /// waits: RBAC, quota or the server can be fixed meanwhile).
    fn api_error(&self, doing: &str, name: &str, error: &kube::Error) -> DriverError {
        match error {
            kube::Error::Api(status) => {
                let hint = match status.code {
                    403 if status.message.contains("exceeded quota") => " (the namespace's ResourceQuota is full; retrying later)".to_owned(),
                    401 | 403 => {
                        format!(" (check the controller's RBAC: it needs get, list, watch, create and delete on pods in namespace {})", self.config.namespace)
                    }
                    404 if doing.starts_with("listing") => format!(" (does namespace {} exist?)", self.config.namespace),
                    _ => String::new(),
                };
                let detail = format!("{doing} {name}: {} ({}){hint}", status.message, status.reason);
                if matches!(status.code, 400 | 422) {
                    DriverError::Refused { placement: self.placement.to_string(), name: name.to_owned(), detail }
                } else {
                    self.unavailable(detail)
                }
            }
            other => self.unavailable(format!("{doing} {name}: {}", crate::error_chain(other))),
        }
    }

    /// The Pod for `spec`.
    pub fn pod(&self, spec: &EnvironmentSpec) -> Pod {
        let config = &self.config;
        let mut env: Vec<EnvVar> = config.env.iter().map(|(k, v)| EnvVar { name: k.clone(), value: Some(v.clone()), ..Default::default() }).collect();
        if !config.job_dockerd {
            env.push(EnvVar { name: "SUPERVISOR_DOCKER".into(), value: Some("false".into()), ..Default::default() });
        }
        env.extend(spec.env.iter().map(|(k, v)| EnvVar { name: k.clone(), value: Some(v.clone()), ..Default::default() }));
        let security_context = if !config.job_dockerd {
            SecurityContext {
                privileged: Some(false),
                allow_privilege_escalation: Some(false),
                capabilities: Some(Capabilities {
                    add: Some(SUPERVISOR_CAPABILITIES.iter().map(|c| (*c).to_owned()).collect()),
                    drop: Some(vec!["ALL".into()]),
                }),
                seccomp_profile: Some(k8s_openapi::api::core::v1::SeccompProfile { type_: "RuntimeDefault".into(), localhost_profile: None }),
                ..Default::default()
            }
        } else if config.privileged {
            SecurityContext { privileged: Some(true), ..Default::default() }
        } else {
            SecurityContext {
                capabilities: Some(Capabilities { add: Some(config.capabilities.clone()), drop: None }),
                allow_privilege_escalation: Some(true),
                seccomp_profile: Some(k8s_openapi::api::core::v1::SeccompProfile { type_: "Unconfined".into(), localhost_profile: None }),
                ..Default::default()
            }
        };
        let mut resources = BTreeMap::new();
        if let Some(cpu) = &config.cpu {
            resources.insert("cpu".to_owned(), Quantity(cpu.clone()));
        }
        if let Some(memory) = &config.memory {
            resources.insert("memory".to_owned(), Quantity(memory.clone()));
        }
        let mut volumes = vec![
            Volume {
                name: "storage".into(),
                empty_dir: Some(EmptyDirVolumeSource { size_limit: config.work_size_limit.clone().map(Quantity), medium: None }),
                ..Default::default()
            },
            Volume { name: "work".into(), empty_dir: Some(EmptyDirVolumeSource::default()), ..Default::default() },
        ];
        let mut mounts = vec![
            // The supervisor's loop image (SUPERVISOR_STORAGE_IMAGE's directory).
            VolumeMount { name: "storage".into(), mount_path: "/var/lib/supervisor".into(), ..Default::default() },
            VolumeMount { name: "work".into(), mount_path: "/home/runner/work".into(), ..Default::default() },
        ];
        if let Some(workload) = &config.workload_api {
            let mut volume = Volume { name: "spire-agent-socket".into(), ..Default::default() };
            if let Some(path) = &workload.host_path {
                volume.host_path = Some(HostPathVolumeSource { path: path.clone(), type_: Some("Directory".into()) });
            }
            if let Some(driver) = &workload.csi_driver {
                volume.csi = Some(CSIVolumeSource { driver: driver.clone(), read_only: Some(true), ..Default::default() });
            }
            volumes.push(volume);
            mounts.push(VolumeMount {
                name: "spire-agent-socket".into(),
                mount_path: workload.mount_path.clone(),
                read_only: Some(true),
                ..Default::default()
            });
        }
        let mut annotations = BTreeMap::new();
        if let Some(id) = spec.env.get(contract::environment::SPIFFE_ID) {
            annotations.insert(ANNOTATION_SPIFFE_ID.to_owned(), id.clone());
        }
        Pod {
            metadata: ObjectMeta {
                name: Some(spec.name.clone()),
                namespace: Some(config.namespace.clone()),
                labels: Some(spec.labels.clone()),
                annotations: (!annotations.is_empty()).then_some(annotations),
                ..Default::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: CONTAINER.into(),
                    image: Some(config.image.clone()),
                    image_pull_policy: Some(config.image_pull_policy.clone()),
                    command: Some(config.command.clone()),
                    env: Some(env),
                    security_context: Some(security_context),
                    resources: (!resources.is_empty()).then(|| ResourceRequirements {
                        requests: Some(resources.clone()),
                        limits: Some(resources),
                        ..Default::default()
                    }),
                    volume_mounts: Some(mounts),
                    ..Default::default()
                }],
                volumes: Some(volumes),
                restart_policy: Some("Never".into()),
                automount_service_account_token: Some(false),
                share_process_namespace: Some(false),
                enable_service_links: Some(false),
                active_deadline_seconds: Some(i64::try_from(config.active_deadline.as_secs()).unwrap_or(i64::MAX)),
                termination_grace_period_seconds: Some(i64::try_from(config.termination_grace.as_secs()).unwrap_or(i64::MAX)),
                runtime_class_name: config.runtime_class.clone(),
                node_selector: (!config.node_selector.is_empty()).then(|| config.node_selector.clone()),
                tolerations: (!config.tolerations.is_empty()).then(|| config.tolerations.clone()),
                service_account_name: config.service_account.clone(),
                ..Default::default()
            }),
            status: None,
        }
    }

    /// Deletes `name` gracefully and waits (up to its grace period and a minute more)
    /// until it is gone.
    async fn delete_and_wait(&self, name: &str) -> Result<(), DriverError> {
        match self.pods.delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(()),
            Err(error) => return Err(self.api_error("deleting", name, &error)),
        }
        let deadline = tokio::time::Instant::now() + self.config.termination_grace + Duration::from_secs(60);
        loop {
            match self.pods.get_opt(name).await {
                Ok(None) => return Ok(()),
                Ok(Some(_)) if tokio::time::Instant::now() >= deadline => {
                    return Err(self.unavailable(format!("Pod {name} is still terminating after its grace period; is its node reachable?")));
                }
                Ok(Some(_)) => tokio::time::sleep(Duration::from_millis(500)).await,
                Err(error) => return Err(self.api_error("waiting for the deletion of", name, &error)),
            }
        }
    }

    fn label_selector(selector: &BTreeMap<String, String>) -> String {
        std::iter::once(format!("{LABEL_MANAGED}=true")).chain(selector.iter().map(|(k, v)| format!("{k}={v}"))).collect::<Vec<_>>().join(",")
    }
}

/// The environment a Pod is, with the kubelet's reason once it ended or cannot start.
pub fn environment_of(pod: &Pod) -> Environment {
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    let (phase, detail) = phase_of(pod);
    Environment {
        name: pod.metadata.name.clone().unwrap_or_default(),
        assignment_id: labels.get(LABEL_ASSIGNMENT).cloned().unwrap_or_default(),
        labels,
        phase,
        detail,
        exit_code: job_container(pod).and_then(|c| c.state?.terminated).map(|t| i64::from(t.exit_code)),
    }
}

fn job_container(pod: &Pod) -> Option<ContainerStatus> {
    pod.status.as_ref()?.container_statuses.as_deref()?.iter().find(|c| c.name == CONTAINER).cloned()
}

fn phase_of(pod: &Pod) -> (Phase, String) {
    let (phase, mut detail) = phase_without_deletion(pod);
    // A Pod being deleted still runs its job until the supervisor has drained: the runner
    // reports its own end through the facade meanwhile. Failing the task at the same
    // moment would race that report (two final log uploads at once crash Gitea 1.23's
    // log transfer), so the Pod counts as running until its container has ended.
    if phase == Phase::Exited && pod.metadata.deletion_timestamp.is_some() {
        detail.push_str(DELETED);
    }
    (phase, detail)
}

/// What the end of a Pod that was deleted by someone adds to its reason.
const DELETED: &str = " after the Pod was deleted (through the Kubernetes API, or its node is drained)";

fn phase_without_deletion(pod: &Pod) -> (Phase, String) {
    let status = pod.status.clone().unwrap_or_default();
    let container = job_container(pod);
    let pod_reason = || {
        let mut detail = String::new();
        if let Some(reason) = status.reason.as_deref().filter(|r| !r.is_empty()) {
            detail.push_str(reason);
        }
        if let Some(message) = status.message.as_deref().filter(|m| !m.is_empty()) {
            if !detail.is_empty() {
                detail.push_str(": ");
            }
            detail.push_str(message);
        }
        detail
    };
    match status.phase.as_deref() {
        Some("Succeeded" | "Failed") => {
            let mut parts = Vec::new();
            let reason = pod_reason();
            if !reason.is_empty() {
                parts.push(format!("the Pod {}", reason));
            }
            if let Some(terminated) = container.as_ref().and_then(terminated_detail) {
                parts.push(terminated);
            }
            if parts.is_empty() {
                parts.push(format!("the Pod {}", status.phase.as_deref().unwrap_or_default().to_ascii_lowercase()));
            }
            (Phase::Exited, parts.join("; "))
        }
        _ => {
            if let Some(waiting) = container.as_ref().and_then(|c| cannot_start(c, age_of(pod))) {
                return (Phase::Exited, waiting);
            }
            if let Some(terminated) = container.as_ref().and_then(terminated_detail) {
                return (Phase::Exited, terminated);
            }
            (Phase::Running, String::new())
        }
    }
}

/// How long ago the Pod was created (zero if it does not say).
fn age_of(pod: &Pod) -> Duration {
    let Some(created) = pod.metadata.creation_timestamp.as_ref() else { return Duration::ZERO };
    let now = k8s_openapi::jiff::Timestamp::now();
    Duration::try_from(now.duration_since(created.0)).unwrap_or(Duration::ZERO)
}

/// "the job container exited with code 137 (OOMKilled)".
fn terminated_detail(container: &ContainerStatus) -> Option<String> {
    let terminated = container.state.as_ref().and_then(|s: &ContainerState| s.terminated.clone())?;
    let mut detail = format!("the job container exited with code {}", terminated.exit_code);
    if let Some(reason) = terminated.reason.as_deref().filter(|r| !r.is_empty() && *r != "Completed" && *r != "Error") {
        let reason = if reason == "OOMKilled" { "OOMKilled: it used more memory than its limit" } else { reason };
        detail.push_str(&format!(" ({reason})"));
    }
    if let Some(message) = terminated.message.as_deref().filter(|m| !m.is_empty()) {
        detail.push_str(": ");
        detail.push_str(message.trim());
    }
    Some(detail)
}

/// "the job container cannot start: ErrImageNeverPull: Container image … is not present".
fn cannot_start(container: &ContainerStatus, age: Duration) -> Option<String> {
    let waiting = container.state.as_ref().and_then(|s| s.waiting.clone())?;
    let reason = waiting.reason.filter(|r| CANNOT_START.contains(&r.as_str()))?;
    if PULLING.contains(&reason.as_str()) && age < PULL_PATIENCE {
        return None;
    }
    let message = waiting.message.unwrap_or_default();
    Some(if message.is_empty() { format!("the job container cannot start: {reason}") } else { format!("the job container cannot start: {reason}: {message}") })
}

#[async_trait]
impl Driver for KubernetesDriver {
    fn placement(&self) -> Placement {
        self.placement
    }

    async fn create(&self, spec: &EnvironmentSpec) -> Result<Environment, DriverError> {
        match self.pods.create(&PostParams::default(), &self.pod(spec)).await {
            Ok(pod) => Ok(environment_of(&pod)),
            // An earlier attempt created it: that one is the environment.
            Err(kube::Error::Api(status)) if status.code == 409 => {
                self.get(&spec.name).await?.ok_or_else(|| self.unavailable(format!("Pod {} exists and vanished at once; retrying", spec.name)))
            }
            Err(error) => Err(self.api_error("creating Pod", &spec.name, &error)),
        }
    }

    async fn get(&self, name: &str) -> Result<Option<Environment>, DriverError> {
        let pod = self.pods.get_opt(name).await.map_err(|e| self.api_error("reading Pod", name, &e))?;
        Ok(pod.as_ref().map(environment_of))
    }

    async fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<Environment>, DriverError> {
        let params = ListParams::default().labels(&Self::label_selector(selector));
        let pods = self.pods.list(&params).await.map_err(|e| self.api_error("listing Pods in", &self.config.namespace, &e))?;
        Ok(pods.items.iter().map(environment_of).collect())
    }

    async fn stop(&self, name: &str) -> Result<(), DriverError> {
        // A graceful delete is a stop: SIGTERM, the supervisor drains, then SIGKILL.
        self.delete_and_wait(name).await
    }

    async fn delete(&self, name: &str) -> Result<(), DriverError> {
        self.delete_and_wait(name).await
    }

    async fn changes(&self) -> Result<Option<super::Changes>, DriverError> {
        use futures_util::StreamExt as _;
        use kube::runtime::{WatchStreamExt as _, watcher};
        let selector = format!("{LABEL_MANAGED}=true,{LABEL_PLACEMENT}={}", self.placement);
        let events = watcher(self.pods.clone(), watcher::Config::default().labels(&selector)).default_backoff();
        // Every status update of an ending Pod is an event: report each Pod's end once.
        let reported = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashSet::<String>::new()));
        let changes = events
            .filter_map(move |event| {
                let reported = std::sync::Arc::clone(&reported);
                async move {
                    let mut reported = reported.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    match event {
                        Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => {
                            let environment = environment_of(&pod);
                            (environment.phase != Phase::Running && reported.insert(environment.name.clone())).then_some(environment)
                        }
                        Ok(watcher::Event::Delete(pod)) => {
                            let mut environment = environment_of(&pod);
                            if reported.remove(&environment.name) {
                                return None;
                            }
                            if environment.phase == Phase::Running {
                                environment.phase = Phase::Exited;
                                environment.detail = format!("the job container did not report its end{DELETED}");
                            }
                            Some(environment)
                        }
                        Ok(_) => None,
                        Err(error) => {
                            tracing::debug!(%error, "watching Pods (the watcher retries)");
                            None
                        }
                    }
                }
            })
            .boxed();
        Ok(Some(changes))
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{ContainerStateTerminated, ContainerStateWaiting, PodStatus};

    use super::*;

    fn config() -> KubernetesConfig {
        toml::from_str("namespace = \"ci-jobs\"\nimage = \"runner:1\"").unwrap()
    }

    fn pod(phase: &str, reason: Option<&str>, state: Option<ContainerState>) -> Pod {
        Pod {
            metadata: ObjectMeta { name: Some("gdr-x-gitea-task-1".into()), ..Default::default() },
            spec: None,
            status: Some(PodStatus {
                phase: Some(phase.into()),
                reason: reason.map(str::to_owned),
                message: reason.map(|r| format!("message for {r}")),
                container_statuses: state.map(|state| vec![ContainerStatus { name: CONTAINER.into(), state: Some(state), ..Default::default() }]),
                ..Default::default()
            }),
        }
    }

    fn created_ago(mut pod: Pod, seconds: i64) -> Pod {
        let created = k8s_openapi::jiff::Timestamp::now().checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(seconds)).unwrap();
        pod.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(created));
        pod
    }

    fn terminated(code: i32, reason: &str) -> ContainerState {
        ContainerState {
            terminated: Some(ContainerStateTerminated { exit_code: code, reason: Some(reason.into()), ..Default::default() }),
            ..Default::default()
        }
    }

    fn waiting(reason: &str) -> ContainerState {
        ContainerState {
            waiting: Some(ContainerStateWaiting { reason: Some(reason.into()), message: Some(format!("kubelet says {reason}")) }),
            ..Default::default()
        }
    }

    #[test]
    fn pod_states_map_to_phases_with_the_kubelets_reason() {
        let cases: Vec<(Pod, Phase, &str)> = vec![
            (pod("Pending", None, None), Phase::Running, ""),
            (pod("Pending", None, Some(waiting("ContainerCreating"))), Phase::Running, ""),
            (pod("Running", None, None), Phase::Running, ""),
            (
                pod("Pending", None, Some(waiting("ErrImageNeverPull"))),
                Phase::Exited,
                "the job container cannot start: ErrImageNeverPull: kubelet says ErrImageNeverPull",
            ),
            // A registry that refuses for a while: the kubelet retries the pull.
            (pod("Pending", None, Some(waiting("ImagePullBackOff"))), Phase::Running, ""),
            (pod("Pending", None, Some(waiting("ErrImagePull"))), Phase::Running, ""),
            (created_ago(pod("Pending", None, Some(waiting("ImagePullBackOff"))), 60), Phase::Running, ""),
            (created_ago(pod("Pending", None, Some(waiting("ImagePullBackOff"))), 6 * 60), Phase::Exited, "cannot start: ImagePullBackOff"),
            (created_ago(pod("Pending", None, Some(waiting("ErrImageNeverPull"))), 1), Phase::Exited, "cannot start: ErrImageNeverPull"),
            (pod("Failed", None, Some(terminated(137, "OOMKilled"))), Phase::Exited, "exited with code 137 (OOMKilled: it used more memory"),
            (pod("Failed", Some("Evicted"), None), Phase::Exited, "the Pod Evicted: message for Evicted"),
            (pod("Failed", Some("DeadlineExceeded"), None), Phase::Exited, "the Pod DeadlineExceeded"),
            (pod("Failed", None, Some(terminated(3, "Error"))), Phase::Exited, "the job container exited with code 3"),
            (pod("Succeeded", None, Some(terminated(0, "Completed"))), Phase::Exited, "exited with code 0"),
            (pod("Failed", None, None), Phase::Exited, "the Pod failed"),
            // Running with the container already ended (the kubelet updates the phase later).
            (pod("Running", None, Some(terminated(1, "Error"))), Phase::Exited, "exited with code 1"),
        ];
        for (pod, phase, detail) in cases {
            let environment = environment_of(&pod);
            assert_eq!(environment.phase, phase, "{pod:?}");
            assert!(environment.detail.contains(detail), "{:?} should contain {detail:?}", environment.detail);
        }
        // Being deleted, still draining: running until the container has ended.
        let deleted = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()));
        let mut deleting = pod("Running", None, None);
        deleting.metadata.deletion_timestamp = deleted.clone();
        assert_eq!(phase_of(&deleting), (Phase::Running, String::new()));
        let mut ended = pod("Running", None, Some(terminated(143, "Error")));
        ended.metadata.deletion_timestamp = deleted;
        let (phase, detail) = phase_of(&ended);
        assert_eq!(phase, Phase::Exited);
        assert!(
            detail.contains("exited with code 143") && detail.ends_with("after the Pod was deleted (through the Kubernetes API, or its node is drained)"),
            "{detail}"
        );
    }

    /// The Pod a driver makes, field by field (the real cluster accepts it: see
    /// tests/e2e/tests/kubernetes.rs).
    // A client needs a runtime (its request buffer is a task); nothing is sent.
    #[tokio::test]
    async fn the_pod_carries_the_contract_and_the_jobs_shape() {
        let mut config = config();
        config.cpu = Some("2".into());
        config.runtime_class = Some("kata".into());
        config.node_selector = BTreeMap::from([("pool".to_owned(), "ci".to_owned())]);
        config.workload_api =
            Some(WorkloadApiVolume { host_path: Some("/run/spire/agent-sockets".into()), csi_driver: None, mount_path: "/run/spire/sockets".into() });
        config.env = BTreeMap::from([("SUPERVISOR_LOG".to_owned(), "debug".to_owned())]);
        let spec = EnvironmentSpec {
            assignment_id: "gitea-task-9".into(),
            name: "gdr-x-gitea-task-9".into(),
            labels: super::super::labels_for("x", "gitea-task-9", Placement::CONTAINER_KUBERNETES),
            env: BTreeMap::from([
                (contract::environment::ASSIGNMENT_ID.to_owned(), "gitea-task-9".to_owned()),
                (contract::environment::SPIFFE_ID.to_owned(), "spiffe://example.org/ci/o/r/build".to_owned()),
            ]),
            ..EnvironmentSpec::default()
        };
        let pods: Api<Pod> = Api::namespaced(Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap(), "ci-jobs");
        // By default: no job-local dockerd, nothing of the supervisor's but what it needs.
        let unprivileged = KubernetesDriver { placement: Placement::CONTAINER_KUBERNETES, pods: pods.clone(), config: config.clone() };
        let pod = serde_json::to_value(unprivileged.pod(&spec)).unwrap();
        let context = &pod["spec"]["containers"][0]["securityContext"];
        assert_eq!(context["privileged"], false);
        assert_eq!(context["allowPrivilegeEscalation"], false);
        assert_eq!(context["capabilities"]["drop"], serde_json::json!(["ALL"]));
        assert_eq!(context["seccompProfile"]["type"], "RuntimeDefault");
        let env: Vec<&str> = pod["spec"]["containers"][0]["env"].as_array().unwrap().iter().map(|e| e["name"].as_str().unwrap()).collect();
        assert_eq!(env, ["SUPERVISOR_LOG", "SUPERVISOR_DOCKER", "CI_ASSIGNMENT_ID", "CI_SPIFFE_ID"]);
        assert!(unprivileged.config.trust_notice().is_none());

        config.job_dockerd = true;
        let driver = KubernetesDriver { placement: Placement::CONTAINER_KUBERNETES, pods, config };
        assert!(driver.config.trust_notice().unwrap().contains("run only trusted code"));
        let pod = serde_json::to_value(driver.pod(&spec)).unwrap();
        assert_eq!(pod["metadata"]["name"], "gdr-x-gitea-task-9");
        assert_eq!(pod["metadata"]["namespace"], "ci-jobs");
        assert_eq!(pod["metadata"]["labels"]["gitea-dynamic-runner/assignment-id"], "gitea-task-9");
        assert_eq!(pod["metadata"]["annotations"][ANNOTATION_SPIFFE_ID], "spiffe://example.org/ci/o/r/build");
        let spec = &pod["spec"];
        assert_eq!(spec["restartPolicy"], "Never");
        assert_eq!(spec["automountServiceAccountToken"], false);
        assert_eq!(spec["shareProcessNamespace"], false);
        assert_eq!(spec["enableServiceLinks"], false);
        assert_eq!(spec["activeDeadlineSeconds"], 3 * 3600);
        assert_eq!(spec["terminationGracePeriodSeconds"], 30);
        assert_eq!(spec["runtimeClassName"], "kata");
        assert_eq!(spec["nodeSelector"]["pool"], "ci");
        let container = &spec["containers"][0];
        assert_eq!(container["securityContext"]["privileged"], true);
        assert_eq!(container["resources"]["limits"]["cpu"], "2");
        assert_eq!(container["resources"]["requests"]["cpu"], "2");
        let env: Vec<&str> = container["env"].as_array().unwrap().iter().map(|e| e["name"].as_str().unwrap()).collect();
        assert_eq!(env, ["SUPERVISOR_LOG", "CI_ASSIGNMENT_ID", "CI_SPIFFE_ID"]);
        let mounts: Vec<&str> = container["volumeMounts"].as_array().unwrap().iter().map(|m| m["mountPath"].as_str().unwrap()).collect();
        assert_eq!(mounts, ["/var/lib/supervisor", "/home/runner/work", "/run/spire/sockets"]);
        assert_eq!(spec["volumes"][2]["hostPath"]["path"], "/run/spire/agent-sockets");
        assert!(spec["volumes"][0]["emptyDir"].is_object());
    }

    #[test]
    fn settings_are_validated_with_their_names() {
        assert_eq!(config().validate(), Ok(()));
        type Change = fn(&mut KubernetesConfig);
        let cases: Vec<(&str, Change)> = vec![
            ("kubernetes.namespace", |c| c.namespace = "CI_Jobs".into()),
            ("kubernetes.namespace", |c| c.namespace = String::new()),
            ("kubernetes.image", |c| c.image = " ".into()),
            ("kubernetes.image_pull_policy", |c| c.image_pull_policy = "Sometimes".into()),
            ("kubernetes.command", |c| c.command.clear()),
            ("kubernetes.capabilities", |c| {
                c.job_dockerd = true;
                c.privileged = false;
                c.capabilities.clear();
            }),
            ("kubernetes.cpu", |c| c.cpu = Some("two".into())),
            ("kubernetes.memory", |c| c.memory = Some("4GB".into())),
            ("kubernetes.work_size_limit", |c| c.work_size_limit = Some("-1".into())),
            ("kubernetes.active_deadline", |c| c.active_deadline = Duration::from_secs(5)),
            ("kubernetes.env", |c| {
                c.env.insert("CI_RUNNER_CAPABILITY".into(), "x".into());
            }),
            ("kubernetes.env", |c| {
                c.env.insert("GITEA_RUNNER_TOKEN".into(), "x".into());
            }),
            ("kubernetes.workload_api", |c| {
                c.workload_api = Some(WorkloadApiVolume { host_path: None, csi_driver: None, mount_path: "/run/spire".into() });
            }),
            ("kubernetes.workload_api.mount_path", |c| {
                c.workload_api = Some(WorkloadApiVolume { host_path: Some("/run/spire".into()), csi_driver: None, mount_path: "run".into() });
            }),
        ];
        for (setting, change) in cases {
            let mut config = config();
            change(&mut config);
            let (named, message) = config.validate().unwrap_err();
            assert_eq!(named, setting, "{message}");
            assert!(!message.is_empty());
        }
        for good in ["2", "500m", "4Gi", "1.5", "128Mi"] {
            assert!(is_quantity(good), "{good}");
        }
    }
}
