//! The run: the workflow's jobs through the controller's pipeline, in `needs` order,
//! independent jobs in parallel up to `--parallel`; the run's result is the exit code.
//! Ctrl-C cancels the run the way Gitea does (each runner is told in its next report
//! and cleans up); a second Ctrl-C removes the environments at once.

use std::collections::BTreeMap;

use proto::runner::v1::{Result as TaskResult, TaskNeed};
use tokio::{
    sync::{mpsc, watch},
    task::JoinSet,
};

use controller::pipeline::Cancel;

use crate::{
    cli::RunLocalArgs,
    host::Host,
    inputs::{Inputs, Served},
    planning::{Job, JobState, Plan, Planner, needs_of},
    reports, summary,
};

/// Runs `args` on a runtime of its own, Ctrl-C (SIGINT) and SIGTERM cancelling.
///
/// # Errors
/// See [`run`].
pub fn main(args: RunLocalArgs) -> anyhow::Result<u8> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let (interrupts, received) = mpsc::unbounded_channel();
        let signals = tokio::spawn(controller::signal::forward_interrupts(interrupts));
        let code = run(args, received).await;
        signals.abort();
        code
    })
}

/// Runs the workflow (or `--job`); returns the exit code: 0 when every job succeeded
/// or was skipped, 1 when one failed, 130 when the run was cancelled.
///
/// # Errors
/// When the workflow, its inputs or the Docker host cannot be used — before any
/// environment starts.
pub async fn run(args: RunLocalArgs, interrupts: mpsc::UnboundedReceiver<()>) -> anyhow::Result<u8> {
    let plan = Plan::read(&args).await?;
    if args.list {
        print!("{}", plan.list());
        return Ok(0);
    }
    let mut inputs = Inputs::read(&args, &plan.workflow, &plan.repository)?;
    let served = Served::take(&args, &plan, &mut inputs.run).await?;
    let host = Host::start(&args, &plan.jobs, plan.rules.clone(), &served).await?;
    inputs.run.actions_url = served.actions_url(&args, host.served_url.as_ref());
    let prefixed = plan.prefixed();
    let (jobs, planner) = plan.into_jobs();
    let mut schedule = Schedule::new(&host, jobs, planner, &inputs, args.parallel.max(1), prefixed);
    let outcome = schedule.run(interrupts).await;
    let jobs = schedule.jobs;
    host.stop(&jobs).await;
    Ok(match outcome {
        Outcome::Ended => {
            summary::summary(&jobs);
            summary::exit_code(summary::run_result(&jobs))
        }
        Outcome::GaveUp => crate::exit::CANCELLED,
    })
}

/// How the schedule ended.
enum Outcome {
    /// Every job ended (succeeded, failed, skipped or was cancelled).
    Ended,
    /// A second interrupt, or no job token could be made: the environments were removed.
    GaveUp,
}

/// Starts every job whose needs are done, up to `parallel` at once, until all ended.
struct Schedule<'a> {
    host: &'a Host,
    jobs: Vec<Job>,
    planner: Planner,
    inputs: &'a Inputs,
    parallel: usize,
    prefixed: bool,
    /// Jobs are told apart by task id: expanding a matrix moves the jobs after it.
    ended_tx: mpsc::UnboundedSender<(i64, reports::Ended)>,
    ended_rx: mpsc::UnboundedReceiver<(i64, reports::Ended)>,
    watchers: JoinSet<()>,
    cancelled: bool,
}

impl<'a> Schedule<'a> {
    fn new(host: &'a Host, jobs: Vec<Job>, planner: Planner, inputs: &'a Inputs, parallel: usize, prefixed: bool) -> Self {
        let (ended_tx, ended_rx) = mpsc::unbounded_channel();
        Schedule { host, jobs, planner, inputs, parallel, prefixed, ended_tx, ended_rx, watchers: JoinSet::new(), cancelled: false }
    }

    /// The first interrupt cancels the run (jobs not started are cancelled, running ones
    /// told); a second gives up at once.
    async fn run(&mut self, mut interrupts: mpsc::UnboundedReceiver<()>) -> Outcome {
        let outcome = loop {
            if let Err(error) = self.start_ready().await {
                eprintln!("run-local: {error}");
                break Outcome::GaveUp;
            }
            if self.jobs.iter().all(|j| j.ended().is_some()) {
                break Outcome::Ended;
            }
            tokio::select! {
                Some((task_id, ended)) = self.ended_rx.recv() => {
                    if let Some(job) = self.jobs.iter_mut().find(|j| j.task_id == task_id) {
                        job.end(ended);
                    }
                }
                Some(()) = interrupts.recv() => if self.interrupted().await {
                    break Outcome::GaveUp;
                }
            }
        };
        self.watchers.abort_all();
        while self.watchers.join_next().await.is_some() {}
        outcome
    }

    /// Expands the deferred jobs that can be, then starts, skips or cancels each job
    /// whose needs ended.
    async fn start_ready(&mut self) -> anyhow::Result<()> {
        if !self.cancelled {
            self.planner.expand_ready(&mut self.jobs, self.inputs);
        }
        for index in 0..self.jobs.len() {
            if !self.jobs[index].is_waiting() {
                continue;
            }
            if self.cancelled {
                self.jobs[index].end_as(TaskResult::Cancelled);
                continue;
            }
            let Some(needs) = needs_of(&self.jobs, index) else { continue };
            if !self.jobs[index].runs_after(&needs) {
                eprintln!("run-local: job {:?} skipped: a job it needs did not succeed", self.jobs[index].planned.name);
                self.jobs[index].end_as(TaskResult::Skipped);
                continue;
            }
            if self.jobs.iter().filter(|j| matches!(j.state, JobState::Running(_))).count() < self.parallel {
                self.start(index, needs).await?;
            }
        }
        Ok(())
    }

    /// Hands `jobs[index]` to the pipeline, watching for its end.
    async fn start(&mut self, index: usize, needs: BTreeMap<String, TaskNeed>) -> anyhow::Result<()> {
        let job = &self.jobs[index];
        let task = self.inputs.task(job, needs)?;
        let prefix = if self.prefixed { format!("[{}] ", job.planned.name) } else { String::new() };
        match self.host.submit(job, task, prefix).await {
            Ok((assignment, ended)) => {
                self.watch(job.task_id, ended);
                self.jobs[index].state = JobState::Running(assignment);
            }
            Err(error) => {
                eprintln!("run-local: job {:?} could not start: {error:#}", job.planned.name);
                self.jobs[index].end_as(TaskResult::Failure);
            }
        }
        Ok(())
    }

    fn watch(&mut self, task_id: i64, mut ended: watch::Receiver<Option<reports::Ended>>) {
        let sender = self.ended_tx.clone();
        self.watchers.spawn(async move {
            if let Ok(done) = ended.wait_for(Option::is_some).await
                && let Some(done) = done.clone()
            {
                let _ = sender.send((task_id, done));
            }
        });
    }

    /// Ctrl-C: the first cancels the run, a second removes the environments (`true`:
    /// give up now).
    async fn interrupted(&mut self) -> bool {
        if self.cancelled {
            eprintln!("run-local: removing the environments");
            for job in &self.jobs {
                self.host.give_up(job, Cancel::Remove).await;
            }
            return true;
        }
        self.cancelled = true;
        eprintln!("run-local: cancelling the run (Ctrl-C again to remove its environments now)");
        self.host.reports.cancel();
        for job in &self.jobs {
            self.host.give_up(job, Cancel::IfUnclaimed).await;
        }
        false
    }
}
