//! A fake Gitea: a Connect server that follows shared/reference/gitea-runner-protocol.md
//! — Register with a registration token, `x-runner-uuid`/`x-runner-token` on every
//! other call (401 `unregistered runner` otherwise), Declare, FetchTask with
//! tasks_version semantics and the labels ⊆ rule, UpdateTask (cancellation through
//! the reply), UpdateLog (ack/no_more, gaps and duplicates not written) — and counts
//! everything so tests can assert "executed exactly once, none lost".

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
    time::Duration,
};

use connect::{ConnectError, Request, Response, Router};
use prost_types::{Struct, Value, value::Kind};
use proto::runner::v1::{
    DeclareRequest, DeclareResponse, FetchTaskRequest, FetchTaskResponse, RegisterRequest, RegisterResponse,
    Result as TaskResult, Runner, Task, UpdateLogRequest, UpdateLogResponse, UpdateTaskRequest, UpdateTaskResponse,
};
use tokio_util::sync::CancellationToken;

pub const REGISTRATION_TOKEN: &str = "fake-registration-token";

#[derive(Debug, Clone)]
pub struct Job {
    pub runs_on: Vec<String>,
    pub job_key: String,
    pub repository: String,
    pub steps: String,
}

impl Job {
    pub fn new(runs_on: &[&str]) -> Self {
        Job {
            runs_on: runs_on.iter().map(|s| (*s).to_owned()).collect(),
            job_key: "build".into(),
            repository: "owner/repo".into(),
            steps: "      - run: echo hello\n".into(),
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
    pub updates: usize,
    pub log: Vec<String>,
    pub sealed: bool,
    pub cancelled: bool,
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
    pub next_task_id: i64,
    /// FetchTask answers `unavailable` this many more times (outage simulation).
    pub fail_fetches: usize,
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

    pub fn cancel(&self, task_id: i64) {
        self.state.lock().unwrap().tasks.entry(task_id).or_default().cancelled = true;
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

fn authenticate<M>(state: &State, request: &Request<M>) -> Result<String, ConnectError> {
    let header = |name: &str| request.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let (uuid, token) = (header("x-runner-uuid"), header("x-runner-token"));
    match state.runners.get(&uuid) {
        Some((expected, _)) if *expected == token => Ok(uuid),
        _ => Err(ConnectError::unauthenticated("unregistered runner")),
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
                    secrets: [("GITEA_TOKEN".to_owned(), "task-token".to_owned())].into_iter().collect(),
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
                let record = state.tasks.get_mut(&task_state.id).ok_or_else(|| ConnectError::new(connect::Code::NotFound, "task not found"))?;
                if record.runner_uuid != uuid {
                    return Err(ConnectError::permission_denied("invalid runner for task"));
                }
                record.updates += 1;
                if record.final_result.is_none() && task_state.result != TaskResult::Unspecified as i32 {
                    record.final_result = Some(if record.cancelled { TaskResult::Cancelled as i32 } else { task_state.result });
                }
                let result = record.final_result.unwrap_or(if record.cancelled { TaskResult::Cancelled as i32 } else { TaskResult::Unspecified as i32 });
                let mut sent: Vec<String> = request.message.outputs.into_keys().collect();
                sent.sort();
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
                authenticate(&state, &request)?;
                let m = request.message;
                let record = state.tasks.get_mut(&m.task_id).ok_or_else(|| ConnectError::new(connect::Code::NotFound, "task not found"))?;
                let ack = record.log.len() as i64;
                if !m.rows.is_empty() && m.index <= ack && m.index + m.rows.len() as i64 > ack {
                    if record.sealed {
                        return Err(ConnectError::new(connect::Code::AlreadyExists, "log file has been archived"));
                    }
                    let skip = (ack - m.index) as usize;
                    record.log.extend(m.rows[skip..].iter().map(|r| r.content.clone()));
                }
                if m.no_more {
                    record.sealed = true;
                }
                Ok(Response::new(UpdateLogResponse { ack_index: record.log.len() as i64 }))
            }
        })
}
