//! [`Queue`] on JetStream: the WorkQueue stream, one durable pull consumer per
//! placement, and its deliveries (see the module docs of `jetstream`).

use std::time::Duration;

use async_nats::jetstream::{
    self, AckKind,
    consumer::{self, AckPolicy, PullConsumer},
    context::{ConsumerInfoErrorKind, PublishError, PublishErrorKind},
    message::PublishMessage,
};
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};

use super::{JetStream, consumer_name, retry_no_responders, unavailable};
use crate::{
    assignment::Placement,
    store::{Consumer, Delivery, Queue, Record, StoreError},
};

impl JetStream {
    fn subject(&self, placement: &str) -> String {
        format!("{}.{placement}", self.base)
    }

    /// Queues `assignment_id` on its placement's subject, deduplicated by its id.
    pub(super) async fn publish(&self, placement: &str, assignment_id: &str) -> Result<(), StoreError> {
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

#[async_trait]
impl Queue for JetStream {
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
