//! Operability: the Prometheus registry, and what `/healthz` and `/readyz` answer
//! (served by [`crate::http`]).
//!
//! - `/healthz` fails when a loop that must keep turning (fetch loops, workers, sweeps)
//!   has not reported for [`STALLED_AFTER`]: a process whose scheduling is stuck gets
//!   restarted.
//! - `/readyz` fails while the store cannot take a write, or when no placement fetches
//!   any more; its body says the state of each placement (a runner deleted in Gitea stops
//!   only its own placement).

use std::{
    collections::BTreeMap,
    sync::{
        Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

/// How long a loop may stay silent before `/healthz` calls the process stuck.
pub const STALLED_AFTER: Duration = Duration::from_secs(300);

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PlacementLabel {
    pub placement: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

/// `gdr_errors_total`: what failed (a Gitea call, the store, the facade) and how.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub source: &'static str,
    pub kind: String,
}

/// Where an error counted in `gdr_errors_total` came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorSource {
    /// A call to Gitea (FetchTask, a registration, a report forwarded).
    Gitea,
    /// The assignment store (JetStream or the embedded one).
    Store,
    /// The facade refused or dropped a client (rate limits, connection limits).
    Facade,
}

impl ErrorSource {
    fn as_str(self) -> &'static str {
        match self {
            ErrorSource::Gitea => "gitea",
            ErrorSource::Store => "store",
            ErrorSource::Facade => "facade",
        }
    }
}

/// `gdr_facade_calls_total`: a facade call by its name and the gRPC code it was answered
/// with (`ok`, or why it was refused).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    pub call: &'static str,
    pub code: &'static str,
}

/// `gdr_environments_ended_total`: how a job's environment ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub placement: String,
    pub outcome: &'static str,
}

/// Gitea's results as labels ([`result_label`]): the outcomes of jobs that ended
/// themselves.
const RESULTS: [&str; 4] = ["success", "failure", "cancelled", "skipped"];

/// Why the controller, not the job, ended a job ([`crate::lifecycle::Lifecycle::fail`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndedBy {
    /// The driver refused to create its environment (the placement's rules, a missing
    /// image, a quota).
    Refused,
    /// Its environment disappeared or exited while the job ran.
    Lost,
    /// Its environments kept disappearing before the claim; the controller gave up.
    NotStarted,
}

impl EndedBy {
    fn as_str(self) -> &'static str {
        match self {
            EndedBy::Refused => "refused",
            EndedBy::Lost => "lost",
            EndedBy::NotStarted => "not_started",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub placement: String,
    pub phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub placement: String,
    pub result: &'static str,
}

/// A stretch of a job's start, measured per placement (`gdr_job_phase_seconds`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobPhase {
    /// Fetched from Gitea → its environment created by the driver (queueing for
    /// capacity included).
    Created,
    /// Environment created → the supervisor claimed the task (the environment's boot:
    /// image, storage, identity).
    Claimed,
    /// Claimed → the job-started hook let the first step through (the runner's start,
    /// a `container:` job's image and services, a host-mode job's services).
    FirstStep,
    /// The job ended → its environment stopped (the supervisor's drain, the driver's stop).
    Teardown,
}

impl JobPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            JobPhase::Created => "created",
            JobPhase::Claimed => "claimed",
            JobPhase::FirstStep => "first_step",
            JobPhase::Teardown => "teardown",
        }
    }
}

/// Seconds from `from_ms` to `to_ms` (Unix ms), when both are known and in order.
fn stretch(from_ms: i64, to_ms: i64) -> Option<f64> {
    (from_ms > 0 && to_ms >= from_ms).then(|| (to_ms - from_ms) as f64 / 1000.0)
}

/// `RESULT_SUCCESS` → `success`: Gitea's result names as a bounded label.
fn result_label(result: &str) -> &'static str {
    match result.trim_start_matches("RESULT_") {
        "SUCCESS" => "success",
        "FAILURE" => "failure",
        "CANCELLED" => "cancelled",
        "SKIPPED" => "skipped",
        _ => "unspecified",
    }
}

/// A gRPC code as a label: `ok`, or the Connect protocol's name of the code
/// (`unauthenticated`, …), as Gitea's errors are labelled.
fn code_label(code: tonic::Code) -> &'static str {
    connect::Code::from_grpc(code as i32).map_or("ok", connect::Code::as_str)
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Start-up stretches: seconds to minutes.
const STARTUP_BUCKETS: [f64; 12] = [0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0];
/// Jobs: seconds to hours.
const DURATION_BUCKETS: [f64; 12] = [1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 10800.0];

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub queue_depth: Family<PlacementLabel, Gauge>,
    pub pool_in_use: Family<PlacementLabel, Gauge>,
    pub pool_capacity: Family<PlacementLabel, Gauge>,
    pub assignments_persisted: Counter,
    pub tasks_rejected: Counter,
    /// Seconds from FetchTask to gitea-runner started (ReportPhase RUNNER_STARTED), by
    /// placement.
    pub job_startup: HistogramFamily<PlacementLabel>,
    /// Seconds from persisted to claimed.
    pub claim_latency: Histogram,
    /// Each stretch of a job's start by placement ([`JobPhase`]).
    pub job_phase: HistogramFamily<PhaseLabels>,
    /// Jobs ended, by placement and Gitea's result.
    pub jobs_finished: Family<ResultLabels, Counter>,
    /// Claimed → ended, by placement and result (a job never claimed did not run).
    pub job_duration: HistogramFamily<ResultLabels>,
    pub errors: Family<ErrorLabels, Counter>,
    /// Facade calls by name and answer ([`CallLabels`]).
    pub facade_calls: Family<CallLabels, Counter>,
    /// Environments ended, by placement and outcome ([`OutcomeLabels`]).
    pub environments_ended: Family<OutcomeLabels, Counter>,
    /// Gitea's webhook deliveries by outcome (`queued`, `ignored`, `bad_signature`, `malformed`).
    pub webhook_deliveries: Family<KindLabel, Counter>,
    /// 1 while a placement's registration fetches, 0 once Gitea no longer knows it.
    pub placement_fetching: Family<PlacementLabel, Gauge>,
    /// The jobs' cache: hits, misses, bytes, evictions, what it stores (`gdr_cache_*`).
    pub cache: std::sync::Arc<cache::CacheMetrics>,
    ready: AtomicBool,
    /// Placement → what its registration is doing, for `/readyz`.
    placements: Mutex<BTreeMap<String, PlacementStatus>>,
    /// Loop → when it last reported.
    beats: Mutex<BTreeMap<String, Instant>>,
}

/// What a placement's registration is doing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlacementStatus {
    Fetching,
    /// Gitea no longer knows its runner: what to do about it.
    Stopped(String),
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("gdr");
        let queue_depth = Family::<PlacementLabel, Gauge>::default();
        let pool_in_use = Family::<PlacementLabel, Gauge>::default();
        let pool_capacity = Family::<PlacementLabel, Gauge>::default();
        let assignments_persisted = Counter::default();
        let tasks_rejected = Counter::default();
        let job_startup: HistogramFamily<PlacementLabel> = Family::new_with_constructor(|| Histogram::new(STARTUP_BUCKETS));
        let claim_latency = Histogram::new(STARTUP_BUCKETS);
        let job_phase: HistogramFamily<PhaseLabels> = Family::new_with_constructor(|| Histogram::new(STARTUP_BUCKETS));
        let jobs_finished = Family::<ResultLabels, Counter>::default();
        let job_duration: HistogramFamily<ResultLabels> = Family::new_with_constructor(|| Histogram::new(DURATION_BUCKETS));
        let errors = Family::<ErrorLabels, Counter>::default();
        let facade_calls = Family::<CallLabels, Counter>::default();
        let environments_ended = Family::<OutcomeLabels, Counter>::default();
        let webhook_deliveries = Family::<KindLabel, Counter>::default();
        let placement_fetching = Family::<PlacementLabel, Gauge>::default();
        registry.register(
            "placement_fetching",
            "1 while the placement's Gitea registration fetches tasks, 0 once Gitea no longer knows it",
            placement_fetching.clone(),
        );
        registry.register("queue_depth", "Assignments waiting in a placement's queue", queue_depth.clone());
        registry.register("pool_in_use", "Environments holding a pool slot", pool_in_use.clone());
        registry.register("pool_capacity", "Pool capacity per placement", pool_capacity.clone());
        registry.register("assignments_persisted", "Tasks persisted as assignments", assignments_persisted.clone());
        registry.register("tasks_rejected", "Tasks failed at once (placement rules, parse errors)", tasks_rejected.clone());
        registry.register("job_startup_seconds", "From FetchTask to gitea-runner started, by placement", job_startup.clone());
        registry.register("claim_latency_seconds", "From persisted to claimed", claim_latency.clone());
        registry.register(
            "job_phase_seconds",
            "Each stretch of a job's life by placement: created (fetched to environment created), claimed (environment created to the task claimed), first_step (claimed to the first step let through), teardown (ended to the environment stopped)",
            job_phase.clone(),
        );
        registry.register("jobs_finished", "Jobs ended, by placement and Gitea's result (success, failure, cancelled, skipped)", jobs_finished.clone());
        registry.register("job_duration_seconds", "From the task claimed to the job ended, by placement and result", job_duration.clone());
        registry.register("errors", "Errors by source (gitea, store, facade) and kind", errors.clone());
        registry.register("facade_calls", "Calls of environments at the facade, by call and gRPC answer (ok, or why it was refused)", facade_calls.clone());
        registry.register(
            "environments_ended",
            "Jobs' environments ended, by placement and outcome: the job's result (success, failure, cancelled, skipped) or why the controller ended it (lost, not_started, refused)",
            environments_ended.clone(),
        );
        registry.register("webhook_deliveries", "Gitea webhook deliveries by outcome (queued: the fetch loops were woken)", webhook_deliveries.clone());
        let cache = std::sync::Arc::new(cache::CacheMetrics::default());
        cache.register(&mut registry);
        Metrics {
            registry,
            queue_depth,
            pool_in_use,
            pool_capacity,
            assignments_persisted,
            tasks_rejected,
            job_startup,
            claim_latency,
            job_phase,
            jobs_finished,
            job_duration,
            errors,
            facade_calls,
            environments_ended,
            webhook_deliveries,
            placement_fetching,
            cache,
            ready: AtomicBool::new(false),
            placements: Mutex::new(BTreeMap::new()),
            beats: Mutex::new(BTreeMap::new()),
        }
    }

    /// `placement` runs here with `capacity` environments at most. Every outcome of its
    /// jobs exists from now on at 0, so an increase over it counts the first one too, and
    /// a rate reads 0, not absent (alerts and panels read "no data" as nothing).
    pub fn configured(&self, placement: &str, capacity: usize) {
        self.pool_capacity.get_or_create(&PlacementLabel { placement: placement.to_owned() }).set(i64::try_from(capacity).unwrap_or(i64::MAX));
        let ended_by = [EndedBy::Refused, EndedBy::Lost, EndedBy::NotStarted].map(EndedBy::as_str);
        for outcome in RESULTS.into_iter().chain(ended_by) {
            let _ = self.environments_ended.get_or_create(&OutcomeLabels { placement: placement.to_owned(), outcome });
        }
        for result in RESULTS {
            let _ = self.jobs_finished.get_or_create(&ResultLabels { placement: placement.to_owned(), result });
            let _ = self.job_duration.get_or_create(&ResultLabels { placement: placement.to_owned(), result });
        }
        for phase in [JobPhase::Created, JobPhase::Claimed, JobPhase::FirstStep, JobPhase::Teardown] {
            let _ = self.job_phase.get_or_create(&PhaseLabels { placement: placement.to_owned(), phase: phase.as_str() });
        }
        let _ = self.job_startup.get_or_create(&PlacementLabel { placement: placement.to_owned() });
    }

    /// Records what `placement`'s registration is doing.
    pub fn placement(&self, placement: &str, status: PlacementStatus) {
        self.placement_fetching.get_or_create(&PlacementLabel { placement: placement.to_owned() }).set(i64::from(status == PlacementStatus::Fetching));
        self.placements.lock().unwrap_or_else(PoisonError::into_inner).insert(placement.to_owned(), status);
    }

    /// `name` (a loop that must keep turning) is alive now.
    pub fn beat(&self, name: &str) {
        let mut beats = self.beats.lock().unwrap_or_else(PoisonError::into_inner);
        match beats.get_mut(name) {
            Some(at) => *at = Instant::now(),
            None => {
                beats.insert(name.to_owned(), Instant::now());
            }
        }
    }

    /// A loop stopped on purpose (shutdown, a placement that stopped fetching).
    pub fn forget(&self, name: &str) {
        self.beats.lock().unwrap_or_else(PoisonError::into_inner).remove(name);
    }

    /// Loops silent for longer than `limit`.
    pub fn stalled(&self, limit: Duration) -> Vec<(String, Duration)> {
        let beats = self.beats.lock().unwrap_or_else(PoisonError::into_inner);
        beats.iter().map(|(name, at)| (name.clone(), at.elapsed())).filter(|(_, silent)| *silent > limit).collect()
    }

    /// Whether the process is ready, and the state of each placement.
    pub fn readiness(&self) -> (bool, String) {
        let placements = self.placements.lock().unwrap_or_else(PoisonError::into_inner);
        let mut body = String::new();
        for (placement, status) in placements.iter() {
            match status {
                PlacementStatus::Fetching => body.push_str(&format!("{placement}: fetching\n")),
                PlacementStatus::Stopped(why) => body.push_str(&format!("{placement}: stopped: {why}\n")),
            }
        }
        let fetching = placements.is_empty() || placements.values().any(|s| *s == PlacementStatus::Fetching);
        let store = self.is_ready();
        if !store {
            body.insert_str(0, "not ready: the store cannot take a write (the log says why)\n");
        } else if !fetching {
            body.insert_str(0, "not ready: no placement fetches tasks\n");
        } else {
            body.insert_str(0, "ready\n");
        }
        (store && fetching, body)
    }

    /// `placement`'s job went through `phase` from `from_ms` to `to_ms` (Unix ms); nothing
    /// is observed when either end is unknown (a record written before it was kept).
    pub fn job_phase(&self, placement: &str, phase: JobPhase, from_ms: i64, to_ms: i64) {
        if let Some(seconds) = stretch(from_ms, to_ms) {
            self.job_phase.get_or_create(&PhaseLabels { placement: placement.to_owned(), phase: phase.as_str() }).observe(seconds);
        }
    }

    /// A job of `placement` ended with `result` (Gitea's name), by the job itself or by
    /// the controller (`ended_by`); `claimed_at_ms` is 0 when it never ran.
    pub fn job_finished(&self, placement: &str, result: &str, ended_by: Option<EndedBy>, claimed_at_ms: i64, ended_at_ms: i64) {
        let labels = ResultLabels { placement: placement.to_owned(), result: result_label(result) };
        self.jobs_finished.get_or_create(&labels).inc();
        if let Some(seconds) = stretch(claimed_at_ms, ended_at_ms) {
            self.job_duration.get_or_create(&labels).observe(seconds);
        }
        let outcome = ended_by.map_or(labels.result, EndedBy::as_str);
        self.environments_ended.get_or_create(&OutcomeLabels { placement: labels.placement, outcome }).inc();
    }

    pub fn error(&self, source: ErrorSource, kind: &str) {
        self.errors.get_or_create(&ErrorLabels { source: source.as_str(), kind: kind.to_owned() }).inc();
    }

    /// The facade answered `call` with `code`.
    pub fn facade_call(&self, call: &'static str, code: tonic::Code) {
        self.facade_calls.get_or_create(&CallLabels { call, code: code_label(code) }).inc();
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        if prometheus_client::encoding::text::encode(&mut text, &self.registry).is_err() {
            text.clear();
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_names_every_metric() {
        let metrics = Metrics::new();
        metrics.queue_depth.get_or_create(&PlacementLabel { placement: "container.docker".into() }).set(3);
        metrics.error(ErrorSource::Store, "unavailable");
        metrics.facade_call("update_log", tonic::Code::ResourceExhausted);
        metrics.pool_in_use.get_or_create(&PlacementLabel { placement: "container.docker".into() }).set(1);
        metrics.job_startup.get_or_create(&PlacementLabel { placement: "container.docker".into() }).observe(1.5);
        let text = metrics.encode();
        for name in [
            "gdr_queue_depth{placement=\"container.docker\"} 3",
            "gdr_errors_total{source=\"store\",kind=\"unavailable\"} 1",
            "gdr_facade_calls_total{call=\"update_log\",code=\"resource_exhausted\"} 1",
            "gdr_job_startup_seconds_count{placement=\"container.docker\"} 1",
            "gdr_claim_latency_seconds",
            "gdr_pool_in_use",
            "gdr_cache_hits_total",
            "gdr_cache_saved_total",
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
    }

    #[test]
    fn a_jobs_stretches_by_placement() {
        let metrics = Metrics::new();
        let cases: &[(JobPhase, i64, i64, Option<&str>)] = &[
            (JobPhase::Created, 1_000, 3_500, Some(r#"gdr_job_phase_seconds_sum{placement="container.docker",phase="created"} 2.5"#)),
            (JobPhase::Claimed, 3_500, 4_000, Some(r#"gdr_job_phase_seconds_sum{placement="container.docker",phase="claimed"} 0.5"#)),
            (JobPhase::FirstStep, 4_000, 4_250, Some(r#"gdr_job_phase_seconds_bucket{le="0.25",placement="container.docker",phase="first_step"} 1"#)),
            (JobPhase::Teardown, 9_000, 12_000, Some(r#"gdr_job_phase_seconds_sum{placement="container.docker",phase="teardown"} 3.0"#)),
            // Unknown or out-of-order ends observe nothing.
            (JobPhase::Created, 0, 3_500, None),
            (JobPhase::Claimed, 5_000, 4_000, None),
        ];
        for (phase, from, to, want) in cases {
            let before = metrics.encode();
            metrics.job_phase("container.docker", *phase, *from, *to);
            let after = metrics.encode();
            match want {
                Some(line) => assert!(after.contains(line), "{phase:?} {from}..{to}: no {line} in:\n{after}"),
                None => assert_eq!(before, after, "{phase:?} {from}..{to} observed something"),
            }
        }
    }

    #[test]
    fn jobs_finished_by_placement_and_result() {
        let metrics = Metrics::new();
        metrics.configured("container.kubernetes", 4);
        let text = metrics.encode();
        for line in [
            r#"gdr_pool_capacity{placement="container.kubernetes"} 4"#,
            r#"gdr_environments_ended_total{placement="container.kubernetes",outcome="lost"} 0"#,
            r#"gdr_jobs_finished_total{placement="container.kubernetes",result="skipped"} 0"#,
            r#"gdr_job_phase_seconds_count{placement="container.kubernetes",phase="teardown"} 0"#,
            r#"gdr_job_startup_seconds_count{placement="container.kubernetes"} 0"#,
        ] {
            assert!(text.contains(line), "configured: no {line} in:\n{text}");
        }
        metrics.job_finished("container.kubernetes", "RESULT_SUCCESS", None, 10_000, 70_000);
        metrics.job_finished("container.kubernetes", "RESULT_FAILURE", None, 0, 70_000);
        metrics.job_finished("container.kubernetes", "RESULT_FAILURE", Some(EndedBy::Lost), 10_000, 20_000);
        metrics.job_finished("container.kubernetes", "RESULT_CANCELLED", None, 10_000, 20_000);
        metrics.job_finished("container.kubernetes", "RESULT_FAILURE", Some(EndedBy::Refused), 0, 20_000);
        let text = metrics.encode();
        for line in [
            r#"gdr_jobs_finished_total{placement="container.kubernetes",result="success"} 1"#,
            r#"gdr_jobs_finished_total{placement="container.kubernetes",result="failure"} 3"#,
            r#"gdr_jobs_finished_total{placement="container.kubernetes",result="cancelled"} 1"#,
            r#"gdr_job_duration_seconds_sum{placement="container.kubernetes",result="success"} 60.0"#,
            // The job's own result where it ended itself, the controller's reason otherwise.
            r#"gdr_environments_ended_total{placement="container.kubernetes",outcome="success"} 1"#,
            r#"gdr_environments_ended_total{placement="container.kubernetes",outcome="failure"} 1"#,
            r#"gdr_environments_ended_total{placement="container.kubernetes",outcome="lost"} 1"#,
            r#"gdr_environments_ended_total{placement="container.kubernetes",outcome="cancelled"} 1"#,
            r#"gdr_environments_ended_total{placement="container.kubernetes",outcome="refused"} 1"#,
        ] {
            assert!(text.contains(line), "no {line} in:\n{text}");
        }
        // Of the three failures, the two never claimed did not run: one duration.
        let count = r#"gdr_job_duration_seconds_count{placement="container.kubernetes",result="failure"} 1"#;
        assert!(text.contains(count), "no {count} in:\n{text}");
    }

    #[test]
    fn readiness_follows_the_store_and_the_placements() {
        let metrics = Metrics::new();
        assert!(!metrics.readiness().0);
        metrics.set_ready(true);
        assert!(metrics.readiness().0);
        metrics.placement("container.docker", PlacementStatus::Fetching);
        metrics.placement("vm.opensandbox", PlacementStatus::Stopped("Gitea no longer knows this runner".into()));
        let (ready, body) = metrics.readiness();
        assert!(ready, "one placement still fetches");
        assert!(body.contains("vm.opensandbox: stopped: Gitea no longer knows this runner") && body.contains("container.docker: fetching"), "{body}");
        assert!(metrics.encode().contains("gdr_placement_fetching{placement=\"vm.opensandbox\"} 0"));
        metrics.placement("container.docker", PlacementStatus::Stopped("deleted".into()));
        assert!(!metrics.readiness().0);
    }

    #[test]
    fn health_fails_when_a_loop_stops_reporting() {
        let metrics = Metrics::new();
        assert!(metrics.stalled(STALLED_AFTER).is_empty());
        metrics.beat("worker container.docker");
        assert!(metrics.stalled(Duration::from_secs(60)).is_empty());
        // Any time at all since the beat is more than no time.
        let stalled = metrics.stalled(Duration::ZERO);
        assert_eq!(stalled.len(), 1);
        assert_eq!(stalled[0].0, "worker container.docker");
        metrics.forget("worker container.docker");
        assert!(metrics.stalled(Duration::ZERO).is_empty());
    }
}
