//! The agent: everything that runs as the runner uid (with the docker group), started
//! by PID 1: the identity wait ([`identity`]), the facade client ([`facade_client`]),
//! the loopback RunnerService the runner talks to ([`loopback`], with the pass-through
//! to Gitea in [`proxy`]), the job's cache ([`cache_proxy`], to the controller over the
//! facade's connection), the loopback's ports as sockets for a `container:` job
//! ([`relay`]), the readiness protocol ([`ready`]) and the job command with
//! its signals ([`job`]); its settings are in [`config`], its failures and their exit
//! codes in [`error`]. It never touches storage, cgroups or dockerd's process; it
//! learns of dockerd through a pipe ([`docker::report`]).
//!
//! It waits for the job's exact SVID (SPIRE attests the caller's uid, so this wait
//! must run as uid 2000, never as root) and for PID 1's word that dockerd is ready,
//! serves the readiness socket that `supervisor job-started` asks, then runs the job
//! command, forwards signals to it, and exits with its status.

use std::{path::Path, time::Duration};

use tokio::sync::{mpsc, watch};

pub mod cache_proxy;
pub mod capability;
pub mod config;
pub mod docker;
pub mod error;
pub mod facade_client;
pub mod identity;
pub mod job;
pub mod loopback;
pub mod proxy;
pub mod ready;
pub mod relay;

pub use capability::CAPABILITY_FD;
pub use config::{AgentConfig, CAPABILITY_ENV, CONFIG_ENV, DockerProxy, FacadeSettings, IdentitySettings};
pub use docker::report::DOCKER_FD;
pub use error::AgentError;
use job::Signals;
use ready::{Readiness, Status};

/// `supervisor agent`: reads its configuration and runs; a failure is logged once, here,
/// and becomes its exit code.
pub fn run() -> u8 {
    match start() {
        Ok(code) => code,
        Err(error) => {
            tracing::error!(error = %crate::error_chain(&error), "the agent cannot go on");
            error.exit_code()
        }
    }
}

fn start() -> Result<u8, AgentError> {
    // Steps run as this same uid: non-dumpable, its memory and /proc/<pid>/environ (the
    // capability, the session, the loopback's token) belong to root, and no step may
    // ptrace it.
    nix::sys::prctl::set_dumpable(false).map_err(AgentError::NotDumpable)?;
    let config = std::env::var(CONFIG_ENV).map_err(|e| AgentError::Config(e.to_string()))?;
    let config: AgentConfig = serde_json::from_str(&config).map_err(|e| AgentError::Config(e.to_string()))?;
    let capability = capability::take();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(AgentError::Runtime)?;
    runtime.block_on(run_with(config, capability))
}

/// Listens on `socket` (replacing a stale one) with permissions `mode`.
///
/// # Errors
/// When the old socket cannot be removed or the new one bound.
pub fn bind_unix(socket: &std::path::Path, mode: u32) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt as _;
    match std::fs::remove_file(socket) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => return Err(error),
        _ => {}
    }
    let listener = tokio::net::UnixListener::bind(socket)?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(mode))?;
    Ok(listener)
}

/// The agent's life with `config`: readiness, the job, then tidying up.
async fn run_with(config: AgentConfig, capability: Option<String>) -> Result<u8, AgentError> {
    let initial = Readiness {
        identity: match &config.identity {
            Some(_) => Status::Waiting("not asked yet".into()),
            None => Status::Off,
        },
        docker: if config.docker { Status::Waiting("dockerd starting".into()) } else { Status::Off },
        services: Status::Off,
    };
    let (state, readiness) = watch::channel(initial);
    let mut signals = Signals::new().map_err(AgentError::Signals)?;
    let listener = bind_unix(&config.socket, ready::SOCKET_MODE).map_err(|source| AgentError::ReadinessSocket { socket: config.socket.clone(), source })?;
    // Each time the job-started hook is let through, for the facade's timeline.
    let (hook_passed, mut hook_passes) = mpsc::unbounded_channel();
    let server = tokio::spawn(ready::serve(listener, readiness.clone(), hook_passed));

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
    if let Some(proxy) = &config.docker_proxy {
        let listener =
            bind_unix(&proxy.listen, docker::proxy::SOCKET_MODE).map_err(|source| AgentError::DockerSocket { socket: proxy.listen.clone(), source })?;
        let listening = format!("{} takes connections; the rootless dockerd starts behind it", proxy.listen.display());
        state.send_modify(|r| r.docker = Status::Starting(listening));
        tasks.spawn(docker::proxy::serve(listener, proxy.upstream.clone(), Duration::from_millis(proxy.patience_ms), readiness.clone()));
    }
    if config.docker {
        let state = state.clone();
        tasks.spawn(async move {
            let reported = state.clone();
            let read = tokio::task::spawn_blocking(move || ready::read_docker_reports(|status| reported.send_modify(|r| r.docker = status))).await;
            if let Err(error) = read {
                state.send_modify(|r| r.docker = Status::Failed(format!("reading PID 1's report failed: {error}")));
            }
        });
    }

    let outcome = async {
        if let Some(stopped) = wait_until_ready(&config, readiness.clone(), &mut signals).await? {
            return Ok(stopped);
        }
        match &config.facade {
            None => job::run(&config, None, &mut signals, None).await,
            Some(facade) => {
                use tracing::Instrument as _;
                let span = tracing::info_span!("assignment", assignment.id = %facade.assignment_id);
                let readiness = (&state, readiness.clone());
                serve_the_runner(&config, facade, capability.clone(), readiness, &mut hook_passes, &mut signals).instrument(span).await
            }
        }
    }
    .await;
    tasks.abort_all();
    server.abort();
    let _ = server.await;
    let _ = std::fs::remove_file(&config.socket);
    outcome
}

/// Waits until the job may start: the identity is ready and — without a facade, where
/// the command may need Docker at once — dockerd answers. `Some(code)` when a signal
/// stopped the agent first.
async fn wait_until_ready(config: &AgentConfig, mut readiness: watch::Receiver<Readiness>, signals: &mut Signals) -> Result<Option<u8>, AgentError> {
    // With a facade the runner starts once claimed; the job-started hook holds the
    // first step until dockerd's socket takes connections (dockerd starts behind it).
    let needs_docker = config.facade.is_none();
    loop {
        let mut now = readiness.borrow_and_update().clone();
        if !needs_docker && !now.docker.is_failed() {
            now.docker = Status::Off;
        }
        if let Status::Failed(reason) = &now.identity {
            return Err(AgentError::Identity(reason.clone()));
        }
        if let Status::Failed(reason) = &now.docker {
            return Err(AgentError::Docker(reason.clone()));
        }
        if now.is_ready() && now.docker.is_final() {
            return Ok(None);
        }
        tokio::select! {
            changed = readiness.changed() => changed.map_err(|_| AgentError::ReadinessLost)?,
            Some(signal) = signals.recv() => {
                if job::stops_before_start(signal) {
                    tracing::info!(%signal, "stopped before the job started");
                    return Ok(Some(128 + signal as u8));
                }
            }
        }
    }
}

/// Claims the task, writes `.runner`, serves the loopback RunnerService and runs
/// gitea-runner (the job command) with phases reported to the facade.
async fn serve_the_runner(
    config: &AgentConfig,
    facade: &FacadeSettings,
    capability: Option<String>,
    (state, readiness): (&watch::Sender<Readiness>, watch::Receiver<Readiness>),
    hook_passes: &mut mpsc::UnboundedReceiver<()>,
    signals: &mut Signals,
) -> Result<u8, AgentError> {
    use proto::facade::v1::Phase;
    let capability = capability.ok_or(AgentError::NoCapability)?;
    let endpoint = config.identity.as_ref().map(|i| i.endpoint.clone());
    let own_id = config.identity.as_ref().map(|i| i.spiffe_id.as_str());
    let mut client =
        facade_client::FacadeClient::connect(&facade.url, facade.spiffe_id.as_deref(), endpoint.as_deref(), own_id, &facade.assignment_id, &capability)
            .await
            .map_err(AgentError::Facade)?;
    if config.identity.is_some() {
        client.report(Phase::IdentityReady, "", 0).await;
    }
    // Kept in memory only: a step that learnt it could claim as this agent.
    let holder = loopback::random_hex(24).map_err(AgentError::Randomness)?;
    let facade_client::Claimed { task, gitea_capabilities } = match client.claim(&holder, Duration::from_secs(120)).await {
        Ok(claimed) => claimed,
        Err(error) => {
            client.report(Phase::Failed, &error.to_string(), 0).await;
            return Err(AgentError::Claim(error));
        }
    };
    tracing::info!(assignment.id = %facade.assignment_id, task_id = task.id, "claimed");
    client.report(Phase::Claimed, "", 0).await;

    let runner = loopback::LocalRunner::new(&facade.assignment_id, facade.labels.clone()).map_err(AgentError::Randomness)?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let fallback = proxy::fallback(facade.gitea_url.as_deref()).map_err(AgentError::PassThrough)?;
    let services = start_services(config, &task, state, readiness.clone());
    // Steps may run once dockerd's socket takes connections and a host-mode job's
    // services are up (or either failed: the job then says so itself).
    let (steps_may_run, steps_receiver) = watch::channel(false);
    let steps_watch = {
        let mut readiness = readiness.clone();
        tokio::spawn(async move {
            let _ = readiness.wait_for(|r| !matches!(r.docker, Status::Waiting(_)) && !matches!(r.services, Status::Waiting(_))).await;
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
    let (address, server) = loopback::start(loopback::router(served), fallback, shutdown.clone()).await.map_err(AgentError::Loopback)?;
    let written = std::fs::create_dir_all(&facade.runner_dir)
        .and_then(|()| write_private(&facade.runner_dir.join(".runner"), &runner.runner_file(&format!("http://{address}"))));
    written.map_err(|source| AgentError::RunnerFile { dir: facade.runner_dir.clone(), source })?;
    let cache = serve_the_cache(&client, facade, &shutdown).await?;
    let port_sockets = relay::dir(&config.socket);
    let ports = relay::serve_ports(&port_sockets, &[address.port(), contract::cache::PORT], shutdown.clone())
        .map_err(|source| AgentError::PortSockets { dir: port_sockets.clone(), source })?;
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
    let code = job::run(config, Some(&facade.runner_dir), signals, Some(&stopping)).await;
    hook_reporter.abort();
    let reported = match &code {
        Ok(code) => i32::from(*code),
        Err(error) => i32::from(error.exit_code()),
    };
    client.report(Phase::RunnerExited, "", reported).await;
    docker_reporter.abort();
    steps_watch.abort();
    if let Some(services) = services {
        services.abort();
        let _ = services.await;
    }
    shutdown.cancel();
    let _ = server.await;
    if let Some(cache) = cache {
        let _ = cache.await;
    }
    let _ = ports.await;
    code
}

/// Starts a host-mode job's `services:` on the job's dockerd once it is ready
/// ([`docker::services`]), their progress in `state` for the job-started hook; `None`
/// when there is nothing to start (or nothing can be: the hook then fails the job,
/// saying why).
fn start_services(
    config: &AgentConfig,
    task: &proto::runner::v1::Task,
    state: &watch::Sender<Readiness>,
    mut readiness: watch::Receiver<Readiness>,
) -> Option<tokio::task::JoinHandle<()>> {
    let declared = docker::services::declared(task.workflow_payload.as_deref().unwrap_or_default(), &task.secrets, &task.vars);
    let services = match declared {
        Ok(services) if services.is_empty() => return None,
        Ok(services) => services,
        Err(error) => {
            state.send_modify(|r| r.services = Status::Failed(error.to_string()));
            return None;
        }
    };
    let Some(host) = config.docker_host.clone() else {
        let error = docker::services::ServicesError::NoDocker { names: docker::services::names(&services) };
        state.send_modify(|r| r.services = Status::Failed(error.to_string()));
        return None;
    };
    state.send_modify(|r| r.services = Status::Waiting(format!("{} wait for dockerd", docker::services::names(&services))));
    let state = state.clone();
    Some(tokio::spawn(async move {
        let docker = readiness.wait_for(|r| r.docker.is_final()).await.map(|r| r.docker.clone());
        let outcome = match docker {
            Ok(Status::Ready(_)) => docker::services::start(&host, &services, |doing| state.send_modify(|r| r.services = Status::Waiting(doing))).await,
            other => {
                let state = other.map_or_else(|_| "the agent lost its readiness".to_owned(), |status| status.to_string());
                Err(docker::services::ServicesError::DockerdDown { names: docker::services::names(&services), state })
            }
        };
        match outcome {
            Ok(summary) => {
                tracing::info!(services = %summary, "the job's services are up");
                state.send_modify(|r| r.services = Status::Ready(summary));
            }
            Err(error) => {
                tracing::warn!(%error, "the job's services did not come up");
                state.send_modify(|r| r.services = Status::Failed(error.to_string()));
            }
        }
    }))
}

/// The job's cache on `contract::cache::LISTEN`, with the runner's registration secret
/// written first (gitea-runner reads it when it starts). A job still runs when the
/// address is taken: its cache steps then say they cannot reach the cache.
async fn serve_the_cache(
    client: &facade_client::FacadeClient,
    facade: &FacadeSettings,
    shutdown: &tokio_util::sync::CancellationToken,
) -> Result<Option<tokio::task::JoinHandle<std::io::Result<()>>>, AgentError> {
    let secret = loopback::random_hex(32).map_err(AgentError::Randomness)?;
    let file = facade.runner_dir.join(contract::cache::SECRET_FILE);
    write_private(&file, secret.as_bytes()).map_err(|source| AgentError::RunnerFile { dir: facade.runner_dir.clone(), source })?;
    let gitea = proxy::fallback(facade.gitea_url.as_deref()).map_err(AgentError::PassThrough)?;
    match cache_proxy::start(client.clone(), secret, gitea, shutdown.clone()).await {
        Ok(server) => Ok(Some(server)),
        Err(error) => {
            tracing::error!(listen = contract::cache::LISTEN, %error, "cannot serve the job's cache; its cache steps will say the cache does not answer");
            Ok(None)
        }
    }
}

fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::{io::Write, os::unix::fs::OpenOptionsExt};
    let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    file.write_all(bytes)
}
