//! A fake Gitea, for fault injection only (outages, counts, cancellation at a chosen
//! moment): everything else is tested against the real Gitea (`testkit::gitea`). Where
//! tests rely on it, it answers as Gitea 1.23.8 does (routers/api/actions/runner):
//! - errors are gRPC status errors that connect-go sends as `unknown` (HTTP 500) with
//!   the text `rpc error: code = … desc = …` — the runner and the controller recognise
//!   "unregistered runner" in that form;
//! - FetchTask: tasks_version semantics and the labels ⊆ rule;
//! - UpdateTask: only the runner that fetched a task may report on it; outputs are
//!   stored on any call (first write wins) and `sent_outputs` lists every stored key;
//!   a final result is kept with its `stopped_at`; a done task does not change and the
//!   reply carries its result (CANCELLED after a cancel);
//! - UpdateLog: the same ownership rule; rows are taken only at the stored length, and
//!   an empty, gapped or duplicate request is answered with the length *before*
//!   `no_more` is looked at (so only a valid final request seals the log);
//! - it counts everything so tests can assert "executed exactly once, none lost".

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
    time::Duration,
};

use connect::{ConnectError, Request, Response, Router};
use prost_types::{Struct, Value, value::Kind};
use proto::runner::v1::{
    DeclareRequest, DeclareResponse, FetchTaskRequest, FetchTaskResponse, RegisterRequest, RegisterResponse, Result as TaskResult, Runner, Task,
    UpdateLogRequest, UpdateLogResponse, UpdateTaskRequest, UpdateTaskResponse,
};
use tokio_util::sync::CancellationToken;

pub const REGISTRATION_TOKEN: &str = "fake-registration-token";

#[derive(Debug, Clone)]
pub struct Job {
    pub runs_on: Vec<String>,
    pub job_key: String,
    pub repository: String,
    pub steps: String,
    /// Secrets beside `GITEA_TOKEN` (a task with many or large ones).
    pub secrets: Vec<(String, String)>,
    /// The event payload of the context (a large push or pull request).
    pub event: Option<String>,
}

impl Job {
    pub fn new(runs_on: &[&str]) -> Self {
        Job {
            runs_on: runs_on.iter().map(|s| (*s).to_owned()).collect(),
            job_key: "build".into(),
            repository: "owner/repo".into(),
            steps: "      - run: echo hello\n".into(),
            secrets: Vec::new(),
            event: None,
        }
    }

    pub fn workflow(&self) -> String {
        let labels = self.runs_on.iter().map(|l| format!("\"{l}\"")).collect::<Vec<_>>().join(", ");
        format!("name: ci\non: push\njobs:\n  {}:\n    runs-on: [{labels}]\n    steps:\n{}", self.job_key, self.steps)
    }
}

#[derive(Debug, Default)]
pub struct TaskRecord {
    pub job: Option<Job>,
    pub runner_uuid: String,
    pub final_result: Option<i32>,
    /// Seconds of the final state's `stopped_at` (0 when it carried none, as Gitea's
    /// epoch default would show).
    pub stopped_at: i64,
    pub updates: usize,
    pub log: Vec<String>,
    pub sealed: bool,
    pub cancelled: bool,
    pub outputs: BTreeMap<String, String>,
}

#[derive(Debug, Default)]
pub struct State {
    pub runners: HashMap<String, (String, Vec<String>)>, // uuid → (token, labels)
    pub registrations: usize,
    pub declares: usize,
    pub capabilities: Vec<String>,
    pub waiting: Vec<Job>,
    pub tasks: BTreeMap<i64, TaskRecord>,
    pub tasks_version: i64,
    pub fetches: usize,
    /// FetchTask calls on which a task was looked for (the runner's tasks_version was
    /// not the latest).
    pub picks: usize,
    pub next_task_id: i64,
    /// FetchTask answers `unavailable` this many more times (outage simulation).
    pub fail_fetches: usize,
    /// FetchTasks answered as a proxy's bare 401 would be (unauthenticated, without
    /// Gitea's "unregistered runner"), before any check of the runner.
    pub unauthorized_fetches: usize,
}

#[derive(Clone)]
pub struct FakeGitea {
    pub state: Arc<Mutex<State>>,
    pub addr: std::net::SocketAddr,
    shutdown: CancellationToken,
}

impl FakeGitea {
    pub async fn start() -> Self {
        let state = Arc::new(Mutex::new(State { next_task_id: 1000, ..Default::default() }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let router = Arc::new(router(Arc::clone(&state)));
        tokio::spawn(connect::serve(listener, router, shutdown.clone(), Duration::from_secs(1)));
        FakeGitea { state, addr, shutdown }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Queues a job; like Gitea, bumps tasks_version.
    pub fn add_job(&self, job: Job) {
        let mut state = self.state.lock().unwrap();
        state.waiting.push(job);
        state.tasks_version += 1;
    }

    /// Cancels a running task as Gitea 1.27's cancel does for a runner that declared
    /// `cancelling`: the task is `cancelling` (replies carry CANCELLED) until a final
    /// state arrives, whatever its result, and is then cancelled.
    pub fn cancel_as_1_27(&self, task_id: i64) {
        let mut state = self.state.lock().unwrap();
        state.tasks.entry(task_id).or_default().cancelled = true;
    }

    /// Cancels a running task as Gitea 1.23.8's cancel does: it is cancelled at once.
    pub fn cancel(&self, task_id: i64) {
        let mut state = self.state.lock().unwrap();
        let record = state.tasks.entry(task_id).or_default();
        record.cancelled = true;
        if record.final_result.is_none() {
            record.final_result = Some(TaskResult::Cancelled as i32);
        }
    }

    pub fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        f(&mut self.state.lock().unwrap())
    }
}

impl Drop for FakeGitea {
    fn drop(&mut self) {
        if Arc::strong_count(&self.state) <= 2 {
            self.shutdown.cancel();
        }
    }
}

/// An error as Gitea 1.23.8 sends a gRPC status through connect-go.
pub fn grpc_style(code: &str, message: &str) -> ConnectError {
    ConnectError::new(connect::Code::Unknown, format!("rpc error: code = {code} desc = {message}"))
}

fn authenticate<M>(state: &State, request: &Request<M>) -> Result<String, ConnectError> {
    let header = |name: &str| request.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let (uuid, token) = (header("x-runner-uuid"), header("x-runner-token"));
    match state.runners.get(&uuid) {
        Some((expected, _)) if *expected == token => Ok(uuid),
        _ => Err(grpc_style("Unauthenticated", "unregistered runner")),
    }
}

fn context(job: &Job) -> Struct {
    let string = |s: &str| Value { kind: Some(Kind::StringValue(s.to_owned())) };
    let owner = job.repository.split('/').next().unwrap_or("").to_owned();
    Struct {
        fields: [
            ("repository", string(&job.repository)),
            ("repository_owner", string(&owner)),
            ("job", string("42")),
            ("event_name", string("push")),
            ("server_url", string("http://gitea.invalid")),
            ("token", string("task-token")),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .chain(job.event.as_ref().map(|event| ("event".to_owned(), string(event))))
        .collect(),
    }
}

fn router(state: Arc<Mutex<State>>) -> Router {
    let s1 = Arc::clone(&state);
    let s2 = Arc::clone(&state);
    let s3 = Arc::clone(&state);
    let s4 = Arc::clone(&state);
    let s5 = Arc::clone(&state);
    Router::new(proto::descriptor_pool().clone())
        .with_prefix("/api/actions")
        .unary("runner.v1.RunnerService/Register", move |request: Request<RegisterRequest>| {
            let state = Arc::clone(&s1);
            async move {
                let mut state = state.lock().unwrap();
                if request.message.token != REGISTRATION_TOKEN {
                    return Err(ConnectError::new(connect::Code::Unknown, "runner registration token not found"));
                }
                state.registrations += 1;
                let uuid = format!("uuid-{}", state.registrations);
                let token = format!("token-{}", state.registrations);
                state.runners.insert(uuid.clone(), (token.clone(), request.message.labels.clone()));
                Ok(Response::new(RegisterResponse {
                    runner: Some(Runner {
                        id: state.registrations as i64,
                        uuid,
                        token,
                        name: request.message.name,
                        labels: request.message.labels,
                        ..Default::default()
                    }),
                }))
            }
        })
        .unary("runner.v1.RunnerService/Declare", move |request: Request<DeclareRequest>| {
            let state = Arc::clone(&s2);
            async move {
                let mut state = state.lock().unwrap();
                let uuid = authenticate(&state, &request)?;
                state.declares += 1;
                state.capabilities = request.message.capabilities.clone();
                if let Some(runner) = state.runners.get_mut(&uuid) {
                    runner.1 = request.message.labels.clone();
                }
                Ok(Response::new(DeclareResponse {
                    runner: Some(Runner { uuid, labels: request.message.labels, version: request.message.version, ..Default::default() }),
                }))
            }
        })
        .unary("runner.v1.RunnerService/FetchTask", move |request: Request<FetchTaskRequest>| {
            let state = Arc::clone(&s3);
            async move {
                let mut state = state.lock().unwrap();
                if state.unauthorized_fetches > 0 {
                    state.unauthorized_fetches -= 1;
                    return Err(ConnectError::new(connect::Code::Unauthenticated, "HTTP status 401 Unauthorized"));
                }
                let uuid = authenticate(&state, &request)?;
                state.fetches += 1;
                if state.fail_fetches > 0 {
                    state.fail_fetches -= 1;
                    return Err(ConnectError::unavailable("database is locked"));
                }
                if state.tasks_version == 0 {
                    state.tasks_version = 1;
                }
                let latest = state.tasks_version;
                if request.message.tasks_version == latest {
                    return Ok(Response::new(FetchTaskResponse { task: None, tasks_version: latest }));
                }
                state.picks += 1;
                let labels = state.runners.get(&uuid).map(|r| r.1.clone()).unwrap_or_default();
                let Some(index) = state.waiting.iter().position(|job| job.runs_on.iter().all(|l| labels.contains(l))) else {
                    return Ok(Response::new(FetchTaskResponse { task: None, tasks_version: latest }));
                };
                let job = state.waiting.remove(index);
                state.next_task_id += 1;
                let id = state.next_task_id;
                let task = Task {
                    id,
                    workflow_payload: Some(job.workflow().into_bytes()),
                    context: Some(context(&job)),
                    secrets: std::iter::once(("GITEA_TOKEN".to_owned(), "task-token".to_owned())).chain(job.secrets.iter().cloned()).collect(),
                    ..Default::default()
                };
                state.tasks.insert(id, TaskRecord { job: Some(job), runner_uuid: uuid, ..Default::default() });
                Ok(Response::new(FetchTaskResponse { task: Some(task), tasks_version: latest }))
            }
        })
        .unary("runner.v1.RunnerService/UpdateTask", move |request: Request<UpdateTaskRequest>| {
            let state = Arc::clone(&s4);
            async move {
                let mut state = state.lock().unwrap();
                let uuid = authenticate(&state, &request)?;
                let task_state = request.message.state.unwrap_or_default();
                let record = state.tasks.get_mut(&task_state.id).ok_or_else(|| grpc_style("Internal", "update task: task does not exist"))?;
                if record.runner_uuid != uuid {
                    return Err(grpc_style("Internal", "update task: invalid runner for task"));
                }
                record.updates += 1;
                if record.final_result.is_none() && task_state.result != TaskResult::Unspecified as i32 {
                    // Cancelling (1.27): any final state ends it as cancelled.
                    record.final_result = Some(if record.cancelled { TaskResult::Cancelled as i32 } else { task_state.result });
                    record.stopped_at = task_state.stopped_at.map_or(0, |t| t.seconds);
                }
                for (key, value) in request.message.outputs {
                    if key.len() <= 255 && value.len() <= 1 << 20 {
                        record.outputs.entry(key).or_insert(value);
                    }
                }
                let result = record.final_result.unwrap_or(if record.cancelled { TaskResult::Cancelled as i32 } else { TaskResult::Unspecified as i32 });
                let sent: Vec<String> = record.outputs.keys().cloned().collect();
                Ok(Response::new(UpdateTaskResponse {
                    state: Some(proto::runner::v1::TaskState { id: task_state.id, result, ..Default::default() }),
                    sent_outputs: sent,
                }))
            }
        })
        .unary("runner.v1.RunnerService/UpdateLog", move |request: Request<UpdateLogRequest>| {
            let state = Arc::clone(&s5);
            async move {
                let mut state = state.lock().unwrap();
                let uuid = authenticate(&state, &request)?;
                let m = request.message;
                let record = state.tasks.get_mut(&m.task_id).ok_or_else(|| grpc_style("Internal", "get task: task does not exist"))?;
                if record.runner_uuid != uuid {
                    return Err(grpc_style("Internal", "invalid runner for task"));
                }
                let ack = record.log.len() as i64;
                if m.rows.is_empty() || m.index > ack || m.index + m.rows.len() as i64 <= ack {
                    return Ok(Response::new(UpdateLogResponse { ack_index: ack }));
                }
                if record.sealed {
                    return Err(grpc_style("AlreadyExists", "log file has been archived"));
                }
                let skip = (ack - m.index) as usize;
                record.log.extend(m.rows[skip..].iter().map(|r| r.content.clone()));
                if m.no_more {
                    record.sealed = true;
                }
                Ok(Response::new(UpdateLogResponse { ack_index: record.log.len() as i64 }))
            }
        })
}
