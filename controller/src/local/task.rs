//! The Task of `controller run-local`, built here from a workflow file
//! the way Gitea builds one (Gitea's services/actions/task.go) — a single-job
//! workflow payload, a context Struct with the keys the runner reads, secrets (only
//! from files) and vars.

use std::{collections::BTreeMap, path::Path};

use prost_types::{Struct, Value as PbValue, value::Kind};
use proto::runner::v1::{Result as TaskResult, Task, TaskNeed};
use serde_yaml_ng::{Mapping, Value};

#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the workflow is not valid YAML: {0}")]
    Yaml(String),
    #[error("the workflow has no jobs")]
    NoJobs,
    #[error("the workflow has several jobs ({0}): choose one with --job")]
    WhichJob(String),
    #[error("the workflow has no job {job:?} (it has: {known})")]
    NoSuchJob { job: String, known: String },
    #[error("{0:?} is not NAME=VALUE")]
    Assignment(String),
}

/// What `run-local` knows about the run (defaults describe a local checkout).
#[derive(Debug, Clone)]
pub struct RunContext {
    pub repository: String,
    pub sha: String,
    pub ref_name: String,
    pub event_name: String,
    pub actor: String,
    pub server_url: String,
}

impl Default for RunContext {
    fn default() -> Self {
        RunContext {
            repository: "local/workflow".into(),
            sha: "0000000000000000000000000000000000000000".into(),
            ref_name: "main".into(),
            event_name: "workflow_dispatch".into(),
            actor: "run-local".into(),
            server_url: "http://127.0.0.1".into(),
        }
    }
}

/// The workflow's document and its `jobs` mapping.
fn parse(workflow: &[u8]) -> Result<(Mapping, Mapping), LocalError> {
    let document: Value = serde_yaml_ng::from_slice(workflow).map_err(|e| LocalError::Yaml(e.to_string()))?;
    let Value::Mapping(document) = document else {
        return Err(LocalError::Yaml("the document is not a mapping".into()));
    };
    let Some(Value::Mapping(jobs)) = document.get("jobs").cloned() else {
        return Err(LocalError::NoJobs);
    };
    Ok((document, jobs))
}

/// The workflow's job keys, in the file's order.
///
/// # Errors
/// Invalid YAML or no `jobs` mapping.
pub fn job_names(workflow: &[u8]) -> Result<Vec<String>, LocalError> {
    Ok(parse(workflow)?.1.keys().filter_map(|k| k.as_str().map(str::to_owned)).collect())
}

/// The single-job workflow Gitea would send for `job` (or the only job): the file's
/// top-level keys with `jobs` reduced to that job. Returns (job key, payload, needs).
///
/// # Errors
/// Invalid YAML, no jobs, several jobs without `job`, or an unknown job.
pub fn single_job(workflow: &[u8], job: Option<&str>) -> Result<(String, Vec<u8>, Vec<String>), LocalError> {
    let (mut document, jobs) = parse(workflow)?;
    let keys: Vec<String> = jobs.keys().filter_map(|k| k.as_str().map(str::to_owned)).collect();
    let key = match (job, keys.as_slice()) {
        (_, []) => return Err(LocalError::NoJobs),
        (None, [only]) => only.clone(),
        (None, _) => return Err(LocalError::WhichJob(keys.join(", "))),
        (Some(wanted), _) if keys.iter().any(|k| k == wanted) => wanted.to_owned(),
        (Some(wanted), _) => return Err(LocalError::NoSuchJob { job: wanted.to_owned(), known: keys.join(", ") }),
    };
    let definition = jobs.get(key.as_str()).cloned().unwrap_or(Value::Null);
    let needs = match definition.get("needs") {
        Some(Value::String(one)) => vec![one.clone()],
        Some(Value::Sequence(many)) => many.iter().filter_map(|n| n.as_str().map(str::to_owned)).collect(),
        _ => Vec::new(),
    };
    let mut single = Mapping::new();
    single.insert(Value::String(key.clone()), definition);
    document.insert(Value::String("jobs".into()), Value::Mapping(single));
    let payload = serde_yaml_ng::to_string(&Value::Mapping(document)).map_err(|e| LocalError::Yaml(e.to_string()))?;
    Ok((key, payload.into_bytes(), needs))
}

fn string(s: &str) -> PbValue {
    PbValue { kind: Some(Kind::StringValue(s.to_owned())) }
}

/// The context keys gitea-runner reads (gitea-runner's internal/app/run/runner.go).
pub fn context(run: &RunContext, job: &str, run_id: i64) -> Struct {
    let owner = run.repository.split('/').next().unwrap_or_default();
    let fields: BTreeMap<String, PbValue> = [
        ("actor", string(&run.actor)),
        ("triggering_actor", string(&run.actor)),
        ("api_url", string(&format!("{}/api/v1", run.server_url))),
        ("server_url", string(&run.server_url)),
        ("repository", string(&run.repository)),
        ("repository_owner", string(owner)),
        ("repositoryUrl", string(&format!("{}/{}.git", run.server_url, run.repository))),
        ("event_name", string(&run.event_name)),
        ("event", PbValue { kind: Some(Kind::StructValue(Struct::default())) }),
        ("sha", string(&run.sha)),
        ("ref", string(&format!("refs/heads/{}", run.ref_name))),
        ("ref_name", string(&run.ref_name)),
        ("ref_type", string("branch")),
        ("ref_protected", string("false")),
        ("head_ref", string("")),
        ("base_ref", string("")),
        ("job", string(job)),
        ("run_id", string(&run_id.to_string())),
        ("run_number", string("1")),
        ("run_attempt", string("1")),
        ("workflow", string("run-local")),
        ("workspace", string("")),
        ("secret_source", string("Actions")),
        ("token", string("")),
        ("gitea_runtime_token", string("")),
        ("gitea_default_actions_url", string("https://github.com")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    Struct { fields }
}

/// `NAME=PATH` pairs whose values are read from the files (secrets never come from
/// the command line itself).
///
/// # Errors
/// A malformed pair or an unreadable file.
pub fn secrets_from_files(pairs: &[String]) -> Result<BTreeMap<String, String>, LocalError> {
    let mut secrets = BTreeMap::new();
    for pair in pairs {
        let (name, path) = pair.split_once('=').filter(|(n, p)| !n.is_empty() && !p.is_empty()).ok_or_else(|| LocalError::Assignment(pair.clone()))?;
        let value = std::fs::read_to_string(Path::new(path)).map_err(|source| LocalError::Read { path: path.to_owned(), source })?;
        secrets.insert(name.to_owned(), value.trim_end_matches(['\n', '\r']).to_owned());
    }
    Ok(secrets)
}

/// `NAME=VALUE` pairs.
///
/// # Errors
/// A pair without `=` or with an empty name.
pub fn vars(pairs: &[String]) -> Result<BTreeMap<String, String>, LocalError> {
    pairs
        .iter()
        .map(|pair| {
            pair.split_once('=').filter(|(n, _)| !n.is_empty()).map(|(n, v)| (n.to_owned(), v.to_owned())).ok_or_else(|| LocalError::Assignment(pair.clone()))
        })
        .collect()
}

/// The Task, as Gitea would hand it out. Gitea always sends the job's token as the
/// secrets `GITEA_TOKEN` and `GITHUB_TOKEN` (and gitea-runner v3.3.0 fails on a task
/// without secrets), so a local task carries `job_token` there unless given.
pub fn task(
    id: i64,
    payload: Vec<u8>,
    context: Struct,
    needs: &[String],
    mut secrets: BTreeMap<String, String>,
    vars: BTreeMap<String, String>,
    job_token: &str,
) -> Task {
    for name in ["GITEA_TOKEN", "GITHUB_TOKEN"] {
        secrets.entry(name.to_owned()).or_insert_with(|| job_token.to_owned());
    }
    Task {
        id,
        workflow_payload: Some(payload),
        context: Some(context),
        secrets: secrets.into_iter().collect(),
        needs: needs.iter().map(|n| (n.clone(), TaskNeed { outputs: Default::default(), result: TaskResult::Success as i32 })).collect(),
        vars: vars.into_iter().collect(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO_JOBS: &str = "name: ci\non: push\nenv:\n  A: b\njobs:\n  build:\n    runs-on: [self-hosted, container, docker]\n    steps:\n      - run: make\n  test:\n    needs: build\n    runs-on: [self-hosted, container, docker]\n    steps:\n      - run: make test\n";

    #[test]
    fn job_selection() {
        let table: &[(Option<&str>, Result<&str, &str>)] = &[
            (None, Err("several jobs (build, test)")),
            (Some("build"), Ok("build")),
            (Some("test"), Ok("test")),
            (Some("deploy"), Err("no job \"deploy\" (it has: build, test)")),
        ];
        for (job, want) in table {
            match (single_job(TWO_JOBS.as_bytes(), *job), want) {
                (Ok((key, payload, _)), Ok(expected)) => {
                    assert_eq!(&key, expected);
                    let (again, labels) = crate::assignment::placement::runs_on(&payload).unwrap();
                    assert_eq!(&again, expected, "the payload must hold exactly that job");
                    assert_eq!(labels, ["self-hosted", "container", "docker"]);
                    let text = String::from_utf8(payload).unwrap();
                    assert!(text.contains("A: b") && text.contains("name: ci"), "{text}");
                }
                (Err(error), Err(expected)) => assert!(error.to_string().contains(expected), "{error}"),
                (got, want) => panic!("{job:?}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn needs_become_successful_needs() {
        let (_, payload, needs) = single_job(TWO_JOBS.as_bytes(), Some("test")).unwrap();
        assert_eq!(needs, ["build"]);
        let task = task(5, payload, context(&RunContext::default(), "test", 1), &needs, BTreeMap::new(), BTreeMap::new(), "local-token");
        assert_eq!(task.needs["build"].result, TaskResult::Success as i32);
        assert_eq!(task.secrets["GITHUB_TOKEN"], "local-token", "gitea-runner needs the job token among the secrets");
    }

    #[test]
    fn malformed_workflows() {
        for (text, want) in [("[]", "not a mapping"), ("name: x\n", "no jobs"), ("jobs: {}\n", "no jobs"), ("jobs: [\n", "YAML")] {
            let error = single_job(text.as_bytes(), None).unwrap_err().to_string();
            assert!(error.contains(want), "{text:?}: {error}");
        }
    }

    #[test]
    fn context_is_what_the_runner_reads_and_yields_the_identity() {
        let run = RunContext { repository: "owner/repo".into(), ..Default::default() };
        let context = context(&run, "build", 7);
        for key in ["repository", "repository_owner", "server_url", "sha", "ref", "event_name", "token", "gitea_runtime_token", "run_id"] {
            assert!(context.fields.contains_key(key), "{key}");
        }
        let (_, payload, _) = single_job(TWO_JOBS.as_bytes(), Some("build")).unwrap();
        let task = task(7, payload, context, &[], BTreeMap::new(), BTreeMap::new(), "local-token");
        let rules = crate::assignment::Rules { trust_domain: "example.org".into(), labels: crate::assignment::placement::LabelPolicy::seed_compatible() };
        let assignment = crate::assignment::envelope::Assignment::from_task(task, &rules).unwrap();
        assert_eq!(assignment.identity.spiffe_id, "spiffe://example.org/ci/owner/repo/build");
    }

    #[test]
    fn secrets_only_from_files_and_vars_from_pairs() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "s3cret\n").unwrap();
        let secrets = secrets_from_files(&[format!("TOKEN={}", file.display())]).unwrap();
        assert_eq!(secrets["TOKEN"], "s3cret");
        assert!(secrets_from_files(&["TOKEN".into()]).is_err());
        assert!(secrets_from_files(&["TOKEN=/nonexistent".into()]).unwrap_err().to_string().contains("/nonexistent"));
        assert_eq!(vars(&["A=1".into(), "B=".into()]).unwrap(), BTreeMap::from([("A".into(), "1".into()), ("B".into(), String::new())]));
        assert!(vars(&["=1".into()]).is_err());
    }
}
