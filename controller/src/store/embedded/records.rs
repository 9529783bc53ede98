//! [`Records`] in redb: the tables `records` (live), `finished` and `finished_by_time`,
//! with compare-and-set on each record's revision, and the group commit of persists (see
//! the module docs of `embedded`).

use std::sync::{Arc, PoisonError};

use async_trait::async_trait;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition, TableHandle};

use super::{Ctx, Embedded, FINISHED, FINISHED_BY_TIME, META, QUEUE, QUEUE_SEQ, RECORDS, blocking, decode, encode};
use crate::store::{Record, Records, StoreError, Versioned, check_transition};

/// One persist waiting to be committed, and where its outcome goes.
pub(super) struct PendingPersist {
    record: Record,
    value: Vec<u8>,
    reply: tokio::sync::oneshot::Sender<Result<bool, String>>,
}

/// Commits every pending persist in ONE write transaction (one fsync for all): record
/// and queue entry of each together, so after a crash either both exist or neither,
/// and a repeated persist has nothing to complete and enqueues nothing.
fn persist_batch_blocking(db: &Database, batch: Vec<PendingPersist>) {
    let outcome = (|| -> Result<Vec<bool>, StoreError> {
        let what = || format!("persisting {} assignments", batch.len());
        let txn = db.begin_write().ctx(what)?;
        let mut created = Vec::with_capacity(batch.len());
        {
            let mut records = txn.open_table(RECORDS).ctx(what)?;
            let finished = txn.open_table(FINISHED).ctx(what)?;
            let mut meta = txn.open_table(META).ctx(what)?;
            let mut queue = txn.open_table(QUEUE).ctx(what)?;
            let mut seq = meta.get(QUEUE_SEQ).ctx(what)?.map_or(0, |g| g.value());
            for pending in &batch {
                let id = pending.record.assignment_id.as_str();
                if records.get(id).ctx(what)?.is_some() || finished.get(id).ctx(what)?.is_some() {
                    created.push(false);
                    continue;
                }
                records.insert(id, (1, pending.value.as_slice())).ctx(what)?;
                seq += 1;
                queue.insert((pending.record.placement.to_string().as_str(), seq), (id, 0)).ctx(what)?;
                created.push(true);
            }
            meta.insert(QUEUE_SEQ, seq).ctx(what)?;
        }
        txn.commit().ctx(what)?;
        Ok(created)
    })();
    match outcome {
        Ok(created) => {
            for (pending, created) in batch.into_iter().zip(created) {
                let _ = pending.reply.send(Ok(created));
            }
        }
        Err(error) => {
            let message = crate::error_chain(&error);
            for pending in batch {
                let _ = pending.reply.send(Err(message.clone()));
            }
        }
    }
}

/// A compare-and-set on the record, live or finished; a live record that becomes
/// terminal moves to the finished ones in the same transaction.
fn update_blocking(db: &Database, record: &Record, value: &[u8], expected: u64) -> Result<u64, StoreError> {
    let id = record.assignment_id.as_str();
    let what = || format!("updating {id}");
    let read = |table: &redb::Table<&str, (u64, &[u8])>| -> Result<Option<(u64, Vec<u8>)>, StoreError> {
        Ok(table.get(id).ctx(what)?.map(|g| {
            let (revision, bytes) = g.value();
            (revision, bytes.to_vec())
        }))
    };
    let txn = db.begin_write().ctx(what)?;
    let revision = {
        let mut records = txn.open_table(RECORDS).ctx(what)?;
        let mut finished = txn.open_table(FINISHED).ctx(what)?;
        let mut by_time = txn.open_table(FINISHED_BY_TIME).ctx(what)?;
        let (live, (revision, bytes)) = match read(&records)? {
            Some(current) => (true, current),
            None => (false, read(&finished)?.ok_or_else(|| StoreError::NotFound(id.to_owned()))?),
        };
        if revision != expected {
            return Err(StoreError::Conflict { assignment_id: id.to_owned(), expected });
        }
        check_transition(&decode(id, &bytes)?, record)?;
        if live && !record.is_terminal() {
            records.insert(id, (revision + 1, value)).ctx(what)?;
        } else {
            if live {
                records.remove(id).ctx(what)?;
            }
            finished.insert(id, (revision + 1, value)).ctx(what)?;
            by_time.insert((record.ended_at_ms, id), ()).ctx(what)?;
        }
        revision + 1
    };
    txn.commit().ctx(what)?;
    Ok(revision)
}

fn list_table(db: &Database, table: TableDefinition<&str, (u64, &[u8])>) -> Result<Vec<Versioned<Record>>, StoreError> {
    let what = || format!("listing table {}", table.name());
    let txn = db.begin_read().ctx(what)?;
    let records = txn.open_table(table).ctx(what)?;
    let mut out = Vec::new();
    for item in records.iter().ctx(what)? {
        let (key, value) = item.ctx(what)?;
        let (revision, bytes) = value.value();
        out.push(Versioned { value: decode(key.value(), bytes)?, revision });
    }
    Ok(out)
}

fn prune_blocking(db: &Database, ended_before_ms: i64) -> Result<usize, StoreError> {
    let what = || format!("removing records that ended before {ended_before_ms}");
    let txn = db.begin_write().ctx(what)?;
    let removed = {
        let mut finished = txn.open_table(FINISHED).ctx(what)?;
        let mut by_time = txn.open_table(FINISHED_BY_TIME).ctx(what)?;
        let mut old = Vec::new();
        for item in by_time.range((i64::MIN, "")..(ended_before_ms, "")).ctx(what)? {
            let (key, _) = item.ctx(what)?;
            let (at, id) = key.value();
            old.push((at, id.to_owned()));
        }
        for (at, id) in &old {
            // A finished record's end time never changes, so its entry here is its only one.
            by_time.remove((*at, id.as_str())).ctx(what)?;
            finished.remove(id.as_str()).ctx(what)?;
        }
        old.len()
    };
    txn.commit().ctx(what)?;
    Ok(removed)
}

#[async_trait]
impl Records for Embedded {
    /// Group commit: the caller queues its record, then whoever holds the committer
    /// lock commits everything queued in one transaction. A caller returns only after
    /// the transaction holding its record committed, so durability is per call, while
    /// concurrent fetch loops share one fsync.
    async fn persist(&self, record: &Record) -> Result<bool, StoreError> {
        let value = encode(record)?;
        let (reply, outcome) = tokio::sync::oneshot::channel();
        self.shared.batch.lock().unwrap_or_else(PoisonError::into_inner).push(PendingPersist { record: record.clone(), value, reply });
        {
            let _committer = self.shared.committer.lock().await;
            let batch = std::mem::take(&mut *self.shared.batch.lock().unwrap_or_else(PoisonError::into_inner));
            if !batch.is_empty() {
                let shared = Arc::clone(&self.shared);
                blocking("persist", move || {
                    persist_batch_blocking(&shared.db, batch);
                    Ok(())
                })
                .await?;
            }
        }
        let created = outcome
            .await
            .map_err(|e| StoreError::Unavailable { context: "redb persist: the committer went away".into(), source: Box::new(e) })?
            .map_err(|message| StoreError::Unavailable { context: "redb persist".into(), source: message.into() })?;
        if created {
            self.shared.notify.notify_waiters();
        }
        Ok(created)
    }

    async fn get(&self, assignment_id: &str) -> Result<Option<Versioned<Record>>, StoreError> {
        // Inline read transaction (see the module docs).
        let what = || format!("reading {assignment_id}");
        let txn = self.shared.db.begin_read().ctx(what)?;
        for table in [RECORDS, FINISHED] {
            let records = txn.open_table(table).ctx(what)?;
            if let Some(guard) = records.get(assignment_id).ctx(what)? {
                let (revision, bytes) = guard.value();
                return Ok(Some(Versioned { value: decode(assignment_id, bytes)?, revision }));
            }
        }
        Ok(None)
    }

    async fn update(&self, record: &Record, expected: u64) -> Result<u64, StoreError> {
        let value = encode(record)?;
        let shared = Arc::clone(&self.shared);
        let record = record.clone();
        blocking("update", move || update_blocking(&shared.db, &record, &value, expected)).await
    }

    async fn list(&self) -> Result<Vec<Versioned<Record>>, StoreError> {
        let shared = Arc::clone(&self.shared);
        blocking("list", move || list_table(&shared.db, RECORDS)).await
    }

    async fn list_finished(&self) -> Result<Vec<Versioned<Record>>, StoreError> {
        let shared = Arc::clone(&self.shared);
        blocking("list", move || list_table(&shared.db, FINISHED)).await
    }

    async fn prune(&self, ended_before_ms: i64) -> Result<usize, StoreError> {
        let shared = Arc::clone(&self.shared);
        blocking("prune", move || prune_blocking(&shared.db, ended_before_ms)).await
    }
}
