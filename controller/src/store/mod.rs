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
//!
//! Live and finished records are kept apart: [`Store::list`] reads only the live ones
//! (what the reconciler, keep-alive and recovery scan every few seconds), so its cost
//! follows the work in flight, not the history. A record that becomes terminal moves to
//! the finished records with its task's credentials removed
//! (`envelope::redacted`), and goes for good after the retention ([`Store::prune`], or
//! the finished bucket's age limit on JetStream).

pub mod embedded;
pub mod jetstream;

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::assignment::Placement;

/// Where an assignment is in its life. Transitions: Pending → Claimed → Terminal, or
/// Pending → Terminal (failed before a claim, cancelled while waiting).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum State {
    Pending,
    /// `holder` is the supervisor instance that claimed it; `claimed_at_ms` is Unix ms.
    Claimed {
        holder: String,
        claimed_at_ms: i64,
    },
    /// `result` is Gitea's final result name, e.g. `RESULT_SUCCESS`.
    Terminal {
        result: String,
    },
}

impl State {
    pub fn can_become(&self, next: &State) -> bool {
        matches!((self, next), (State::Pending, State::Claimed { .. } | State::Terminal { .. }) | (State::Claimed { .. }, State::Terminal { .. }))
    }
}

/// One assignment as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// `gitea-task-<task id>`: the dedup key everywhere.
    pub assignment_id: String,
    /// Where it runs; stored as its name, e.g. `"container.docker"`.
    pub placement: Placement,
    /// The uuid of the Gitea runner registration that fetched the task: Gitea accepts
    /// reports on it from that runner only. Empty for tasks that are not Gitea's.
    #[serde(default)]
    pub runner: String,
    pub state: State,
    /// The versioned assignment envelope (holds the full protobuf Task; its secrets are
    /// removed once the assignment is terminal). Stored as its JSON text.
    #[serde(with = "envelope_text")]
    pub envelope: Vec<u8>,
    /// The driver's name for the environment once it was created (recovery metadata).
    pub environment: Option<String>,
    pub updated_at_ms: i64,
    /// When the task was fetched from Gitea (Unix ms): the start of the job-startup
    /// and claim-latency measurements.
    #[serde(default)]
    pub created_at_ms: i64,
    /// The environment's last reported phase, with its detail (e.g. `failed: dockerd:
    /// …`): part of the reason when the environment ends before its job.
    #[serde(default)]
    pub phase: Option<String>,
    /// When the environment reached each phase (`claimed`, `docker_ready`, …; Unix ms),
    /// in the order reported: where a job's start-up time went.
    #[serde(default)]
    pub timeline: Vec<(String, i64)>,
    /// Why the controller ended it (the line it wrote into the job's log), for operators.
    #[serde(default)]
    pub reason: Option<String>,
    /// When it became terminal (Unix ms); 0 while it is live.
    #[serde(default)]
    pub ended_at_ms: i64,
    /// Environments made for it that ended before their claim (each retried).
    #[serde(default)]
    pub attempts: u32,
}

impl Record {
    /// A new pending record for a fetched task.
    pub fn pending(assignment_id: &str, placement: Placement, runner: &str, envelope: Vec<u8>, fetched_at_ms: i64) -> Record {
        Record {
            assignment_id: assignment_id.to_owned(),
            placement,
            runner: runner.to_owned(),
            state: State::Pending,
            envelope,
            environment: None,
            updated_at_ms: now_ms(),
            created_at_ms: fetched_at_ms,
            phase: None,
            timeline: Vec::new(),
            reason: None,
            ended_at_ms: 0,
            attempts: 0,
        }
    }

    pub fn is_terminal(&self) -> bool {
        matches!(self.state, State::Terminal { .. })
    }

    /// The result a terminal record ended with, as the runner protocol's code.
    pub fn result_code(&self) -> Option<i32> {
        match &self.state {
            State::Terminal { result } => proto::runner::v1::Result::from_str_name(result).map(|r| r as i32),
            _ => None,
        }
    }

    /// This record ended with `result`: terminal, the reason kept, the task's credentials
    /// removed.
    pub fn ended(&self, result: String, reason: Option<&str>) -> Record {
        Record {
            state: State::Terminal { result },
            reason: reason.map(str::to_owned),
            ended_at_ms: now_ms(),
            envelope: crate::assignment::envelope::redacted(&self.envelope),
            ..self.clone()
        }
    }
}

/// The envelope is JSON text: stored as a JSON string (earlier builds wrote an array of
/// byte values, five times the size; both are read).
mod envelope_text {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        match std::str::from_utf8(bytes) {
            Ok(text) => serializer.serialize_str(text),
            Err(_) => serializer.collect_seq(bytes),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Stored {
            Text(String),
            Bytes(Vec<u8>),
        }
        Ok(match Stored::deserialize(deserializer)? {
            Stored::Text(text) => text.into_bytes(),
            Stored::Bytes(bytes) => bytes,
        })
    }
}

/// The transition rule of both backends: a record may move along [`State::can_become`],
/// or be rewritten in the same state (same variant: adding `environment`, or a
/// recovering controller re-claiming with another holder).
///
/// # Errors
/// [`StoreError::InvalidTransition`].
pub fn check_transition(current: &Record, next: &Record) -> Result<(), StoreError> {
    let same_state = std::mem::discriminant(&current.state) == std::mem::discriminant(&next.state);
    if same_state || current.state.can_become(&next.state) {
        Ok(())
    } else {
        Err(StoreError::InvalidTransition { assignment_id: next.assignment_id.clone(), from: current.state.clone(), to: next.state.clone() })
    }
}

/// How long finished records are kept by default (`store.retention`).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(3 * 24 * 3600);

/// A lease as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub holder: String,
    pub expires_at_ms: i64,
}

impl Lease {
    /// The rule of both stores' leases: `holder` asking for `current` at `now_ms` gets a
    /// lease until `ttl` from now — new, renewed, or taken over once the other holder's
    /// has expired — or nothing while another holder's has not. Wall-clock time, because
    /// replicas on different machines compare it.
    pub fn take(current: Option<&Lease>, holder: &str, now_ms: i64, ttl: Duration) -> Option<Lease> {
        if current.is_some_and(|lease| lease.holder != holder && lease.expires_at_ms > now_ms) {
            return None;
        }
        Some(Lease { holder: holder.to_owned(), expires_at_ms: now_ms.saturating_add(i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX)) })
    }
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

    /// Every live record (not terminal): what keep-alive, recovery and the reconciler
    /// scan. Its cost follows the work in flight, not the history.
    async fn list(&self) -> Result<Vec<Versioned<Record>>, StoreError>;

    /// Every finished record still kept (operators, tests).
    async fn list_finished(&self) -> Result<Vec<Versioned<Record>>, StoreError>;

    /// Removes finished records that ended before `ended_before_ms`; returns how many.
    /// (JetStream also ages them out by itself.)
    async fn prune(&self, ended_before_ms: i64) -> Result<usize, StoreError>;

    /// Queues a pending assignment again under a new delivery (its environment ended
    /// before the claim and is to be made again). `generation` tells the deliveries of
    /// one assignment apart; a repeated call with the same one adds nothing.
    async fn requeue(&self, record: &Record, generation: u32) -> Result<(), StoreError>;

    /// Takes or renews the lease `name` for `holder` until `ttl` from now; false while
    /// another holder's lease has not expired. (One scheduler per registration fetches at
    /// a time: a second one waits and takes over when the first stops renewing.)
    async fn lease(&self, name: &str, holder: &str, ttl: Duration) -> Result<bool, StoreError>;

    /// Gives the lease up at once if `holder` holds it (a clean stop hands over sooner).
    async fn release_lease(&self, name: &str, holder: &str) -> Result<(), StoreError>;

    /// Whether the backend answers now (for `/readyz`).
    async fn healthy(&self) -> Result<(), StoreError>;

    /// Messages waiting (not yet delivered) on a placement's queue.
    async fn queue_depth(&self, placement: Placement) -> Result<u64, StoreError>;

    /// The consumer of one placement's queue, with at most `max_in_flight`
    /// unacknowledged deliveries. Durable: a restarted process gets the same consumer,
    /// and deliveries that were never acknowledged come again (after their ack wait).
    async fn consumer(&self, placement: Placement, max_in_flight: usize) -> Result<Box<dyn Consumer>, StoreError>;
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
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lease rule on a made-up clock (the stores' tests check that each applies it).
    #[test]
    fn a_lease_has_one_holder_until_it_expires() {
        let ttl = Duration::from_secs(2);
        let held = |holder: &str, until: i64| Some(Lease { holder: holder.into(), expires_at_ms: until });
        let cases = [
            ("free: taken", None, "a", 1_000, held("a", 3_000)),
            ("held by another: refused", held("a", 3_000), "b", 1_000, None),
            ("renewed by its holder before expiry", held("a", 3_000), "a", 2_200, held("a", 4_200)),
            ("the renewal holds others off", held("a", 4_200), "b", 3_400, None),
            ("another's, a millisecond before it expires", held("a", 4_200), "b", 4_199, None),
            ("expired at its instant: taken over", held("a", 4_200), "b", 4_200, held("b", 6_200)),
            ("its holder renews after expiry too", held("a", 4_200), "a", 9_000, held("a", 11_000)),
        ];
        for (name, current, holder, now, expected) in cases {
            assert_eq!(Lease::take(current.as_ref(), holder, now, ttl), expected, "{name}");
        }
    }

    fn record(state: State) -> Record {
        Record { state, ..Record::pending("gitea-task-1", Placement::CONTAINER_DOCKER, "", Vec::new(), 0) }
    }

    #[test]
    fn transitions_only_go_forward() {
        let pending = record(State::Pending);
        let claimed = record(State::Claimed { holder: "a".into(), claimed_at_ms: 1 });
        let reclaimed = record(State::Claimed { holder: "b".into(), claimed_at_ms: 2 });
        let terminal = record(State::Terminal { result: "RESULT_SUCCESS".into() });
        assert!(check_transition(&pending, &claimed).is_ok());
        assert!(check_transition(&claimed, &reclaimed).is_ok());
        assert!(check_transition(&claimed, &terminal).is_ok());
        assert!(check_transition(&pending, &pending).is_ok());
        assert!(matches!(check_transition(&terminal, &pending), Err(StoreError::InvalidTransition { .. })));
        assert!(matches!(check_transition(&claimed, &pending), Err(StoreError::InvalidTransition { .. })));
    }
}
