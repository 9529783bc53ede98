//! The supervisor's command line. Every setting is a flag with an environment
//! variable; values are parsed and cross-checked before any side effect, and an
//! invalid one ends the process with a usage error (exit 64) naming the setting.
//!
//! It only parses and converts: the commands take their settings in their own terms
//! ([`RunArgs::settings`], [`DoctorArgs::settings`]), and the settings' types live with
//! the code that uses them (the runner's hooks in the agent, dockerd's bridge in
//! `pid1::dockerd`, the runner user in `pid1::settings`).

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use clap::{Args, Parser, Subcommand};
use contract::environment::{self as env, Contract};

use contract::units::{parse_duration, parse_size};

use crate::{
    agent::{config::RunnerHooks, identity::parse_workload_endpoint},
    pid1::{
        self, IdRange, RunnerUser,
        dockerd::{ActivateArgs, Bridge},
    },
    tools::doctor,
};

#[derive(Debug, Parser)]
#[command(name = "supervisor", version, about = "PID 1 of a Gitea dynamic runner job environment.")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Be PID 1: prepare storage, cgroups and a job-local dockerd, start the agent
    /// (as the runner uid) that waits for identity and runs COMMAND, and drain in order.
    Run(Box<RunArgs>),
    /// The agent half of `run` (started by PID 1 as the runner uid; not for direct use).
    #[command(hide = true)]
    Agent,
    /// gitea-runner's job-started hook: wait until the identity is ready and dockerd's socket takes connections.
    JobStarted(JobStartedArgs),
    /// Diagnose this environment: independent checks with PASS/FAIL/SKIP.
    Doctor(Box<DoctorArgs>),
    /// Relay the environment's loopback ports into a `container:` job's container
    /// (started by the job-started hook there; not for direct use).
    #[command(hide = true)]
    LoopbackRelay {
        /// The directory of the agent's port sockets.
        dir: PathBuf,
    },
    /// Exec PROGRAM with the socket on fd 3 announced the systemd way (LISTEN_FDS=1,
    /// LISTEN_PID=its pid), for `dockerd -H fd://` (started by PID 1; not for direct use).
    #[command(hide = true)]
    Activate(ActivateArgs),
    /// Print the version.
    Version,
}

/// Settings both `run` and `doctor` read: what the environment is (the contract's
/// variables among them) and where its parts live, so that doctor checks exactly what
/// the supervisor set up.
#[derive(Debug, Clone, Args)]
pub struct Environment {
    /// Wait for the job's X.509 SVID before claiming. Default: on exactly when the job's
    /// SPIFFE ID is given (CI_SPIFFE_ID).
    #[arg(long, env = env::supervisor::IDENTITY, action = clap::ArgAction::Set)]
    pub identity: Option<bool>,
    /// The exact SPIFFE ID the job's SVID must carry [contract: CI_SPIFFE_ID].
    #[arg(long, value_parser = parse_spiffe_id)]
    pub spiffe_id: Option<String>,
    /// SPIFFE Workload API endpoint, unix:///path or tcp://ip:port [contract: SPIFFE_ENDPOINT_SOCKET].
    #[arg(long, value_parser = parse_workload_endpoint)]
    pub spiffe_endpoint: Option<String>,
    /// Start a job-local dockerd (and its storage). Off for environments without Docker.
    #[arg(long, env = env::supervisor::DOCKER, default_value_t = true, action = clap::ArgAction::Set)]
    pub docker: bool,
    /// The job's dockerd runs rootless, as the runner uid in its own user namespace
    /// (rootlesskit): no loop storage, no cgroup changes, its socket in
    /// --docker-socket's directory, which must not be /var/run.
    #[arg(long, env = env::supervisor::DOCKER_ROOTLESS, default_value_t = false, action = clap::ArgAction::Set)]
    pub docker_rootless: bool,
    /// dockerd's data root; backed by a loop-mounted ext4 image unless already a mountpoint.
    #[arg(long, env = env::supervisor::DOCKER_DATA_ROOT, default_value = "/var/lib/docker", value_parser = parse_absolute)]
    pub docker_data_root: PathBuf,
    #[arg(long, env = env::supervisor::DOCKER_SOCKET, default_value = "/var/run/docker.sock", value_parser = parse_absolute)]
    pub docker_socket: PathBuf,
    /// File that receives dockerd's output.
    #[arg(long, env = env::supervisor::DOCKERD_LOG, default_value = "/var/log/supervisor/dockerd.log", value_parser = parse_absolute)]
    pub dockerd_log: PathBuf,
    /// Root of the cgroup hierarchy as seen by this environment.
    #[arg(long, env = env::supervisor::CGROUP_ROOT, default_value = "/sys/fs/cgroup", value_parser = parse_absolute)]
    pub cgroup_root: PathBuf,
    /// The controller's facade, unix:///path, https://host:port (SPIFFE mTLS) or
    /// http://private-ip:port (development mode, capability only); when set, the agent
    /// claims the task and serves it to the runner (COMMAND) on 127.0.0.1
    /// [contract: CI_RUNNER_FACADE_URL].
    #[arg(long)]
    pub facade_url: Option<String>,
    /// The assignment this environment runs, gitea-task-<id> [contract: CI_ASSIGNMENT_ID].
    #[arg(long)]
    pub assignment_id: Option<String>,
    /// gitea-runner's working directory (its .runner file is written there).
    #[arg(long, env = env::supervisor::RUNNER_DIR, default_value = "/home/runner", value_parser = parse_absolute)]
    pub runner_dir: PathBuf,
}

/// The flags of the user the agent and the job run as ([`RunnerUser`]): `run` switches
/// to it, `doctor --image` checks that the image defines it the same way.
#[derive(Debug, Clone, Args)]
pub struct RunnerUserArgs {
    /// Uid the agent and the job run as [default: 2000, the image's]. Given (or the gid, or
    /// the subordinate ids), PID 1 makes the image's `runner` entries agree with it.
    #[arg(long, env = env::runner_user::UID, value_parser = parse_unprivileged_id)]
    pub runner_uid: Option<u32>,
    /// Primary gid of the runner [default: 2000].
    #[arg(long, env = env::runner_user::GID, value_parser = parse_unprivileged_id)]
    pub runner_gid: Option<u32>,
    /// The runner's subordinate uids and gids, `FIRST:COUNT` (a rootless dockerd maps
    /// them); PID 1 writes them to /etc/subuid and /etc/subgid. Default: the image's.
    #[arg(long, env = env::runner_user::SUBORDINATE_IDS, value_parser = parse_id_range)]
    pub subordinate_ids: Option<IdRange>,
    /// Gid of the docker group: owns dockerd's socket and is the runner's supplementary group.
    #[arg(long, env = env::supervisor::DOCKER_GID, default_value_t = env::runner_user::IMAGE_DOCKER_GID, value_parser = parse_unprivileged_id)]
    pub docker_gid: u32,
    /// HOME of the runner user.
    #[arg(long, env = env::supervisor::RUNNER_HOME, default_value = "/home/runner", value_parser = parse_absolute)]
    pub runner_home: PathBuf,
}

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub environment: Environment,
    #[command(flatten)]
    pub user: RunnerUserArgs,

    #[arg(long, env = env::supervisor::DOCKERD, default_value = "dockerd")]
    pub dockerd: PathBuf,
    /// What starts a rootless dockerd: Docker's own `dockerd-rootless.sh` (rootlesskit and
    /// slirp4netns around dockerd), looked up in PATH.
    #[arg(long, env = env::supervisor::ROOTLESS_DOCKERD, default_value = "dockerd-rootless.sh")]
    pub rootless_dockerd: PathBuf,
    /// Registry mirrors for the job's dockerd (comma-separated URLs): every environment
    /// starts with no image, so pulls of Docker Hub images go to the operator's mirror first.
    #[arg(long = "registry-mirror", env = env::supervisor::REGISTRY_MIRRORS, value_delimiter = ',', value_parser = parse_registry_mirror)]
    pub registry_mirrors: Vec<String>,
    #[arg(long, env = env::supervisor::DOCKER_EXEC_ROOT, default_value = "/var/run/docker", value_parser = parse_absolute)]
    pub docker_exec_root: PathBuf,
    #[arg(long, env = env::supervisor::DOCKER_PIDFILE, default_value = "/var/run/docker.pid", value_parser = parse_absolute)]
    pub docker_pidfile: PathBuf,
    #[arg(long, env = env::supervisor::DOCKER_BRIDGE, value_enum, default_value_t = Bridge::Default)]
    pub docker_bridge: Bridge,
    /// How long dockerd may take to answer GET /_ping.
    #[arg(long, env = env::supervisor::DOCKER_READY_TIMEOUT, default_value = "120s", value_parser = parse_positive_duration)]
    pub docker_ready_timeout: Duration,

    /// Sparse image backing /var/lib/docker (not inside the data root).
    #[arg(long, env = env::supervisor::STORAGE_IMAGE, default_value = "/var/lib/supervisor/docker.img", value_parser = parse_absolute)]
    pub storage_image: PathBuf,
    /// Size of the sparse image (e.g. 20G); only written blocks use disk.
    #[arg(long, env = env::supervisor::STORAGE_SIZE, default_value = "20G", value_parser = parse_storage_size)]
    pub storage_size: u64,
    #[arg(long, env = env::supervisor::MKFS, default_value = "mkfs.ext4")]
    pub mkfs: PathBuf,

    #[arg(long, env = env::supervisor::IDENTITY_TIMEOUT, default_value = "180s", value_parser = parse_positive_duration)]
    pub identity_timeout: Duration,

    /// The facade's SPIFFE ID, required for https facade URLs [contract: CI_RUNNER_FACADE_SPIFFE_ID].
    #[arg(long)]
    pub facade_spiffe_id: Option<String>,
    /// The runner labels for the .runner file, a JSON array of strings
    /// [contract: CI_RUNNER_LABELS_JSON; default ["self-hosted"]].
    #[arg(long, value_parser = parse_labels)]
    pub runner_labels_json: Option<RunnerLabels>,
    /// Gitea as this environment reaches it: every request of the runner or its steps that
    /// is not the runner protocol is passed there [contract: CI_GITEA_URL].
    #[arg(long, value_parser = parse_http_url)]
    pub gitea_url: Option<String>,
    /// Whether the runner runs `supervisor job-started` before the first step (its
    /// job-started hook). Without it the loopback holds the task back until dockerd's
    /// socket takes connections. auto: gitea-runner v3 and later have hooks (the image configures this one).
    #[arg(long, env = env::supervisor::RUNNER_HOOKS, value_enum, default_value_t = RunnerHooks::Auto)]
    pub runner_hooks: RunnerHooks,

    /// Time from SIGTERM to exit: runner, dockerd, unmount, loop detach, then SIGKILL.
    /// The default stays inside Kubernetes' 30 s termination grace period.
    #[arg(long, env = env::supervisor::DRAIN_TIMEOUT, default_value = "25s", value_parser = parse_drain)]
    pub drain_timeout: Duration,

    /// Directory for the supervisor's runtime state (agent socket, storage state).
    #[arg(long, env = env::supervisor::STATE_DIR, default_value = "/run/supervisor", value_parser = parse_absolute)]
    pub state_dir: PathBuf,

    /// The job command, run as the runner uid once the identity is ready and dockerd's socket takes connections.
    #[arg(trailing_var_arg = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

#[derive(Debug, Clone, Args)]
pub struct JobStartedArgs {
    /// The agent's readiness socket.
    #[arg(long, env = env::supervisor::AGENT_SOCKET, default_value = "/run/supervisor/agent/agent.sock", value_parser = parse_absolute)]
    pub socket: PathBuf,
    /// How long to wait for identity and dockerd before failing the job.
    #[arg(long, env = env::supervisor::JOB_STARTED_TIMEOUT, default_value = "300s", value_parser = parse_positive_duration)]
    pub timeout: Duration,
}

#[derive(Debug, Clone, Args)]
pub struct DoctorArgs {
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub environment: Environment,
    #[arg(long, default_value = "/dev/loop-control", value_parser = parse_absolute)]
    pub loop_control: PathBuf,
    /// The runner binary (on PATH or a path).
    #[arg(long, default_value = "gitea-runner")]
    pub runner: PathBuf,
    #[arg(long, default_value = "/etc/gitea-runner/config.yaml")]
    pub runner_config: PathBuf,
    /// Check a runner image rather than a running environment: every package of its
    /// package list present and running, the runner, its job-started hook and the runner
    /// user. Run it inside the image, e.g. `docker run --rm --user 0 --entrypoint
    /// /usr/local/bin/supervisor IMAGE doctor --image`.
    #[arg(long)]
    pub image: bool,
    /// Check what a job's steps reach, from where a step runs — a `container:` job's
    /// container too: the loopback "Gitea" (GITHUB_SERVER_URL), the runtime and results
    /// service (ACTIONS_RUNTIME_URL, ACTIONS_RESULTS_URL) and the cache
    /// (ACTIONS_CACHE_URL) answer. Run it as a step, e.g. in a container
    /// `/usr/local/lib/gitea-dynamic-runner/job-started doctor --step`.
    #[arg(long, conflicts_with = "image")]
    pub step: bool,
    /// The image's package list (for --image).
    #[arg(long, default_value = "/usr/local/lib/gitea-dynamic-runner/packages", value_parser = parse_absolute)]
    pub packages: PathBuf,
    #[command(flatten)]
    pub user: RunnerUserArgs,
}

impl RunnerUserArgs {
    /// The user, in the terms of PID 1 and doctor.
    pub fn user(&self) -> RunnerUser {
        RunnerUser {
            uid: self.runner_uid.unwrap_or(env::runner_user::IMAGE_ID),
            gid: self.runner_gid.unwrap_or(env::runner_user::IMAGE_ID),
            docker_gid: self.docker_gid,
            home: self.runner_home.clone(),
            subordinate: self.subordinate_ids,
            assigned: self.runner_uid.is_some() || self.runner_gid.is_some() || self.subordinate_ids.is_some(),
        }
    }
}

impl DoctorArgs {
    /// What doctor checks, in its own terms.
    pub fn settings(&self) -> doctor::Settings {
        let e = &self.environment;
        doctor::Settings {
            identity: e.identity_on(),
            spiffe_endpoint: e.spiffe_endpoint.clone(),
            spiffe_id: e.spiffe_id.clone(),
            job_docker: e.job_docker(),
            docker_data_root: e.docker_data_root.clone(),
            docker_socket: e.docker_socket.clone(),
            dockerd_log: e.dockerd_log.clone(),
            loop_control: self.loop_control.clone(),
            cgroup_root: e.cgroup_root.clone(),
            facade_url: e.facade_url.clone(),
            runner: self.runner.clone(),
            runner_config: self.runner_config.clone(),
            runner_dir: e.runner_dir.clone(),
            assignment_id: e.assignment_id.clone(),
            mode: match (self.image, self.step) {
                (true, _) => doctor::Mode::Image,
                (false, true) => doctor::Mode::Step,
                (false, false) => doctor::Mode::Environment,
            },
            packages: self.packages.clone(),
            runner_user: self.user.user(),
        }
    }
}

impl Environment {
    /// Whether the agent waits for the job's SVID.
    pub fn identity_on(&self) -> bool {
        self.identity.unwrap_or(self.spiffe_id.is_some())
    }

    /// Which dockerd the job gets, from the two flags.
    pub const fn job_docker(&self) -> env::JobDocker {
        env::JobDocker::from_flags(self.docker, self.docker_rootless)
    }

    /// Fills the contract settings not given as flags (see [`apply_contract`]).
    ///
    /// # Errors
    /// The first invalid value, naming its variable.
    pub fn apply_contract(&mut self, contract: &Contract) -> Result<(), String> {
        let text = |value: &str| Ok::<_, String>(value.to_owned());
        fill(&mut self.spiffe_id, contract.spiffe_id.as_ref(), env::SPIFFE_ID, parse_spiffe_id)?;
        fill(&mut self.spiffe_endpoint, contract.spiffe_endpoint_socket.as_ref(), env::SPIFFE_ENDPOINT_SOCKET, parse_workload_endpoint)?;
        fill(&mut self.facade_url, contract.facade_url.as_ref(), env::FACADE_URL, text)?;
        fill(&mut self.assignment_id, contract.assignment_id.as_ref(), env::ASSIGNMENT_ID, text)
    }
}

fn fill<T>(slot: &mut Option<T>, value: Option<&String>, name: &str, parse: impl Fn(&str) -> Result<T, String>) -> Result<(), String> {
    if slot.is_none()
        && let Some(value) = value
    {
        *slot = Some(parse(value).map_err(|error| format!("{name}: {error}"))?);
    }
    Ok(())
}

impl RunArgs {
    /// Whether the agent waits for the job's SVID.
    pub fn identity_on(&self) -> bool {
        self.environment.identity_on()
    }

    pub fn runner_labels(&self) -> Vec<String> {
        self.runner_labels_json.clone().map_or_else(|| vec!["self-hosted".to_owned()], |labels| labels.0)
    }

    /// What PID 1 does, in its own terms (after [`apply_contract`] and [`validate`]).
    pub fn settings(&self) -> pid1::Settings {
        let e = &self.environment;
        pid1::Settings {
            identity: self.identity_on(),
            spiffe_id: e.spiffe_id.clone(),
            spiffe_endpoint: e.spiffe_endpoint.clone(),
            identity_timeout: self.identity_timeout,
            job_docker: e.job_docker(),
            rootless_dockerd: self.rootless_dockerd.clone(),
            registry_mirrors: self.registry_mirrors.clone(),
            docker_data_root: e.docker_data_root.clone(),
            docker_socket: e.docker_socket.clone(),
            dockerd_log: e.dockerd_log.clone(),
            dockerd: self.dockerd.clone(),
            docker_exec_root: self.docker_exec_root.clone(),
            docker_pidfile: self.docker_pidfile.clone(),
            docker_bridge: self.docker_bridge,
            docker_ready_timeout: self.docker_ready_timeout,
            storage_image: self.storage_image.clone(),
            storage_size: self.storage_size,
            mkfs: self.mkfs.clone(),
            cgroup_root: e.cgroup_root.clone(),
            facade_url: e.facade_url.clone(),
            facade_spiffe_id: self.facade_spiffe_id.clone(),
            assignment_id: e.assignment_id.clone(),
            runner_dir: e.runner_dir.clone(),
            runner_labels: self.runner_labels(),
            gitea_url: self.gitea_url.clone(),
            runner_hooks: self.runner_hooks,
            user: self.user.user(),
            drain_timeout: self.drain_timeout,
            state_dir: self.state_dir.clone(),
            command: self.command.clone(),
        }
    }
}

/// Fills every contract setting not given as a flag from the environment contract,
/// where an empty variable is unset; each value is checked as its flag would be, and
/// an error names the variable.
///
/// # Errors
/// The first invalid value.
pub fn apply_contract(args: &mut RunArgs, contract: &Contract) -> Result<(), String> {
    let text = |value: &str| Ok::<_, String>(value.to_owned());
    args.environment.apply_contract(contract)?;
    fill(&mut args.facade_spiffe_id, contract.facade_spiffe_id.as_ref(), env::FACADE_SPIFFE_ID, text)?;
    fill(&mut args.runner_labels_json, contract.runner_labels_json.as_ref(), env::RUNNER_LABELS_JSON, parse_labels)?;
    fill(&mut args.gitea_url, contract.gitea_url.as_ref(), env::GITEA_URL, parse_http_url)?;
    Ok(())
}

/// Settings that only make sense together, checked after parsing. The message names
/// the setting and says what to do.
///
/// # Errors
/// The first inconsistency found.
pub fn validate(args: &RunArgs) -> Result<(), String> {
    if args.identity_on() {
        if args.environment.spiffe_id.is_none() {
            return Err("--spiffe-id (CI_SPIFFE_ID) is required while identity is on: set it to the job's \
                        SPIFFE ID, or leave SUPERVISOR_IDENTITY unset (or false) on hosts without SPIFFE"
                .into());
        }
        if args.environment.spiffe_endpoint.is_none() {
            return Err("--spiffe-endpoint (SPIFFE_ENDPOINT_SOCKET) is required while identity is on: set it to \
                        the Workload API socket, e.g. unix:///run/spire/agent/public/api.sock"
                .into());
        }
    }
    if let Some(url) = &args.environment.facade_url {
        if args.environment.assignment_id.as_deref().is_none_or(str::is_empty) {
            return Err("--assignment-id (CI_ASSIGNMENT_ID) is required with --facade-url (CI_RUNNER_FACADE_URL)".into());
        }
        let parsed = contract::facade::FacadeUrl::parse(url).map_err(|error| format!("--facade-url (CI_RUNNER_FACADE_URL) {error}"))?;
        if matches!(parsed, contract::facade::FacadeUrl::Https(_)) && (args.facade_spiffe_id.is_none() || !args.identity_on()) {
            return Err("--facade-url (CI_RUNNER_FACADE_URL) https:// needs identity on and --facade-spiffe-id (CI_RUNNER_FACADE_SPIFFE_ID)".into());
        }
    }
    if args.user.user().gid == args.user.docker_gid {
        return Err(format!("--docker-gid (SUPERVISOR_DOCKER_GID) must differ from --runner-gid: both are {}", args.user.docker_gid));
    }
    if args.environment.job_docker().runs_dockerd() {
        if args.storage_image.starts_with(&args.environment.docker_data_root) {
            return Err(format!(
                "--storage-image (SUPERVISOR_STORAGE_IMAGE) {} must not be inside --docker-data-root {}",
                args.storage_image.display(),
                args.environment.docker_data_root.display()
            ));
        }
        if args.environment.job_docker().is_rootless()
            && args.environment.docker_socket.parent().is_none_or(|dir| dir == Path::new("/var/run") || dir == Path::new("/run"))
        {
            return Err(format!(
                "--docker-socket (SUPERVISOR_DOCKER_SOCKET) {} cannot serve a rootless dockerd, which runs as the runner uid: \
                 put it in the runner's own runtime directory, e.g. /run/user/{}/docker.sock",
                args.environment.docker_socket.display(),
                args.user.user().uid
            ));
        }
        if args.docker_ready_timeout >= Duration::from_secs(3600) {
            return Err("--docker-ready-timeout (SUPERVISOR_DOCKER_READY_TIMEOUT) must be under 1h".into());
        }
    }
    Ok(())
}

/// The runner labels (CI_RUNNER_LABELS_JSON): one JSON array, one clap value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerLabels(pub Vec<String>);

fn parse_labels(value: &str) -> Result<RunnerLabels, String> {
    let labels: Vec<String> = serde_json::from_str(value).map_err(|e| format!("{value:?} is not a JSON array of strings: {e}"))?;
    if labels.iter().any(String::is_empty) {
        return Err("labels must not be empty strings".into());
    }
    Ok(RunnerLabels(labels))
}

fn parse_http_url(value: &str) -> Result<String, String> {
    if (value.starts_with("http://") || value.starts_with("https://")) && value.len() > "https://".len() {
        Ok(value.trim_end_matches('/').to_owned())
    } else {
        Err(format!("{value:?} is not an http(s) URL"))
    }
}

fn parse_registry_mirror(value: &str) -> Result<String, String> {
    contract::environment::check_registry_mirror(value).map(|()| value.to_owned())
}

fn parse_unprivileged_id(value: &str) -> Result<u32, String> {
    let id: u32 = value.parse().map_err(|_| format!("{value:?} is not a numeric id"))?;
    if id == 0 {
        return Err("0 is root: the job must not run as root".into());
    }
    if id == u32::MAX {
        return Err(format!("{id} is not a valid id"));
    }
    Ok(id)
}

/// `FIRST:COUNT` of subordinate ids: none of them root, and at least the 65,536 ids a
/// rootless dockerd maps.
fn parse_id_range(value: &str) -> Result<IdRange, String> {
    let (first, count) = value.split_once(':').ok_or_else(|| format!("{value:?} is not FIRST:COUNT, e.g. 100000:65536"))?;
    let number = |text: &str, what: &str| text.parse::<u32>().map_err(|_| format!("{value:?}: the {what} {text:?} is not a number"));
    let range = IdRange { first: number(first, "first id")?, count: number(count, "count")? };
    if range.first == 0 {
        return Err(format!("{value:?} starts at root (0)"));
    }
    if range.count < 65_536 {
        return Err(format!("{value:?} has {} ids; a rootless dockerd maps 65536", range.count));
    }
    if range.first.checked_add(range.count).is_none() {
        return Err(format!("{value:?} ends beyond the largest id"));
    }
    Ok(range)
}

fn parse_absolute(value: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(value);
    if path.is_absolute() { Ok(path) } else { Err(format!("{value:?} is not an absolute path")) }
}

fn parse_positive_duration(value: &str) -> Result<Duration, String> {
    let duration = parse_duration(value)?;
    if duration.is_zero() {
        return Err("must be longer than 0".into());
    }
    Ok(duration)
}

fn parse_drain(value: &str) -> Result<Duration, String> {
    let duration = parse_positive_duration(value)?;
    if duration < Duration::from_secs(1) || duration > Duration::from_secs(3600) {
        return Err(format!("{value:?} must be between 1s and 1h"));
    }
    Ok(duration)
}

fn parse_storage_size(value: &str) -> Result<u64, String> {
    let size = parse_size(value)?;
    // mkfs.ext4 needs room for its metadata and a journal; dockerd needs more.
    if size < 64 << 20 {
        return Err(format!("{value:?} is too small: at least 64M"));
    }
    Ok(size)
}

/// A SPIFFE ID: `spiffe://<trust domain>/<path>`, compared byte for byte later.
pub fn parse_spiffe_id(value: &str) -> Result<String, String> {
    let id = spiffe::SpiffeId::new(value).map_err(|error| format!("{value:?} is not a SPIFFE ID: {error}"))?;
    if id.path().is_empty() {
        return Err(format!("{value:?} names a trust domain, not a workload: add a path"));
    }
    Ok(value.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<RunArgs, String> {
        let mut argv = vec!["supervisor", "run"];
        argv.extend_from_slice(args);
        let cli = Cli::try_parse_from(argv).map_err(|e| e.to_string())?;
        match cli.command {
            Command::Run(run) => validate(&run).map(|()| *run),
            other => Err(format!("unexpected {other:?}")),
        }
    }

    const OK: &[&str] = &["--spiffe-id", "spiffe://example.org/ci/o/r/j", "--spiffe-endpoint", "unix:///tmp/api.sock"];

    fn with(extra: &[&'static str]) -> Vec<&'static str> {
        let mut args: Vec<&str> = OK.to_vec();
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "true"]);
        args
    }

    #[test]
    fn defaults_are_valid() {
        let run = parse(&with(&[])).unwrap();
        assert_eq!((run.user.user().uid, run.user.user().assigned), (2000, false));
        assert_eq!(run.storage_size, 20 << 30);
        assert_eq!(run.drain_timeout, Duration::from_secs(25));
        assert_eq!(run.command, vec!["true"]);
        assert_eq!(run.runner_labels(), ["self-hosted"]);
        assert!(run.identity_on());
    }

    /// Each invalid value must give an error that names its setting.
    #[test]
    fn invalid_settings_name_themselves() {
        let table: &[(&[&str], &str)] = &[
            (&["--runner-uid", "0"], "--runner-uid"),
            (&["--runner-uid", "abc"], "--runner-uid"),
            (&["--runner-gid=-1"], "--runner-gid"),
            (&["--docker-gid", "2000"], "--docker-gid"),
            (&["--docker", "maybe"], "--docker"),
            (&["--docker-data-root", "relative"], "--docker-data-root"),
            (&["--docker-socket", "docker.sock"], "--docker-socket"),
            (&["--docker-bridge", "nat"], "--docker-bridge"),
            (&["--docker-ready-timeout", "0s"], "--docker-ready-timeout"),
            (&["--docker-ready-timeout", "2h"], "--docker-ready-timeout"),
            (&["--storage-size", "10M"], "--storage-size"),
            (&["--storage-size", "big"], "--storage-size"),
            (&["--storage-image", "/var/lib/docker/img"], "--storage-image"),
            (&["--identity-timeout", "soon"], "--identity-timeout"),
            (&["--drain-timeout", "2h"], "--drain-timeout"),
            (&["--drain-timeout", "500ms"], "--drain-timeout"),
            (&["--spiffe-id", "spiffe://example.org"], "--spiffe-id"),
            (&["--spiffe-id", "https://example.org/ci"], "--spiffe-id"),
            (&["--spiffe-endpoint", "/tmp/api.sock"], "--spiffe-endpoint"),
            (&["--spiffe-endpoint", "tcp://localhost:80"], "--spiffe-endpoint"),
            (&["--cgroup-root", "sys/fs/cgroup"], "--cgroup-root"),
            (&["--state-dir", "run"], "--state-dir"),
            (&["--runner-labels-json", "self-hosted"], "--runner-labels-json"),
            (&["--facade-url", "unix:///run/f.sock"], "--assignment-id"),
            (&["--facade-url", "http://controller", "--assignment-id", "gitea-task-1"], "--facade-url"),
            (&["--facade-url", "http://8.8.8.8:9444", "--assignment-id", "gitea-task-1"], "not a loopback or private"),
            (&["--facade-url", "https://controller:9443", "--assignment-id", "gitea-task-1"], "--facade-spiffe-id"),
        ];
        for &(extra, setting) in table {
            let error = parse(&with(extra)).expect_err(&format!("{extra:?} was accepted"));
            assert!(error.contains(setting), "{extra:?}: {error}");
        }
    }

    #[test]
    fn identity_settings_are_required_while_identity_is_on() {
        let error = parse(&["--identity=true", "--", "true"]).unwrap_err();
        assert!(error.contains("--spiffe-id (CI_SPIFFE_ID)"), "{error}");
        let error = parse(&["--spiffe-id", "spiffe://example.org/ci/o/r/j", "--", "true"]).unwrap_err();
        assert!(error.contains("--spiffe-endpoint (SPIFFE_ENDPOINT_SOCKET)"), "{error}");
        assert!(!parse(&["--identity=false", "--", "true"]).unwrap().identity_on());
        assert!(!parse(&["--", "true"]).unwrap().identity_on(), "no job SPIFFE ID: no identity wait");
    }

    fn contract(vars: &[(&str, &str)]) -> Contract {
        Contract::from_lookup(|name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| (*v).to_owned()))
    }

    /// What drivers set reaches the settings; empty variables are unset; flags win;
    /// a bad value names its variable.
    #[test]
    fn the_environment_contract_fills_what_flags_leave_open() {
        let mut args = parse(&["--", "true"]).unwrap();
        let vars = [
            (env::ASSIGNMENT_ID, "gitea-task-3"),
            (env::FACADE_URL, "unix:///run/gdr/facade.sock"),
            (env::SPIFFE_ENDPOINT_SOCKET, ""),
            (env::FACADE_SPIFFE_ID, ""),
            (env::SPIFFE_ID, ""),
            (env::RUNNER_LABELS_JSON, r#"["disposable","container","docker"]"#),
            (env::GITEA_URL, "http://10.0.0.1:3000/"),
        ];
        apply_contract(&mut args, &contract(&vars)).unwrap();
        validate(&args).unwrap();
        assert_eq!(args.environment.assignment_id.as_deref(), Some("gitea-task-3"));
        assert_eq!(args.environment.spiffe_endpoint, None);
        assert!(!args.identity_on());
        assert_eq!(args.runner_labels(), ["disposable", "container", "docker"]);
        assert_eq!(args.gitea_url.as_deref(), Some("http://10.0.0.1:3000"));

        let mut flagged = parse(&["--assignment-id", "gitea-task-9", "--", "true"]).unwrap();
        apply_contract(&mut flagged, &contract(&vars)).unwrap();
        assert_eq!(flagged.environment.assignment_id.as_deref(), Some("gitea-task-9"));

        for (name, bad) in
            [(env::SPIFFE_ENDPOINT_SOCKET, "/no/scheme"), (env::RUNNER_LABELS_JSON, "docker"), (env::GITEA_URL, "gitea:3000"), (env::SPIFFE_ID, "spiffe://x")]
        {
            let mut args = parse(&["--", "true"]).unwrap();
            let error = apply_contract(&mut args, &contract(&[(name, bad)])).unwrap_err();
            assert!(error.starts_with(name), "{name}: {error}");
        }
    }

    #[test]
    fn a_command_is_required() {
        let error = parse(OK).unwrap_err();
        assert!(error.contains("COMMAND"), "{error}");
    }
}
