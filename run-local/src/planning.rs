//! The plan: the workflow's jobs as Gitea would create them, each with the placement its
//! `runs-on` names (refused before anything starts when it names none), the jobs whose
//! matrix is an expression expanded once the jobs they need ended, and `--list`.
//!
//! Each job's state — waiting, running in its environment, ended — is held in one
//! place, its [`Job`].

use std::collections::BTreeMap;

use anyhow::Context;
use proto::runner::v1::{Result as TaskResult, Task, TaskNeed};

use controller::{
    assignment::{Assignment, Placement, Rules, placement::LabelPolicy},
    store::now_ms,
};

use crate::{
    cli::RunLocalArgs,
    reports, repository, task,
    workflow::{PlannedJob, Workflow},
};

/// The assignments of `tasks` and the rules they were made with, under whichever
/// label policy takes them all: run-local accepts what a Gitea with either setting would,
/// and runs-on made only of `platforms` (e.g. ubuntu-latest) runs in a docker container.
///
/// # Errors
/// The default policy's error for the first job neither takes (its `runs-on` names no
/// placement).
pub fn assignments_for(tasks: &[Task], platforms: &[String]) -> Result<(Vec<Assignment>, Rules), controller::assignment::envelope::AssignmentError> {
    let trust_domain = "run-local.invalid".to_owned();
    let default_rules = Rules { trust_domain: trust_domain.clone(), labels: LabelPolicy { host_platforms: platforms.to_vec(), ..LabelPolicy::default() } };
    let under = |rules: &Rules| tasks.iter().map(|task| Assignment::from_task(task.clone(), rules)).collect::<Result<Vec<_>, _>>();
    match under(&default_rules) {
        Ok(assignments) => Ok((assignments, default_rules)),
        Err(first) => {
            let seed = Rules { trust_domain, labels: LabelPolicy { host_platforms: platforms.to_vec(), ..LabelPolicy::seed_compatible() } };
            under(&seed).map(|assignments| (assignments, seed)).map_err(|_| first)
        }
    }
}

/// A planned job and where it stands.
#[derive(Debug)]
pub struct Job {
    pub planned: PlannedJob,
    pub task_id: i64,
    pub placement: Placement,
    runs_on: Vec<String>,
    pub state: JobState,
}

#[derive(Debug)]
pub enum JobState {
    Waiting,
    /// Handed to the pipeline: its environment is retired at the end.
    Running(Assignment),
    Done {
        ended: reports::Ended,
        assignment: Option<Assignment>,
    },
}

impl Job {
    fn new(planned: PlannedJob, assignment: Assignment) -> Job {
        Job { planned, task_id: assignment.task.id, placement: assignment.placement, runs_on: assignment.runs_on, state: JobState::Waiting }
    }

    /// As Gitea decides: a job runs when every job it needs succeeded, or when it has an
    /// `if:` (which the runner then evaluates); otherwise it is skipped.
    pub fn runs_after(&self, needs: &BTreeMap<String, TaskNeed>) -> bool {
        self.planned.has_if || needs.values().all(|need| need.result == TaskResult::Success as i32)
    }

    pub fn ended(&self) -> Option<&reports::Ended> {
        match &self.state {
            JobState::Done { ended, .. } => Some(ended),
            _ => None,
        }
    }

    pub fn is_waiting(&self) -> bool {
        matches!(self.state, JobState::Waiting)
    }

    /// The job's assignment once it was handed to the pipeline.
    pub fn assignment(&self) -> Option<&Assignment> {
        match &self.state {
            JobState::Running(assignment) | JobState::Done { assignment: Some(assignment), .. } => Some(assignment),
            _ => None,
        }
    }

    /// Ends the job with `result`, without its runner's report (skipped, cancelled,
    /// could not start).
    pub fn end_as(&mut self, result: TaskResult) {
        self.end(reports::Ended { result: result as i32, ..Default::default() });
    }

    pub fn end(&mut self, ended: reports::Ended) {
        let assignment = match std::mem::replace(&mut self.state, JobState::Waiting) {
            JobState::Running(assignment) => Some(assignment),
            JobState::Done { assignment, .. } => assignment,
            JobState::Waiting => None,
        };
        self.state = JobState::Done { ended, assignment };
    }
}

/// The task a planned job would be, to find its placement before anything starts.
fn probe(planned: &PlannedJob, id: i64, repository: &str) -> Task {
    let run = task::RunContext { repository: repository.to_owned(), ..task::RunContext::default() };
    let context = task::context(&run, &planned.key);
    task::task(id, planned.payload.clone(), context, BTreeMap::new(), BTreeMap::new(), BTreeMap::new(), "probe")
}

/// The workflow read, its jobs planned and placed.
#[derive(Debug)]
pub struct Plan {
    pub workflow: Workflow,
    pub filters: Vec<(String, String)>,
    pub jobs: Vec<Job>,
    pub rules: Rules,
    /// OWNER/NAME the jobs run for.
    pub repository: String,
    /// The work tree the workflow is in, served to the jobs.
    pub root: Option<std::path::PathBuf>,
}

impl Plan {
    /// Reads `--workflow` and plans its jobs (or `--job`, `--matrix`).
    ///
    /// # Errors
    /// When the workflow cannot be read or planned, or a job's `runs-on` names no placement.
    pub async fn read(args: &RunLocalArgs) -> anyhow::Result<Plan> {
        let text = std::fs::read(&args.workflow).with_context(|| format!("--workflow {}", args.workflow.display()))?;
        let mut workflow = Workflow::parse(&text).with_context(|| format!("{}", args.workflow.display()))?;
        if let Some(file) = &args.env_file {
            workflow = workflow.with_base_env(&task::dotenv_file(file)?);
        }
        let filters = args
            .matrix
            .iter()
            .map(|f| {
                f.split_once(':').map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned())).ok_or_else(|| anyhow::anyhow!("--matrix {f:?} is not KEY:VALUE"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let planned = workflow.plan(args.job.as_deref(), &filters)?;
        let root = repository::work_tree_of(&args.workflow).await;
        let repository = match (&args.repository, &root) {
            (Some(name), _) => repository::owner_and_name(name).ok_or_else(|| anyhow::anyhow!("--repository {name:?} is not OWNER/NAME"))?,
            (None, Some(root)) => repository::origin_name(root).await.unwrap_or_else(|| task::DEFAULT_REPOSITORY.to_owned()),
            (None, None) => task::DEFAULT_REPOSITORY.to_owned(),
        };
        // Every job must name a placement before anything starts.
        let probes: Vec<Task> = planned.iter().zip(now_ms().max(1)..).map(|(job, id)| probe(job, id, &repository)).collect();
        let (assignments, rules) = assignments_for(&probes, &args.platforms).map_err(|error| anyhow::anyhow!("a job cannot run: {error}"))?;
        let jobs = planned.into_iter().zip(assignments).map(|(planned, assignment)| Job::new(planned, assignment)).collect();
        Ok(Plan { workflow, filters, jobs, rules, repository, root })
    }

    /// Whether log lines carry the job's name: several jobs run, or may.
    pub fn prefixed(&self) -> bool {
        self.jobs.len() > 1 || self.jobs.iter().any(|j| j.planned.deferred)
    }

    /// `--list`: each job with what it needs, its matrix size and its placement.
    pub fn list(&self) -> String {
        let mut rows = vec![["JOB".to_owned(), "NEEDS".to_owned(), "MATRIX".to_owned(), "PLACEMENT".to_owned(), "RUNS-ON".to_owned()]];
        for spec in self.workflow.jobs() {
            let planned: Vec<&Job> = self.jobs.iter().filter(|j| j.planned.key == spec.key).collect();
            let Some(first) = planned.first() else { continue };
            let needs = if spec.needs.is_empty() { "-".to_owned() } else { spec.needs.join(",") };
            // A matrix given by an expression is known once the jobs it needs ended.
            let size = if first.planned.deferred { "needs".to_owned() } else { planned.len().to_string() };
            rows.push([spec.key.clone(), needs, size, first.placement.to_string(), first.runs_on.join(",")]);
        }
        let widths: Vec<usize> = (0..5).map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0)).collect();
        let mut out = String::new();
        for row in rows {
            let cells: Vec<String> = row.iter().zip(&widths).map(|(cell, width)| format!("{cell:<width$}")).collect();
            out.push_str(cells.join("  ").trim_end());
            out.push('\n');
        }
        out
    }

    /// Splits the plan into its jobs and what expands the deferred ones.
    pub fn into_jobs(self) -> (Vec<Job>, Planner) {
        let next_id = self.jobs.iter().map(|j| j.task_id).max().unwrap_or_else(now_ms) + 1;
        let planner = Planner { workflow: self.workflow, filters: self.filters, rules: self.rules, repository: self.repository, next_id };
        (self.jobs, planner)
    }
}

/// Expands the jobs whose matrix is an expression once the jobs they need ended.
#[derive(Debug)]
pub struct Planner {
    workflow: Workflow,
    filters: Vec<(String, String)>,
    rules: Rules,
    repository: String,
    next_id: i64,
}

impl Planner {
    /// The combinations of the deferred job `key` as jobs of their own, evaluated with its needs.
    fn expand(&mut self, key: &str, needs: &BTreeMap<String, TaskNeed>, inputs: &crate::inputs::Inputs) -> anyhow::Result<Vec<Job>> {
        let contexts = task::expression_contexts(&inputs.run, key, needs, &inputs.vars);
        let planned = self.workflow.expand(key, &contexts, &self.filters)?;
        planned
            .into_iter()
            .map(|planned| {
                let id = self.next_id;
                self.next_id += 1;
                let assignment = Assignment::from_task(probe(&planned, id, &self.repository), &self.rules).map_err(|error| anyhow::anyhow!("{error}"))?;
                Ok(Job::new(planned, assignment))
            })
            .collect()
    }

    /// Replaces each deferred job whose needs ended (and that runs: they succeeded or it
    /// has an `if:`) by its combinations; one that cannot be expanded fails.
    pub fn expand_ready(&mut self, jobs: &mut Vec<Job>, inputs: &crate::inputs::Inputs) {
        loop {
            let ready = (0..jobs.len()).find_map(|index| {
                let job = &jobs[index];
                if !job.planned.deferred || !job.is_waiting() {
                    return None;
                }
                let needs = needs_of(jobs, index)?;
                job.runs_after(&needs).then_some((index, needs))
            });
            let Some((index, needs)) = ready else { return };
            let (key, name) = (jobs[index].planned.key.clone(), jobs[index].planned.name.clone());
            match self.expand(&key, &needs, inputs) {
                Ok(expanded) => {
                    let names: Vec<&str> = expanded.iter().map(|j| j.planned.name.as_str()).collect();
                    eprintln!("run-local: job {name:?}'s matrix gives {}: {}", expanded.len(), names.join(", "));
                    jobs.splice(index..=index, expanded);
                }
                Err(error) => {
                    eprintln!("run-local: job {name:?} cannot run: {error:#}");
                    jobs[index].end_as(TaskResult::Failure);
                }
            }
        }
    }
}

/// The needs of `jobs[index]` once every job it needs has ended, as Gitea hands them
/// to the runner; a need left out of the run (`--job`, matrix filters) counts as a
/// success without outputs.
pub fn needs_of(jobs: &[Job], index: usize) -> Option<BTreeMap<String, TaskNeed>> {
    let mut needs = BTreeMap::new();
    for need in &jobs[index].planned.needs {
        let of_need: Vec<&Job> = jobs.iter().filter(|j| &j.planned.key == need).collect();
        if of_need.iter().any(|j| j.ended().is_none()) {
            return None;
        }
        let empty = BTreeMap::new();
        let ended = of_need.iter().filter_map(|j| j.ended()).map(|e| (e.result, &e.outputs));
        let aggregated = if of_need.is_empty() { task::need_of([(TaskResult::Success as i32, &empty)]) } else { task::need_of(ended) };
        needs.insert(need.clone(), aggregated);
    }
    Some(needs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The project's own workflows (`.gitea/workflows/`) and the examples, as run-local reads
    /// them: every job parses into a task and its `runs-on` names a placement (run-local
    /// refuses one that does not before any environment starts).
    #[test]
    fn the_projects_own_workflows_parse_and_name_a_placement() {
        use crate::task::RunContext;
        let repository = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let mut seen = Vec::new();
        for dir in [".gitea/workflows", "examples"] {
            for entry in std::fs::read_dir(repository.join(dir)).unwrap() {
                let path = entry.unwrap().path();
                let text = std::fs::read(&path).unwrap();
                let plan = Workflow::parse(&text).and_then(|w| w.plan(None, &[])).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                let tasks: Vec<_> = (1..)
                    .zip(&plan)
                    .map(|(id, job)| {
                        let context = task::context(&RunContext::default(), &job.key);
                        task::task(id, job.payload.clone(), context, Default::default(), Default::default(), Default::default(), "job-token")
                    })
                    .collect();
                let (assignments, _) = assignments_for(&tasks, &[]).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                for (job, assignment) in plan.iter().zip(assignments) {
                    seen.push(format!("{}: {} → {}", path.strip_prefix(repository).unwrap().display(), job.name, assignment.placement));
                }
            }
        }
        seen.sort();
        println!("{}", seen.join("\n"));
        for expected in [
            ".gitea/workflows/ci.yml: test",
            ".gitea/workflows/release.yml: images",
            ".gitea/workflows/release.yml: smoke",
            "examples/hello.yml: hello",
            "examples/pipeline.yml: build (amd64)",
        ] {
            assert!(seen.iter().any(|s| s.starts_with(expected)), "{expected} missing from {seen:?}");
        }
    }
}
