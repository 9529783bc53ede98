//! The Task of `controller run-local`, built here from a workflow file
//! the way Gitea builds one (Gitea's services/actions/task.go) — a single-job
//! workflow payload, a context Struct with the keys the runner reads, secrets (only
//! from files) and vars.

use std::{collections::BTreeMap, path::Path};

use prost_types::{Struct, Value as PbValue, value::Kind};
use proto::runner::v1::{Result as TaskResult, Task, TaskNeed};

#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    BadFile { path: String, reason: String },
    #[error("the workflow is not valid YAML: {0}")]
    Yaml(String),
    #[error("the workflow has no jobs")]
    NoJobs,
    #[error("the workflow has no job {job:?} (it has: {known})")]
    NoSuchJob { job: String, known: String },
    #[error("job {job:?} needs {need:?}, which the workflow does not have (it has: {known})")]
    UnknownNeed { job: String, need: String, known: String },
    #[error("the workflow has jobs that need each other: {0}")]
    Cycle(String),
    #[error("job {job:?} {what}")]
    Unsupported { job: String, what: String },
    #[error("nothing to run: the job and matrix filters leave no job")]
    NothingToRun,
    #[error("{0:?} is not NAME=VALUE")]
    Assignment(String),
    #[error("--input {name}: the workflow's workflow_dispatch has no such input (it has: {known})")]
    UnknownInput { name: String, known: String },
    #[error("the workflow_dispatch input {0:?} is required: give it with --input {0}=VALUE")]
    MissingInput(String),
}

/// `github.repository` of a run outside a clone with an `origin` remote.
pub const DEFAULT_REPOSITORY: &str = "local/workflow";

/// A result as workflows spell it: `success`, `failure`, `cancelled`, `skipped`.
pub fn result_word(result: i32) -> String {
    controller::lifecycle::result_name(result).trim_start_matches("RESULT_").to_ascii_lowercase()
}

/// What `run-local` knows about the run (defaults describe a local checkout).
#[derive(Debug, Clone)]
pub struct RunContext {
    pub repository: String,
    pub sha: String,
    pub ref_name: String,
    pub event_name: String,
    /// The event's payload (`github.event`), e.g. from `--event-file`.
    pub event: serde_json::Map<String, serde_json::Value>,
    pub actor: String,
    pub server_url: String,
    /// `gitea_default_actions_url`: where the runner fetches `uses: OWNER/NAME@REF`.
    pub actions_url: String,
    pub run_id: i64,
}

impl RunContext {
    /// The run is of the commit `served` (`github.sha`, `github.ref`); a push event's
    /// payload names it too unless the event file did.
    pub fn served(&mut self, served: &crate::repository::Served) {
        self.sha.clone_from(&served.sha);
        self.ref_name.clone_from(&served.branch);
        if self.event_name == "push" {
            let fields = [
                ("ref", serde_json::json!(format!("refs/heads/{}", served.branch))),
                ("after", serde_json::json!(served.sha)),
                ("head_commit", serde_json::json!({ "id": served.sha, "message": served.message })),
            ];
            for (key, value) in fields {
                self.event.entry(key).or_insert(value);
            }
        }
    }
}

impl Default for RunContext {
    fn default() -> Self {
        RunContext {
            repository: DEFAULT_REPOSITORY.into(),
            sha: "0000000000000000000000000000000000000000".into(),
            ref_name: "main".into(),
            event_name: "workflow_dispatch".into(),
            event: serde_json::Map::new(),
            actor: "run-local".into(),
            server_url: "http://127.0.0.1".into(),
            actions_url: "https://github.com".into(),
            run_id: 1,
        }
    }
}

/// The event payload with the workflow_dispatch `inputs`: the workflow's defaults, then
/// `given` (an input the workflow does not declare is refused, one it requires must be
/// given).
///
/// # Errors
/// An undeclared or a missing required input.
pub fn with_inputs(
    mut event: serde_json::Map<String, serde_json::Value>,
    declared: &BTreeMap<String, (Option<String>, bool)>,
    given: &BTreeMap<String, String>,
) -> Result<serde_json::Map<String, serde_json::Value>, LocalError> {
    if let Some(name) = given.keys().find(|name| !declared.contains_key(*name)) {
        let known: Vec<&str> = declared.keys().map(String::as_str).collect();
        return Err(LocalError::UnknownInput { name: name.clone(), known: if known.is_empty() { "none".into() } else { known.join(", ") } });
    }
    let mut inputs = serde_json::Map::new();
    for (name, (default, required)) in declared {
        match (given.get(name), default) {
            (Some(value), _) | (None, Some(value)) => {
                inputs.insert(name.clone(), serde_json::Value::String(value.clone()));
            }
            (None, None) if *required => return Err(LocalError::MissingInput(name.clone())),
            (None, None) => {}
        }
    }
    if !inputs.is_empty() {
        event.insert("inputs".into(), serde_json::Value::Object(inputs));
    }
    Ok(event)
}

/// A JSON value as the protobuf `Value` the context carries.
fn from_json(value: &serde_json::Value) -> PbValue {
    let kind = match value {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or_default()),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(items) => Kind::ListValue(prost_types::ListValue { values: items.iter().map(from_json).collect() }),
        serde_json::Value::Object(fields) => Kind::StructValue(Struct { fields: fields.iter().map(|(k, v)| (k.clone(), from_json(v))).collect() }),
    };
    PbValue { kind: Some(kind) }
}

/// The protobuf `Value` as JSON again (numbers as f64, as the context carries them).
fn to_json(value: &PbValue) -> serde_json::Value {
    match &value.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::BoolValue(b)) => serde_json::Value::Bool(*b),
        Some(Kind::NumberValue(n)) => serde_json::Number::from_f64(*n).map_or(serde_json::Value::Null, serde_json::Value::Number),
        Some(Kind::StringValue(s)) => serde_json::Value::String(s.clone()),
        Some(Kind::ListValue(list)) => serde_json::Value::Array(list.values.iter().map(to_json).collect()),
        Some(Kind::StructValue(fields)) => serde_json::Value::Object(fields.fields.iter().map(|(k, v)| (k.clone(), to_json(v))).collect()),
    }
}

/// The contexts a job's matrix expression is evaluated with once its needs ended, as
/// Gitea's jobparser has them: `needs` (results and outputs), `inputs`, `vars`, `github`.
pub fn expression_contexts(run: &RunContext, job: &str, needs: &BTreeMap<String, TaskNeed>, vars: &BTreeMap<String, String>) -> serde_json::Value {
    let needs: serde_json::Map<String, serde_json::Value> =
        needs.iter().map(|(key, need)| (key.clone(), serde_json::json!({ "result": result_word(need.result), "outputs": need.outputs }))).collect();
    let github = serde_json::Value::Object(context(run, job).fields.iter().map(|(k, v)| (k.clone(), to_json(v))).collect());
    serde_json::json!({
        "needs": needs,
        "inputs": run.event.get("inputs").cloned().unwrap_or_else(|| serde_json::json!({})),
        "vars": vars,
        "github": github,
    })
}

fn string(s: &str) -> PbValue {
    PbValue { kind: Some(Kind::StringValue(s.to_owned())) }
}

/// The context keys gitea-runner reads (gitea-runner's internal/app/run/runner.go).
pub fn context(run: &RunContext, job: &str) -> Struct {
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
        ("event", from_json(&serde_json::Value::Object(run.event.clone()))),
        ("sha", string(&run.sha)),
        ("ref", string(&format!("refs/heads/{}", run.ref_name))),
        ("ref_name", string(&run.ref_name)),
        ("ref_type", string("branch")),
        ("ref_protected", string("false")),
        ("head_ref", string("")),
        ("base_ref", string("")),
        ("job", string(job)),
        ("run_id", string(&run.run_id.to_string())),
        ("run_number", string("1")),
        ("run_attempt", string("1")),
        ("workflow", string("run-local")),
        ("workspace", string("")),
        ("secret_source", string("Actions")),
        ("token", string("")),
        ("gitea_runtime_token", string("")),
        ("gitea_default_actions_url", string(&run.actions_url)),
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

/// A dotenv file (`NAME=VALUE` lines, `#` comments, quoting as dotenv defines it):
/// `--secret-file`, `--var-file`, `--env-file`.
///
/// # Errors
/// An unreadable file or a line that is not `NAME=VALUE`.
pub fn dotenv_file(path: &Path) -> Result<BTreeMap<String, String>, LocalError> {
    let shown = path.display().to_string();
    let entries = dotenvy::from_path_iter(path).map_err(|error| match error {
        dotenvy::Error::Io(source) => LocalError::Read { path: shown.clone(), source },
        other => LocalError::BadFile { path: shown.clone(), reason: other.to_string() },
    })?;
    entries.map(|entry| entry.map_err(|error| LocalError::BadFile { path: shown.clone(), reason: error.to_string() })).collect()
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
    needs: BTreeMap<String, TaskNeed>,
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
        needs: needs.into_iter().collect(),
        vars: vars.into_iter().collect(),
        ..Default::default()
    }
}

/// What a job that needs `key` learns of it, as Gitea aggregates a job's matrix
/// (services/actions: FindTaskNeeds): one result for all its combinations (a failure
/// or cancel in any one wins; skipped only if all were) and their outputs merged.
pub fn need_of<'a>(ended: impl IntoIterator<Item = (i32, &'a BTreeMap<String, String>)>) -> TaskNeed {
    let mut results = Vec::new();
    let mut outputs = BTreeMap::new();
    for (result, job_outputs) in ended {
        results.push(result);
        for (key, value) in job_outputs {
            if !value.is_empty() || !outputs.contains_key(key) {
                outputs.insert(key.clone(), value.clone());
            }
        }
    }
    let any = |r: TaskResult| results.contains(&(r as i32));
    let result = if any(TaskResult::Failure) || results.iter().any(|r| TaskResult::try_from(*r).is_err() || *r == TaskResult::Unspecified as i32) {
        TaskResult::Failure
    } else if any(TaskResult::Cancelled) {
        TaskResult::Cancelled
    } else if !results.is_empty() && results.iter().all(|r| *r == TaskResult::Skipped as i32) {
        TaskResult::Skipped
    } else {
        TaskResult::Success
    };
    TaskNeed { outputs: outputs.into_iter().collect(), result: result as i32 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workflow::Workflow;

    const TWO_JOBS: &str = "name: ci\non: push\nenv:\n  A: b\njobs:\n  build:\n    runs-on: [self-hosted, container, docker]\n    steps:\n      - run: make\n  test:\n    needs: build\n    runs-on: [self-hosted, container, docker]\n    steps:\n      - run: make test\n";

    fn outputs(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn a_need_aggregates_its_matrix_as_gitea_does() {
        use TaskResult::{Cancelled, Failure, Skipped, Success};
        let (a, b) = (outputs(&[("x", "1"), ("y", "")]), outputs(&[("y", "2"), ("x", "")]));
        let table: &[(&[TaskResult], TaskResult)] = &[
            (&[Success, Success], Success),
            (&[Success, Failure], Failure),
            (&[Cancelled, Success], Cancelled),
            (&[Cancelled, Failure], Failure),
            (&[Skipped, Success], Success),
            (&[Skipped, Skipped], Skipped),
        ];
        for (results, want) in table {
            let need = need_of(results.iter().zip([&a, &b]).map(|(r, o)| (*r as i32, o)));
            assert_eq!(need.result, *want as i32, "{results:?}");
            assert_eq!(need.outputs, [("x".to_owned(), "1".to_owned()), ("y".to_owned(), "2".to_owned())].into(), "non-empty values win");
        }
    }

    #[test]
    fn the_task_carries_needs_the_job_token_and_the_identity() {
        let plan = Workflow::parse(TWO_JOBS.as_bytes()).unwrap().plan(Some("test"), &[]).unwrap();
        let need = need_of([(TaskResult::Success as i32, &outputs(&[("v", "1")]))]);
        let run = RunContext { repository: "owner/repo".into(), run_id: 7, ..Default::default() };
        let context = context(&run, "test");
        for key in ["repository", "repository_owner", "server_url", "sha", "ref", "event_name", "token", "gitea_runtime_token", "run_id", "event"] {
            assert!(context.fields.contains_key(key), "{key}");
        }
        let task = task(7, plan[0].payload.clone(), context, BTreeMap::from([("build".to_owned(), need)]), BTreeMap::new(), BTreeMap::new(), "local-token");
        assert_eq!(task.needs["build"].outputs["v"], "1");
        assert_eq!(task.secrets["GITHUB_TOKEN"], "local-token", "gitea-runner needs the job token among the secrets");
        let rules =
            controller::assignment::Rules { trust_domain: "example.org".into(), labels: controller::assignment::placement::LabelPolicy::seed_compatible() };
        let assignment = controller::assignment::envelope::Assignment::from_task(task, &rules).unwrap();
        assert_eq!(assignment.identity.spiffe_id, "spiffe://example.org/ci/owner/repo/test/7");
    }

    #[test]
    fn inputs_take_the_workflows_defaults_and_refuse_what_it_does_not_declare() {
        let declared = BTreeMap::from([("level".to_owned(), (Some("low".to_owned()), false)), ("target".to_owned(), (None, true))]);
        let given = |pairs: &[(&str, &str)]| outputs(pairs);
        let event = with_inputs(serde_json::Map::new(), &declared, &given(&[("target", "prod")])).unwrap();
        assert_eq!(event["inputs"], serde_json::json!({"level": "low", "target": "prod"}));
        let error = with_inputs(serde_json::Map::new(), &declared, &given(&[])).unwrap_err().to_string();
        assert!(error.contains("--input target=VALUE"), "{error}");
        let error = with_inputs(serde_json::Map::new(), &declared, &given(&[("target", "x"), ("typo", "1")])).unwrap_err().to_string();
        assert!(error.contains("no such input (it has: level, target)"), "{error}");
        let context = context(&RunContext { event: event.clone(), ..Default::default() }, "job");
        let Some(Kind::StructValue(event)) = &context.fields["event"].kind else { panic!("event is not a struct") };
        assert!(event.fields.contains_key("inputs"));
    }

    #[test]
    fn secrets_only_from_files_and_vars_from_pairs_or_dotenv_files() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "s3cret\n").unwrap();
        let secrets = secrets_from_files(&[format!("TOKEN={}", file.display())]).unwrap();
        assert_eq!(secrets["TOKEN"], "s3cret");
        assert!(secrets_from_files(&["TOKEN".into()]).is_err());
        assert!(secrets_from_files(&["TOKEN=/nonexistent".into()]).unwrap_err().to_string().contains("/nonexistent"));
        assert_eq!(vars(&["A=1".into(), "B=".into()]).unwrap(), BTreeMap::from([("A".into(), "1".into()), ("B".into(), String::new())]));
        assert!(vars(&["=1".into()]).is_err());

        let env = dir.path().join("ci.env");
        std::fs::write(&env, "# comment\nA=1\nB=\"two words\"\n").unwrap();
        assert_eq!(dotenv_file(&env).unwrap(), outputs(&[("A", "1"), ("B", "two words")]));
        std::fs::write(&env, "A=1\nnot a pair\n").unwrap();
        assert!(dotenv_file(&env).unwrap_err().to_string().contains("ci.env"));
        assert!(dotenv_file(&dir.path().join("missing.env")).unwrap_err().to_string().contains("missing.env: cannot read"));
    }
}
