//! The records: one per assignment, with its [`State`] and the transitions both backends
//! allow, the verbs that make each change of a [`Record`], and the [`Records`] trait of
//! the stores that keep them.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::{StoreError, Versioned, now_ms};
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
    /// When that environment was created (Unix ms; 0 before, or in a record written by an
    /// earlier build): where the start-up's stretches meet.
    #[serde(default)]
    pub environment_at_ms: i64,
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
            environment_at_ms: 0,
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

    /// When a supervisor claimed it (Unix ms); 0 while it is not claimed.
    pub fn claimed_at_ms(&self) -> i64 {
        match self.state {
            State::Claimed { claimed_at_ms, .. } => claimed_at_ms,
            _ => 0,
        }
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

    /// This record with the driver's name for the environment made for it at `at_ms` (the
    /// recovery metadata).
    pub fn with_environment(&self, name: &str, at_ms: i64) -> Record {
        Record { environment: Some(name.to_owned()), environment_at_ms: at_ms, ..self.clone() }
    }

    /// This record, to be placed again: the environment that ended before its claim
    /// forgotten, one attempt more.
    pub fn next_attempt(&self) -> Record {
        Record { environment: None, attempts: self.attempts + 1, ..self.clone() }
    }

    /// This record with the environment's phase `name` reported at `at_ms`: added to the
    /// timeline while it holds fewer than `max_timeline`, and `summary` (the phase with
    /// its detail) kept as the last phase — except on a terminal record, which keeps the
    /// phase it ended with.
    pub fn with_phase(&self, summary: &str, name: &str, at_ms: i64, max_timeline: usize) -> Record {
        let mut timeline = self.timeline.clone();
        if timeline.len() < max_timeline {
            timeline.push((name.to_owned(), at_ms));
        }
        let phase = if self.is_terminal() { self.phase.clone() } else { Some(summary.to_owned()) };
        Record { phase, timeline, ..self.clone() }
    }

    /// This record claimed by `holder` (a supervisor instance) at `at_ms`.
    pub fn claimed_by(&self, holder: &str, at_ms: i64) -> Record {
        Record { state: State::Claimed { holder: holder.to_owned(), claimed_at_ms: at_ms }, updated_at_ms: at_ms, ..self.clone() }
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

/// Where the records are kept.
#[async_trait]
pub trait Records: Send + Sync {
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
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Each verb changes what it names and nothing else.
    #[test]
    fn verbs() {
        let pending = Record::pending("gitea-task-1", Placement::CONTAINER_DOCKER, "runner-uuid", b"{}".to_vec(), 1_000);
        let placed = Record { environment: Some("env-a".into()), attempts: 1, ..pending.clone() };
        let started = Record { phase: Some("started".into()), timeline: vec![("claimed".into(), 2_000), ("started".into(), 2_500)], ..placed.clone() };
        let ended = Record { state: State::Terminal { result: "RESULT_FAILURE".into() }, phase: Some("failed: dockerd: gone".into()), ..started.clone() };
        let with_timeline = |record: &Record, timeline: &[(&str, i64)]| Record {
            timeline: timeline.iter().map(|(name, at)| ((*name).to_owned(), *at)).collect(),
            ..record.clone()
        };
        let cases = [
            (
                "with_environment: the name and when",
                pending.with_environment("env-a", 1_500),
                Record { environment: Some("env-a".into()), environment_at_ms: 1_500, ..pending.clone() },
            ),
            (
                "with_environment: a new name replaces the last",
                placed.with_environment("env-b", 1_800),
                Record { environment: Some("env-b".into()), environment_at_ms: 1_800, ..placed.clone() },
            ),
            ("next_attempt: no environment, one attempt more", placed.next_attempt(), Record { environment: None, attempts: 2, ..placed.clone() }),
            ("next_attempt: on a record never placed", pending.next_attempt(), Record { attempts: 1, ..pending.clone() }),
            (
                "claimed_by: the holder and the time",
                placed.claimed_by("holder-a", 2_000),
                Record { state: State::Claimed { holder: "holder-a".into(), claimed_at_ms: 2_000 }, updated_at_ms: 2_000, ..placed.clone() },
            ),
            (
                "with_phase: the first phase",
                pending.with_phase("claimed", "claimed", 2_000, 32),
                Record { phase: Some("claimed".into()), ..with_timeline(&pending, &[("claimed", 2_000)]) },
            ),
            (
                "with_phase: appended, the summary with its detail",
                started.with_phase("failed: dockerd: gone", "failed", 3_000, 32),
                Record { phase: Some("failed: dockerd: gone".into()), ..with_timeline(&started, &[("claimed", 2_000), ("started", 2_500), ("failed", 3_000)]) },
            ),
            (
                "with_phase: a full timeline keeps its entries, the phase still changes",
                started.with_phase("runner_exited (exit 1)", "runner_exited", 3_000, 2),
                Record { phase: Some("runner_exited (exit 1)".into()), ..started.clone() },
            ),
            (
                "with_phase: a terminal record keeps the phase it ended with",
                ended.with_phase("runner_exited (exit 0)", "runner_exited", 4_000, 32),
                with_timeline(&ended, &[("claimed", 2_000), ("started", 2_500), ("runner_exited", 4_000)]),
            ),
        ];
        for (name, got, expected) in cases {
            assert_eq!(got, expected, "{name}");
        }
    }
}
