//! The NATS JetStream backend; see the module docs of `store`.
//!
//! - Queue: one WorkQueue stream over `<base>.>` (file storage). An assignment of
//!   placement `<class>.<driver>` is published on `<base>.<class>.<driver>` with
//!   `Nats-Msg-Id` = assignment id and the id as payload; the stream removes a message
//!   when it is acknowledged.
//! - Consumers: one durable pull consumer per placement, `worker-<class>-<driver>`,
//!   filtered on the placement's subject, explicit acks, `MaxAckPending` = the pool's
//!   capacity, `AckWait` from [`JetStream::connect`].
//! - Records: a KV bucket of the live records, key = assignment id, value = [`Record`](super::Record)
//!   as JSON; the KV revision is the compare-and-set revision. A record that becomes
//!   terminal is written there (the compare-and-set), copied to `<bucket>-finished`
//!   (whose entries age out after the retention) and deleted from the live bucket; a
//!   crash between those steps leaves a terminal record in the live bucket, which the
//!   next [`Records::list`](super::Records::list) moves on.
//! - Sizes: a record must fit the servers' `max_payload` (1 MiB by default); one that
//!   does not is [`StoreError::TooLarge`] at once instead of a write the server refuses
//!   again and again.
//!
//! One file per concern: this one connects and sets up the stream and the buckets
//! ([`Settings`], [`JetStream::connect_with`]) and holds what the others share;
//! `records.rs` implements [`Records`](super::Records) on the live and finished buckets,
//! `queue.rs` [`Queue`](super::Queue) with its consumer and delivery on the stream, and
//! `leases.rs` [`Leases`](super::Leases) on the leases bucket.

mod leases;
mod queue;
mod records;

use std::{path::PathBuf, time::Duration};

use async_nats::jetstream::{
    self, kv,
    stream::{self, RetentionPolicy, StorageType},
};
use async_trait::async_trait;
use bytes::Bytes;
use contract::backoff::{Backoff, retry_until};

use super::{Store, StoreError};

/// How long the stream remembers a `Nats-Msg-Id`. Longer than JetStream's default of
/// two minutes so that a persist repeated well after a crash (a controller that was
/// down for a while) is still deduplicated while its first copy waits in the queue.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(60 * 60);

/// How to reach and lay out the JetStream store (`[store]` with `kind = "jetstream"`).
#[derive(Clone, PartialEq, Eq)]
pub struct Settings {
    /// `nats://host:4222`, several comma-separated for a cluster. Credentials never go
    /// here: see `credentials_file` and `token_file`.
    pub url: String,
    pub subject: String,
    pub bucket: String,
    pub ack_wait: Duration,
    pub replicas: usize,
    /// How long finished records are kept.
    pub retention: Duration,
    /// A NATS credentials file (`.creds`: user JWT and NKey seed).
    pub credentials_file: Option<PathBuf>,
    /// A file holding a NATS token.
    pub token_file: Option<PathBuf>,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("url", &redact_url(&self.url))
            .field("subject", &self.subject)
            .field("bucket", &self.bucket)
            .field("replicas", &self.replicas)
            .field("retention", &self.retention)
            .field("credentials_file", &self.credentials_file)
            .field("token_file", &self.token_file)
            .finish_non_exhaustive()
    }
}

impl Settings {
    pub fn new(url: &str, subject: &str, bucket: &str, ack_wait: Duration) -> Settings {
        Settings {
            url: url.to_owned(),
            subject: subject.to_owned(),
            bucket: bucket.to_owned(),
            ack_wait,
            replicas: 1,
            retention: super::DEFAULT_RETENTION,
            credentials_file: None,
            token_file: None,
        }
    }
}

/// `nats://user:secret@host:4222,…` → `nats://***@host:4222,…`: a URL fit for logs.
pub fn redact_url(url: &str) -> String {
    url.split(',')
        .map(|server| match (server.find("://"), server.rfind('@')) {
            (Some(scheme), Some(at)) if at > scheme => format!("{}***{}", &server[..scheme + 3], &server[at..]),
            (None, Some(at)) => format!("***{}", &server[at..]),
            _ => server.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The JetStream store.
#[derive(Clone)]
pub struct JetStream {
    context: jetstream::Context,
    stream: stream::Stream<()>,
    kv: kv::Store,
    finished: kv::Store,
    leases: kv::Store,
    /// The servers' largest message.
    max_payload: usize,
    base: String,
    stream_name: String,
    bucket: String,
    ack_wait: Duration,
}

impl std::fmt::Debug for JetStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStream")
            .field("stream", &self.stream_name)
            .field("subjects", &format!("{}.>", self.base))
            .field("bucket", &self.bucket)
            .field("ack_wait", &self.ack_wait)
            .finish_non_exhaustive()
    }
}

/// Wraps any error as `Unavailable` with what was being attempted.
fn unavailable<E>(context: impl Into<String>) -> impl FnOnce(E) -> StoreError
where
    E: std::error::Error + Send + Sync + 'static,
{
    let context = context.into();
    move |source| StoreError::Unavailable { context, source: Box::new(source) }
}

/// `ci.assignments` → `CI_ASSIGNMENTS`: stream names may not contain `.`, `*`, `>` or
/// whitespace.
#[must_use]
pub fn stream_name(base: &str) -> String {
    base.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c.to_ascii_uppercase() } else { '_' }).collect()
}

/// `container.docker` → `worker-container-docker`: consumer names may not contain `.`.
#[must_use]
pub fn consumer_name(placement: &str) -> String {
    let tail: String = placement.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '-' }).collect();
    format!("worker-{tail}")
}

/// How long opening the store waits for a cluster that times out JetStream requests.
const SET_UP_PATIENCE: Duration = Duration::from_secs(60);

/// The stream and the buckets: live records, finished records, leases.
type Handles = (stream::Stream<()>, kv::Store, kv::Store, kv::Store);

/// Creates (or updates) the stream and both buckets.
async fn set_up(
    context: &jetstream::Context,
    stream_name: &str,
    base_subject: &str,
    bucket: &str,
    replicas: usize,
    retention: Duration,
) -> Result<Handles, StoreError> {
    context
        .create_or_update_stream(stream::Config {
            name: stream_name.to_owned(),
            subjects: vec![format!("{base_subject}.>")],
            retention: RetentionPolicy::WorkQueue,
            storage: StorageType::File,
            duplicate_window: DUPLICATE_WINDOW,
            num_replicas: replicas,
            description: Some("gitea-dynamic-runner assignments, one subject per placement".into()),
            ..Default::default()
        })
        .await
        .map_err(unavailable(format!("creating or updating stream {stream_name} over {base_subject}.>")))?;
    let stream = context.get_stream_no_info(stream_name).await.map_err(unavailable(format!("opening stream {stream_name}")))?;

    let kv = context
        .create_or_update_key_value(kv::Config {
            bucket: bucket.to_owned(),
            description: "gitea-dynamic-runner assignment records".into(),
            // Compare-and-set needs only the latest value.
            history: 1,
            storage: StorageType::File,
            num_replicas: replicas,
            ..Default::default()
        })
        .await
        .map_err(unavailable(format!("creating or updating KV bucket {bucket}")))?;
    let finished_bucket = format!("{bucket}-finished");
    let finished = context
        .create_or_update_key_value(kv::Config {
            bucket: finished_bucket.clone(),
            description: "gitea-dynamic-runner finished assignment records (credentials removed), kept for the retention".into(),
            history: 1,
            max_age: retention,
            storage: StorageType::File,
            num_replicas: replicas,
            ..Default::default()
        })
        .await
        .map_err(unavailable(format!("creating or updating KV bucket {finished_bucket}")))?;
    let leases_bucket = format!("{bucket}-leases");
    let leases = context
        .create_or_update_key_value(kv::Config {
            bucket: leases_bucket.clone(),
            description: "gitea-dynamic-runner leases (one active scheduler per registration)".into(),
            history: 1,
            storage: StorageType::File,
            num_replicas: replicas,
            ..Default::default()
        })
        .await
        .map_err(unavailable(format!("creating or updating KV bucket {leases_bucket}")))?;

    Ok((stream, kv, finished, leases))
}

/// A timeout or a temporarily unavailable JetStream, which a retry can outlast. The
/// client folds these into different error kinds per request (a KV bucket's creation
/// wraps its stream's), so the cause is recognised by its text.
fn is_transient(error: &StoreError) -> bool {
    let text = crate::error_chain(error);
    // "peer offline": a replicated stream cannot be placed while the cluster counts a node
    // as offline (seen on a loaded three-node cluster right after it formed).
    ["timed out", "temporarily unavailable", "no responders", "peer offline"].iter().any(|needle| text.contains(needle))
}

/// The first of `names` whose replicated stream has not elected a leader yet. A stream
/// created with replicas answers its creation before that: a write in the next moment
/// gets "no responders" (seen on a real three-node cluster), so the store is not usable.
async fn without_leader(context: &jetstream::Context, names: &[String]) -> Option<String> {
    for name in names {
        let led = context.get_stream(name).await.is_ok_and(|stream| stream.cached_info().cluster.as_ref().is_some_and(|cluster| cluster.leader.is_some()));
        if !led {
            return Some(name.clone());
        }
    }
    None
}

/// [`set_up`], then a leader for each of `replicated`; an error comes with whether a
/// retry can outlast it.
async fn set_up_led(
    context: &jetstream::Context,
    stream_name: &str,
    base_subject: &str,
    bucket: &str,
    replicas: usize,
    retention: Duration,
    replicated: &[String],
) -> Result<Handles, (StoreError, bool)> {
    match set_up(context, stream_name, base_subject, bucket, replicas, retention).await {
        Ok(handles) => match without_leader(context, replicated).await {
            None => Ok(handles),
            Some(name) => Err((
                StoreError::Unavailable {
                    context: format!("waiting for stream {name} to elect a leader; check that a majority of the NATS cluster's nodes run"),
                    source: "no leader yet".into(),
                },
                true,
            )),
        },
        Err(error) => {
            let transient = is_transient(&error);
            Err((error, transient))
        }
    }
}

impl JetStream {
    /// Connects and creates (or updates) the stream and the KV bucket.
    ///
    /// # Errors
    /// `Unavailable` when the server cannot be reached or refuses the stream or bucket
    /// (e.g. a stream of that name exists with a configuration that cannot be updated).
    pub async fn connect(url: &str, base_subject: &str, bucket: &str, ack_wait: Duration) -> Result<Self, StoreError> {
        Self::connect_with(&Settings::new(url, base_subject, bucket, ack_wait)).await
    }

    /// [`JetStream::connect`] with `replicas` copies of the stream and the buckets (3 on a
    /// three-node cluster survives the loss of one node). `url` may list several servers,
    /// comma-separated; the client fails over between them.
    ///
    /// # Errors
    /// As [`JetStream::connect`]; also an unparsable server address.
    pub async fn connect_replicated(url: &str, base_subject: &str, bucket: &str, ack_wait: Duration, replicas: usize) -> Result<Self, StoreError> {
        Self::connect_with(&Settings { replicas, ..Settings::new(url, base_subject, bucket, ack_wait) }).await
    }

    /// Connects as `settings` say (credentials from their files) and sets up the stream
    /// and the buckets.
    ///
    /// # Errors
    /// As [`JetStream::connect`]; also an unreadable credentials or token file.
    pub async fn connect_with(settings: &Settings) -> Result<Self, StoreError> {
        let (url, base_subject, bucket, ack_wait, replicas) =
            (redact_url(&settings.url), settings.subject.as_str(), settings.bucket.as_str(), settings.ack_wait, settings.replicas);
        let url = url.as_str();
        let servers: Vec<async_nats::ServerAddr> = settings
            .url
            .split(',')
            .map(|server| server.trim().parse::<async_nats::ServerAddr>())
            .collect::<Result<_, _>>()
            .map_err(unavailable(format!("reading the NATS server list {url}")))?;
        let mut options = async_nats::ConnectOptions::new().name("gitea-dynamic-runner controller").retry_on_initial_connect();
        if let Some(file) = &settings.credentials_file {
            options = async_nats::ConnectOptions::with_credentials_file(file.clone())
                .await
                .map_err(unavailable(format!("reading the NATS credentials file {} (store.credentials_file)", file.display())))?
                .name("gitea-dynamic-runner controller")
                .retry_on_initial_connect();
        }
        if let Some(file) = &settings.token_file {
            let token = std::fs::read_to_string(file).map_err(unavailable(format!("reading the NATS token file {} (store.token_file)", file.display())))?;
            options = options.token(token.trim().to_owned());
        }
        let client = options.connect(servers).await.map_err(unavailable(format!("connecting to NATS at {url}")))?;
        let max_payload = client.server_info().max_payload;
        let context = jetstream::new(client);

        let stream_name = stream_name(base_subject);
        // A cluster that is electing leaders (a node just restarted, or the streams were
        // just created) times out JetStream requests or has replicated streams without a
        // leader for a few seconds: keep trying for a while instead of exiting, and fail
        // at once on anything else (a stream of that name with another configuration…).
        let replicated = if replicas > 1 {
            vec![stream_name.clone(), format!("KV_{bucket}"), format!("KV_{bucket}-finished"), format!("KV_{bucket}-leases")]
        } else {
            Vec::new()
        };
        let deadline = tokio::time::Instant::now() + SET_UP_PATIENCE;
        let mut pauses = Backoff::new(Duration::from_millis(250), Duration::from_secs(4));
        let (stream, kv, finished, leases) = retry_until(
            deadline,
            &mut pauses,
            |(_, transient): &(StoreError, bool)| *transient,
            |(error, _), _| tracing::warn!(url, error = %crate::error_chain(error), "JetStream is not answering yet (a cluster electing its leaders?); retrying"),
            || set_up_led(&context, &stream_name, base_subject, bucket, replicas, settings.retention, &replicated),
        )
        .await
        .map_err(|(error, _)| error)?;
        Ok(Self {
            context,
            stream,
            kv,
            finished,
            leases,
            max_payload: if max_payload == 0 { 1 << 20 } else { max_payload },
            base: base_subject.to_owned(),
            stream_name,
            bucket: bucket.to_owned(),
            ack_wait,
        })
    }
}

/// How often, and how far apart, a write answered "no responders" is tried again.
const NO_RESPONDERS_RETRIES: u32 = 4;
const NO_RESPONDERS_PAUSE: Duration = Duration::from_millis(250);

/// Runs `write`, again while `unanswered` says nobody answered it ("no responders"). The
/// server a client is connected to answers that for a stream's subjects until it has
/// learnt of the stream's leader — for a moment after the stream was created or its
/// leader changed, even when STREAM.INFO already names the leader (a fresh three-node
/// cluster, one run in ten). The official Go client retries a JetStream publish on
/// exactly this (nats.go: twice, 250 ms apart); async-nats does not, so the store does.
async fn retry_no_responders<T, E, F, Fut>(mut write: F, unanswered: impl Fn(&E) -> bool) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    for _ in 0..NO_RESPONDERS_RETRIES {
        match write().await {
            Err(error) if unanswered(&error) => tokio::time::sleep(NO_RESPONDERS_PAUSE).await,
            done => return done,
        }
    }
    write().await
}

#[async_trait]
impl Store for JetStream {
    async fn healthy(&self) -> Result<(), StoreError> {
        // A write, because only a write needs a quorum: a node cut off from the rest keeps
        // answering reads (stream info included) until its leaderships time out.
        let key = "health";
        self.leases
            .put(key, Bytes::from(super::now_ms().to_string()))
            .await
            .map(|_| ())
            .map_err(unavailable(format!("writing {key} to bucket {}-leases (a write needs a JetStream quorum)", self.bucket)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(stream_name("ci.assignments"), "CI_ASSIGNMENTS");
        assert_eq!(consumer_name("container.docker"), "worker-container-docker");
    }

    /// The texts the real nats-server answered while a cluster was forming or electing.
    #[test]
    fn transient_errors() {
        for (text, transient) in [
            ("jetstream request timed out", true),
            ("JetStream system temporarily unavailable", true),
            ("error response: 503, no responders", true),
            ("no suitable peers for placement, peer offline", true),
            ("stream name already in use with a different configuration", false),
            ("insufficient resources", false),
        ] {
            let error = StoreError::Unavailable { context: "creating or updating KV bucket b".into(), source: text.into() };
            assert_eq!(is_transient(&error), transient, "{text}");
        }
    }
}
