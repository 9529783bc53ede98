//! The jobs' cache, as they reach it: a listener on `contract::cache::LISTEN` (loopback
//! only) — the runner configuration's `cache.external_server` — that sends `actions/cache`'s
//! requests (`/_apis/artifactcache/…`, the v2 `CacheService`) to the controller over the
//! facade's own connection, with this environment's session. Nothing of the cache's is
//! stored here: the controller knows the job's repository and refs from its task.
//!
//! gitea-runner registers each job with its external cache (`/_internal/register`, with
//! its `external_secret`): answered here, with the secret this agent wrote for this
//! environment alone. The registration names a repository; nothing here uses it. The
//! answer's results URL decides which API gitea-runner advertises: this listener (v2)
//! where the environment's Node.js has the global Web Crypto the v2 client's Azure
//! uploads need (Node ≥ 19: the runner image's Node.js 24 has it; a derived image with an
//! older `node` gets v1), else none (v1, which every client speaks). What is not the cache (the v2 `ArtifactService` that
//! `ACTIONS_RESULTS_URL` points here too when v2 is advertised) goes on to Gitea, as the
//! loopback's pass-through does.

use std::sync::Arc;

use bytes::Bytes;
use connect::{BoxBody, Fallback};
use contract::cache::Call;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;

use super::{
    facade_client::FacadeClient,
    proxy::{bad_gateway, strip_hop_by_hop},
};

/// Serves the job's cache on `contract::cache::LISTEN` until `shutdown`; `gitea` answers
/// what is not the cache.
///
/// # Errors
/// When the address cannot be bound (another process of the environment has it).
pub async fn start(
    facade: FacadeClient,
    secret: String,
    gitea: Fallback,
    shutdown: tokio_util::sync::CancellationToken,
) -> std::io::Result<tokio::task::JoinHandle<std::io::Result<()>>> {
    let listener = tokio::net::TcpListener::bind(contract::cache::LISTEN).await?;
    let router = Arc::new(connect::Router::new(proto::descriptor_pool().clone()));
    let fallback = handler(facade, Arc::new(secret), gitea);
    Ok(tokio::spawn(connect::serve_with_fallback(listener, router, Some(fallback), shutdown, std::time::Duration::from_secs(5))))
}

fn handler(facade: FacadeClient, secret: Arc<String>, gitea: Fallback) -> Fallback {
    Arc::new(move |request: http::Request<Incoming>| {
        let (facade, secret, gitea) = (facade.clone(), Arc::clone(&secret), Arc::clone(&gitea));
        Box::pin(async move {
            match request.uri().path() {
                "/_internal/register" => register(&request, &secret),
                "/_internal/revoke" => json(StatusCode::OK, "{}"),
                // The cache protocol's own route table says which requests are the cache's.
                path if Call::classify(request.method(), path).is_some() => forward(&facade, request).await,
                _ => gitea(request).await,
            }
        })
    })
}

/// gitea-runner's registration of a job: with this environment's secret, the answer is
/// this listener as the job's results URL.
fn register(request: &http::Request<Incoming>, secret: &str) -> Response<BoxBody> {
    let given = request.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).unwrap_or("");
    // Compared as digests: how long the comparison takes says nothing of the secret.
    let digest = |text: &str| ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
    if request.method() != http::Method::POST || digest(given).as_ref() != digest(secret).as_ref() {
        return json(StatusCode::UNAUTHORIZED, r#"{"error":"internal: bad secret"}"#);
    }
    let results_url = if node_speaks_v2() { contract::cache::URL } else { "" };
    json(StatusCode::OK, &serde_json::json!({ "results_url": results_url }).to_string())
}

/// Whether the `node` that runs the job's actions has the global `crypto` the v2
/// client's uploads use (asked once).
fn node_speaks_v2() -> bool {
    static ANSWER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ANSWER.get_or_init(|| {
        // From stdin, as a script runs: `node -e` would give it the crypto module as a
        // global that a script does not see.
        // With nothing of the agent's environment: the probe is dumpable, its environ
        // readable by a step.
        let probe = std::process::Command::new("node")
            .arg("-")
            .env_clear()
            .envs(["PATH", "HOME"].into_iter().filter_map(|name| std::env::var_os(name).map(|value| (name, value))))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .and_then(|mut child| {
                use std::io::Write as _;
                if let Some(mut stdin) = child.stdin.take() {
                    stdin.write_all(b"process.exit(typeof globalThis.crypto === 'object' && globalThis.crypto.subtle ? 0 : 1)")?;
                }
                child.wait()
            });
        let v2 = probe.is_ok_and(|status| status.success());
        tracing::info!(api = if v2 { "v2" } else { "v1" }, "the job's cache API (v2 needs Node.js with the global Web Crypto)");
        v2
    })
}

/// One cache request, to the controller and back, streaming both ways.
async fn forward(facade: &FacadeClient, request: http::Request<Incoming>) -> Response<BoxBody> {
    let (mut parts, body) = request.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    parts.headers.remove(header::HOST);
    parts.headers.insert(contract::cache::HEADER_URL, HeaderValue::from_static(contract::cache::URL));
    parts.version = http::Version::HTTP_2;
    let body = tonic::body::Body::new(body);
    match facade.cache(http::Request::from_parts(parts, body)).await {
        Ok(response) => response.map(|body| body.map_err(|status| Box::new(status) as Box<dyn std::error::Error + Send + Sync>).boxed_unsync()),
        Err(error) => {
            tracing::warn!(error = %crate::error_chain(&error), "cannot reach the controller's cache");
            let mut response = bad_gateway(&format!("the cache is unavailable: the controller does not answer ({})", crate::error_chain(&error)));
            *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            response
        }
    }
}

fn json(status: StatusCode, body: &str) -> Response<BoxBody> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_owned())).map_err(|never| match never {}).boxed_unsync());
    *response.status_mut() = status;
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}
