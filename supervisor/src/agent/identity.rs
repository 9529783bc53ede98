//! Waiting for the job's X.509 SVID through the SPIFFE Workload API.
//!
//! SPIRE attests the caller once per stream and, while it has no identity for it,
//! answers PermissionDenied and closes the stream; new registrations are only seen
//! after reconnecting. So: connect, stream, scan *every* SVID of each update for the
//! exact expected SPIFFE ID (not a prefix, not only the default SVID), and reconnect
//! with jittered backoff on anything retryable, until a deadline.
//! (A Workload API stream sends every rotation; each update is checked.)

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use spiffe::{
    WorkloadApiClient, WorkloadApiError,
    transport::{GrpcStatusCode, TransportError},
};

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error(
        "no SVID with SPIFFE ID {expected} after {waited:?}; last seen: {last}. Check that a registration entry \
         for this ID matches uid {uid} (e.g. selector unix:uid:{uid}) and that the agent at {endpoint} is healthy"
    )]
    Timeout { expected: String, waited: Duration, last: String, uid: u32, endpoint: String },
    #[error("the Workload API at {endpoint} refused the request for good: {detail}")]
    Fatal { endpoint: String, detail: String },
}

/// How the wait goes, for logs and the readiness socket.
pub trait Progress: Send {
    fn update(&mut self, detail: &str);
}

impl<F: FnMut(&str) + Send> Progress for F {
    fn update(&mut self, detail: &str) {
        self(detail);
    }
}

/// Waits until the Workload API at `endpoint` offers an SVID whose SPIFFE ID equals
/// `expected`. Returns the IDs offered in that update.
///
/// # Errors
/// On the deadline, naming the last thing seen; at once for non-retryable refusals
/// (InvalidArgument, Unimplemented).
pub async fn wait_for_svid(endpoint: &str, expected: &str, timeout: Duration, progress: &mut dyn Progress) -> Result<Vec<String>, IdentityError> {
    let started = Instant::now();
    let deadline = started + timeout;
    let mut backoff = backoff();
    let mut last = String::from("nothing yet");
    let mut last_logged: Option<Instant> = None;
    loop {
        match attempt(endpoint, expected, deadline).await {
            Attempt::Found(ids) => {
                tracing::info!(spiffe_id = expected, waited = ?started.elapsed(), "identity ready");
                return Ok(ids);
            }
            Attempt::Fatal(detail) => {
                return Err(IdentityError::Fatal { endpoint: endpoint.to_owned(), detail });
            }
            Attempt::Retry(detail) => {
                if detail != last || last_logged.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                    tracing::info!(spiffe_id = expected, waited = ?started.elapsed(), "waiting for identity: {detail}");
                    last_logged = Some(Instant::now());
                }
                progress.update(&detail);
                last = detail;
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(IdentityError::Timeout {
                expected: expected.to_owned(),
                waited: started.elapsed(),
                last,
                uid: nix::unistd::getuid().as_raw(),
                endpoint: endpoint.to_owned(),
            });
        }
        tokio::time::sleep(backoff.next_delay().min(deadline - now)).await;
    }
}

enum Attempt {
    Found(Vec<String>),
    Retry(String),
    Fatal(String),
}

async fn attempt(endpoint: &str, expected: &str, deadline: Instant) -> Attempt {
    let work = async {
        let client = match WorkloadApiClient::connect_to(endpoint).await {
            Ok(client) => client,
            Err(error) => return classify(&error, "connect"),
        };
        let mut stream = match client.stream_x509_contexts().await {
            Ok(stream) => stream,
            Err(error) => return classify(&error, "FetchX509SVID"),
        };
        let mut last = Attempt::Retry("the stream ended before any update".into());
        while let Some(update) = stream.next().await {
            match update {
                Ok(context) => {
                    let ids: Vec<String> = context.svids().iter().map(|svid| svid.spiffe_id().to_string()).collect();
                    if ids.iter().any(|id| id == expected) {
                        return Attempt::Found(ids);
                    }
                    last = Attempt::Retry(format!("offered {ids:?}, not {expected}"));
                    // Keep the stream: an entitlement change arrives as the next update.
                    tracing::info!(offered = ?ids, expected, "the Workload API offers other identities; waiting");
                }
                Err(error) => return classify(&error, "stream"),
            }
        }
        last
    };
    match tokio::time::timeout_at(deadline.into(), work).await {
        Ok(attempt) => attempt,
        Err(_) => Attempt::Retry("deadline reached while connected".into()),
    }
}

fn classify(error: &WorkloadApiError, during: &str) -> Attempt {
    let status = match error {
        WorkloadApiError::Transport(TransportError::Status(status)) => Some(status.code()),
        _ => None,
    };
    match status {
        Some(GrpcStatusCode::InvalidArgument | GrpcStatusCode::Unimplemented) => Attempt::Fatal(format!("{during}: {error}")),
        _ => Attempt::Retry(format!("{during}: {error}")),
    }
}

/// 250 ms doubling to 5 s (jittered).
fn backoff() -> contract::backoff::Backoff {
    contract::backoff::Backoff::new(Duration::from_millis(250), Duration::from_secs(5))
}

/// `unix:///abs/path`, `unix:/abs/path` or `tcp://ip:port` (SPIFFE Workload Endpoint).
pub fn parse_workload_endpoint(value: &str) -> Result<String, String> {
    if let Some(rest) = value.strip_prefix("unix:") {
        let path = rest.strip_prefix("//").unwrap_or(rest);
        if path.starts_with('/') && path.len() > 1 {
            return Ok(value.to_owned());
        }
        return Err(format!("{value:?} is not a unix socket URI: use unix:///absolute/path"));
    }
    if let Some(rest) = value.strip_prefix("tcp://") {
        if rest.parse::<std::net::SocketAddr>().is_ok() {
            return Ok(value.to_owned());
        }
        return Err(format!("{value:?}: tcp endpoints need an IP address and port, e.g. tcp://127.0.0.1:8081"));
    }
    Err(format!("{value:?} is not a Workload API endpoint: use unix:///path or tcp://ip:port"))
}
