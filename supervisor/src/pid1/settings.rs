//! What `supervisor run` was told, in PID 1's terms ([`Settings`]), and the user the
//! agent and the job run as ([`RunnerUser`]). The command line parses and checks the
//! flags and converts them into these; PID 1 never sees a flag.

use std::{path::PathBuf, time::Duration};

use contract::environment::JobDocker;

use super::{dockerd::Bridge, spawn::Credentials};
use crate::agent::config::RunnerHooks;

/// The user the agent and the job run as: PID 1 switches to it, `doctor --image` checks
/// that the image defines it the same way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerUser {
    pub uid: u32,
    /// The runner's primary gid.
    pub gid: u32,
    /// The docker group: owns dockerd's socket and is the runner's supplementary group.
    pub docker_gid: u32,
    pub home: PathBuf,
    /// The runner's subordinate uids and gids (a rootless dockerd's), when the driver gives
    /// this environment a range of its own; otherwise the image's.
    pub subordinate: Option<IdRange>,
    /// Whether a driver gave these ids (rather than the image's defaults standing): only
    /// then does PID 1 rewrite the image's entries (`pid1::user`), never a host's /etc when
    /// the supervisor runs elsewhere.
    pub assigned: bool,
}

/// `count` ids from `first`, as /etc/subuid writes them (`FIRST:COUNT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdRange {
    pub first: u32,
    pub count: u32,
}

impl RunnerUser {
    /// Who the agent runs as: the runner, with the docker group.
    pub fn credentials(&self) -> Credentials {
        Credentials { uid: self.uid, gid: self.gid, groups: [self.docker_gid] }
    }
}

/// Everything PID 1 does in one environment, already checked (the flags' help says what
/// each means).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Whether the agent waits for the job's SVID.
    pub identity: bool,
    pub spiffe_id: Option<String>,
    pub spiffe_endpoint: Option<String>,
    pub identity_timeout: Duration,

    /// Which dockerd the job gets: none, rootless (as the runner uid, through
    /// `rootless_dockerd`), or root on loop-backed storage.
    pub job_docker: JobDocker,
    pub rootless_dockerd: PathBuf,
    pub registry_mirrors: Vec<String>,
    pub docker_data_root: PathBuf,
    pub docker_socket: PathBuf,
    pub dockerd_log: PathBuf,
    pub dockerd: PathBuf,
    pub docker_exec_root: PathBuf,
    pub docker_pidfile: PathBuf,
    pub docker_bridge: Bridge,
    pub docker_ready_timeout: Duration,
    pub storage_image: PathBuf,
    pub storage_size: u64,
    pub mkfs: PathBuf,
    pub cgroup_root: PathBuf,

    /// With a facade the agent claims the task and serves it to the runner.
    pub facade_url: Option<String>,
    pub facade_spiffe_id: Option<String>,
    pub assignment_id: Option<String>,
    pub runner_dir: PathBuf,
    pub runner_labels: Vec<String>,
    pub gitea_url: Option<String>,
    pub runner_hooks: RunnerHooks,

    pub user: RunnerUser,
    pub drain_timeout: Duration,
    pub state_dir: PathBuf,
    /// The job command.
    pub command: Vec<String>,
}
