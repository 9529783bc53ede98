//! `controller run-local`: one job of a workflow file through the whole pipeline — the
//! embedded store, the docker driver, the supervisor in the runner image, the real
//! runner — with the controller itself in Gitea's place: it builds the Task
//! ([`task`]), takes the runner's reports ([`reports`]: the log streams to the
//! terminal) and exits with the job's result. Ctrl-C cancels the job the way Gitea
//! does (the runner is told in its next report and cleans up); a second Ctrl-C removes
//! the environment at once.
//!
//! No Gitea is involved, so steps that talk to Gitea (checkout, artifacts, API calls)
//! get a clear 502 from the supervisor's pass-through.

pub mod reports;
pub mod task;

use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context;
use proto::runner::v1::{Result as TaskResult, StepState};
use tokio_util::sync::CancellationToken;

use crate::{
    assignment::{Assignment, Placement, Rules, capability::CapabilityKey, placement::LabelPolicy},
    driver::{
        Driver,
        docker::{DockerConfig, DockerDriver},
    },
    facade::{EnvironmentSockets, Facade},
    gitea::registrations::Registrations,
    lifecycle::Lifecycle,
    placements::Placements,
    store::{Record, Store, embedded::Embedded, now_ms},
    worker::{EnvironmentSettings, Worker},
};

/// The installation name of local runs.
const LOCAL_INSTANCE: &str = "local";

/// Exit code after a cancelled job (as a shell reports SIGINT).
pub const EXIT_CANCELLED: u8 = 130;

/// What `run-local` was asked.
#[derive(Debug, Clone)]
pub struct RunLocal {
    pub workflow: PathBuf,
    pub job: Option<String>,
    /// `NAME=@FILE`: the secret's value is read from FILE.
    pub secrets: Vec<String>,
    /// `NAME=VALUE`.
    pub vars: Vec<String>,
    pub image: String,
    pub docker_socket: String,
    /// `--privileged` (refused on some hosts); otherwise the explicit capability list.
    pub privileged: bool,
    /// `owner/name` the job believes it runs for.
    pub repository: String,
}

/// Runs the job; returns the exit code (0 success, 1 failure, 130 cancelled).
///
/// # Errors
/// When the workflow, the secrets or the Docker host cannot be used.
/// The assignment of `task` and the rules it was made with, under either label policy:
/// run-local accepts what a Gitea with either setting would.
///
/// # Errors
/// The default policy's error when neither takes the job (its `runs-on` names no placement).
pub fn assignment_for(task: proto::runner::v1::Task) -> Result<(Assignment, Rules), crate::assignment::envelope::AssignmentError> {
    let trust_domain = "run-local.invalid".to_owned();
    let default_rules = Rules { trust_domain: trust_domain.clone(), labels: LabelPolicy::default() };
    match Assignment::from_task(task.clone(), &default_rules) {
        Ok(assignment) => Ok((assignment, default_rules)),
        Err(first) => {
            let seed = Rules { trust_domain, labels: LabelPolicy::seed_compatible() };
            Assignment::from_task(task, &seed).map(|assignment| (assignment, seed)).map_err(|_| first)
        }
    }
}

pub async fn run(args: RunLocal, interrupts: tokio::sync::mpsc::UnboundedReceiver<()>) -> anyhow::Result<u8> {
    let text = std::fs::read(&args.workflow).with_context(|| format!("--workflow {}", args.workflow.display()))?;
    let (job, payload, needs) = task::single_job(&text, args.job.as_deref())?;
    let secrets = task::secrets_from_files(&args.secrets.iter().map(|s| s.replacen("=@", "=", 1)).collect::<Vec<_>>())?;
    let vars = task::vars(&args.vars)?;
    let run = task::RunContext { repository: args.repository.clone(), ..task::RunContext::default() };
    let task_id = now_ms().max(1);
    let job_token = crate::assignment::capability::random_token().map_err(|_| anyhow::anyhow!("the system offers no randomness"))?;
    let task = task::task(task_id, payload, task::context(&run, &job, task_id), &needs, secrets, vars, &job_token);
    let (assignment, rules) = assignment_for(task).with_context(|| format!("job {job:?} cannot run"))?;
    if assignment.placement != Placement::CONTAINER_DOCKER {
        eprintln!("run-local: job {job:?} asks for {}; running it in a local Docker container instead", assignment.placement);
    }

    let dir = tempfile::Builder::new().prefix("gdr-run-local-").tempdir_in("/tmp").context("a scratch directory under /tmp")?;
    let socket_dir = dir.path().join("environments");
    let mut docker = if args.privileged { DockerConfig::privileged(&args.image) } else { DockerConfig::unprivileged_loop_capable(&args.image) };
    docker.socket = args.docker_socket.clone();
    let driver: Arc<dyn Driver> = Arc::new(
        DockerDriver::connect(docker)
            .await
            .with_context(|| format!("the Docker host at {} (start one, or pass --docker-socket)", args.docker_socket))?
            .for_placement(assignment.placement),
    );

    let store: Arc<dyn Store> = Arc::new(Embedded::open(&dir.path().join("store.redb"))?);
    let mut placements = Placements::new();
    let runtime = placements.add(assignment.placement, 1, Some(Arc::clone(&driver)));
    let reports = Arc::new(reports::LocalReports::new(Box::new(std::io::stdout())));
    let registrations = Registrations::local(Arc::clone(&reports) as Arc<dyn crate::gitea::TaskReports>);
    let lifecycle = Lifecycle::new(Arc::clone(&store), placements, registrations.clone()).with_retire_grace(Duration::from_secs(10));
    let key = Arc::new(CapabilityKey::random().map_err(|_| anyhow::anyhow!("the system offers no randomness for the capability key"))?);
    let shutdown = CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();

    let facade = Arc::new(Facade::new(Arc::clone(&store), registrations, lifecycle.clone(), Arc::clone(&key), rules.clone()));
    let sockets = EnvironmentSockets::new(&socket_dir, LOCAL_INSTANCE, &[assignment.placement]).context("the facade sockets' directory")?;
    tasks.spawn({
        let (sockets, store, shutdown) = (Arc::clone(&sockets), Arc::clone(&store), shutdown.clone());
        async move { sockets.serve(facade, store, shutdown).await.map_err(anyhow::Error::from) }
    });
    let settings = EnvironmentSettings {
        instance: LOCAL_INSTANCE.to_owned(),
        capability_ttl: Duration::from_secs(24 * 3600),
        socket_dir: Some(socket_dir),
        socket_placements: vec![assignment.placement],
        ..EnvironmentSettings::default()
    };
    let worker = Arc::new(
        Worker::new(runtime, Arc::clone(&driver), Arc::clone(&store), key, settings, rules, lifecycle.clone())
            .with_sweep_interval(Duration::from_secs(2))
            .with_sockets(Some(sockets)),
    );
    {
        let (worker, shutdown) = (Arc::clone(&worker), shutdown.clone());
        tasks.spawn(async move { worker.run(shutdown).await.map_err(anyhow::Error::from) });
    }
    let record = Record::pending(&assignment.id, assignment.placement, reports::RUNNER, assignment.encode(), now_ms());
    store.persist(&record).await?;
    eprintln!("run-local: job {job:?} as {} in {} ({})", assignment.id, crate::driver::environment_name(LOCAL_INSTANCE, &assignment.id), args.image);

    let ended = wait_for_the_end(&reports, &lifecycle, &store, &assignment.id, &driver, interrupts).await;
    // Let the environment end and be removed before leaving.
    let name = crate::driver::environment_name(LOCAL_INSTANCE, &assignment.id);
    crate::lifecycle::retire(driver.as_ref(), &name, &assignment.id, Duration::from_secs(15), || {}).await;
    shutdown.cancel();
    while tasks.join_next().await.is_some() {}
    lifecycle.drain(Duration::from_secs(10)).await;

    let code = match &ended {
        Some(ended) => {
            summary(&assignment, ended);
            exit_code(ended.result)
        }
        None => EXIT_CANCELLED,
    };
    Ok(code)
}

/// Waits for the final state. The first interrupt cancels the job (the runner hears it
/// in its next report); a second one gives up at once (`None`).
async fn wait_for_the_end(
    reports: &reports::LocalReports,
    lifecycle: &Lifecycle,
    store: &Arc<dyn Store>,
    assignment_id: &str,
    driver: &Arc<dyn Driver>,
    mut interrupts: tokio::sync::mpsc::UnboundedReceiver<()>,
) -> Option<reports::Ended> {
    let mut ended = reports.ended();
    let mut interrupted = 0;
    loop {
        if let Some(done) = ended.borrow().clone() {
            return Some(done);
        }
        tokio::select! {
            changed = ended.changed() => if changed.is_err() { return None },
            Some(()) = interrupts.recv() => {
                interrupted += 1;
                if interrupted == 1 {
                    eprintln!("run-local: cancelling the job (Ctrl-C again to remove its environment now)");
                    reports.cancel();
                    // Not claimed yet: nobody will hear of it; end it here.
                    if let Ok(Some(record)) = store.get(assignment_id).await
                        && record.value.state == crate::store::State::Pending
                    {
                        let _ = lifecycle.finish(assignment_id, TaskResult::Cancelled as i32).await;
                        return Some(reports::Ended { result: TaskResult::Cancelled as i32, steps: Vec::new() });
                    }
                } else {
                    eprintln!("run-local: removing the environment");
                    let _ = driver.delete(&crate::driver::environment_name(LOCAL_INSTANCE, assignment_id)).await;
                    let _ = lifecycle.finish(assignment_id, TaskResult::Cancelled as i32).await;
                    return None;
                }
            }
        }
    }
}

fn exit_code(result: i32) -> u8 {
    match TaskResult::try_from(result) {
        Ok(TaskResult::Success | TaskResult::Skipped) => 0,
        Ok(TaskResult::Cancelled) => EXIT_CANCELLED,
        _ => 1,
    }
}

/// One line per step with its result, then the job's.
fn summary(assignment: &Assignment, ended: &reports::Ended) {
    let names = step_names(assignment);
    eprintln!("run-local: ── summary ──");
    for step in &ended.steps {
        let name = usize::try_from(step.id).ok().and_then(|i| names.get(i)).cloned().unwrap_or_else(|| format!("step {}", step.id));
        eprintln!("run-local:   {:<10} {name}", short(step));
    }
    eprintln!("run-local: job {}", crate::lifecycle::result_name(ended.result).trim_start_matches("RESULT_").to_ascii_lowercase());
}

fn short(step: &StepState) -> String {
    crate::lifecycle::result_name(step.result).trim_start_matches("RESULT_").to_ascii_lowercase()
}

/// The job's step names as the workflow writes them (`name`, else `run`/`uses`).
fn step_names(assignment: &Assignment) -> Vec<String> {
    let Some(payload) = assignment.task.workflow_payload.as_deref() else { return Vec::new() };
    let Ok(document) = serde_yaml_ng::from_slice::<serde_yaml_ng::Value>(payload) else { return Vec::new() };
    let Some(jobs) = document.get("jobs").and_then(|j| j.as_mapping()) else { return Vec::new() };
    let Some((_, job)) = jobs.iter().next() else { return Vec::new() };
    let steps = job.get("steps").and_then(|s| s.as_sequence()).cloned().unwrap_or_default();
    steps
        .iter()
        .map(|step| {
            let field = |key: &str| step.get(key).and_then(|v| v.as_str()).map(|v| v.lines().next().unwrap_or_default().to_owned());
            field("name").or_else(|| field("run").map(|r| format!("Run {r}"))).or_else(|| field("uses")).unwrap_or_default()
        })
        .collect()
}
