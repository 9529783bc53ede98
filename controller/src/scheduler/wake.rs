//! Fetching at once when Gitea says a job was queued, instead of at the next poll.
//!
//! Gitea ≥ 1.24 sends a `workflow_job` webhook when a job is queued. The controller's
//! HTTP listener takes it at `POST /hooks/gitea` when `gitea.webhook_secret_file` is
//! set: the body must carry Gitea's signature (`X-Gitea-Signature`, hex HMAC-SHA256 of
//! the body with the shared secret), so nothing but Gitea can make the controller fetch.
//! A queued job wakes every idle fetch loop; the poll stays as the fallback (a lost
//! delivery, Gitea 1.23, a job only a re-run queued).

use std::sync::Arc;

use tokio::sync::watch;

use crate::{
    http::{Route, respond},
    metrics::{KindLabel, Metrics},
};

/// The most a webhook body may be (Gitea's `workflow_job` payloads are a few KiB).
pub const MAX_BODY: usize = 1 << 20;

/// Wakes the fetch loops. Cloned into each scheduler and the HTTP listener.
#[derive(Debug, Clone)]
pub struct Wake {
    /// A counter: a loop that saw it change since its last fetch fetches again at once,
    /// so a wake that comes during a fetch is not lost.
    generation: Arc<watch::Sender<u64>>,
}

impl Default for Wake {
    fn default() -> Self {
        Wake { generation: Arc::new(watch::channel(0).0) }
    }
}

impl Wake {
    /// A job was queued: idle loops fetch now.
    pub fn wake(&self) {
        self.generation.send_modify(|generation| *generation = generation.wrapping_add(1));
    }

    /// A loop's view of the wakes.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }
}

/// What the webhook endpoint makes of one delivery.
#[derive(Debug, PartialEq, Eq)]
pub enum Delivery {
    /// A job was queued: fetch now.
    Queued,
    /// A valid delivery of something else (another event or action): nothing to do.
    Ignored,
    /// Not signed with the shared secret.
    BadSignature,
    /// Signed, but not a JSON object.
    Malformed,
}

/// The shared secret of Gitea's webhook.
#[derive(Clone)]
pub struct Webhook {
    key: ring::hmac::Key,
}

impl std::fmt::Debug for Webhook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Webhook(secret hidden)")
    }
}

impl Webhook {
    pub fn new(secret: &[u8]) -> Self {
        Webhook { key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret) }
    }

    /// Judges a delivery: its `X-Gitea-Signature`, `X-Gitea-Event` and body.
    pub fn judge(&self, signature: Option<&str>, event: Option<&str>, body: &[u8]) -> Delivery {
        let Some(signature) = signature.and_then(|hex| decode_hex(hex.trim())) else { return Delivery::BadSignature };
        if ring::hmac::verify(&self.key, body, &signature).is_err() {
            return Delivery::BadSignature;
        }
        let Ok(serde_json::Value::Object(payload)) = serde_json::from_slice::<serde_json::Value>(body) else { return Delivery::Malformed };
        let queued = event == Some("workflow_job") && payload.get("action").and_then(serde_json::Value::as_str) == Some("queued");
        if queued { Delivery::Queued } else { Delivery::Ignored }
    }
}

/// `POST /hooks/gitea` on the HTTP listener: a signed `workflow_job` "queued" wakes
/// the fetch loops. Without a configured secret it says how to configure one.
#[derive(Debug)]
pub struct WebhookRoute {
    hooks: Option<(Webhook, Wake)>,
    metrics: Arc<Metrics>,
}

impl WebhookRoute {
    pub fn new(hooks: Option<(Webhook, Wake)>, metrics: Arc<Metrics>) -> Self {
        WebhookRoute { hooks, metrics }
    }
}

#[async_trait::async_trait]
impl Route for WebhookRoute {
    fn path(&self) -> &'static str {
        "/hooks/gitea"
    }

    async fn handle(&self, request: http::Request<hyper::body::Incoming>) -> crate::http::Response {
        use http_body_util::BodyExt as _;
        let Some((webhook, wake)) = &self.hooks else {
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
        self.metrics.webhook_deliveries.get_or_create(&KindLabel { kind: outcome.to_owned() }).inc();
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
}

/// Hex to bytes; None for anything that is not an even number of hex digits.
fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sign(secret: &[u8], body: &[u8]) -> String {
        let tag = ring::hmac::sign(&ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret), body);
        tag.as_ref().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// A delivery: its signature, its event, its body; what it is judged.
    type Case<'a> = (Option<&'a str>, Option<&'a str>, &'a [u8], Delivery);

    #[test]
    fn only_a_signed_queued_job_wakes() {
        let webhook = Webhook::new(b"shared-secret");
        let queued = br#"{"action":"queued","workflow_job":{"labels":["disposable"]}}"#;
        let running = br#"{"action":"in_progress"}"#;
        let good = sign(b"shared-secret", queued);
        let table: &[Case<'_>] = &[
            (Some(&good), Some("workflow_job"), queued, Delivery::Queued),
            (Some(&good.to_uppercase()), Some("workflow_job"), queued, Delivery::Queued),
            (Some(&sign(b"shared-secret", running)), Some("workflow_job"), running, Delivery::Ignored),
            (Some(&good), Some("push"), queued, Delivery::Ignored),
            (Some(&sign(b"another-secret", queued)), Some("workflow_job"), queued, Delivery::BadSignature),
            (Some(&good), Some("workflow_job"), br#"{"action":"queued","x":1}"#, Delivery::BadSignature),
            (None, Some("workflow_job"), queued, Delivery::BadSignature),
            (Some("not hex"), Some("workflow_job"), queued, Delivery::BadSignature),
            (Some(&good[1..]), Some("workflow_job"), queued, Delivery::BadSignature),
            (Some(&sign(b"shared-secret", b"[1]")), Some("workflow_job"), b"[1]", Delivery::Malformed),
        ];
        for (signature, event, body, expected) in table {
            assert_eq!(&webhook.judge(*signature, *event, body), expected, "{signature:?} {event:?} {}", String::from_utf8_lossy(body));
        }
    }

    #[tokio::test]
    async fn a_wake_during_a_fetch_is_not_lost() {
        let wake = Wake::default();
        let mut seen = wake.subscribe();
        seen.borrow_and_update();
        wake.wake();
        // The loop was fetching: it sees the change when it would go idle.
        assert!(seen.has_changed().unwrap());
    }
}
