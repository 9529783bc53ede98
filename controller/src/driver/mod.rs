//! Environment drivers: one per placement, each creating one disposable environment
//! per assignment (a Pod, an OpenSandbox sandbox, a Docker container).
//!
//! Environments are the truth for what runs: every one carries labels that name its
//! assignment, so pools are rebuilt from driver listings at start and a reconciler can
//! find what to delete.

use std::collections::BTreeMap;

use async_trait::async_trait;
use contract::environment::JobDocker;

use crate::assignment::placement::Placement;

#[cfg(feature = "test-driver")]
pub mod directory;
pub mod docker;
pub mod kubernetes;
pub mod opensandbox;
pub mod seccomp;
pub mod spire;

/// Labels every environment carries (recovery metadata).
pub const LABEL_ASSIGNMENT: &str = "gitea-dynamic-runner/assignment-id";
pub const LABEL_PLACEMENT: &str = "gitea-dynamic-runner/placement";
pub const LABEL_MANAGED: &str = "gitea-dynamic-runner/managed";
/// Which controller installation an environment belongs to (`Config::installation`).
pub const LABEL_INSTANCE: &str = "gitea-dynamic-runner/instance";
/// Proof that the installation holding the capability key made the environment (a MAC
/// of its name): a controller removes or counts only environments it can prove it made,
/// whatever else shares the Docker host, the namespace or the installation's name.
pub const LABEL_PROOF: &str = "gitea-dynamic-runner/proof";

/// A stream of environments that changed on their own (ended, failed, evicted).
pub type Changes = std::pin::Pin<Box<dyn futures_util::Stream<Item = Environment> + Send>>;

/// What a driver is asked to create.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct EnvironmentSpec {
    pub assignment_id: String,
    /// Derived from the assignment id, so a retried create finds the first one.
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// The environment contract's variables (`contract::environment`), only those with
    /// a value — never a Gitea credential.
    pub env: BTreeMap<String, String>,
    /// The environment's own facade directory on the host (its socket, and its
    /// capability file until PID 1 has read it), for drivers that mount it at
    /// `contract::facade::ENVIRONMENT_DIR`.
    pub facade_dir: Option<FacadeDir>,
}

/// An environment's own facade directory; see `facade::sockets`.
#[derive(Clone, PartialEq, Eq)]
pub struct FacadeDir {
    /// The host directory the driver mounts.
    pub host: std::path::PathBuf,
    /// What the worker writes into its capability file before the environment starts.
    pub capability: String,
}

impl std::fmt::Debug for FacadeDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FacadeDir").field("host", &self.host).finish_non_exhaustive()
    }
}

impl std::fmt::Debug for EnvironmentSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The capability is a credential: keep it out of logs.
        f.debug_struct("EnvironmentSpec")
            .field("assignment_id", &self.assignment_id)
            .field("name", &self.name)
            .field("labels", &self.labels)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("facade_dir", &self.facade_dir)
            .finish()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Running,
    /// Marked terminal by the controller; waiting for deletion.
    Terminal,
    /// Exited or failed on its own.
    Exited,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Environment {
    pub name: String,
    pub assignment_id: String,
    pub labels: BTreeMap<String, String>,
    pub phase: Phase,
    /// Why it ended, in the backend's words (exit code, OOM kill, eviction …); empty
    /// while it runs.
    pub detail: String,
    /// The code its main process (the supervisor) exited with, where the backend says.
    pub exit_code: Option<i64>,
}

impl Environment {
    /// Why an environment that never claimed its job ended: the backend's words and,
    /// since no job ran to give the code, what the supervisor said with it.
    pub fn why_unclaimed(&self) -> String {
        let detail = if self.detail.is_empty() { "no reason given" } else { self.detail.as_str() };
        match self.exit_code.and_then(contract::exit::meaning) {
            Some(meaning) => format!("{detail} — {meaning}"),
            None => detail.to_owned(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("the {placement} driver cannot reach its backend: {detail}")]
    Unavailable { placement: String, detail: String },
    #[error("the {placement} driver refused {name}: {detail}")]
    Refused { placement: String, name: String, detail: String },
    /// Nothing is wrong, but the environment cannot be made yet (the worker tries again).
    #[error("the {placement} driver cannot make {name} yet: {detail}")]
    Waiting { placement: String, name: String, detail: String },
}

#[async_trait]
pub trait Driver: Send + Sync + std::fmt::Debug {
    fn placement(&self) -> Placement;
    /// Creates the environment; idempotent by `spec.name` (an existing one is returned).
    async fn create(&self, spec: &EnvironmentSpec) -> Result<Environment, DriverError>;
    async fn get(&self, name: &str) -> Result<Option<Environment>, DriverError>;
    /// Every managed environment whose labels include all of `selector`.
    async fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<Environment>, DriverError>;
    /// Nothing more will run in it: stops it gracefully (its supervisor drains) and
    /// deletes it.
    async fn stop(&self, name: &str) -> Result<(), DriverError>;
    /// Deletes it with its storage; deleting a missing one is not an error.
    async fn delete(&self, name: &str) -> Result<(), DriverError>;
    /// Environments of this driver that end on their own, as they end, so a worker
    /// reacts at once instead of at its next sweep. `None`: the driver cannot watch
    /// (the sweep alone notices).
    async fn changes(&self) -> Result<Option<Changes>, DriverError> {
        Ok(None)
    }
    /// Removes what the driver keeps beside its environments (their SPIRE entries) for
    /// environments that are not in `listed`, a fresh listing of the placement; returns
    /// how many it removed.
    async fn sweep_leftovers(&self, _listed: &[Environment]) -> Result<usize, DriverError> {
        Ok(0)
    }
}

/// The runner image's supervisor running the runner for one job: the command of
/// drivers whose backend needs it spelled out (the image's ENTRYPOINT and CMD).
pub fn default_command() -> Vec<String> {
    ["/usr/local/bin/supervisor", "run", "--", "/usr/local/bin/gitea-runner", "daemon", "--once", "--config", "/etc/gitea-runner/config.yaml"]
        .map(str::to_owned)
        .to_vec()
}

/// Checks a driver's extra environment for environments: never a contract variable
/// (the controller sets those per job), never something that looks like a secret.
///
/// # Errors
/// What is wrong with which variable.
pub fn check_extra_env(env: &BTreeMap<String, String>) -> Result<(), String> {
    for name in env.keys() {
        if contract::environment::ALL.contains(&name.as_str()) {
            return Err(format!("{name} is set by the controller for each job (the environment contract); remove it"));
        }
        if name.ends_with("TOKEN") || name.ends_with("_KEY") || name.contains("PASSWORD") || name.contains("SECRET") {
            return Err(format!("{name} looks like a secret: environments never get the controller's secrets"));
        }
    }
    Ok(())
}

/// Whether an error is worth retrying (the backend is unavailable) or final (the
/// backend refused this environment: retrying cannot help, the task must fail).
impl DriverError {
    pub fn is_refusal(&self) -> bool {
        matches!(self, DriverError::Refused { .. })
    }
}

/// An installation's default name: 8 hex digits of the hash of what tells installations
/// apart — the Gitea URL and where its records are (two controllers of one Gitea with two
/// stores, as during a migration, are two installations). Task ids are Gitea's, so two
/// installations on one Docker host (or one Kubernetes namespace) would otherwise name
/// their environments alike.
pub fn instance_of(gitea_url: &str, store: &str) -> String {
    let text = format!("{}\n{store}", gitea_url.trim_end_matches('/'));
    let digest = ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
    digest.as_ref()[..4].iter().map(|b| format!("{b:02x}")).collect()
}

/// What is wrong with `mirrors` (a job dockerd's `--registry-mirror` URLs) for the setting
/// named `setting`; `job_dockerd` says whether the placement's jobs have a dockerd at all.
pub fn check_registry_mirrors(setting: &str, mirrors: &[String], job_dockerd: bool, problems: &mut crate::setting::Problems) {
    for mirror in mirrors {
        if let Err(message) = contract::environment::check_registry_mirror(mirror) {
            problems.add(setting, message);
        }
    }
    if !mirrors.is_empty() && !job_dockerd {
        problems.add(setting, "mirrors are for a job's own dockerd, which this placement's jobs do not have: turn one on, or remove them");
    }
}

/// The environment name for an assignment of an installation: DNS-1123-safe, as Pods
/// and containers need.
pub fn environment_name(instance: &str, assignment_id: &str) -> String {
    let name: String = assignment_id.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    if instance.is_empty() { format!("gdr-{}", name.trim_matches('-')) } else { format!("gdr-{instance}-{}", name.trim_matches('-')) }
}

/// The name of an assignment's environment at `attempt` (0: the first). A new attempt
/// gets a new name, so that a listing taken before an ended environment was deleted
/// can never be mistaken for its successor: a stale stop or "ended" would otherwise
/// hit the new environment of the same name (found by the kill campaign).
pub fn attempt_name(instance: &str, assignment_id: &str, attempt: u32) -> String {
    let name = environment_name(instance, assignment_id);
    if attempt == 0 { name } else { format!("{name}-r{attempt}") }
}

/// Recovery labels of an environment.
pub fn labels_for(instance: &str, assignment_id: &str, placement: Placement) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_MANAGED.to_owned(), "true".to_owned()),
        (LABEL_INSTANCE.to_owned(), instance.to_owned()),
        (LABEL_ASSIGNMENT.to_owned(), assignment_id.to_owned()),
        (LABEL_PLACEMENT.to_owned(), placement.to_string()),
    ])
}

/// The listing selector of one installation's environments of one placement.
pub fn selector(instance: &str, placement: Placement) -> BTreeMap<String, String> {
    BTreeMap::from([(LABEL_INSTANCE.to_owned(), instance.to_owned()), (LABEL_PLACEMENT.to_owned(), placement.to_string())])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unclaimed_environment_says_what_the_supervisors_code_meant() {
        let ended = |detail: &str, exit_code| Environment {
            name: "e".into(),
            assignment_id: "a".into(),
            labels: BTreeMap::new(),
            phase: Phase::Exited,
            detail: detail.into(),
            exit_code,
        };
        let table: &[(&str, Option<i64>, &str)] = &[
            ("the container exited with code 71", Some(71), "the container exited with code 71 — the job's SPIFFE identity was not issued in time (check"),
            ("the container exited with code 75", Some(75), "the container exited with code 75 — the supervisor could not claim the job"),
            // Not the supervisor's: as the backend said it.
            (
                "the container exited with code 137 (killed for using more memory than allowed)",
                Some(137),
                "the container exited with code 137 (killed for using more memory than allowed)",
            ),
            ("the Pod Evicted", None, "the Pod Evicted"),
            ("", None, "no reason given"),
        ];
        for &(detail, code, want) in table {
            let why = ended(detail, code).why_unclaimed();
            assert!(why.starts_with(want), "{detail:?}, {code:?}: {why}");
        }
        assert_eq!(ended("the Pod Evicted", None).why_unclaimed(), "the Pod Evicted");
    }

    #[test]
    fn names_are_derived_from_the_installation_and_the_assignment() {
        let instance = instance_of("https://gitea.example.com/", "redb:/var/lib/gdr/store.redb");
        assert_eq!(instance, instance_of("https://gitea.example.com", "redb:/var/lib/gdr/store.redb"));
        assert_eq!(instance.len(), 8);
        assert_ne!(instance, instance_of("https://gitea.other.example", "redb:/var/lib/gdr/store.redb"));
        assert_ne!(instance, instance_of("https://gitea.example.com", "nats:nats-0:4222/ci-assignments"), "a second store is a second installation");
        assert_eq!(environment_name(&instance, "gitea-task-42"), format!("gdr-{instance}-gitea-task-42"));
        assert_ne!(environment_name(&instance, "gitea-task-42"), environment_name(&instance, "gitea-task-43"));
        assert_ne!(environment_name(&instance, "gitea-task-42"), environment_name(&instance_of("http://other", ""), "gitea-task-42"));
        assert!(environment_name(&instance, &format!("gitea-task-{}", i64::MAX)).len() <= 63, "DNS-1123 labels are at most 63 characters");
        assert_eq!(attempt_name(&instance, "gitea-task-42", 0), environment_name(&instance, "gitea-task-42"));
        assert_ne!(attempt_name(&instance, "gitea-task-42", 1), attempt_name(&instance, "gitea-task-42", 2));
        assert!(attempt_name(&instance, &format!("gitea-task-{}", i64::MAX), 9).len() <= 63, "DNS-1123 labels are at most 63 characters");
    }
}

/// The job's Docker a placement's settings name: `job_docker` (`"none"`, `"rootless"`,
/// `"root"`), or the two switches it replaces, read as its aliases (`job_dockerd = true`:
/// root, `rootless_dockerd = true`: rootless). [`check_job_docker`] refuses settings that
/// say two things.
pub fn job_docker_of(mode: Option<JobDocker>, job_dockerd: bool, rootless_dockerd: bool) -> JobDocker {
    match (mode, job_dockerd, rootless_dockerd) {
        (Some(mode), ..) => mode,
        (None, true, _) => JobDocker::Root,
        (None, false, true) => JobDocker::Rootless,
        (None, false, false) => JobDocker::None,
    }
}

/// Refuses `[section]` settings whose job Docker is two things at once.
pub fn check_job_docker(section: &str, mode: Option<JobDocker>, job_dockerd: bool, rootless_dockerd: bool, problems: &mut crate::setting::Problems) {
    if job_dockerd && rootless_dockerd {
        problems.add(
            format!("{section}.rootless_dockerd"),
            "choose one job dockerd: rootless_dockerd (no step is root on this host) or job_dockerd (a step is root on this host: trusted code only)",
        );
    }
    if let Some(mode) = mode {
        for (alias, set, means) in [("job_dockerd", job_dockerd, JobDocker::Root), ("rootless_dockerd", rootless_dockerd, JobDocker::Rootless)] {
            if set && mode != means {
                problems.add(
                    format!("{section}.job_docker"),
                    format!(
                        "job_docker = \"{}\" contradicts {alias} = true: keep job_docker alone (it replaces job_dockerd and rootless_dockerd)",
                        mode.as_str()
                    ),
                );
            }
        }
    }
}

#[cfg(test)]
mod job_docker_tests {
    use contract::environment::JobDocker::{self, None as Off, Root, Rootless};

    use super::{check_job_docker, job_docker_of};
    use crate::setting::Problems;

    #[test]
    fn the_mode_or_its_aliases_and_no_contradiction() {
        /// (job_docker, job_dockerd, rootless_dockerd) → the mode, or the setting refused.
        type Case = (Option<JobDocker>, bool, bool, Result<JobDocker, &'static str>);
        let cases: [Case; 10] = [
            (None, false, false, Ok(Off)),
            (None, true, false, Ok(Root)),
            (None, false, true, Ok(Rootless)),
            (None, true, true, Err("docker.rootless_dockerd")),
            (Some(Off), false, false, Ok(Off)),
            (Some(Rootless), false, false, Ok(Rootless)),
            (Some(Root), true, false, Ok(Root)),
            (Some(Rootless), false, true, Ok(Rootless)),
            (Some(Off), true, false, Err("docker.job_docker")),
            (Some(Root), false, true, Err("docker.job_docker")),
        ];
        for (mode, job, rootless, want) in cases {
            let checked = Problems::check(|problems| check_job_docker("docker", mode, job, rootless, problems));
            match want {
                Ok(expected) => {
                    assert_eq!(checked, Ok(()), "{mode:?} {job} {rootless}");
                    assert_eq!(job_docker_of(mode, job, rootless), expected, "{mode:?} {job} {rootless}");
                }
                Err(setting) => {
                    let problems = checked.expect_err("refused").to_string();
                    assert!(problems.contains(setting), "{mode:?} {job} {rootless}: {problems}");
                }
            }
        }
    }
}
