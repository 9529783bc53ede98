//! The embedded backend (redb); see the module docs of `store`.
//!
//! One redb file (mode 0600: records hold tasks with their secrets) holds these tables:
//!
//! - `records`: assignment id → (revision, [`Record`] as JSON) of the live assignments.
//!   The revision starts at 1 and grows by one per update; [`Records::update`](super::Records::update) is a
//!   compare-and-set on it.
//! - `finished`: the same for terminal records, which an update moves here in the same
//!   transaction (credentials removed, see `store`), and `finished_by_time`: (ended at,
//!   id), so [`Records::prune`](super::Records::prune) reads only what it removes.
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
//!
//! One file per concern: this one opens the file and holds the tables and what the
//! others share (the [`Embedded`] handle, its shared state, the blocking helpers);
//! `records.rs` implements [`Records`](super::Records) on `records`, `finished` and
//! `finished_by_time` (with the group commit of persists), `queue.rs`
//! [`Queue`](super::Queue) with its consumer and delivery on `queue` and the in-memory
//! flights, and `leases.rs` [`Leases`](super::Leases), in memory.

mod leases;
mod queue;
mod records;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use redb::{Database, ReadableTable, TableDefinition};
use tokio::sync::Notify;

use self::{queue::Flights, records::PendingPersist};
use super::{Lease, Record, Store, StoreError};

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
    leases: Mutex<HashMap<String, Lease>>,
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

#[async_trait]
impl Store for Embedded {
    async fn healthy(&self) -> Result<(), StoreError> {
        Ok(())
    }
}
