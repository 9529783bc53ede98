//! Gitea's side of the reports, for `controller run-local`: the job's log goes to the
//! terminal as it arrives, its final state is kept for the exit code, and Ctrl-C is
//! answered the way Gitea answers a cancelled task (a CANCELLED result in the reply to
//! the runner's next UpdateTask).

use std::{
    collections::BTreeSet,
    io::Write,
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use proto::runner::v1::{Result as TaskResult, StepState, TaskState, UpdateLogRequest, UpdateLogResponse, UpdateTaskRequest, UpdateTaskResponse};
use tokio::sync::watch;

use crate::gitea::{GiteaError, TaskReports};

/// The runner uuid of local tasks.
pub const RUNNER: &str = "run-local";

/// How the job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    pub result: i32,
    pub steps: Vec<StepState>,
}

pub struct LocalReports {
    out: Mutex<Box<dyn Write + Send>>,
    state: Mutex<State>,
    cancelled: AtomicBool,
    ended: watch::Sender<Option<Ended>>,
}

#[derive(Default)]
struct State {
    rows: i64,
    sealed: bool,
    outputs: BTreeSet<String>,
}

impl std::fmt::Debug for LocalReports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalReports").field("cancelled", &self.cancelled.load(Ordering::SeqCst)).finish_non_exhaustive()
    }
}

impl LocalReports {
    pub fn new(out: Box<dyn Write + Send>) -> Self {
        LocalReports { out: Mutex::new(out), state: Mutex::new(State::default()), cancelled: AtomicBool::new(false), ended: watch::channel(None).0 }
    }

    /// From now on the job is told it was cancelled.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    /// Resolves with the final state once the runner (or the controller) reported it.
    pub fn ended(&self) -> watch::Receiver<Option<Ended>> {
        self.ended.subscribe()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn print(&self, line: &str) {
        let mut out = self.out.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

#[async_trait::async_trait]
impl TaskReports for LocalReports {
    fn runner_uuid(&self) -> &str {
        RUNNER
    }

    async fn update_log(&self, request: &UpdateLogRequest) -> Result<UpdateLogResponse, GiteaError> {
        // Gitea's rules: rows are taken only at the acknowledged index, the rest ignored.
        let new_rows: Vec<String> = {
            let mut state = self.state();
            let ack = state.rows;
            let count = i64::try_from(request.rows.len()).unwrap_or(i64::MAX);
            if state.sealed || request.rows.is_empty() || request.index > ack || request.index + count <= ack {
                return Ok(UpdateLogResponse { ack_index: ack });
            }
            let skip = usize::try_from(ack - request.index).unwrap_or(0);
            let rows: Vec<String> = request.rows[skip..].iter().map(|r| r.content.clone()).collect();
            state.rows += i64::try_from(rows.len()).unwrap_or(i64::MAX);
            state.sealed = request.no_more;
            rows
        };
        for row in &new_rows {
            self.print(row);
        }
        Ok(UpdateLogResponse { ack_index: self.state().rows })
    }

    async fn update_task(&self, request: &UpdateTaskRequest) -> Result<UpdateTaskResponse, GiteaError> {
        let state = request.state.clone().unwrap_or_default();
        let sent_outputs: Vec<String> = {
            let mut local = self.state();
            local.outputs.extend(request.outputs.keys().cloned());
            local.outputs.iter().cloned().collect()
        };
        let already = self.ended.borrow().clone();
        let result = match already {
            Some(ended) => ended.result,
            None if state.result != TaskResult::Unspecified as i32 => {
                // Like Gitea: a task cancelled by the user stays cancelled.
                let result = if self.is_cancelled() { TaskResult::Cancelled as i32 } else { state.result };
                self.ended.send_replace(Some(Ended { result, steps: state.steps.clone() }));
                result
            }
            None if self.is_cancelled() => TaskResult::Cancelled as i32,
            None => TaskResult::Unspecified as i32,
        };
        Ok(UpdateTaskResponse { state: Some(TaskState { id: state.id, result, ..Default::default() }), sent_outputs })
    }
}

#[cfg(test)]
mod tests {
    use proto::runner::v1::LogRow;

    use super::*;

    #[derive(Clone, Default)]
    struct Captured(std::sync::Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn rows(lines: &[&str]) -> Vec<LogRow> {
        lines.iter().map(|l| LogRow { time: None, content: (*l).to_owned() }).collect()
    }

    #[tokio::test]
    async fn logs_follow_gitea_rules_and_cancellation_is_answered() {
        let out = Captured::default();
        let reports = LocalReports::new(Box::new(out.clone()));
        let ack = |index, lines: &[&str], no_more| UpdateLogRequest { task_id: 1, index, rows: rows(lines), no_more };
        assert_eq!(reports.update_log(&ack(0, &["a", "b"], false)).await.unwrap().ack_index, 2);
        assert_eq!(reports.update_log(&ack(1, &["b", "c"], false)).await.unwrap().ack_index, 3, "duplicates are skipped");
        assert_eq!(reports.update_log(&ack(5, &["gap"], false)).await.unwrap().ack_index, 3, "a gap is not written");
        assert_eq!(String::from_utf8(out.0.lock().unwrap().clone()).unwrap(), "a\nb\nc\n");

        let running = UpdateTaskRequest { state: Some(TaskState { id: 1, ..Default::default() }), outputs: [("k".into(), "v".into())].into() };
        let reply = reports.update_task(&running).await.unwrap();
        assert_eq!(reply.state.unwrap().result, TaskResult::Unspecified as i32);
        assert_eq!(reply.sent_outputs, ["k"]);
        reports.cancel();
        assert_eq!(reports.update_task(&running).await.unwrap().state.unwrap().result, TaskResult::Cancelled as i32);
        let success =
            UpdateTaskRequest { state: Some(TaskState { id: 1, result: TaskResult::Success as i32, ..Default::default() }), outputs: Default::default() };
        assert_eq!(reports.update_task(&success).await.unwrap().state.unwrap().result, TaskResult::Cancelled as i32);
        assert_eq!(reports.ended().borrow().as_ref().map(|e| e.result), Some(TaskResult::Cancelled as i32));
    }
}
