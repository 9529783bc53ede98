//! What the run reads besides the workflow: secrets and variables (from files), the
//! event and its inputs, and what is served where the jobs' Gitea would be — the
//! repository's snapshot and the `--action` mappings.

use std::{collections::BTreeMap, path::PathBuf};

use anyhow::Context;

use controller::store::now_ms;
use proto::runner::v1::{Task, TaskNeed};

use crate::{
    cli::RunLocalArgs,
    planning::{Job, Plan},
    repository, task,
    workflow::Workflow,
};

/// Everything the run reads besides the workflow, from the command line and its files.
#[derive(Debug)]
pub struct Inputs {
    pub run: task::RunContext,
    pub secrets: BTreeMap<String, String>,
    pub vars: BTreeMap<String, String>,
}

impl Inputs {
    /// Reads the secrets, variables, event and inputs the command line gives.
    ///
    /// # Errors
    /// A file that cannot be read, or inputs the event does not take.
    pub fn read(args: &RunLocalArgs, workflow: &Workflow, repository: &str) -> anyhow::Result<Inputs> {
        let mut secrets = match &args.secret_file {
            Some(file) => task::dotenv_file(file)?,
            None => BTreeMap::new(),
        };
        secrets.extend(task::secrets_from_files(&args.secrets.iter().map(|s| s.replacen("=@", "=", 1)).collect::<Vec<_>>())?);
        let mut vars = match &args.var_file {
            Some(file) => task::dotenv_file(file)?,
            None => BTreeMap::new(),
        };
        vars.extend(task::vars(&args.vars)?);
        let event_name = args.event.clone().or_else(|| workflow.first_event()).unwrap_or_else(|| "push".to_owned());
        let mut event = match &args.event_file {
            Some(file) => {
                let text = std::fs::read(file).with_context(|| format!("--event-file {}", file.display()))?;
                match serde_json::from_slice(&text).with_context(|| format!("--event-file {}: not JSON", file.display()))? {
                    serde_json::Value::Object(payload) => payload,
                    _ => anyhow::bail!("--event-file {}: the payload must be a JSON object", file.display()),
                }
            }
            None => serde_json::Map::new(),
        };
        let given = task::vars(&args.inputs)?;
        if event_name == "workflow_dispatch" {
            event = task::with_inputs(event, &workflow.dispatch_inputs(), &given)?;
        } else if !given.is_empty() {
            anyhow::bail!("--input is for the workflow_dispatch event; this run's event is {event_name:?} (choose it with --event workflow_dispatch)");
        }
        let run = task::RunContext { repository: repository.to_owned(), event_name, event, run_id: now_ms().max(1), ..task::RunContext::default() };
        Ok(Inputs { run, secrets, vars })
    }
}

/// `--action OWNER/NAME@REF=DIR` mappings grouped by action: OWNER/NAME → its (REF, DIR)s
/// in the order given; one ref given twice is refused.
fn action_mappings(mappings: &[String]) -> anyhow::Result<BTreeMap<String, Vec<(String, PathBuf)>>> {
    let mut actions: BTreeMap<String, Vec<(String, PathBuf)>> = BTreeMap::new();
    for mapping in mappings {
        let (name, git_ref, dir) = action_mapping(mapping)?;
        let refs = actions.entry(name.clone()).or_default();
        if let Some((_, other)) = refs.iter().find(|(r, _)| *r == git_ref) {
            anyhow::bail!("--action {mapping}: {name}@{git_ref} is served from {} already", other.display());
        }
        refs.push((git_ref, dir));
    }
    Ok(actions)
}

/// `OWNER/NAME@REF=DIR` → (OWNER/NAME, REF, DIR).
fn action_mapping(mapping: &str) -> anyhow::Result<(String, String, PathBuf)> {
    let usage = || anyhow::anyhow!("--action {mapping:?} is not OWNER/NAME@REF=DIR");
    let (action, dir) = mapping.split_once('=').ok_or_else(usage)?;
    let (name, git_ref) = action.split_once('@').ok_or_else(usage)?;
    let parts: Vec<&str> = name.split('/').collect();
    if parts.len() != 2 || parts.iter().any(|p| p.is_empty()) || git_ref.is_empty() || dir.is_empty() {
        return Err(usage());
    }
    let dir = PathBuf::from(dir);
    if !dir.is_dir() {
        anyhow::bail!("--action {mapping}: {} is not a directory", dir.display());
    }
    Ok((name.to_owned(), git_ref.to_owned(), dir))
}

impl Inputs {
    /// The task of `job` as Gitea hands it to a runner: its context, its needs' results
    /// and outputs, the secrets and variables, a job token of its own.
    ///
    /// # Errors
    /// When the system offers no randomness for the job token.
    pub fn task(&self, job: &Job, needs: BTreeMap<String, TaskNeed>) -> anyhow::Result<Task> {
        let context = task::context(&self.run, &job.planned.key);
        let token = controller::assignment::capability::random_token().map_err(|_| anyhow::anyhow!("the system offers no randomness for the job token"))?;
        Ok(task::task(job.task_id, job.planned.payload.clone(), context, needs, self.secrets.clone(), self.vars.clone(), &token))
    }
}

/// What the jobs' Gitea would serve: the repository's snapshot and the mapped actions.
#[derive(Debug)]
pub struct Served {
    /// Kept while the run lasts: their git directories are what is served.
    _snapshots: Vec<repository::Snapshot>,
    /// OWNER/NAME → its git directory.
    pub git_dirs: BTreeMap<String, PathBuf>,
    /// Where unmapped actions are sent on to, once an action is mapped.
    pub elsewhere: Option<String>,
}

impl Served {
    /// Takes the snapshots of the work tree (at `--commit`) and of each `--action`, and
    /// tells `run` which commit and branch the jobs see.
    ///
    /// # Errors
    /// A snapshot that cannot be taken, or a mapping that is refused.
    pub async fn take(args: &RunLocalArgs, plan: &Plan, run: &mut task::RunContext) -> anyhow::Result<Served> {
        let mut snapshots = Vec::new();
        let mut git_dirs = BTreeMap::new();
        match &plan.root {
            Some(root) => {
                let snapshot = repository::Snapshot::take(root, args.commit.as_deref()).await?;
                let served = &snapshot.served;
                eprintln!(
                    "run-local: serving {} as {} ({} on {})",
                    root.display(),
                    plan.repository,
                    if args.commit.is_some() { served.sha.clone() } else { format!("the working tree, {}", &served.sha[..12]) },
                    served.branch
                );
                run.served(served);
                git_dirs.insert(plan.repository.clone(), snapshot.git_dir().to_path_buf());
                snapshots.push(snapshot);
            }
            None if args.commit.is_some() => anyhow::bail!("--commit: {} is not in a git repository", args.workflow.display()),
            None => eprintln!("run-local: {} is not in a git repository: no repository is served to the jobs", args.workflow.display()),
        }
        let mut mapped = false;
        for (name, refs) in action_mappings(&args.actions)? {
            let action = repository::Snapshot::of_directories(&refs).await.with_context(|| format!("--action {name}"))?;
            if git_dirs.insert(name.clone(), action.git_dir().to_path_buf()).is_some() {
                anyhow::bail!("--action {name}: {name} is the repository the jobs run for (--repository)");
            }
            for (git_ref, dir) in &refs {
                eprintln!("run-local: serving {} as the action {name}@{git_ref}", dir.display());
            }
            snapshots.push(action);
            mapped = true;
        }
        Ok(Served { _snapshots: snapshots, git_dirs, elsewhere: mapped.then(|| args.actions_url.clone()) })
    }

    /// The actions URL the jobs get: where the host serves them once one is mapped,
    /// else `--actions-url`.
    pub fn actions_url(&self, args: &RunLocalArgs, served_url: Option<&String>) -> String {
        match (served_url, &self.elsewhere) {
            (Some(url), Some(_)) => url.clone(),
            _ => args.actions_url.clone(),
        }
    }
}
