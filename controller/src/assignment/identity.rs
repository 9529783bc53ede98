//! Who a task is: `spiffe://<trust domain>/ci/<owner>/<repo>/<job>/<task id>`, derived
//! from the claimed task's repository, job key (the key under `jobs:`, never the numeric
//! job id) and Gitea task id; docs/security.md says what the identity lets a job reach.
//!
//! The task id is there so that the facade's peer check separates tasks: a pull request
//! from a fork chooses its job keys, and with `<job>` alone its SVID would pass for every
//! concurrent task of the base repository's job of that key. Assignments stored before
//! (envelope versions 1 and 2) keep the job-wide `…/<job>` their environments hold.
//! The identity names a task of a job key of a repository: no ref, event or trust level.
//!
//! The task id is its decimal digits (always the fourth segment, so it needs no
//! encoding). Each of owner, repo and job becomes one path segment:
//! - **Verbatim** iff it matches `[A-Za-z0-9._-]+`, is not `.` or `..`, is at most 64
//!   bytes, and does not itself look like a hashed segment (end in 12 lowercase hex
//!   digits that are the whole segment or follow a `-`).
//! - **Otherwise hashed**: `<slug>-<h>`, or just `<h>` when the slug is empty, where `h`
//!   is the first 12 hex digits of SHA-256 over the original segment's bytes and `slug`
//!   is the segment with every run of other characters replaced by one `-`, trimmed of
//!   leading and trailing `-` and `.`, cut to 48 bytes (all slug characters are ASCII),
//!   and trimmed of a trailing `-` or `.` again.
//!
//! Decisions:
//! - The slug keeps its case (`My Job` → `My-Job-<h>`): verbatim segments keep theirs,
//!   SPIFFE paths are case-sensitive, and the hash already separates names that differ
//!   only in case, so lowercasing would only lose readability.
//! - A verbatim-looking name that is exactly 12 lowercase hex digits is hashed too (the
//!   brief's rule named only `-<12 hex>` suffixes): a name whose slug is empty (`日本`)
//!   becomes just `<h>`, which a verbatim `0123456789ab` could otherwise equal.
//!
//! Why this is injective: every hashed segment ends in `(^|-)[0-9a-f]{12}` and no
//! verbatim one does, so the two kinds never meet; verbatim segments are the names
//! themselves; two hashed segments are equal only if their 48-bit SHA-256 prefixes
//! collide. Owner and repo stay separate segments (a repository needs exactly one `/`),
//! and a `/` inside a job key is slugged, so no name can move a path boundary.

use serde::{Deserialize, Serialize};

use proto::runner::v1::Task;

use crate::assignment::placement::{self, PlacementError};

/// Longest segment kept verbatim.
const MAX_VERBATIM: usize = 64;
/// Longest slug in a hashed segment (plus `-` and 12 hex = 61 bytes at most).
const MAX_SLUG: usize = 48;
/// Hex digits of the SHA-256 suffix.
const HASH_HEX: usize = 12;
/// SPIFFE's limit on a trust domain name.
const MAX_TRUST_DOMAIN: usize = 255;
/// SPIFFE IDs should not be longer (ours are at most 9 + 255 + 4 + 3×64 + 3 + 19 = 482).
pub const MAX_SPIFFE_ID: usize = 2048;

/// A task's workload identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    /// `owner/repo` exactly as Gitea named it.
    pub repository: String,
    /// The job key under `jobs:` exactly as written.
    pub job: String,
    /// `spiffe://<trust domain>/ci/<owner>/<repo>/<job>/<task id>` with encoded segments
    /// (without `/<task id>` for assignments stored by envelope versions 1 and 2).
    pub spiffe_id: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error("trust domain {trust_domain:?} is invalid ({reason}): configure a lowercase name of letters, digits, `.`, `-` and `_`, e.g. `ci.example.org`")]
    InvalidTrustDomain { trust_domain: String, reason: &'static str },

    #[error(
        "repository {repository:?} is not `owner/name` with both parts non-empty; the task context's `repository` must name exactly one owner and one repository"
    )]
    InvalidRepository { repository: String },

    #[error("the job key is empty; a job needs a non-empty key under `jobs:`")]
    EmptyJob,

    #[error("the task carries no context; Gitea always sends one, so this task did not come from a compatible Gitea")]
    MissingContext,

    #[error("the task carries no workflow payload; Gitea always sends one, so this task did not come from a compatible Gitea")]
    MissingWorkflow,

    #[error("the task context has no `repository` string; it is needed to derive the task's identity")]
    MissingRepository,

    #[error("the task context is inconsistent: `repository` is {repository:?} but `repository_owner` is {owner:?}; refusing to guess the identity")]
    OwnerMismatch { repository: String, owner: String },

    #[error(transparent)]
    Workflow(#[from] PlacementError),

    #[error("derived SPIFFE ID {spiffe_id:?} is not valid ({reason}); this is a bug in the identity derivation, please report it")]
    Invalid { spiffe_id: String, reason: String },
}

/// Derives the identity of task `task_id` of job `job` of `repository` (`owner/repo`);
/// `None` derives the job-wide identity of envelopes before version 3. Task ids below 1
/// are the caller's to refuse.
///
/// # Errors
/// An invalid trust domain, a repository without exactly one `/` or with an empty
/// part, or an empty job key.
pub fn derive(trust_domain: &str, repository: &str, job: &str, task_id: Option<i64>) -> Result<Identity, IdentityError> {
    validate_trust_domain(trust_domain)?;
    let (owner, repo) = match repository.split_once('/') {
        Some((owner, repo)) if !owner.is_empty() && !repo.is_empty() && !repo.contains('/') => (owner, repo),
        _ => return Err(IdentityError::InvalidRepository { repository: repository.to_owned() }),
    };
    if job.is_empty() {
        return Err(IdentityError::EmptyJob);
    }
    let mut spiffe_id = format!("spiffe://{trust_domain}/ci/{}/{}/{}", segment(owner), segment(repo), segment(job));
    if let Some(task_id) = task_id {
        spiffe_id = format!("{spiffe_id}/{task_id}");
    }
    let invalid = |reason: String| IdentityError::Invalid { spiffe_id: spiffe_id.clone(), reason };
    if spiffe_id.len() > MAX_SPIFFE_ID {
        return Err(invalid(format!("longer than {MAX_SPIFFE_ID} bytes")));
    }
    spiffe::SpiffeId::new(&spiffe_id).map_err(|e| invalid(e.to_string()))?;
    Ok(Identity { repository: repository.to_owned(), job: job.to_owned(), spiffe_id })
}

/// Derives the identity of a claimed task: the repository from its context, the job
/// key from its workflow payload, and its id.
///
/// # Errors
/// A missing payload or context, a payload without exactly one job and runs-on
/// ([`placement::runs_on`]), a context without a consistent repository, or anything
/// [`derive`] refuses.
pub fn for_task(trust_domain: &str, task: &Task) -> Result<Identity, IdentityError> {
    let payload = task.workflow_payload.as_deref().ok_or(IdentityError::MissingWorkflow)?;
    let context = task.context.as_ref().ok_or(IdentityError::MissingContext)?;
    let repository = repository_of(context)?;
    let (job, _labels) = placement::runs_on(payload)?;
    derive(trust_domain, &repository, &job, Some(task.id))
}

/// The `owner/repo` of a task context: its `repository` string. When the context also
/// carries `repository_owner` (Gitea sends both), it must equal the owner part; a
/// disagreement is refused rather than guessed.
///
/// # Errors
/// [`IdentityError::MissingRepository`], [`IdentityError::InvalidRepository`] or
/// [`IdentityError::OwnerMismatch`].
pub fn repository_of(context: &prost_types::Struct) -> Result<String, IdentityError> {
    let string = |key: &str| super::context::string(context, key);
    let repository = string("repository").ok_or(IdentityError::MissingRepository)?;
    let Some((owner, _)) = repository.split_once('/') else {
        return Err(IdentityError::InvalidRepository { repository: repository.to_owned() });
    };
    match string("repository_owner") {
        Some(stated) if !stated.is_empty() && stated != owner => {
            Err(IdentityError::OwnerMismatch { repository: repository.to_owned(), owner: stated.to_owned() })
        }
        _ => Ok(repository.to_owned()),
    }
}

/// Checks a configured trust domain (lowercase `[a-z0-9._-]`, 1..=255 bytes). Call it at
/// start-up so a bad configuration is not mistaken for a bad task.
///
/// # Errors
/// [`IdentityError::InvalidTrustDomain`] saying what is wrong.
pub fn validate_trust_domain(trust_domain: &str) -> Result<(), IdentityError> {
    let reason = if trust_domain.is_empty() {
        Some("it is empty")
    } else if trust_domain.len() > MAX_TRUST_DOMAIN {
        Some("it is longer than 255 bytes")
    } else if !trust_domain.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_')) {
        Some("it has characters other than a-z, 0-9, `.`, `-` and `_`")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(IdentityError::InvalidTrustDomain { trust_domain: trust_domain.to_owned(), reason }),
        None => Ok(()),
    }
}

fn allowed(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')
}

/// Ends in 12 lowercase hex digits that are the whole name or follow a `-`: the shape
/// of every hashed segment.
fn looks_hashed(name: &str) -> bool {
    let bytes = name.as_bytes();
    let Some(split) = bytes.len().checked_sub(HASH_HEX) else {
        return false;
    };
    let (head, tail) = bytes.split_at(split);
    tail.iter().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b)) && (head.is_empty() || head.ends_with(b"-"))
}

/// One path segment for a non-empty name.
fn segment(name: &str) -> String {
    let verbatim = name.len() <= MAX_VERBATIM && name != "." && name != ".." && name.bytes().all(allowed) && !looks_hashed(name);
    if verbatim {
        return name.to_owned();
    }
    let mut slug = String::with_capacity(name.len());
    for c in name.chars() {
        if c.is_ascii() && allowed(c as u8) {
            slug.push(c);
        } else if !slug.ends_with('-') {
            slug.push('-');
        }
    }
    let trim = |s: &str| s.trim_matches(|c| c == '-' || c == '.').to_owned();
    let mut slug = trim(&slug);
    // Every slug character is ASCII, so any byte index is a char boundary.
    slug.truncate(MAX_SLUG);
    let slug = trim(&slug);
    let digest = ring::digest::digest(&ring::digest::SHA256, name.as_bytes());
    let hash: String = digest.as_ref().iter().take(HASH_HEX / 2).map(|b| format!("{b:02x}")).collect();
    if slug.is_empty() { hash } else { format!("{slug}-{hash}") }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashSet};

    use prost_types::{Struct, Value, value::Kind};

    use super::*;

    const TD: &str = "ci.example.org";

    fn id(repository: &str, job: &str) -> String {
        derive(TD, repository, job, None).unwrap().spiffe_id
    }

    fn assert_valid(spiffe_id: &str) {
        assert!(spiffe_id.len() <= MAX_SPIFFE_ID, "{spiffe_id}");
        assert!(spiffe::SpiffeId::new(spiffe_id).is_ok(), "{spiffe_id}");
    }

    #[test]
    fn segment_table() {
        let x300 = "x".repeat(300);
        let x64 = "x".repeat(64);
        let x65 = "x".repeat(65);
        let x48 = "x".repeat(48);
        let rows: Vec<(&str, String)> = vec![
            // Verbatim.
            ("build", "build".into()),
            ("Build.Test_1-x", "Build.Test_1-x".into()),
            ("-lead", "-lead".into()),
            ("--x--", "--x--".into()),
            (".github", ".github".into()),
            ("...", "...".into()),
            ("v1.2.3", "v1.2.3".into()),
            (&x64, x64.clone()),
            ("deploy-0123456789a", "deploy-0123456789a".into()),
            ("deploy-0123456789AB", "deploy-0123456789AB".into()),
            ("deploy_0123456789ab", "deploy_0123456789ab".into()),
            ("x0123456789ab", "x0123456789ab".into()),
            // Hashed.
            ("café", "caf-850f7dc43910".into()),
            ("日本", "cf2abf0c5be3".into()),
            ("build and test", "build-and-test-bf591e8954bf".into()),
            ("a b", "a-b-c8687a08aa5d".into()),
            ("a/b", "a-b-c14cddc033f6".into()),
            ("a  b", "a-b-6e12db73209a".into()),
            ("a\tb", "a-b-894891f8b78a".into()),
            ("a/b/c", "a-b-c-d76a7b72669c".into()),
            (" spaces ", "spaces-4b504061eca0".into()),
            ("a\u{0}b", "a-b-59b271ae1bbc".into()),
            ("Test Job", "Test-Job-8e9f764de448".into()),
            (".", "cdb4ee2aea69".into()),
            ("..", "5ec1f7e700f3".into()),
            (&x300, format!("{x48}-0d4e2ca9e9cb")),
            (&x65, format!("{x48}-9537c5fdf120")),
            // Verbatim names shaped like hashed ones are hashed.
            ("deploy-0123456789ab", "deploy-0123456789ab-7cbfe463dfcf".into()),
            ("0123456789ab", "0123456789ab-d407ad901895".into()),
        ];
        for (name, want) in rows {
            assert_eq!(segment(name), want, "{name:?}");
            assert!(segment(name).len() <= MAX_VERBATIM);
        }
    }

    #[test]
    fn derive_table() {
        let rows: Vec<(&str, &str, Result<&str, IdentityError>)> = vec![
            ("gitea/runner", "build", Ok("spiffe://ci.example.org/ci/gitea/runner/build")),
            ("My Org/r/e", "j", Err(IdentityError::InvalidRepository { repository: "My Org/r/e".into() })),
            ("My Org/repo", "Test Job", Ok("spiffe://ci.example.org/ci/My-Org-f8c9c9e474d3/repo/Test-Job-8e9f764de448")),
            ("o/r", "a/b", Ok("spiffe://ci.example.org/ci/o/r/a-b-c14cddc033f6")),
            ("o/r", "..", Ok("spiffe://ci.example.org/ci/o/r/5ec1f7e700f3")),
            ("./..", ".", Ok("spiffe://ci.example.org/ci/cdb4ee2aea69/5ec1f7e700f3/cdb4ee2aea69")),
            ("o/café", "日本", Ok("spiffe://ci.example.org/ci/o/caf-850f7dc43910/cf2abf0c5be3")),
            ("o/r", "", Err(IdentityError::EmptyJob)),
            ("", "j", Err(IdentityError::InvalidRepository { repository: String::new() })),
            ("/", "j", Err(IdentityError::InvalidRepository { repository: "/".into() })),
            ("o/", "j", Err(IdentityError::InvalidRepository { repository: "o/".into() })),
            ("/r", "j", Err(IdentityError::InvalidRepository { repository: "/r".into() })),
            ("or", "j", Err(IdentityError::InvalidRepository { repository: "or".into() })),
            ("o//r", "j", Err(IdentityError::InvalidRepository { repository: "o//r".into() })),
        ];
        for (repository, job, want) in rows {
            let got = derive(TD, repository, job, None).map(|i| i.spiffe_id);
            assert_eq!(got, want.map(str::to_owned), "{repository:?} {job:?}");
            if let Ok(spiffe_id) = got {
                assert_valid(&spiffe_id);
            }
        }
        let identity = derive(TD, "My Org/repo", "Test Job", None).unwrap();
        assert_eq!((identity.repository.as_str(), identity.job.as_str()), ("My Org/repo", "Test Job"));
        let rows: Vec<(&str, &str, i64, &str)> = vec![
            ("gitea/runner", "build", 42, "spiffe://ci.example.org/ci/gitea/runner/build/42"),
            ("o/r", "0123456789ab", 1, "spiffe://ci.example.org/ci/o/r/0123456789ab-d407ad901895/1"),
            ("o/r", "a/b", i64::MAX, "spiffe://ci.example.org/ci/o/r/a-b-c14cddc033f6/9223372036854775807"),
        ];
        for (repository, job, task_id, want) in rows {
            let got = derive(TD, repository, job, Some(task_id)).unwrap().spiffe_id;
            assert_eq!(got, want, "{repository:?} {job:?} {task_id}");
            assert_valid(&got);
        }
    }

    #[test]
    fn trust_domain_table() {
        let long = "a".repeat(256);
        let rows: Vec<(&str, bool)> = vec![
            ("ci.example.org", true),
            ("example_org-1", true),
            ("a", true),
            ("", false),
            ("Example.org", false),
            ("example.org:8443", false),
            ("exa mple", false),
            ("example.org/x", false),
            ("ex@mple", false),
            ("exämple", false),
            (&long, false),
        ];
        for (trust_domain, ok) in rows {
            let got = derive(trust_domain, "o/r", "j", Some(1));
            assert_eq!(got.is_ok(), ok, "{trust_domain:?}: {got:?}");
            if let Err(e) = got {
                assert!(matches!(e, IdentityError::InvalidTrustDomain { .. }));
                assert!(e.to_string().contains("configure a lowercase name"));
            }
        }
    }

    #[test]
    fn similar_names_never_share_an_identity() {
        let x300 = "x".repeat(300);
        let x301 = "x".repeat(301);
        let names = [
            "a b",
            "a/b",
            "a_b",
            "a-b",
            "a.b",
            "a  b",
            "a\tb",
            "a\u{a0}b",
            "a--b",
            "ab",
            "A b",
            "A B",
            "café",
            "cafe",
            "caf",
            "caf-850f7dc43910",
            "caf-850f7dc43910-x",
            "日本",
            "日本語",
            "cf2abf0c5be3",
            ".",
            "..",
            "...",
            "_",
            "-",
            "0123456789ab",
            "deploy-0123456789ab",
            "deploy-0123456789ab-7cbfe463dfcf",
            &x300,
            &x301,
        ];
        let mut seen = BTreeMap::new();
        for name in names {
            let spiffe_id = id("o/r", name);
            assert_valid(&spiffe_id);
            if let Some(other) = seen.insert(spiffe_id.clone(), name) {
                panic!("{name:?} and {other:?} share {spiffe_id}");
            }
        }
        // Owner/repo boundaries: `a/b c` vs `a b/c` and names moved between segments.
        let pairs = [("a/b c", "j"), ("a b/c", "j"), ("a/b", "c j"), ("a/b-c", "j"), ("a-b/c", "j")];
        let ids: HashSet<String> = pairs.iter().map(|(r, j)| id(r, j)).collect();
        assert_eq!(ids.len(), pairs.len());
        // Two tasks of one job key never share one, nor a task and a job named like it.
        let task = |job: &str, task_id| derive(TD, "o/r", job, Some(task_id)).unwrap().spiffe_id;
        let tasks: HashSet<String> = [task("deploy", 1), task("deploy", 2), task("deploy", 12), task("deploy/1", 2), id("o/r", "deploy/1")].into();
        assert_eq!(tasks.len(), 5, "{tasks:?}");
    }

    #[test]
    fn deterministic_and_bounded() {
        let long = "é".repeat(1000);
        let cases = [("o/r", "j"), ("My Org/café", "日本 / build"), (long.as_str(), "x"), ("o/r", long.as_str())];
        for (repository, job) in cases {
            let repository = if repository.contains('/') { repository.to_owned() } else { format!("{repository}/{repository}") };
            let a = derive(TD, &repository, job, Some(7)).unwrap();
            let b = derive(TD, &repository, job, Some(7)).unwrap();
            assert_eq!(a, b);
            assert_valid(&a.spiffe_id);
        }
        let max = derive(&"a".repeat(255), &format!("{}/{}", "x".repeat(300), "y".repeat(300)), &"z".repeat(300), Some(i64::MAX)).unwrap();
        assert_valid(&max.spiffe_id);
        assert!(max.spiffe_id.len() <= 9 + 255 + 4 + 3 * 61 + 3 + 19);
    }

    fn context(fields: &[(&str, &str)]) -> Struct {
        Struct { fields: fields.iter().map(|(k, v)| ((*k).to_owned(), Value { kind: Some(Kind::StringValue((*v).to_owned())) })).collect() }
    }

    fn task(payload: Option<&str>, context: Option<Struct>) -> Task {
        Task { id: 7, workflow_payload: payload.map(|p| p.as_bytes().to_vec()), context, ..Default::default() }
    }

    #[test]
    fn for_task_table() {
        let wf = "jobs:\n  Test Job:\n    runs-on: [self-hosted, container]\n";
        let rows: Vec<(Task, Result<&str, IdentityError>)> = vec![
            (
                task(Some(wf), Some(context(&[("repository", "gitea/runner"), ("repository_owner", "gitea"), ("job", "42")]))),
                Ok("spiffe://ci.example.org/ci/gitea/runner/Test-Job-8e9f764de448/7"),
            ),
            (task(Some(wf), Some(context(&[("repository", "gitea/runner")]))), Ok("spiffe://ci.example.org/ci/gitea/runner/Test-Job-8e9f764de448/7")),
            (
                task(Some(wf), Some(context(&[("repository", "gitea/runner"), ("repository_owner", "")]))),
                Ok("spiffe://ci.example.org/ci/gitea/runner/Test-Job-8e9f764de448/7"),
            ),
            (
                task(Some(wf), Some(context(&[("repository", "gitea/runner"), ("repository_owner", "evil")]))),
                Err(IdentityError::OwnerMismatch { repository: "gitea/runner".into(), owner: "evil".into() }),
            ),
            (task(Some(wf), Some(context(&[("repository_owner", "gitea")]))), Err(IdentityError::MissingRepository)),
            (task(Some(wf), Some(context(&[("repository", "runner")]))), Err(IdentityError::InvalidRepository { repository: "runner".into() })),
            (
                task(Some(wf), Some(Struct { fields: [("repository".to_owned(), Value { kind: Some(Kind::NumberValue(1.0)) })].into() })),
                Err(IdentityError::MissingRepository),
            ),
            (task(Some(wf), None), Err(IdentityError::MissingContext)),
            (task(None, Some(context(&[("repository", "o/r")]))), Err(IdentityError::MissingWorkflow)),
            (task(Some("jobs: {}"), Some(context(&[("repository", "o/r")]))), Err(IdentityError::Workflow(PlacementError::JobCount { count: 0 }))),
        ];
        for (i, (task, want)) in rows.into_iter().enumerate() {
            assert_eq!(for_task(TD, &task).map(|i| i.spiffe_id), want.map(str::to_owned), "row {i}");
        }
    }

    #[test]
    fn identity_serde_round_trip() {
        let identity = derive(TD, "o/r", "j", Some(3)).unwrap();
        let json = serde_json::to_string(&identity).unwrap();
        assert_eq!(json, r#"{"repository":"o/r","job":"j","spiffe_id":"spiffe://ci.example.org/ci/o/r/j/3"}"#);
        assert_eq!(serde_json::from_str::<Identity>(&json).unwrap(), identity);
    }
}
