//! The host of one run: the controller's pipeline started with the embedded store in a
//! scratch directory, the docker driver for every placement the jobs ask for, this
//! program's terminal as Gitea, the repository server where the jobs' Gitea would be,
//! and the cache kept between runs.
//!
//! No Gitea is involved: [`crate::repository`] serves a snapshot of the local
//! repository (and mapped actions) where the jobs' Gitea would be, so checkouts and
//! `uses:` work; other Gitea routes (artifacts, API calls) get an answer saying there
//! is no Gitea.

use std::{collections::BTreeSet, path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context;
use proto::runner::v1::{Result as TaskResult, Task};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use controller::{
    assignment::{Assignment, Placement, Rules, capability::CapabilityKey},
    driver::{
        Driver,
        docker::{DockerConfig, DockerDriver},
    },
    gitea::registrations::Registrations,
    pipeline::{Cancel, Pipeline, Running},
    placements::Placements,
    store::{Store, embedded::Embedded},
    worker::EnvironmentSettings,
};

use crate::{
    cli::RunLocalArgs,
    inputs::Served,
    planning::{Job, JobState},
    reports, repository,
};

/// The installation name of local runs.
const LOCAL_INSTANCE: &str = "local";

/// How long components may take to stop once the run ended.
const DRAIN_DEADLINE: Duration = Duration::from_secs(10);

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

/// The controller's pipeline for the jobs of one run, running.
#[derive(Debug)]
pub struct Host {
    _dir: tempfile::TempDir,
    /// Where the repository and mapped actions are served (the environments' Gitea URL).
    pub served_url: Option<String>,
    running: Running,
    pub reports: Arc<reports::LocalReports>,
    /// Kept between runs; swept (by age and size) when a run ends.
    cache: Option<Arc<cache::Cache>>,
}

impl Host {
    /// Connects to the Docker host and starts the pipeline for the placements `jobs` ask
    /// for (all of them run in local Docker containers).
    ///
    /// # Errors
    /// When the Docker host, the scratch directory, the store or the cache cannot be used.
    pub async fn start(args: &RunLocalArgs, jobs: &[Job], rules: Rules, served: &Served) -> anyhow::Result<Self> {
        for job in jobs.iter().filter(|j| j.placement != Placement::CONTAINER_DOCKER) {
            eprintln!("run-local: job {:?} asks for {}; running it in a local Docker container instead", job.planned.name, job.placement);
        }
        let placements_used: Vec<Placement> = jobs.iter().map(|j| j.placement).collect::<BTreeSet<_>>().into_iter().collect();
        let dir = tempfile::Builder::new().prefix("gdr-run-local-").tempdir_in("/tmp").context("a scratch directory under /tmp")?;
        let mut docker = if args.privileged { DockerConfig::privileged(&args.image) } else { DockerConfig::unprivileged_loop_capable(&args.image) };
        docker.socket = args.docker_socket.clone();
        let docker =
            DockerDriver::connect(docker).await.with_context(|| format!("the Docker host at {} (start one, or pass --docker-socket)", args.docker_socket))?;
        let shutdown = CancellationToken::new();
        // Where the jobs' Gitea would be: the repository, reached through the supervisor's
        // pass-through on the host's address in the environments' network.
        let repository_server = if served.git_dirs.is_empty() {
            None
        } else {
            let host = docker.host_address().await.context("the address of this host in the environments' network")?;
            Some(repository::serve(std::net::SocketAddr::new(host, 0), served.git_dirs.clone(), served.elsewhere.clone(), shutdown.clone()).await?)
        };
        let gitea_url = repository_server.as_ref().map(|(address, _)| format!("http://{address}"));
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
            socket_placements: placements_used,
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
        let mut running = pipeline.start(None, shutdown);
        if let Some((_, server)) = repository_server {
            running.spawn("the repository server", server);
        }
        Ok(Host { _dir: dir, served_url: gitea_url, running, reports, cache })
    }

    /// Hands `task` to the worker, as a fetched task is; the receiver resolves once the
    /// job ended.
    ///
    /// # Errors
    /// When the pipeline refuses the task.
    pub async fn submit(&self, job: &Job, task: Task, prefix: String) -> anyhow::Result<(Assignment, watch::Receiver<Option<reports::Ended>>)> {
        let ended = self.reports.register(job.task_id, prefix, &job.planned.needs);
        let assignment = self.running.submit(task, reports::RUNNER).await?;
        eprintln!("run-local: job {:?} as {} in {}", job.planned.name, assignment.id, self.running.pipeline().environment_name(&assignment.id));
        Ok((assignment, ended))
    }

    /// Ends a running job nobody will report on any more: not claimed yet (Ctrl-C), or
    /// its environment removed (second Ctrl-C).
    pub async fn give_up(&self, job: &Job, how: Cancel) {
        let JobState::Running(assignment) = &job.state else { return };
        if self.running.cancel(assignment, how).await {
            self.reports.end(job.task_id, TaskResult::Cancelled);
        }
    }

    /// Lets every started environment end and be removed, then stops the pipeline.
    pub async fn stop(self, jobs: &[Job]) {
        let pipeline = self.running.pipeline();
        let retiring = jobs.iter().filter_map(Job::assignment).map(|assignment| pipeline.retire(assignment, Duration::from_secs(15)));
        futures_util::future::join_all(retiring).await;
        if let Err(error) = self.running.drain(DRAIN_DEADLINE).await {
            eprintln!("run-local: {error:#}");
        }
        if let Some(cache) = &self.cache
            && let Err(error) = cache.sweep().await
        {
            eprintln!("run-local: the cache could not be swept: {}", controller::error_chain(&error));
        }
    }
}
