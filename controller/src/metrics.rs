//! Operability: Prometheus metrics, `/healthz` and `/readyz` on one small HTTP
//! listener — which also takes Gitea's `workflow_job` webhook at `POST /hooks/gitea`
//! when one is configured (see [`crate::scheduler::wake`]).
//!
//! - `/healthz` fails when a loop that must keep turning (fetch loops, workers, sweeps)
//!   has not reported for [`STALLED_AFTER`]: a process whose scheduling is stuck gets
//!   restarted.
//! - `/readyz` fails while the store cannot take a write, or when no placement fetches
//!   any more; its body says the state of each placement (a runner deleted in Gitea stops
//!   only its own placement).

use std::{
    collections::BTreeMap,
    convert::Infallible,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

/// How long a loop may stay silent before `/healthz` calls the process stuck.
pub const STALLED_AFTER: Duration = Duration::from_secs(300);

use bytes::Bytes;
use http_body_util::Full;
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};
use tokio_util::sync::CancellationToken;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PlacementLabel {
    pub placement: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub queue_depth: Family<PlacementLabel, Gauge>,
    pub pool_in_use: Family<PlacementLabel, Gauge>,
    pub pool_capacity: Family<PlacementLabel, Gauge>,
    pub assignments_persisted: Counter,
    pub tasks_rejected: Counter,
    /// Seconds from FetchTask to gitea-runner started (ReportPhase RUNNER_STARTED).
    pub job_startup: Histogram,
    /// Seconds from persisted to claimed.
    pub claim_latency: Histogram,
    pub errors: Family<KindLabel, Counter>,
    /// Gitea's webhook deliveries by outcome (`queued`, `ignored`, `bad_signature`, `malformed`).
    pub webhook_deliveries: Family<KindLabel, Counter>,
    /// 1 while a placement's registration fetches, 0 once Gitea no longer knows it.
    pub placement_fetching: Family<PlacementLabel, Gauge>,
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
        let buckets = [0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0];
        let job_startup = Histogram::new(buckets);
        let claim_latency = Histogram::new(buckets);
        let errors = Family::<KindLabel, Counter>::default();
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
        registry.register("job_startup_seconds", "From FetchTask to gitea-runner started", job_startup.clone());
        registry.register("claim_latency_seconds", "From persisted to claimed", claim_latency.clone());
        registry.register("errors", "Errors by kind", errors.clone());
        registry.register("webhook_deliveries", "Gitea webhook deliveries by outcome (queued: the fetch loops were woken)", webhook_deliveries.clone());
        Metrics {
            registry,
            queue_depth,
            pool_in_use,
            pool_capacity,
            assignments_persisted,
            tasks_rejected,
            job_startup,
            claim_latency,
            errors,
            webhook_deliveries,
            placement_fetching,
            ready: AtomicBool::new(false),
            placements: Mutex::new(BTreeMap::new()),
            beats: Mutex::new(BTreeMap::new()),
        }
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

    fn readiness(&self) -> (bool, String) {
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

    pub fn error(&self, kind: &str) {
        self.errors.get_or_create(&KindLabel { kind: kind.to_owned() }).inc();
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

/// Gitea's webhook, where one is configured: its secret and whom it wakes.
pub type Hooks = Option<(crate::scheduler::wake::Webhook, crate::scheduler::wake::Wake)>;

/// Serves `/metrics`, `/healthz` (alive) and `/readyz` (registered with Gitea and the
/// store reachable), and `POST /hooks/gitea` with `hooks`, until `shutdown`.
///
/// # Errors
/// When accepting fails for good.
pub async fn serve(listener: tokio::net::TcpListener, metrics: Arc<Metrics>, hooks: Hooks, shutdown: CancellationToken) -> std::io::Result<()> {
    let mut connections = tokio::task::JoinSet::new();
    let hooks = Arc::new(hooks);
    loop {
        let (stream, _) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted?,
        };
        let (metrics, hooks) = (Arc::clone(&metrics), Arc::clone(&hooks));
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                let (metrics, hooks) = (Arc::clone(&metrics), Arc::clone(&hooks));
                async move {
                    if request.uri().path() == "/hooks/gitea" {
                        return Ok::<_, Infallible>(hook(request, &hooks, &metrics).await);
                    }
                    Ok::<_, Infallible>(answer(request.uri().path(), &metrics))
                }
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(hyper_util::rt::TokioIo::new(stream), service).await;
        });
        while connections.try_join_next().is_some() {}
    }
    connections.shutdown().await;
    Ok(())
}

/// `POST /hooks/gitea`: a signed `workflow_job` "queued" wakes the fetch loops.
async fn hook(request: http::Request<hyper::body::Incoming>, hooks: &Hooks, metrics: &Metrics) -> http::Response<Full<Bytes>> {
    use crate::scheduler::wake::{Delivery, MAX_BODY};
    use http_body_util::BodyExt as _;
    let Some((webhook, wake)) = hooks else {
        return respond(404, "no webhook is configured here: set gitea.webhook_secret_file\n".to_owned());
    };
    if request.method() != http::Method::POST {
        return respond(405, "POST Gitea's webhook deliveries here\n".to_owned());
    }
    let header = |name: &str| request.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let (signature, event) = (header("x-gitea-signature"), header("x-gitea-event"));
    let Ok(body) = http_body_util::Limited::new(request.into_body(), MAX_BODY).collect().await.map(http_body_util::Collected::to_bytes) else {
        return respond(413, format!("a delivery is at most {MAX_BODY} bytes\n"));
    };
    let delivery = webhook.judge(signature.as_deref(), event.as_deref(), &body);
    let outcome = match delivery {
        Delivery::Queued => "queued",
        Delivery::Ignored => "ignored",
        Delivery::BadSignature => "bad_signature",
        Delivery::Malformed => "malformed",
    };
    metrics.webhook_deliveries.get_or_create(&KindLabel { kind: outcome.to_owned() }).inc();
    match delivery {
        Delivery::Queued => {
            wake.wake();
            respond(200, "fetching\n".to_owned())
        }
        Delivery::Ignored => respond(200, "nothing to do\n".to_owned()),
        Delivery::BadSignature => {
            tracing::warn!(
                "a webhook delivery without a valid X-Gitea-Signature was refused: check that Gitea's webhook secret is gitea.webhook_secret_file's"
            );
            respond(401, "the signature does not match the shared secret\n".to_owned())
        }
        Delivery::Malformed => respond(400, "the body is not a JSON object\n".to_owned()),
    }
}

fn respond(status: u16, body: String) -> http::Response<Full<Bytes>> {
    let mut response = http::Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::OK);
    response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("text/plain"));
    response
}

fn answer(path: &str, metrics: &Metrics) -> http::Response<Full<Bytes>> {
    let (status, content_type, body) = match path {
        "/metrics" => (200, "application/openmetrics-text; version=1.0.0; charset=utf-8", metrics.encode()),
        "/healthz" => match metrics.stalled(STALLED_AFTER).as_slice() {
            [] => (200, "text/plain", "ok\n".to_owned()),
            stalled => {
                let list: Vec<String> = stalled.iter().map(|(name, silent)| format!("{name}: silent for {}s", silent.as_secs())).collect();
                (503, "text/plain", format!("stalled: {}\n", list.join(", ")))
            }
        },
        "/readyz" => {
            let (ready, body) = metrics.readiness();
            (if ready { 200 } else { 503 }, "text/plain", body)
        }
        _ => (404, "text/plain", "not found: try /metrics, /healthz or /readyz\n".to_owned()),
    };
    let mut response = http::Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::OK);
    response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static(content_type));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_names_every_metric() {
        let metrics = Metrics::new();
        metrics.queue_depth.get_or_create(&PlacementLabel { placement: "container.docker".into() }).set(3);
        metrics.error("unavailable");
        metrics.pool_in_use.get_or_create(&PlacementLabel { placement: "container.docker".into() }).set(1);
        metrics.job_startup.observe(1.5);
        let text = metrics.encode();
        for name in [
            "gdr_queue_depth{placement=\"container.docker\"} 3",
            "gdr_errors_total{kind=\"unavailable\"} 1",
            "gdr_job_startup_seconds_count 1",
            "gdr_claim_latency_seconds",
            "gdr_pool_in_use",
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
    }

    #[test]
    fn readiness_follows_the_store_and_the_placements() {
        let metrics = Metrics::new();
        assert_eq!(answer("/readyz", &metrics).status(), 503);
        metrics.set_ready(true);
        assert_eq!(answer("/readyz", &metrics).status(), 200);
        metrics.placement("container.docker", PlacementStatus::Fetching);
        metrics.placement("vm.opensandbox", PlacementStatus::Stopped("Gitea no longer knows this runner".into()));
        let (ready, body) = metrics.readiness();
        assert!(ready, "one placement still fetches");
        assert!(body.contains("vm.opensandbox: stopped: Gitea no longer knows this runner") && body.contains("container.docker: fetching"), "{body}");
        assert!(metrics.encode().contains("gdr_placement_fetching{placement=\"vm.opensandbox\"} 0"));
        metrics.placement("container.docker", PlacementStatus::Stopped("deleted".into()));
        assert_eq!(answer("/readyz", &metrics).status(), 503);
        assert_eq!(answer("/nope", &metrics).status(), 404);
    }

    #[test]
    fn health_fails_when_a_loop_stops_reporting() {
        let metrics = Metrics::new();
        assert_eq!(answer("/healthz", &metrics).status(), 200);
        metrics.beat("worker container.docker");
        assert!(metrics.stalled(Duration::from_secs(60)).is_empty());
        std::thread::sleep(Duration::from_millis(20));
        let stalled = metrics.stalled(Duration::from_millis(10));
        assert_eq!(stalled.len(), 1);
        assert_eq!(stalled[0].0, "worker container.docker");
        metrics.forget("worker container.docker");
        assert!(metrics.stalled(Duration::ZERO).is_empty());
    }
}
