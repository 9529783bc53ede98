//! The one place where an assignment ends ("finish assignment"), used by the facade,
//! the keep-alive, the reconciler and the worker:
//!
//! 1. the record becomes terminal (compare-and-set; finishing twice is harmless);
//! 2. at once, the placement's admission is released: the scheduler may take the next
//!    task from Gitea while this environment ends;
//! 3. the environment is retired in the background: it gets a grace period to end on
//!    its own (after its final report the runner exits and the supervisor drains),
//!    then it is stopped; its pool slot is released the moment it is no longer running
//!    (so the next environment starts then, and no more than `capacity` environments
//!    ever run), and it is deleted. The worker's watch of environment exits does the
//!    same when it sees the exit first; where this process has no driver for the
//!    placement, the worker that has one does it.
//!
//! [`Lifecycle::ended_by_gitea`] is the end Gitea announces in a reply (a cancel): if the
//! runner has not reported its own end by the time its environment is stopped, Gitea
//! is told (≥ 1.27 keeps such a task `cancelling` until then).
//!
//! [`Lifecycle::fail`] first writes the reason into the job's log in Gitea (as its last
//! line) and fails the task there, for the cases where nothing else will report: the
//! environment died, could not be made, or the task cannot run.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use proto::runner::v1::Result as TaskResult;
use tokio_util::task::TaskTracker;

use crate::{
    assignment::envelope,
    driver::{Driver, Phase},
    gitea::{self, registrations::Registrations},
    metrics::{EndedBy, JobPhase},
    placements::Placements,
    store::{self, Record, Store, StoreError},
};

/// How long a finished environment may take to end on its own before it is stopped.
pub const DEFAULT_RETIRE_GRACE: Duration = Duration::from_secs(15);
/// How long [`Lifecycle::finish`] keeps trying an unavailable store.
pub const FINISH_RETRY: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct Lifecycle {
    store: Arc<dyn Store>,
    placements: Placements,
    registrations: Registrations,
    retiring: TaskTracker,
    retire_grace: Duration,
    /// Assignments Gitea ended whose runner has not reported its own end yet.
    unreported: Arc<Mutex<HashSet<String>>>,
    /// Where each end is counted (by placement and result).
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

#[derive(Debug, thiserror::Error)]
pub enum LifecycleError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("no assignment {0}")]
    NotFound(String),
}

impl Lifecycle {
    pub fn new(store: Arc<dyn Store>, placements: Placements, registrations: Registrations) -> Self {
        Lifecycle {
            store,
            placements,
            registrations,
            retiring: TaskTracker::new(),
            retire_grace: DEFAULT_RETIRE_GRACE,
            unreported: Arc::default(),
            metrics: None,
        }
    }

    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    pub fn with_retire_grace(mut self, grace: Duration) -> Self {
        self.retire_grace = grace;
        self
    }

    /// Gitea has the task's final result (the runner reported it, or Gitea said the
    /// task is done): record it, release the slots, retire the environment.
    ///
    /// The store is retried for up to [`FINISH_RETRY`] while it is unavailable (a NATS node
    /// died and leaders are being elected): Gitea already has the result, and a record left
    /// unfinished would hold its placement's capacity until its environment ends.
    ///
    /// # Errors
    /// When the store cannot record it (the caller may retry; nothing was released).
    #[tracing::instrument(skip(self, assignment_id), fields(assignment.id = %assignment_id))]
    pub async fn finish(&self, assignment_id: &str, result: i32) -> Result<Record, LifecycleError> {
        self.end(assignment_id, result, None).await
    }

    /// Gitea answered a report with the task's end (`result`: a cancel) before the runner
    /// reported its own: finished as [`Lifecycle::finish`]; if the runner still has not
    /// reported when its environment is stopped, Gitea is told the end then.
    ///
    /// # Errors
    /// See [`Lifecycle::finish`].
    pub async fn ended_by_gitea(&self, assignment_id: &str, result: i32) -> Result<Record, LifecycleError> {
        self.unreported().insert(assignment_id.to_owned());
        self.finish(assignment_id, result).await
    }

    /// The runner reported the task's end itself.
    pub fn reported_end(&self, assignment_id: &str) {
        self.unreported().remove(assignment_id);
    }

    fn unreported(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.unreported.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// [`Lifecycle::finish`], keeping `reason` on the record for operators when the
    /// controller ends the job.
    async fn end(&self, assignment_id: &str, result: i32, ended_by: Option<(EndedBy, &str)>) -> Result<Record, LifecycleError> {
        let reason = ended_by.map(|(_, reason)| reason);
        let name = result_name(result);
        // When this call's write ended it: the claim's time (0 when never claimed).
        let ended_here: Mutex<Option<i64>> = Mutex::new(None);
        let deadline = tokio::time::Instant::now() + FINISH_RETRY;
        let mut pauses = contract::backoff::Backoff::new(Duration::from_millis(200), Duration::from_secs(2));
        let modified = contract::backoff::retry_until(
            deadline,
            &mut pauses,
            |error| matches!(error, StoreError::Unavailable { .. }),
            |_, _| tracing::warn!(assignment.id = assignment_id, "the store is unavailable; retrying to record the end"),
            || {
                store::modify(self.store.as_ref(), assignment_id, |current| {
                    let next = (!current.is_terminal()).then(|| current.ended(name.clone(), reason));
                    // Counted once, by the call whose write ended it.
                    *ended_here.lock().unwrap_or_else(PoisonError::into_inner) = next.as_ref().map(|_| current.claimed_at_ms());
                    next
                })
            },
        )
        .await;
        let record = modified?.ok_or_else(|| LifecycleError::NotFound(assignment_id.to_owned()))?.value;
        let ended_here = ended_here.lock().unwrap_or_else(PoisonError::into_inner).take();
        self.release(&record, ended_here.is_some());
        if let (Some(metrics), Some(claimed_at_ms)) = (&self.metrics, ended_here) {
            metrics.job_finished(&record.placement.to_string(), &name, ended_by.map(|(by, _)| by), claimed_at_ms, record.ended_at_ms);
        }
        tracing::info!(assignment.id = assignment_id, result = %name, "assignment finished");
        Ok(record)
    }

    /// Fails the task in Gitea with `reason` as the last line of its log, then
    /// finishes the assignment as failed. When Gitea cannot be told, the assignment is
    /// finished anyway (nothing here can run it any more) and Gitea times it out.
    ///
    /// # Errors
    /// When the store cannot record it.
    #[tracing::instrument(skip(self, assignment_id, reason), fields(assignment.id = %assignment_id))]
    pub async fn fail(&self, assignment_id: &str, ended_by: EndedBy, reason: &str) -> Result<Record, LifecycleError> {
        let record = self.store.get(assignment_id).await?.ok_or_else(|| LifecycleError::NotFound(assignment_id.to_owned()))?.value;
        if record.is_terminal() {
            self.release(&record, false);
            return Ok(record);
        }
        tracing::error!(assignment.id = assignment_id, reason, "failing the task");
        match (envelope::task_id_of(assignment_id), self.registrations.reports_for(&record.runner)) {
            (Some(task_id), Ok(reports)) => {
                if let Err(error) = gitea::fail_task(reports.as_ref(), task_id, reason).await {
                    tracing::error!(
                        assignment.id = assignment_id,
                        task_id,
                        error = %crate::error_chain(&error),
                        "could not fail the task in Gitea; Gitea will time it out"
                    );
                }
            }
            (_, Err(error)) => tracing::error!(assignment.id = assignment_id, %error, "cannot tell Gitea that the task failed"),
            (None, _) => tracing::error!(assignment.id = assignment_id, "not a Gitea task id; nothing to tell Gitea"),
        }
        self.end(assignment_id, TaskResult::Failure as i32, Some((ended_by, reason))).await
    }

    /// Frees what a terminal record held in this process (idempotent); `ended_here`: this
    /// process's write ended it, so its teardown is measured (once).
    fn release(&self, record: &Record, ended_here: bool) {
        let Some(runtime) = self.placements.get(record.placement) else { return };
        runtime.admission.release(&record.assignment_id);
        match (runtime.driver(), record.environment.clone()) {
            (Some(driver), Some(environment)) => {
                let (grace, runtime) = (self.retire_grace, Arc::clone(runtime));
                let (assignment_id, runner, result) = (record.assignment_id.clone(), record.runner.clone(), record.result_code());
                let (unreported, registrations) = (Arc::clone(&self.unreported), self.registrations.clone());
                let teardown = self.metrics.clone().filter(|_| ended_here).map(|metrics| (metrics, record.placement.to_string(), record.ended_at_ms));
                self.retiring.spawn(async move {
                    retire(driver.as_ref(), &environment, &assignment_id, grace, || {
                        runtime.pool.release(&assignment_id);
                        if let Some((metrics, placement, ended_at_ms)) = teardown {
                            metrics.job_phase(&placement, JobPhase::Teardown, ended_at_ms, crate::clock::now_ms());
                        }
                    })
                    .await;
                    let untold = unreported.lock().unwrap_or_else(PoisonError::into_inner).remove(&assignment_id);
                    if let (true, Some(task_id), Ok(reports), Some(result)) =
                        (untold, envelope::task_id_of(&assignment_id), registrations.reports_for(&runner), result)
                    {
                        match gitea::close_task(reports.as_ref(), task_id, result).await {
                            Ok(()) => tracing::info!(assignment.id = %assignment_id, task_id, "the runner did not report the end Gitea announced; told Gitea"),
                            Err(error) => {
                                tracing::warn!(assignment.id = %assignment_id, task_id, error = %crate::error_chain(&error), "cannot tell Gitea the end of the task")
                            }
                        }
                    }
                });
            }
            // No environment (yet): nothing runs, the slot is free.
            (_, None) => {
                runtime.pool.release(&record.assignment_id);
            }
            // Another process's worker retires it and frees its slot.
            (None, Some(_)) => {}
        }
    }

    /// Waits (bounded) for the environments being retired.
    pub async fn drain(&self, limit: Duration) {
        self.retiring.close();
        if tokio::time::timeout(limit, self.retiring.wait()).await.is_err() {
            tracing::warn!(?limit, "environments still being retired at shutdown; the reconciler removes them on the next start");
        }
    }
}

/// Lets a finished environment end on its own for `grace`, then stops it; calls
/// `stopped` once it no longer runs (before the deletion, which may take longer), then
/// deletes it.
pub async fn retire(driver: &dyn Driver, name: &str, assignment_id: &str, grace: Duration, stopped: impl FnOnce()) {
    let deadline = tokio::time::Instant::now() + grace;
    loop {
        match driver.get(name).await {
            Ok(None) => {
                stopped();
                return;
            }
            Ok(Some(environment)) if environment.phase != Phase::Running => break,
            Ok(Some(_)) | Err(_) if tokio::time::Instant::now() >= deadline => break,
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let outcome = match driver.get(name).await {
        // Stops it (the supervisor drains within its timeout) and deletes it.
        Ok(Some(environment)) if environment.phase == Phase::Running => {
            let outcome = driver.stop(name).await;
            if outcome.is_ok() {
                stopped();
            }
            outcome
        }
        _ => {
            stopped();
            driver.delete(name).await
        }
    };
    match outcome {
        Ok(()) => tracing::debug!(environment = name, assignment.id = assignment_id, "environment removed"),
        Err(error) => tracing::warn!(environment = name, assignment.id = assignment_id, %error, "cannot remove the environment yet; the reconciler will"),
    }
}

/// `RESULT_SUCCESS`, … as stored in terminal records.
pub fn result_name(result: i32) -> String {
    TaskResult::try_from(result).map_or("RESULT_UNKNOWN", |r| r.as_str_name()).to_owned()
}
