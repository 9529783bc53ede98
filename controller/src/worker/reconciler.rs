//! The reconciler of one placement: environments are the truth for what runs, the
//! store for what should. It settles each environment the driver reports as changed
//! (at once, from the worker's watch) and sweeps all of them now and then:
//!
//! - an environment without a live assignment (orphan, or its assignment finished
//!   longer ago than the retire grace) is deleted;
//! - an environment that ended while its assignment was not finished fails the task in
//!   Gitea, with the backend's reason and the environment's last reported phase as the
//!   last line of the job's log, and is deleted;
//! - a started assignment whose environment disappeared is failed the same way;
//! - a pending assignment whose queue message was lost is queued again;
//! - what the driver keeps beside gone environments (SPIRE entries) is removed.
//!
//! Every deletion releases the pool slot; so does an environment that is gone from the
//! listing (removed by another replica, or vanished).

use std::{sync::Arc, time::Duration};

use crate::{
    driver::{Driver, Environment, LABEL_INSTANCE, Phase},
    lifecycle::{self, Lifecycle},
    placements::PlacementRuntime,
    store::{Record, State, Store, StoreError, now_ms},
};

/// A pending record is queued again once it is this old and still has no environment
/// (a delivered one gets its environment within a second or two, unless its pool is full,
/// and then it keeps its one message)…
const REQUEUE_AFTER: Duration = Duration::from_secs(30);
/// …and no longer than the stream's duplicate window (one hour), less a margin, so that
/// the copy is always dropped while the first message exists.
const REQUEUE_UNTIL: Duration = Duration::from_secs(50 * 60);

#[derive(Debug)]
pub struct Reconciler {
    runtime: Arc<PlacementRuntime>,
    driver: Arc<dyn Driver>,
    store: Arc<dyn Store>,
    lifecycle: Lifecycle,
    /// Only this installation's environments are ours to settle.
    instance: String,
}

impl Reconciler {
    pub fn new(runtime: Arc<PlacementRuntime>, driver: Arc<dyn Driver>, store: Arc<dyn Store>, lifecycle: Lifecycle, instance: String) -> Self {
        Reconciler { runtime, driver, store, lifecycle, instance }
    }

    /// One pass over the placement's environments and started assignments; returns
    /// how many environments it removed.
    ///
    /// # Errors
    /// When the store cannot be read.
    pub async fn sweep(&self) -> Result<usize, StoreError> {
        let placement = self.runtime.placement;
        let selector = crate::driver::selector(&self.instance, self.runtime.placement);
        let listed_at = std::time::Instant::now();
        let environments = match self.driver.list(&selector).await {
            Ok(environments) => environments,
            Err(error) => {
                tracing::warn!(%placement, %error, "cannot list environments");
                return Ok(0);
            }
        };
        if let Err(error) = self.driver.sweep_leftovers(&environments).await {
            tracing::warn!(%placement, %error, "cannot sweep what belonged to gone environments");
        }
        let mut removed = 0;
        let mut present = std::collections::HashSet::new();
        for environment in &environments {
            if self.settle(environment.clone()).await {
                removed += 1;
            } else {
                present.insert(environment.assignment_id.clone());
            }
        }
        for id in self.runtime.pool.release_absent(&present, listed_at) {
            tracing::info!(%placement, assignment_id = %id, "pool slot released: its environment is gone");
        }
        let now_ms = now_ms();
        for record in self.store.list().await? {
            let record = record.value;
            if record.placement != placement || record.is_terminal() {
                continue;
            }
            if record.state == State::Pending {
                self.requeue_if_stranded(&record, now_ms).await;
                continue;
            }
            let Some(name) = record.environment.clone() else { continue };
            if environments.iter().any(|e| e.name == name) {
                continue;
            }
            // Listed before the record was read: ask once more before calling it gone.
            if let Ok(None) = self.driver.get(&name).await {
                let reason = format!("the job's environment {name} disappeared before the job finished{}", last_phase(&record));
                if let Err(error) = self.lifecycle.fail(&record.assignment_id, &reason).await {
                    tracing::warn!(assignment_id = %record.assignment_id, "cannot fail the task yet: {}", crate::error_chain(&error));
                }
            }
        }
        Ok(removed)
    }

    /// A pending record with no environment that is old enough to have been delivered is
    /// queued again: the scheduler writes the record, then the queue message, and a
    /// scheduler that died between the two (its publish timed out during a NATS leader
    /// election, found by the kill campaign) left a record nobody would ever deliver. The
    /// stream drops the copy while the first message is within its duplicate window (a
    /// record waiting for a slot keeps its one message), and the embedded store writes
    /// both in one transaction, so this never adds a second delivery.
    async fn requeue_if_stranded(&self, record: &Record, now_ms: i64) {
        let age = Duration::from_millis(u64::try_from(now_ms - record.created_at_ms).unwrap_or(0));
        if record.environment.is_some() || age < REQUEUE_AFTER || age > REQUEUE_UNTIL {
            return;
        }
        match self.store.persist(record).await {
            Ok(_) => tracing::debug!(assignment_id = %record.assignment_id, "pending record queued again (a no-op unless its message was lost)"),
            Err(error) => tracing::warn!(assignment_id = %record.assignment_id, "cannot queue the pending record again: {}", crate::error_chain(&error)),
        }
    }

    /// Settles one environment; returns whether it was removed.
    #[tracing::instrument(skip_all, fields(assignment.id = %environment.assignment_id))]
    pub async fn settle(&self, environment: Environment) -> bool {
        if environment.labels.get(LABEL_INSTANCE).map(String::as_str) != Some(self.instance.as_str()) {
            return false;
        }
        let id = environment.assignment_id.clone();
        let record = match self.store.get(&id).await {
            Ok(record) => record.map(|r| r.value),
            Err(error) => {
                tracing::warn!(environment = %environment.name, %error, "cannot read the assignment; settling later");
                return false;
            }
        };
        let remove = match (&record, environment.phase) {
            (None, _) => {
                tracing::info!(environment = %environment.name, assignment_id = %id, "environment without an assignment");
                true
            }
            (Some(record), Phase::Running) if record.is_terminal() => {
                // The lifecycle gives it a grace to end on its own; past that, stop it.
                let grace = i64::try_from(lifecycle::DEFAULT_RETIRE_GRACE.as_millis()).unwrap_or(i64::MAX);
                now_ms() - record.updated_at_ms > grace
            }
            (Some(_), Phase::Running) => {
                self.runtime.pool.adopt(&id);
                false
            }
            (Some(record), Phase::Exited | Phase::Terminal) if !record.is_terminal() => {
                let reason = format!(
                    "the job's environment {} ended before the job finished: {}{}",
                    environment.name,
                    if environment.detail.is_empty() { "no reason given" } else { environment.detail.as_str() },
                    last_phase(record)
                );
                if let Err(error) = self.lifecycle.fail(&id, &reason).await {
                    tracing::warn!(assignment_id = %id, "cannot fail the task yet: {}", crate::error_chain(&error));
                    return false;
                }
                true
            }
            (Some(_), Phase::Exited | Phase::Terminal) => true,
        };
        if !remove {
            return false;
        }
        let deleted = if environment.phase == Phase::Running { self.driver.stop(&environment.name).await } else { self.driver.delete(&environment.name).await };
        match deleted {
            Ok(()) => {
                self.runtime.pool.release(&id);
                tracing::info!(environment = %environment.name, assignment_id = %id, "environment deleted");
                true
            }
            Err(error) => {
                tracing::warn!(environment = %environment.name, %error, "cannot delete the environment");
                false
            }
        }
    }
}

/// "; it last reported: failed: dockerd: …".
fn last_phase(record: &Record) -> String {
    record.phase.as_deref().map_or_else(String::new, |phase| format!("; it last reported: {phase}"))
}
