//! The reconciler of one placement: environments are the truth for what runs, the
//! store for what should. It settles each environment the driver reports as changed
//! (at once, from the worker's watch) and sweeps all of them now and then:
//!
//! - an environment without a live assignment (orphan, or its assignment finished
//!   longer ago than the retire grace) is deleted;
//! - an environment that ended (or disappeared) before its claim is deleted and made
//!   again — the task is intact, nothing of it ran — up to [`MAX_ATTEMPTS`] times, then
//!   its task fails with the reason;
//! - an environment that ended after the claim while its assignment was not finished
//!   fails the task in Gitea, with the backend's reason and the environment's last
//!   reported phase as the last line of the job's log, and is deleted;
//! - a claimed assignment whose environment disappeared is failed the same way;
//! - a pending assignment whose queue message was lost is queued again;
//! - what the driver keeps beside gone environments (SPIRE entries) is removed.
//!
//! Every deletion releases the pool slot; so does an environment that is gone from the
//! listing (removed by another replica, or vanished).

use std::{sync::Arc, time::Duration};

use crate::{
    driver::{Driver, Environment, LABEL_INSTANCE, Phase},
    lifecycle::{self, Lifecycle},
    metrics::EndedBy,
    placements::PlacementState,
    store::{Record, State, Store, StoreError, now_ms},
};

/// A pending record is queued again once it is this old and still has no environment
/// (a delivered one gets its environment within a second or two, unless its pool is full,
/// and then it keeps its one message)…
const REQUEUE_AFTER: Duration = Duration::from_secs(30);
/// …and no longer than the stream's duplicate window (one hour), less a margin, so that
/// the copy is always dropped while the first message exists.
const REQUEUE_UNTIL: Duration = Duration::from_secs(50 * 60);

/// Environments one assignment may get before its claim: a registry's rate limit or a
/// node that could not start a container gets a few more tries, a broken image not many.
pub const MAX_ATTEMPTS: u32 = 3;

#[derive(Debug)]
pub struct Reconciler {
    served: Arc<PlacementState>,
    driver: Arc<dyn Driver>,
    store: Arc<dyn Store>,
    lifecycle: Lifecycle,
    /// Only this installation's environments are ours to settle…
    instance: String,
    /// …and of those only the ones it can prove it made (`driver::LABEL_PROOF`).
    key: Arc<crate::assignment::capability::CapabilityKey>,
    /// Environments already reported as not provably ours (reported once each).
    foreign: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl Reconciler {
    pub fn new(
        served: Arc<PlacementState>,
        driver: Arc<dyn Driver>,
        store: Arc<dyn Store>,
        lifecycle: Lifecycle,
        instance: String,
        key: Arc<crate::assignment::capability::CapabilityKey>,
    ) -> Self {
        Reconciler { served, driver, store, lifecycle, instance, key, foreign: std::sync::Mutex::default() }
    }

    /// Whether this installation made `environment`: its name and label, and the proof
    /// only the holder of the capability key can write. Anything else — another
    /// installation that chose the same name, an environment copied by hand — is never
    /// removed nor counted; it is reported once.
    pub fn made_here(&self, environment: &Environment) -> bool {
        let named = environment.labels.get(LABEL_INSTANCE).map(String::as_str) == Some(self.instance.as_str());
        let proven = environment.labels.get(crate::driver::LABEL_PROOF).is_some_and(|proof| self.key.proves(&environment.name, proof));
        if named && !proven && self.foreign.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(environment.name.clone()) {
            tracing::warn!(
                environment = %environment.name,
                installation = %self.instance,
                "an environment carries this installation's name but not its proof: another installation uses the same name (set gitea.installation \
                 apart) or holds another capability key; it is left alone"
            );
        }
        named && proven
    }

    /// Whether `name` is the environment of the record's current attempt.
    fn current_attempt(&self, record: &Record, name: &str) -> bool {
        crate::driver::attempt_name(&self.instance, &record.assignment_id, record.attempts) == name
    }

    /// One pass over the placement's environments and started assignments; returns
    /// how many environments it removed.
    ///
    /// # Errors
    /// When the store cannot be read.
    pub async fn sweep(&self) -> Result<usize, StoreError> {
        let placement = self.served.placement;
        let selector = crate::driver::selector(&self.instance, self.served.placement);
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
        let environments: Vec<Environment> = environments.into_iter().filter(|e| self.made_here(e)).collect();
        let mut removed = 0;
        let mut present = std::collections::HashSet::new();
        for environment in &environments {
            if self.settle(environment.clone()).await {
                removed += 1;
            } else {
                present.insert(environment.assignment_id.clone());
            }
        }
        for id in self.served.pool.release_absent(&present, listed_at) {
            tracing::info!(%placement, assignment.id = %id, "pool slot released: its environment is gone");
        }
        let now_ms = now_ms();
        for record in self.store.list().await? {
            let record = record.value;
            if record.placement != placement || record.is_terminal() {
                continue;
            }
            let Some(name) = record.environment.clone() else {
                if record.state == State::Pending {
                    self.requeue_if_stranded(&record, now_ms).await;
                }
                continue;
            };
            if environments.iter().any(|e| e.name == name) {
                continue;
            }
            // Listed before the record was read: ask once more before calling it gone.
            if let Ok(None) = self.driver.get(&name).await {
                let reason = format!("the job's environment {name} disappeared before the job finished{}", last_phase(&record));
                if record.state == State::Pending {
                    self.try_again(&record.assignment_id, &name, &format!("the job's environment {name} disappeared before it claimed the job")).await;
                } else if let Err(error) = self.lifecycle.fail(&record.assignment_id, EndedBy::Lost, &reason).await {
                    tracing::warn!(assignment.id = %record.assignment_id, error = %crate::error_chain(&error), "cannot fail the task yet");
                }
            }
        }
        Ok(removed)
    }

    /// An environment ended or vanished before its claim: nothing of the job ran and the
    /// task is intact, so the assignment is queued for a new environment — unless it had
    /// [`MAX_ATTEMPTS`] already, then its task fails with `reason`. Returns whether it
    /// is queued again (false: failed, or no longer pending — claimed meanwhile).
    async fn try_again(&self, assignment_id: &str, environment: &str, reason: &str) -> bool {
        let changed = crate::store::modify(self.store.as_ref(), assignment_id, |current| {
            let ours = current.state == State::Pending && current.environment.as_deref() == Some(environment) && current.attempts + 1 < MAX_ATTEMPTS;
            ours.then(|| current.next_attempt())
        })
        .await;
        match changed {
            Ok(Some(record)) if record.value.environment.is_none() && record.value.state == State::Pending => {
                self.served.pool.release(assignment_id);
                tracing::warn!(assignment.id = assignment_id, attempt = record.value.attempts + 1, "{reason}; making a new environment");
                if let Err(error) = self.store.requeue(&record.value, record.value.attempts).await {
                    // The stranded-record check queues it again at a later sweep.
                    tracing::warn!(assignment.id = assignment_id, error = %crate::error_chain(&error), "cannot queue the assignment again yet");
                }
                true
            }
            Ok(Some(record)) if record.value.state == State::Pending && record.value.environment.as_deref() == Some(environment) => {
                let reason = format!("{reason}; gave up after {MAX_ATTEMPTS} environments{}", last_phase(&record.value));
                if let Err(error) = self.lifecycle.fail(assignment_id, EndedBy::NotStarted, &reason).await {
                    tracing::warn!(assignment.id = assignment_id, error = %crate::error_chain(&error), "cannot fail the task yet");
                }
                false
            }
            Ok(_) => false,
            Err(error) => {
                tracing::warn!(assignment.id = assignment_id, error = %crate::error_chain(&error), "cannot record the new attempt yet");
                false
            }
        }
    }

    /// A pending record with no environment that is old enough to have been delivered is
    /// queued again: the scheduler writes the record, then the queue message, and a
    /// scheduler that died between the two (its publish timed out during a NATS leader
    /// election, found by the kill campaign) left a record nobody would ever deliver. The
    /// stream drops the copy while the first message is within its duplicate window (a
    /// record waiting for a slot keeps its one message), and the embedded store writes
    /// both in one transaction, so this never adds a second delivery.
    async fn requeue_if_stranded(&self, record: &Record, now_ms: i64) {
        // Since it was fetched, or since its last environment was given up.
        let since = if record.attempts > 0 { record.updated_at_ms } else { record.created_at_ms };
        let age = Duration::from_millis(u64::try_from(now_ms - since).unwrap_or(0));
        if record.environment.is_some() || age < REQUEUE_AFTER || age > REQUEUE_UNTIL {
            return;
        }
        if record.attempts > 0 {
            // Its first message was consumed: a new delivery under its attempt.
            if let Err(error) = self.store.requeue(record, record.attempts).await {
                tracing::warn!(assignment.id = %record.assignment_id, error = %crate::error_chain(&error), "cannot queue the pending record again");
            }
            return;
        }
        match self.store.persist(record).await {
            Ok(_) => tracing::debug!(assignment.id = %record.assignment_id, "pending record queued again (a no-op unless its message was lost)"),
            Err(error) => tracing::warn!(assignment.id = %record.assignment_id, error = %crate::error_chain(&error), "cannot queue the pending record again"),
        }
    }

    /// Settles one environment; returns whether it was removed.
    #[tracing::instrument(skip_all, fields(assignment.id = %environment.assignment_id))]
    pub async fn settle(&self, environment: Environment) -> bool {
        if !self.made_here(&environment) {
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
                tracing::info!(environment = %environment.name, assignment.id = %id, "environment without an assignment");
                true
            }
            (Some(record), _) if !record.is_terminal() && !self.current_attempt(record, &environment.name) => {
                // An earlier attempt's environment (listed before it was deleted, or one
                // a killed process left): never the job's, so neither its slot nor its
                // record is touched.
                tracing::info!(environment = %environment.name, assignment.id = %id, "environment of an earlier attempt");
                return self.driver.delete(&environment.name).await.is_ok();
            }
            (Some(record), Phase::Running) if record.is_terminal() => {
                // The lifecycle gives it a grace to end on its own; past that, stop it.
                let grace = i64::try_from(lifecycle::DEFAULT_RETIRE_GRACE.as_millis()).unwrap_or(i64::MAX);
                now_ms() - record.updated_at_ms > grace
            }
            (Some(_), Phase::Running) => {
                self.served.pool.adopt(&id);
                false
            }
            (Some(record), Phase::Exited | Phase::Terminal) if record.state == State::Pending => {
                // Deleted before the next attempt is queued, so that one slot holds one environment.
                if let Err(error) = self.driver.delete(&environment.name).await {
                    tracing::warn!(environment = %environment.name, %error, "cannot delete the environment yet");
                    return false;
                }
                let reason = format!("the job's environment {} ended before it claimed the job: {}", environment.name, environment.why_unclaimed());
                if !self.try_again(&id, &environment.name, &reason).await {
                    self.served.pool.release(&id);
                }
                return true;
            }
            (Some(record), Phase::Exited | Phase::Terminal) if !record.is_terminal() => {
                let reason = format!(
                    "the job's environment {} ended before the job finished: {}{}",
                    environment.name,
                    if environment.detail.is_empty() { "no reason given" } else { environment.detail.as_str() },
                    last_phase(record)
                );
                if let Err(error) = self.lifecycle.fail(&id, EndedBy::Lost, &reason).await {
                    tracing::warn!(assignment.id = %id, error = %crate::error_chain(&error), "cannot fail the task yet");
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
                self.served.pool.release(&id);
                tracing::info!(environment = %environment.name, assignment.id = %id, "environment deleted");
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
