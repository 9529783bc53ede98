//! The run: the workflow's jobs through the controller's pipeline, in `needs` order,
//! independent jobs in parallel up to `--parallel`; the run's result is the exit code.
//! Ctrl-C cancels the run the way Gitea does (each runner is told in its next report
//! and cleans up); a second Ctrl-C removes the environments at once.
//!
//! No Gitea is involved: [`crate::repository`] serves a snapshot of the local
//! repository (and mapped actions) where the jobs' Gitea would be, so checkouts and
//! `uses:` work; other Gitea routes (artifacts, API calls) get an answer saying there
//! is no Gitea.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use anyhow::Context;
use proto::runner::v1::{Result as TaskResult, Task, TaskNeed};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use controller::{
    assignment::{Assignment, Placement, Rules, capability::CapabilityKey, placement::LabelPolicy},
    driver::{
        Driver,
        docker::{DockerConfig, DockerDriver},
    },
    gitea::registrations::Registrations,
    pipeline::Pipeline,
    placements::Placements,
    store::{Store, embedded::Embedded, now_ms},
    worker::EnvironmentSettings,
};

use crate::{
    cli::RunLocalArgs,
    reports, repository, task,
    workflow::{self, PlannedJob, Workflow},
};

/// The installation name of local runs.
const LOCAL_INSTANCE: &str = "local";

/// The assignments of `tasks` and the rules they were made with, under whichever
/// label policy takes them all: run-local accepts what a Gitea with either setting would,
/// and runs-on made only of `platforms` (e.g. ubuntu-latest) runs in a docker container.
///
/// # Errors
/// The default policy's error for the first job neither takes (its `runs-on` names no
/// placement).
pub fn assignments_for(tasks: &[Task], platforms: &[String]) -> Result<(Vec<Assignment>, Rules), controller::assignment::envelope::AssignmentError> {
    let trust_domain = "run-local.invalid".to_owned();
    let default_rules = Rules { trust_domain: trust_domain.clone(), labels: LabelPolicy { host_platforms: platforms.to_vec(), ..LabelPolicy::default() } };
    let under = |rules: &Rules| tasks.iter().map(|task| Assignment::from_task(task.clone(), rules)).collect::<Result<Vec<_>, _>>();
    match under(&default_rules) {
        Ok(assignments) => Ok((assignments, default_rules)),
        Err(first) => {
            let seed = Rules { trust_domain, labels: LabelPolicy { host_platforms: platforms.to_vec(), ..LabelPolicy::seed_compatible() } };
            under(&seed).map(|assignments| (assignments, seed)).map_err(|_| first)
        }
    }
}
/// A planned job and where it stands.
struct Job {
    planned: PlannedJob,
    task_id: i64,
    placement: Placement,
    runs_on: Vec<String>,
    state: JobState,
    /// Once handed to the pipeline: its environment is retired at the end.
    assignment: Option<Assignment>,
}

enum JobState {
    Waiting,
    Running,
    Done(reports::Ended),
}

impl Job {
    fn new(planned: PlannedJob, assignment: Assignment) -> Job {
        Job { planned, task_id: assignment.task.id, placement: assignment.placement, runs_on: assignment.runs_on, state: JobState::Waiting, assignment: None }
    }

    /// As Gitea decides: a job runs when every job it needs succeeded, or when it has an
    /// `if:` (which the runner then evaluates); otherwise it is skipped.
    fn runs_after(&self, needs: &BTreeMap<String, TaskNeed>) -> bool {
        self.planned.has_if || needs.values().all(|need| need.result == TaskResult::Success as i32)
    }

    fn ended(&self) -> Option<&reports::Ended> {
        match &self.state {
            JobState::Done(ended) => Some(ended),
            _ => None,
        }
    }
}

/// The task a planned job would be, to find its placement before anything starts.
fn probe(planned: &PlannedJob, id: i64, repository: &str) -> Task {
    let run = task::RunContext { repository: repository.to_owned(), ..task::RunContext::default() };
    let context = task::context(&run, &planned.key);
    task::task(id, planned.payload.clone(), context, BTreeMap::new(), BTreeMap::new(), BTreeMap::new(), "probe")
}

/// Expands the jobs whose matrix is an expression once the jobs they need ended.
struct Planner<'a> {
    workflow: &'a Workflow,
    filters: &'a [(String, String)],
    rules: Rules,
    repository: String,
    next_id: i64,
}

impl Planner<'_> {
    /// The combinations of the deferred job `key` as jobs of their own, evaluated with its needs.
    fn expand(&mut self, key: &str, needs: &BTreeMap<String, TaskNeed>, inputs: &Inputs) -> anyhow::Result<Vec<Job>> {
        let contexts = task::expression_contexts(&inputs.run, key, needs, &inputs.vars);
        let planned = self.workflow.expand(key, &contexts, self.filters)?;
        planned
            .into_iter()
            .map(|planned| {
                let id = self.next_id;
                self.next_id += 1;
                let assignment = Assignment::from_task(probe(&planned, id, &self.repository), &self.rules).map_err(|error| anyhow::anyhow!("{error}"))?;
                Ok(Job::new(planned, assignment))
            })
            .collect()
    }

    /// Replaces each deferred job whose needs ended (and that runs: they succeeded or it
    /// has an `if:`) by its combinations; one that cannot be expanded fails.
    fn expand_ready(&mut self, jobs: &mut Vec<Job>, inputs: &Inputs) {
        loop {
            let ready = (0..jobs.len()).find_map(|index| {
                let job = &jobs[index];
                if !job.planned.deferred || !matches!(job.state, JobState::Waiting) {
                    return None;
                }
                let needs = needs_of(jobs, index)?;
                job.runs_after(&needs).then_some((index, needs))
            });
            let Some((index, needs)) = ready else { return };
            let (key, name) = (jobs[index].planned.key.clone(), jobs[index].planned.name.clone());
            match self.expand(&key, &needs, inputs) {
                Ok(expanded) => {
                    let names: Vec<&str> = expanded.iter().map(|j| j.planned.name.as_str()).collect();
                    eprintln!("run-local: job {name:?}'s matrix gives {}: {}", expanded.len(), names.join(", "));
                    jobs.splice(index..=index, expanded);
                }
                Err(error) => {
                    eprintln!("run-local: job {name:?} cannot run: {error:#}");
                    jobs[index].state = JobState::Done(reports::Ended { result: TaskResult::Failure as i32, ..Default::default() });
                }
            }
        }
    }
}

/// Everything the run reads besides the workflow, from the command line and its files.
struct Inputs {
    run: task::RunContext,
    secrets: BTreeMap<String, String>,
    vars: BTreeMap<String, String>,
}

/// Runs `args` on a runtime of its own, Ctrl-C (SIGINT) and SIGTERM cancelling.
///
/// # Errors
/// See [`run`].
pub fn main(args: RunLocalArgs) -> anyhow::Result<u8> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let (interrupts, received) = tokio::sync::mpsc::unbounded_channel();
        let signals = tokio::spawn(controller::signal::forward_interrupts(interrupts));
        let code = run(args, received).await;
        signals.abort();
        code
    })
}

/// Runs the workflow (or `--job`); returns the exit code: 0 when every job succeeded
/// or was skipped, 1 when one failed, 130 when the run was cancelled.
///
/// # Errors
/// When the workflow, its inputs or the Docker host cannot be used — before any
/// environment starts.
pub async fn run(args: RunLocalArgs, interrupts: tokio::sync::mpsc::UnboundedReceiver<()>) -> anyhow::Result<u8> {
    let text = std::fs::read(&args.workflow).with_context(|| format!("--workflow {}", args.workflow.display()))?;
    let mut workflow = Workflow::parse(&text).with_context(|| format!("{}", args.workflow.display()))?;
    if let Some(file) = &args.env_file {
        workflow = workflow.with_base_env(&task::dotenv_file(file)?);
    }
    let filters = args
        .matrix
        .iter()
        .map(|f| f.split_once(':').map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned())).ok_or_else(|| anyhow::anyhow!("--matrix {f:?} is not KEY:VALUE")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let plan = workflow.plan(args.job.as_deref(), &filters)?;
    let root = repository::work_tree_of(&args.workflow).await;
    let repository = match (&args.repository, &root) {
        (Some(name), _) => repository::owner_and_name(name).ok_or_else(|| anyhow::anyhow!("--repository {name:?} is not OWNER/NAME"))?,
        (None, Some(root)) => repository::origin_name(root).await.unwrap_or_else(|| task::DEFAULT_REPOSITORY.to_owned()),
        (None, None) => task::DEFAULT_REPOSITORY.to_owned(),
    };

    // Every job must name a placement before anything starts.
    let first_id = now_ms().max(1);
    let probes: Vec<Task> = plan.iter().zip(first_id..).map(|(planned, id)| probe(planned, id, &repository)).collect();
    let (assignments, rules) = assignments_for(&probes, &args.platforms).map_err(|error| anyhow::anyhow!("a job cannot run: {error}"))?;
    let mut jobs: Vec<Job> = plan.into_iter().zip(assignments).map(|(planned, assignment)| Job::new(planned, assignment)).collect();
    if args.list {
        print!("{}", list(&workflow, &jobs));
        return Ok(0);
    }
    let mut inputs = read_inputs(&args, &workflow, &repository)?;
    let snapshot = match root {
        Some(root) => {
            let snapshot = repository::Snapshot::take(&root, args.commit.as_deref()).await?;
            let served = &snapshot.served;
            eprintln!(
                "run-local: serving {} as {} ({} on {})",
                root.display(),
                repository,
                if args.commit.is_some() { served.sha.clone() } else { format!("the working tree, {}", &served.sha[..12]) },
                served.branch
            );
            inputs.run.served(served);
            Some(snapshot)
        }
        None if args.commit.is_some() => anyhow::bail!("--commit: {} is not in a git repository", args.workflow.display()),
        None => {
            eprintln!("run-local: {} is not in a git repository: no repository is served to the jobs", args.workflow.display());
            None
        }
    };
    for job in jobs.iter().filter(|j| j.placement != Placement::CONTAINER_DOCKER) {
        eprintln!("run-local: job {:?} asks for {}; running it in a local Docker container instead", job.planned.name, job.placement);
    }

    let mut served: BTreeMap<String, PathBuf> = snapshot.iter().map(|s| (repository.clone(), s.git_dir().to_path_buf())).collect();
    let mut actions = Vec::new();
    for (name, refs) in action_mappings(&args.actions)? {
        let action = repository::Snapshot::of_directories(&refs).await.with_context(|| format!("--action {name}"))?;
        if served.insert(name.clone(), action.git_dir().to_path_buf()).is_some() {
            anyhow::bail!("--action {name}: {name} is the repository the jobs run for (--repository)");
        }
        for (git_ref, dir) in &refs {
            eprintln!("run-local: serving {} as the action {name}@{git_ref}", dir.display());
        }
        actions.push(action);
    }
    // Unmapped actions are sent on to the actions URL.
    let elsewhere = (!actions.is_empty()).then(|| args.actions_url.clone());
    let planner =
        Planner { workflow: &workflow, filters: &filters, rules: rules.clone(), repository: repository.clone(), next_id: first_id + jobs.len() as i64 };
    let pipeline = LocalPipeline::start(&args, &jobs, rules, served, elsewhere).await?;
    inputs.run.actions_url = match (&pipeline.served_url, actions.is_empty()) {
        (Some(url), false) => url.clone(),
        _ => args.actions_url.clone(),
    };
    let prefixed = jobs.len() > 1 || jobs.iter().any(|j| j.planned.deferred);
    let outcome = schedule(&pipeline, &mut jobs, planner, &inputs, args.parallel.max(1), prefixed, interrupts).await;
    pipeline.stop(&jobs).await;
    let code = match outcome {
        Some(()) => {
            summary(&jobs);
            exit_code(run_result(&jobs))
        }
        None => crate::exit::CANCELLED,
    };
    Ok(code)
}

fn read_inputs(args: &RunLocalArgs, workflow: &Workflow, repository: &str) -> anyhow::Result<Inputs> {
    let mut secrets = match &args.secret_file {
        Some(file) => task::dotenv_file(file)?,
        None => BTreeMap::new(),
    };
    secrets.extend(task::secrets_from_files(&args.secrets.iter().map(|s| s.replacen("=@", "=", 1)).collect::<Vec<_>>())?);
    let mut vars = match &args.var_file {
        Some(file) => task::dotenv_file(file)?,
        None => BTreeMap::new(),
    };
    vars.extend(task::vars(&args.vars)?);
    let event_name = args.event.clone().or_else(|| workflow.first_event()).unwrap_or_else(|| "push".to_owned());
    let mut event = match &args.event_file {
        Some(file) => {
            let text = std::fs::read(file).with_context(|| format!("--event-file {}", file.display()))?;
            match serde_json::from_slice(&text).with_context(|| format!("--event-file {}: not JSON", file.display()))? {
                serde_json::Value::Object(payload) => payload,
                _ => anyhow::bail!("--event-file {}: the payload must be a JSON object", file.display()),
            }
        }
        None => serde_json::Map::new(),
    };
    let given = task::vars(&args.inputs)?;
    if event_name == "workflow_dispatch" {
        event = task::with_inputs(event, &workflow.dispatch_inputs(), &given)?;
    } else if !given.is_empty() {
        anyhow::bail!("--input is for the workflow_dispatch event; this run's event is {event_name:?} (choose it with --event workflow_dispatch)");
    }
    let run = task::RunContext { repository: repository.to_owned(), event_name, event, run_id: now_ms().max(1), ..task::RunContext::default() };
    Ok(Inputs { run, secrets, vars })
}

/// `--action OWNER/NAME@REF=DIR` mappings grouped by action: OWNER/NAME → its (REF, DIR)s
/// in the order given; one ref given twice is refused.
fn action_mappings(mappings: &[String]) -> anyhow::Result<BTreeMap<String, Vec<(String, PathBuf)>>> {
    let mut actions: BTreeMap<String, Vec<(String, PathBuf)>> = BTreeMap::new();
    for mapping in mappings {
        let (name, git_ref, dir) = action_mapping(mapping)?;
        let refs = actions.entry(name.clone()).or_default();
        if let Some((_, other)) = refs.iter().find(|(r, _)| *r == git_ref) {
            anyhow::bail!("--action {mapping}: {name}@{git_ref} is served from {} already", other.display());
        }
        refs.push((git_ref, dir));
    }
    Ok(actions)
}

/// `OWNER/NAME@REF=DIR` → (OWNER/NAME, REF, DIR).
fn action_mapping(mapping: &str) -> anyhow::Result<(String, String, PathBuf)> {
    let usage = || anyhow::anyhow!("--action {mapping:?} is not OWNER/NAME@REF=DIR");
    let (action, dir) = mapping.split_once('=').ok_or_else(usage)?;
    let (name, git_ref) = action.split_once('@').ok_or_else(usage)?;
    let parts: Vec<&str> = name.split('/').collect();
    if parts.len() != 2 || parts.iter().any(|p| p.is_empty()) || git_ref.is_empty() || dir.is_empty() {
        return Err(usage());
    }
    let dir = PathBuf::from(dir);
    if !dir.is_dir() {
        anyhow::bail!("--action {mapping}: {} is not a directory", dir.display());
    }
    Ok((name.to_owned(), git_ref.to_owned(), dir))
}

/// The controller's pipeline for the jobs of one run: the embedded store in a scratch
/// directory, the docker driver for every placement the jobs ask for, this program's
/// terminal as Gitea.
struct LocalPipeline {
    _dir: tempfile::TempDir,
    /// Where the repository and mapped actions are served (the environments' Gitea URL).
    served_url: Option<String>,
    pipeline: Pipeline,
    reports: Arc<reports::LocalReports>,
    shutdown: CancellationToken,
    tasks: tokio::task::JoinSet<anyhow::Result<()>>,
    /// Kept between runs; swept (by age and size) when a run ends.
    cache: Option<Arc<cache::Cache>>,
}

/// How much run-local's cache keeps: one developer's repositories.
const CACHE_LIMITS: cache::Limits = cache::Limits::new(20 << 30, 10 << 30, Duration::from_secs(7 * 24 * 3600));

/// The cache between runs (`--cache-dir`, by default under ~/.cache), unless `--no-cache`.
fn open_cache(args: &RunLocalArgs) -> anyhow::Result<Option<Arc<cache::Cache>>> {
    if args.no_cache {
        return Ok(None);
    }
    let dir = match &args.cache_dir {
        Some(dir) => dir.clone(),
        None => {
            let home = std::env::var_os("HOME").map(PathBuf::from).ok_or_else(|| anyhow::anyhow!("HOME is not set: pass --cache-dir DIR or --no-cache"))?;
            home.join(".cache/gitea-dynamic-runner/run-local-cache")
        }
    };
    let store = cache::backend::directory(&dir).with_context(|| format!("--cache-dir {}", dir.display()))?;
    Ok(Some(Arc::new(cache::Cache::new(store, CACHE_LIMITS, Arc::new(cache::CacheMetrics::default())))))
}

impl LocalPipeline {
    async fn start(args: &RunLocalArgs, jobs: &[Job], rules: Rules, served: BTreeMap<String, PathBuf>, elsewhere: Option<String>) -> anyhow::Result<Self> {
        let placements_used: Vec<Placement> = jobs.iter().map(|j| j.placement).collect::<BTreeSet<_>>().into_iter().collect();
        let dir = tempfile::Builder::new().prefix("gdr-run-local-").tempdir_in("/tmp").context("a scratch directory under /tmp")?;
        let mut docker = if args.privileged { DockerConfig::privileged(&args.image) } else { DockerConfig::unprivileged_loop_capable(&args.image) };
        docker.socket = args.docker_socket.clone();
        let docker =
            DockerDriver::connect(docker).await.with_context(|| format!("the Docker host at {} (start one, or pass --docker-socket)", args.docker_socket))?;
        let shutdown = CancellationToken::new();
        let mut tasks = tokio::task::JoinSet::new();
        // Where the jobs' Gitea would be: the repository, reached through the supervisor's
        // pass-through on the host's address in the environments' network.
        let gitea_url = if served.is_empty() {
            None
        } else {
            let host = docker.host_address().await.context("the address of this host in the environments' network")?;
            let (address, server) = repository::serve(std::net::SocketAddr::new(host, 0), served, elsewhere, shutdown.clone()).await?;
            tasks.spawn(async move { server.await.context("the repository server") });
            Some(format!("http://{address}"))
        };
        let mut placements = Placements::new();
        for placement in &placements_used {
            placements.add(*placement, args.parallel.max(1), Some(Arc::new(docker.clone().for_placement(*placement)) as Arc<dyn Driver>));
        }
        let store: Arc<dyn Store> = Arc::new(Embedded::open(&dir.path().join("store.redb"))?);
        let reports = Arc::new(reports::LocalReports::new(Box::new(std::io::stdout())));
        let registrations = Registrations::local(Arc::clone(&reports) as Arc<dyn controller::gitea::TaskReports>);
        let key = Arc::new(CapabilityKey::random().map_err(|_| anyhow::anyhow!("the system offers no randomness for the capability key"))?);
        let settings = EnvironmentSettings {
            instance: LOCAL_INSTANCE.to_owned(),
            capability_ttl: Duration::from_secs(24 * 3600),
            socket_dir: Some(dir.path().join("environments")),
            socket_placements: placements_used.clone(),
            gitea_url: gitea_url.clone(),
            ..EnvironmentSettings::default()
        };
        let cache = open_cache(args)?;
        let pipeline = Pipeline::builder(store, registrations, rules, key, placements)
            .cache(cache.clone())
            .environments(settings)
            .with_sockets(true)
            .sweep_interval(Duration::from_secs(2))
            .retire_grace(Duration::from_secs(10))
            .build()
            .context("the facade sockets' directory")?;
        for served in pipeline.placements().iter() {
            let Some(driver) = served.driver() else { continue };
            let (worker, shutdown) = (Arc::new(pipeline.worker(served, driver)), shutdown.clone());
            tasks.spawn(async move { worker.run(shutdown).await.map_err(anyhow::Error::from) });
        }
        if let Some(serving) = pipeline.serve_sockets(shutdown.clone()) {
            tasks.spawn(async move { serving.await.map_err(anyhow::Error::from) });
        }
        Ok(LocalPipeline { _dir: dir, served_url: gitea_url, pipeline, reports, shutdown, tasks, cache })
    }

    /// Hands `task` to the worker, as a fetched task is.
    async fn submit(&self, job: &Job, task: Task, prefix: String) -> anyhow::Result<(Assignment, watch::Receiver<Option<reports::Ended>>)> {
        let ended = self.reports.register(job.task_id, prefix, &job.planned.needs);
        let assignment = self.pipeline.submit(task, reports::RUNNER).await?;
        eprintln!("run-local: job {:?} as {} in {}", job.planned.name, assignment.id, self.pipeline.environment_name(&assignment.id));
        Ok((assignment, ended))
    }

    /// Ends a job nobody will report on any more: not claimed yet (Ctrl-C), or its
    /// environment removed (second Ctrl-C).
    async fn give_up(&self, job: &Job, remove: bool) {
        let (JobState::Running, Some(assignment)) = (&job.state, &job.assignment) else { return };
        if remove {
            let _ = self.pipeline.remove(assignment).await;
        } else if !self.pipeline.unclaimed(&assignment.id).await {
            return;
        }
        let _ = self.pipeline.lifecycle().finish(&assignment.id, TaskResult::Cancelled as i32).await;
        self.reports.end(job.task_id, TaskResult::Cancelled);
    }

    /// Lets every started environment end and be removed, then stops the pipeline.
    async fn stop(self, jobs: &[Job]) {
        let retiring = jobs.iter().filter_map(|job| job.assignment.as_ref()).map(|assignment| self.pipeline.retire(assignment, Duration::from_secs(15)));
        futures_util::future::join_all(retiring).await;
        self.shutdown.cancel();
        let mut tasks = self.tasks;
        while tasks.join_next().await.is_some() {}
        self.pipeline.lifecycle().drain(Duration::from_secs(10)).await;
        if let Some(cache) = &self.cache
            && let Err(error) = cache.sweep().await
        {
            eprintln!("run-local: the cache could not be swept: {}", controller::error_chain(&error));
        }
    }
}

/// Starts every job whose needs are done, up to `parallel` at once, until all ended.
/// The first interrupt cancels the run (jobs not started are cancelled, running ones
/// told); a second gives up at once (`None`).
async fn schedule(
    pipeline: &LocalPipeline,
    jobs: &mut Vec<Job>,
    mut planner: Planner<'_>,
    inputs: &Inputs,
    parallel: usize,
    prefixed: bool,
    mut interrupts: tokio::sync::mpsc::UnboundedReceiver<()>,
) -> Option<()> {
    // Jobs are told apart by task id: expanding a matrix moves the jobs after it.
    let (ended_tx, mut ended_rx) = tokio::sync::mpsc::unbounded_channel::<(i64, reports::Ended)>();
    let mut watchers = tokio::task::JoinSet::new();
    let mut cancelled = false;
    loop {
        if !cancelled {
            planner.expand_ready(jobs, inputs);
        }
        for index in 0..jobs.len() {
            if !matches!(jobs[index].state, JobState::Waiting) {
                continue;
            }
            if cancelled {
                jobs[index].state = JobState::Done(reports::Ended { result: TaskResult::Cancelled as i32, ..Default::default() });
                continue;
            }
            let Some(needs) = needs_of(jobs, index) else { continue };
            let running = jobs.iter().filter(|j| matches!(j.state, JobState::Running)).count();
            if !jobs[index].runs_after(&needs) {
                eprintln!("run-local: job {:?} skipped: a job it needs did not succeed", jobs[index].planned.name);
                jobs[index].state = JobState::Done(reports::Ended { result: TaskResult::Skipped as i32, ..Default::default() });
                continue;
            }
            if running >= parallel {
                continue;
            }
            let job = &jobs[index];
            let context = task::context(&inputs.run, &job.planned.key);
            let token = match controller::assignment::capability::random_token() {
                Ok(token) => token,
                Err(_) => {
                    eprintln!("run-local: the system offers no randomness for the job token");
                    return None;
                }
            };
            let task = task::task(job.task_id, job.planned.payload.clone(), context, needs, inputs.secrets.clone(), inputs.vars.clone(), &token);
            let prefix = if prefixed { format!("[{}] ", job.planned.name) } else { String::new() };
            match pipeline.submit(job, task, prefix).await {
                Ok((assignment, mut ended)) => {
                    let (sender, task_id) = (ended_tx.clone(), job.task_id);
                    watchers.spawn(async move {
                        if let Ok(done) = ended.wait_for(Option::is_some).await
                            && let Some(done) = done.clone()
                        {
                            let _ = sender.send((task_id, done));
                        }
                    });
                    jobs[index].state = JobState::Running;
                    jobs[index].assignment = Some(assignment);
                }
                Err(error) => {
                    eprintln!("run-local: job {:?} could not start: {error:#}", job.planned.name);
                    jobs[index].state = JobState::Done(reports::Ended { result: TaskResult::Failure as i32, ..Default::default() });
                }
            }
        }
        if jobs.iter().all(|j| matches!(j.state, JobState::Done(_))) {
            watchers.abort_all();
            while watchers.join_next().await.is_some() {}
            return Some(());
        }
        tokio::select! {
            Some((task_id, ended)) = ended_rx.recv() => {
                if let Some(job) = jobs.iter_mut().find(|j| j.task_id == task_id) {
                    job.state = JobState::Done(ended);
                }
            }
            Some(()) = interrupts.recv() => {
                if cancelled {
                    eprintln!("run-local: removing the environments");
                    for job in jobs.iter() {
                        pipeline.give_up(job, true).await;
                    }
                    watchers.abort_all();
                    while watchers.join_next().await.is_some() {}
                    return None;
                }
                cancelled = true;
                eprintln!("run-local: cancelling the run (Ctrl-C again to remove its environments now)");
                pipeline.reports.cancel();
                for job in jobs.iter() {
                    pipeline.give_up(job, false).await;
                }
            }
        }
    }
}

/// The needs of `jobs[index]` once every job it needs has ended, as Gitea hands them
/// to the runner; a need left out of the run (`--job`, matrix filters) counts as a
/// success without outputs.
fn needs_of(jobs: &[Job], index: usize) -> Option<BTreeMap<String, TaskNeed>> {
    let mut needs = BTreeMap::new();
    for need in &jobs[index].planned.needs {
        let of_need: Vec<&Job> = jobs.iter().filter(|j| &j.planned.key == need).collect();
        if of_need.iter().any(|j| j.ended().is_none()) {
            return None;
        }
        let empty = BTreeMap::new();
        let ended = of_need.iter().filter_map(|j| j.ended()).map(|e| (e.result, &e.outputs));
        let aggregated = if of_need.is_empty() { task::need_of([(TaskResult::Success as i32, &empty)]) } else { task::need_of(ended) };
        needs.insert(need.clone(), aggregated);
    }
    Some(needs)
}

/// `--list`: each job with what it needs, its matrix size and its placement.
fn list(workflow: &Workflow, jobs: &[Job]) -> String {
    let mut rows = vec![["JOB".to_owned(), "NEEDS".to_owned(), "MATRIX".to_owned(), "PLACEMENT".to_owned(), "RUNS-ON".to_owned()]];
    for spec in workflow.jobs() {
        let planned: Vec<&Job> = jobs.iter().filter(|j| j.planned.key == spec.key).collect();
        let Some(first) = planned.first() else { continue };
        let needs = if spec.needs.is_empty() { "-".to_owned() } else { spec.needs.join(",") };
        // A matrix given by an expression is known once the jobs it needs ended.
        let size = if first.planned.deferred { "needs".to_owned() } else { planned.len().to_string() };
        rows.push([spec.key.clone(), needs, size, first.placement.to_string(), first.runs_on.join(",")]);
    }
    let widths: Vec<usize> = (0..5).map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row.iter().zip(&widths).map(|(cell, width)| format!("{cell:<width$}")).collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}
fn exit_code(result: i32) -> u8 {
    match TaskResult::try_from(result) {
        Ok(TaskResult::Success | TaskResult::Skipped) => 0,
        Ok(TaskResult::Cancelled) => crate::exit::CANCELLED,
        _ => crate::exit::JOB_FAILED,
    }
}

/// One line per job with its result, its steps under it.
fn summary(jobs: &[Job]) {
    eprintln!("run-local: ── summary ──");
    for job in jobs {
        let Some(ended) = job.ended() else { continue };
        eprintln!("run-local: {:<10} {}", task::result_word(ended.result), job.planned.name);
        let names = step_names(&job.planned.payload);
        for step in &ended.steps {
            let name = usize::try_from(step.id).ok().and_then(|i| names.get(i)).cloned().unwrap_or_else(|| format!("step {}", step.id));
            let name = workflow::fill_matrix(&name, &job.planned.combination);
            eprintln!("run-local:   {:<10} {name}", task::result_word(step.result));
        }
    }
    eprintln!("run-local: {} {}", if jobs.len() == 1 { "job" } else { "run" }, task::result_word(run_result(jobs)));
}

/// The run's result as Gitea sums up its jobs.
fn run_result(jobs: &[Job]) -> i32 {
    let no_outputs = BTreeMap::new();
    task::need_of(jobs.iter().filter_map(|j| j.ended().map(|e| (e.result, &no_outputs)))).result
}

/// The job's step names as the workflow writes them (`name`, else `run`/`uses`).
fn step_names(payload: &[u8]) -> Vec<String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The project's own workflows (`.gitea/workflows/`) and the examples, as run-local reads
    /// them: every job parses into a task and its `runs-on` names a placement (run-local
    /// refuses one that does not before any environment starts).
    #[test]
    fn the_projects_own_workflows_parse_and_name_a_placement() {
        use crate::{
            task::{self, RunContext},
            workflow::Workflow,
        };
        let repository = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let mut seen = Vec::new();
        for dir in [".gitea/workflows", "examples"] {
            for entry in std::fs::read_dir(repository.join(dir)).unwrap() {
                let path = entry.unwrap().path();
                let text = std::fs::read(&path).unwrap();
                let plan = Workflow::parse(&text).and_then(|w| w.plan(None, &[])).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                let tasks: Vec<_> = (1..)
                    .zip(&plan)
                    .map(|(id, job)| {
                        let context = task::context(&RunContext::default(), &job.key);
                        task::task(id, job.payload.clone(), context, Default::default(), Default::default(), Default::default(), "job-token")
                    })
                    .collect();
                let (assignments, _) = assignments_for(&tasks, &[]).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                for (job, assignment) in plan.iter().zip(assignments) {
                    seen.push(format!("{}: {} → {}", path.strip_prefix(repository).unwrap().display(), job.name, assignment.placement));
                }
            }
        }
        seen.sort();
        println!("{}", seen.join("\n"));
        for expected in [
            ".gitea/workflows/ci.yml: test",
            ".gitea/workflows/release.yml: images",
            ".gitea/workflows/release.yml: smoke",
            "examples/hello.yml: hello",
            "examples/pipeline.yml: build (amd64)",
        ] {
            assert!(seen.iter().any(|s| s.starts_with(expected)), "{expected} missing from {seen:?}");
        }
    }
}
