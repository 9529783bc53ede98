//! The environment contract: the variables a driver injects into an environment and
//! the supervisor reads. Both sides use [`Contract`], so a name cannot drift between
//! them.
//!
//! **Empty is unset.** A driver writes only the variables that have a value
//! ([`Contract::to_vars`]); the supervisor treats a variable that is present but empty
//! exactly like a missing one ([`Contract::from_lookup`]), and fails with a message
//! naming the variable only where a value is required.
//!
//! Never in the contract: the Gitea runner token and the registration token. The
//! capability is assignment-scoped and short-lived; the supervisor keeps it from the
//! job's environment.

use std::collections::BTreeMap;

/// `gitea-task-<id>`: the assignment this environment runs.
pub const ASSIGNMENT_ID: &str = "CI_ASSIGNMENT_ID";
/// The assignment capability (HMAC token bound to the assignment id, with an expiry).
pub const CAPABILITY: &str = "CI_RUNNER_CAPABILITY";
/// A file holding the capability instead (the docker driver): PID 1 reads it and
/// removes it before anything of the job runs, so the capability is in no container
/// configuration (`docker inspect`) and no file a step could read.
pub const CAPABILITY_FILE: &str = "CI_RUNNER_CAPABILITY_FILE";
/// The controller's facade: `unix:///path` (socket mounted in) or `https://host:port`.
pub const FACADE_URL: &str = "CI_RUNNER_FACADE_URL";
/// The facade's exact SPIFFE ID (https facades only).
pub const FACADE_SPIFFE_ID: &str = "CI_RUNNER_FACADE_SPIFFE_ID";
/// The exact SPIFFE ID of this job; set means "wait for this SVID".
pub const SPIFFE_ID: &str = "CI_SPIFFE_ID";
/// The Workload API endpoint, e.g. `unix:///run/spire/agent/public/api.sock`.
pub const SPIFFE_ENDPOINT_SOCKET: &str = "SPIFFE_ENDPOINT_SOCKET";
/// The runner labels for the `.runner` file, a JSON array of strings.
pub const RUNNER_LABELS_JSON: &str = "CI_RUNNER_LABELS_JSON";
/// Gitea as this environment reaches it: the loopback passes every path that is not
/// the runner protocol there (checkout, artifacts, API calls of steps).
pub const GITEA_URL: &str = "CI_GITEA_URL";

/// What a driver tells the supervisor about the runner user beyond the contract (the
/// supervisor's own flags, read from these variables).
pub mod runner_user {
    /// The runner's uid and gid in the runner image (rootfs/Dockerfile): what environments
    /// run as when no driver assigns other ids.
    pub const IMAGE_ID: u32 = 2000;
    /// The image's docker group (owns dockerd's socket): no runner gid may be it.
    pub const IMAGE_DOCKER_GID: u32 = 2001;
    /// The host uid the agent and the job run as (`--runner-uid`; the image's 2000 when unset).
    pub const UID: &str = "SUPERVISOR_RUNNER_UID";
    /// The runner's primary gid (`--runner-gid`).
    pub const GID: &str = "SUPERVISOR_RUNNER_GID";
    /// `FIRST:COUNT`: the runner's subordinate uids and gids for a rootless dockerd
    /// (`--subordinate-ids`; the image's /etc/subuid and /etc/subgid when unset).
    pub const SUBORDINATE_IDS: &str = "SUPERVISOR_SUBORDINATE_IDS";
}

/// Which Docker a job has of its own: one mode for both sides (the controller's
/// `job_dockerd`/`rootless_dockerd` settings, the supervisor's [`supervisor::DOCKER`] and
/// [`supervisor::DOCKER_ROOTLESS`]), so that no combination of two flags can mean
/// something neither side meant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobDocker {
    /// No dockerd: the job uses none (the safe default of the docker and kubernetes
    /// placements).
    None,
    /// A rootless dockerd as the runner uid, in user namespaces of its own.
    Rootless,
    /// A dockerd as root on loop-backed storage: a step is root where the environment is
    /// (the runner image's default, for VMs).
    Root,
}

impl JobDocker {
    /// From the supervisor's two flags: rootless means nothing without a dockerd.
    pub const fn from_flags(docker: bool, rootless: bool) -> JobDocker {
        match (docker, rootless) {
            (false, _) => JobDocker::None,
            (true, true) => JobDocker::Rootless,
            (true, false) => JobDocker::Root,
        }
    }

    /// As the settings write it: `none`, `rootless`, `root`.
    pub const fn as_str(self) -> &'static str {
        match self {
            JobDocker::None => "none",
            JobDocker::Rootless => "rootless",
            JobDocker::Root => "root",
        }
    }

    /// Whether the environment starts a dockerd (and the job waits for it).
    pub const fn runs_dockerd(self) -> bool {
        !matches!(self, JobDocker::None)
    }

    pub const fn is_rootless(self) -> bool {
        matches!(self, JobDocker::Rootless)
    }

    /// The supervisor's variables a driver sets for this mode (root is the image's
    /// default: none). A rootless dockerd's socket depends on the runner uid: the driver
    /// adds [`supervisor::DOCKER_SOCKET`].
    pub const fn supervisor_vars(self) -> &'static [(&'static str, &'static str)] {
        match self {
            JobDocker::None => &[(supervisor::DOCKER, "false")],
            JobDocker::Rootless => &[(supervisor::DOCKER_ROOTLESS, "true")],
            JobDocker::Root => &[],
        }
    }
}

/// The supervisor's own settings a driver or an operator sets (each a flag of `supervisor`,
/// read from this variable): every `SUPERVISOR_*` name, here so that the drivers, the
/// supervisor and the docs share one spelling.
pub mod supervisor {
    /// `true` (the image's default) or `false`: whether the job has a dockerd.
    pub const DOCKER: &str = "SUPERVISOR_DOCKER";
    /// `true`: that dockerd is rootless ([`super::JobDocker::Rootless`]).
    pub const DOCKER_ROOTLESS: &str = "SUPERVISOR_DOCKER_ROOTLESS";
    /// The job's dockerd socket in the environment.
    pub const DOCKER_SOCKET: &str = "SUPERVISOR_DOCKER_SOCKET";
    /// Comma-separated registry mirrors of the job's dockerd.
    pub const REGISTRY_MIRRORS: &str = "SUPERVISOR_REGISTRY_MIRRORS";
    /// The size of the job's loop-backed storage, e.g. `10G`.
    pub const STORAGE_SIZE: &str = "SUPERVISOR_STORAGE_SIZE";
    /// The supervisor's log filter (`tracing`'s `EnvFilter`), e.g. `debug`.
    pub const LOG: &str = "SUPERVISOR_LOG";
    /// `true` or `false`: whether the agent waits for the job's SVID (default: whether a SPIFFE ID is given).
    pub const IDENTITY: &str = "SUPERVISOR_IDENTITY";
    /// The job's dockerd's data root.
    pub const DOCKER_DATA_ROOT: &str = "SUPERVISOR_DOCKER_DATA_ROOT";
    /// Where the job's dockerd logs.
    pub const DOCKERD_LOG: &str = "SUPERVISOR_DOCKERD_LOG";
    /// The cgroup filesystem PID 1 nests the job's dockerd in.
    pub const CGROUP_ROOT: &str = "SUPERVISOR_CGROUP_ROOT";
    /// gitea-runner's working directory.
    pub const RUNNER_DIR: &str = "SUPERVISOR_RUNNER_DIR";
    /// The image's docker group (owns the job's dockerd socket).
    pub const DOCKER_GID: &str = "SUPERVISOR_DOCKER_GID";
    /// The runner user's home.
    pub const RUNNER_HOME: &str = "SUPERVISOR_RUNNER_HOME";
    /// The dockerd binary.
    pub const DOCKERD: &str = "SUPERVISOR_DOCKERD";
    /// The rootless dockerd's launcher (`dockerd-rootless.sh`).
    pub const ROOTLESS_DOCKERD: &str = "SUPERVISOR_ROOTLESS_DOCKERD";
    /// The job's dockerd's exec root.
    pub const DOCKER_EXEC_ROOT: &str = "SUPERVISOR_DOCKER_EXEC_ROOT";
    /// The job's dockerd's pid file.
    pub const DOCKER_PIDFILE: &str = "SUPERVISOR_DOCKER_PIDFILE";
    /// How the job's dockerd makes its bridge.
    pub const DOCKER_BRIDGE: &str = "SUPERVISOR_DOCKER_BRIDGE";
    /// How long a job waits for its dockerd.
    pub const DOCKER_READY_TIMEOUT: &str = "SUPERVISOR_DOCKER_READY_TIMEOUT";
    /// The sparse file behind the job's loop-backed storage.
    pub const STORAGE_IMAGE: &str = "SUPERVISOR_STORAGE_IMAGE";
    /// The mkfs that formats that storage.
    pub const MKFS: &str = "SUPERVISOR_MKFS";
    /// How long PID 1 waits for the job's SVID.
    pub const IDENTITY_TIMEOUT: &str = "SUPERVISOR_IDENTITY_TIMEOUT";
    /// Whether gitea-runner gets the job-started hook.
    pub const RUNNER_HOOKS: &str = "SUPERVISOR_RUNNER_HOOKS";
    /// How long a stopped environment drains.
    pub const DRAIN_TIMEOUT: &str = "SUPERVISOR_DRAIN_TIMEOUT";
    /// PID 1's state directory.
    pub const STATE_DIR: &str = "SUPERVISOR_STATE_DIR";
    /// The agent's socket (the job-started hook asks it).
    pub const AGENT_SOCKET: &str = "SUPERVISOR_AGENT_SOCKET";
    /// How long the job-started hook waits for the environment.
    pub const JOB_STARTED_TIMEOUT: &str = "SUPERVISOR_JOB_STARTED_TIMEOUT";
    /// PID 1's configuration of the agent (set by PID 1 for the agent only).
    pub const AGENT_CONFIG: &str = "SUPERVISOR_AGENT_CONFIG";
}

/// Every variable of the contract, in the order they are documented.
pub const ALL: [&str; 9] =
    [ASSIGNMENT_ID, CAPABILITY, CAPABILITY_FILE, FACADE_URL, FACADE_SPIFFE_ID, SPIFFE_ID, SPIFFE_ENDPOINT_SOCKET, RUNNER_LABELS_JSON, GITEA_URL];

/// The contract's values; `None` is "unset" (an empty variable reads as `None`).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Contract {
    pub assignment_id: Option<String>,
    pub capability: Option<String>,
    pub capability_file: Option<String>,
    pub facade_url: Option<String>,
    pub facade_spiffe_id: Option<String>,
    pub spiffe_id: Option<String>,
    pub spiffe_endpoint_socket: Option<String>,
    /// Kept as the JSON text: the supervisor validates it and names the variable.
    pub runner_labels_json: Option<String>,
    pub gitea_url: Option<String>,
}

impl std::fmt::Debug for Contract {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The capability is a credential: never printed.
        f.debug_struct("Contract")
            .field("assignment_id", &self.assignment_id)
            .field("capability", &self.capability.as_ref().map(|_| "<redacted>"))
            .field("capability_file", &self.capability_file)
            .field("facade_url", &self.facade_url)
            .field("facade_spiffe_id", &self.facade_spiffe_id)
            .field("spiffe_id", &self.spiffe_id)
            .field("spiffe_endpoint_socket", &self.spiffe_endpoint_socket)
            .field("runner_labels_json", &self.runner_labels_json)
            .field("gitea_url", &self.gitea_url)
            .finish()
    }
}

impl Contract {
    /// The labels as JSON, for [`Contract::runner_labels_json`].
    pub fn labels_json(labels: &[String]) -> String {
        serde_json::to_string(labels).unwrap_or_else(|_| "[]".to_owned())
    }

    fn fields(&self) -> [(&'static str, &Option<String>); 9] {
        [
            (ASSIGNMENT_ID, &self.assignment_id),
            (CAPABILITY, &self.capability),
            (CAPABILITY_FILE, &self.capability_file),
            (FACADE_URL, &self.facade_url),
            (FACADE_SPIFFE_ID, &self.facade_spiffe_id),
            (SPIFFE_ID, &self.spiffe_id),
            (SPIFFE_ENDPOINT_SOCKET, &self.spiffe_endpoint_socket),
            (RUNNER_LABELS_JSON, &self.runner_labels_json),
            (GITEA_URL, &self.gitea_url),
        ]
    }

    /// The variables to set: only those with a non-empty value.
    pub fn to_vars(&self) -> BTreeMap<String, String> {
        self.fields().into_iter().filter_map(|(name, value)| value.as_deref().filter(|v| !v.is_empty()).map(|v| (name.to_owned(), v.to_owned()))).collect()
    }

    /// Reads the contract through `lookup` (e.g. `std::env::var`); empty values are unset.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Contract {
        let get = |name: &str| lookup(name).filter(|v| !v.is_empty());
        Contract {
            assignment_id: get(ASSIGNMENT_ID),
            capability: get(CAPABILITY),
            capability_file: get(CAPABILITY_FILE),
            facade_url: get(FACADE_URL),
            facade_spiffe_id: get(FACADE_SPIFFE_ID),
            spiffe_id: get(SPIFFE_ID),
            spiffe_endpoint_socket: get(SPIFFE_ENDPOINT_SOCKET),
            runner_labels_json: get(RUNNER_LABELS_JSON),
            gitea_url: get(GITEA_URL),
        }
    }

    /// Reads this process's environment.
    pub fn from_process_env() -> Contract {
        Contract::from_lookup(|name| std::env::var(name).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a driver sets for a mode is what the supervisor's flags read back, with the
    /// image's defaults (`SUPERVISOR_DOCKER=true`, `SUPERVISOR_DOCKER_ROOTLESS=false`) for
    /// what is unset.
    #[test]
    fn each_job_docker_mode_survives_the_trip_through_the_variables() {
        for mode in [JobDocker::None, JobDocker::Rootless, JobDocker::Root] {
            let vars: BTreeMap<&str, &str> = mode.supervisor_vars().iter().copied().collect();
            let flag = |name: &str, default: bool| vars.get(name).map_or(default, |value| *value == "true");
            assert_eq!(JobDocker::from_flags(flag(supervisor::DOCKER, true), flag(supervisor::DOCKER_ROOTLESS, false)), mode);
        }
        for (docker, rootless, mode, dockerd) in [
            (false, false, JobDocker::None, false),
            (false, true, JobDocker::None, false),
            (true, false, JobDocker::Root, true),
            (true, true, JobDocker::Rootless, true),
        ] {
            assert_eq!(JobDocker::from_flags(docker, rootless), mode, "{docker} {rootless}");
            assert_eq!(mode.runs_dockerd(), dockerd);
        }
    }

    #[test]
    fn empty_and_missing_are_the_same() {
        let vars = BTreeMap::from([(ASSIGNMENT_ID, "gitea-task-1"), (SPIFFE_ENDPOINT_SOCKET, ""), (FACADE_SPIFFE_ID, "")]);
        let contract = Contract::from_lookup(|name| vars.get(name).map(|v| (*v).to_owned()));
        assert_eq!(contract.assignment_id.as_deref(), Some("gitea-task-1"));
        assert_eq!(contract.spiffe_endpoint_socket, None);
        assert_eq!(contract.facade_spiffe_id, None);
        assert_eq!(contract.gitea_url, None);
    }

    #[test]
    fn only_values_are_written_and_they_read_back() {
        let contract = Contract {
            assignment_id: Some("gitea-task-7".into()),
            capability: Some("cap".into()),
            facade_url: Some("unix:///run/gdr/facade.sock".into()),
            facade_spiffe_id: Some(String::new()),
            runner_labels_json: Some(Contract::labels_json(&["self-hosted".into()])),
            ..Contract::default()
        };
        let vars = contract.to_vars();
        assert_eq!(vars.keys().map(String::as_str).collect::<Vec<_>>(), [ASSIGNMENT_ID, CAPABILITY, FACADE_URL, RUNNER_LABELS_JSON]);
        let back = Contract::from_lookup(|name| vars.get(name).cloned());
        assert_eq!(back, Contract { facade_spiffe_id: None, ..contract });
    }

    #[test]
    fn debug_hides_the_capability() {
        let contract = Contract { capability: Some("secret-capability".into()), ..Contract::default() };
        assert!(!format!("{contract:?}").contains("secret-capability"));
    }

    #[test]
    fn every_name_is_listed_once() {
        let mut names = ALL.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ALL.len());
        assert_eq!(Contract::default().fields().map(|(n, _)| n), ALL);
    }
}

/// Whether `url` is a registry mirror a job dockerd takes (`--registry-mirror`): an
/// http(s) URL with a host, no comma (the supervisor's variable lists them with commas)
/// and no whitespace. The controller checks its settings with it, the supervisor its flag.
///
/// # Errors
/// What is wrong with it, with an example.
pub fn check_registry_mirror(url: &str) -> Result<(), String> {
    let host = url.strip_prefix("https://").or_else(|| url.strip_prefix("http://")).map(|rest| rest.trim_end_matches('/'));
    match host {
        Some(host) if !host.is_empty() && !host.contains(',') && !host.contains(char::is_whitespace) => Ok(()),
        _ => Err(format!("{url:?} is not an http(s) URL of a registry, e.g. \"https://mirror.example.org\"")),
    }
}

#[cfg(test)]
mod registry_mirror_tests {
    #[test]
    fn registry_mirrors() {
        for (url, ok) in [
            ("https://mirror.example.org", true),
            ("http://10.0.0.1:5000/", true),
            ("mirror.example.org", false),
            ("https://", false),
            ("https://a.example,https://b.example", false),
            ("https://a example", false),
            ("ftp://mirror.example.org", false),
        ] {
            assert_eq!(super::check_registry_mirror(url).is_ok(), ok, "{url}");
        }
    }
}
