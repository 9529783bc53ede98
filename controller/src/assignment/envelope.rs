//! The persisted form of an assignment: one claimed Gitea task plus what was derived
//! from it (id, placement, identity), as a versioned JSON envelope:
//!
//! ```json
//! {"version":3,"id":"gitea-task-42","placement":"container.docker",
//!  "identity":{"repository":"o/r","job":"build","spiffe_id":"spiffe://…/ci/o/r/build/42"},
//!  "task":"<base64 of the protobuf-encoded runner.v1.Task>",
//!  "task_sha256":"<hex SHA-256 of those protobuf bytes>"}
//! ```
//!
//! The task is kept as protobuf so the exact Task Gitea sent survives; its digest makes
//! any corruption of it (a flipped byte in a secret would still decode) a refusal
//! ([`EnvelopeError::DigestMismatch`]). The other fields are for operators and queries;
//! [`Assignment::decode`] derives them again from the task and refuses an envelope whose
//! fields disagree ([`EnvelopeError::Tampered`]). Together every single-byte change of an
//! envelope is refused (a test flips every bit); a consistent rewrite of every field is
//! not detected: the store itself must be trusted. Versions 1 (no digest) and 2 (an
//! identity per job key, not per task), written by earlier builds, are still read: their
//! environments hold SVIDs of that identity, so it is derived as they were.
//!
//! `Debug` of an [`Assignment`] never prints the task's secrets.

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use prost::Message as _;
use serde::Deserialize;

use proto::runner::v1::Task;

use crate::assignment::identity::{self, Identity, IdentityError};
use crate::assignment::{
    Rules,
    placement::{self, Placement, PlacementError},
};

/// The envelope version this build writes (it also reads versions 1 and 2).
pub const VERSION: u64 = 3;
/// The first version whose identity names the task.
const IDENTITY_PER_TASK: u64 = 3;
/// Prefix of every assignment id.
pub const ASSIGNMENT_PREFIX: &str = "gitea-task-";

/// `gitea-task-<task id>`: the dedup key everywhere. Gitea task ids start at 1 and are
/// never reused; [`Assignment::from_task`] refuses ids below 1.
pub fn assignment_id(task_id: i64) -> String {
    format!("{ASSIGNMENT_PREFIX}{task_id}")
}

/// The task id of an assignment id: the exact inverse of [`assignment_id`] for task
/// ids ≥ 1 (no sign, no leading zeros, no other text), `None` for anything else.
pub fn task_id_of(assignment_id: &str) -> Option<i64> {
    let digits = assignment_id.strip_prefix(ASSIGNMENT_PREFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || digits.starts_with('0') {
        return None;
    }
    digits.parse().ok()
}

/// One claimed task and what was derived from it.
#[derive(Clone, PartialEq)]
pub struct Assignment {
    /// `gitea-task-<task id>`.
    pub id: String,
    pub placement: Placement,
    pub identity: Identity,
    /// The job's runs-on labels as written (derived from the task, not stored).
    pub runs_on: Vec<String>,
    /// The task exactly as Gitea sent it (holds secrets: never log it).
    pub task: Task,
}

impl fmt::Debug for Assignment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Assignment")
            .field("id", &self.id)
            .field("placement", &self.placement)
            .field("identity", &self.identity)
            .field("task", &format_args!("Task {{ id: {}, secrets: {} redacted, .. }}", self.task.id, self.task.secrets.len()))
            .finish()
    }
}

/// Why a claimed task cannot become an assignment. Except for a bad trust domain
/// (a configuration error, which should be caught at start-up), the task must be failed
/// in Gitea with this text as its log line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssignmentError {
    #[error("task id {id} is below 1; Gitea task ids start at 1, so this task did not come from a compatible Gitea")]
    InvalidTaskId { id: i64 },

    #[error("the task carries no workflow payload; Gitea always sends one, so this task did not come from a compatible Gitea")]
    MissingWorkflow,

    #[error("the task carries no context; Gitea always sends one, so this task did not come from a compatible Gitea")]
    MissingContext,

    #[error(transparent)]
    Placement(#[from] PlacementError),

    #[error(transparent)]
    Identity(#[from] IdentityError),
}

/// Why a stored envelope cannot be read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    #[error("the stored assignment is not a JSON envelope object ({reason}); the record is corrupt: fail the assignment and delete the record")]
    NotJson { reason: String },

    #[error("the stored assignment envelope has no numeric `version`; the record is corrupt: fail the assignment and delete the record")]
    MissingVersion,

    #[error(
        "assignment envelope version {found} is not supported (this controller reads versions 1 to {VERSION}): run the controller version that wrote it, or let those assignments drain first"
    )]
    UnsupportedVersion { found: String },

    #[error("the stored envelope is malformed ({reason}); the record is corrupt: fail the assignment and delete the record")]
    Malformed { reason: String },

    #[error(
        "the envelope's task does not match its task_sha256 (stored {stored}, computed {computed}); the record is corrupt: fail the assignment and delete the record"
    )]
    DigestMismatch { stored: String, computed: String },

    #[error("the envelope's `task` is not standard base64 ({reason}); the record is corrupt")]
    TaskEncoding { reason: String },

    #[error("the envelope's `task` is not a protobuf runner.v1.Task ({reason}); the record is corrupt")]
    TaskDecoding { reason: String },

    #[error("the stored task no longer yields an assignment: {0}")]
    Underivable(AssignmentError),

    #[error(
        "the envelope's {field} is {stored:?} but its task derives {derived:?}: the record was altered (or the trust domain changed); do not run it, fail the assignment"
    )]
    Tampered { field: &'static str, stored: String, derived: String },
}

/// The envelope as stored: version 1 has no `task_sha256`, versions 2 and 3 require it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StoredEnvelope {
    #[allow(dead_code)] // Checked before this struct is read.
    version: u64,
    id: String,
    placement: String,
    identity: Identity,
    task: String,
    task_sha256: Option<String>,
}

fn sha256_hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    ring::digest::digest(&ring::digest::SHA256, bytes).as_ref().iter().fold(String::with_capacity(64), |mut hex, byte| {
        let _ = write!(hex, "{byte:02x}");
        hex
    })
}

impl Assignment {
    /// Derives an assignment from a claimed task.
    ///
    /// # Errors
    /// A task id below 1, a missing payload or context, a payload without exactly one
    /// job, runs-on that breaks the placement rules, or an underivable identity.
    pub fn from_task(task: Task, rules: &Rules) -> Result<Assignment, AssignmentError> {
        if task.id < 1 {
            return Err(AssignmentError::InvalidTaskId { id: task.id });
        }
        let payload = task.workflow_payload.as_deref().ok_or(AssignmentError::MissingWorkflow)?;
        let context = task.context.as_ref().ok_or(AssignmentError::MissingContext)?;
        let (job, labels) = placement::runs_on(payload)?;
        let placement = placement::from_labels(&labels, &rules.labels)?;
        let repository = identity::repository_of(context)?;
        let identity = identity::derive(&rules.trust_domain, &repository, &job, Some(task.id))?;
        Ok(Assignment { id: assignment_id(task.id), placement, identity, runs_on: labels, task })
    }

    /// The versioned JSON envelope (see the module documentation).
    pub fn encode(&self) -> Vec<u8> {
        let task = self.task.encode_to_vec();
        // Built as a `serde_json::Value`, whose serialisation cannot fail.
        serde_json::json!({
            "version": VERSION,
            "id": self.id,
            "placement": self.placement.to_string(),
            "identity": {
                "repository": self.identity.repository,
                "job": self.identity.job,
                "spiffe_id": self.identity.spiffe_id,
            },
            "task": STANDARD.encode(&task),
            "task_sha256": sha256_hex(&task),
        })
        .to_string()
        .into_bytes()
    }

    /// Reads an envelope back, derives id, placement and identity again from its task
    /// and refuses any disagreement.
    ///
    /// # Errors
    /// See [`EnvelopeError`]; [`EnvelopeError::Tampered`] names the first field that
    /// disagrees (`id`, `placement`, `identity.repository`, `identity.job`,
    /// `identity.spiffe_id`).
    pub fn decode(bytes: &[u8], rules: &Rules) -> Result<Assignment, EnvelopeError> {
        let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| EnvelopeError::NotJson { reason: e.to_string() })?;
        let Some(object) = value.as_object() else {
            return Err(EnvelopeError::NotJson { reason: "not an object".to_owned() });
        };
        let version = match object.get("version") {
            Some(serde_json::Value::Number(n)) if n.as_u64().is_some_and(|v| (1..=VERSION).contains(&v)) => n.as_u64(),
            Some(serde_json::Value::Number(n)) => return Err(EnvelopeError::UnsupportedVersion { found: n.to_string() }),
            _ => return Err(EnvelopeError::MissingVersion),
        };
        let envelope: StoredEnvelope = serde_json::from_value(value).map_err(|e| EnvelopeError::Malformed { reason: e.to_string() })?;
        let task_bytes = STANDARD.decode(&envelope.task).map_err(|e| EnvelopeError::TaskEncoding { reason: e.to_string() })?;
        match (version, &envelope.task_sha256) {
            (Some(1), None) => {}
            (Some(1), Some(_)) => return Err(EnvelopeError::Malformed { reason: "a version-1 envelope has no task_sha256".into() }),
            (_, None) => return Err(EnvelopeError::Malformed { reason: "missing field `task_sha256`".into() }),
            (_, Some(stored)) => {
                let computed = sha256_hex(&task_bytes);
                if *stored != computed {
                    return Err(EnvelopeError::DigestMismatch { stored: stored.clone(), computed });
                }
            }
        }
        let task = Task::decode(task_bytes.as_slice()).map_err(|e| EnvelopeError::TaskDecoding { reason: e.to_string() })?;
        let mut derived = Assignment::from_task(task, rules).map_err(EnvelopeError::Underivable)?;
        if version.is_some_and(|v| v < IDENTITY_PER_TASK) {
            let Identity { repository, job, .. } = &derived.identity;
            derived.identity =
                identity::derive(&rules.trust_domain, repository, job, None).map_err(|e| EnvelopeError::Underivable(AssignmentError::Identity(e)))?;
        }

        let checks: [(&'static str, &str, String); 5] = [
            ("id", &envelope.id, derived.id.clone()),
            ("placement", &envelope.placement, derived.placement.to_string()),
            ("identity.repository", &envelope.identity.repository, derived.identity.repository.clone()),
            ("identity.job", &envelope.identity.job, derived.identity.job.clone()),
            ("identity.spiffe_id", &envelope.identity.spiffe_id, derived.identity.spiffe_id.clone()),
        ];
        for (field, stored, derived) in checks {
            if stored != derived {
                return Err(EnvelopeError::Tampered { field, stored: stored.to_owned(), derived });
            }
        }
        Ok(derived)
    }
}

/// Context fields that carry credentials of the job (the job token and the Actions
/// runtime's), and the event payload (large, and of no use once the job ended).
const CONTEXT_DROPPED_AT_END: [&str; 3] = ["token", "gitea_runtime_token", "event"];

/// The envelope of a finished assignment: the same envelope with the task's secrets,
/// its job tokens and its event payload removed (the digest recomputed), so a record
/// kept for operators holds no credential and stays small. It still decodes: id,
/// placement and identity derive from what is left. An envelope that cannot be read is
/// returned empty (a corrupt record keeps nothing).
pub fn redacted(bytes: &[u8]) -> Vec<u8> {
    let redact = || -> Option<Vec<u8>> {
        let mut value: serde_json::Value = serde_json::from_slice(bytes).ok()?;
        let task_bytes = STANDARD.decode(value.get("task")?.as_str()?).ok()?;
        let mut task = Task::decode(task_bytes.as_slice()).ok()?;
        task.secrets.clear();
        if let Some(context) = task.context.as_mut() {
            for field in CONTEXT_DROPPED_AT_END {
                context.fields.remove(field);
            }
        }
        let task_bytes = task.encode_to_vec();
        value["task"] = serde_json::Value::String(STANDARD.encode(&task_bytes));
        if value.get("task_sha256").is_some() {
            value["task_sha256"] = serde_json::Value::String(sha256_hex(&task_bytes));
        }
        Some(value.to_string().into_bytes())
    };
    redact().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use prost_types::{Struct, Value, value::Kind};
    use serde_json::json;

    use super::*;

    fn rules(trust_domain: &str) -> Rules {
        Rules { trust_domain: trust_domain.to_owned(), labels: crate::assignment::placement::LabelPolicy::seed_compatible() }
    }

    const TD: &str = "ci.example.org";

    fn context(repository: &str) -> Struct {
        let s = |v: &str| Value { kind: Some(Kind::StringValue(v.to_owned())) };
        let owner = repository.split('/').next().unwrap_or_default();
        Struct { fields: [("repository".to_owned(), s(repository)), ("repository_owner".to_owned(), s(owner)), ("job".to_owned(), s("99"))].into() }
    }

    fn task(id: i64, runs_on: &str) -> Task {
        let payload = format!("name: ci\njobs:\n  build:\n    runs-on: {runs_on}\n    steps:\n      - run: echo hi\n");
        Task {
            id,
            workflow_payload: Some(payload.into_bytes()),
            context: Some(context("gitea/runner")),
            secrets: [("GITEA_TOKEN".to_owned(), "s3cr3t-token".to_owned())].into(),
            vars: [("V".to_owned(), "1".to_owned())].into(),
            ..Default::default()
        }
    }

    /// Replaces the task and its digest together (to reach the checks after the digest).
    fn set_task(value: &mut serde_json::Value, task_b64: &str) {
        value["task"] = json!(task_b64);
        value["task_sha256"] = json!(sha256_hex(&STANDARD.decode(task_b64).unwrap_or_default()));
    }

    fn edit(bytes: &[u8], f: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
        let mut value: serde_json::Value = serde_json::from_slice(bytes).unwrap();
        f(&mut value);
        serde_json::to_vec(&value).unwrap()
    }

    #[test]
    fn assignment_id_table() {
        let rows: Vec<(&str, Option<i64>)> = vec![
            ("gitea-task-1", Some(1)),
            ("gitea-task-42", Some(42)),
            ("gitea-task-9223372036854775807", Some(i64::MAX)),
            ("gitea-task-9223372036854775808", None),
            ("gitea-task-0", None),
            ("gitea-task-007", None),
            ("gitea-task--1", None),
            ("gitea-task-+1", None),
            ("gitea-task-", None),
            ("gitea-task-1a", None),
            ("gitea-task- 1", None),
            ("Gitea-task-1", None),
            ("task-1", None),
            ("", None),
            ("gitea-task-١", None),
        ];
        for (id, want) in rows {
            assert_eq!(task_id_of(id), want, "{id:?}");
            if let Some(n) = want {
                assert_eq!(assignment_id(n), id);
            }
        }
        for n in [1, 2, 10, 999_999, i64::MAX] {
            assert_eq!(task_id_of(&assignment_id(n)), Some(n));
        }
    }

    #[test]
    fn from_task_table() {
        let mut no_payload = task(1, "[self-hosted, container]");
        no_payload.workflow_payload = None;
        let mut no_context = task(1, "[self-hosted, container]");
        no_context.context = None;
        let mut bad_repository = task(1, "[self-hosted, container]");
        bad_repository.context = Some(context("runner"));
        type Want<'a> = Result<(&'a str, Placement, &'a str), AssignmentError>;
        let rows: Vec<(Task, &str, Want)> = vec![
            (
                task(42, "[self-hosted, container, docker]"),
                TD,
                Ok(("gitea-task-42", Placement::CONTAINER_DOCKER, "spiffe://ci.example.org/ci/gitea/runner/build/42")),
            ),
            (task(1, "[self-hosted, pod]"), TD, Ok(("gitea-task-1", Placement::CONTAINER_KUBERNETES, "spiffe://ci.example.org/ci/gitea/runner/build/1"))),
            (task(2, "{labels: [self-hosted, vm]}"), TD, Ok(("gitea-task-2", Placement::VM_OPENSANDBOX, "spiffe://ci.example.org/ci/gitea/runner/build/2"))),
            (task(0, "[self-hosted, container]"), TD, Err(AssignmentError::InvalidTaskId { id: 0 })),
            (task(-5, "[self-hosted, container]"), TD, Err(AssignmentError::InvalidTaskId { id: -5 })),
            (no_payload, TD, Err(AssignmentError::MissingWorkflow)),
            (no_context, TD, Err(AssignmentError::MissingContext)),
            (
                task(1, "[self-hosted, vm, docker]"),
                TD,
                Err(AssignmentError::Placement(PlacementError::UnsupportedCombination { class: placement::Class::Vm, driver: placement::DriverKind::Docker })),
            ),
            (
                task(1, "[container]"),
                TD,
                Err(AssignmentError::Placement(PlacementError::MissingRequired { required: "self-hosted".into(), labels: vec!["container".into()] })),
            ),
            (bad_repository, TD, Err(AssignmentError::Identity(IdentityError::InvalidRepository { repository: "runner".into() }))),
            (
                task(1, "[self-hosted, container]"),
                "Bad TD",
                Err(AssignmentError::Identity(IdentityError::InvalidTrustDomain {
                    trust_domain: "Bad TD".into(),
                    reason: "it has characters other than a-z, 0-9, `.`, `-` and `_`",
                })),
            ),
        ];
        for (i, (task, td, want)) in rows.into_iter().enumerate() {
            let got = Assignment::from_task(task, &rules(td));
            let got = got.as_ref().map(|a| (a.id.as_str(), a.placement, a.identity.spiffe_id.as_str())).map_err(Clone::clone);
            assert_eq!(got, want, "row {i}");
        }
    }

    #[test]
    fn round_trip() {
        for (id, runs_on) in [(1, "[self-hosted, container]"), (42, "[self-hosted, container, docker]"), (i64::MAX, "[self-hosted, vm-dev]")] {
            let assignment = Assignment::from_task(task(id, runs_on), &rules(TD)).unwrap();
            let bytes = assignment.encode();
            assert_eq!(Assignment::decode(&bytes, &rules(TD)).unwrap(), assignment);
        }
    }

    #[test]
    fn a_finished_assignment_keeps_no_credential_and_still_decodes() {
        let mut with_tokens = task(42, "[self-hosted, container, docker]");
        let s = |v: &str| Value { kind: Some(Kind::StringValue(v.to_owned())) };
        let context = with_tokens.context.as_mut().unwrap();
        context.fields.insert("token".into(), s("job-token-secret"));
        context.fields.insert("gitea_runtime_token".into(), s("runtime-token-secret"));
        context.fields.insert("event".into(), s(&"e".repeat(100_000)));
        let assignment = Assignment::from_task(with_tokens, &rules(TD)).unwrap();
        let full = assignment.encode();
        let redacted = redacted(&full);
        let decoded = Assignment::decode(&redacted, &rules(TD)).unwrap();
        let task_bytes = decoded.task.encode_to_vec();
        for secret in ["s3cr3t-token", "job-token-secret", "runtime-token-secret"] {
            assert!(!task_bytes.windows(secret.len()).any(|w| w == secret.as_bytes()), "{secret} kept");
        }
        assert!(decoded.task.secrets.is_empty());
        assert_eq!((decoded.id.as_str(), decoded.placement, &decoded.identity), (assignment.id.as_str(), assignment.placement, &assignment.identity));
        assert!(redacted.len() * 10 < full.len(), "the event payload stays: {} of {} bytes", redacted.len(), full.len());
        assert!(self::redacted(b"not an envelope").is_empty());
    }

    #[test]
    fn envelope_shape_keeps_the_exact_task() {
        let assignment = Assignment::from_task(task(42, "[self-hosted, container, docker]"), &rules(TD)).unwrap();
        let value: serde_json::Value = serde_json::from_slice(&assignment.encode()).unwrap();
        let task_b64 = value["task"].as_str().unwrap();
        let digest = sha256_hex(&assignment.task.encode_to_vec());
        assert_eq!(digest.len(), 64);
        assert_eq!(
            value,
            json!({
                "version": 3,
                "id": "gitea-task-42",
                "placement": "container.docker",
                "identity": {"repository": "gitea/runner", "job": "build", "spiffe_id": "spiffe://ci.example.org/ci/gitea/runner/build/42"},
                "task": task_b64,
                "task_sha256": digest,
            })
        );
        assert_eq!(STANDARD.decode(task_b64).unwrap(), assignment.task.encode_to_vec());
    }

    #[test]
    fn tampered_fields_are_detected() {
        let bytes = Assignment::from_task(task(42, "[self-hosted, container, docker]"), &rules(TD)).unwrap().encode();
        let other_task = STANDARD.encode(task(42, "[self-hosted, container]").encode_to_vec());
        let other_id = STANDARD.encode(task(43, "[self-hosted, container, docker]").encode_to_vec());
        let mut other_job = task(42, "[self-hosted, container, docker]");
        other_job.workflow_payload = Some(b"jobs:\n  deploy:\n    runs-on: [self-hosted, container, docker]\n".to_vec());
        let other_job = STANDARD.encode(other_job.encode_to_vec());
        let mut other_repo = task(42, "[self-hosted, container, docker]");
        other_repo.context = Some(context("gitea/other"));
        let other_repo = STANDARD.encode(other_repo.encode_to_vec());

        type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;
        let rows: Vec<(Edit, &str, &str, &str)> = vec![
            (Box::new(|v| v["id"] = json!("gitea-task-43")), "id", "gitea-task-43", "gitea-task-42"),
            (Box::new(|v| v["placement"] = json!("container.kubernetes")), "placement", "container.kubernetes", "container.docker"),
            (Box::new(|v| v["placement"] = json!("vm.docker")), "placement", "vm.docker", "container.docker"),
            (Box::new(|v| v["identity"]["repository"] = json!("evil/runner")), "identity.repository", "evil/runner", "gitea/runner"),
            (Box::new(|v| v["identity"]["job"] = json!("deploy")), "identity.job", "deploy", "build"),
            (
                Box::new(|v| v["identity"]["spiffe_id"] = json!("spiffe://ci.example.org/ci/gitea/runner/deploy/42")),
                "identity.spiffe_id",
                "spiffe://ci.example.org/ci/gitea/runner/deploy/42",
                "spiffe://ci.example.org/ci/gitea/runner/build/42",
            ),
            // Another task's identity, or the job-wide one of earlier versions.
            (
                Box::new(|v| v["identity"]["spiffe_id"] = json!("spiffe://ci.example.org/ci/gitea/runner/build/43")),
                "identity.spiffe_id",
                "spiffe://ci.example.org/ci/gitea/runner/build/43",
                "spiffe://ci.example.org/ci/gitea/runner/build/42",
            ),
            (
                Box::new(|v| v["identity"]["spiffe_id"] = json!("spiffe://ci.example.org/ci/gitea/runner/build")),
                "identity.spiffe_id",
                "spiffe://ci.example.org/ci/gitea/runner/build",
                "spiffe://ci.example.org/ci/gitea/runner/build/42",
            ),
            // The task payload itself was replaced: the derived values no longer match.
            (Box::new(move |v| set_task(v, &other_task)), "placement", "container.docker", "container.kubernetes"),
            (Box::new(move |v| set_task(v, &other_id)), "id", "gitea-task-42", "gitea-task-43"),
            (Box::new(move |v| set_task(v, &other_job)), "identity.job", "build", "deploy"),
            (Box::new(move |v| set_task(v, &other_repo)), "identity.repository", "gitea/runner", "gitea/other"),
        ];
        for (change, field, stored, derived) in rows {
            let tampered = edit(&bytes, change);
            let want = EnvelopeError::Tampered { field, stored: stored.to_owned(), derived: derived.to_owned() };
            assert_eq!(Assignment::decode(&tampered, &rules(TD)), Err(want), "{field}");
        }
        // Another trust domain derives another SPIFFE ID.
        assert!(matches!(Assignment::decode(&bytes, &rules("other.org")), Err(EnvelopeError::Tampered { field: "identity.spiffe_id", .. })));
        // A task that no longer derives anything.
        let invalid = STANDARD.encode(task(42, "[self-hosted, vm, docker]").encode_to_vec());
        assert!(matches!(
            Assignment::decode(&edit(&bytes, |v| set_task(v, &invalid)), &rules(TD)),
            Err(EnvelopeError::Underivable(AssignmentError::Placement(_)))
        ));
    }

    #[test]
    fn unreadable_envelopes() {
        let bytes = Assignment::from_task(task(42, "[self-hosted, container, docker]"), &rules(TD)).unwrap().encode();
        let not_json: [&[u8]; 8] = [b"", b"\xff\xfe", b"garbage", b"{", b"null", b"[]", b"1", b"\"v1\""];
        for garbage in not_json {
            assert!(matches!(Assignment::decode(garbage, &rules(TD)), Err(EnvelopeError::NotJson { .. })), "{garbage:?}");
        }
        type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;
        type Check = fn(&EnvelopeError) -> bool;
        let rows: Vec<(Edit, Check)> = vec![
            (Box::new(|v| v["version"] = json!(4)), |e| *e == EnvelopeError::UnsupportedVersion { found: "4".into() }),
            (Box::new(|v| v["version"] = json!(1)), |e| matches!(e, EnvelopeError::Malformed { .. })),
            (Box::new(|v| drop(v.as_object_mut().unwrap().remove("task_sha256"))), |e| matches!(e, EnvelopeError::Malformed { .. })),
            (Box::new(|v| v["task_sha256"] = json!("00")), |e| matches!(e, EnvelopeError::DigestMismatch { .. })),
            (Box::new(|v| v["version"] = json!(0)), |e| *e == EnvelopeError::UnsupportedVersion { found: "0".into() }),
            (Box::new(|v| v["version"] = json!(-1)), |e| *e == EnvelopeError::UnsupportedVersion { found: "-1".into() }),
            (Box::new(|v| v["version"] = json!(1.5)), |e| *e == EnvelopeError::UnsupportedVersion { found: "1.5".into() }),
            (Box::new(|v| v["version"] = json!("1")), |e| *e == EnvelopeError::MissingVersion),
            (Box::new(|v| v["version"] = json!(null)), |e| *e == EnvelopeError::MissingVersion),
            (Box::new(|v| drop(v.as_object_mut().unwrap().remove("version"))), |e| *e == EnvelopeError::MissingVersion),
            (Box::new(|v| drop(v.as_object_mut().unwrap().remove("task"))), |e| matches!(e, EnvelopeError::Malformed { .. })),
            (Box::new(|v| drop(v.as_object_mut().unwrap().remove("identity"))), |e| matches!(e, EnvelopeError::Malformed { .. })),
            (Box::new(|v| v["extra"] = json!(true)), |e| matches!(e, EnvelopeError::Malformed { .. })),
            (Box::new(|v| v["identity"]["extra"] = json!(true)), |e| matches!(e, EnvelopeError::Malformed { .. })),
            (Box::new(|v| v["id"] = json!(42)), |e| matches!(e, EnvelopeError::Malformed { .. })),
            (Box::new(|v| v["task"] = json!("not base64!")), |e| matches!(e, EnvelopeError::TaskEncoding { .. })),
            (Box::new(|v| set_task(v, &STANDARD.encode(b"\xff\xff\xff\xff"))), |e| matches!(e, EnvelopeError::TaskDecoding { .. })),
            (Box::new(|v| set_task(v, "")), |e| *e == EnvelopeError::Underivable(AssignmentError::InvalidTaskId { id: 0 })),
        ];
        for (i, (change, want)) in rows.into_iter().enumerate() {
            let got = Assignment::decode(&edit(&bytes, change), &rules(TD));
            assert!(got.as_ref().is_err_and(want), "row {i}: {got:?}");
        }
        let text = EnvelopeError::UnsupportedVersion { found: "4".into() }.to_string();
        assert!(text.contains("this controller reads versions 1 to 3"), "{text}");
    }

    /// Envelopes written by earlier builds (version 1, no digest; version 2, an identity
    /// per job key) are still read, with the identity their environments hold.
    #[test]
    fn versions_1_and_2_are_still_read_with_the_job_wide_identity() {
        let assignment = Assignment::from_task(task(42, "[self-hosted, container, docker]"), &rules(TD)).unwrap();
        let job_wide = "spiffe://ci.example.org/ci/gitea/runner/build";
        let v1 = edit(&assignment.encode(), |v| {
            v["version"] = json!(1);
            v["identity"]["spiffe_id"] = json!(job_wide);
            drop(v.as_object_mut().unwrap().remove("task_sha256"));
        });
        let v2 = edit(&assignment.encode(), |v| {
            v["version"] = json!(2);
            v["identity"]["spiffe_id"] = json!(job_wide);
        });
        for old in [v1, v2] {
            let decoded = Assignment::decode(&old, &rules(TD)).unwrap();
            assert_eq!(decoded.identity.spiffe_id, job_wide);
            assert_eq!((&decoded.id, decoded.placement, &decoded.task), (&assignment.id, assignment.placement, &assignment.task));
        }
        // A version-2 envelope that claims a task's identity was altered.
        let v2_per_task = edit(&assignment.encode(), |v| v["version"] = json!(2));
        assert!(matches!(Assignment::decode(&v2_per_task, &rules(TD)), Err(EnvelopeError::Tampered { field: "identity.spiffe_id", .. })));
    }

    /// Every single-bit flip of an envelope, at every byte, is refused (exhaustive);
    /// `GDR_FUZZ_LONG=1` replaces every byte by every other value.
    #[test]
    fn every_changed_byte_is_refused() {
        let assignment = Assignment::from_task(task(42, "[self-hosted, container, docker]"), &rules(TD)).unwrap();
        let bytes = assignment.encode();
        let long = std::env::var_os("GDR_FUZZ_LONG").is_some();
        let mut tried = 0usize;
        let mut by_error: std::collections::BTreeMap<&'static str, usize> = std::collections::BTreeMap::new();
        for position in 0..bytes.len() {
            let replacements: Vec<u8> =
                if long { (0..=255u8).filter(|b| *b != bytes[position]).collect() } else { (0..8).map(|bit| bytes[position] ^ (1 << bit)).collect() };
            for replacement in replacements {
                let mut changed = bytes.clone();
                changed[position] = replacement;
                tried += 1;
                match Assignment::decode(&changed, &rules(TD)) {
                    Ok(_) => panic!("byte {position} set to {replacement:#04x} was accepted"),
                    Err(error) => {
                        let class = match error {
                            EnvelopeError::NotJson { .. } => "not JSON",
                            EnvelopeError::MissingVersion => "no version",
                            EnvelopeError::UnsupportedVersion { .. } => "unsupported version",
                            EnvelopeError::Malformed { .. } => "malformed",
                            EnvelopeError::DigestMismatch { .. } => "digest mismatch",
                            EnvelopeError::TaskEncoding { .. } => "task not base64",
                            EnvelopeError::TaskDecoding { .. } => "task not protobuf",
                            EnvelopeError::Underivable(_) => "underivable",
                            EnvelopeError::Tampered { .. } => "tampered",
                        };
                        *by_error.entry(class).or_default() += 1;
                    }
                }
            }
        }
        let refused: usize = by_error.values().sum();
        println!("envelope of {} bytes: {tried} changed envelopes, {refused} refused: {by_error:?}", bytes.len());
        assert_eq!(refused, tried, "every change is refused");
    }

    #[test]
    fn debug_redacts_secrets() {
        let assignment = Assignment::from_task(task(42, "[self-hosted, container]"), &rules(TD)).unwrap();
        let debug = format!("{assignment:?}");
        assert!(!debug.contains("s3cr3t-token"), "{debug}");
        assert!(debug.contains("gitea-task-42") && debug.contains("1 redacted"), "{debug}");
    }
}
