//! Keep-alive: until an assignment is claimed, nobody reports on its task, and Gitea
//! stops a running task that was not updated for ZOMBIE_TASK_TIMEOUT (10 minutes).
//! So the controller sends a running UpdateTask for every pending assignment well
//! inside that; if Gitea answers that the task was cancelled meanwhile, the
//! environment is deleted and the assignment finished.

use std::{collections::HashMap, sync::Arc, time::Duration};

use proto::runner::v1::{Result as TaskResult, TaskState, UpdateTaskRequest};
use tokio_util::sync::CancellationToken;

use crate::{
    driver::Driver,
    envelope,
    gitea::Gitea,
    pool::Pool,
    store::{State, Store, StoreError, now_ms},
};

/// A third of Gitea's default zombie timeout.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(200);

#[derive(Debug)]
pub struct KeepAlive {
    pub store: Arc<dyn Store>,
    pub gitea: Gitea,
    pub drivers: HashMap<String, Arc<dyn Driver>>,
    pub pools: HashMap<String, Arc<Pool>>,
}

impl KeepAlive {
    /// Runs the keep-alive round every `interval` and reconciliation every `reconcile`
    /// (often, so a dead environment fails its task promptly) until `shutdown`.
    pub async fn run(&self, interval: Duration, reconcile: Duration, shutdown: CancellationToken) {
        let mut last_round: Option<tokio::time::Instant> = None;
        loop {
            if last_round.is_none_or(|t| t.elapsed() >= interval) {
                if let Err(error) = self.round().await {
                    tracing::warn!(%error, "keep-alive round failed");
                }
                last_round = Some(tokio::time::Instant::now());
            }
            if let Err(error) = self.reconcile().await {
                tracing::warn!(%error, "reconciliation failed");
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(reconcile.min(interval)) => {}
            }
        }
    }

    /// Environments are the truth for what runs: deletes environments marked terminal
    /// and orphans without a live assignment, and fails in Gitea the tasks whose
    /// environment exited before the task ended. Returns how many environments it removed.
    ///
    /// # Errors
    /// When the store cannot be read.
    pub async fn reconcile(&self) -> Result<usize, StoreError> {
        let mut removed = 0;
        for (placement, driver) in &self.drivers {
            let selector = std::collections::BTreeMap::from([(crate::driver::LABEL_PLACEMENT.to_owned(), placement.clone())]);
            let environments = match driver.list(&selector).await {
                Ok(environments) => environments,
                Err(error) => {
                    tracing::warn!(%placement, %error, "cannot list environments");
                    continue;
                }
            };
            for environment in environments {
                let record = self.store.get(&environment.assignment_id).await?;
                let finished = record.as_ref().is_none_or(|r| matches!(r.value.state, State::Terminal { .. }));
                let delete = match environment.phase {
                    crate::driver::Phase::Terminal => true,
                    crate::driver::Phase::Running => finished,
                    crate::driver::Phase::Exited => {
                        if let Some(record) = record.filter(|_| !finished) {
                            self.environment_died(record, &environment.name).await?;
                        }
                        true
                    }
                };
                if delete {
                    match driver.delete(&environment.name).await {
                        Ok(()) => {
                            removed += 1;
                            if let Some(pool) = self.pools.get(placement) {
                                pool.release(&environment.assignment_id);
                            }
                            tracing::info!(environment = %environment.name, assignment_id = %environment.assignment_id, "environment deleted");
                        }
                        Err(error) => tracing::warn!(environment = %environment.name, %error, "cannot delete the environment"),
                    }
                }
            }
        }
        Ok(removed)
    }

    /// The environment ended on its own before its task did: fail the task, say why.
    async fn environment_died(&self, record: crate::store::Versioned<crate::store::Record>, name: &str) -> Result<(), StoreError> {
        let id = record.value.assignment_id.clone();
        let Some(task_id) = envelope::task_id_of(&id) else { return Ok(()) };
        let reason = format!("the job's environment {name} exited before the job finished; see the environment's logs");
        tracing::error!(assignment_id = %id, task_id, "{reason}");
        if let Err(error) = self.gitea.fail_task(task_id, &reason).await {
            tracing::error!(assignment_id = %id, task_id, %error, "cannot fail the task in Gitea");
            return Ok(());
        }
        let mut next = record.value.clone();
        next.state = State::Terminal { result: TaskResult::Failure.as_str_name().to_owned() };
        next.updated_at_ms = now_ms();
        match self.store.update(&next, record.revision).await {
            Ok(_) | Err(StoreError::Conflict { .. }) => Ok(()),
            Err(error) => Err(error),
        }
    }

    /// One pass over the pending assignments; returns how many were cancelled.
    ///
    /// # Errors
    /// When the store cannot list.
    pub async fn round(&self) -> Result<usize, StoreError> {
        let mut cancelled = 0;
        for record in self.store.list().await? {
            if record.value.state != State::Pending {
                continue;
            }
            let id = record.value.assignment_id.clone();
            let Some(task_id) = envelope::task_id_of(&id) else { continue };
            let request = UpdateTaskRequest {
                state: Some(TaskState { id: task_id, result: TaskResult::Unspecified as i32, ..Default::default() }),
                outputs: Default::default(),
            };
            let reply = match self.gitea.update_task(&request).await {
                Ok(reply) => reply,
                Err(error) => {
                    tracing::warn!(assignment_id = %id, task_id, %error, "keep-alive UpdateTask failed");
                    continue;
                }
            };
            let result = reply.state.map_or(0, |s| s.result);
            if result == TaskResult::Unspecified as i32 {
                continue;
            }
            // Gitea is done with the task (cancelled while it waited): clean up.
            let name = TaskResult::try_from(result).map_or("RESULT_UNKNOWN", |r| r.as_str_name()).to_owned();
            let mut next = record.value.clone();
            next.state = State::Terminal { result: name.clone() };
            next.updated_at_ms = now_ms();
            match self.store.update(&next, record.revision).await {
                Ok(_) => {}
                // Claimed meanwhile: the supervisor learns of the cancellation itself.
                Err(StoreError::Conflict { .. }) => continue,
                Err(error) => return Err(error),
            }
            if let (Some(driver), Some(environment)) = (self.drivers.get(&next.placement), &next.environment)
                && let Err(error) = driver.delete(environment).await
            {
                tracing::warn!(assignment_id = %id, %error, "cannot delete the environment of a cancelled task; the reconciler will");
            }
            if let Some(pool) = self.pools.get(&next.placement) {
                pool.release(&id);
            }
            tracing::info!(assignment_id = %id, task_id, result = %name, "task ended in Gitea before it was claimed");
            cancelled += 1;
        }
        Ok(cancelled)
    }
}
