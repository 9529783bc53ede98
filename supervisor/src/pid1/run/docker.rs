//! The job's dockerd, as PID 1 starts it: what it needs before the agent starts (a root
//! dockerd's socket, a rootless dockerd's directories), then storage, dockerd (as root
//! through `supervisor activate`, or Docker's `dockerd-rootless.sh` as the runner uid)
//! and `/_ping`, each step reported to the agent through a pipe ([`DockerReport`]).
//! Stopping it is the drain's (`super`).

use std::{
    fs,
    io::Write,
    os::{
        fd::AsRawFd,
        unix::{fs::PermissionsExt, net::UnixListener},
    },
    path::PathBuf,
    process::{Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use contract::environment::JobDocker;
use nix::sys::signal::Signal;

use super::Supervisor;
use crate::{
    agent::docker::report::DockerReport,
    exit::ChildStatus,
    pid1::{
        Pid1, Settings,
        dockerd::{self, DockerdConfig},
        spawn,
        storage::{self, StorageConfig},
    },
};

/// How often dockerd is pinged while starting (the benchmark floor polls as often).
const PING_INTERVAL: Duration = Duration::from_millis(10);

/// What PID 1 prepared for the job's dockerd before the agent started.
pub(super) enum DockerPrep {
    /// The socket a root dockerd is handed (`supervisor activate`).
    Root(Result<UnixListener, String>),
    /// A rootless dockerd's runtime directory; the agent serves its socket there.
    Rootless(Result<PathBuf, String>),
}

/// How starting the job's dockerd ended; each ends PID 1's reports to the agent (a
/// [`DockerReport`]).
pub(super) enum DockerStart {
    /// `/_ping` answered: how soon, for the report.
    Ready(String),
    /// dockerd cannot be used: why.
    Failed(String),
    /// A signal, or the agent's end, came first.
    Interrupted,
}

impl Supervisor {
    /// What the job's dockerd needs before anything of the job runs: a root dockerd's
    /// socket (a `docker` call then waits for dockerd instead of failing, so no step waits
    /// for it: pid1::dockerd), a rootless dockerd's directories (the agent serves its
    /// socket there); nothing without a dockerd.
    pub(super) fn prepare_docker(&self) -> Option<DockerPrep> {
        match self.settings.job_docker {
            JobDocker::None => None,
            JobDocker::Rootless => Some(DockerPrep::Rootless(self.prepare_rootless_dirs())),
            JobDocker::Root => {
                let path = &self.settings.docker_socket;
                let bound = dockerd::bind_socket(path, self.settings.user.docker_gid).map_err(|error| format!("cannot bind {}: {error}", path.display()));
                Some(DockerPrep::Root(bound))
            }
        }
    }

    /// dockerd from what `prep` made ready (when there is one), each step reported to the
    /// agent on `pipe`. The agent may already be gone; that is handled by the event loop.
    pub(super) fn start_docker_and_report(&mut self, mut pipe: fs::File, prep: Option<DockerPrep>, started: Instant) {
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

    pub(super) fn dockerd_shutdown_timeout(&self) -> Duration {
        (self.settings.drain_timeout / 2).saturating_sub(Duration::from_secs(2)).max(Duration::from_secs(1))
    }
}

/// The socket a rootless dockerd binds itself, beside the one the agent serves.
pub(super) fn rootless_socket(settings: &Settings) -> PathBuf {
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
