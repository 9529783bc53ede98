//! `controller run`: the components of one controller process, wired together.
//!
//! `--components` selects them (default: all): `scheduler` (registration, FetchTask
//! loops, keep-alive), `facade` (the environments' only path to Gitea), `worker` (one
//! per configured placement), `worker:<placement>`, and the previous implementation's
//! aliases `pod-worker` (container.kubernetes) and `vm-worker` (vm.opensandbox).
//! Records live in the store, so the components may run in separate processes.

use std::{collections::BTreeMap, convert::Infallible, sync::Arc, time::Duration};

use anyhow::{Context, bail};
use tokio_util::sync::CancellationToken;

use crate::{
    assignment::{Placement, capability::CapabilityKey},
    config::{Config, StoreConfig},
    driver::Driver,
    facade,
    gitea::registrations::{RegistrationSettings, Registrations},
    metrics::{Metrics, PlacementLabel},
    pipeline::{Connect, Pipeline, Running},
    placements::Placements,
    scheduler::{Scheduler, SchedulerConfig, keepalive::KeepAlive},
    store::{Store, embedded::Embedded, jetstream::JetStream},
    worker::EnvironmentSettings,
};

/// Which components this process runs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Components {
    pub scheduler: bool,
    pub facade: bool,
    /// Placements whose worker runs here.
    pub workers: Vec<Placement>,
    all_workers: bool,
}

impl Components {
    /// Parses `scheduler,facade,worker,worker:container.docker,pod-worker,vm-worker`.
    ///
    /// # Errors
    /// An unknown component, named.
    pub fn parse(text: &str) -> Result<Components, String> {
        let mut components = Components::default();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match item {
                "scheduler" => components.scheduler = true,
                "facade" => components.facade = true,
                "worker" => components.all_workers = true,
                "pod-worker" => components.workers.push(Placement::CONTAINER_KUBERNETES),
                "vm-worker" => components.workers.push(Placement::VM_OPENSANDBOX),
                other => match other.strip_prefix("worker:").map(str::parse::<Placement>) {
                    Some(Ok(placement)) => components.workers.push(placement),
                    Some(Err(error)) => return Err(format!("--components: {other:?}: {error}")),
                    None => {
                        return Err(format!(
                            "--components: unknown component {other:?}; use scheduler, facade, worker, worker:<placement>, pod-worker or vm-worker"
                        ));
                    }
                },
            }
        }
        Ok(components)
    }

    pub fn all() -> Components {
        Components { scheduler: true, facade: true, workers: Vec::new(), all_workers: true }
    }

    fn worker_for(&self, placement: Placement) -> bool {
        self.all_workers || self.workers.contains(&placement)
    }
}

/// The driver of a placement, if its section is configured: docker for container.docker,
/// opensandbox for vm.opensandbox, kubernetes for container.kubernetes; in `test-driver` builds
/// the directory driver when GDR_TEST_DRIVER_DIR is set.
async fn driver_for(placement: Placement, config: &Config) -> anyhow::Result<Option<Arc<dyn Driver>>> {
    #[cfg(feature = "test-driver")]
    if let Ok(dir) = std::env::var("GDR_TEST_DRIVER_DIR") {
        return Ok(Some(Arc::new(crate::driver::directory::DirectoryDriver { placement, dir: dir.into() })));
    }
    if placement == Placement::CONTAINER_DOCKER
        && let Some(docker) = &config.docker
    {
        let driver = crate::driver::docker::DockerDriver::connect(docker.clone()).await.context("docker")?;
        return Ok(Some(Arc::new(driver)));
    }
    if placement == Placement::VM_OPENSANDBOX
        && let Some(opensandbox) = &config.opensandbox
    {
        let driver = crate::driver::opensandbox::OpenSandboxDriver::connect(opensandbox.clone()).await.context("opensandbox")?;
        return Ok(Some(with_spire(Arc::new(driver), opensandbox.spire.as_ref(), config)));
    }
    if placement == Placement::CONTAINER_KUBERNETES
        && let Some(kubernetes) = &config.kubernetes
    {
        let driver = crate::driver::kubernetes::KubernetesDriver::connect(kubernetes.clone()).await.context("kubernetes")?;
        return Ok(Some(with_spire(Arc::new(driver), kubernetes.spire.as_ref(), config)));
    }
    Ok(None)
}

/// Connects a placement's driver that did not answer at start, with a growing pause
/// (at most a minute); `None` at shutdown.
async fn connect_until_up(placement: Placement, config: &Config, shutdown: &CancellationToken) -> Option<Arc<dyn Driver>> {
    let mut backoff = contract::backoff::Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return None,
            () = tokio::time::sleep(backoff.next_delay()) => {}
        }
        match driver_for(placement, config).await {
            Ok(Some(driver)) => {
                tracing::info!(%placement, "the placement's backend answers: its jobs are fetched now");
                return Some(driver);
            }
            Ok(None) => return None,
            Err(error) => tracing::warn!(%placement, error = %format!("{error:#}"), "the placement's backend still does not answer"),
        }
    }
}

/// `driver`, making one SPIRE entry per environment when its section configures it.
fn with_spire(driver: Arc<dyn Driver>, spire: Option<&crate::driver::spire::SpireConfig>, config: &Config) -> Arc<dyn Driver> {
    match spire {
        Some(spire) => {
            let registrar = crate::driver::spire::Registrar::new(spire.clone(), driver.placement(), &config.installation());
            Arc::new(crate::driver::spire::Registered::new(driver, registrar))
        }
        None => driver,
    }
}

/// How this controller registers with Gitea.
pub fn registration_settings(config: &Config) -> RegistrationSettings {
    RegistrationSettings {
        url: config.gitea.url.clone(),
        credential_dir: config.gitea.credential_dir.clone(),
        registration_token_file: config.gitea.registration_token_file.clone(),
        runner_name: config.gitea.runner_name.clone(),
        labels: config.label_policy(),
    }
}

/// `controller register`: registers (or loads) and Declares every placement's runner,
/// then exits — run once before starting several replicas, so that they share one
/// runner per placement.
///
/// # Errors
/// The registration that failed.
pub async fn register(config: &Config) -> anyhow::Result<()> {
    let placements: Vec<Placement> = config.pools.iter().map(|p| p.placement).collect();
    let settings = registration_settings(config);
    Registrations::open(&settings, &placements).await?;
    for placement in placements {
        println!("{placement}: {}", settings.credential_file(placement).display());
    }
    Ok(())
}

/// The configured store.
///
/// # Errors
/// When it cannot be opened or reached.
pub async fn open_store(config: &Config) -> anyhow::Result<Arc<dyn Store>> {
    Ok(match &config.store {
        StoreConfig::Embedded { path, .. } => Arc::new(Embedded::open(path).with_context(|| format!("store.path {}", path.display()))?),
        StoreConfig::Jetstream { url, subject, bucket, ack_wait, replicas, retention, credentials_file, token_file } => {
            let settings = crate::store::jetstream::Settings {
                url: url.clone(),
                subject: subject.clone(),
                bucket: bucket.clone(),
                ack_wait: *ack_wait,
                replicas: *replicas,
                retention: *retention,
                credentials_file: credentials_file.clone(),
                token_file: token_file.clone(),
            };
            Arc::new(JetStream::connect_with(&settings).await.with_context(|| format!("store.url {}", crate::store::jetstream::redact_url(url)))?)
        }
    })
}

/// The jobs' cache where `[cache]` gives it a place; `None` when it is off (said once,
/// with what to set, where it is off only for want of a place).
///
/// # Errors
/// When its storage cannot be opened or its credential files read.
pub fn open_cache(config: &Config, metrics: &Metrics) -> anyhow::Result<Option<Arc<::cache::Cache>>> {
    let backend = match config.cache_storage() {
        None if config.cache.enabled => {
            tracing::warn!(
                "the jobs' cache is off: set cache.dir (a directory of this host, best on a filesystem apart from the store's; one all controllers \
                 see with JetStream) or [cache.s3] (a bucket the controllers share); set cache.enabled = false to say it is meant"
            );
            return Ok(None);
        }
        None => return Ok(None),
        Some(crate::config::CacheStorage::Directory(dir)) => {
            let backend = ::cache::backend::directory(&dir).context("cache.dir")?;
            warn_if_beside_the_store(&dir, config.store_dir());
            backend
        }
        Some(crate::config::CacheStorage::S3(s3)) => {
            let read = |setting: &str, path: &std::path::Path| {
                std::fs::read_to_string(path).map(|text| text.trim().to_owned()).with_context(|| format!("{setting}: cannot read {}", path.display()))
            };
            let settings = ::cache::backend::S3 {
                bucket: s3.bucket.clone(),
                endpoint: s3.endpoint.clone(),
                region: s3.region.clone(),
                prefix: s3.prefix.clone(),
                access_key_id: read("cache.s3.access_key_id_file", &s3.access_key_id_file)?,
                secret_access_key: read("cache.s3.secret_access_key_file", &s3.secret_access_key_file)?,
                path_style: s3.path_style,
            };
            ::cache::backend::s3(&settings).context("cache.s3")?
        }
    };
    let limits = config.cache.limits();
    let io = ::cache::Io::new(CACHE_IO_THREADS).context("cannot start the cache's I/O threads")?;
    tracing::info!(
        storage = ?config.cache_storage(),
        max_size = limits.max_total,
        max_repository_size = limits.max_repository,
        max_uploading = limits.max_uploading,
        keep_free = %config.cache.keep_free,
        max_age = ?limits.max_age,
        "the jobs' cache is on"
    );
    let cache = ::cache::Cache::new(backend, limits, Arc::clone(&metrics.cache)).with_io(io).keep_free(config.cache.keep_free());
    Ok(Some(Arc::new(cache)))
}

/// The cache's blocking file I/O at once: its own, never the threads the store's writes
/// need.
const CACHE_IO_THREADS: usize = 16;

/// Says so where the cache's directory shares the embedded store's filesystem: what
/// cache.keep_free then protects is the store's room too.
fn warn_if_beside_the_store(cache_dir: &std::path::Path, store_dir: Option<&std::path::Path>) {
    use std::os::unix::fs::MetadataExt as _;
    let Some(store_dir) = store_dir else { return };
    let device = |path: &std::path::Path| std::fs::metadata(path).map(|metadata| metadata.dev()).ok();
    if let (Some(cache), Some(store)) = (device(cache_dir), device(store_dir))
        && cache == store
    {
        tracing::warn!(
            cache_dir = %cache_dir.display(),
            store_dir = %store_dir.display(),
            "the jobs' cache shares the store's filesystem: saves stop at cache.keep_free of free space, which is all that keeps the store room to write; \
             a filesystem of its own is safer"
        );
    }
}

/// Runs until `shutdown`, then joins every component (bounded by 30 s).
///
/// # Errors
/// Start-up failures (store, Gitea, configuration) and final component errors.
pub async fn run(config: Config, components: Components, shutdown: CancellationToken) -> anyhow::Result<()> {
    run_with(config, components, Overrides::default(), shutdown).await
}

/// What a caller (a test) supplies instead of what the configuration would make.
#[derive(Debug, Default)]
pub struct Overrides {
    /// Drivers to use instead of the configured ones.
    pub drivers: BTreeMap<Placement, Arc<dyn Driver>>,
    /// The store to use instead of opening the configured one (so the caller can watch
    /// the records).
    pub store: Option<Arc<dyn Store>>,
}

/// [`run`] with some parts supplied by the caller.
///
/// # Errors
/// Start-up failures (store, Gitea, configuration) and final component errors.
pub async fn run_with(config: Config, components: Components, overrides: Overrides, shutdown: CancellationToken) -> anyhow::Result<()> {
    let Overrides { drivers, store } = overrides;
    let metrics = Arc::new(Metrics::new());
    let wake = crate::scheduler::wake::Wake::default();
    // Health and metrics answer while the store and Gitea are still being reached; the
    // set aborts the server if the start fails.
    let mut http = tokio::task::JoinSet::new();
    http.spawn(serve_http(&config, &metrics, &wake, &shutdown).await?);
    let store = match store {
        Some(store) => store,
        None => open_store(&config).await?,
    };
    let placements = placements_with_drivers(&config, &components, drivers, &metrics).await?;
    warn_where_jobs_may_step_out(&config, &placements);
    let registrations = Registrations::open(&registration_settings(&config), &placements.enabled()).await?;
    let key = Arc::new(CapabilityKey::from_file(&config.facade.capability_key_file).context("facade.capability_key_file")?);
    let cache = if components.facade { open_cache(&config, &metrics)? } else { None };
    let pipeline = Pipeline::builder(store, registrations, config.rules(), key, placements)
        .cache(cache.clone())
        .environments(environment_settings(&config))
        .with_sockets(components.facade)
        .metrics(metrics)
        .sweep_interval(config.gitea.reconcile_interval)
        .session_ttl(config.facade.capability_ttl)
        .build()
        .context("facade.environment_socket_dir")?;
    let mut running = pipeline.start(Some(connector(&config)), shutdown.clone());
    running.spawn("http", async move {
        if let Some(joined) = http.join_next().await {
            joined??;
        }
        anyhow::Ok(())
    });
    if components.facade {
        spawn_facade(&mut running, &config).await?;
    }
    if components.scheduler {
        spawn_schedulers(&mut running, &config, &wake);
    }
    spawn_pruning(&mut running, &config);
    if let Some(cache) = cache {
        let (interval, shutdown) = (config.cache.sweep_interval, shutdown.clone());
        running.spawn("cache sweep", async move {
            cache.sweep_loop(interval, shutdown).await;
            Ok::<(), Infallible>(())
        });
    }
    spawn_gauges(&mut running);
    spawn_readiness(&mut running);
    tracing::info!(components = ?components, placements = ?running.pipeline().placements().enabled(), "controller running");
    let outcome = running.ended().await;
    let drained = running.drain(JOIN_DEADLINE).await;
    outcome.and(drained)
}

/// How long components may take to stop after the shutdown signal.
const JOIN_DEADLINE: Duration = Duration::from_secs(30);

/// Connects, for a placement whose backend did not answer at start, its driver.
fn connector(config: &Config) -> Connect {
    let config = Arc::new(config.clone());
    Arc::new(move |placement, shutdown| {
        let config = Arc::clone(&config);
        Box::pin(async move { connect_until_up(placement, &config, &shutdown).await })
    })
}

/// `http.listen`: metrics, health, readiness, and Gitea's webhook when a secret is set;
/// bound here, served by the returned future.
async fn serve_http(
    config: &Config,
    metrics: &Arc<Metrics>,
    wake: &crate::scheduler::wake::Wake,
    shutdown: &CancellationToken,
) -> anyhow::Result<impl std::future::Future<Output = std::io::Result<()>> + Send + 'static> {
    let listener = tokio::net::TcpListener::bind(&config.http.listen).await.with_context(|| format!("http.listen: cannot listen on {}", config.http.listen))?;
    let hooks = match &config.gitea.webhook_secret_file {
        Some(path) => {
            let secret = std::fs::read_to_string(path).with_context(|| format!("gitea.webhook_secret_file: cannot read {}", path.display()))?;
            let secret = secret.trim();
            anyhow::ensure!(
                secret.len() >= 16,
                "gitea.webhook_secret_file: {} holds {} characters; use at least 16 (e.g. openssl rand -hex 32), the same as the webhook's secret in Gitea",
                path.display(),
                secret.len()
            );
            tracing::info!(listen = %config.http.listen, "taking Gitea's workflow_job webhook at POST /hooks/gitea");
            Some((crate::scheduler::wake::Webhook::new(secret.as_bytes()), wake.clone()))
        }
        None => None,
    };
    let routes: Vec<Arc<dyn crate::http::Route>> = vec![Arc::new(crate::scheduler::wake::WebhookRoute::new(hooks, Arc::clone(metrics)))];
    Ok(crate::http::serve(listener, Arc::clone(metrics), routes, shutdown.clone()))
}

/// Every configured placement, with its driver where its worker runs here; a backend
/// that does not answer holds back its own placement only.
async fn placements_with_drivers(
    config: &Config,
    components: &Components,
    mut drivers: BTreeMap<Placement, Arc<dyn Driver>>,
    metrics: &Metrics,
) -> anyhow::Result<Placements> {
    let mut placements = Placements::new();
    for pool in &config.pools {
        let placement = pool.placement;
        if components.worker_for(placement) {
            let connected = match drivers.remove(&placement) {
                Some(driver) => Ok(Some(driver)),
                None => driver_for(placement, config).await,
            };
            match connected {
                Ok(Some(driver)) => {
                    placements.add(placement, pool.capacity, Some(driver));
                }
                Ok(None) => {
                    bail!("pool {placement}: no [{}] section configures its driver; add one, or leave this worker out of --components", placement.driver)
                }
                Err(error) => {
                    tracing::error!(%placement, error = %format!("{error:#}"), "cannot reach this placement's backend; its jobs wait in Gitea until it answers (retrying), the other placements run");
                    placements.add_awaiting_driver(placement, pool.capacity);
                }
            }
        } else {
            placements.add(placement, pool.capacity, None);
        }
        metrics.configured(&placement.to_string(), pool.capacity);
    }
    Ok(placements)
}

/// Where a mode lets a job step out of its environment, says so once (docs/security.md).
fn warn_where_jobs_may_step_out(config: &Config, placements: &Placements) {
    let enabled = placements.enabled();
    let notices = [
        (Placement::CONTAINER_DOCKER, config.docker.as_ref().and_then(crate::driver::docker::DockerConfig::trust_notice)),
        (Placement::CONTAINER_KUBERNETES, config.kubernetes.as_ref().and_then(crate::driver::kubernetes::KubernetesConfig::trust_notice)),
    ];
    for (_, notice) in notices.into_iter().filter(|(placement, _)| enabled.contains(placement)) {
        if let Some(notice) = notice {
            tracing::warn!("{notice}");
        }
    }
}

/// What every environment is told: where the facade and Gitea are, who it is.
fn environment_settings(config: &Config) -> EnvironmentSettings {
    EnvironmentSettings {
        facade_url: config.facade.url.clone().unwrap_or_default(),
        facade_spiffe_id: config.facade.spiffe_id.clone(),
        spiffe_endpoint_socket: config.facade.environment_spiffe_endpoint_socket.clone(),
        gitea_url: Some(config.gitea.environment_url.clone().unwrap_or_else(|| config.gitea.url.clone())),
        instance: config.installation(),
        capability_ttl: config.facade.capability_ttl,
        socket_dir: config.facade.environment_socket_dir.clone(),
        socket_placements: crate::facade::sockets::PLACEMENTS.to_vec(),
    }
}

/// The facade on each configured transport besides the environments' own sockets
/// (which the pipeline serves): the development-mode TCP listener, the mTLS listener.
async fn spawn_facade(running: &mut Running, config: &Config) -> anyhow::Result<()> {
    let (facade, shutdown) = (Arc::clone(running.pipeline().facade()), running.shutdown().clone());
    if let Some(listen) = config.facade.insecure_listen.clone() {
        let listener = tokio::net::TcpListener::bind(&listen).await.with_context(|| format!("facade.insecure_listen {listen}"))?;
        tracing::warn!(%listen, "facade development mode: plain HTTP/2 on a private address, authenticated by the capability alone");
        running.spawn("facade", facade::serve_insecure_tcp(Arc::clone(&facade), listener, shutdown.clone()));
    }
    if let (Some(listen), Some(endpoint)) = (config.facade.listen.clone(), config.facade.spiffe_endpoint_socket.clone()) {
        let source = spiffe::X509Source::builder().endpoint(&endpoint).build().await.with_context(|| format!("facade.spiffe_endpoint_socket {endpoint}"))?;
        let tls = facade::mtls_server_config(source, &config.identity.trust_domain)?;
        let listener = tokio::net::TcpListener::bind(&listen).await.with_context(|| format!("facade.listen {listen}"))?;
        running.spawn("facade", facade::serve_mtls(facade, listener, tls, shutdown));
    }
    Ok(())
}

/// The FetchTask loops of every enabled placement, and the keep-alive of the
/// assignments nobody reports on yet.
fn spawn_schedulers(running: &mut Running, config: &Config, wake: &crate::scheduler::wake::Wake) {
    let pipeline = running.pipeline();
    let scheduler_config = SchedulerConfig {
        rules: pipeline.rules().clone(),
        fetch_interval: config.gitea.fetch_interval,
        fetch_interval_max: config.gitea.fetch_interval_max,
        fetch_timeout: config.gitea.fetch_timeout,
        max_loops: 8,
    };
    let mut schedulers = Vec::new();
    for placement in pipeline.placements().enabled() {
        let Some(gitea) = pipeline.registrations().fetcher(placement).cloned() else { continue };
        schedulers.push(Arc::new(
            Scheduler::new(placement, gitea, Arc::clone(pipeline.store()), pipeline.placements().clone(), scheduler_config.clone())
                .with_metrics(Arc::clone(pipeline.metrics()))
                .with_wake(wake.clone())
                .with_lease_ttl(config.gitea.lease_ttl),
        ));
    }
    let keep_alive =
        KeepAlive { store: Arc::clone(pipeline.store()), registrations: pipeline.registrations().clone(), lifecycle: pipeline.lifecycle().clone() };
    let (interval, shutdown) = (config.gitea.keepalive_interval, running.shutdown().clone());
    for scheduler in schedulers {
        running.spawn("scheduler", scheduler.run(shutdown.clone()));
    }
    running.spawn("keep-alive", async move {
        keep_alive.run(interval, shutdown).await;
        Ok::<(), Infallible>(())
    });
}

/// Finished records go after the retention (JetStream's bucket ages them out itself).
fn spawn_pruning(running: &mut Running, config: &Config) {
    let (store, retention, shutdown) = (Arc::clone(running.pipeline().store()), config.store.retention(), running.shutdown().clone());
    running.spawn("pruning", async move {
        while !shutdown.is_cancelled() {
            let before = crate::store::now_ms() - i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
            match store.prune(before).await {
                Ok(0) => {}
                Ok(removed) => tracing::info!(removed, ?retention, "finished records past the retention removed"),
                Err(error) => tracing::warn!(error = %crate::error_chain(&error), "cannot remove finished records past the retention"),
            }
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = tokio::time::sleep(Duration::from_secs(600)) => {}
            }
        }
        Ok::<(), Infallible>(())
    });
}

/// Gauges that come from elsewhere, refreshed every few seconds.
fn spawn_gauges(running: &mut Running) {
    let pipeline = running.pipeline();
    let (store, metrics, placements, shutdown) =
        (Arc::clone(pipeline.store()), Arc::clone(pipeline.metrics()), pipeline.placements().clone(), running.shutdown().clone());
    running.spawn("gauges", async move {
        while !shutdown.is_cancelled() {
            for served in placements.iter() {
                let label = PlacementLabel { placement: served.placement.to_string() };
                metrics.pool_in_use.get_or_create(&label).set(i64::try_from(served.pool.in_use()).unwrap_or(i64::MAX));
                if let Ok(depth) = store.queue_depth(served.placement).await {
                    metrics.queue_depth.get_or_create(&label).set(i64::try_from(depth).unwrap_or(i64::MAX));
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = tokio::time::sleep(Duration::from_secs(5)) => {}
            }
        }
        Ok::<(), Infallible>(())
    });
}

/// Ready while the store answers: during a NATS outage nothing can be persisted,
/// claimed or finished, and a load balancer should know.
fn spawn_readiness(running: &mut Running) {
    let (store, metrics, shutdown) = (Arc::clone(running.pipeline().store()), Arc::clone(running.pipeline().metrics()), running.shutdown().clone());
    metrics.set_ready(true);
    running.spawn("readiness", async move {
        let mut was_ready = true;
        while !shutdown.is_cancelled() {
            let ready = tokio::time::timeout(Duration::from_secs(2), store.healthy()).await.is_ok_and(|r| r.is_ok());
            if ready != was_ready {
                if ready {
                    tracing::info!("the store answers again: ready")
                } else {
                    tracing::warn!("the store does not answer: not ready")
                }
                was_ready = ready;
            }
            metrics.set_ready(ready);
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
        Ok::<(), Infallible>(())
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn components_and_legacy_aliases() {
        assert_eq!(Components::parse("scheduler,facade").unwrap(), Components { scheduler: true, facade: true, ..Default::default() });
        let pod = Components::parse("pod-worker").unwrap();
        assert!(pod.worker_for(Placement::CONTAINER_KUBERNETES) && !pod.worker_for(Placement::VM_OPENSANDBOX));
        let vm = Components::parse("vm-worker").unwrap();
        assert!(vm.worker_for(Placement::VM_OPENSANDBOX) && !vm.scheduler);
        assert!(Components::parse("worker:container.docker").unwrap().worker_for(Placement::CONTAINER_DOCKER));
        assert!(Components::parse("worker").unwrap().worker_for(Placement::VM_OPENSANDBOX));
        for bad in ["schedulr", "worker:vm.docker", "facade,pods"] {
            assert!(Components::parse(bad).unwrap_err().contains("--components"), "{bad}");
        }
    }
}
