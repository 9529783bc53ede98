//! A started pipeline: [`Pipeline::start`] spawns the worker of every placement whose
//! worker runs in this process and the environments' facade sockets, and returns the
//! [`Running`] handle that `controller run` and run-local both hold. It owns the
//! components' tasks, so each is joined and the drain has one time limit whichever
//! program started them.

use std::{future::Future, sync::Arc, time::Duration};

use anyhow::Context;
use futures_util::future::BoxFuture;
use proto::runner::v1::{Result as TaskResult, Task};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{Pipeline, SubmitError};
use crate::{
    assignment::{Assignment, Placement},
    driver::Driver,
    placements::PlacementState,
};

/// Connects the driver of a placement whose backend did not answer at start; `None`
/// when it never will (shutdown, or nothing configures it).
pub type Connect = Arc<dyn Fn(Placement, CancellationToken) -> BoxFuture<'static, Option<Arc<dyn Driver>>> + Send + Sync>;

/// How long the lifecycle's in-flight reports may take once the components stopped.
const LIFECYCLE_DRAIN: Duration = Duration::from_secs(10);

/// How a job that nobody will report on any more is ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancel {
    /// Only while its environment has not claimed it; a claimed job is told in its
    /// runner's next report instead, as Gitea tells it.
    IfUnclaimed,
    /// Its environment is deleted at once, claimed or not.
    Remove,
}

/// The pipeline with its components running; see [`Pipeline::start`].
pub struct Running {
    pipeline: Pipeline,
    components: JoinSet<anyhow::Result<()>>,
    shutdown: CancellationToken,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running").field("components", &self.components.len()).finish_non_exhaustive()
    }
}

impl Pipeline {
    /// Starts the worker of each placement whose worker runs here — one whose driver is
    /// not connected yet through `connect` first — and the environments' facade sockets;
    /// they stop on `shutdown`.
    pub fn start(self, connect: Option<Connect>, shutdown: CancellationToken) -> Running {
        let mut running = Running { pipeline: self, components: JoinSet::new(), shutdown };
        let here: Vec<Arc<PlacementState>> = running.pipeline.placements().iter().filter(|served| served.worker_here()).cloned().collect();
        for served in here {
            running.start_worker(served, connect.clone());
        }
        if let Some(serving) = running.pipeline.serve_sockets(running.shutdown.clone()) {
            running.spawn("facade", serving);
        }
        running
    }
}

impl Running {
    pub fn pipeline(&self) -> &Pipeline {
        &self.pipeline
    }

    pub fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }

    /// Runs another component beside the pipeline's own, joined with them; its error
    /// names it and stops the others.
    pub fn spawn<E>(&mut self, component: &'static str, future: impl Future<Output = Result<(), E>> + Send + 'static)
    where
        E: Into<anyhow::Error>,
    {
        self.components.spawn(async move { future.await.map_err(Into::into).with_context(|| format!("{component} stopped")) });
    }

    fn start_worker(&mut self, served: Arc<PlacementState>, connect: Option<Connect>) {
        let (worker, shutdown) = (self.pipeline.worker_factory(), self.shutdown.clone());
        self.spawn("worker", async move {
            let driver = match (served.driver(), connect) {
                (Some(driver), _) => driver,
                (None, Some(connect)) => match connect(served.placement, shutdown.clone()).await {
                    Some(driver) => driver,
                    None => return Ok(()),
                },
                (None, None) => return Ok(()),
            };
            served.set_driver(Arc::clone(&driver));
            Arc::new(worker.make(&served, driver)).run(shutdown).await
        });
    }

    /// Hands `task` in as a task fetched by `runner` is; see [`Pipeline::submit`].
    ///
    /// # Errors
    /// When the task names no placement of the rules, or the store refuses it.
    pub async fn submit(&self, task: Task, runner: &str) -> Result<Assignment, SubmitError> {
        self.pipeline.submit(task, runner).await
    }

    /// Ends `assignment` as cancelled where `how` allows; whether it applied (`false`:
    /// claimed, and `how` leaves claimed jobs to their runner).
    pub async fn cancel(&self, assignment: &Assignment, how: Cancel) -> bool {
        match how {
            Cancel::Remove => {
                if let Err(error) = self.pipeline.remove(assignment).await {
                    tracing::warn!(assignment = %assignment.id, error = %crate::error_chain(&error), "cannot delete the environment");
                }
            }
            Cancel::IfUnclaimed if !self.pipeline.unclaimed(&assignment.id).await => return false,
            Cancel::IfUnclaimed => {}
        }
        if let Err(error) = self.pipeline.lifecycle().finish(&assignment.id, TaskResult::Cancelled as i32).await {
            tracing::warn!(assignment = %assignment.id, error = %crate::error_chain(&error), "cannot record the cancellation");
        }
        true
    }

    /// Waits until the shutdown signal, or until a component fails (its error, the
    /// others told to stop), or until every component ended on its own.
    ///
    /// # Errors
    /// The first component's failure.
    pub async fn ended(&mut self) -> anyhow::Result<()> {
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => return Ok(()),
                joined = self.components.join_next() => match joined {
                    None => return Ok(()),
                    Some(Ok(Ok(()))) => {}
                    Some(Ok(Err(error))) => {
                        tracing::error!("component failed: {error:#}");
                        self.shutdown.cancel();
                        return Err(error);
                    }
                    Some(Err(error)) => tracing::error!(%error, "component panicked"),
                },
            }
        }
    }

    /// Stops every component, giving them `deadline` to end, then lets the lifecycle's
    /// in-flight reports finish.
    ///
    /// # Errors
    /// The first component that failed while stopping.
    pub async fn drain(mut self, deadline: Duration) -> anyhow::Result<()> {
        self.shutdown.cancel();
        let mut outcome = Ok(());
        let joined = tokio::time::timeout(deadline, async {
            while let Some(joined) = self.components.join_next().await {
                match joined {
                    Ok(Err(error)) => {
                        tracing::error!("component failed: {error:#}");
                        if outcome.is_ok() {
                            outcome = Err(error);
                        }
                    }
                    Ok(Ok(())) => {}
                    Err(error) => tracing::error!(%error, "component panicked"),
                }
            }
        })
        .await;
        if joined.is_err() {
            tracing::warn!(?deadline, "components did not stop in time; exiting");
            self.components.abort_all();
        }
        self.pipeline.lifecycle().drain(LIFECYCLE_DRAIN).await;
        outcome
    }
}
