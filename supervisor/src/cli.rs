//! The supervisor's command line. Every setting is a flag with an environment
//! variable; values are parsed and cross-checked before any side effect, and an
//! invalid one ends the process with a usage error (exit 64) naming the setting.

use std::{path::PathBuf, time::Duration};

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::units::{parse_duration, parse_size};

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
    /// gitea-runner's job-started hook: wait until identity and dockerd are ready.
    JobStarted(JobStartedArgs),
    /// Diagnose this environment: independent checks with PASS/FAIL/SKIP.
    Doctor(Box<DoctorArgs>),
    /// Print the version.
    Version,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
pub enum Bridge {
    /// dockerd's default bridge network (what jobs expect).
    Default,
    /// No bridge and no iptables rules (containers need --network none or host).
    None,
}

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Uid the agent and the job run as.
    #[arg(long, env = "SUPERVISOR_RUNNER_UID", default_value_t = 2000, value_parser = parse_unprivileged_id)]
    pub runner_uid: u32,
    /// Primary gid of the runner.
    #[arg(long, env = "SUPERVISOR_RUNNER_GID", default_value_t = 2000, value_parser = parse_unprivileged_id)]
    pub runner_gid: u32,
    /// Gid of the docker group: owns dockerd's socket and is the runner's supplementary group.
    #[arg(long, env = "SUPERVISOR_DOCKER_GID", default_value_t = 2001, value_parser = parse_unprivileged_id)]
    pub docker_gid: u32,

    /// HOME of the runner user.
    #[arg(long, env = "SUPERVISOR_RUNNER_HOME", default_value = "/home/runner", value_parser = parse_absolute)]
    pub runner_home: PathBuf,

    /// Start a job-local dockerd (and its storage). Off for environments without Docker.
    #[arg(long, env = "SUPERVISOR_DOCKER", default_value_t = true, action = clap::ArgAction::Set)]
    pub docker: bool,
    #[arg(long, env = "SUPERVISOR_DOCKERD", default_value = "dockerd")]
    pub dockerd: PathBuf,
    /// dockerd's data root; backed by a loop-mounted ext4 image unless already a mountpoint.
    #[arg(long, env = "SUPERVISOR_DOCKER_DATA_ROOT", default_value = "/var/lib/docker", value_parser = parse_absolute)]
    pub docker_data_root: PathBuf,
    #[arg(long, env = "SUPERVISOR_DOCKER_EXEC_ROOT", default_value = "/var/run/docker", value_parser = parse_absolute)]
    pub docker_exec_root: PathBuf,
    #[arg(long, env = "SUPERVISOR_DOCKER_SOCKET", default_value = "/var/run/docker.sock", value_parser = parse_absolute)]
    pub docker_socket: PathBuf,
    #[arg(long, env = "SUPERVISOR_DOCKER_PIDFILE", default_value = "/var/run/docker.pid", value_parser = parse_absolute)]
    pub docker_pidfile: PathBuf,
    /// File that receives dockerd's output.
    #[arg(long, env = "SUPERVISOR_DOCKERD_LOG", default_value = "/var/log/supervisor/dockerd.log", value_parser = parse_absolute)]
    pub dockerd_log: PathBuf,
    #[arg(long, env = "SUPERVISOR_DOCKER_BRIDGE", value_enum, default_value_t = Bridge::Default)]
    pub docker_bridge: Bridge,
    /// How long dockerd may take to answer GET /_ping.
    #[arg(long, env = "SUPERVISOR_DOCKER_READY_TIMEOUT", default_value = "120s", value_parser = parse_positive_duration)]
    pub docker_ready_timeout: Duration,

    /// Sparse image backing /var/lib/docker (not inside the data root).
    #[arg(long, env = "SUPERVISOR_STORAGE_IMAGE", default_value = "/var/lib/supervisor/docker.img", value_parser = parse_absolute)]
    pub storage_image: PathBuf,
    /// Size of the sparse image (e.g. 20G); only written blocks use disk.
    #[arg(long, env = "SUPERVISOR_STORAGE_SIZE", default_value = "20G", value_parser = parse_storage_size)]
    pub storage_size: u64,
    #[arg(long, env = "SUPERVISOR_MKFS", default_value = "mkfs.ext4")]
    pub mkfs: PathBuf,

    /// Root of the cgroup hierarchy as seen by this environment.
    #[arg(long, env = "SUPERVISOR_CGROUP_ROOT", default_value = "/sys/fs/cgroup", value_parser = parse_absolute)]
    pub cgroup_root: PathBuf,

    /// Wait for the job's X.509 SVID before running the job. Off for hosts without SPIFFE.
    #[arg(long, env = "SUPERVISOR_IDENTITY", default_value_t = true, action = clap::ArgAction::Set)]
    pub identity: bool,
    /// The exact SPIFFE ID the job's SVID must carry.
    #[arg(long, env = "CI_SPIFFE_ID", value_parser = parse_spiffe_id)]
    pub spiffe_id: Option<String>,
    /// SPIFFE Workload API endpoint (unix:///path or tcp://ip:port).
    #[arg(long, env = "SPIFFE_ENDPOINT_SOCKET", value_parser = parse_workload_endpoint)]
    pub spiffe_endpoint: Option<String>,
    #[arg(long, env = "SUPERVISOR_IDENTITY_TIMEOUT", default_value = "180s", value_parser = parse_positive_duration)]
    pub identity_timeout: Duration,

    /// The controller's facade (unix:///path or https://host:port). When set, the agent
    /// claims the task and serves it to gitea-runner (COMMAND) on 127.0.0.1.
    #[arg(long, env = "CI_RUNNER_FACADE_URL")]
    pub facade_url: Option<String>,
    /// The facade's SPIFFE ID, required for https facade URLs.
    #[arg(long, env = "CI_RUNNER_FACADE_SPIFFE_ID")]
    pub facade_spiffe_id: Option<String>,
    /// The assignment this environment runs (gitea-task-<id>).
    #[arg(long, env = "CI_ASSIGNMENT_ID")]
    pub assignment_id: Option<String>,
    /// The runner labels for the .runner file, as a JSON array of strings.
    #[arg(long, env = "CI_RUNNER_LABELS_JSON", value_parser = parse_labels, default_value = "[\"self-hosted\"]")]
    pub runner_labels_json: RunnerLabels,
    /// gitea-runner's working directory (its .runner file is written there).
    #[arg(long, env = "SUPERVISOR_RUNNER_DIR", default_value = "/home/runner", value_parser = parse_absolute)]
    pub runner_dir: PathBuf,

    /// Time from SIGTERM to exit: runner, dockerd, unmount, loop detach, then SIGKILL.
    /// The default stays inside Kubernetes' 30 s termination grace period.
    #[arg(long, env = "SUPERVISOR_DRAIN_TIMEOUT", default_value = "25s", value_parser = parse_drain)]
    pub drain_timeout: Duration,

    /// Directory for the supervisor's runtime state (agent socket, storage state).
    #[arg(long, env = "SUPERVISOR_STATE_DIR", default_value = "/run/supervisor", value_parser = parse_absolute)]
    pub state_dir: PathBuf,

    /// The job command, run as the runner uid once identity and dockerd are ready.
    #[arg(trailing_var_arg = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

#[derive(Debug, Clone, Args)]
pub struct JobStartedArgs {
    /// The agent's readiness socket.
    #[arg(long, env = "SUPERVISOR_AGENT_SOCKET", default_value = "/run/supervisor/agent/agent.sock", value_parser = parse_absolute)]
    pub socket: PathBuf,
    /// How long to wait for identity and dockerd before failing the job.
    #[arg(long, env = "SUPERVISOR_JOB_STARTED_TIMEOUT", default_value = "300s", value_parser = parse_positive_duration)]
    pub timeout: Duration,
}

#[derive(Debug, Clone, Args)]
pub struct DoctorArgs {
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub paths: crate::doctor::Paths,
}

/// Settings that only make sense together, checked after parsing. The message names
/// the setting and says what to do.
///
/// # Errors
/// The first inconsistency found.
pub fn validate(args: &RunArgs) -> Result<(), String> {
    if args.identity {
        if args.spiffe_id.is_none() {
            return Err("--spiffe-id (CI_SPIFFE_ID) is required while identity is on: set it to the job's \
                        SPIFFE ID, or pass --identity=false (SUPERVISOR_IDENTITY=false) on hosts without SPIFFE"
                .into());
        }
        if args.spiffe_endpoint.is_none() {
            return Err("--spiffe-endpoint (SPIFFE_ENDPOINT_SOCKET) is required while identity is on: set it to \
                        the Workload API socket, e.g. unix:///run/spire/agent/public/api.sock"
                .into());
        }
    }
    if let Some(url) = &args.facade_url {
        if args.assignment_id.as_deref().is_none_or(str::is_empty) {
            return Err("--assignment-id (CI_ASSIGNMENT_ID) is required with --facade-url (CI_RUNNER_FACADE_URL)".into());
        }
        if !(url.starts_with("unix:///") || url.starts_with("https://")) {
            return Err(format!("--facade-url (CI_RUNNER_FACADE_URL) {url:?} must be unix:///path or https://host:port"));
        }
        if url.starts_with("https://") && (args.facade_spiffe_id.is_none() || !args.identity) {
            return Err("--facade-url (CI_RUNNER_FACADE_URL) https:// needs identity on and --facade-spiffe-id (CI_RUNNER_FACADE_SPIFFE_ID)".into());
        }
    }
    if args.runner_gid == args.docker_gid {
        return Err(format!(
            "--docker-gid (SUPERVISOR_DOCKER_GID) must differ from --runner-gid: both are {}",
            args.docker_gid
        ));
    }
    if args.docker {
        if args.storage_image.starts_with(&args.docker_data_root) {
            return Err(format!(
                "--storage-image (SUPERVISOR_STORAGE_IMAGE) {} must not be inside --docker-data-root {}",
                args.storage_image.display(),
                args.docker_data_root.display()
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

fn parse_absolute(value: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(value);
    if path.is_absolute() {
        Ok(path)
    } else {
        Err(format!("{value:?} is not an absolute path"))
    }
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

/// `unix:///abs/path`, `unix:/abs/path` or `tcp://ip:port` (SPIFFE Workload Endpoint).
pub fn parse_workload_endpoint(value: &str) -> Result<String, String> {
    if let Some(rest) = value.strip_prefix("unix:") {
        let path = rest.strip_prefix("//").unwrap_or(rest);
        if path.starts_with('/') && path.len() > 1 {
            return Ok(value.to_owned());
        }
        return Err(format!("{value:?} is not a unix socket URI: use unix:///absolute/path"));
    }
    if let Some(rest) = value.strip_prefix("tcp://") {
        if rest.parse::<std::net::SocketAddr>().is_ok() {
            return Ok(value.to_owned());
        }
        return Err(format!("{value:?}: tcp endpoints need an IP address and port, e.g. tcp://127.0.0.1:8081"));
    }
    Err(format!("{value:?} is not a Workload API endpoint: use unix:///path or tcp://ip:port"))
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
        assert_eq!(run.runner_uid, 2000);
        assert_eq!(run.storage_size, 20 << 30);
        assert_eq!(run.drain_timeout, Duration::from_secs(25));
        assert_eq!(run.command, vec!["true"]);
        assert_eq!(run.runner_labels_json, RunnerLabels(vec!["self-hosted".into()]));
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
            (&["--facade-url", "https://controller:9443", "--assignment-id", "gitea-task-1"], "--facade-spiffe-id"),
        ];
        for &(extra, setting) in table {
            let error = parse(&with(extra)).expect_err(&format!("{extra:?} was accepted"));
            assert!(error.contains(setting), "{extra:?}: {error}");
        }
    }

    #[test]
    fn identity_settings_are_required_while_identity_is_on() {
        let error = parse(&["--", "true"]).unwrap_err();
        assert!(error.contains("--spiffe-id (CI_SPIFFE_ID)"), "{error}");
        let error = parse(&["--spiffe-id", "spiffe://example.org/ci/o/r/j", "--", "true"]).unwrap_err();
        assert!(error.contains("--spiffe-endpoint (SPIFFE_ENDPOINT_SOCKET)"), "{error}");
        parse(&["--identity=false", "--", "true"]).unwrap();
    }

    #[test]
    fn a_command_is_required() {
        let error = parse(OK).unwrap_err();
        assert!(error.contains("COMMAND"), "{error}");
    }
}
