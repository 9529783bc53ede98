//! [`Records`] on JetStream: the live records in the KV bucket `<bucket>`, the finished
//! ones in `<bucket>-finished`, and the move from one to the other (see the module docs
//! of `jetstream`).

use async_nats::jetstream::{
    kv::{self, CreateErrorKind, UpdateErrorKind},
    stream::LastRawMessageErrorKind,
};
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};

use super::{JetStream, retry_no_responders, unavailable};
use crate::store::{Record, Records, State, StoreError, Versioned, check_transition};

/// The header a KV delete or purge marker carries (the value is `DEL` or `PURGE`).
const KV_OPERATION: &str = "KV-Operation";

/// How many records `list` reads at once.
const LIST_CONCURRENCY: usize = 32;

impl JetStream {
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
    /// leaves a marker per key, and the stream's subjects — what [`Records::list`] reads —
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

#[async_trait]
impl Records for JetStream {
    /// `kv.create` then publish. Two writes, so a crash can fall between them; a repeated
    /// persist then finds the record and publishes again, and the stream drops the copy
    /// if the first publish did get through (same `Nats-Msg-Id` within the window). A
    /// record that already moved on from Pending is not enqueued again.
    async fn persist(&self, record: &Record) -> Result<bool, StoreError> {
        let id = &record.assignment_id;
        let value = self.encode_fitting(record)?;
        // The first request to a stream just created may find nobody answering yet, a read
        // as much as a write (a fresh three-node cluster, one CI run in many).
        let finished = retry_no_responders(|| self.finished.entry(id), |error: &kv::EntryError| crate::error_chain(error).contains("no responders"))
            .await
            .map_err(unavailable(format!("reading finished record {id}")))?;
        if finished.is_some_and(|e| e.operation == kv::Operation::Put) {
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
}
