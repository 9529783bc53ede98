//! `supervisor run`: PID 1's whole life, synchronous at heart.
//!
//! 1. cgroups (v2: nest into `init`), state directories;
//! 2. the agent, started at once as the runner uid so that the identity wait overlaps
//!    with storage and dockerd;
//! 3. storage for /var/lib/docker and the job-local dockerd, ready on `/_ping`, reported
//!    to the agent through a pipe;
//! 4. signals forwarded to the agent until it exits; SIGTERM starts the drain;
//! 5. the ordered drain — agent, dockerd, leftovers, unmount, loop detach — bounded by
//!    the drain deadline, then the agent's exit code.
//!
//! Once the agent runs, nothing here may bail out: errors are logged and the drain
//! still happens (a PID 1 that exits early takes everything down uncleaned).

use std::{
    fs,
    io::Write,
    os::{
        fd::{AsRawFd, OwnedFd},
        unix::{fs::PermissionsExt, net::UnixListener},
    },
    path::PathBuf,
    process::{Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use contract::environment::JobDocker;
use nix::{sys::signal::Signal, unistd::Pid};

use super::{
    Event, Pid1, Settings, cgroup,
    dockerd::{self, DockerdConfig},
    spawn,
    storage::{self, Prepared, StorageConfig},
};
use crate::{
    agent::{self, AgentConfig, DockerProxy, FacadeSettings, IdentitySettings, docker_report::DockerReport},
    exit::{self, ChildStatus},
};

/// How often dockerd is pinged while starting (the benchmark floor polls as often).
const PING_INTERVAL: Duration = Duration::from_millis(10);

pub fn run(settings: Settings) -> u8 {
    let pid1 = match Pid1::new() {
        Ok(pid1) => pid1,
        Err(error) => {
            tracing::error!(error = %crate::error_chain(&error), "cannot become the environment's PID 1");
            return exit::INTERNAL;
        }
    };
    let mut supervisor = Supervisor { pid1, settings, agent: None, dockerd: None, storage: None, drain_started: None, agent_status: None };
    supervisor.run()
}

struct Supervisor {
    pid1: Pid1,
    settings: Settings,
    agent: Option<Pid>,
    dockerd: Option<Pid>,
    storage: Option<Prepared>,
    /// When SIGTERM arrived: the drain deadline counts from here.
    drain_started: Option<Instant>,
    agent_status: Option<ChildStatus>,
}

/// Stop preparing: the agent ended or SIGTERM arrived.
struct Interrupted;

/// What PID 1 prepared for the job's dockerd before the agent started.
enum DockerPrep {
    /// The socket a root dockerd is handed (`supervisor activate`).
    Root(Result<UnixListener, String>),
    /// A rootless dockerd's runtime directory; the agent serves its socket there.
    Rootless(Result<PathBuf, String>),
}

/// How starting the job's dockerd ended; each ends PID 1's reports to the agent (a
/// [`DockerReport`]).
enum DockerStart {
    /// `/_ping` answered: how soon, for the report.
    Ready(String),
    /// dockerd cannot be used: why.
    Failed(String),
    /// A signal, or the agent's end, came first.
    Interrupted,
}

impl Supervisor {
    fn run(&mut self) -> u8 {
        let started = Instant::now();
        tracing::info!(
            pid = std::process::id(),
            drain_timeout = ?self.settings.drain_timeout,
            "supervisor starting; the drain needs a termination grace period longer than the drain timeout"
        );
        // The runner's ids before anything runs as the runner.
        match super::user::adopt(&self.settings.user, std::path::Path::new("/etc")) {
            Ok(adopted) if adopted == super::user::Adopted::default() => {}
            Ok(adopted) => {
                tracing::info!(uid = self.settings.user.uid, gid = self.settings.user.gid, subordinate = ?self.settings.user.subordinate, files = ?adopted.files, home_entries = adopted.home_entries, "the runner user takes this environment's ids")
            }
            Err(error) => {
                tracing::error!(error = %crate::error_chain(&error), "cannot give the runner user this environment's ids");
                return exit::INTERNAL;
            }
        }
        // A rootless dockerd gets no cgroup of its own to manage.
        if self.settings.job_docker == JobDocker::Root {
            self.nest_cgroups();
        }
        let agent_dir = self.settings.state_dir.join("agent");
        if let Err(error) = self.prepare_state_dir(&agent_dir) {
            tracing::error!(dir = %agent_dir.display(), %error, "cannot prepare the state directory");
            return exit::INTERNAL;
        }
        // dockerd's socket before anything of the job runs: a `docker` call then waits
        // for dockerd instead of failing, so no step waits for it (pid1::dockerd). A
        // rootless dockerd's directories before the agent, which serves its socket there.
        let prep = match self.settings.job_docker {
            JobDocker::None => None,
            JobDocker::Rootless => Some(DockerPrep::Rootless(self.prepare_rootless_dirs())),
            JobDocker::Root => {
                let path = &self.settings.docker_socket;
                let bound = dockerd::bind_socket(path, self.settings.user.docker_gid).map_err(|error| format!("cannot bind {}: {error}", path.display()));
                Some(DockerPrep::Root(bound))
            }
        };
        let report = match self.start_agent(&agent_dir) {
            Ok(report) => report,
            Err(code) => return code,
        };
        if let Some(report) = report {
            self.start_docker_and_report(fs::File::from(report), prep, started);
        }
        self.supervise();
        self.drain();
        let code = self.agent_status.map_or(exit::INTERNAL, ChildStatus::exit_code);
        tracing::info!(code, "supervisor exiting");
        code
    }

    /// dockerd from what `prep` made ready (when there is one), each step reported to the
    /// agent on `pipe`. The agent may already be gone; that is handled by the event loop.
    fn start_docker_and_report(&mut self, mut pipe: fs::File, prep: Option<DockerPrep>, started: Instant) {
        let mut report = |report: DockerReport| {
            let _ = pipe.write_all(report.to_line().as_bytes());
        };
        if let Some(DockerPrep::Root(Ok(_))) = &prep {
            report(DockerReport::Listening(format!("{} takes connections; dockerd starts behind it", self.settings.docker_socket.display())));
        }
        let outcome = match prep {
            Some(DockerPrep::Root(Ok(listener))) => self.start_docker(listener),
            Some(DockerPrep::Rootless(Ok(runtime_dir))) => self.start_rootless_docker(&runtime_dir),
            Some(DockerPrep::Root(Err(reason)) | DockerPrep::Rootless(Err(reason))) => DockerStart::Failed(reason),
            None => DockerStart::Failed("dockerd is off".to_owned()),
        };
        match &outcome {
            DockerStart::Ready(detail) => tracing::info!(elapsed = ?started.elapsed(), "dockerd ready: {detail}"),
            DockerStart::Failed(reason) => tracing::error!("dockerd is not available: {reason}"),
            DockerStart::Interrupted => {}
        }
        report(match outcome {
            DockerStart::Ready(detail) => DockerReport::Ready(detail),
            DockerStart::Failed(reason) => DockerReport::Failed(reason),
            DockerStart::Interrupted => DockerReport::Failed("the supervisor is shutting down".to_owned()),
        });
    }

    fn nest_cgroups(&mut self) {
        match cgroup::detect(&self.settings.cgroup_root) {
            cgroup::Mode::V1 => match cgroup::make_v1_writable(&self.settings.cgroup_root) {
                Ok(changed) if changed.is_empty() => {
                    tracing::info!(root = %self.settings.cgroup_root.display(), "cgroup v1: the hierarchies are writable")
                }
                Ok(changed) => tracing::info!(remounted = changed.len(), "cgroup v1: remounted the read-only hierarchies read-write for dockerd"),
                Err(error) => {
                    tracing::warn!(error = %crate::error_chain(&error), "cgroup v1: cannot make the hierarchies writable; containers of the job may not start")
                }
            },
            cgroup::Mode::V2 => match cgroup::nest_v2(&self.settings.cgroup_root, Duration::from_secs(10)) {
                Ok(nested) => tracing::info!(moved = nested.moved, enabled = ?nested.enabled, failed = ?nested.failed, "cgroup v2: nested into init"),
                Err(error) => tracing::warn!(error = %crate::error_chain(&error), "cgroup v2 nesting failed, containers may not start"),
            },
        }
    }

    fn prepare_state_dir(&self, agent_dir: &std::path::Path) -> std::io::Result<()> {
        fs::create_dir_all(agent_dir)?;
        nix::unistd::chown(agent_dir, Some(nix::unistd::Uid::from_raw(self.settings.user.uid)), Some(nix::unistd::Gid::from_raw(self.settings.user.gid)))?;
        // Others may pass through to the readiness socket (not list): the job-started hook
        // runs as whichever user a `container:` job's image has, with this directory mounted.
        fs::set_permissions(agent_dir, fs::Permissions::from_mode(0o711))?;
        // The hook runs as the runner uid and must reach the socket inside.
        fs::set_permissions(&self.settings.state_dir, fs::Permissions::from_mode(0o755))
    }

    /// Starts the agent; returns the write end of its dockerd report pipe (if any).
    fn start_agent(&mut self, agent_dir: &std::path::Path) -> Result<Option<OwnedFd>, u8> {
        let settings = &self.settings;
        let config = AgentConfig {
            identity: settings.identity.then(|| IdentitySettings {
                spiffe_id: settings.spiffe_id.clone().unwrap_or_default(),
                endpoint: settings.spiffe_endpoint.clone().unwrap_or_default(),
                timeout_ms: u64::try_from(settings.identity_timeout.as_millis()).unwrap_or(u64::MAX),
            }),
            docker: settings.job_docker.runs_dockerd(),
            docker_host: settings.job_docker.runs_dockerd().then(|| format!("unix://{}", settings.docker_socket.display())),
            docker_proxy: settings.job_docker.is_rootless().then(|| DockerProxy {
                listen: settings.docker_socket.clone(),
                upstream: rootless_socket(settings),
                patience_ms: u64::try_from(settings.docker_ready_timeout.as_millis()).unwrap_or(u64::MAX),
            }),
            socket: agent_dir.join("agent.sock"),
            command: settings.command.clone(),
            facade: settings.facade_url.clone().map(|url| FacadeSettings {
                url,
                spiffe_id: settings.facade_spiffe_id.clone(),
                assignment_id: settings.assignment_id.clone().unwrap_or_default(),
                labels: settings.runner_labels.clone(),
                runner_dir: settings.runner_dir.clone(),
                gitea_url: settings.gitea_url.clone(),
                hooks: settings.runner_hooks,
            }),
        };
        let json = serde_json::to_string(&config).map_err(|error| {
            tracing::error!(%error, "cannot encode the agent's configuration");
            exit::INTERNAL
        })?;
        let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe"));
        let mut command = Command::new(exe);
        command.arg("agent").env(agent::CONFIG_ENV, json).env("HOME", &settings.user.home).env("USER", "runner").stdin(Stdio::inherit());
        // The capability — a file the docker driver names (read and removed before
        // anything of the job runs), or PID 1's own environment (Pods, sandboxes) — goes
        // to the agent on a pipe (agent::CAPABILITY_FD), never in an environment a child
        // would inherit.
        command.env_remove(contract::environment::CAPABILITY_FILE).env_remove(agent::CAPABILITY_ENV);
        let capability = match contract::environment::Contract::from_process_env().capability_file {
            Some(file) => Some(fs::read_to_string(&file).and_then(|capability| fs::remove_file(&file).map(|()| capability)).map_err(|error| {
                tracing::error!(%file, %error, "cannot read and remove the capability file ({})", contract::environment::CAPABILITY_FILE);
                exit::USAGE
            })?),
            None => std::env::var(agent::CAPABILITY_ENV).ok(),
        };
        let capability_pipe = match capability {
            Some(capability) => {
                let (read, write) = spawn::handover_pipe().map_err(|error| {
                    tracing::error!(%error, "cannot create the capability pipe");
                    exit::INTERNAL
                })?;
                // A capability is far below the pipe's buffer: written whole now, read by the agent later.
                std::fs::File::from(write).write_all(capability.trim().as_bytes()).map_err(|error| {
                    tracing::error!(%error, "cannot write the capability pipe");
                    exit::INTERNAL
                })?;
                spawn::pass_fd(&mut command, read.as_raw_fd(), agent::CAPABILITY_FD);
                Some(read)
            }
            None => None,
        };
        spawn::prepare(&mut command, Some(settings.user.credentials()));
        spawn::no_new_privileges(&mut command);
        let (read, write) = if settings.job_docker.runs_dockerd() {
            let (read, write) = spawn::handover_pipe().map_err(|error| {
                tracing::error!(%error, "cannot create the dockerd report pipe");
                exit::INTERNAL
            })?;
            (Some(read), Some(write))
        } else {
            (None, None)
        };
        if let Some(read) = &read {
            // The agent's documented report channel.
            spawn::pass_fd(&mut command, read.as_raw_fd(), agent::DOCKER_FD);
        }
        match self.pid1.spawn(&mut command) {
            Ok(pid) => {
                tracing::info!(%pid, uid = settings.user.uid, "agent started");
                self.agent = Some(pid);
                drop(read);
                drop(capability_pipe);
                Ok(write)
            }
            Err(error) => {
                tracing::error!(%error, "cannot start the agent");
                Err(exit::INTERNAL)
            }
        }
    }

    /// Storage, then dockerd on `listener` until `/_ping` answers. PID 1 keeps no copy
    /// of the socket: without dockerd, a `docker` call is refused rather than left waiting.
    fn start_docker(&mut self, listener: UnixListener) -> DockerStart {
        if let Err(reason) = self.prepare_storage() {
            return DockerStart::Failed(reason);
        }
        if self.check_interrupts().is_err() {
            return DockerStart::Interrupted;
        }
        match self.spawn_dockerd(listener) {
            Ok(started) => self.wait_for_ping(&self.settings.docker_socket.clone(), started),
            Err(reason) => DockerStart::Failed(reason),
        }
    }

    /// Loop-backed storage for dockerd's data root, unless it is a mountpoint already.
    fn prepare_storage(&mut self) -> Result<(), String> {
        let storage_config = StorageConfig {
            mountpoint: self.settings.docker_data_root.clone(),
            image_path: self.settings.storage_image.clone(),
            size_bytes: self.settings.storage_size,
            mkfs: self.settings.mkfs.clone(),
            state_file: self.settings.state_dir.join("storage.json"),
        };
        let storage_started = Instant::now();
        match storage::prepare(&storage_config, &mut ReapingRunner(&mut self.pid1)) {
            Ok(prepared) => {
                tracing::info!(elapsed = ?storage_started.elapsed(), storage = ?prepared, "storage ready");
                self.storage = Some(prepared);
                Ok(())
            }
            Err(error) => Err(format!("storage for {} failed: {}", self.settings.docker_data_root.display(), crate::error_chain(&error))),
        }
    }

    /// dockerd on `listener` (through `supervisor activate`); when it started.
    fn spawn_dockerd(&mut self, listener: UnixListener) -> Result<Instant, String> {
        for stale in [&self.settings.docker_pidfile, &self.settings.docker_exec_root.join("containerd/containerd.pid")] {
            let _ = fs::remove_file(stale);
        }
        let config = DockerdConfig {
            dockerd: self.settings.dockerd.clone(),
            listen: dockerd::Listen::Activated,
            storage_driver: "overlay2",
            registry_mirrors: self.settings.registry_mirrors.clone(),
            data_root: self.settings.docker_data_root.clone(),
            exec_root: self.settings.docker_exec_root.clone(),
            pidfile: self.settings.docker_pidfile.clone(),
            bridge: self.settings.docker_bridge,
            shutdown_timeout: self.dockerd_shutdown_timeout(),
            mtu: dockerd::uplink_mtu(std::path::Path::new("/sys/class/net")),
        };
        let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe"));
        let mut command = Command::new(exe);
        command.arg("activate").arg(&config.dockerd).args(dockerd::args(&config));
        spawn::pass_fd(&mut command, listener.as_raw_fd(), dockerd::LISTEN_FD);
        spawn::prepare(&mut command, None);
        let started = self.launch_dockerd(command, &config.dockerd);
        drop(listener);
        started
    }

    /// A rootless dockerd: its directories made for the runner uid, then Docker's
    /// `dockerd-rootless.sh` as that uid (rootlesskit gives it a user, mount and network
    /// namespace of its own), until `/_ping` answers on the socket it binds.
    fn start_rootless_docker(&mut self, runtime_dir: &std::path::Path) -> DockerStart {
        let socket = rootless_socket(&self.settings);
        let config = DockerdConfig {
            dockerd: self.settings.rootless_dockerd.clone(),
            listen: dockerd::Listen::Socket(socket.clone()),
            storage_driver: dockerd::storage_driver_for(&self.settings.docker_data_root),
            registry_mirrors: self.settings.registry_mirrors.clone(),
            data_root: self.settings.docker_data_root.clone(),
            exec_root: runtime_dir.join("docker"),
            pidfile: runtime_dir.join("docker.pid"),
            bridge: self.settings.docker_bridge,
            shutdown_timeout: self.dockerd_shutdown_timeout(),
            // slirp4netns sets the uplink's MTU inside rootlesskit's namespace.
            mtu: None,
        };
        let mut command = Command::new(&config.dockerd);
        command.args(dockerd::args(&config)).env("XDG_RUNTIME_DIR", runtime_dir).env("HOME", &self.settings.user.home).env("USER", "runner");
        spawn::prepare(&mut command, Some(self.settings.user.credentials()));
        match self.launch_dockerd(command, &config.dockerd) {
            Ok(started) => self.wait_for_ping(&socket, started),
            Err(reason) => DockerStart::Failed(reason),
        }
    }

    /// The rootless dockerd's runtime directory (its sockets', 0700), data root and
    /// `/var/run/docker.sock` as a link to the socket the agent serves, for jobs that name
    /// that path.
    fn prepare_rootless_dirs(&self) -> Result<PathBuf, String> {
        let settings = &self.settings;
        let socket = &settings.docker_socket;
        let runtime_dir = socket.parent().map(PathBuf::from).ok_or_else(|| format!("{} has no directory", socket.display()))?;
        let owner = (Some(nix::unistd::Uid::from_raw(settings.user.uid)), Some(nix::unistd::Gid::from_raw(settings.user.gid)));
        for (dir, mode) in [(&runtime_dir, 0o700), (&settings.docker_data_root, 0o710)] {
            fs::create_dir_all(dir)
                .and_then(|()| nix::unistd::chown(dir.as_path(), owner.0, owner.1).map_err(std::io::Error::from))
                .and_then(|()| fs::set_permissions(dir, fs::Permissions::from_mode(mode)))
                .map_err(|error| format!("cannot prepare {} for the rootless dockerd: {error}", dir.display()))?;
        }
        let _ = fs::remove_file(rootless_socket(settings));
        // `supervisor run` refuses a rootless socket in /var/run, so this is another path.
        let well_known = std::path::Path::new("/var/run/docker.sock");
        let _ = fs::remove_file(well_known);
        if let Err(error) = std::os::unix::fs::symlink(socket, well_known) {
            tracing::warn!(%error, "cannot link /var/run/docker.sock to the rootless dockerd's socket");
        }
        Ok(runtime_dir)
    }

    /// Starts `command` (some dockerd) with its output in the dockerd log and none of the
    /// environment contract (its capability least of all); when it started.
    fn launch_dockerd(&mut self, mut command: Command, program: &std::path::Path) -> Result<Instant, String> {
        let log = open_log(&self.settings.dockerd_log).map_err(|error| format!("cannot open {}: {error}", self.settings.dockerd_log.display()))?;
        command.stdin(Stdio::null());
        for name in contract::environment::ALL {
            command.env_remove(name);
        }
        match log.try_clone() {
            Ok(err) => command.stdout(log).stderr(err),
            Err(_) => command.stdout(Stdio::null()).stderr(Stdio::null()),
        };
        let started = Instant::now();
        let pid = self.pid1.spawn(&mut command).map_err(|error| format!("cannot start {}: {error}", program.display()))?;
        self.dockerd = Some(pid);
        tracing::info!(%pid, program = %program.display(), "dockerd started");
        Ok(started)
    }

    /// Pings dockerd until it answers, handling PID 1's events meanwhile, within the
    /// ready timeout counted from `dockerd_started`.
    fn wait_for_ping(&mut self, socket: &std::path::Path, dockerd_started: Instant) -> DockerStart {
        let deadline = dockerd_started + self.settings.docker_ready_timeout;
        loop {
            match dockerd::ping(socket, Duration::from_secs(2)) {
                Ok(_) => {
                    return DockerStart::Ready(format!(
                        "{} answered /_ping {} ms after dockerd started",
                        socket.display(),
                        dockerd_started.elapsed().as_millis()
                    ));
                }
                Err(error) if Instant::now() >= deadline => {
                    return DockerStart::Failed(format!(
                        "dockerd did not answer within {:?} ({error}); its log ends with:\n{}",
                        self.settings.docker_ready_timeout,
                        dockerd::log_tail(&self.settings.dockerd_log, 20)
                    ));
                }
                Err(_) => {}
            }
            if let Some(event) = self.pid1.next_event(PING_INTERVAL) {
                self.handle(event);
            }
            if self.dockerd.is_none() {
                return DockerStart::Failed(format!(
                    "dockerd exited while starting; its log ends with:\n{}",
                    dockerd::log_tail(&self.settings.dockerd_log, 20)
                ));
            }
            if self.check_interrupts().is_err() {
                return DockerStart::Interrupted;
            }
        }
    }

    fn check_interrupts(&mut self) -> Result<(), Interrupted> {
        for signal in self.pid1.take_signals() {
            self.handle(Event::Signal(signal));
        }
        if self.drain_started.is_some() || self.agent_status.is_some() {
            return Err(Interrupted);
        }
        Ok(())
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Signal(signal) => {
                if let Some(agent) = self.agent {
                    tracing::info!(%signal, "forwarding signal to the agent");
                    self.pid1.signal(agent, signal);
                }
                if signal == Signal::SIGTERM && self.drain_started.is_none() {
                    tracing::info!(deadline = ?self.settings.drain_timeout, "SIGTERM: draining");
                    self.drain_started = Some(Instant::now());
                }
            }
            Event::Exited { pid, status } if Some(pid) == self.agent => {
                tracing::info!(%status, "agent exited");
                self.agent = None;
                self.agent_status = Some(status);
            }
            Event::Exited { pid, status } if Some(pid) == self.dockerd => {
                tracing::warn!(%status, log = %self.settings.dockerd_log.display(), "dockerd exited");
                self.dockerd = None;
            }
            Event::Exited { pid, status } => tracing::debug!(%pid, %status, "child exited"),
        }
    }

    /// Until the agent exits; SIGTERM gives it half of the drain budget.
    fn supervise(&mut self) {
        while self.agent.is_some() {
            let wait = match self.drain_started {
                Some(started) => {
                    let budget = self.settings.drain_timeout / 2;
                    let left = budget.saturating_sub(started.elapsed());
                    if left.is_zero() {
                        tracing::warn!(?budget, "the agent did not stop in its share of the drain: SIGKILL");
                        if let Some(agent) = self.agent {
                            self.pid1.signal(agent, Signal::SIGKILL);
                            if let Some(status) = self.pid1.wait_child(agent, Duration::from_secs(5)) {
                                self.handle(Event::Exited { pid: agent, status });
                            }
                        }
                        break;
                    }
                    left
                }
                None => Duration::from_secs(3600),
            };
            if let Some(event) = self.pid1.next_event(wait) {
                self.handle(event);
            }
        }
    }

    /// Ordered shutdown: dockerd, leftovers, unmount, loop detach.
    fn drain(&mut self) {
        let started = self.drain_started.unwrap_or_else(Instant::now);
        let deadline = started + self.settings.drain_timeout;
        if let Some(agent) = self.agent.take() {
            self.pid1.signal(agent, Signal::SIGKILL);
        }
        if let Some(dockerd) = self.dockerd.take() {
            tracing::info!("stopping dockerd");
            self.pid1.signal(dockerd, Signal::SIGTERM);
            // Keep a second for unmounting; dockerd stops its containers meanwhile.
            let budget = deadline.saturating_duration_since(Instant::now()).saturating_sub(Duration::from_secs(1));
            if self.pid1.wait_child(dockerd, budget.max(Duration::from_millis(100))).is_none() {
                tracing::warn!(?budget, "dockerd did not stop in time: SIGKILL");
                self.pid1.signal(dockerd, Signal::SIGKILL);
                let _ = self.pid1.wait_child(dockerd, Duration::from_secs(5));
            }
        }
        self.pid1.kill_remaining();
        if let Some(prepared) = self.storage.take() {
            match storage::cleanup(&prepared) {
                Ok(()) => tracing::info!("storage cleaned up"),
                Err(error) => tracing::error!(error = %crate::error_chain(&error), "storage cleanup failed"),
            }
        }
        tracing::info!(elapsed = ?started.elapsed(), "drain complete");
    }

    fn dockerd_shutdown_timeout(&self) -> Duration {
        (self.settings.drain_timeout / 2).saturating_sub(Duration::from_secs(2)).max(Duration::from_secs(1))
    }
}

/// The socket a rootless dockerd binds itself, beside the one the agent serves.
fn rootless_socket(settings: &Settings) -> PathBuf {
    settings.docker_socket.with_file_name("dockerd.sock")
}

fn open_log(path: &std::path::Path) -> std::io::Result<fs::File> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent)?;
    }
    fs::OpenOptions::new().create(true).append(true).open(path)
}

/// Lets storage run mkfs and friends through the reaper, the only waiter.
struct ReapingRunner<'a>(&'a mut Pid1);

impl storage::Runner for ReapingRunner<'_> {
    fn run(&mut self, mut command: Command) -> std::io::Result<ExitStatus> {
        use std::os::unix::process::ExitStatusExt;
        spawn::prepare(&mut command, None);
        let pid = self.0.spawn(&mut command)?;
        match self.0.wait_child(pid, Duration::from_secs(600)) {
            Some(ChildStatus::Exited(code)) => Ok(ExitStatus::from_raw((code & 0xff) << 8)),
            Some(ChildStatus::Signaled(signal)) => Ok(ExitStatus::from_raw(signal & 0x7f)),
            None => {
                self.0.signal(pid, Signal::SIGKILL);
                Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the command did not finish in 10 minutes"))
            }
        }
    }
}
