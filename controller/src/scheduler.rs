//! The scheduler: N concurrent FetchTask loops (N = the sum of the pool capacities)
//! that turn Gitea tasks into persisted assignments.
//!
//! A task Gitea hands over is already assigned to this runner: nobody else will run
//! it. So each one is either persisted before its loop fetches again (a failed
//! persist is retried, for that assignment only, until it succeeds or shutdown), or,
//! when it cannot run here at all (labels break the placement rules, unparsable
//! workflow, placement not enabled), failed in Gitea at once with a log line that
//! says why — never left to Gitea's zombie timeout.

use std::{
    sync::{
        Arc,
        atomic::{AtomicI64, Ordering},
    },
    time::Duration,
};

use proto::runner::v1::Task;
use tokio_util::sync::CancellationToken;

use crate::{
    envelope::Assignment,
    gitea::{Gitea, GiteaError},
    placement::Placement,
    store::{Record, State, Store, now_ms},
};

/// Settings of the fetch loops.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub trust_domain: String,
    /// Placements whose pools exist here.
    pub enabled: Vec<Placement>,
    /// Number of concurrent FetchTask loops.
    pub loops: usize,
    /// Pause after an empty FetchTask (gitea-runner's fetch_interval is 2 s).
    pub fetch_interval: Duration,
    /// Per-call deadline of FetchTask.
    pub fetch_timeout: Duration,
}

/// What one loop did with one task, for tests and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// `latency`: from FetchTask's reply to the store's confirmation.
    Persisted { assignment_id: String, placement: String, latency: Duration },
    AlreadyPersisted { assignment_id: String },
    Rejected { task_id: i64, reason: String },
}

#[derive(Debug)]
pub struct Scheduler {
    gitea: Gitea,
    store: Arc<dyn Store>,
    config: SchedulerConfig,
    /// The highest tasks_version seen, shared by all loops (reference §2.5).
    tasks_version: AtomicI64,
    observer: Option<tokio::sync::mpsc::UnboundedSender<Outcome>>,
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

impl Scheduler {
    pub fn new(gitea: Gitea, store: Arc<dyn Store>, config: SchedulerConfig) -> Self {
        Scheduler { gitea, store, config, tasks_version: AtomicI64::new(0), observer: None, metrics: None }
    }

    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Reports every outcome on `observer` (tests, metrics).
    pub fn with_observer(mut self, observer: tokio::sync::mpsc::UnboundedSender<Outcome>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Runs the loops until `shutdown`; every loop is joined before returning.
    ///
    /// # Errors
    /// When Gitea says the runner is no longer registered: nothing can continue.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) -> Result<(), GiteaError> {
        let mut loops = tokio::task::JoinSet::new();
        for index in 0..self.config.loops.max(1) {
            let scheduler = Arc::clone(&self);
            let shutdown = shutdown.clone();
            loops.spawn(async move { scheduler.fetch_loop(index, shutdown).await });
        }
        let mut outcome = Ok(());
        while let Some(joined) = loops.join_next().await {
            match joined {
                Ok(Err(error)) => {
                    // One loop hit a final error: stop the others too.
                    shutdown.cancel();
                    outcome = Err(error);
                }
                Ok(Ok(())) => {}
                Err(error) => tracing::error!(%error, "a fetch loop panicked"),
            }
        }
        outcome
    }

    async fn fetch_loop(&self, index: usize, shutdown: CancellationToken) -> Result<(), GiteaError> {
        let mut failures = 0u32;
        while !shutdown.is_cancelled() {
            let version = self.tasks_version.load(Ordering::SeqCst);
            let fetched = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                fetched = self.gitea.fetch_task(version, self.config.fetch_timeout) => fetched,
            };
            match fetched {
                Ok(response) => {
                    failures = 0;
                    self.tasks_version.fetch_max(response.tasks_version, Ordering::SeqCst);
                    match response.task {
                        Some(task) => {
                            crate::failpoint::hit("after-fetch");
                            // Like gitea-runner: after a task, ask again for real next time.
                            self.tasks_version.store(0, Ordering::SeqCst);
                            self.handle(task, &shutdown).await;
                        }
                        None => sleep_or_stop(self.config.fetch_interval, &shutdown).await,
                    }
                }
                Err(error @ GiteaError::Unregistered { .. }) => return Err(error),
                Err(error) => {
                    failures += 1;
                    let delay = backoff(failures);
                    if failures == 1 {
                        tracing::warn!(loop_index = index, %error, "FetchTask failed; backing off");
                    } else {
                        tracing::debug!(loop_index = index, %error, failures, "FetchTask still failing");
                    }
                    sleep_or_stop(delay, &shutdown).await;
                }
            }
        }
        Ok(())
    }

    async fn handle(&self, task: Task, shutdown: &CancellationToken) {
        let fetched_at_ms = now_ms();
        let fetched = std::time::Instant::now();
        let task_id = task.id;
        let assignment = match Assignment::from_task(task, &self.config.trust_domain) {
            Ok(assignment) => assignment,
            Err(error) => {
                let reason = crate::error_chain(&error);
                self.reject(task_id, &reason).await;
                return;
            }
        };
        if !self.config.enabled.contains(&assignment.placement) {
            let reason = format!(
                "placement {} is not enabled on this controller (enabled: {})",
                assignment.placement,
                self.config.enabled.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
            );
            self.reject(task_id, &reason).await;
            return;
        }
        let record = Record {
            assignment_id: assignment.id.clone(),
            placement: assignment.placement.to_string(),
            state: State::Pending,
            envelope: assignment.encode(),
            environment: None,
            updated_at_ms: now_ms(),
            created_at_ms: fetched_at_ms,
        };
        let mut attempt = 0u32;
        loop {
            match self.store.persist(&record).await {
                Ok(created) => {
                    tracing::info!(assignment_id = %record.assignment_id, task_id, placement = %record.placement, created, "assignment persisted");
                    self.observe(if created {
                        Outcome::Persisted { assignment_id: record.assignment_id.clone(), placement: record.placement.clone(), latency: fetched.elapsed() }
                    } else {
                        Outcome::AlreadyPersisted { assignment_id: record.assignment_id.clone() }
                    });
                    return;
                }
                Err(error) => {
                    attempt += 1;
                    if let Some(metrics) = &self.metrics {
                        metrics.error(error.metric_label());
                    }
                    // The task is ours alone now: keep trying, this assignment only.
                    tracing::warn!(assignment_id = %record.assignment_id, task_id, attempt, %error, "persisting failed; retrying");
                    if shutdown.is_cancelled() && attempt > 20 {
                        tracing::error!(assignment_id = %record.assignment_id, task_id, "giving up on persisting at shutdown; Gitea will time the task out");
                        return;
                    }
                    tokio::time::sleep(backoff(attempt)).await;
                }
            }
        }
    }

    /// Fails a task in Gitea at once, with the reason in its log.
    async fn reject(&self, task_id: i64, reason: &str) {
        tracing::error!(task_id, "task cannot run here, failing it in Gitea: {reason}");
        if let Err(error) = self.gitea.fail_task(task_id, &format!("this job cannot run: {reason}")).await {
            tracing::error!(task_id, %error, "could not fail the task in Gitea; it will time out there");
        }
        self.observe(Outcome::Rejected { task_id, reason: reason.to_owned() });
    }

    fn observe(&self, outcome: Outcome) {
        if let Some(metrics) = &self.metrics {
            match &outcome {
                Outcome::Persisted { .. } => {
                    metrics.assignments_persisted.inc();
                }
                Outcome::Rejected { .. } => {
                    metrics.tasks_rejected.inc();
                }
                Outcome::AlreadyPersisted { .. } => {}
            }
        }
        if let Some(observer) = &self.observer {
            let _ = observer.send(outcome);
        }
    }
}

async fn sleep_or_stop(delay: Duration, shutdown: &CancellationToken) {
    tokio::select! {
        () = shutdown.cancelled() => {}
        () = tokio::time::sleep(delay) => {}
    }
}

/// 200 ms doubling to 10 s.
fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(200).saturating_mul(1 << attempt.saturating_sub(1).min(6)).min(Duration::from_secs(10))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_ten_seconds() {
        let delays: Vec<u64> = (1..=8).map(|n| backoff(n).as_millis() as u64).collect();
        assert_eq!(delays, [200, 400, 800, 1600, 3200, 6400, 10000, 10000]);
    }
}
