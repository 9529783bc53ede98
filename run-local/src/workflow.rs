//! A workflow file turned into the jobs Gitea would create from it (Gitea's jobparser):
//! one single-job workflow per job and matrix combination, named as Gitea names them,
//! in an order where every job comes after the jobs it needs. A matrix given by an
//! expression is expanded once the jobs it needs have ended ([`Workflow::expand`]), as
//! Gitea does. Everything `run-local` cannot do is refused here, before any environment
//! starts.

use std::collections::{BTreeMap, BTreeSet};

use serde_yaml_ng::{Mapping, Value};

use crate::task::LocalError;

/// One matrix combination: key → value, in key order (as Gitea orders them in names).
pub type Combination = BTreeMap<String, Value>;

/// A job of the file as written.
#[derive(Debug, Clone)]
pub struct JobSpec {
    pub key: String,
    pub needs: Vec<String>,
    /// A job-level `if:`. Gitea hands such a job to the runner (which evaluates it) even
    /// when a job it needs did not succeed; without one the job is skipped.
    pub has_if: bool,
    pub matrix: Matrix,
    definition: Mapping,
}

/// A job's `strategy.matrix`.
#[derive(Debug, Clone)]
pub enum Matrix {
    /// Literal: its combinations are known now.
    Known(Vec<Combination>),
    /// It holds `${{ }}`: expanded with the needed jobs' outputs once they ended.
    Deferred(Value),
}

/// One job Gitea would create: a job and one matrix combination.
#[derive(Debug, Clone)]
pub struct PlannedJob {
    pub key: String,
    /// As Gitea shows it: `name:` (its `${{ matrix.* }}` filled in), else the key with
    /// the combination's values, e.g. `build (linux, 3)`.
    pub name: String,
    pub needs: Vec<String>,
    pub has_if: bool,
    pub combination: Combination,
    /// The single-job workflow the runner receives.
    pub payload: Vec<u8>,
    /// Stands for a job whose matrix is an expression, until [`Workflow::expand`].
    pub deferred: bool,
}

#[derive(Debug, Clone)]
pub struct Workflow {
    document: Mapping,
    jobs: Vec<JobSpec>,
}

impl Workflow {
    /// # Errors
    /// Invalid YAML, no jobs, a job that needs an unknown job or itself in a cycle, a
    /// reusable workflow (`uses:` on a job), a literal matrix with no combinations.
    pub fn parse(text: &[u8]) -> Result<Workflow, LocalError> {
        let mut document: Value = serde_yaml_ng::from_slice(text).map_err(|e| LocalError::Yaml(e.to_string()))?;
        document.apply_merge().map_err(|e| LocalError::Yaml(e.to_string()))?;
        let Value::Mapping(document) = document else {
            return Err(LocalError::Yaml("the document is not a mapping".into()));
        };
        let Some(Value::Mapping(raw_jobs)) = document.get("jobs") else {
            return Err(LocalError::NoJobs);
        };
        let mut jobs = Vec::new();
        for (key, definition) in raw_jobs {
            let key = key.as_str().ok_or_else(|| LocalError::Yaml(format!("job key {key:?} is not a string")))?.to_owned();
            let Value::Mapping(definition) = definition else {
                return Err(LocalError::Yaml(format!("job {key:?} is not a mapping")));
            };
            if let Some(uses) = definition.get("uses").and_then(Value::as_str) {
                return Err(LocalError::Unsupported { job: key, what: format!("calls the reusable workflow {uses:?}; run-local runs jobs with steps only") });
            }
            let needs = match definition.get("needs") {
                Some(Value::String(one)) => vec![one.clone()],
                Some(Value::Sequence(many)) => many.iter().filter_map(|n| n.as_str().map(str::to_owned)).collect(),
                _ => Vec::new(),
            };
            let has_if = definition.get("if").is_some_and(|condition| !matches!(condition, Value::Null) && condition.as_str() != Some(""));
            let raw_matrix = definition.get("strategy").and_then(|s| s.get("matrix"));
            let matrix = match raw_matrix {
                Some(raw) if crate::expression::has_expression(raw) => Matrix::Deferred(raw.clone()),
                raw => Matrix::Known(matrix(&key, raw)?),
            };
            jobs.push(JobSpec { key, needs, has_if, matrix, definition: definition.clone() });
        }
        if jobs.is_empty() {
            return Err(LocalError::NoJobs);
        }
        let workflow = Workflow { document, jobs };
        workflow.ordered()?;
        Ok(workflow)
    }

    /// The jobs in the file's order.
    pub fn jobs(&self) -> &[JobSpec] {
        &self.jobs
    }

    /// The event a run of this file gets unless told: its first `on:` event.
    pub fn first_event(&self) -> Option<String> {
        match self.document.get("on")? {
            Value::String(one) => Some(one.clone()),
            Value::Sequence(many) => many.first().and_then(Value::as_str).map(str::to_owned),
            Value::Mapping(events) => events.keys().next().and_then(Value::as_str).map(str::to_owned),
            _ => None,
        }
    }

    /// `on.workflow_dispatch.inputs`: name → (default, required).
    pub fn dispatch_inputs(&self) -> BTreeMap<String, (Option<String>, bool)> {
        let Some(Value::Mapping(inputs)) = self.document.get("on").and_then(|on| on.get("workflow_dispatch")).and_then(|d| d.get("inputs")) else {
            return BTreeMap::new();
        };
        inputs
            .iter()
            .filter_map(|(name, spec)| {
                let default = spec.get("default").and_then(scalar);
                let required = spec.get("required").and_then(Value::as_bool).unwrap_or(false);
                Some((name.as_str()?.to_owned(), (default, required)))
            })
            .collect()
    }

    /// Adds `env` under the workflow's own `env:` (the workflow's values win), as
    /// `--env-file` asks.
    pub fn with_base_env(mut self, env: &BTreeMap<String, String>) -> Workflow {
        if env.is_empty() {
            return self;
        }
        let mut merged: Mapping = env.iter().map(|(k, v)| (Value::String(k.clone()), Value::String(v.clone()))).collect();
        if let Some(Value::Mapping(own)) = self.document.get("env") {
            merged.extend(own.clone());
        }
        self.document.insert(Value::String("env".into()), Value::Mapping(merged));
        self
    }

    /// The jobs to run, every one after those it needs. `only` runs a single job (its
    /// needs count as succeeded, as `act -j`); `filters` keep the matrix combinations
    /// whose value of each named key matches. A job whose matrix is an expression is
    /// planned as one job with [`PlannedJob::deferred`] set, for [`Workflow::expand`].
    ///
    /// # Errors
    /// An unknown `only`, or filters that leave nothing to run.
    pub fn plan(&self, only: Option<&str>, filters: &[(String, String)]) -> Result<Vec<PlannedJob>, LocalError> {
        if let Some(only) = only
            && !self.jobs.iter().any(|j| j.key == only)
        {
            return Err(LocalError::NoSuchJob { job: only.to_owned(), known: self.keys().join(", ") });
        }
        let mut planned = Vec::new();
        for job in self.ordered()? {
            if only.is_some_and(|only| only != job.key) {
                continue;
            }
            match &job.matrix {
                Matrix::Known(combinations) => planned.extend(self.combinations(job, combinations, filters)?),
                Matrix::Deferred(_) => {
                    let mut placeholder = self.single(job, &Combination::new())?;
                    placeholder.deferred = true;
                    planned.push(placeholder);
                }
            }
        }
        if planned.is_empty() {
            return Err(LocalError::NothingToRun);
        }
        Ok(planned)
    }

    /// The jobs of the deferred job `key` once the jobs it needs ended: its matrix
    /// evaluated with `contexts` (needs, inputs, vars, github) and expanded, filtered like
    /// [`Workflow::plan`].
    ///
    /// # Errors
    /// An expression that cannot be evaluated, a matrix that is not one after evaluation,
    /// or none of its combinations left by the filters.
    pub fn expand(&self, key: &str, contexts: &serde_json::Value, filters: &[(String, String)]) -> Result<Vec<PlannedJob>, LocalError> {
        let job = self.jobs.iter().find(|j| j.key == key).ok_or_else(|| LocalError::NoSuchJob { job: key.to_owned(), known: self.keys().join(", ") })?;
        let Matrix::Deferred(raw) = &job.matrix else {
            return self.plan(Some(key), filters);
        };
        let evaluated = crate::expression::evaluate_value(raw, contexts)
            .map_err(|e| LocalError::Unsupported { job: key.to_owned(), what: format!("strategy.matrix: {e}") })?;
        let combinations = matrix(key, Some(&evaluated))?;
        let planned = self.combinations(job, &combinations, filters)?;
        if planned.is_empty() {
            return Err(LocalError::NothingToRun);
        }
        Ok(planned)
    }

    fn combinations(&self, job: &JobSpec, combinations: &[Combination], filters: &[(String, String)]) -> Result<Vec<PlannedJob>, LocalError> {
        combinations
            .iter()
            .filter(|combination| filters.iter().all(|(key, value)| combination.get(key).is_none_or(|v| scalar(v).as_deref() == Some(value.as_str()))))
            .map(|combination| self.single(job, combination))
            .collect()
    }

    fn keys(&self) -> Vec<String> {
        self.jobs.iter().map(|j| j.key.clone()).collect()
    }

    /// Kahn's order, ties in the file's order; refuses unknown needs and cycles.
    fn ordered(&self) -> Result<Vec<&JobSpec>, LocalError> {
        let known: BTreeSet<&str> = self.jobs.iter().map(|j| j.key.as_str()).collect();
        for job in &self.jobs {
            if let Some(unknown) = job.needs.iter().find(|n| !known.contains(n.as_str())) {
                return Err(LocalError::UnknownNeed { job: job.key.clone(), need: unknown.clone(), known: self.keys().join(", ") });
            }
        }
        let mut done: BTreeSet<&str> = BTreeSet::new();
        let mut order = Vec::new();
        while order.len() < self.jobs.len() {
            let next = self.jobs.iter().find(|j| !done.contains(j.key.as_str()) && j.needs.iter().all(|n| done.contains(n.as_str())));
            let Some(next) = next else {
                let cycle: Vec<String> = self.jobs.iter().filter(|j| !done.contains(j.key.as_str())).map(|j| j.key.clone()).collect();
                return Err(LocalError::Cycle(cycle.join(", ")));
            };
            done.insert(&next.key);
            order.push(next);
        }
        Ok(order)
    }

    fn single(&self, job: &JobSpec, combination: &Combination) -> Result<PlannedJob, LocalError> {
        let mut definition = job.definition.clone();
        let name = match definition.get("name").and_then(Value::as_str) {
            Some(name) => fill_matrix(name, combination),
            None if combination.is_empty() => job.key.clone(),
            None => format!("{} ({})", job.key, combination.values().map(|v| scalar(v).unwrap_or_default()).collect::<Vec<_>>().join(", ")),
        };
        if !combination.is_empty() {
            // What the runner expands again: exactly this combination.
            let single: Mapping = combination.iter().map(|(k, v)| (Value::String(k.clone()), Value::Sequence(vec![v.clone()]))).collect();
            let mut strategy = definition.get("strategy").and_then(Value::as_mapping).cloned().unwrap_or_default();
            strategy.insert(Value::String("matrix".into()), Value::Mapping(single));
            definition.insert(Value::String("strategy".into()), Value::Mapping(strategy));
            definition.insert(Value::String("name".into()), Value::String(name.clone()));
        }
        let mut document = self.document.clone();
        let jobs: Mapping = [(Value::String(job.key.clone()), Value::Mapping(definition))].into_iter().collect();
        document.insert(Value::String("jobs".into()), Value::Mapping(jobs));
        let payload = serde_yaml_ng::to_string(&Value::Mapping(document)).map_err(|e| LocalError::Yaml(e.to_string()))?;
        Ok(PlannedJob {
            key: job.key.clone(),
            name,
            needs: job.needs.clone(),
            has_if: job.has_if,
            combination: combination.clone(),
            payload: payload.into_bytes(),
            deferred: false,
        })
    }
}

/// A scalar as the runner prints it.
fn scalar(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Bool(b) => Some(b.to_string()),
        Value::Number(n) => Some(n.to_string()),
        Value::Null => Some(String::new()),
        _ => serde_yaml_ng::to_string(value).ok().map(|s| s.trim_end().to_owned()),
    }
}

/// `${{ matrix.KEY }}` in a job name, filled in (the only expression a name needs here).
pub(crate) fn fill_matrix(name: &str, combination: &Combination) -> String {
    let mut filled = name.to_owned();
    for (key, value) in combination {
        for spelling in [format!("${{{{ matrix.{key} }}}}"), format!("${{{{matrix.{key}}}}}")] {
            filled = filled.replace(&spelling, &scalar(value).unwrap_or_default());
        }
    }
    filled
}

/// The combinations of `strategy.matrix` as GitHub defines them: the product of the
/// lists, minus `exclude` (partial matches), then each `include` added to every
/// combination whose original values it does not change, or as a new one.
fn matrix(job: &str, matrix: Option<&Value>) -> Result<Vec<Combination>, LocalError> {
    let expression =
        |what: &str| LocalError::Unsupported { job: job.to_owned(), what: format!("{what} is not what a matrix holds there (a mapping of lists)") };
    let Some(matrix) = matrix else { return Ok(vec![Combination::new()]) };
    let Value::Mapping(matrix) = matrix else {
        return Err(expression("strategy.matrix"));
    };
    let mut combinations = vec![Combination::new()];
    let mut original_keys = BTreeSet::new();
    let mut includes = Vec::new();
    let mut excludes = Vec::new();
    for (key, values) in matrix {
        let key = key.as_str().unwrap_or_default().to_owned();
        match (key.as_str(), values) {
            ("include", Value::Sequence(entries)) => includes.clone_from(entries),
            ("exclude", Value::Sequence(entries)) => excludes.clone_from(entries),
            (_, Value::Sequence(values)) => {
                original_keys.insert(key.clone());
                combinations = combinations
                    .into_iter()
                    .flat_map(|base| {
                        let key = key.clone();
                        values.iter().map(move |v| {
                            let mut c = base.clone();
                            c.insert(key.clone(), v.clone());
                            c
                        })
                    })
                    .collect::<Vec<_>>();
            }
            _ => return Err(expression(&format!("strategy.matrix.{key}"))),
        }
    }
    if original_keys.is_empty() {
        combinations.clear();
    }
    let entry = |value: &Value| -> Result<Combination, LocalError> {
        let Value::Mapping(m) = value else { return Err(expression("a matrix include/exclude entry")) };
        Ok(m.iter().filter_map(|(k, v)| Some((k.as_str()?.to_owned(), v.clone()))).collect())
    };
    for exclude in &excludes {
        let exclude = entry(exclude)?;
        combinations.retain(|c| !exclude.iter().all(|(k, v)| c.get(k) == Some(v)));
    }
    let originals = combinations.len();
    for include in &includes {
        let include = entry(include)?;
        let mut added = false;
        for combination in combinations.iter_mut().take(originals) {
            if include.iter().all(|(k, v)| !original_keys.contains(k) || combination.get(k) == Some(v)) {
                combination.extend(include.clone());
                added = true;
            }
        }
        if !added {
            combinations.push(include);
        }
    }
    if combinations.is_empty() {
        return Err(LocalError::Unsupported { job: job.to_owned(), what: "has a matrix with no combinations".into() });
    }
    Ok(combinations)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn combos(yaml: &str) -> Vec<String> {
        let value: Value = serde_yaml_ng::from_str(yaml).unwrap();
        matrix("j", Some(&value)).unwrap().iter().map(|c| c.iter().map(|(k, v)| format!("{k}={}", scalar(v).unwrap())).collect::<Vec<_>>().join(",")).collect()
    }

    #[test]
    fn matrices_expand_as_github_defines_them() {
        let table: &[(&str, &[&str])] = &[
            ("os: [linux, mac]\nv: [1, 2]", &["os=linux,v=1", "os=linux,v=2", "os=mac,v=1", "os=mac,v=2"]),
            ("os: [linux, mac]\nv: [1, 2]\nexclude: [{os: mac, v: 2}]", &["os=linux,v=1", "os=linux,v=2", "os=mac,v=1"]),
            ("os: [linux, mac]\nexclude: [{os: mac}]", &["os=linux"]),
            // An include that changes no original value extends every match; one that would is added.
            ("os: [linux, mac]\ninclude: [{os: linux, extra: x}, {os: bsd}]", &["extra=x,os=linux", "os=mac", "os=bsd"]),
            ("os: [linux]\ninclude: [{tool: cc}]", &["os=linux,tool=cc"]),
            ("include: [{a: 1}, {a: 2}]", &["a=1", "a=2"]),
        ];
        for (yaml, want) in table {
            assert_eq!(combos(yaml), *want, "{yaml}");
        }
    }

    const PIPELINE: &str = "on:\n  workflow_dispatch:\n    inputs:\n      level: {default: low}\n  push:\nenv:\n  A: workflow\njobs:\n  test:\n    needs: [build]\n    if: always()\n    runs-on: docker\n    steps: [{run: make test}]\n  build:\n    runs-on: docker\n    strategy:\n      fail-fast: false\n      matrix: {os: [linux, bsd], n: [1]}\n    steps: [{run: make}]\n  named:\n    name: lint ${{ matrix.tool }}\n    runs-on: docker\n    strategy: {matrix: {tool: [clippy]}}\n    steps: [{run: lint}]\n";

    #[test]
    fn jobs_come_after_their_needs_one_per_combination_named_as_gitea_names_them() {
        let workflow = Workflow::parse(PIPELINE.as_bytes()).unwrap();
        let plan = workflow.plan(None, &[]).unwrap();
        let names: Vec<&str> = plan.iter().map(|j| j.name.as_str()).collect();
        assert_eq!(names, ["build (1, linux)", "build (1, bsd)", "test", "lint clippy"]);
        assert!(plan[2].has_if && !plan[0].has_if);
        assert_eq!(plan[2].needs, ["build"]);
        let single: Value = serde_yaml_ng::from_slice(&plan[1].payload).unwrap();
        assert_eq!(single["jobs"].as_mapping().unwrap().len(), 1);
        assert_eq!(single["jobs"]["build"]["strategy"]["matrix"]["os"], Value::Sequence(vec![Value::String("bsd".into())]));
        assert_eq!(single["jobs"]["build"]["strategy"]["fail-fast"], Value::Bool(false));
        assert_eq!(single["env"]["A"], Value::String("workflow".into()));
        let (key, labels) = controller::assignment::placement::runs_on(&plan[1].payload).unwrap();
        assert_eq!((key.as_str(), labels.as_slice()), ("build", ["docker".to_owned()].as_slice()));

        assert_eq!(workflow.first_event().as_deref(), Some("workflow_dispatch"));
        assert_eq!(workflow.dispatch_inputs()["level"], (Some("low".into()), false));
        let filtered = workflow.plan(None, &[("os".into(), "bsd".into())]).unwrap();
        assert_eq!(filtered.iter().map(|j| j.name.as_str()).collect::<Vec<_>>(), ["build (1, bsd)", "test", "lint clippy"]);
        let only = workflow.plan(Some("test"), &[]).unwrap();
        assert_eq!(only.len(), 1);

        let with_env = Workflow::parse(PIPELINE.as_bytes()).unwrap().with_base_env(&BTreeMap::from([("A".into(), "file".into()), ("B".into(), "file".into())]));
        let single: Value = serde_yaml_ng::from_slice(&with_env.plan(Some("test"), &[]).unwrap()[0].payload).unwrap();
        assert_eq!((single["env"]["A"].as_str(), single["env"]["B"].as_str()), (Some("workflow"), Some("file")), "the workflow's env wins");
    }

    #[test]
    fn a_matrix_given_by_an_expression_is_expanded_once_its_needs_ended() {
        let text = r#"jobs:
  prepare: {runs-on: docker, steps: [{run: x}]}
  whole:
    needs: prepare
    runs-on: docker
    strategy: {matrix: "${{ fromJSON(needs.prepare.outputs.matrix) }}"}
    steps: [{run: y}]
  keyed:
    needs: prepare
    runs-on: docker
    strategy: {matrix: {"${{ needs.prepare.outputs.key }}": "${{ fromJSON(needs.prepare.outputs.oses) }}"}}
    steps: [{run: y}]
  constant:
    runs-on: docker
    strategy: {matrix: {a: "${{ fromJSON('[1,2]') }}"}}
    steps: [{run: y}]
"#;
        let workflow = Workflow::parse(text.as_bytes()).unwrap();
        let plan = workflow.plan(None, &[]).unwrap();
        let planned: Vec<(&str, bool)> = plan.iter().map(|j| (j.name.as_str(), j.deferred)).collect();
        assert_eq!(planned, [("prepare", false), ("whole", true), ("keyed", true), ("constant", true)]);
        let contexts = serde_json::json!({"needs": {"prepare": {"result": "success", "outputs": {
            "matrix": r#"{"os": ["linux", "bsd"], "v": [3], "include": [{"os": "mac", "v": 4}]}"#, "key": "os", "oses": r#"["linux","bsd","mac"]"#}}}});
        let names = |key: &str, filters: &[(String, String)]| -> Vec<String> {
            workflow.expand(key, &contexts, filters).unwrap().into_iter().map(|j| j.name).collect()
        };
        assert_eq!(names("whole", &[]), ["whole (linux, 3)", "whole (bsd, 3)", "whole (mac, 4)"]);
        assert_eq!(names("keyed", &[]), ["keyed (linux)", "keyed (bsd)", "keyed (mac)"]);
        assert_eq!(names("constant", &[]), ["constant (1)", "constant (2)"]);
        assert_eq!(names("keyed", &[("os".into(), "mac".into())]), ["keyed (mac)"]);
        let expanded = workflow.expand("whole", &contexts, &[]).unwrap();
        let single: Value = serde_yaml_ng::from_slice(&expanded[2].payload).unwrap();
        assert_eq!(single["jobs"]["whole"]["strategy"]["matrix"]["v"], Value::Sequence(vec![Value::Number(4.into())]), "the runner gets its combination");
        assert!(!expanded[0].deferred);
        let error = workflow.expand("whole", &serde_json::json!({"needs": {}}), &[]).unwrap_err().to_string();
        assert!(error.contains("fromJSON(needs.prepare.outputs.matrix) }}: cannot be evaluated"), "{error}");
        let not_a_matrix = serde_json::json!({"needs": {"prepare": {"outputs": {"matrix": "\"linux\""}}}});
        let error = workflow.expand("whole", &not_a_matrix, &[]).unwrap_err().to_string();
        assert!(error.contains("strategy.matrix is not what a matrix holds"), "{error}");
        let error = workflow.expand("keyed", &serde_json::json!({}), &[]).unwrap_err().to_string();
        assert!(error.contains("\"needs\" is not known"), "{error}");
    }

    #[test]
    fn what_cannot_run_locally_is_refused_with_the_reason() {
        let table = [
            ("[]", "not a mapping"),
            ("name: x\n", "no jobs"),
            ("jobs: {}\n", "no jobs"),
            ("jobs: [\n", "YAML"),
            ("jobs:\n  a: {needs: b, steps: []}\n", "needs \"b\", which the workflow does not have (it has: a)"),
            ("jobs:\n  a: {needs: b, steps: []}\n  b: {needs: a, steps: []}\n", "jobs that need each other: a, b"),
            ("jobs:\n  call: {uses: other/repo/.gitea/workflows/x.yml@main}\n", "reusable workflow"),
            ("jobs:\n  m: {strategy: {matrix: {os: linux}}, steps: []}\n", "strategy.matrix.os is not what a matrix holds there"),
            ("jobs:\n  m: {strategy: {matrix: {os: [a], exclude: [{os: a}]}}, steps: []}\n", "no combinations"),
        ];
        for (text, want) in table {
            let error = Workflow::parse(text.as_bytes()).unwrap_err().to_string();
            assert!(error.contains(want), "{text:?}: {error}");
        }
        let workflow = Workflow::parse(PIPELINE.as_bytes()).unwrap();
        assert!(workflow.plan(Some("deploy"), &[]).unwrap_err().to_string().contains("no job \"deploy\" (it has: test, build, named)"));
        assert!(workflow.plan(Some("build"), &[("os".into(), "windows".into())]).unwrap_err().to_string().contains("nothing"));
    }
}
