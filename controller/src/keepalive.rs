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
    /// Runs a round every `interval` until `shutdown`.
    pub async fn run(&self, interval: Duration, shutdown: CancellationToken) {
        loop {
            if let Err(error) = self.round().await {
                tracing::warn!(%error, "keep-alive round failed");
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
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
