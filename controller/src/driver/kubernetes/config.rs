//! `[kubernetes]`: how job Pods are made, and the checks of those settings.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use k8s_openapi::api::core::v1::Toleration;
use serde::Deserialize;

use crate::setting::Problems;

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
    #[serde(default = "crate::driver::default_command")]
    pub command: Vec<String>,
    /// Which Docker every job gets: `"none"` (the default) or `"root"`, its own dockerd
    /// (`docker build`, `docker run` in steps), which needs `privileged` or the
    /// `capabilities` list and makes a job step root on its node: trusted code only (no
    /// rootless mode on Pods yet). Without one: the Pod drops every capability but those the
    /// supervisor needs to start the runner, with the runtime's seccomp profile and no
    /// privilege escalation (the jobs namespace can enforce the `baseline` Pod Security
    /// level).
    #[serde(default)]
    pub job_docker: Option<contract::environment::JobDocker>,
    /// `job_docker = "root"`, as older configurations say it.
    #[serde(default)]
    pub job_dockerd: bool,
    /// Registry mirrors the job's dockerd pulls Docker Hub images through (`job_dockerd`).
    #[serde(default)]
    pub registry_mirrors: Vec<String>,
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
    #[serde(default = "default_deadline", with = "crate::setting::duration")]
    pub active_deadline: Duration,
    /// `terminationGracePeriodSeconds`: longer than the supervisor's drain (25 s).
    #[serde(default = "default_grace", with = "crate::setting::duration")]
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
    pub spire: Option<crate::driver::spire::SpireConfig>,
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

impl KubernetesConfig {
    /// Which Docker its jobs have (`job_docker`, or its alias `job_dockerd`).
    pub fn job_docker(&self) -> contract::environment::JobDocker {
        crate::driver::job_docker_of(self.job_docker, self.job_dockerd, false)
    }

    /// What a job step can reach in these Pods, said once at start (docs/security.md).
    pub fn trust_notice(&self) -> Option<String> {
        self.job_docker().runs_dockerd().then(|| {
            let how = if self.privileged { "privileged Pods" } else { "Pods with the capability list and no seccomp" };
            format!(
                "container.kubernetes: jobs get their own dockerd in {how}: a job step can become root on its node and reach the Pods, \
                 SVIDs and capabilities of every job on that node; run only trusted code here (docs/security.md)"
            )
        })
    }

    pub fn validate(&self, problems: &mut Problems) {
        crate::driver::check_job_docker("kubernetes", self.job_docker, self.job_dockerd, false, problems);
        if self.job_docker == Some(contract::environment::JobDocker::Rootless) {
            problems.add("kubernetes.job_docker", "\"rootless\" is not offered on Pods yet: \"none\" or \"root\" (docs/security.md)");
        }
        crate::driver::check_registry_mirrors("kubernetes.registry_mirrors", &self.registry_mirrors, self.job_docker().runs_dockerd(), problems);
        let mut invalid = |setting: &str, message: String| problems.add(format!("kubernetes.{setting}"), message);
        if !is_dns_label(&self.namespace) {
            invalid("namespace", format!("{:?} is not a namespace name (lower-case letters, digits and '-', at most 63)", self.namespace));
        }
        if self.image.trim().is_empty() {
            invalid("image", "the runner image is required".into());
        }
        if !["Always", "IfNotPresent", "Never"].contains(&self.image_pull_policy.as_str()) {
            invalid("image_pull_policy", format!("{:?} must be Always, IfNotPresent or Never", self.image_pull_policy));
        }
        if self.command.is_empty() {
            invalid("command", "must name the supervisor (the default does)".into());
        }
        if self.job_docker().runs_dockerd() && !self.privileged && self.capabilities.is_empty() {
            invalid("capabilities", "a job-local dockerd needs privileged = true or capabilities to mount its storage and run dockerd".into());
        }
        for (setting, value) in [("cpu", &self.cpu), ("memory", &self.memory), ("work_size_limit", &self.work_size_limit)] {
            if let Some(value) = value
                && !is_quantity(value)
            {
                invalid(setting, format!("{value:?} is not a Kubernetes quantity (e.g. \"2\", \"500m\", \"4Gi\")"));
            }
        }
        if self.active_deadline < Duration::from_secs(60) {
            invalid("active_deadline", "must be at least 1m".into());
        }
        if let Err(message) = crate::driver::check_extra_env(&self.env) {
            invalid("env", message);
        }
        if let Some(volume) = &self.workload_api {
            if !matches!((&volume.host_path, &volume.csi_driver), (Some(_), None) | (None, Some(_))) {
                invalid("workload_api", "set exactly one of host_path and csi_driver".into());
            }
            if !volume.mount_path.starts_with('/') {
                invalid("workload_api.mount_path", format!("{:?} must be an absolute path", volume.mount_path));
            }
        }
        if let Some(spire) = &self.spire {
            spire.validate("kubernetes.spire", problems);
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> KubernetesConfig {
        toml::from_str("namespace = \"ci-jobs\"\nimage = \"runner:1\"").unwrap()
    }

    #[test]
    fn settings_are_validated_with_their_names() {
        assert_eq!(Problems::check(|p| config().validate(p)), Ok(()));
        type Change = fn(&mut KubernetesConfig);
        let cases: Vec<(&str, Change)> = vec![
            ("kubernetes.namespace", |c| c.namespace = "CI_Jobs".into()),
            ("kubernetes.namespace", |c| c.namespace = String::new()),
            ("kubernetes.image", |c| c.image = " ".into()),
            ("kubernetes.image_pull_policy", |c| c.image_pull_policy = "Sometimes".into()),
            ("kubernetes.command", |c| c.command.clear()),
            ("kubernetes.job_docker", |c| c.job_docker = Some(contract::environment::JobDocker::Rootless)),
            ("kubernetes.job_docker", |c| {
                c.job_docker = Some(contract::environment::JobDocker::None);
                c.job_dockerd = true;
            }),
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
            let problems = Problems::check(|p| config.validate(p)).expect_err(setting);
            assert_eq!(problems.settings(), [setting], "{problems}");
            assert!(problems.iter().all(|invalid| !invalid.message.is_empty()));
        }
        for good in ["2", "500m", "4Gi", "1.5", "128Mi"] {
            assert!(is_quantity(good), "{good}");
        }
    }
}
