//! Durable assignments: one record per assignment, one work queue per placement, and
//! leases (one scheduler per registration fetches at a time). A trait per concern, each
//! in its own file with its types:
//!
//! - [`Records`] (`record.rs`): [`Record`], its [`State`] and the verbs that change it
//!   ([`Record::pending`], [`Record::with_environment`], [`Record::claimed_by`],
//!   [`Record::with_phase`], [`Record::next_attempt`], [`Record::ended`]), and the
//!   transition rule both backends apply ([`check_transition`]).
//! - [`Queue`] (`queue.rs`): the placements' queues, their [`Consumer`]s and
//!   [`Delivery`]s.
//! - [`Leases`] (`lease.rs`): [`Lease`] and its rule, [`Lease::take`].
//!
//! [`Store`] is the three together, plus `healthy`: what the rest of the controller holds
//! (`Arc<dyn Store>`). Two backends implement it, each a folder with one file per trait:
//!
//! - [`jetstream`]: NATS JetStream — a WorkQueue stream with subjects
//!   `<base>.<class>.<driver>` (`Nats-Msg-Id` = assignment id, so a re-publish after a
//!   crash is deduplicated), one durable pull consumer per placement whose
//!   MaxAckPending equals the pool capacity, and a KV bucket of records with
//!   compare-and-set on the revision. For several controllers on several machines.
//! - [`embedded`]: a redb file with the same semantics, for one host without NATS
//!   (the default).
//!
//! Records, not process memory, hold what must survive a restart: a restarted or a
//! second controller continues where the first stopped.
//!
//! Live and finished records are kept apart: [`Records::list`] reads only the live ones
//! (what the reconciler, keep-alive and recovery scan every few seconds), so its cost
//! follows the work in flight, not the history. A record that becomes terminal moves to
//! the finished records with its task's credentials removed
//! (`envelope::redacted`), and goes for good after the retention ([`Records::prune`], or
//! the finished bucket's age limit on JetStream).

pub mod embedded;
pub mod jetstream;
mod lease;
mod queue;
mod record;

use std::time::Duration;

use async_trait::async_trait;

pub use lease::{Lease, Leases};
pub use queue::{Consumer, Delivery, Queue};
pub use record::{Record, Records, State, check_transition};

/// How long finished records are kept by default (`store.retention`).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(3 * 24 * 3600);

/// A record with the revision it was read at, for compare-and-set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned<T> {
    pub value: T,
    pub revision: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The record changed since it was read (compare-and-set lost).
    #[error("assignment {assignment_id} changed since revision {expected}")]
    Conflict { assignment_id: String, expected: u64 },
    #[error("assignment {0} does not exist")]
    NotFound(String),
    #[error("invalid transition of {assignment_id}: {from:?} → {to:?}")]
    InvalidTransition { assignment_id: String, from: State, to: State },
    /// The backend is unreachable or failed; retrying may help.
    #[error("store unavailable: {context}")]
    Unavailable {
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("corrupt record {key}: {reason}")]
    Corrupt { key: String, reason: String },
    /// The record cannot be stored at all: retrying cannot help.
    #[error("record {assignment_id} is {size} bytes, more than the store takes ({limit} bytes){hint}")]
    TooLarge { assignment_id: String, size: usize, limit: usize, hint: &'static str },
}

impl StoreError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            StoreError::Conflict { .. } => "conflict",
            StoreError::NotFound(_) => "not_found",
            StoreError::InvalidTransition { .. } => "invalid_transition",
            StoreError::Unavailable { .. } => "unavailable",
            StoreError::Corrupt { .. } => "corrupt",
            StoreError::TooLarge { .. } => "too_large",
        }
    }
}

/// Re-reads and rewrites a record until the compare-and-set wins: `change` gets the
/// current record and returns the next one, or `None` to leave it as it is. Returns
/// the record as stored afterwards (`None` if there is no such record).
///
/// # Errors
/// A store failure other than a lost compare-and-set, or a refused transition.
pub async fn modify(
    store: &dyn Store,
    assignment_id: &str,
    mut change: impl FnMut(&Record) -> Option<Record> + Send,
) -> Result<Option<Versioned<Record>>, StoreError> {
    loop {
        let Some(current) = store.get(assignment_id).await? else { return Ok(None) };
        let Some(mut next) = change(&current.value) else { return Ok(Some(current)) };
        next.updated_at_ms = now_ms();
        match store.update(&next, current.revision).await {
            Ok(revision) => return Ok(Some(Versioned { value: next, revision })),
            Err(StoreError::Conflict { .. }) => {}
            Err(error) => return Err(error),
        }
    }
}

/// A whole store: its records, its queues and its leases, and whether it answers.
#[async_trait]
pub trait Store: Records + Queue + Leases + std::fmt::Debug {
    /// Whether the backend answers now (for `/readyz`).
    async fn healthy(&self) -> Result<(), StoreError>;
}

/// Unix milliseconds now, from the controller's one clock.
pub use crate::clock::now_ms;
