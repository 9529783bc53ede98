//! The agent's configuration, as PID 1 hands it over: JSON in one environment variable
//! with no secret in it (the capability comes on its own, see [`CAPABILITY_ENV`]), and
//! the settings' own types ([`RunnerHooks`]).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Environment variable that carries [`AgentConfig`] from PID 1.
pub const CONFIG_ENV: &str = contract::environment::supervisor::AGENT_CONFIG;
/// The capability comes from the environment the driver set (or from the file PID 1
/// read and removed), and is not passed on to the job.
pub const CAPABILITY_ENV: &str = contract::environment::CAPABILITY;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AgentConfig {
    pub identity: Option<IdentitySettings>,
    /// Whether PID 1 reports on dockerd (see [`super::docker::report`]).
    pub docker: bool,
    pub docker_host: Option<String>,
    /// A rootless dockerd's public socket, which the agent serves ([`super::docker::proxy`]).
    #[serde(default)]
    pub docker_proxy: Option<DockerProxy>,
    pub socket: PathBuf,
    pub command: Vec<String>,
    /// With a facade: claim the task and serve it to gitea-runner (the job command)
    /// through the loopback RunnerService; without: just run the command.
    #[serde(default)]
    pub facade: Option<FacadeSettings>,
}

/// Where the agent takes `docker` calls ([`super::docker::proxy`]) and where dockerd
/// answers them once it binds its socket.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DockerProxy {
    pub listen: PathBuf,
    pub upstream: PathBuf,
    /// How long a call waits for dockerd.
    pub patience_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FacadeSettings {
    pub url: String,
    pub spiffe_id: Option<String>,
    pub assignment_id: String,
    /// Labels for the `.runner` file (CI_RUNNER_LABELS_JSON).
    pub labels: Vec<String>,
    /// gitea-runner's working directory, where `.runner` is written.
    pub runner_dir: PathBuf,
    /// Gitea as this environment reaches it: the loopback passes every request that is
    /// not the runner protocol there.
    #[serde(default)]
    pub gitea_url: Option<String>,
    #[serde(default = "default_hooks")]
    pub hooks: RunnerHooks,
}

fn default_hooks() -> RunnerHooks {
    RunnerHooks::Auto
}

/// Whether the runner runs `supervisor job-started` before the first step, which
/// decides whether the loopback holds the task back until dockerd's socket takes
/// connections (`--runner-hooks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
pub enum RunnerHooks {
    /// By the runner's version in its Declare: v3 and later run the hook.
    Auto,
    /// The runner runs `supervisor job-started` before the first step.
    JobStarted,
    /// No hook: hand the task over only once dockerd's socket takes connections.
    None,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IdentitySettings {
    pub spiffe_id: String,
    pub endpoint: String,
    pub timeout_ms: u64,
}
