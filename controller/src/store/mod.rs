//! Durable assignments: one work queue per placement plus one record per assignment,
//! behind one trait with two backends:
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

pub mod embedded;
pub mod jetstream;

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

/// Where an assignment is in its life. Transitions: Pending → Claimed → Terminal, or
/// Pending → Terminal (failed before a claim, cancelled while waiting).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum State {
    Pending,
    /// `holder` is the supervisor instance that claimed it; `claimed_at_ms` is Unix ms.
    Claimed { holder: String, claimed_at_ms: i64 },
    /// `result` is Gitea's final result name, e.g. `RESULT_SUCCESS`.
    Terminal { result: String },
}

impl State {
    pub fn can_become(&self, next: &State) -> bool {
        matches!(
            (self, next),
            (State::Pending, State::Claimed { .. } | State::Terminal { .. }) | (State::Claimed { .. }, State::Terminal { .. })
        )
    }
}

/// One assignment as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// `gitea-task-<task id>`: the dedup key everywhere.
    pub assignment_id: String,
    /// `<class>.<driver>`, e.g. `container.docker`.
    pub placement: String,
    pub state: State,
    /// The versioned assignment envelope (holds the full protobuf Task).
    pub envelope: Vec<u8>,
    /// The driver's name for the environment once it was created (recovery metadata).
    pub environment: Option<String>,
    pub updated_at_ms: i64,
    /// When the task was fetched from Gitea (Unix ms): the start of the job-startup
    /// and claim-latency measurements.
    #[serde(default)]
    pub created_at_ms: i64,
}

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
}

impl StoreError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            StoreError::Conflict { .. } => "conflict",
            StoreError::NotFound(_) => "not_found",
            StoreError::InvalidTransition { .. } => "invalid_transition",
            StoreError::Unavailable { .. } => "unavailable",
            StoreError::Corrupt { .. } => "corrupt",
        }
    }
}

#[async_trait]
pub trait Store: Send + Sync + std::fmt::Debug {
    /// Persists a new assignment: creates its record (normally Pending) if absent and
    /// enqueues its id on the placement's queue, deduplicated by assignment id.
    /// Idempotent: calling it again for the same id (e.g. after a crash between the
    /// two writes) completes what is missing and never enqueues a second live copy.
    /// Returns `true` when the record was created by this call.
    async fn persist(&self, record: &Record) -> Result<bool, StoreError>;

    async fn get(&self, assignment_id: &str) -> Result<Option<Versioned<Record>>, StoreError>;

    /// Replaces the record if it is still at `expected`; returns the new revision.
    /// Refuses state transitions that [`State::can_become`] does not allow (a record
    /// may be rewritten in the same state, e.g. to add `environment`).
    async fn update(&self, record: &Record, expected: u64) -> Result<u64, StoreError>;

    /// Every record (for keep-alive and recovery).
    async fn list(&self) -> Result<Vec<Versioned<Record>>, StoreError>;

    /// Messages waiting (not yet delivered) on a placement's queue.
    async fn queue_depth(&self, placement: &str) -> Result<u64, StoreError>;

    /// The consumer of one placement's queue, with at most `max_in_flight`
    /// unacknowledged deliveries. Durable: a restarted process gets the same consumer,
    /// and deliveries that were never acknowledged come again (after their ack wait).
    async fn consumer(&self, placement: &str, max_in_flight: usize) -> Result<Box<dyn Consumer>, StoreError>;
}

#[async_trait]
pub trait Consumer: Send {
    /// The next delivery, or `None` if nothing came within `wait`.
    async fn next(&mut self, wait: Duration) -> Result<Option<Box<dyn Delivery>>, StoreError>;
}

#[async_trait]
pub trait Delivery: Send + Sync {
    fn assignment_id(&self) -> &str;
    /// 1 on first delivery.
    fn attempt(&self) -> u64;
    /// Give it back to be delivered again not before `delay` (the pool is full).
    async fn nak(self: Box<Self>, delay: Duration) -> Result<(), StoreError>;
    /// Done for good; returns once the store has confirmed (JetStream double ack).
    async fn ack(self: Box<Self>) -> Result<(), StoreError>;
}

/// Unix milliseconds now.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
