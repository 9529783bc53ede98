//! The pipeline of one process, built in one place: from a store, the placements
//! with their drivers, the registrations (Gitea's, or run-local's terminal) and the
//! capability key, [`PipelineBuilder::build`] makes the lifecycle, the facade, the
//! environments' sockets and, per placement, its worker — with the same wiring for
//! `controller run` ([`crate::app`]) and `run-local`, which differ only in the values.
//!
//! [`Pipeline::start`] runs it: the workers and sockets spawned, a [`Running`] handle
//! returned ([`running`]). A caller that plays Gitea's part itself (run-local) hands
//! tasks in with [`Running::submit`], cancels them with [`Running::cancel`] and takes
//! environments down with [`Pipeline::retire`]; it needs nothing else of the
//! controller's insides.

pub mod running;

use std::{sync::Arc, time::Duration};

use proto::runner::v1::Task;

use crate::{
    assignment::{Assignment, Rules, capability::CapabilityKey, envelope::AssignmentError},
    driver::{Driver, DriverError},
    facade::{EnvironmentSockets, Facade, FacadeError},
    gitea::registrations::Registrations,
    lifecycle::Lifecycle,
    metrics::Metrics,
    placements::{PlacementState, Placements},
    store::{Record, State, Store, StoreError, now_ms},
    worker::{EnvironmentSettings, Worker},
};

pub use self::running::{Cancel, Connect, Running};

/// What the pipeline is made of; see [`Pipeline::builder`].
#[derive(Debug)]
pub struct PipelineBuilder {
    store: Arc<dyn Store>,
    registrations: Registrations,
    rules: Rules,
    key: Arc<CapabilityKey>,
    placements: Placements,
    settings: EnvironmentSettings,
    sockets: bool,
    metrics: Option<Arc<Metrics>>,
    sweep_interval: Duration,
    retire_grace: Option<Duration>,
    session_ttl: Option<Duration>,
    cache: Option<Arc<::cache::Cache>>,
}

impl PipelineBuilder {
    /// The jobs' cache, served on the facade's transport.
    pub fn cache(mut self, cache: Option<Arc<::cache::Cache>>) -> Self {
        self.cache = cache;
        self
    }

    /// What environments are told (facade, Gitea, installation, capability lifetime).
    pub fn environments(mut self, settings: EnvironmentSettings) -> Self {
        self.settings = settings;
        self
    }

    /// Serve each docker environment its own facade socket under
    /// `settings.socket_dir` (where the facade runs in this process).
    pub fn with_sockets(mut self, serve: bool) -> Self {
        self.sockets = serve;
        self
    }

    pub fn metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// How often workers compare environments with assignments.
    pub fn sweep_interval(mut self, interval: Duration) -> Self {
        self.sweep_interval = interval;
        self
    }

    /// How long a finished environment may end on its own before it is stopped.
    pub fn retire_grace(mut self, grace: Duration) -> Self {
        self.retire_grace = Some(grace);
        self
    }

    /// How long a facade session lives.
    pub fn session_ttl(mut self, ttl: Duration) -> Self {
        self.session_ttl = Some(ttl);
        self
    }

    /// # Errors
    /// When the environments' socket directory cannot be prepared.
    pub fn build(self) -> Result<Pipeline, FacadeError> {
        let metrics = self.metrics.unwrap_or_else(|| Arc::new(Metrics::new()));
        let mut lifecycle = Lifecycle::new(Arc::clone(&self.store), self.placements.clone(), self.registrations.clone()).with_metrics(Arc::clone(&metrics));
        if let Some(grace) = self.retire_grace {
            lifecycle = lifecycle.with_retire_grace(grace);
        }
        let mut facade = Facade::new(Arc::clone(&self.store), self.registrations.clone(), lifecycle.clone(), Arc::clone(&self.key), self.rules.clone())
            .with_metrics(Arc::clone(&metrics))
            .with_cache(self.cache.clone());
        if let Some(ttl) = self.session_ttl {
            facade = facade.with_session_ttl(ttl);
        }
        let sockets = match (&self.settings.socket_dir, self.sockets) {
            (Some(dir), true) => Some(EnvironmentSockets::new(dir, &self.settings.instance, &self.settings.socket_placements)?),
            _ => None,
        };
        Ok(Pipeline {
            store: self.store,
            key: self.key,
            lifecycle,
            registrations: self.registrations,
            rules: self.rules,
            placements: self.placements,
            metrics,
            facade: Arc::new(facade),
            sockets,
            settings: self.settings,
            sweep_interval: self.sweep_interval,
        })
    }
}

/// The built pipeline: what its components share, and how to make each.
#[derive(Debug)]
pub struct Pipeline {
    store: Arc<dyn Store>,
    key: Arc<CapabilityKey>,
    lifecycle: Lifecycle,
    registrations: Registrations,
    rules: Rules,
    placements: Placements,
    metrics: Arc<Metrics>,
    facade: Arc<Facade>,
    sockets: Option<Arc<EnvironmentSockets>>,
    settings: EnvironmentSettings,
    sweep_interval: Duration,
}

/// Why a task could not be handed in.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the task cannot run here")]
    Assignment(#[from] AssignmentError),
    #[error("cannot persist the task")]
    Store(#[from] StoreError),
}

impl Pipeline {
    /// A pipeline over `store` for `placements` (each with its driver where its worker
    /// runs in this process), reporting through `registrations`.
    pub fn builder(store: Arc<dyn Store>, registrations: Registrations, rules: Rules, key: Arc<CapabilityKey>, placements: Placements) -> PipelineBuilder {
        PipelineBuilder {
            store,
            registrations,
            rules,
            key,
            placements,
            settings: EnvironmentSettings::default(),
            sockets: false,
            metrics: None,
            sweep_interval: Duration::from_secs(10),
            retire_grace: None,
            session_ttl: None,
            cache: None,
        }
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    pub fn lifecycle(&self) -> &Lifecycle {
        &self.lifecycle
    }

    pub fn registrations(&self) -> &Registrations {
        &self.registrations
    }

    pub fn placements(&self) -> &Placements {
        &self.placements
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn rules(&self) -> &Rules {
        &self.rules
    }

    /// The facade service (one, whatever the transports it is served on).
    pub fn facade(&self) -> &Arc<Facade> {
        &self.facade
    }

    /// The environments' own sockets, when this process serves them.
    pub fn sockets(&self) -> Option<&Arc<EnvironmentSockets>> {
        self.sockets.as_ref()
    }

    /// Serving the facade on the environments' sockets until `shutdown`, when this
    /// process serves them (a future to spawn).
    fn serve_sockets(
        &self,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> Option<impl std::future::Future<Output = Result<(), FacadeError>> + Send + 'static> {
        let (facade, store) = (Arc::clone(&self.facade), Arc::clone(&self.store));
        self.sockets.clone().map(|sockets| sockets.serve(facade, store, shutdown))
    }

    /// What makes workers, for a placement whose driver connects later (in a task of
    /// its own).
    fn worker_factory(&self) -> WorkerFactory {
        WorkerFactory {
            store: Arc::clone(&self.store),
            key: Arc::clone(&self.key),
            settings: self.settings.clone(),
            rules: self.rules.clone(),
            lifecycle: self.lifecycle.clone(),
            sockets: self.sockets.clone(),
            metrics: Arc::clone(&self.metrics),
            sweep_interval: self.sweep_interval,
        }
    }

    /// Hands `task` to its placement's worker as a task fetched by `runner` is: its
    /// record is persisted, pending.
    ///
    /// # Errors
    /// When the task names no placement of the rules, or the store refuses it.
    pub async fn submit(&self, task: Task, runner: &str) -> Result<Assignment, SubmitError> {
        let assignment = Assignment::from_task(task, &self.rules)?;
        let record = Record::pending(&assignment.id, assignment.placement, runner, assignment.encode(), now_ms());
        self.store.persist(&record).await?;
        Ok(assignment)
    }

    /// Whether the assignment is still waiting for its environment's claim.
    pub async fn unclaimed(&self, assignment_id: &str) -> bool {
        matches!(self.store.get(assignment_id).await, Ok(Some(record)) if record.value.state == State::Pending)
    }

    /// The name of the assignment's environment.
    pub fn environment_name(&self, assignment_id: &str) -> String {
        crate::driver::environment_name(&self.settings.instance, assignment_id)
    }

    /// Lets the assignment's environment end on its own for `grace`, then stops and
    /// deletes it; at once when it has none.
    pub async fn retire(&self, assignment: &Assignment, grace: Duration) {
        let Some(driver) = self.driver_of(assignment) else { return };
        let name = self.environment_name(&assignment.id);
        crate::lifecycle::retire(driver.as_ref(), &name, &assignment.id, grace, || {}).await;
    }

    /// Deletes the assignment's environment at once.
    ///
    /// # Errors
    /// What the driver answered.
    pub async fn remove(&self, assignment: &Assignment) -> Result<(), DriverError> {
        match self.driver_of(assignment) {
            Some(driver) => driver.delete(&self.environment_name(&assignment.id)).await,
            None => Ok(()),
        }
    }

    fn driver_of(&self, assignment: &Assignment) -> Option<Arc<dyn Driver>> {
        self.placements.get(assignment.placement).and_then(|served| served.driver())
    }
}

/// Makes the worker of a placement: the pipeline's parts, cloned.
#[derive(Debug, Clone)]
pub struct WorkerFactory {
    store: Arc<dyn Store>,
    key: Arc<CapabilityKey>,
    settings: EnvironmentSettings,
    rules: Rules,
    lifecycle: Lifecycle,
    sockets: Option<Arc<EnvironmentSockets>>,
    metrics: Arc<Metrics>,
    sweep_interval: Duration,
}

impl WorkerFactory {
    pub fn make(&self, served: &Arc<PlacementState>, driver: Arc<dyn Driver>) -> Worker {
        Worker::new(
            Arc::clone(served),
            driver,
            Arc::clone(&self.store),
            Arc::clone(&self.key),
            self.settings.clone(),
            self.rules.clone(),
            self.lifecycle.clone(),
        )
        .with_sweep_interval(self.sweep_interval)
        .with_sockets(self.sockets.clone())
        .with_metrics(Arc::clone(&self.metrics))
    }
}
