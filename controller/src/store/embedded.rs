//! The embedded backend (redb); see the module docs of `store`.
//!
//! One redb file (mode 0600: records hold tasks with their secrets) holds these tables:
//!
//! - `records`: assignment id → (revision, [`Record`] as JSON) of the live assignments.
//!   The revision starts at 1 and grows by one per update; [`Store::update`] is a
//!   compare-and-set on it.
//! - `finished`: the same for terminal records, which an update moves here in the same
//!   transaction (credentials removed, see `store`), and `finished_by_time`: (ended at,
//!   id), so [`Store::prune`] reads only what it removes.
//! - `queue`: (placement, sequence) → (assignment id, deliveries so far). One table keyed
//!   by placement first, so each placement is its own FIFO range. An entry lives until it
//!   is acknowledged; there is no "delivered" flag on disk.
//! - `meta`: counters; `queue_seq` is the last sequence handed out (sequences are unique
//!   across placements, so in memory a sequence alone names a queue entry).
//!
//! Which entries are in flight (delivered, not yet acknowledged) and which were given
//! back with a delay is kept in memory only: redb allows one writer process per file, so
//! no other process can hold a delivery. After a crash or restart everything on disk is
//! deliverable again at once, which is exactly "un-acked deliveries come again". Within
//! one process a delivery that is neither acknowledged nor given back within the ack
//! wait (default 30 s, [`Embedded::with_ack_wait`]) is delivered again, like JetStream's
//! `AckWait`.
//!
//! Blocking: every write transaction runs in `spawn_blocking`, because its commit waits
//! for `fsync` and `begin_write` waits for any other writer. Read transactions (`get`,
//! `queue_depth` and the scan in `next`) run inline: they never wait for a writer (redb
//! readers see the last committed snapshot) and touch a handful of pages, so they take
//! microseconds. `list` reads every record, so it also goes to `spawn_blocking`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition, TableHandle};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{Consumer, Delivery, Record, Store, StoreError, Versioned, check_transition};
use crate::assignment::Placement;

/// assignment id → (revision, record as JSON): live records.
const RECORDS: TableDefinition<&str, (u64, &[u8])> = TableDefinition::new("records");
/// The same for finished records.
const FINISHED: TableDefinition<&str, (u64, &[u8])> = TableDefinition::new("finished");
/// (ended at, Unix ms; assignment id) of finished records.
const FINISHED_BY_TIME: TableDefinition<(i64, &str), ()> = TableDefinition::new("finished_by_time");
/// (placement, sequence) → (assignment id, deliveries so far).
const QUEUE: TableDefinition<(&str, u64), (&str, u64)> = TableDefinition::new("queue");
/// counter name → value.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const QUEUE_SEQ: &str = "queue_seq";

/// JetStream's default `AckWait`, so both backends behave alike out of the box.
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);

/// The redb store. Cheap to share behind an `Arc<dyn Store>`; consumers and deliveries
/// keep the file open until they are dropped too.
pub struct Embedded {
    shared: Arc<Shared>,
    ack_wait: Duration,
    leases: Mutex<HashMap<String, super::Lease>>,
}

impl std::fmt::Debug for Embedded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedded").field("path", &self.shared.path).field("ack_wait", &self.ack_wait).finish_non_exhaustive()
    }
}

impl Embedded {
    /// Opens (or creates) the store file and its tables. Synchronous: it is called once at
    /// start-up, before any consumer runs.
    ///
    /// # Errors
    /// `Unavailable` when the file cannot be opened (e.g. another process holds it) or
    /// the tables cannot be created.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        private_file(path).map_err(|e| StoreError::Unavailable {
            context: format!("making the redb store {} readable by its owner only (it holds tasks with their secrets)", path.display()),
            source: Box::new(e),
        })?;
        let db = Database::create(path).ctx(|| format!("opening redb store {}", path.display()))?;
        // Create the tables up front so read transactions never meet a missing table.
        let txn = db.begin_write().ctx(|| format!("initialising redb store {}", path.display()))?;
        {
            let mut records = txn.open_table(RECORDS).ctx(|| "creating table records".into())?;
            let mut finished = txn.open_table(FINISHED).ctx(|| "creating table finished".into())?;
            let mut by_time = txn.open_table(FINISHED_BY_TIME).ctx(|| "creating table finished_by_time".into())?;
            txn.open_table(QUEUE).ctx(|| "creating table queue".into())?;
            txn.open_table(META).ctx(|| "creating table meta".into())?;
            // Earlier builds kept finished records with the live ones, secrets and all.
            let mut terminal = Vec::new();
            for item in records.iter().ctx(|| "reading table records".into())? {
                let (key, value) = item.ctx(|| "reading table records".into())?;
                let (revision, bytes) = value.value();
                if let Ok(record) = decode(key.value(), bytes)
                    && record.is_terminal()
                {
                    terminal.push((revision, record));
                }
            }
            for (revision, record) in terminal {
                let id = record.assignment_id.clone();
                let ended = Record { ended_at_ms: record.ended_at_ms.max(record.updated_at_ms), ..record.ended(result_of(&record), record.reason.as_deref()) };
                records.remove(id.as_str()).ctx(|| format!("moving {id} to table finished"))?;
                finished.insert(id.as_str(), (revision, encode(&ended)?.as_slice())).ctx(|| format!("moving {id} to table finished"))?;
                by_time.insert((ended.ended_at_ms, id.as_str()), ()).ctx(|| format!("moving {id} to table finished"))?;
            }
        }
        txn.commit().ctx(|| format!("initialising redb store {}", path.display()))?;
        Ok(Self {
            shared: Arc::new(Shared {
                db,
                path: path.to_owned(),
                flights: Mutex::new(Flights::default()),
                batch: Mutex::new(Vec::new()),
                committer: tokio::sync::Mutex::new(()),
                notify: Notify::new(),
            }),
            ack_wait: DEFAULT_ACK_WAIT,
            leases: Mutex::new(HashMap::new()),
        })
    }

    /// How long a delivery may stay unacknowledged before it is delivered again.
    /// Applies to consumers created afterwards.
    #[must_use]
    pub fn with_ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }
}

/// State shared by the store, its consumers and their deliveries.
struct Shared {
    db: Database,
    path: PathBuf,
    flights: Mutex<Flights>,
    /// Persists waiting for the next commit (group commit, see [`Embedded::persist`]).
    batch: Mutex<Vec<PendingPersist>>,
    /// Held by whoever commits the batch; everybody else's entries ride along.
    committer: tokio::sync::Mutex<()>,
    /// Woken on everything that can make a delivery possible: persist, ack, nak and a
    /// change of a consumer's limit. Waiters re-check and otherwise sleep until the
    /// earliest nak delay or ack wait ends, so nothing polls.
    notify: Notify,
}

impl Shared {
    fn flights(&self) -> MutexGuard<'_, Flights> {
        // The data stays consistent even if a holder panicked: every critical section
        // is a handful of map operations.
        self.flights.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// In-memory delivery state, keyed by queue sequence.
#[derive(Default)]
struct Flights {
    in_flight: HashMap<u64, Flight>,
    /// Given back with a delay: sequence → (placement, deliverable again at).
    delayed: HashMap<u64, (String, Instant)>,
    /// Placement → max in flight, set by the latest `consumer()` for it (like updating
    /// a durable JetStream consumer's MaxAckPending).
    limits: HashMap<String, usize>,
    next_token: u64,
}

struct Flight {
    placement: String,
    /// Tells this delivery apart from a later redelivery of the same entry, so a late
    /// nak of an expired delivery cannot release the new one.
    token: u64,
    deadline: Instant,
}

impl Flights {
    fn expire(&mut self, now: Instant) {
        self.in_flight.retain(|_, flight| flight.deadline > now);
        self.delayed.retain(|_, (_, until)| *until > now);
    }

    /// The earliest moment something of `placement` may become deliverable without a
    /// notification: an ack wait or a nak delay ending.
    fn next_change(&self, placement: &str) -> Option<Instant> {
        let deadlines = self.in_flight.values().filter(|f| f.placement == placement).map(|f| f.deadline);
        let delays = self.delayed.values().filter(|(p, _)| p == placement).map(|(_, until)| *until);
        deadlines.chain(delays).min()
    }
}

/// What one attempt to take a delivery found.
enum Take {
    Got(EmbeddedDelivery),
    /// Nothing deliverable now; re-check on a notification or at this moment.
    Wait(Option<Instant>),
}

/// Runs a blocking closure on the blocking pool, mapping a panic or cancellation of it
/// to `Unavailable`.
async fn blocking<T, F>(what: &str, f: F) -> Result<T, StoreError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, StoreError> + Send + 'static,
{
    tokio::task::spawn_blocking(f).await.map_err(|e| StoreError::Unavailable { context: format!("redb {what}: blocking task failed"), source: Box::new(e) })?
}

/// Adds a context to redb errors.
trait Ctx<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T, StoreError>;
}

impl<T, E: Into<redb::Error>> Ctx<T> for Result<T, E> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T, StoreError> {
        self.map_err(|e| StoreError::Unavailable { context: context(), source: Box::new(e.into()) })
    }
}

fn decode(key: &str, bytes: &[u8]) -> Result<Record, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt { key: key.to_owned(), reason: e.to_string() })
}

fn encode(record: &Record) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(record).map_err(|e| StoreError::Corrupt { key: record.assignment_id.clone(), reason: format!("cannot encode: {e}") })
}

/// The result name of a terminal record.
fn result_of(record: &Record) -> String {
    match &record.state {
        super::State::Terminal { result } => result.clone(),
        _ => String::new(),
    }
}

/// Creates `path` readable and writable by its owner only, or makes an existing file so.
fn private_file(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o600).open(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
}

/// One persist waiting to be committed, and where its outcome goes.
struct PendingPersist {
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

fn requeue_blocking(db: &Database, record: &Record) -> Result<(), StoreError> {
    let id = record.assignment_id.as_str();
    let placement = record.placement.to_string();
    let what = || format!("queueing {id} again");
    let txn = db.begin_write().ctx(what)?;
    {
        let records = txn.open_table(RECORDS).ctx(what)?;
        let mut queue = txn.open_table(QUEUE).ctx(what)?;
        let mut meta = txn.open_table(META).ctx(what)?;
        let pending = records.get(id).ctx(what)?.map(|g| decode(id, g.value().1)).transpose()?.is_some_and(|r| r.state == super::State::Pending);
        let mut queued = false;
        for item in queue.range((placement.as_str(), 0)..=(placement.as_str(), u64::MAX)).ctx(what)? {
            let (_, value) = item.ctx(what)?;
            queued |= value.value().0 == id;
        }
        if pending && !queued {
            let seq = meta.get(QUEUE_SEQ).ctx(what)?.map_or(0, |g| g.value()) + 1;
            queue.insert((placement.as_str(), seq), (id, 0)).ctx(what)?;
            meta.insert(QUEUE_SEQ, seq).ctx(what)?;
        }
    }
    txn.commit().ctx(what)?;
    Ok(())
}

/// Counts one more delivery of a queue entry; `None` if it was acknowledged meanwhile.
/// Committed without fsync: the count is a diagnostic (the attempt number). The next
/// durable commit (any persist, update or ack) writes it, and so does redb when the
/// database is closed cleanly; a crash may lose the latest counts, never an entry.
fn count_delivery(db: &Database, placement: &str, seq: u64) -> Result<Option<u64>, StoreError> {
    let what = || format!("counting a delivery of {placement}#{seq}");
    let mut txn = db.begin_write().ctx(what)?;
    txn.set_durability(Durability::None).ctx(what)?;
    let attempt = {
        let mut queue = txn.open_table(QUEUE).ctx(what)?;
        let current = queue.get((placement, seq)).ctx(what)?.map(|g| {
            let (id, deliveries) = g.value();
            (id.to_owned(), deliveries)
        });
        match current {
            None => None,
            Some((id, deliveries)) => {
                queue.insert((placement, seq), (id.as_str(), deliveries + 1)).ctx(what)?;
                Some(deliveries + 1)
            }
        }
    };
    txn.commit().ctx(what)?;
    Ok(attempt)
}

fn ack_blocking(db: &Database, placement: &str, seq: u64) -> Result<(), StoreError> {
    let what = || format!("acknowledging {placement}#{seq}");
    let txn = db.begin_write().ctx(what)?;
    {
        let mut queue = txn.open_table(QUEUE).ctx(what)?;
        // Already gone is fine: a late ack of an expired delivery whose redelivery was
        // acknowledged first.
        queue.remove((placement, seq)).ctx(what)?;
    }
    txn.commit().ctx(what)?;
    Ok(())
}

#[async_trait]
impl Store for Embedded {
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

    async fn requeue(&self, record: &Record, _generation: u32) -> Result<(), StoreError> {
        // One process owns the file: "no queue entry for it" is known exactly, so the
        // generation is not needed to keep a second copy out.
        let (shared, record) = (Arc::clone(&self.shared), record.clone());
        blocking("requeue", move || requeue_blocking(&shared.db, &record)).await?;
        self.shared.notify.notify_waiters();
        Ok(())
    }

    /// Entries of the placement that were never delivered: the same figure as the
    /// JetStream consumer's `num_pending` (entries given back with `nak` or waiting for
    /// redelivery are not counted).
    async fn lease(&self, name: &str, holder: &str, ttl: Duration) -> Result<bool, StoreError> {
        // One process owns a redb file, so the leases live in memory.
        let mut leases = self.leases.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(next) = super::Lease::take(leases.get(name), holder, super::now_ms(), ttl) else { return Ok(false) };
        leases.insert(name.to_owned(), next);
        Ok(true)
    }

    async fn healthy(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn release_lease(&self, name: &str, holder: &str) -> Result<(), StoreError> {
        let mut leases = self.leases.lock().unwrap_or_else(PoisonError::into_inner);
        if leases.get(name).is_some_and(|l| l.holder == holder) {
            leases.remove(name);
        }
        Ok(())
    }

    async fn queue_depth(&self, placement: Placement) -> Result<u64, StoreError> {
        let placement = placement.to_string();
        let placement = placement.as_str();
        // Inline read transaction (see the module docs); a linear scan of one placement's
        // range, which holds at most the assignments waiting for that pool.
        let what = || format!("counting the queue of {placement}");
        let txn = self.shared.db.begin_read().ctx(what)?;
        let queue = txn.open_table(QUEUE).ctx(what)?;
        let mut depth = 0;
        for item in queue.range((placement, 0)..=(placement, u64::MAX)).ctx(what)? {
            let (_, value) = item.ctx(what)?;
            if value.value().1 == 0 {
                depth += 1;
            }
        }
        Ok(depth)
    }

    async fn consumer(&self, placement: Placement, max_in_flight: usize) -> Result<Box<dyn Consumer>, StoreError> {
        let placement = placement.to_string();
        let placement = placement.as_str();
        // At least one: a consumer that may hold nothing would never deliver.
        let max_in_flight = max_in_flight.max(1);
        self.shared.flights().limits.insert(placement.to_owned(), max_in_flight);
        // A raised limit may allow deliveries that waiting consumers could not take.
        self.shared.notify.notify_waiters();
        Ok(Box::new(EmbeddedConsumer { shared: Arc::clone(&self.shared), placement: placement.to_owned(), max_in_flight, ack_wait: self.ack_wait }))
    }
}

struct EmbeddedConsumer {
    shared: Arc<Shared>,
    placement: String,
    /// Fallback for the shared per-placement limit (which the latest `consumer()` sets).
    max_in_flight: usize,
    ack_wait: Duration,
}

impl EmbeddedConsumer {
    /// Marks the oldest deliverable entry of the placement as in flight, if the limit
    /// allows, then counts the delivery on disk.
    async fn take(&self) -> Result<Take, StoreError> {
        let now = Instant::now();
        let (seq, assignment_id, token) = {
            let mut flights = self.shared.flights();
            flights.expire(now);
            let wake = flights.next_change(&self.placement);
            let limit = flights.limits.get(&self.placement).copied().unwrap_or(self.max_in_flight);
            let busy = flights.in_flight.values().filter(|f| f.placement == self.placement).count();
            if busy >= limit {
                return Ok(Take::Wait(wake));
            }
            // Inline read transaction under the (std) mutex: it is short (see the module
            // docs) and holding the mutex makes "find a free entry and mark it" atomic
            // for consumers of the same placement.
            let what = || format!("reading the queue of {}", self.placement);
            let txn = self.shared.db.begin_read().ctx(what)?;
            let queue = txn.open_table(QUEUE).ctx(what)?;
            let mut found = None;
            for item in queue.range((self.placement.as_str(), 0)..=(self.placement.as_str(), u64::MAX)).ctx(what)? {
                let (key, value) = item.ctx(what)?;
                let seq = key.value().1;
                if !flights.in_flight.contains_key(&seq) && !flights.delayed.contains_key(&seq) {
                    found = Some((seq, value.value().0.to_owned()));
                    break;
                }
            }
            let Some((seq, assignment_id)) = found else {
                return Ok(Take::Wait(wake));
            };
            flights.next_token += 1;
            let token = flights.next_token;
            let flight = Flight { placement: self.placement.clone(), token, deadline: now + self.ack_wait };
            flights.in_flight.insert(seq, flight);
            (seq, assignment_id, token)
        };
        let shared = Arc::clone(&self.shared);
        let placement = self.placement.clone();
        let counted = blocking("delivery", move || count_delivery(&shared.db, &placement, seq)).await;
        match counted {
            Ok(Some(attempt)) => {
                Ok(Take::Got(EmbeddedDelivery { shared: Arc::clone(&self.shared), placement: self.placement.clone(), seq, token, assignment_id, attempt }))
            }
            other => {
                // Acknowledged meanwhile (a late ack of an earlier delivery), or the count
                // failed: release the slot so the entry is not stuck until the ack wait.
                release(&self.shared, seq, token);
                other.map(|_| Take::Wait(Some(now)))
            }
        }
    }
}

/// Frees an in-flight slot if it still belongs to the delivery holding `token`.
fn release(shared: &Shared, seq: u64, token: u64) -> bool {
    let mut flights = shared.flights();
    if flights.in_flight.get(&seq).is_some_and(|f| f.token == token) {
        flights.in_flight.remove(&seq);
        true
    } else {
        false
    }
}

#[async_trait]
impl Consumer for EmbeddedConsumer {
    /// Waits on the store's `Notify` and on the earliest timer that can change the
    /// answer; never polls. If this future is dropped after an entry was marked in
    /// flight (while its delivery is being counted), that entry comes again after the
    /// ack wait, as with JetStream.
    async fn next(&mut self, wait: Duration) -> Result<Option<Box<dyn Delivery>>, StoreError> {
        let deadline = Instant::now() + wait;
        loop {
            // Register for notifications before looking, so a persist between the look
            // and the wait is not missed.
            let notified = self.shared.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let wake = match self.take().await? {
                Take::Got(delivery) => return Ok(Some(Box::new(delivery))),
                Take::Wait(wake) => wake,
            };
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            let until = wake.map_or(deadline, |w| w.min(deadline));
            tokio::select! {
                () = &mut notified => {}
                () = tokio::time::sleep_until(until) => {}
            }
        }
    }
}

struct EmbeddedDelivery {
    shared: Arc<Shared>,
    placement: String,
    seq: u64,
    token: u64,
    assignment_id: String,
    attempt: u64,
}

#[async_trait]
impl Delivery for EmbeddedDelivery {
    fn assignment_id(&self) -> &str {
        &self.assignment_id
    }

    fn attempt(&self) -> u64 {
        self.attempt
    }

    /// In memory only, like a JetStream nak (which the server does not confirm): after a
    /// restart the entry is deliverable at once.
    async fn nak(self: Box<Self>, delay: Duration) -> Result<(), StoreError> {
        if release(&self.shared, self.seq, self.token) && !delay.is_zero() {
            let until = Instant::now() + delay;
            self.shared.flights().delayed.insert(self.seq, (self.placement.clone(), until));
        }
        self.shared.notify.notify_waiters();
        Ok(())
    }

    async fn ack(self: Box<Self>) -> Result<(), StoreError> {
        let shared = Arc::clone(&self.shared);
        let placement = self.placement.clone();
        let seq = self.seq;
        blocking("ack", move || ack_blocking(&shared.db, &placement, seq)).await?;
        {
            // The entry is gone, so whichever delivery of it holds the slot frees it.
            let mut flights = self.shared.flights();
            flights.in_flight.remove(&self.seq);
            flights.delayed.remove(&self.seq);
        }
        self.shared.notify.notify_waiters();
        Ok(())
    }
}
