//! A worker per placement: consumes its queue and creates one environment per
//! assignment within the placement's [`Pool`](crate::placements::Pool); watches its environments and
//! sweeps them with the [`reconciler`].
//!
//! While the pool is full the worker holds the delivery and waits for a slot (a
//! finished assignment frees one at once), up to a bound, then gives the delivery back
//! with a delayed NAK — no environment beyond capacity is ever created and the message
//! waits in the queue (not in memory). Creation is idempotent (the name derives from
//! the assignment id); the environment's name is recorded on the assignment before the
//! delivery is acknowledged, so a crash at any point either redelivers (and finds the
//! existing environment) or is done. A backend that refuses an environment for good
//! (missing image, invalid spec) fails the task with its reason.
//!
//! It may touch: the store (records of its placement), its driver, the lifecycle.

pub mod reconciler;

use std::{sync::Arc, time::Duration};

use contract::environment::Contract;
use tokio_util::sync::CancellationToken;

use crate::{
    assignment::{Assignment, Rules, capability::CapabilityKey, placement},
    driver::{self, Driver, EnvironmentSpec, Phase},
    lifecycle::Lifecycle,
    metrics::{EndedBy, JobPhase},
    placements::PlacementState,
    store::{self, Delivery, Record, Store, StoreError},
};

/// What environments are told about where they are (the rest of the contract comes
/// from the assignment).
#[derive(Debug, Clone, Default)]
pub struct EnvironmentSettings {
    /// CI_RUNNER_FACADE_URL, e.g. `https://controller:9443` or `unix:///run/gdr/facade.sock`.
    pub facade_url: String,
    /// CI_RUNNER_FACADE_SPIFFE_ID (https facades).
    pub facade_spiffe_id: Option<String>,
    /// SPIFFE_ENDPOINT_SOCKET inside the environment; set means the supervisor waits
    /// for the job's SVID (CI_SPIFFE_ID is then set too).
    pub spiffe_endpoint_socket: Option<String>,
    /// CI_GITEA_URL: Gitea as environments reach it.
    pub gitea_url: Option<String>,
    /// The installation (`driver::instance_of` the Gitea URL): part of every
    /// environment's name and labels.
    pub instance: String,
    pub capability_ttl: Duration,
    /// `facade.environment_socket_dir`: environments of `socket_placements` get their
    /// own socket and capability file there instead of `facade_url` and a capability in
    /// their configuration.
    pub socket_dir: Option<std::path::PathBuf>,
    /// Normally `facade::sockets::PLACEMENTS`; run-local runs any container placement
    /// in a local container.
    pub socket_placements: Vec<crate::assignment::Placement>,
}

#[derive(Debug)]
pub struct Worker {
    served: Arc<PlacementState>,
    driver: Arc<dyn Driver>,
    store: Arc<dyn Store>,
    key: Arc<CapabilityKey>,
    settings: EnvironmentSettings,
    rules: Rules,
    lifecycle: Lifecycle,
    reconciler: reconciler::Reconciler,
    /// The facade's per-environment sockets, when the facade runs in this process: the
    /// socket is open before the environment starts (another process's facade opens it
    /// within its next sync, and the supervisor retries until then).
    sockets: Option<Arc<crate::facade::EnvironmentSockets>>,
    metrics: Option<Arc<crate::metrics::Metrics>>,
    /// How long a delivery waits for a slot before it goes back to the queue.
    hold: Duration,
    /// The delay of a delivery given back.
    nak_delay: Duration,
    sweep_interval: Duration,
}

impl Worker {
    /// # Panics
    /// Never: a placement without a driver is refused by the caller (see `app`).
    pub fn new(
        served: Arc<PlacementState>,
        driver: Arc<dyn Driver>,
        store: Arc<dyn Store>,
        key: Arc<CapabilityKey>,
        settings: EnvironmentSettings,
        rules: Rules,
        lifecycle: Lifecycle,
    ) -> Self {
        let reconciler = reconciler::Reconciler::new(
            Arc::clone(&served),
            Arc::clone(&driver),
            Arc::clone(&store),
            lifecycle.clone(),
            settings.instance.clone(),
            Arc::clone(&key),
        );
        Worker {
            served,
            driver,
            store,
            key,
            settings,
            rules,
            lifecycle,
            reconciler,
            sockets: None,
            metrics: None,
            hold: Duration::from_secs(20),
            nak_delay: Duration::from_secs(1),
            sweep_interval: Duration::from_secs(10),
        }
    }

    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    fn beat(&self, what: &str) {
        if let Some(metrics) = &self.metrics {
            metrics.beat(&format!("{what} {}", self.served.placement));
        }
    }

    pub fn with_sockets(mut self, sockets: Option<Arc<crate::facade::EnvironmentSockets>>) -> Self {
        self.sockets = sockets;
        self
    }

    pub fn with_nak_delay(mut self, delay: Duration) -> Self {
        self.nak_delay = delay;
        self
    }

    pub fn with_hold(mut self, hold: Duration) -> Self {
        self.hold = hold;
        self
    }

    pub fn with_sweep_interval(mut self, interval: Duration) -> Self {
        self.sweep_interval = interval;
        self
    }

    pub fn reconciler(&self) -> &reconciler::Reconciler {
        &self.reconciler
    }

    /// Rebuilds the pool from the driver's listing: every live environment of this
    /// placement holds a slot.
    ///
    /// # Errors
    /// When the driver cannot list.
    pub async fn recover(&self) -> Result<usize, driver::DriverError> {
        let placement = self.served.placement;
        let selector = driver::selector(&self.settings.instance, placement);
        let mut adopted = 0;
        for environment in self.driver.list(&selector).await? {
            if environment.phase == Phase::Running && self.reconciler.made_here(&environment) {
                self.served.pool.adopt(&environment.assignment_id);
                adopted += 1;
            }
        }
        tracing::info!(%placement, adopted, capacity = self.served.capacity, "pool rebuilt from the driver");
        Ok(adopted)
    }

    /// Consumes, watches and sweeps until `shutdown`; every task it started is joined.
    ///
    /// # Errors
    /// When the consumer cannot be created for a reason other than an unavailable store.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) -> Result<(), StoreError> {
        let placement = self.served.placement;
        // The pool first: what runs holds its slots before anything new is made.
        let mut backoff = contract::backoff::Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
        while let Err(error) = self.recover().await {
            tracing::warn!(%placement, %error, "cannot list this placement's environments to rebuild its pool; retrying");
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                () = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
        // A store that does not answer yet (a cluster electing leaders after a node
        // restarted) is waited for, as the loop below waits for its queue: exiting would
        // take the facade and the scheduler of this process down with the worker.
        let mut pause = contract::backoff::Backoff::new(Duration::from_millis(500), Duration::from_secs(10));
        let mut consumer = loop {
            match self.store.consumer(placement, self.served.capacity).await {
                Ok(consumer) => break consumer,
                Err(error @ StoreError::Unavailable { .. }) => {
                    tracing::warn!(%placement, error = %crate::error_chain(&error), "cannot open the queue yet; retrying");
                    tokio::select! {
                        () = shutdown.cancelled() => return Ok(()),
                        () = tokio::time::sleep(pause.next_delay()) => {}
                    }
                }
                Err(error) => return Err(error),
            }
        };
        let mut helpers = tokio::task::JoinSet::new();
        helpers.spawn(Arc::clone(&self).watch(shutdown.clone()));
        helpers.spawn(Arc::clone(&self).sweep(shutdown.clone()));
        while !shutdown.is_cancelled() {
            self.beat("worker");
            let next = tokio::select! {
                () = shutdown.cancelled() => break,
                next = consumer.next(Duration::from_secs(1)) => next,
            };
            match next {
                Ok(Some(delivery)) => self.handle(delivery, &shutdown).await,
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(%placement, %error, "queue unavailable; retrying");
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        }
        while helpers.join_next().await.is_some() {}
        if let Some(metrics) = &self.metrics {
            metrics.forget(&format!("worker {placement}"));
            metrics.forget(&format!("reconciler {placement}"));
        }
        Ok(())
    }

    /// Reacts to environments that end on their own, as the driver reports them.
    /// Each change is settled on its own task: settling may wait for a deletion (a Pod's
    /// grace period), which must not hold back the changes behind it.
    async fn watch(self: Arc<Self>, shutdown: CancellationToken) {
        let mut settling = tokio::task::JoinSet::new();
        self.watch_changes(&mut settling, &shutdown).await;
        while settling.join_next().await.is_some() {}
    }

    async fn watch_changes(self: &Arc<Self>, settling: &mut tokio::task::JoinSet<()>, shutdown: &CancellationToken) {
        use futures_util::StreamExt as _;
        while !shutdown.is_cancelled() {
            let mut changes = match self.driver.changes().await {
                Ok(Some(changes)) => changes,
                Ok(None) => return,
                Err(error) => {
                    tracing::warn!(placement = %self.served.placement, %error, "cannot watch environments; the sweep still runs");
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_secs(5)) => continue,
                    }
                }
            };
            loop {
                let change = tokio::select! {
                    () = shutdown.cancelled() => return,
                    change = changes.next() => change,
                };
                match change {
                    Some(environment) => {
                        let worker = Arc::clone(self);
                        settling.spawn(async move {
                            worker.reconciler.settle(environment).await;
                        });
                        while settling.try_join_next().is_some() {}
                    }
                    None => break,
                }
            }
        }
    }

    async fn sweep(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            self.beat("reconciler");
            if let Err(error) = self.reconciler.sweep().await {
                tracing::warn!(placement = %self.served.placement, %error, "reconciliation failed");
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(self.sweep_interval) => {}
            }
        }
    }

    async fn handle(&self, delivery: Box<dyn Delivery>, shutdown: &CancellationToken) {
        use tracing::Instrument as _;
        let span = tracing::info_span!("assignment", assignment.id = %delivery.assignment_id());
        self.handle_delivery(delivery, shutdown).instrument(span).await;
    }

    async fn handle_delivery(&self, delivery: Box<dyn Delivery>, shutdown: &CancellationToken) {
        let assignment_id = delivery.assignment_id().to_owned();
        let placed = tokio::select! {
            placed = self.place(&assignment_id) => placed,
            () = shutdown.cancelled() => Ok(Placed::PoolFull),
        };
        match placed {
            Ok(Placed::Done) => {
                if let Err(error) = delivery.ack().await {
                    tracing::warn!(assignment.id = %assignment_id, %error, "ack failed; the delivery will come again and find the environment");
                }
            }
            Ok(Placed::PoolFull) => {
                tracing::debug!(assignment.id = %assignment_id, placement = %self.served.placement, "pool full; the assignment waits in the queue");
                let _ = delivery.nak(self.nak_delay).await;
            }
            Err(PlaceError::Driver(error)) if error.is_refusal() => {
                let reason = format!("the {} environment could not be created: {error}", self.served.placement);
                if let Err(failed) = self.lifecycle.fail(&assignment_id, EndedBy::Refused, &reason).await {
                    tracing::warn!(assignment.id = %assignment_id, error = %crate::error_chain(&failed), "cannot fail the task yet");
                    let _ = delivery.nak(self.nak_delay).await;
                } else if let Err(error) = delivery.ack().await {
                    tracing::warn!(assignment.id = %assignment_id, %error, "ack failed");
                }
            }
            Err(error) => {
                tracing::warn!(assignment.id = %assignment_id, error = %crate::error_chain(&error), "creating the environment failed; retrying later");
                let _ = delivery.nak(self.nak_delay).await;
            }
        }
    }

    async fn place(&self, assignment_id: &str) -> Result<Placed, PlaceError> {
        let Some(record) = self.store.get(assignment_id).await? else {
            tracing::warn!(assignment.id = %assignment_id, "queued assignment has no record; dropping the message");
            return Ok(Placed::Done);
        };
        if record.value.is_terminal() {
            return Ok(Placed::Done);
        }
        let name = driver::attempt_name(&self.settings.instance, assignment_id, record.value.attempts);
        if record.value.environment.is_some() {
            if self.driver.get(&name).await?.is_some() {
                self.served.pool.adopt(assignment_id);
                return Ok(Placed::Done);
            }
            if record.value.state != store::State::Pending {
                // It ran and is gone: a second environment would run the job twice.
                let reason = format!("the job's environment {name} disappeared before the job finished");
                self.lifecycle.fail(assignment_id, EndedBy::Lost, &reason).await.map_err(|e| PlaceError::Envelope(crate::error_chain(&e)))?;
                return Ok(Placed::Done);
            }
        }
        if !self.served.pool.acquire_within(assignment_id, self.hold).await {
            return Ok(Placed::PoolFull);
        }
        let spec = match self.spec(&record.value, &name) {
            Ok(spec) => spec,
            Err(error) => {
                self.served.pool.release(assignment_id);
                return Err(error);
            }
        };
        if let Err(error) = self.prepare_facade(&spec) {
            self.served.pool.release(assignment_id);
            return Err(error);
        }
        crate::failpoint::hit("before-create");
        let created = self.driver.create(&spec).await;
        self.served.pool.created(assignment_id);
        let environment = match created {
            Ok(environment) => environment,
            Err(error) => {
                self.served.pool.release(assignment_id);
                return Err(error.into());
            }
        };
        crate::failpoint::hit("after-create");
        // Record the recovery metadata before acknowledging (the facade may have
        // claimed meanwhile: modify re-reads on conflicts).
        let created_at_ms = crate::clock::now_ms();
        let recorded = store::modify(self.store.as_ref(), assignment_id, |current| Some(current.with_environment(&environment.name, created_at_ms))).await?;
        tracing::info!(assignment.id = %assignment_id, environment = %environment.name, placement = %self.served.placement, "environment created");
        if let (Some(metrics), Some(record)) = (&self.metrics, &recorded) {
            metrics.job_phase(&self.served.placement.to_string(), JobPhase::Created, record.value.created_at_ms, created_at_ms);
        }
        // Finished while it was being created (cancelled in Gitea): retire it now.
        if recorded.is_some_and(|r| r.value.is_terminal()) {
            let (driver, name, id) = (Arc::clone(&self.driver), environment.name.clone(), assignment_id.to_owned());
            crate::lifecycle::retire(driver.as_ref(), &name, &id, Duration::ZERO, || {
                self.served.pool.release(assignment_id);
            })
            .await;
        }
        Ok(Placed::Done)
    }

    /// The environment's own facade directory with its capability file, and its socket
    /// when the facade is in this process.
    fn prepare_facade(&self, spec: &EnvironmentSpec) -> Result<(), PlaceError> {
        let Some(facade_dir) = &spec.facade_dir else { return Ok(()) };
        let (Some(dir), Some(name)) = (facade_dir.host.parent(), facade_dir.host.file_name()) else {
            return Err(PlaceError::Facade(format!("{} is not a directory of facade.environment_socket_dir", facade_dir.host.display())));
        };
        crate::facade::sockets::prepare_environment_dir(dir, &name.to_string_lossy(), &facade_dir.capability)
            .map_err(|error| PlaceError::Facade(format!("cannot prepare {}: {error}", facade_dir.host.display())))?;
        if let Some(sockets) = &self.sockets {
            sockets.open(&spec.assignment_id).map_err(|error| PlaceError::Facade(crate::error_chain(&error)))?;
        }
        Ok(())
    }

    fn spec(&self, record: &Record, name: &str) -> Result<EnvironmentSpec, PlaceError> {
        let assignment = Assignment::decode(&record.envelope, &self.rules).map_err(|error| PlaceError::Envelope(crate::error_chain(&error)))?;
        Ok(environment_spec(&assignment, self.served.placement, name, &self.settings, &self.key))
    }
}

/// What every driver is asked to create for `assignment`: its name, recovery labels and
/// the environment contract — only the variables that have a value.
pub fn environment_spec(
    assignment: &Assignment,
    placement: crate::assignment::Placement,
    name: &str,
    settings: &EnvironmentSettings,
    key: &CapabilityKey,
) -> EnvironmentSpec {
    let expires = crate::clock::now_secs().saturating_add(settings.capability_ttl.as_secs());
    let spiffe = settings.spiffe_endpoint_socket.is_some();
    let capability = key.issue(&assignment.id, expires);
    // Its own socket and a capability file where the driver can mount a directory.
    let own_dir = settings.socket_dir.as_deref().filter(|_| settings.socket_placements.contains(&placement));
    // One directory per assignment (its socket outlives an attempt's environment).
    let facade_dir = own_dir.map(|dir| driver::FacadeDir {
        host: crate::facade::sockets::environment_dir(dir, &driver::environment_name(&settings.instance, &assignment.id)),
        capability: capability.clone(),
    });
    let contract = Contract {
        assignment_id: Some(assignment.id.clone()),
        capability_file: facade_dir.as_ref().map(|_| format!("{}/{}", contract::facade::ENVIRONMENT_DIR, contract::facade::CAPABILITY_NAME)),
        capability: facade_dir.is_none().then_some(capability),
        facade_url: Some(if facade_dir.is_some() { contract::facade::environment_socket_url() } else { settings.facade_url.clone() }),
        facade_spiffe_id: settings.facade_spiffe_id.clone(),
        spiffe_id: spiffe.then(|| assignment.identity.spiffe_id.clone()),
        spiffe_endpoint_socket: settings.spiffe_endpoint_socket.clone(),
        runner_labels_json: Some(Contract::labels_json(&placement::runner_labels(&assignment.runs_on))),
        gitea_url: settings.gitea_url.clone(),
    };
    EnvironmentSpec {
        assignment_id: assignment.id.clone(),
        name: name.to_owned(),
        labels: {
            let mut labels = driver::labels_for(&settings.instance, &assignment.id, placement);
            labels.insert(driver::LABEL_PROOF.to_owned(), key.prove(name));
            labels
        },
        env: contract.to_vars(),
        facade_dir,
    }
}

enum Placed {
    Done,
    PoolFull,
}

#[derive(Debug, thiserror::Error)]
enum PlaceError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Driver(#[from] driver::DriverError),
    #[error("stored envelope is invalid: {0}")]
    Envelope(String),
    #[error("the environment's facade directory: {0}")]
    Facade(String),
}
