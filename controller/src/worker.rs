//! A worker per placement: consumes its queue with an in-flight limit equal to the
//! pool capacity, and creates one environment per assignment.
//!
//! While the pool is full the delivery goes back with a delayed NAK, so no environment
//! beyond capacity is ever created and the message waits in the queue (not in memory).
//! Creation is idempotent (the name derives from the assignment id); the environment's
//! name is recorded on the assignment before the delivery is acknowledged, so a crash
//! at any point either redelivers (and finds the existing environment) or is done.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use tokio_util::sync::CancellationToken;

use crate::{
    capability::CapabilityKey,
    driver::{self, Driver, EnvironmentSpec, LABEL_PLACEMENT, Phase},
    placement::Placement,
    pool::Pool,
    store::{Delivery, State, Store, StoreError, now_ms},
};

/// What environments need to reach the facade and prove who they are.
#[derive(Debug, Clone)]
pub struct EnvironmentContract {
    /// CI_RUNNER_FACADE_URL, e.g. `https://controller:9443` or `unix:///run/gdr/facade.sock`.
    pub facade_url: String,
    /// CI_RUNNER_FACADE_SPIFFE_ID (empty without SPIFFE).
    pub facade_spiffe_id: String,
    /// SPIFFE_ENDPOINT_SOCKET inside the environment (empty without SPIFFE).
    pub spiffe_endpoint_socket: String,
    pub capability_ttl: Duration,
}

#[derive(Debug)]
pub struct Worker {
    pub placement: Placement,
    store: Arc<dyn Store>,
    driver: Arc<dyn Driver>,
    pool: Arc<Pool>,
    key: Arc<CapabilityKey>,
    contract: EnvironmentContract,
    trust_domain: String,
    /// How long a delivery waits when the pool is full.
    nak_delay: Duration,
}

impl Worker {
    pub fn new(
        store: Arc<dyn Store>,
        driver: Arc<dyn Driver>,
        pool: Arc<Pool>,
        key: Arc<CapabilityKey>,
        contract: EnvironmentContract,
        trust_domain: String,
    ) -> Self {
        Worker { placement: driver.placement(), store, driver, pool, key, contract, trust_domain, nak_delay: Duration::from_secs(2) }
    }

    pub fn with_nak_delay(mut self, delay: Duration) -> Self {
        self.nak_delay = delay;
        self
    }

    /// Rebuilds the pool from the driver's listing: every live environment of this
    /// placement holds a slot.
    ///
    /// # Errors
    /// When the driver cannot list.
    pub async fn recover(&self) -> Result<usize, driver::DriverError> {
        let selector = BTreeMap::from([(LABEL_PLACEMENT.to_owned(), self.placement.to_string())]);
        let mut adopted = 0;
        for environment in self.driver.list(&selector).await? {
            if environment.phase == Phase::Running {
                self.pool.adopt(&environment.assignment_id);
                adopted += 1;
            }
        }
        tracing::info!(placement = %self.placement, adopted, capacity = self.pool.capacity(), "pool rebuilt from the driver");
        Ok(adopted)
    }

    /// Consumes until `shutdown`.
    ///
    /// # Errors
    /// When the consumer cannot be created.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) -> Result<(), StoreError> {
        let mut consumer = self.store.consumer(&self.placement.to_string(), self.pool.capacity()).await?;
        while !shutdown.is_cancelled() {
            let next = tokio::select! {
                () = shutdown.cancelled() => break,
                next = consumer.next(Duration::from_secs(1)) => next,
            };
            match next {
                Ok(Some(delivery)) => self.handle(delivery).await,
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(placement = %self.placement, %error, "queue unavailable; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
        Ok(())
    }

    async fn handle(&self, delivery: Box<dyn Delivery>) {
        let assignment_id = delivery.assignment_id().to_owned();
        match self.place(&assignment_id).await {
            Ok(Placed::Done) => {
                if let Err(error) = delivery.ack().await {
                    tracing::warn!(%assignment_id, %error, "ack failed; the delivery will come again and find the environment");
                }
            }
            Ok(Placed::PoolFull) => {
                tracing::debug!(%assignment_id, placement = %self.placement, "pool full; the assignment waits in the queue");
                let _ = delivery.nak(self.nak_delay).await;
            }
            Err(error) => {
                tracing::warn!(%assignment_id, %error, "creating the environment failed; retrying later");
                let _ = delivery.nak(self.nak_delay).await;
            }
        }
    }

    async fn place(&self, assignment_id: &str) -> Result<Placed, PlaceError> {
        let Some(mut record) = self.store.get(assignment_id).await? else {
            tracing::warn!(%assignment_id, "queued assignment has no record; dropping the message");
            return Ok(Placed::Done);
        };
        if matches!(record.value.state, State::Terminal { .. }) {
            return Ok(Placed::Done);
        }
        let name = driver::environment_name(assignment_id);
        if record.value.environment.is_some() && self.driver.get(&name).await?.is_some() {
            self.pool.adopt(assignment_id);
            return Ok(Placed::Done);
        }
        if !self.pool.try_acquire(assignment_id) {
            return Ok(Placed::PoolFull);
        }
        let spec = self.spec(assignment_id, &record.value.envelope, &name)?;
        crate::failpoint::hit("before-create");
        let environment = match self.driver.create(&spec).await {
            Ok(environment) => environment,
            Err(error) => {
                self.pool.release(assignment_id);
                return Err(error.into());
            }
        };
        // Record the recovery metadata before acknowledging; re-read on conflicts
        // (the facade may have claimed meanwhile).
        loop {
            record.value.environment = Some(environment.name.clone());
            record.value.updated_at_ms = now_ms();
            match self.store.update(&record.value, record.revision).await {
                Ok(_) => break,
                Err(StoreError::Conflict { .. }) => match self.store.get(assignment_id).await? {
                    Some(fresh) => record = fresh,
                    None => break,
                },
                Err(error) => return Err(error.into()),
            }
        }
        tracing::info!(%assignment_id, environment = %environment.name, placement = %self.placement, "environment created");
        Ok(Placed::Done)
    }

    fn spec(&self, assignment_id: &str, envelope: &[u8], name: &str) -> Result<EnvironmentSpec, PlaceError> {
        let assignment = crate::envelope::Assignment::decode(envelope, &self.trust_domain)
            .map_err(|error| PlaceError::Envelope(crate::error_chain(&error)))?;
        let expires = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
            .saturating_add(self.contract.capability_ttl.as_secs());
        let labels = crate::placement::runner_labels(self.placement);
        let env = BTreeMap::from([
            ("CI_ASSIGNMENT_ID".to_owned(), assignment_id.to_owned()),
            ("CI_RUNNER_CAPABILITY".to_owned(), self.key.issue(assignment_id, expires)),
            ("CI_RUNNER_FACADE_URL".to_owned(), self.contract.facade_url.clone()),
            ("CI_RUNNER_FACADE_SPIFFE_ID".to_owned(), self.contract.facade_spiffe_id.clone()),
            ("CI_SPIFFE_ID".to_owned(), assignment.identity.spiffe_id.clone()),
            ("CI_RUNNER_LABELS_JSON".to_owned(), serde_json::to_string(&labels).unwrap_or_else(|_| "[]".into())),
            ("SPIFFE_ENDPOINT_SOCKET".to_owned(), self.contract.spiffe_endpoint_socket.clone()),
        ]);
        Ok(EnvironmentSpec {
            assignment_id: assignment_id.to_owned(),
            name: name.to_owned(),
            labels: driver::labels_for(assignment_id, self.placement),
            env,
        })
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
}
