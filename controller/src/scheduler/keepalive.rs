//! Keep-alive: until an assignment is claimed, nobody reports on its task, and Gitea
//! stops a running task that was not updated for ZOMBIE_TASK_TIMEOUT (10 minutes).
//! So the controller sends a running UpdateTask for every pending assignment well
//! inside that; when Gitea answers that the task is done (cancelled while it waited),
//! the assignment is finished through the [`Lifecycle`].

use std::{sync::Arc, time::Duration};

use proto::runner::v1::{Result as TaskResult, TaskState, UpdateTaskRequest};
use tokio_util::sync::CancellationToken;

use crate::{
    assignment::envelope,
    gitea::registrations::Registrations,
    lifecycle::Lifecycle,
    store::{State, Store, StoreError},
};

/// A third of Gitea's default zombie timeout.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(200);

#[derive(Debug)]
pub struct KeepAlive {
    pub store: Arc<dyn Store>,
    pub registrations: Registrations,
    pub lifecycle: Lifecycle,
}

impl KeepAlive {
    /// A round every `interval` until `shutdown`.
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

    /// One heartbeat for an unclaimed assignment; true when Gitea had ended its task (and
    /// the assignment was finished).
    #[tracing::instrument(skip(self, id, runner), fields(assignment.id = %id))]
    async fn beat(&self, id: &str, runner: &str) -> bool {
        let Some(task_id) = envelope::task_id_of(id) else { return false };
        let reports = match self.registrations.reports_for(runner) {
            Ok(reports) => reports,
            Err(error) => {
                tracing::warn!(%error, "keep-alive: no reporter for the runner");
                return false;
            }
        };
        let request = UpdateTaskRequest {
            state: Some(TaskState { id: task_id, result: TaskResult::Unspecified as i32, ..Default::default() }),
            outputs: Default::default(),
        };
        let reply = match reports.update_task(&request).await {
            Ok(reply) => reply,
            Err(error) => {
                tracing::warn!(task_id, %error, "keep-alive UpdateTask failed");
                return false;
            }
        };
        let result = reply.state.map_or(0, |s| s.result);
        if result == TaskResult::Unspecified as i32 {
            return false;
        }
        tracing::info!(task_id, "Gitea ended the task before it was claimed");
        match self.lifecycle.finish(id, result).await {
            Ok(_) => {
                // Nothing of it ran, so no runner will report its end: Gitea ≥ 1.27 keeps a
                // cancelled task `cancelling` until one does (1.23 ignores this).
                if let Err(error) = crate::gitea::close_task(reports.as_ref(), task_id, result).await {
                    tracing::warn!(task_id, error = %crate::error_chain(&error), "cannot tell Gitea the end of the task");
                }
                true
            }
            Err(error) => {
                tracing::warn!(error = %crate::error_chain(&error), "cannot record the end of a task Gitea ended");
                false
            }
        }
    }

    /// One pass over the pending assignments; returns how many Gitea had ended.
    ///
    /// # Errors
    /// When the store cannot list.
    pub async fn round(&self) -> Result<usize, StoreError> {
        let mut ended = 0;
        for record in self.store.list().await? {
            if record.value.state == State::Pending && self.beat(&record.value.assignment_id, &record.value.runner).await {
                ended += 1;
            }
        }
        Ok(ended)
    }
}
