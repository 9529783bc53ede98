//! Operability: Prometheus metrics, `/healthz` and `/readyz` on one small HTTP
//! listener.

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

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
    ready: AtomicBool,
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
        registry.register("queue_depth", "Assignments waiting in a placement's queue", queue_depth.clone());
        registry.register("pool_in_use", "Environments holding a pool slot", pool_in_use.clone());
        registry.register("pool_capacity", "Pool capacity per placement", pool_capacity.clone());
        registry.register("assignments_persisted", "Tasks persisted as assignments", assignments_persisted.clone());
        registry.register("tasks_rejected", "Tasks failed at once (placement rules, parse errors)", tasks_rejected.clone());
        registry.register("job_startup_seconds", "From FetchTask to gitea-runner started", job_startup.clone());
        registry.register("claim_latency_seconds", "From persisted to claimed", claim_latency.clone());
        registry.register("errors", "Errors by kind", errors.clone());
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
            ready: AtomicBool::new(false),
        }
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

/// Serves `/metrics`, `/healthz` (alive) and `/readyz` (registered with Gitea and the
/// store reachable) until `shutdown`.
///
/// # Errors
/// When accepting fails for good.
pub async fn serve(listener: tokio::net::TcpListener, metrics: Arc<Metrics>, shutdown: CancellationToken) -> std::io::Result<()> {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let (stream, _) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted?,
        };
        let metrics = Arc::clone(&metrics);
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                let metrics = Arc::clone(&metrics);
                async move { Ok::<_, Infallible>(answer(request.uri().path(), &metrics)) }
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(hyper_util::rt::TokioIo::new(stream), service).await;
        });
        while connections.try_join_next().is_some() {}
    }
    connections.shutdown().await;
    Ok(())
}

fn answer(path: &str, metrics: &Metrics) -> http::Response<Full<Bytes>> {
    let (status, content_type, body) = match path {
        "/metrics" => (200, "application/openmetrics-text; version=1.0.0; charset=utf-8", metrics.encode()),
        "/healthz" => (200, "text/plain", "ok\n".to_owned()),
        "/readyz" if metrics.is_ready() => (200, "text/plain", "ready\n".to_owned()),
        "/readyz" => (503, "text/plain", "not ready: not yet registered with Gitea, or the store cannot take a write (the log says which)\n".to_owned()),
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
    fn readiness_follows_the_flag() {
        let metrics = Metrics::new();
        assert_eq!(answer("/readyz", &metrics).status(), 503);
        metrics.set_ready(true);
        assert_eq!(answer("/readyz", &metrics).status(), 200);
        assert_eq!(answer("/healthz", &metrics).status(), 200);
        assert_eq!(answer("/nope", &metrics).status(), 404);
    }
}
