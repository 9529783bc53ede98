//! The controller's small HTTP listener (`http.listen`): `/metrics`, `/healthz` (alive:
//! no loop that must keep turning has been silent for [`STALLED_AFTER`]) and `/readyz`
//! (the store takes writes and a placement fetches), plus the routes the composition
//! root mounts on it ([`Route`]: Gitea's webhook at `POST /hooks/gitea`).

use std::{convert::Infallible, sync::Arc};

use async_trait::async_trait;
use bytes::Bytes;
use http_body_util::Full;
use tokio_util::sync::CancellationToken;

use crate::metrics::{Metrics, STALLED_AFTER};

pub type Response = http::Response<Full<Bytes>>;

/// A route of the listener besides the operability ones.
#[async_trait]
pub trait Route: Send + Sync + std::fmt::Debug {
    /// The path it answers, e.g. `/hooks/gitea`.
    fn path(&self) -> &'static str;
    async fn handle(&self, request: http::Request<hyper::body::Incoming>) -> Response;
}

/// Serves the listener until `shutdown`.
///
/// # Errors
/// When accepting fails for good.
pub async fn serve(listener: tokio::net::TcpListener, metrics: Arc<Metrics>, routes: Vec<Arc<dyn Route>>, shutdown: CancellationToken) -> std::io::Result<()> {
    let mut connections = tokio::task::JoinSet::new();
    let routes = Arc::new(routes);
    loop {
        let (stream, _) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted?,
        };
        let (metrics, routes) = (Arc::clone(&metrics), Arc::clone(&routes));
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                let (metrics, routes) = (Arc::clone(&metrics), Arc::clone(&routes));
                async move {
                    if let Some(route) = routes.iter().find(|route| route.path() == request.uri().path()) {
                        return Ok::<_, Infallible>(route.handle(request).await);
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

/// A plain-text answer.
pub fn respond(status: u16, body: String) -> Response {
    respond_as(status, "text/plain", body)
}

fn respond_as(status: u16, content_type: &'static str, body: String) -> Response {
    let mut response = http::Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::OK);
    response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static(content_type));
    response
}

fn answer(path: &str, metrics: &Metrics) -> Response {
    match path {
        "/metrics" => respond_as(200, "application/openmetrics-text; version=1.0.0; charset=utf-8", metrics.encode()),
        "/healthz" => match metrics.stalled(STALLED_AFTER).as_slice() {
            [] => respond(200, "ok\n".to_owned()),
            stalled => {
                let list: Vec<String> = stalled.iter().map(|(name, silent)| format!("{name}: silent for {}s", silent.as_secs())).collect();
                respond(503, format!("stalled: {}\n", list.join(", ")))
            }
        },
        "/readyz" => {
            let (ready, body) = metrics.readiness();
            respond(if ready { 200 } else { 503 }, body)
        }
        _ => respond(404, "not found: try /metrics, /healthz or /readyz\n".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operability_routes_answer_from_the_metrics() {
        let metrics = Metrics::new();
        assert_eq!(answer("/readyz", &metrics).status(), 503);
        metrics.set_ready(true);
        assert_eq!(answer("/readyz", &metrics).status(), 200);
        assert_eq!(answer("/healthz", &metrics).status(), 200);
        assert_eq!(answer("/metrics", &metrics).status(), 200);
        assert_eq!(answer("/nope", &metrics).status(), 404);
    }
}
