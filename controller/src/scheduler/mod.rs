//! The scheduler: for each placement's Gitea registration, FetchTask loops that turn
//! tasks into persisted assignments — only while the placement's [`Admission`](crate::placements::Admission) has
//! room. A task Gitea hands over is "running" there from that moment and cannot be
//! handed back, so a full placement stops fetching and its backlog waits in Gitea.
//!
//! A task Gitea hands over is ours alone: it is either persisted before its loop
//! fetches again (a failed persist is retried, for that assignment only, until it
//! succeeds or shutdown), or, when it cannot run here at all (labels break the
//! placement rules, unparsable workflow, placement not enabled), failed in Gitea at
//! once with a log line that says why — never left to Gitea's zombie timeout.
//!
//! [`keepalive`] reports for assignments nobody reports on yet.

pub mod keepalive;
pub mod wake;

use std::{
    sync::{
        Arc,
        atomic::{AtomicI64, Ordering},
    },
    time::Duration,
};

use contract::backoff::Backoff;
use proto::runner::v1::Task;
use tokio_util::sync::CancellationToken;

use crate::{
    assignment::{Assignment, Placement, Rules},
    gitea::{self, Gitea, GiteaError, TaskReports},
    metrics::ErrorSource,
    placements::{Placements, Ticket},
    store::{Record, Store, now_ms},
};

/// Settings of the fetch loops.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub rules: Rules,
    /// Pause after an empty FetchTask right after work was seen.
    pub fetch_interval: Duration,
    /// The longest pause while idle: an idle loop asks Gitea no more often than this.
    pub fetch_interval_max: Duration,
    /// Per-call deadline of FetchTask.
    pub fetch_timeout: Duration,
    /// Upper bound of concurrent FetchTask loops per registration (below capacity).
    pub max_loops: usize,
}

/// How long a scheduler's lease on its registration lasts without renewal: a standby
/// scheduler takes over this long after the active one died.
pub const LEASE_TTL: Duration = Duration::from_secs(15);

/// What one loop did with one task, for tests and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// `latency`: from FetchTask's reply to the store's confirmation.
    Persisted {
        assignment_id: String,
        placement: Placement,
        latency: Duration,
    },
    AlreadyPersisted {
        assignment_id: String,
    },
    Rejected {
        task_id: i64,
        reason: String,
    },
}

/// The fetch loops of one registration.
#[derive(Debug)]
pub struct Scheduler {
    /// The placement whose registration fetches here.
    placement: Placement,
    gitea: Gitea,
    store: Arc<dyn Store>,
    placements: Placements,
    config: SchedulerConfig,
    /// The tasks_version this registration's loops send, shared as gitea-runner's poller
    /// shares it (see [`note_reply`]).
    tasks_version: AtomicI64,
    observer: Option<tokio::sync::mpsc::UnboundedSender<Outcome>>,
    metrics: Option<Arc<crate::metrics::Metrics>>,
    /// This scheduler's name in the registration's lease.
    holder: String,
    lease_ttl: Duration,
    /// Until when this scheduler surely holds the lease (renewed at half-life).
    leading_until: std::sync::Mutex<Option<tokio::time::Instant>>,
    /// One renewal at a time among this scheduler's loops.
    renewing: tokio::sync::Mutex<()>,
    /// Gitea's "a job was queued" (webhook): idle loops fetch at once.
    wake: Option<wake::Wake>,
}

impl Scheduler {
    pub fn new(placement: Placement, gitea: Gitea, store: Arc<dyn Store>, placements: Placements, config: SchedulerConfig) -> Self {
        let holder = crate::assignment::capability::random_token().unwrap_or_else(|_| format!("pid-{}", std::process::id()));
        Scheduler {
            placement,
            gitea,
            store,
            placements,
            config,
            tasks_version: AtomicI64::new(0),
            observer: None,
            metrics: None,
            holder,
            lease_ttl: LEASE_TTL,
            leading_until: std::sync::Mutex::new(None),
            renewing: tokio::sync::Mutex::new(()),
            wake: None,
        }
    }

    /// Idle loops fetch at once when `wake` fires (Gitea's `workflow_job` webhook).
    pub fn with_wake(mut self, wake: wake::Wake) -> Self {
        self.wake = Some(wake);
        self
    }

    pub fn with_lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    fn lease_name(&self) -> String {
        format!("scheduler.{}", self.placement)
    }

    fn leading_until(&self) -> Option<tokio::time::Instant> {
        *self.leading_until.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set_leading_until(&self, until: Option<tokio::time::Instant>) {
        *self.leading_until.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = until;
    }

    /// Waits until this scheduler holds its registration's lease (renewing it at half its
    /// life); false at shutdown. Only the holder fetches, so two schedulers of one
    /// registration never fetch beyond the capacity together. On taking over, the live
    /// assignments are counted from the store.
    async fn lead(&self, index: usize, shutdown: &CancellationToken) -> bool {
        loop {
            self.beat(index);
            let now = tokio::time::Instant::now();
            if self.leading_until().is_some_and(|until| until > now + self.lease_ttl / 2) {
                return true;
            }
            let _renewing = self.renewing.lock().await;
            let now = tokio::time::Instant::now();
            let held = self.leading_until();
            if held.is_some_and(|until| until > now + self.lease_ttl / 2) {
                return true;
            }
            match self.store.lease(&self.lease_name(), &self.holder, self.lease_ttl).await {
                Ok(true) => {
                    if held.is_none_or(|until| until <= now) {
                        match self.recover_placement(self.placement).await {
                            Ok(live) => tracing::info!(placement = %self.placement, live, "fetching for this registration (lease taken)"),
                            Err(error) => {
                                tracing::warn!(placement = %self.placement, %error, "cannot count the live assignments yet");
                                self.store.release_lease(&self.lease_name(), &self.holder).await.ok();
                                sleep_or_stop(Duration::from_secs(1), shutdown).await;
                                continue;
                            }
                        }
                    }
                    self.set_leading_until(Some(now + self.lease_ttl));
                    return true;
                }
                Ok(false) => {
                    if held.is_some_and(|until| until > now) {
                        tracing::warn!(placement = %self.placement, "another scheduler holds this registration's lease; standing by");
                    }
                    self.set_leading_until(None);
                }
                Err(error) => {
                    tracing::warn!(placement = %self.placement, %error, "cannot renew the lease");
                    if held.is_some_and(|until| until > now) {
                        return true;
                    }
                }
            }
            drop(_renewing);
            tokio::select! {
                () = shutdown.cancelled() => return false,
                () = tokio::time::sleep((self.lease_ttl / 5).max(Duration::from_millis(100))) => {}
            }
        }
    }

    /// Counts the store's live assignments of `placement` into its admission.
    async fn recover_placement(&self, placement: Placement) -> Result<usize, crate::store::StoreError> {
        let Some(runtime) = self.placements.get(placement) else { return Ok(0) };
        let mut live = 0;
        for record in self.store.list().await? {
            if !record.value.is_terminal() && record.value.placement == placement {
                runtime.admission.admit(&record.value.assignment_id);
                live += 1;
            }
        }
        Ok(live)
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

    /// Runs the loops until `shutdown`; every loop is joined before returning. When Gitea
    /// says this registration's runner no longer exists, this placement stops fetching
    /// (the log, `/readyz` and `gdr_placement_fetching` say so) and the rest of the
    /// controller — other placements, the facade for running jobs — goes on.
    ///
    /// # Errors
    /// None today; the signature leaves room for final errors.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) -> Result<(), GiteaError> {
        let capacity = self.placements.get(self.placement).map_or(1, |r| r.capacity);
        let placement = self.placement.to_string();
        if let Some(metrics) = &self.metrics {
            metrics.placement(&placement, crate::metrics::PlacementStatus::Fetching);
        }
        let stop = shutdown.child_token();
        let mut loops = tokio::task::JoinSet::new();
        for index in 0..capacity.min(self.config.max_loops).max(1) {
            let scheduler = Arc::clone(&self);
            let stop = stop.clone();
            loops.spawn(async move { scheduler.fetch_loop(index, stop).await });
        }
        while let Some(joined) = loops.join_next().await {
            match joined {
                Ok(Err(error)) => {
                    // This registration is gone: its other loops stop too, nothing else.
                    if !stop.is_cancelled() {
                        tracing::error!(%placement, error = %error, "this placement stops fetching tasks; the others and the running jobs go on");
                        if let Some(metrics) = &self.metrics {
                            metrics.placement(&placement, crate::metrics::PlacementStatus::Stopped(error.to_string()));
                            metrics.error(ErrorSource::Gitea, error.metric_label());
                        }
                    }
                    stop.cancel();
                }
                Ok(Ok(())) => {}
                Err(error) => tracing::error!(%error, "a fetch loop panicked"),
            }
        }
        if let Some(metrics) = &self.metrics {
            for index in 0..capacity.min(self.config.max_loops).max(1) {
                metrics.forget(&self.loop_name(index));
            }
        }
        // A clean stop hands the registration over at once.
        if let Err(error) = self.store.release_lease(&self.lease_name(), &self.holder).await {
            tracing::warn!(%error, "cannot release the lease; a standby takes over when it expires");
        }
        Ok(())
    }

    fn loop_name(&self, index: usize) -> String {
        format!("scheduler {} fetch loop {index}", self.placement)
    }

    fn beat(&self, index: usize) {
        if let Some(metrics) = &self.metrics {
            metrics.beat(&self.loop_name(index));
        }
    }

    /// Room for one fetch: waits while the placement is full, re-checking its live
    /// assignments against the store now and then (another process — a facade on its
    /// own — may have finished them).
    async fn reserve(&self, index: usize, shutdown: &CancellationToken) -> Option<Ticket> {
        let runtime = Arc::clone(self.placements.get(self.placement)?);
        let admission = Arc::clone(&runtime.admission);
        loop {
            self.beat(index);
            if runtime.can_place()
                && let Some(ticket) = admission.try_reserve()
            {
                return Some(ticket);
            }
            tokio::select! {
                () = shutdown.cancelled() => return None,
                () = admission.released() => {}
                () = tokio::time::sleep(self.config.fetch_interval_max.max(Duration::from_secs(1))) => {
                    for id in admission.persisted_live() {
                        if let Ok(record) = self.store.get(&id).await
                            && record.as_ref().is_none_or(|r| r.value.is_terminal())
                        {
                            admission.release(&id);
                        }
                    }
                }
            }
        }
    }

    async fn fetch_loop(&self, index: usize, shutdown: CancellationToken) -> Result<(), GiteaError> {
        let mut failures = 0u32;
        let mut retry = retry_backoff();
        let mut wakes = self.wake.as_ref().map(wake::Wake::subscribe);
        let mut ended = self.placements.get(self.placement).map(|runtime| runtime.admission.ended());
        // The poll's pace, as gitea-runner's: fetch_interval after an empty reply, doubling
        // while idle up to fetch_interval_max — but back to fetch_interval not only after a
        // task: work comes in bursts (a push queues several jobs, a job that ends queues the
        // ones that need it), so also when an assignment ends or Gitea says a job was queued.
        let mut pace = Backoff::new(self.config.fetch_interval, self.config.fetch_interval_max.max(self.config.fetch_interval));
        while !shutdown.is_cancelled() {
            self.beat(index);
            if !self.lead(index, &shutdown).await {
                return Ok(());
            }
            let Some(ticket) = self.reserve(index, &shutdown).await else { return Ok(()) };
            // Whatever happened up to this fetch, the fetch itself answers.
            if let Some(wakes) = &mut wakes {
                wakes.borrow_and_update();
            }
            if let Some(ended) = &mut ended {
                ended.borrow_and_update();
            }
            let version = self.tasks_version.load(Ordering::SeqCst);
            // Not cut short at shutdown: Gitea may have committed a task to this reply,
            // which is then ours alone; the call is bounded by fetch_timeout, and a task
            // it brings is persisted before the loop ends.
            let fetched = self.gitea.fetch_task(version, self.config.fetch_timeout).await;
            match fetched {
                Ok(response) => {
                    failures = 0;
                    retry.reset();
                    note_reply(&self.tasks_version, version, response.tasks_version, response.task.is_some());
                    match response.task {
                        Some(task) => {
                            crate::failpoint::hit("after-fetch");
                            pace.reset();
                            self.handle(task, ticket, &shutdown).await;
                        }
                        None => {
                            drop(ticket);
                            if idle(pace.next_delay(), wakes.as_mut(), ended.as_mut(), &shutdown).await {
                                pace.reset();
                            }
                        }
                    }
                }
                Err(error @ GiteaError::Unregistered { .. }) => return Err(error),
                Err(GiteaError::Call { error, .. }) if error.code == connect::Code::DeadlineExceeded => {
                    drop(ticket);
                    // A task Gitea committed to a reply that never came is lost to us; Gitea
                    // fails it after its zombie timeout. Say so: it is rare, and costly.
                    tracing::warn!(
                        placement = %self.placement,
                        loop_index = index,
                        timeout = ?self.config.fetch_timeout,
                        "FetchTask got no answer in time; a task in that reply would be lost (raise gitea.fetch_timeout if Gitea is slow)"
                    );
                    if let Some(metrics) = &self.metrics {
                        metrics.error(ErrorSource::Gitea, "fetch_unanswered");
                    }
                    sleep_or_stop(self.config.fetch_interval, &shutdown).await;
                }
                Err(error) => {
                    if let Some(metrics) = &self.metrics {
                        metrics.error(ErrorSource::Gitea, error.metric_label());
                    }
                    drop(ticket);
                    failures += 1;
                    let delay = retry.next_delay();
                    if failures == 1 {
                        tracing::warn!(placement = %self.placement, loop_index = index, %error, "FetchTask failed; backing off");
                    } else {
                        tracing::debug!(placement = %self.placement, loop_index = index, %error, failures, "FetchTask still failing");
                    }
                    sleep_or_stop(delay, &shutdown).await;
                }
            }
        }
        Ok(())
    }

    async fn handle(&self, task: Task, ticket: Ticket, shutdown: &CancellationToken) {
        let fetched_at_ms = now_ms();
        let fetched = std::time::Instant::now();
        let task_id = task.id;
        let assignment = match Assignment::from_task(task, &self.config.rules) {
            Ok(assignment) => assignment,
            Err(error) => {
                let reason = crate::error_chain(&error);
                self.reject(task_id, &reason).await;
                return;
            }
        };
        let Some(runtime) = self.placements.get(assignment.placement) else {
            let reason = format!(
                "placement {} is not enabled on this controller (enabled: {})",
                assignment.placement,
                self.placements.enabled().iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
            );
            self.reject(task_id, &reason).await;
            return;
        };
        // Count it where it will run (the container.docker registration may be handed a
        // container.kubernetes task, see placement::declared_labels).
        if assignment.placement == self.placement {
            ticket.fill(&assignment.id);
        } else {
            drop(ticket);
            runtime.admission.admit(&assignment.id);
        }
        let record = Record::pending(&assignment.id, assignment.placement, self.gitea.runner_uuid(), assignment.encode(), fetched_at_ms);
        // The task is ours alone now: keep trying, this assignment only — with no deadline
        // but shutdown, after which it gives up once it has failed 20 times. A record too
        // large to store cannot be stored by any retry.
        let failures = std::sync::atomic::AtomicU32::new(0);
        let persisted = contract::backoff::retry_until(
            tokio::time::Instant::now() + PERSIST_PATIENCE,
            &mut retry_backoff(),
            |error| {
                let permanent = matches!(error, crate::store::StoreError::TooLarge { .. });
                let given_up = shutdown.is_cancelled() && failures.load(Ordering::SeqCst) > 20;
                !(permanent || given_up)
            },
            |error, _| {
                let attempt = failures.load(Ordering::SeqCst);
                tracing::warn!(assignment.id = %record.assignment_id, task_id, attempt, %error, "persisting failed; retrying");
            },
            || async {
                let persisted = self.store.persist(&record).await;
                if let Err(error) = &persisted {
                    failures.fetch_add(1, Ordering::SeqCst);
                    if let Some(metrics) = &self.metrics {
                        metrics.error(ErrorSource::Store, error.metric_label());
                    }
                }
                persisted
            },
        )
        .await;
        match persisted {
            Ok(created) => {
                runtime.admission.persisted(&record.assignment_id);
                tracing::info!(assignment.id = %record.assignment_id, task_id, placement = %record.placement, created, "assignment persisted");
                self.observe(if created {
                    Outcome::Persisted { assignment_id: record.assignment_id.clone(), placement: record.placement, latency: fetched.elapsed() }
                } else {
                    Outcome::AlreadyPersisted { assignment_id: record.assignment_id.clone() }
                });
            }
            Err(error @ crate::store::StoreError::TooLarge { .. }) => {
                // No retry can store it: the task fails in Gitea with the reason.
                runtime.admission.release(&record.assignment_id);
                self.reject(task_id, &format!("the controller cannot store this task: {error}")).await;
            }
            Err(error) => {
                tracing::error!(assignment.id = %record.assignment_id, task_id, %error, "giving up on persisting at shutdown; Gitea will time the task out");
            }
        }
    }

    /// Fails a task in Gitea at once, with the reason in its log.
    async fn reject(&self, task_id: i64, reason: &str) {
        tracing::error!(task_id, "task cannot run here, failing it in Gitea: {reason}");
        if let Err(error) = gitea::fail_task(&self.gitea as &dyn TaskReports, task_id, &format!("this job cannot run: {reason}")).await {
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

/// Waits `interval` after an empty FetchTask; cut short, returning true, when Gitea says
/// a job was queued (`wakes`) or an assignment of the placement ended (`ended`) since
/// the fetch began — signs that work is about.
async fn idle(
    interval: Duration,
    wakes: Option<&mut tokio::sync::watch::Receiver<u64>>,
    ended: Option<&mut tokio::sync::watch::Receiver<u64>>,
    shutdown: &CancellationToken,
) -> bool {
    async fn changed(receiver: Option<&mut tokio::sync::watch::Receiver<u64>>) {
        // A closed channel (its sender dropped at shutdown) is no sign of work.
        let open = match receiver {
            Some(receiver) => receiver.changed().await.is_ok(),
            None => false,
        };
        if !open {
            std::future::pending::<()>().await;
        }
    }
    tokio::select! {
        () = shutdown.cancelled() => false,
        () = tokio::time::sleep(interval) => false,
        () = changed(wakes) => {
            tracing::debug!("Gitea queued a job: fetching now");
            true
        }
        () = changed(ended) => {
            tracing::debug!("an assignment ended: fetching now");
            true
        }
    }
}

async fn sleep_or_stop(delay: Duration, shutdown: &CancellationToken) {
    tokio::select! {
        () = shutdown.cancelled() => {}
        () = tokio::time::sleep(delay) => {}
    }
}

/// What a FetchTask reply does to the tasks_version the loops share. Gitea answers a
/// fetch that sends its latest version with "no task" without looking at the queue, so a
/// version may only stand for "nothing waiting that we have not been offered". As
/// gitea-runner's poller (v3.3.0, `internal/app/poll/poller.go`): after a task the next
/// fetch sends 0 (more may be waiting), and a reply moves the version on only from the
/// one its fetch sent — a reply to a fetch sent before another loop's task must not undo
/// that loop's reset, or the backlog would wait in Gitea until a new job changed its
/// version (the chaos test saw two jobs never fetched).
fn note_reply(shared: &AtomicI64, sent: i64, replied: i64, got_task: bool) {
    if got_task {
        shared.store(0, Ordering::SeqCst);
    } else if replied > sent {
        let _ = shared.compare_exchange(sent, replied, Ordering::SeqCst, Ordering::SeqCst);
    }
}

/// Retrying a failed FetchTask or persist: 200 ms doubling to 10 s.
fn retry_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(200), Duration::from_secs(10))
}

/// How long a persist is retried: for good (thirty years; only shutdown stops it).
const PERSIST_PATIENCE: Duration = Duration::from_secs(30 * 365 * 24 * 3600);

#[cfg(test)]
mod tests {
    use super::*;

    /// Replies applied in the order they arrive, from loops that read the shared version
    /// at different moments: (version sent, version replied, task) → the shared version.
    #[test]
    fn a_stale_reply_never_hides_the_backlog() {
        type Reply = (i64, i64, bool);
        let cases: [(&str, &[Reply], i64); 6] = [
            ("an empty reply records Gitea's version", &[(0, 7, false)], 7),
            ("after a task the next fetch looks again", &[(0, 7, true)], 0),
            // Loop Z read 7 and sent it while loop X's fetch brought a task; X reset the
            // version. Gitea did not look for Z (7 is its latest): Z's "no task" says
            // nothing, and keeping 7 would hide the jobs still waiting behind X's task
            // until a new job changed Gitea's version. The old rule (the highest version
            // seen) kept 7.
            ("a reply Gitea gave without looking, after another loop's task", &[(0, 7, true), (7, 7, false)], 0),
            // Gitea looked for Z and found nothing at 9, but X's reset came first: one
            // more look than needed, never a hidden job.
            ("a reply to a fetch sent before another loop's reset", &[(0, 9, true), (7, 9, false)], 0),
            // Both sent 0: X took the last job, Z found none left: nothing waits at 9.
            ("two fetches from 0, one task and one empty", &[(0, 9, true), (0, 9, false)], 9),
            ("a reply older than the version held does not move it back", &[(0, 9, false), (0, 5, false)], 9),
        ];
        for (name, replies, expected) in cases {
            let shared = AtomicI64::new(0);
            for &(sent, replied, task) in replies {
                note_reply(&shared, sent, replied, task);
            }
            assert_eq!(shared.load(Ordering::SeqCst), expected, "{name}");
        }
    }
}
