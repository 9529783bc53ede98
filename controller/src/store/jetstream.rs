//! The NATS JetStream backend; see the module docs of `store`.
//!
//! - Queue: one WorkQueue stream over `<base>.>` (file storage). An assignment of
//!   placement `<class>.<driver>` is published on `<base>.<class>.<driver>` with
//!   `Nats-Msg-Id` = assignment id and the id as payload; the stream removes a message
//!   when it is acknowledged.
//! - Consumers: one durable pull consumer per placement, `worker-<class>-<driver>`,
//!   filtered on the placement's subject, explicit acks, `MaxAckPending` = the pool's
//!   capacity, `AckWait` from [`JetStream::connect`].
//! - Records: a KV bucket, key = assignment id, value = [`Record`] as JSON; the KV
//!   revision is the compare-and-set revision.

use std::time::Duration;

use async_nats::jetstream::{
    self, AckKind,
    consumer::{self, AckPolicy, PullConsumer},
    context::ConsumerInfoErrorKind,
    message::PublishMessage,
    kv::{self, CreateErrorKind, Operation, UpdateErrorKind},
    stream::{self, RetentionPolicy, StorageType},
};
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};

use super::{Consumer, Delivery, Record, State, Store, StoreError, Versioned, embedded::check_transition};

/// How long the stream remembers a `Nats-Msg-Id`. Longer than JetStream's default of
/// two minutes so that a persist repeated well after a crash (a controller that was
/// down for a while) is still deduplicated while its first copy waits in the queue.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(60 * 60);

/// How many records `list` reads at once.
const LIST_CONCURRENCY: usize = 32;

/// The JetStream store.
#[derive(Clone)]
pub struct JetStream {
    context: jetstream::Context,
    stream: stream::Stream<()>,
    kv: kv::Store,
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
    base.chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c.to_ascii_uppercase() } else { '_' })
        .collect()
}

/// `container.docker` → `worker-container-docker`: consumer names may not contain `.`.
#[must_use]
pub fn consumer_name(placement: &str) -> String {
    let tail: String =
        placement.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '-' }).collect();
    format!("worker-{tail}")
}

impl JetStream {
    /// Connects and creates (or updates) the stream and the KV bucket.
    ///
    /// # Errors
    /// `Unavailable` when the server cannot be reached or refuses the stream or bucket
    /// (e.g. a stream of that name exists with a configuration that cannot be updated).
    pub async fn connect(url: &str, base_subject: &str, bucket: &str, ack_wait: Duration) -> Result<Self, StoreError> {
        let client = async_nats::ConnectOptions::new()
            .name("gitea-dynamic-runner controller")
            .connect(url)
            .await
            .map_err(unavailable(format!("connecting to NATS at {url}")))?;
        let context = jetstream::new(client);

        let stream_name = stream_name(base_subject);
        context
            .create_or_update_stream(stream::Config {
                name: stream_name.clone(),
                subjects: vec![format!("{base_subject}.>")],
                retention: RetentionPolicy::WorkQueue,
                storage: StorageType::File,
                duplicate_window: DUPLICATE_WINDOW,
                description: Some("gitea-dynamic-runner assignments, one subject per placement".into()),
                ..Default::default()
            })
            .await
            .map_err(unavailable(format!("creating or updating stream {stream_name} over {base_subject}.>")))?;
        let stream = context
            .get_stream_no_info(&stream_name)
            .await
            .map_err(unavailable(format!("opening stream {stream_name}")))?;

        let kv = context
            .create_or_update_key_value(kv::Config {
                bucket: bucket.to_owned(),
                description: "gitea-dynamic-runner assignment records".into(),
                // Compare-and-set needs only the latest value.
                history: 1,
                storage: StorageType::File,
                ..Default::default()
            })
            .await
            .map_err(unavailable(format!("creating or updating KV bucket {bucket}")))?;

        Ok(Self {
            context,
            stream,
            kv,
            base: base_subject.to_owned(),
            stream_name,
            bucket: bucket.to_owned(),
            ack_wait,
        })
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
        self.context
            .send_publish(subject.clone(), publish)
            .await
            .map_err(unavailable(what()))?
            .await
            .map_err(unavailable(what()))?;
        Ok(())
    }
}

fn decode(key: &str, bytes: &[u8]) -> Result<Record, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt { key: key.to_owned(), reason: e.to_string() })
}

fn encode(record: &Record) -> Result<Bytes, StoreError> {
    serde_json::to_vec(record)
        .map(Bytes::from)
        .map_err(|e| StoreError::Corrupt { key: record.assignment_id.clone(), reason: format!("cannot encode: {e}") })
}

#[async_trait]
impl Store for JetStream {
    /// `kv.create` then publish. Two writes, so a crash can fall between them; a repeated
    /// persist then finds the record and publishes again, and the stream drops the copy
    /// if the first publish did get through (same `Nats-Msg-Id` within the window). A
    /// record that already moved on from Pending is not enqueued again.
    async fn persist(&self, record: &Record) -> Result<bool, StoreError> {
        let id = &record.assignment_id;
        let created = match self.kv.create(id, encode(record)?).await {
            Ok(_) => true,
            Err(e) if e.kind() == CreateErrorKind::AlreadyExists => false,
            Err(e) => return Err(unavailable(format!("creating record {id} in bucket {}", self.bucket))(e)),
        };
        let placement = if created {
            record.placement.clone()
        } else {
            match self.get(id).await? {
                // The stored record decides: it is the one the worker will read.
                Some(stored) if stored.value.state == State::Pending => stored.value.placement,
                // Claimed or finished (or deleted meanwhile): nothing to deliver.
                _ => return Ok(false),
            }
        };
        self.publish(&placement, id).await?;
        Ok(created)
    }

    async fn get(&self, assignment_id: &str) -> Result<Option<Versioned<Record>>, StoreError> {
        let entry = self
            .kv
            .entry(assignment_id)
            .await
            .map_err(unavailable(format!("reading record {assignment_id} from bucket {}", self.bucket)))?;
        match entry {
            Some(entry) if entry.operation == Operation::Put => {
                Ok(Some(Versioned { value: decode(assignment_id, &entry.value)?, revision: entry.revision }))
            }
            // Deleted or purged keys read as absent.
            _ => Ok(None),
        }
    }

    async fn update(&self, record: &Record, expected: u64) -> Result<u64, StoreError> {
        let id = &record.assignment_id;
        let current = self.get(id).await?.ok_or_else(|| StoreError::NotFound(id.clone()))?;
        if current.revision != expected {
            return Err(StoreError::Conflict { assignment_id: id.clone(), expected });
        }
        // Checked against the value at `expected`; the update below only succeeds if
        // that is still the latest value, so check and write cannot be split.
        check_transition(&current.value, record)?;
        match self.kv.update(id, encode(record)?, expected).await {
            Ok(revision) => Ok(revision),
            Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => {
                Err(StoreError::Conflict { assignment_id: id.clone(), expected })
            }
            Err(e) => Err(unavailable(format!("updating record {id} at revision {expected}"))(e)),
        }
    }

    async fn list(&self) -> Result<Vec<Versioned<Record>>, StoreError> {
        let what = || format!("listing keys of bucket {}", self.bucket);
        let keys: Vec<String> =
            self.kv.keys().await.map_err(unavailable(what()))?.try_collect().await.map_err(unavailable(what()))?;
        let records: Vec<Option<Versioned<Record>>> = futures_util::stream::iter(keys)
            .map(|key| async move { self.get(&key).await })
            .buffered(LIST_CONCURRENCY)
            .try_collect()
            .await?;
        // A key deleted between listing and reading is simply gone.
        Ok(records.into_iter().flatten().collect())
    }

    /// The placement consumer's `num_pending`: messages on its subject not yet delivered
    /// (given-back and redelivery-pending ones are not counted). Before that consumer
    /// exists nothing was delivered, so it is the number of messages on the subject.
    async fn queue_depth(&self, placement: &str) -> Result<u64, StoreError> {
        let name = consumer_name(placement);
        match self.stream.consumer_info(&name).await {
            Ok(info) => Ok(info.num_pending),
            Err(e) if matches!(e.kind(), ConsumerInfoErrorKind::NotFound) => {
                let subject = self.subject(placement);
                let what = || format!("counting messages on {subject}");
                let counts: Vec<(String, usize)> = self
                    .stream
                    .info_with_subjects(&subject)
                    .await
                    .map_err(unavailable(what()))?
                    .try_collect()
                    .await
                    .map_err(unavailable(what()))?;
                let count: usize = counts.into_iter().filter(|(s, _)| *s == subject).map(|(_, n)| n).sum();
                Ok(u64::try_from(count).unwrap_or(u64::MAX))
            }
            Err(e) => Err(unavailable(format!("reading consumer {name} of stream {}", self.stream_name))(e)),
        }
    }

    /// Creates the durable consumer, or updates it to this `max_in_flight` and the
    /// store's ack wait (the server's create action is create-or-update).
    async fn consumer(&self, placement: &str, max_in_flight: usize) -> Result<Box<dyn Consumer>, StoreError> {
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
        let consumer = self
            .stream
            .create_consumer(config)
            .await
            .map_err(unavailable(format!("creating or updating consumer {name} on stream {}", self.stream_name)))?;
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
        self.message.ack_with(AckKind::Nak(Some(delay))).await.map_err(|source| StoreError::Unavailable {
            context: format!("giving back {} for {delay:?}", self.assignment_id),
            source,
        })
    }

    async fn ack(self: Box<Self>) -> Result<(), StoreError> {
        self.message.double_ack().await.map_err(|source| StoreError::Unavailable {
            context: format!("acknowledging {}", self.assignment_id),
            source,
        })
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
}
