//! `controller run`: the components of one controller process, wired together.
//!
//! `--components` selects them (default: all): `scheduler` (registration, FetchTask
//! loops, keep-alive), `facade` (the environments' only path to Gitea), `worker` (one
//! per configured placement), `worker:<placement>`, and the previous implementation's
//! aliases `pod-worker` (container.kubernetes) and `vm-worker` (vm.opensandbox).
//! Records live in the store, so the components may run in separate processes.

use std::{collections::HashMap, sync::Arc, time::Duration};

use anyhow::{Context, bail};
use tokio_util::sync::CancellationToken;

use crate::{
    capability::CapabilityKey,
    config::{Config, StoreConfig},
    driver::Driver,
    facade::{self, Facade},
    gitea,
    keepalive::KeepAlive,
    metrics::{Metrics, PlacementLabel},
    placement::Placement,
    pool::Pool,
    scheduler::{Scheduler, SchedulerConfig},
    store::{Store, embedded::Embedded, jetstream::JetStream},
    worker::{EnvironmentContract, Worker},
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

/// The driver of a placement, if this build has one: docker for container.docker
/// (kubernetes and opensandbox arrive with their own issues); in `test-driver` builds
/// the directory driver when GDR_TEST_DRIVER_DIR is set.
async fn driver_for(placement: Placement, config: &Config) -> anyhow::Result<Option<Arc<dyn Driver>>> {
    #[cfg(feature = "test-driver")]
    if let Ok(dir) = std::env::var("GDR_TEST_DRIVER_DIR") {
        return Ok(Some(Arc::new(crate::test_driver::DirectoryDriver { placement, dir: dir.into() })));
    }
    if placement == Placement::CONTAINER_DOCKER
        && let Some(docker) = &config.docker
    {
        let driver = crate::driver::docker::DockerDriver::connect(docker.clone()).await.context("docker")?;
        return Ok(Some(Arc::new(driver)));
    }
    Ok(None)
}

/// Runs until `shutdown`, then joins every component (bounded by 30 s).
///
/// # Errors
/// Start-up failures (store, Gitea, configuration) and final component errors.
pub async fn run(config: Config, components: Components, shutdown: CancellationToken) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new());
    let mut tasks = tokio::task::JoinSet::new();

    let listener = tokio::net::TcpListener::bind(&config.http.listen)
        .await
        .with_context(|| format!("http.listen: cannot listen on {}", config.http.listen))?;
    tasks.spawn(named("metrics", crate::metrics::serve(listener, Arc::clone(&metrics), shutdown.clone())));

    let store: Arc<dyn Store> = match &config.store {
        StoreConfig::Embedded { path } => Arc::new(Embedded::open(path).with_context(|| format!("store.path {}", path.display()))?),
        StoreConfig::Jetstream { url, subject, bucket, ack_wait } => Arc::new(
            JetStream::connect(url, subject, bucket, *ack_wait)
                .await
                .with_context(|| format!("store.url {url}"))?,
        ),
    };
    let placements: Vec<Placement> = config.pools.iter().map(|p| p.placement).collect();
    let labels = crate::placement::declared_labels(&placements);
    let (gitea, _) = gitea::connect(
        &config.gitea.url,
        &config.gitea.credential_file,
        config.gitea.registration_token_file.as_deref(),
        &config.gitea.runner_name,
        &labels,
    )
    .await?;
    let key = Arc::new(CapabilityKey::from_file(&config.facade.capability_key_file).context("facade.capability_key_file")?);

    let mut pools = HashMap::new();
    let mut drivers: HashMap<String, Arc<dyn Driver>> = HashMap::new();
    for pool in &config.pools {
        let name = pool.placement.to_string();
        pools.insert(name.clone(), Arc::new(Pool::new(name.clone(), pool.capacity)));
        metrics.pool_capacity.get_or_create(&PlacementLabel { placement: name.clone() }).set(i64::try_from(pool.capacity).unwrap_or(i64::MAX));
        match driver_for(pool.placement, &config).await? {
            Some(driver) => {
                drivers.insert(name, driver);
            }
            None if components.worker_for(pool.placement) => {
                bail!("pool {name}: this build has no {} driver yet (only docker); leave this worker out of --components", pool.placement.driver)
            }
            None => {}
        }
    }

    let contract = EnvironmentContract {
        facade_url: config.facade.url.clone(),
        facade_spiffe_id: config.facade.spiffe_id.clone(),
        spiffe_endpoint_socket: config.facade.environment_spiffe_endpoint_socket.clone(),
        capability_ttl: config.facade.capability_ttl,
    };
    for pool in &config.pools {
        if !components.worker_for(pool.placement) {
            continue;
        }
        let name = pool.placement.to_string();
        let (Some(driver), Some(slots)) = (drivers.get(&name), pools.get(&name)) else { continue };
        let worker = Arc::new(Worker::new(Arc::clone(&store), Arc::clone(driver), Arc::clone(slots), Arc::clone(&key), contract.clone(), config.identity.trust_domain.clone()));
        worker.recover().await.with_context(|| format!("pool {name}: rebuilding from the driver"))?;
        tasks.spawn(named("worker", Arc::clone(&worker).run(shutdown.clone())));
    }

    if components.facade {
        let facade = Arc::new(
            Facade::new(Arc::clone(&store), gitea.clone(), Arc::clone(&key), config.identity.trust_domain.clone(), drivers.clone(), pools.clone())
                .with_metrics(Arc::clone(&metrics)),
        );
        if let Some(path) = config.facade.unix_socket.clone() {
            let facade = Arc::clone(&facade);
            let shutdown = shutdown.clone();
            tasks.spawn(async move { facade::serve_unix(facade, &path, shutdown).await.map_err(anyhow::Error::from) });
        }
        if let (Some(listen), Some(endpoint)) = (config.facade.listen.clone(), config.facade.spiffe_endpoint_socket.clone()) {
            let source = spiffe::X509Source::builder().endpoint(&endpoint).build().await.with_context(|| format!("facade.spiffe_endpoint_socket {endpoint}"))?;
            let tls = facade::mtls_server_config(source, &config.identity.trust_domain)?;
            let listener = tokio::net::TcpListener::bind(&listen).await.with_context(|| format!("facade.listen {listen}"))?;
            tasks.spawn(named("facade", facade::serve_mtls(facade, listener, tls, shutdown.clone())));
        }
    }

    if components.scheduler {
        let scheduler = Arc::new(Scheduler::new(
            gitea.clone(),
            Arc::clone(&store),
            SchedulerConfig {
                trust_domain: config.identity.trust_domain.clone(),
                enabled: placements.clone(),
                loops: config.total_capacity(),
                fetch_interval: config.gitea.fetch_interval,
                fetch_timeout: Duration::from_secs(5),
            },
        )
        .with_metrics(Arc::clone(&metrics)));
        tasks.spawn(named("scheduler", scheduler.run(shutdown.clone())));
        let keep_alive = KeepAlive { store: Arc::clone(&store), gitea: gitea.clone(), drivers: drivers.clone(), pools: pools.clone() };
        let interval = config.gitea.keepalive_interval;
        let reconcile = config.gitea.reconcile_interval;
        let keep_shutdown = shutdown.clone();
        tasks.spawn(async move {
            keep_alive.run(interval, reconcile, keep_shutdown).await;
            Ok(())
        });
    }

    // Gauges that come from elsewhere, refreshed every few seconds.
    {
        let (store, metrics, pools, shutdown) = (Arc::clone(&store), Arc::clone(&metrics), pools.clone(), shutdown.clone());
        tasks.spawn(async move {
            while !shutdown.is_cancelled() {
                for (placement, pool) in &pools {
                    let label = PlacementLabel { placement: placement.clone() };
                    metrics.pool_in_use.get_or_create(&label).set(i64::try_from(pool.in_use()).unwrap_or(i64::MAX));
                    if let Ok(depth) = store.queue_depth(placement).await {
                        metrics.queue_depth.get_or_create(&label).set(i64::try_from(depth).unwrap_or(i64::MAX));
                    }
                }
                tokio::select! {
                    () = shutdown.cancelled() => {}
                    () = tokio::time::sleep(Duration::from_secs(5)) => {}
                }
            }
            Ok(())
        });
    }
    metrics.set_ready(true);
    tracing::info!(components = ?components, placements = ?placements, "controller running");

    let mut outcome = Ok(());
    let drain = async {
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok(Err(error)) => {
                    tracing::error!("component failed: {error:#}");
                    shutdown.cancel();
                    outcome = Err(error);
                }
                Ok(Ok(())) => {}
                Err(error) => tracing::error!(%error, "component panicked"),
            }
        }
    };
    tokio::select! {
        () = drain => {}
        () = async { shutdown.cancelled().await; tokio::time::sleep(Duration::from_secs(30)).await } => {
            tracing::warn!("components did not stop within 30 s; exiting");
        }
    }
    outcome
}

/// A component's error, with the component named.
async fn named<E>(component: &'static str, future: impl std::future::Future<Output = Result<(), E>>) -> anyhow::Result<()>
where
    E: std::error::Error + Send + Sync + 'static,
{
    future.await.with_context(|| format!("{component} stopped"))
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
