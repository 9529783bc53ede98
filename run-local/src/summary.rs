//! The end of a run: one line per job with its result and its steps under it, the
//! run's result as Gitea sums up its jobs, and the exit code.

use std::collections::BTreeMap;

use proto::runner::v1::Result as TaskResult;

use crate::{planning::Job, task, workflow};

/// The exit code of a run whose jobs sum up to `result`.
pub fn exit_code(result: i32) -> u8 {
    match TaskResult::try_from(result) {
        Ok(TaskResult::Success | TaskResult::Skipped) => 0,
        Ok(TaskResult::Cancelled) => crate::exit::CANCELLED,
        _ => crate::exit::JOB_FAILED,
    }
}

/// One line per job with its result, its steps under it.
pub fn summary(jobs: &[Job]) {
    eprintln!("run-local: ── summary ──");
    for job in jobs {
        let Some(ended) = job.ended() else { continue };
        eprintln!("run-local: {:<10} {}", task::result_word(ended.result), job.planned.name);
        let names = step_names(&job.planned.payload);
        for step in &ended.steps {
            let name = usize::try_from(step.id).ok().and_then(|i| names.get(i)).cloned().unwrap_or_else(|| format!("step {}", step.id));
            let name = workflow::fill_matrix(&name, &job.planned.combination);
            eprintln!("run-local:   {:<10} {name}", task::result_word(step.result));
        }
    }
    eprintln!("run-local: {} {}", if jobs.len() == 1 { "job" } else { "run" }, task::result_word(run_result(jobs)));
}

/// The run's result as Gitea sums up its jobs.
pub fn run_result(jobs: &[Job]) -> i32 {
    let no_outputs = BTreeMap::new();
    task::need_of(jobs.iter().filter_map(|j| j.ended().map(|e| (e.result, &no_outputs)))).result
}

/// The job's step names as the workflow writes them (`name`, else `run`/`uses`).
fn step_names(payload: &[u8]) -> Vec<String> {
    let Ok(document) = serde_yaml_ng::from_slice::<serde_yaml_ng::Value>(payload) else { return Vec::new() };
    let Some(jobs) = document.get("jobs").and_then(|j| j.as_mapping()) else { return Vec::new() };
    let Some((_, job)) = jobs.iter().next() else { return Vec::new() };
    let steps = job.get("steps").and_then(|s| s.as_sequence()).cloned().unwrap_or_default();
    steps
        .iter()
        .map(|step| {
            let field = |key: &str| step.get(key).and_then(|v| v.as_str()).map(|v| v.lines().next().unwrap_or_default().to_owned());
            field("name").or_else(|| field("run").map(|r| format!("Run {r}"))).or_else(|| field("uses")).unwrap_or_default()
        })
        .collect()
}
