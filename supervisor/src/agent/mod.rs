//! The agent: everything that runs as the runner uid (with the docker group), started
//! by PID 1: the identity wait ([`identity`]), the facade client ([`facade_client`]),
//! the loopback RunnerService the runner talks to ([`loopback`], with the pass-through
//! to Gitea in [`proxy`]) and the readiness protocol ([`ready`]). It never touches
//! storage, cgroups or dockerd's process; it learns of dockerd through a pipe.
//!
//!
//! It waits for the job's exact SVID (SPIRE attests the caller's uid, so this wait
//! must run as uid 2000, never as root) and for PID 1's word that dockerd is ready,
//! serves the readiness socket that `supervisor job-started` asks, then runs the job
//! command, forwards signals to it, and exits with its status.

use std::{
    io::{BufRead, BufReader},
    os::fd::{FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use nix::{sys::signal::Signal, unistd::Pid};
use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt},
    net::{UnixListener, UnixStream},
    signal::unix::{SignalKind, signal},
    sync::{mpsc, watch},
};

pub mod facade_client;
pub mod identity;
pub mod loopback;
pub mod proxy;
pub mod ready;

use crate::{
    exit::{self, ChildStatus},
    pid1::FORWARDED,
};
use ready::{Readiness, Request, Status};

/// Environment variable that carries [`AgentConfig`] from PID 1 (no secrets in it).
pub const CONFIG_ENV: &str = "SUPERVISOR_AGENT_CONFIG";
/// The fd on which PID 1 writes one line about dockerd: `ready …` or `failed …`.
pub const DOCKER_FD: i32 = 3;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AgentConfig {
    pub identity: Option<IdentitySettings>,
    /// Whether PID 1 reports on dockerd through fd 3.
    pub docker: bool,
    pub docker_host: Option<String>,
    pub socket: PathBuf,
    pub command: Vec<String>,
    /// With a facade: claim the task and serve it to gitea-runner (the job command)
    /// through the loopback RunnerService; without: just run the command.
    #[serde(default)]
    pub facade: Option<FacadeSettings>,
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
    /// Keeps the claim's holder id across agent restarts.
    pub holder_file: PathBuf,
    /// Gitea as this environment reaches it: the loopback passes every request that is
    /// not the runner protocol there.
    #[serde(default)]
    pub gitea_url: Option<String>,
    #[serde(default = "default_hooks")]
    pub hooks: crate::cli::RunnerHooks,
}

fn default_hooks() -> crate::cli::RunnerHooks {
    crate::cli::RunnerHooks::Auto
}

/// The capability comes from the environment the driver set (or from the file PID 1
/// read and removed), and is not passed on to the job.
pub const CAPABILITY_ENV: &str = contract::environment::CAPABILITY;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IdentitySettings {
    pub spiffe_id: String,
    pub endpoint: String,
    pub timeout_ms: u64,
}

/// `supervisor agent`: reads its configuration and runs.
pub fn main() -> u8 {
    // Steps run as this same uid: non-dumpable, its memory and /proc/<pid>/environ (the
    // capability, the session, the loopback's token) belong to root, and no step may
    // ptrace it.
    if let Err(error) = nix::sys::prctl::set_dumpable(false) {
        tracing::error!(%error, "cannot make itself non-dumpable; refusing to hold the capability where the job's steps could read it");
        return exit::INTERNAL;
    }
    let config =
        match std::env::var(CONFIG_ENV).map_err(|e| e.to_string()).and_then(|json| serde_json::from_str::<AgentConfig>(&json).map_err(|e| e.to_string())) {
            Ok(config) => config,
            Err(error) => {
                tracing::error!("invalid {CONFIG_ENV}: {error}; the agent is started by `supervisor run`");
                return exit::USAGE;
            }
        };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            tracing::error!(%error, "cannot start the async runtime");
            return exit::INTERNAL;
        }
    };
    runtime.block_on(run(config))
}

async fn run(config: AgentConfig) -> u8 {
    let initial = Readiness {
        identity: match &config.identity {
            Some(_) => Status::Waiting("not asked yet".into()),
            None => Status::Off,
        },
        docker: if config.docker { Status::Waiting("dockerd starting".into()) } else { Status::Off },
    };
    let (state, readiness) = watch::channel(initial);
    let mut signals = match Signals::new() {
        Ok(signals) => signals,
        Err(error) => {
            tracing::error!(%error, "cannot install signal handlers");
            return exit::INTERNAL;
        }
    };
    let listener = match bind(&config.socket) {
        Ok(listener) => listener,
        Err(error) => {
            tracing::error!(socket = %config.socket.display(), %error, "cannot listen on the readiness socket");
            return exit::INTERNAL;
        }
    };
    // Each time the job-started hook is let through, for the facade's timeline.
    let (hook_passed, mut hook_passes) = mpsc::unbounded_channel();
    let server = tokio::spawn(serve(listener, readiness.clone(), hook_passed));

    let mut tasks = tokio::task::JoinSet::new();
    if let Some(settings) = config.identity.clone() {
        let state = state.clone();
        tasks.spawn(async move {
            let mut progress = |detail: &str| {
                let detail = detail.to_owned();
                state.send_modify(|r| r.identity = Status::Waiting(detail));
            };
            let outcome = identity::wait_for_svid(&settings.endpoint, &settings.spiffe_id, Duration::from_millis(settings.timeout_ms), &mut progress).await;
            state.send_modify(|r| {
                r.identity = match outcome {
                    Ok(_) => Status::Ready(settings.spiffe_id.clone()),
                    Err(error) => Status::Failed(error.to_string()),
                }
            });
        });
    }
    if config.docker {
        let state = state.clone();
        tasks.spawn(async move {
            let reported = state.clone();
            let read = tokio::task::spawn_blocking(move || read_docker_reports(|status| reported.send_modify(|r| r.docker = status))).await;
            if let Err(error) = read {
                state.send_modify(|r| r.docker = Status::Failed(format!("reading PID 1's report failed: {error}")));
            }
        });
    }

    let code = 'outcome: {
        let mut watching = readiness.clone();
        // With a facade the runner starts once claimed; the job-started hook holds the
        // first step until dockerd's socket takes connections (dockerd starts behind it).
        let needs_docker = config.facade.is_none();
        loop {
            let mut now = watching.borrow_and_update().clone();
            if !needs_docker && !now.docker.is_failed() {
                now.docker = Status::Off;
            }
            if now.identity.is_failed() {
                tracing::error!(identity = %now.identity, "no usable SPIFFE identity for this job");
                break 'outcome exit::IDENTITY;
            }
            if now.docker.is_failed() {
                tracing::error!(docker = %now.docker, "the job's dockerd failed");
                break 'outcome exit::DOCKER;
            }
            // Without a facade, COMMAND is started only once dockerd answers (it may need Docker at once).
            if now.is_ready() && now.docker.is_final() {
                break;
            }
            tokio::select! {
                changed = watching.changed() => if changed.is_err() { break 'outcome exit::INTERNAL },
                Some(signal) = signals.recv() => {
                    if stops_before_start(signal) {
                        tracing::info!(%signal, "stopped before the job started");
                        break 'outcome 128 + signal as u8;
                    }
                }
            }
        }
        match &config.facade {
            None => run_job(&config, None, &mut signals, None).await,
            Some(facade) => {
                use tracing::Instrument as _;
                let span = tracing::info_span!("assignment", assignment.id = %facade.assignment_id);
                serve_the_runner(&config, facade, readiness.clone(), &mut hook_passes, &mut signals).instrument(span).await
            }
        }
    };
    tasks.abort_all();
    server.abort();
    let _ = server.await;
    let _ = std::fs::remove_file(&config.socket);
    code
}

/// Before the job runs there is nothing to forward to: terminating signals end the
/// agent, the rest (SIGUSR1, SIGWINCH…) are ignored.
fn stops_before_start(signal: Signal) -> bool {
    matches!(signal, Signal::SIGTERM | Signal::SIGINT | Signal::SIGHUP | Signal::SIGQUIT)
}

/// Claims the task, writes `.runner`, serves the loopback RunnerService and runs
/// gitea-runner (the job command) with phases reported to the facade.
async fn serve_the_runner(
    config: &AgentConfig,
    facade: &FacadeSettings,
    readiness: watch::Receiver<Readiness>,
    hook_passes: &mut mpsc::UnboundedReceiver<()>,
    signals: &mut Signals,
) -> u8 {
    use proto::facade::v1::Phase;
    let Ok(capability) = std::env::var(CAPABILITY_ENV) else {
        tracing::error!("{CAPABILITY_ENV} is not set; the driver injects it with the assignment");
        return exit::USAGE;
    };
    let endpoint = config.identity.as_ref().map(|i| i.endpoint.clone());
    let own_id = config.identity.as_ref().map(|i| i.spiffe_id.as_str());
    let mut client =
        match facade_client::FacadeClient::connect(&facade.url, facade.spiffe_id.as_deref(), endpoint.as_deref(), own_id, &facade.assignment_id, &capability)
            .await
        {
            Ok(client) => client,
            Err(error) => {
                tracing::error!(error = %crate::error_chain(&error), "cannot reach the controller's facade");
                return exit::CLAIM;
            }
        };
    if config.identity.is_some() {
        client.report(Phase::IdentityReady, "", 0).await;
    }
    let holder = match holder(&facade.holder_file) {
        Ok(holder) => holder,
        Err(error) => {
            tracing::error!(file = %facade.holder_file.display(), %error, "cannot keep the holder id");
            return exit::INTERNAL;
        }
    };
    let facade_client::Claimed { task, gitea_capabilities } = match client.claim(&holder, Duration::from_secs(120)).await {
        Ok(claimed) => claimed,
        Err(error) => {
            tracing::error!(error = %crate::error_chain(&error), "cannot claim the task");
            client.report(Phase::Failed, &error.to_string(), 0).await;
            return exit::CLAIM;
        }
    };
    tracing::info!(assignment.id = %facade.assignment_id, task_id = task.id, "claimed");
    client.report(Phase::Claimed, "", 0).await;

    let runner = match loopback::LocalRunner::new(&facade.assignment_id, facade.labels.clone()) {
        Ok(runner) => runner,
        Err(error) => {
            tracing::error!(%error, "no randomness for the local runner token");
            return exit::INTERNAL;
        }
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let fallback = match proxy::fallback(facade.gitea_url.as_deref()) {
        Ok(fallback) => fallback,
        Err(error) => {
            tracing::error!(error = %crate::error_chain(&error), "cannot set up the pass-through to Gitea");
            return exit::USAGE;
        }
    };
    // Steps may run once dockerd's socket takes connections (or dockerd failed: the job then says so itself).
    let (steps_may_run, steps_receiver) = watch::channel(false);
    let steps_watch = {
        let mut readiness = readiness.clone();
        tokio::spawn(async move {
            let _ = readiness.wait_for(|r| !matches!(r.docker, Status::Waiting(_))).await;
            let _ = steps_may_run.send(true);
        })
    };
    let stopping = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let served = loopback::Served {
        runner: runner.clone(),
        task,
        gitea_capabilities,
        upstream: std::sync::Arc::new(client.clone()),
        hooks: facade.hooks,
        steps_may_run: steps_receiver,
        stopping: std::sync::Arc::clone(&stopping),
    };
    let (address, server) = match loopback::start(loopback::router(served), fallback, shutdown.clone()).await {
        Ok(started) => started,
        Err(error) => {
            tracing::error!(%error, "cannot listen on 127.0.0.1");
            return exit::INTERNAL;
        }
    };
    let written = std::fs::create_dir_all(&facade.runner_dir)
        .and_then(|()| write_private(&facade.runner_dir.join(".runner"), &runner.runner_file(&format!("http://{address}"))));
    if let Err(error) = written {
        tracing::error!(dir = %facade.runner_dir.display(), %error, "cannot write .runner");
        return exit::INTERNAL;
    }
    // Report dockerd's readiness when it comes, without holding the runner back.
    let docker_reporter = {
        let (client, mut readiness) = (client.clone(), readiness);
        tokio::spawn(async move {
            let docker = readiness.wait_for(|r| r.docker.is_final()).await.map(|r| r.docker.clone());
            match docker {
                Ok(Status::Ready(detail)) => client.report(Phase::DockerReady, &detail, 0).await,
                Ok(Status::Failed(detail)) => client.report(Phase::Failed, &format!("dockerd: {detail}"), 0).await,
                _ => {}
            }
        })
    };
    client.report(Phase::RunnerStarted, "", 0).await;
    let hook_reporter = {
        let client = client.clone();
        let mut passes = std::mem::replace(hook_passes, mpsc::unbounded_channel().1);
        tokio::spawn(async move {
            if passes.recv().await.is_some() {
                client.report(Phase::JobStarted, "", 0).await;
            }
        })
    };
    let code = run_job(config, Some(&facade.runner_dir), signals, Some(&stopping)).await;
    hook_reporter.abort();
    client.report(Phase::RunnerExited, "", i32::from(code)).await;
    docker_reporter.abort();
    steps_watch.abort();
    shutdown.cancel();
    let _ = server.await;
    code
}

/// A random holder id, kept in `file` so that a restarted agent claims as the same holder.
fn holder(file: &Path) -> std::io::Result<String> {
    if let Ok(existing) = std::fs::read_to_string(file)
        && existing.trim().len() >= 16
    {
        return Ok(existing.trim().to_owned());
    }
    let holder = loopback::random_hex(24)?;
    write_private(file, holder.as_bytes())?;
    Ok(holder)
}

fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::{io::Write, os::unix::fs::OpenOptionsExt};
    let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    file.write_all(bytes)
}

/// Runs the job command, passing signals on; `stopping` is set when a terminating
/// signal is passed on.
async fn run_job(config: &AgentConfig, cwd: Option<&Path>, signals: &mut Signals, stopping: Option<&std::sync::atomic::AtomicBool>) -> u8 {
    let Some((program, args)) = config.command.split_first() else {
        return exit::USAGE;
    };
    let mut command = tokio::process::Command::new(program);
    command.args(args).stdin(Stdio::inherit()).stdout(Stdio::inherit()).stderr(Stdio::inherit());
    // The runner and its steps see none of the contract (the capability least of all).
    command.env_remove(CONFIG_ENV);
    for name in contract::environment::ALL {
        command.env_remove(name);
    }
    if let Some(cwd) = cwd {
        command.current_dir(cwd);
    }
    if let Some(host) = &config.docker_host {
        command.env("DOCKER_HOST", host);
    }
    // Its own process group, so a terminal's job control does not reach the agent.
    command.process_group(0);
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(error) => {
            tracing::error!(program, %error, "cannot run the job command");
            return exit::spawn_failure(&error);
        }
    };
    let pid = child.id().and_then(|id| i32::try_from(id).ok()).map(Pid::from_raw);
    tracing::info!(program, pid = ?pid, "job started");
    loop {
        tokio::select! {
            status = child.wait() => {
                return match status {
                    Ok(status) => {
                        let status = ChildStatus::from_std(status);
                        tracing::info!(%status, "job ended");
                        status.exit_code()
                    }
                    Err(error) => {
                        tracing::error!(%error, "waiting for the job failed");
                        exit::INTERNAL
                    }
                };
            }
            Some(signal) = signals.recv() => {
                if let Some(stopping) = stopping
                    && matches!(signal, Signal::SIGTERM | Signal::SIGINT)
                {
                    stopping.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                if let Some(pid) = pid {
                    tracing::debug!(%signal, %pid, "forwarding signal to the job");
                    let _ = nix::sys::signal::kill(pid, signal);
                }
            }
        }
    }
}

/// Reads PID 1's reports about dockerd from [`DOCKER_FD`], one line each, until the
/// last (`ready` or `failed`), passing each on.
fn read_docker_reports(mut report: impl FnMut(Status)) {
    // SAFETY: fd 3 was installed by PID 1 (dup2 in the pre-exec step) for this
    // process alone; fcntl confirms it is open before ownership is taken, and nothing
    // else in the agent uses fd 3.
    let open = unsafe { libc::fcntl(DOCKER_FD, libc::F_GETFD) } != -1;
    if !open {
        return report(Status::Failed("PID 1 gave the agent no dockerd report channel (fd 3)".into()));
    }
    // SAFETY: see above; the fd is open and owned by nobody else in this process.
    let fd = unsafe { OwnedFd::from_raw_fd(DOCKER_FD) };
    let mut reader = BufReader::new(std::fs::File::from(fd));
    loop {
        let mut line = String::new();
        let status = match reader.read_line(&mut line) {
            Ok(0) => Status::Failed("PID 1 closed the dockerd report channel without a final word".into()),
            Ok(_) => parse_docker_report(&line),
            Err(error) => Status::Failed(format!("reading PID 1's dockerd report failed: {error}")),
        };
        let last = status.is_final();
        report(status);
        if last {
            return;
        }
    }
}

/// `listening <detail>` (dockerd starts behind its socket), then `ready <detail>` or
/// `failed <detail>`.
pub fn parse_docker_report(line: &str) -> Status {
    let line = line.trim_end();
    match line.split_once(' ').unwrap_or((line, "")) {
        ("listening", detail) => Status::Starting(detail.to_owned()),
        ("ready", detail) => Status::Ready(detail.to_owned()),
        ("failed", detail) => Status::Failed(detail.to_owned()),
        _ => Status::Failed(format!("unreadable dockerd report {line:?}")),
    }
}

fn bind(socket: &Path) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::remove_file(socket) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(error),
    }
    let listener = UnixListener::bind(socket)?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

async fn serve(listener: UnixListener, readiness: watch::Receiver<Readiness>, passed: mpsc::UnboundedSender<()>) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                connections.spawn(answer(stream, readiness.clone(), passed.clone()));
            }
            Err(error) => {
                tracing::warn!(%error, "readiness socket accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        while connections.try_join_next().is_some() {}
    }
}

async fn answer(stream: UnixStream, mut readiness: watch::Receiver<Readiness>, passed: mpsc::UnboundedSender<()>) {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let mut reader = tokio::io::BufReader::new(read.take(4096));
    if reader.read_line(&mut line).await.is_err() {
        return;
    }
    let wait = serde_json::from_str::<Request>(&line).map_or(Duration::ZERO, |r| Duration::from_millis(r.wait_ms));
    let _ = tokio::time::timeout(wait, readiness.wait_for(Readiness::is_settled)).await;
    let current = readiness.borrow().clone();
    let mut answer = serde_json::to_vec(&current).unwrap_or_default();
    answer.push(b'\n');
    if write.write_all(&answer).await.is_ok() && current.is_ready() {
        let _ = passed.send(());
    }
}

/// The forwarded signals as one stream (the agent is not PID 1: tokio handlers are fine).
struct Signals {
    receiver: mpsc::UnboundedReceiver<Signal>,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        let (sender, receiver) = mpsc::unbounded_channel();
        for forwarded in FORWARDED {
            let mut stream = signal(SignalKind::from_raw(forwarded as i32))?;
            let sender = sender.clone();
            tokio::spawn(async move {
                while stream.recv().await.is_some() {
                    if sender.send(forwarded).is_err() {
                        return;
                    }
                }
            });
        }
        Ok(Signals { receiver })
    }

    async fn recv(&mut self) -> Option<Signal> {
        self.receiver.recv().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docker_reports() {
        let table: &[(&str, Status)] = &[
            ("ready /var/run/docker.sock answered in 412ms\n", Status::Ready("/var/run/docker.sock answered in 412ms".into())),
            ("failed dockerd exited with 1\n", Status::Failed("dockerd exited with 1".into())),
            ("ready\n", Status::Ready(String::new())),
            ("listening /var/run/docker.sock\n", Status::Starting("/var/run/docker.sock".into())),
            ("bogus\n", Status::Failed("unreadable dockerd report \"bogus\"".into())),
        ];
        for (line, want) in table {
            assert_eq!(&parse_docker_report(line), want, "{line:?}");
        }
    }
}
