//! The NATS JetStream backend; see the module docs of `store`.
//!
//! - Queue: one WorkQueue stream over `<base>.>` (file storage). An assignment of
//!   placement `<class>.<driver>` is published on `<base>.<class>.<driver>` with
//!   `Nats-Msg-Id` = assignment id and the id as payload; the stream removes a message
//!   when it is acknowledged.
//! - Consumers: one durable pull consumer per placement, `worker-<class>-<driver>`,
//!   filtered on the placement's subject, explicit acks, `MaxAckPending` = the pool's
//!   capacity, `AckWait` from [`JetStream::connect`].
//! - Records: a KV bucket of the live records, key = assignment id, value = [`Record`]
//!   as JSON; the KV revision is the compare-and-set revision. A record that becomes
//!   terminal is written there (the compare-and-set), copied to `<bucket>-finished`
//!   (whose entries age out after the retention) and deleted from the live bucket; a
//!   crash between those steps leaves a terminal record in the live bucket, which the
//!   next [`Store::list`] moves on.
//! - Sizes: a record must fit the servers' `max_payload` (1 MiB by default); one that
//!   does not is [`StoreError::TooLarge`] at once instead of a write the server refuses
//!   again and again.

use std::{path::PathBuf, time::Duration};

use async_nats::jetstream::{
    self, AckKind,
    consumer::{self, AckPolicy, PullConsumer},
    context::{ConsumerInfoErrorKind, PublishError, PublishErrorKind},
    kv::{self, CreateErrorKind, UpdateErrorKind},
    message::PublishMessage,
    stream::{self, LastRawMessageErrorKind, RetentionPolicy, StorageType},
};
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};

use super::{Consumer, Delivery, Record, State, Store, StoreError, Versioned, check_transition};
use crate::assignment::Placement;

/// The header a KV delete or purge marker carries (the value is `DEL` or `PURGE`).
const KV_OPERATION: &str = "KV-Operation";

/// How long the stream remembers a `Nats-Msg-Id`. Longer than JetStream's default of
/// two minutes so that a persist repeated well after a crash (a controller that was
/// down for a while) is still deduplicated while its first copy waits in the queue.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(60 * 60);

/// How many records `list` reads at once.
const LIST_CONCURRENCY: usize = 32;

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

/// Creates (or updates) the stream and both buckets.
async fn set_up(
    context: &jetstream::Context,
    stream_name: &str,
    base_subject: &str,
    bucket: &str,
    replicas: usize,
    retention: Duration,
) -> Result<(stream::Stream<()>, kv::Store, kv::Store, kv::Store), StoreError> {
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
        let deadline = std::time::Instant::now() + SET_UP_PATIENCE;
        let mut pauses = contract::backoff::Backoff::new(Duration::from_millis(250), Duration::from_secs(4));
        let (stream, kv, finished, leases) = loop {
            let (error, transient) = match set_up(&context, &stream_name, base_subject, bucket, replicas, settings.retention).await {
                Ok(handles) => match without_leader(&context, &replicated).await {
                    None => break handles,
                    Some(name) => (
                        StoreError::Unavailable {
                            context: format!("waiting for stream {name} to elect a leader; check that a majority of the NATS cluster's nodes run"),
                            source: "no leader yet".into(),
                        },
                        true,
                    ),
                },
                Err(error) => {
                    let transient = is_transient(&error);
                    (error, transient)
                }
            };
            let pause = pauses.next_delay();
            if !transient || std::time::Instant::now() + pause >= deadline {
                return Err(error);
            }
            tracing::warn!(url, error = %crate::error_chain(&error), "JetStream is not answering yet (a cluster electing its leaders?); retrying");
            tokio::time::sleep(pause).await;
        };
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

    /// The record's bytes, refused when no server would take them. The headroom is for
    /// the message's subject and headers.
    fn encode_fitting(&self, record: &Record) -> Result<Bytes, StoreError> {
        let value = encode(record)?;
        let limit = self.max_payload.saturating_sub(1024);
        if value.len() > limit {
            return Err(StoreError::TooLarge {
                assignment_id: record.assignment_id.clone(),
                size: value.len(),
                limit,
                hint: "; raise max_payload on the NATS servers (e.g. 8MB) to store tasks this large",
            });
        }
        Ok(value)
    }

    /// Copies a terminal record to the finished bucket and deletes it from the live one
    /// (if it is still at `revision`); best effort — the next `list` finishes a move a
    /// crash cut short. Returns the revision it has in the finished bucket.
    async fn move_to_finished(&self, record: &Record, revision: u64) -> Result<u64, StoreError> {
        let id = &record.assignment_id;
        let finished =
            self.finished.put(id, encode(record)?).await.map_err(unavailable(format!("copying finished record {id} to bucket {}-finished", self.bucket)))?;
        // Another writer that changed it meanwhile wins; its own write moves it again.
        if self.kv.delete_expect_revision(id, Some(revision)).await.is_ok() {
            self.forget_live(id).await;
        }
        Ok(finished)
    }

    /// Removes every trace of a deleted key from the live bucket's stream. A KV delete
    /// leaves a marker per key, and the stream's subjects — what [`Store::list`] reads —
    /// would grow with every record ever finished (100k finished records made a sweep
    /// take 13 s: the sweep benchmark). Only a deleted key is purged, and a record id is
    /// never written again once finished, so nothing live can go with it. Best effort:
    /// a marker left here is purged by the next `list`.
    async fn forget_live(&self, id: &str) {
        let subject = format!("{}{id}", self.kv.prefix);
        if let Err(error) = self.kv.stream.purge().filter(subject).await {
            tracing::debug!(assignment.id = id, %error, "cannot purge the deleted record's marker yet");
        }
    }

    fn subject(&self, placement: &str) -> String {
        format!("{}.{placement}", self.base)
    }

    async fn publish(&self, placement: &str, assignment_id: &str) -> Result<(), StoreError> {
        let subject = self.subject(placement);
        let what = || format!("publishing {assignment_id} on {subject}");
        let publish = PublishMessage::build().message_id(assignment_id).payload(Bytes::from(assignment_id.to_owned()));
        // The ack says the stream stored it (or that it was a duplicate of a stored
        // message within the window, which is just as good).
        // async-nats reports a publish answered "no responders" as StreamNotFound; the
        // stream exists (opening the store made it).
        let unanswered = |error: &PublishError| error.kind() == PublishErrorKind::StreamNotFound;
        retry_no_responders(|| async { self.context.send_publish(subject.clone(), publish.clone()).await?.await }, unanswered)
            .await
            .map_err(unavailable(what()))?;
        Ok(())
    }
}

impl JetStream {
    /// The live record, if any.
    async fn get_live(&self, assignment_id: &str) -> Result<Option<Versioned<Record>>, StoreError> {
        read_confirmed(&self.kv, &self.bucket, assignment_id).await
    }

    /// The finished record, if it is still kept.
    async fn get_finished(&self, assignment_id: &str) -> Result<Option<Versioned<Record>>, StoreError> {
        read_confirmed(&self.finished, &format!("{}-finished", self.bucket), assignment_id).await
    }
}

/// Reads one record of `bucket`. Any replica may answer a KV read (direct get), and one
/// that has not yet applied a put answers "no record": the worker then dropped the
/// queued assignment and the task never ran (found by the kill campaign on a three-node
/// cluster). A present record may be a little old — every write is a compare-and-set
/// the leader checks — but "absent" is confirmed by the leader.
async fn read_confirmed(kv: &kv::Store, bucket: &str, assignment_id: &str) -> Result<Option<Versioned<Record>>, StoreError> {
    let entry = kv.entry(assignment_id).await.map_err(unavailable(format!("reading record {assignment_id} from bucket {bucket}")))?;
    if let Some(entry) = entry
        && entry.operation == kv::Operation::Put
    {
        return Ok(Some(Versioned { value: decode(assignment_id, &entry.value)?, revision: entry.revision }));
    }
    let subject = format!("{}{assignment_id}", kv.prefix);
    let message = match kv.stream.get_last_raw_message_by_subject(&subject).await {
        Ok(message) => message,
        Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => return Ok(None),
        Err(error) => return Err(unavailable(format!("confirming with the leader that record {assignment_id} is absent from bucket {bucket}"))(error)),
    };
    // Deleted or purged keys read as absent.
    let operation = message.headers.get(KV_OPERATION).map(|v| v.as_str().to_owned());
    if operation.as_deref().is_some_and(|op| op == "DEL" || op == "PURGE") {
        return Ok(None);
    }
    Ok(Some(Versioned { value: decode(assignment_id, &message.payload)?, revision: message.sequence }))
}

fn decode(key: &str, bytes: &[u8]) -> Result<Record, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt { key: key.to_owned(), reason: e.to_string() })
}

fn encode(record: &Record) -> Result<Bytes, StoreError> {
    serde_json::to_vec(record).map(Bytes::from).map_err(|e| StoreError::Corrupt { key: record.assignment_id.clone(), reason: format!("cannot encode: {e}") })
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
    /// `kv.create` then publish. Two writes, so a crash can fall between them; a repeated
    /// persist then finds the record and publishes again, and the stream drops the copy
    /// if the first publish did get through (same `Nats-Msg-Id` within the window). A
    /// record that already moved on from Pending is not enqueued again.
    async fn persist(&self, record: &Record) -> Result<bool, StoreError> {
        let id = &record.assignment_id;
        let value = self.encode_fitting(record)?;
        if self.finished.entry(id).await.map_err(unavailable(format!("reading finished record {id}")))?.is_some_and(|e| e.operation == kv::Operation::Put) {
            return Ok(false);
        }
        let unanswered = |error: &kv::CreateError| crate::error_chain(error).contains("no responders");
        let created = match retry_no_responders(|| self.kv.create(id, value.clone()), unanswered).await {
            Ok(_) => true,
            Err(e) if e.kind() == CreateErrorKind::AlreadyExists => false,
            Err(e) => return Err(unavailable(format!("creating record {id} in bucket {}", self.bucket))(e)),
        };
        let placement = if created {
            record.placement
        } else {
            match self.get(id).await? {
                // The stored record decides: it is the one the worker will read.
                Some(stored) if stored.value.state == State::Pending => stored.value.placement,
                // Claimed or finished (or deleted meanwhile): nothing to deliver.
                _ => return Ok(false),
            }
        };
        self.publish(&placement.to_string(), id).await?;
        Ok(created)
    }

    async fn get(&self, assignment_id: &str) -> Result<Option<Versioned<Record>>, StoreError> {
        match self.get_live(assignment_id).await? {
            Some(live) => Ok(Some(live)),
            None => self.get_finished(assignment_id).await,
        }
    }

    async fn update(&self, record: &Record, expected: u64) -> Result<u64, StoreError> {
        let id = &record.assignment_id;
        // A finished record is rewritten where it is (a phase reported after the end).
        let (current, bucket) = match self.get_live(id).await? {
            Some(live) => (live, &self.kv),
            None => (self.get_finished(id).await?.ok_or_else(|| StoreError::NotFound(id.clone()))?, &self.finished),
        };
        if current.revision != expected {
            return Err(StoreError::Conflict { assignment_id: id.clone(), expected });
        }
        // Checked against the value at `expected`; the update below only succeeds if
        // that is still the latest value, so check and write cannot be split.
        check_transition(&current.value, record)?;
        let value = self.encode_fitting(record)?;
        let revision = match bucket.update(id, value, expected).await {
            Ok(revision) => revision,
            Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => return Err(StoreError::Conflict { assignment_id: id.clone(), expected }),
            Err(e) => return Err(unavailable(format!("updating record {id} at revision {expected}"))(e)),
        };
        if record.is_terminal() && std::ptr::eq(bucket, &self.kv) {
            return self.move_to_finished(record, revision).await;
        }
        Ok(revision)
    }

    async fn lease(&self, name: &str, holder: &str, ttl: Duration) -> Result<bool, StoreError> {
        let what = || format!("the lease {name}");
        let corrupt = |e: serde_json::Error| StoreError::Corrupt { key: name.to_owned(), reason: e.to_string() };
        let entry = self.leases.entry(name).await.map_err(unavailable(what()))?.filter(|e| e.operation == kv::Operation::Put);
        let current: Option<super::Lease> = entry.as_ref().map(|e| serde_json::from_slice(&e.value)).transpose().map_err(corrupt)?;
        let Some(next) = super::Lease::take(current.as_ref(), holder, super::now_ms(), ttl) else { return Ok(false) };
        let next = serde_json::to_vec(&next).map_err(corrupt)?;
        let outcome = match entry {
            None => self.leases.create(name, next.into()).await.map(|_| ()).map_err(|e| e.to_string()),
            Some(entry) => self.leases.update(name, next.into(), entry.revision).await.map(|_| ()).map_err(|e| e.to_string()),
        };
        // Losing the compare-and-set means another holder took it first.
        Ok(outcome.is_ok())
    }

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

    async fn release_lease(&self, name: &str, holder: &str) -> Result<(), StoreError> {
        let what = || format!("the lease {name}");
        if let Some(entry) = self.leases.entry(name).await.map_err(unavailable(what()))?
            && entry.operation == kv::Operation::Put
            && serde_json::from_slice::<super::Lease>(&entry.value).is_ok_and(|l| l.holder == holder)
        {
            let _ = self.leases.delete_expect_revision(name, Some(entry.revision)).await;
        }
        Ok(())
    }

    async fn list_finished(&self) -> Result<Vec<Versioned<Record>>, StoreError> {
        let what = || format!("listing keys of bucket {}-finished", self.bucket);
        let prefix = self.finished.prefix.as_str();
        let subjects: Vec<(String, usize)> = self
            .finished
            .stream
            .info_with_subjects(format!("{prefix}>"))
            .await
            .map_err(unavailable(what()))?
            .try_collect()
            .await
            .map_err(unavailable(what()))?;
        let mut records = Vec::new();
        for key in subjects.into_iter().filter_map(|(subject, _)| subject.strip_prefix(prefix).map(str::to_owned)) {
            if let Some(record) = self.get_finished(&key).await? {
                records.push(record);
            }
        }
        Ok(records)
    }

    /// Nothing to do: the finished bucket's age limit (the retention) removes them.
    async fn prune(&self, _ended_before_ms: i64) -> Result<usize, StoreError> {
        Ok(0)
    }

    /// Published with `Nats-Msg-Id` `<id>.<generation>`: a new message the stream keeps
    /// even while the first one's id is in its duplicate window, and the same call
    /// repeated adds nothing.
    async fn requeue(&self, record: &Record, generation: u32) -> Result<(), StoreError> {
        let id = &record.assignment_id;
        let subject = self.subject(&record.placement.to_string());
        let publish = PublishMessage::build().message_id(format!("{id}.{generation}")).payload(Bytes::from(id.clone()));
        let unanswered = |error: &PublishError| error.kind() == PublishErrorKind::StreamNotFound;
        retry_no_responders(|| async { self.context.send_publish(subject.clone(), publish.clone()).await?.await }, unanswered)
            .await
            .map_err(unavailable(format!("queueing {id} again on {subject}")))?;
        Ok(())
    }

    async fn list(&self) -> Result<Vec<Versioned<Record>>, StoreError> {
        // The keys come from the bucket stream's subjects as its leader reports them:
        // `kv.keys()` reads through an ephemeral consumer that may sit on a replica still
        // catching up after a restart, and a record written a moment ago was then missing
        // from the list (found by the cluster test after two nodes came back).
        let what = || format!("listing keys of bucket {} (from its stream leader)", self.bucket);
        let prefix = self.kv.prefix.as_str();
        let subjects: Vec<(String, usize)> =
            self.kv.stream.info_with_subjects(format!("{prefix}>")).await.map_err(unavailable(what()))?.try_collect().await.map_err(unavailable(what()))?;
        let keys: Vec<String> = subjects.into_iter().filter_map(|(subject, _)| subject.strip_prefix(prefix).map(str::to_owned)).collect();
        let records: Vec<Option<Versioned<Record>>> =
            futures_util::stream::iter(keys.clone()).map(|key| async move { self.get_live(&key).await }).buffered(LIST_CONCURRENCY).try_collect().await?;
        // A key deleted between listing and reading is simply gone (and its marker, left
        // by a move cut short or an earlier version, is purged); a terminal one is a move
        // a crash cut short: finished now.
        let mut live = Vec::new();
        for (key, record) in keys.iter().zip(records) {
            let Some(record) = record else {
                self.forget_live(key).await;
                continue;
            };
            if record.value.is_terminal() {
                if let Err(error) = self.move_to_finished(&record.value, record.revision).await {
                    tracing::warn!(assignment.id = %record.value.assignment_id, error = %crate::error_chain(&error), "cannot move a finished record yet");
                }
            } else {
                live.push(record);
            }
        }
        Ok(live)
    }

    /// The placement consumer's `num_pending`: messages on its subject not yet delivered
    /// (given-back and redelivery-pending ones are not counted). Before that consumer
    /// exists nothing was delivered, so it is the number of messages on the subject.
    async fn queue_depth(&self, placement: Placement) -> Result<u64, StoreError> {
        let placement = placement.to_string();
        let placement = placement.as_str();
        let name = consumer_name(placement);
        match self.stream.consumer_info(&name).await {
            Ok(info) => Ok(info.num_pending),
            Err(e) if matches!(e.kind(), ConsumerInfoErrorKind::NotFound) => {
                let subject = self.subject(placement);
                let what = || format!("counting messages on {subject}");
                let counts: Vec<(String, usize)> =
                    self.stream.info_with_subjects(&subject).await.map_err(unavailable(what()))?.try_collect().await.map_err(unavailable(what()))?;
                let count: usize = counts.into_iter().filter(|(s, _)| *s == subject).map(|(_, n)| n).sum();
                Ok(u64::try_from(count).unwrap_or(u64::MAX))
            }
            Err(e) => Err(unavailable(format!("reading consumer {name} of stream {}", self.stream_name))(e)),
        }
    }

    /// Creates the durable consumer, or updates it to this `max_in_flight` and the
    /// store's ack wait (the server's create action is create-or-update).
    async fn consumer(&self, placement: Placement, max_in_flight: usize) -> Result<Box<dyn Consumer>, StoreError> {
        let placement = placement.to_string();
        let placement = placement.as_str();
        let name = consumer_name(placement);
        let config = consumer::pull::Config {
            durable_name: Some(name.clone()),
            description: Some(format!("workers of placement {placement}")),
            filter_subject: self.subject(placement),
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.ack_wait,
            // At least one: 0 would mean "server default" (1000), not "none".
            max_ack_pending: i64::try_from(max_in_flight.max(1)).unwrap_or(i64::MAX),
            ..Default::default()
        };
        let consumer =
            self.stream.create_consumer(config).await.map_err(unavailable(format!("creating or updating consumer {name} on stream {}", self.stream_name)))?;
        Ok(Box::new(JetStreamConsumer { consumer, name }))
    }
}

struct JetStreamConsumer {
    consumer: PullConsumer,
    name: String,
}

/// The server refuses pull requests that expire in under a millisecond.
const MIN_EXPIRES: Duration = Duration::from_millis(10);

#[async_trait]
impl Consumer for JetStreamConsumer {
    /// One pull request for one message per call, waiting up to `wait` at the server.
    /// Nothing is prefetched, so a message is never held by a process that is not about
    /// to work on it. If this future is dropped while the request is open, a message the
    /// server sends meanwhile is lost to this process and comes again after the ack wait.
    async fn next(&mut self, wait: Duration) -> Result<Option<Box<dyn Delivery>>, StoreError> {
        let what = || format!("pulling from consumer {}", self.name);
        let mut batch = if wait.is_zero() {
            // Answers at once, with "no messages" when there are none.
            self.consumer.fetch().max_messages(1).messages().await
        } else {
            self.consumer.batch().max_messages(1).expires(wait.max(MIN_EXPIRES)).messages().await
        }
        .map_err(unavailable(what()))?;
        let message = match batch.next().await {
            None => return Ok(None),
            Some(Err(e)) => {
                return Err(StoreError::Unavailable { context: what(), source: e });
            }
            Some(Ok(message)) => message,
        };
        let attempt = message
            .info()
            .map(|info| u64::try_from(info.delivered).unwrap_or(1).max(1))
            .map_err(|e| StoreError::Unavailable { context: format!("{}: reading message metadata", what()), source: e })?;
        match std::str::from_utf8(&message.payload) {
            Ok(id) => {
                let assignment_id = id.to_owned();
                Ok(Some(Box::new(JetStreamDelivery { message, assignment_id, attempt })))
            }
            Err(e) => {
                // Not ours to interpret, and redelivering it would fail forever: stop it.
                let _ = message.ack_with(AckKind::Term).await;
                Err(StoreError::Corrupt { key: message.subject.to_string(), reason: format!("payload is not an id: {e}") })
            }
        }
    }
}

struct JetStreamDelivery {
    message: jetstream::Message,
    assignment_id: String,
    attempt: u64,
}

#[async_trait]
impl Delivery for JetStreamDelivery {
    fn assignment_id(&self) -> &str {
        &self.assignment_id
    }

    fn attempt(&self) -> u64 {
        self.attempt
    }

    /// Not confirmed by the server; if it is lost the ack wait redelivers anyway.
    async fn nak(self: Box<Self>, delay: Duration) -> Result<(), StoreError> {
        self.message
            .ack_with(AckKind::Nak(Some(delay)))
            .await
            .map_err(|source| StoreError::Unavailable { context: format!("giving back {} for {delay:?}", self.assignment_id), source })
    }

    async fn ack(self: Box<Self>) -> Result<(), StoreError> {
        self.message.double_ack().await.map_err(|source| StoreError::Unavailable { context: format!("acknowledging {}", self.assignment_id), source })
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
