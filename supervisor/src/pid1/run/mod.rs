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
//! still happens (a PID 1 that exits early takes everything down uncleaned). The job's
//! dockerd (step 3) is [`docker`]'s.

mod docker;

use std::{
    fs,
    io::Write,
    os::{
        fd::{AsRawFd, OwnedFd},
        unix::fs::PermissionsExt,
    },
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use contract::environment::JobDocker;
use nix::{sys::signal::Signal, unistd::Pid};

use self::docker::rootless_socket;
use super::{
    Event, Pid1, Settings, cgroup, spawn,
    storage::{self, Prepared},
};
use crate::{
    agent::{self, AgentConfig, DockerProxy, FacadeSettings, IdentitySettings},
    exit::{self, ChildStatus},
};

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
        let prep = self.prepare_docker();
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
}
