//! Gitea's side of the reports, for `controller run-local`: each job's log goes to the
//! terminal as it arrives (prefixed with the job's name when several run), its final
//! state and outputs are kept for the jobs that need it and the exit code, and Ctrl-C is
//! answered the way Gitea answers a cancelled task (a CANCELLED result in the reply to
//! the runner's next UpdateTask).

use std::{
    collections::{BTreeMap, HashMap},
    io::Write,
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use proto::runner::v1::{Result as TaskResult, StepState, TaskState, UpdateLogRequest, UpdateLogResponse, UpdateTaskRequest, UpdateTaskResponse};
use tokio::sync::watch;

use controller::gitea::{GiteaError, TaskReports};

/// The runner uuid of local tasks.
pub const RUNNER: &str = "run-local";

/// How a job ended.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ended {
    pub result: i32,
    pub steps: Vec<StepState>,
    pub outputs: BTreeMap<String, String>,
}

pub struct LocalReports {
    out: Mutex<Box<dyn Write + Send>>,
    jobs: Mutex<HashMap<i64, JobReport>>,
    cancelled: AtomicBool,
}

struct JobReport {
    /// Put before each log line (empty when one job runs).
    prefix: String,
    /// The jobs it needs, whose stand-ins the runner complains about.
    needs: Vec<String>,
    rows: i64,
    sealed: bool,
    outputs: BTreeMap<String, String>,
    ended: watch::Sender<Option<Ended>>,
}

impl std::fmt::Debug for LocalReports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalReports").field("cancelled", &self.cancelled.load(Ordering::SeqCst)).finish_non_exhaustive()
    }
}

impl LocalReports {
    pub fn new(out: Box<dyn Write + Send>) -> Self {
        LocalReports { out: Mutex::new(out), jobs: Mutex::new(HashMap::new()), cancelled: AtomicBool::new(false) }
    }

    /// Takes reports on `task_id`, a job that needs `needs`; the receiver resolves once it
    /// ended.
    pub fn register(&self, task_id: i64, prefix: String, needs: &[String]) -> watch::Receiver<Option<Ended>> {
        let (ended, receiver) = watch::channel(None);
        self.jobs().insert(task_id, JobReport { prefix, needs: needs.to_vec(), rows: 0, sealed: false, outputs: BTreeMap::new(), ended });
        receiver
    }

    /// Ends a task the runner will not report on (cancelled before it was claimed).
    pub fn end(&self, task_id: i64, result: TaskResult) {
        if let Some(job) = self.jobs().get(&task_id) {
            job.ended.send_if_modified(|ended| ended.is_none() && ended.replace(Ended { result: result as i32, ..Ended::default() }).is_none());
        }
    }

    /// From now on every job is told it was cancelled.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    fn jobs(&self) -> std::sync::MutexGuard<'_, HashMap<i64, JobReport>> {
        self.jobs.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn print(&self, prefix: &str, lines: &[String]) {
        let mut out = self.out.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for line in lines {
            let _ = writeln!(out, "{prefix}{line}");
        }
        let _ = out.flush();
    }
}

/// gitea-runner stands each needed job in with only its result and outputs, then logs for
/// each that it has no `runs-on` (act/runner/run_context.go, runsOnImage): an error line in
/// every dependent job's log that is about nothing the job did, so the terminal leaves it
/// out (the line stays in what Gitea would store; only its printing is skipped).
fn stand_in_noise(line: &str, needs: &[String]) -> bool {
    let Some((_, job)) = line.split_once("'runs-on' key not defined in ") else { return false };
    needs.iter().any(|need| job.trim_end().rsplit_once('/').is_some_and(|(_, name)| name == need))
}

#[async_trait::async_trait]
impl TaskReports for LocalReports {
    fn runner_uuid(&self) -> &str {
        RUNNER
    }

    async fn update_log(&self, request: &UpdateLogRequest) -> Result<UpdateLogResponse, GiteaError> {
        // Gitea's rules: rows are taken only at the acknowledged index, the rest ignored.
        let (prefix, new_rows, ack) = {
            let mut jobs = self.jobs();
            let Some(job) = jobs.get_mut(&request.task_id) else { return Ok(UpdateLogResponse { ack_index: 0 }) };
            let ack = job.rows;
            let count = i64::try_from(request.rows.len()).unwrap_or(i64::MAX);
            if job.sealed || request.rows.is_empty() || request.index > ack || request.index + count <= ack {
                return Ok(UpdateLogResponse { ack_index: ack });
            }
            let skip = usize::try_from(ack - request.index).unwrap_or(0);
            let rows: Vec<String> = request.rows[skip..].iter().map(|r| r.content.clone()).collect();
            job.rows += i64::try_from(rows.len()).unwrap_or(i64::MAX);
            let rows: Vec<String> = rows.into_iter().filter(|row| !stand_in_noise(row, &job.needs)).collect();
            job.sealed = request.no_more;
            (job.prefix.clone(), rows, job.rows)
        };
        self.print(&prefix, &new_rows);
        Ok(UpdateLogResponse { ack_index: ack })
    }

    async fn update_task(&self, request: &UpdateTaskRequest) -> Result<UpdateTaskResponse, GiteaError> {
        let state = request.state.clone().unwrap_or_default();
        let mut jobs = self.jobs();
        let Some(job) = jobs.get_mut(&state.id) else {
            return Ok(UpdateTaskResponse { state: Some(TaskState { id: state.id, ..Default::default() }), sent_outputs: Vec::new() });
        };
        // Like Gitea: an output once set keeps its first value.
        for (key, value) in &request.outputs {
            job.outputs.entry(key.clone()).or_insert_with(|| value.clone());
        }
        let sent_outputs = job.outputs.keys().cloned().collect();
        let already = job.ended.borrow().clone();
        let result = match already {
            Some(ended) => ended.result,
            None if state.result != TaskResult::Unspecified as i32 => {
                // Like Gitea: a task cancelled by the user stays cancelled.
                let result = if self.is_cancelled() { TaskResult::Cancelled as i32 } else { state.result };
                job.ended.send_replace(Some(Ended { result, steps: state.steps.clone(), outputs: job.outputs.clone() }));
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

    fn update(id: i64, result: TaskResult, outputs: &[(&str, &str)]) -> UpdateTaskRequest {
        UpdateTaskRequest {
            state: Some(TaskState { id, result: result as i32, ..Default::default() }),
            outputs: outputs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
        }
    }

    #[tokio::test]
    async fn logs_follow_gitea_rules_per_job_and_cancellation_is_answered() {
        let out = Captured::default();
        let reports = LocalReports::new(Box::new(out.clone()));
        let first = reports.register(1, "[build] ".into(), &[]);
        let second = reports.register(2, "[test] ".into(), &["build".to_owned()]);
        let log = |task_id, index, lines: &[&str], no_more| UpdateLogRequest { task_id, index, rows: rows(lines), no_more };
        assert_eq!(reports.update_log(&log(1, 0, &["a", "b"], false)).await.unwrap().ack_index, 2);
        assert_eq!(reports.update_log(&log(1, 1, &["b", "c"], false)).await.unwrap().ack_index, 3, "duplicates are skipped");
        assert_eq!(reports.update_log(&log(1, 5, &["gap"], false)).await.unwrap().ack_index, 3, "a gap is not written");
        assert_eq!(reports.update_log(&log(2, 0, &["x"], false)).await.unwrap().ack_index, 1, "each job has its own index");
        let noise = ["'runs-on' key not defined in pipeline/build", "'runs-on' key not defined in pipeline/test", "y"];
        assert_eq!(reports.update_log(&log(2, 1, &noise, false)).await.unwrap().ack_index, 4, "a hidden line is still acknowledged");
        assert_eq!(
            String::from_utf8(out.0.lock().unwrap().clone()).unwrap(),
            "[build] a\n[build] b\n[build] c\n[test] x\n[test] 'runs-on' key not defined in pipeline/test\n[test] y\n",
            "only the line about a needed job's stand-in is left out"
        );

        let reply = reports.update_task(&update(1, TaskResult::Unspecified, &[("k", "v")])).await.unwrap();
        assert_eq!(reply.state.unwrap().result, TaskResult::Unspecified as i32);
        assert_eq!(reply.sent_outputs, ["k"]);
        reports.update_task(&update(1, TaskResult::Success, &[("k", "changed"), ("j", "w")])).await.unwrap();
        let ended = first.borrow().clone().unwrap();
        assert_eq!((ended.result, ended.outputs["k"].as_str(), ended.outputs["j"].as_str()), (TaskResult::Success as i32, "v", "w"));

        reports.cancel();
        assert_eq!(reports.update_task(&update(2, TaskResult::Unspecified, &[])).await.unwrap().state.unwrap().result, TaskResult::Cancelled as i32);
        assert_eq!(reports.update_task(&update(2, TaskResult::Success, &[])).await.unwrap().state.unwrap().result, TaskResult::Cancelled as i32);
        assert_eq!(second.borrow().as_ref().map(|e| e.result), Some(TaskResult::Cancelled as i32));
        reports.end(2, TaskResult::Failure);
        assert_eq!(second.borrow().as_ref().map(|e| e.result), Some(TaskResult::Cancelled as i32), "an ended job keeps its result");
    }
}
