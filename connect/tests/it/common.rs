//! The conformance FIXTURE of tests/conformance/README.md, on the Rust side: the
//! same server semantics as tests/conformance/server.mjs, and the expected values
//! both clients check.

#![allow(dead_code, clippy::unwrap_used)]

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use connect::{ConnectError, Request, Response, Router};
use prost_types::{ListValue, Struct, Timestamp, Value, value::Kind};
use proto::{
    ping::v1::{PingRequest, PingResponse},
    runner::v1::{
        DeclareRequest, DeclareResponse, FetchTaskRequest, FetchTaskResponse, LogRow, RegisterRequest, RegisterResponse, Result as TaskResult, Runner,
        RunnerStatus, StepState, Task, TaskNeed, TaskState, UpdateLogRequest, UpdateLogResponse, UpdateTaskRequest, UpdateTaskResponse,
    },
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub const UUID: &str = "conformance-uuid";
pub const TOKEN: &str = "conformance-token";
pub const REGISTRATION_TOKEN: &str = "registration-token";
pub const WORKFLOW: &str = "name: ci\non: push\njobs:\n  build:\n    runs-on: [self-hosted, container, docker]\n    steps:\n      - run: echo héllo\n";

pub fn ts(rfc3339_seconds: i64, nanos: i32) -> Option<Timestamp> {
    Some(Timestamp { seconds: rfc3339_seconds, nanos })
}

/// 2026-11-29T08:00:00Z
pub const T0: i64 = 1_795_939_200;

fn value(kind: Kind) -> Value {
    Value { kind: Some(kind) }
}

fn string(s: &str) -> Value {
    value(Kind::StringValue(s.to_owned()))
}

pub fn fixture_task() -> Task {
    let event = Struct { fields: BTreeMap::from([("ref".to_owned(), string("refs/heads/main")), ("forced".to_owned(), value(Kind::BoolValue(false)))]) };
    let context = Struct {
        fields: BTreeMap::from([
            ("repository".to_owned(), string("owner/repo")),
            ("run_number".to_owned(), string("7")),
            ("run_attempt".to_owned(), value(Kind::NumberValue(1.0))),
            ("event".to_owned(), value(Kind::StructValue(event))),
            ("tags".to_owned(), value(Kind::ListValue(ListValue { values: vec![string("a"), value(Kind::NumberValue(2.5)), value(Kind::NullValue(0))] }))),
            ("token".to_owned(), string("")),
        ]),
    };
    Task {
        id: 9_007_199_254_740_993,
        workflow_payload: Some(WORKFLOW.as_bytes().to_vec()),
        context: Some(context),
        secrets: [("GITEA_TOKEN", "task-token"), ("EMPTY", "")].into_iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect(),
        needs: [("prep".to_owned(), TaskNeed { outputs: [("out".to_owned(), "x".to_owned())].into_iter().collect(), result: TaskResult::Success as i32 })]
            .into_iter()
            .collect(),
        vars: [("V".to_owned(), "1".to_owned())].into_iter().collect(),
        ..Default::default()
    }
}

pub fn update_task_request() -> UpdateTaskRequest {
    UpdateTaskRequest {
        state: Some(TaskState {
            id: 12,
            result: TaskResult::Success as i32,
            started_at: ts(T0, 500_000_000),
            stopped_at: ts(T0 + 62, 0),
            steps: vec![StepState {
                id: 0,
                result: TaskResult::Success as i32,
                started_at: ts(T0 + 1, 0),
                stopped_at: ts(T0 + 60, 0),
                log_index: 0,
                log_length: 3,
            }],
        }),
        outputs: [("b", "2"), ("a", "1")].into_iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect(),
    }
}

pub fn update_log_request() -> UpdateLogRequest {
    UpdateLogRequest {
        task_id: 12,
        index: 5,
        rows: vec![LogRow { time: ts(T0 + 2, 0), content: "line 1".into() }, LogRow { time: ts(T0 + 3, 0), content: String::new() }],
        no_more: true,
    }
}

fn authenticate<M>(request: &Request<M>) -> Result<(), ConnectError> {
    let header = |name: &str| request.headers.get(name).and_then(|v| v.to_str().ok());
    if header("x-runner-uuid") == Some(UUID) && header("x-runner-token") == Some(TOKEN) {
        Ok(())
    } else {
        Err(ConnectError::unauthenticated("unregistered runner"))
    }
}

/// The FIXTURE server, under `/api/actions` like Gitea.
pub fn fixture_router() -> Router {
    Router::new(proto::descriptor_pool().clone())
        .with_prefix("/api/actions")
        .unary("ping.v1.PingService/Ping", |request: Request<PingRequest>| async move {
            Ok(Response::new(PingResponse { data: format!("Hello, {}!", request.message.data) }))
        })
        .unary("runner.v1.RunnerService/Register", |request: Request<RegisterRequest>| async move {
            let m = request.message;
            if m.token != REGISTRATION_TOKEN {
                return Err(ConnectError::permission_denied("runner registration token not found"));
            }
            Ok(Response::new(RegisterResponse {
                runner: Some(Runner {
                    id: 1,
                    uuid: UUID.into(),
                    token: TOKEN.into(),
                    name: m.name,
                    version: m.version,
                    labels: m.labels,
                    ephemeral: m.ephemeral,
                    status: RunnerStatus::Idle as i32,
                    ..Default::default()
                }),
            }))
        })
        .unary("runner.v1.RunnerService/Declare", |request: Request<DeclareRequest>| async move {
            authenticate(&request)?;
            let m = request.message;
            Ok(Response::new(DeclareResponse {
                runner: Some(Runner {
                    id: 1,
                    uuid: UUID.into(),
                    name: "conformance".into(),
                    version: m.version,
                    labels: m.labels,
                    status: RunnerStatus::Active as i32,
                    ..Default::default()
                }),
            }))
        })
        .unary("runner.v1.RunnerService/FetchTask", |request: Request<FetchTaskRequest>| async move {
            authenticate(&request)?;
            let response = match request.message.tasks_version {
                0 => FetchTaskResponse { task: Some(fixture_task()), tasks_version: 7 },
                99 => {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    FetchTaskResponse { task: None, tasks_version: 99 }
                }
                other => FetchTaskResponse { task: None, tasks_version: other },
            };
            Ok(Response::new(response))
        })
        .unary("runner.v1.RunnerService/UpdateTask", |request: Request<UpdateTaskRequest>| async move {
            authenticate(&request)?;
            let m = request.message;
            let mut state = m.state.unwrap_or_default();
            if state.id == 13 {
                state.result = TaskResult::Cancelled as i32;
            }
            let mut sent_outputs: Vec<String> = m.outputs.into_keys().collect();
            sent_outputs.sort();
            Ok(Response::new(UpdateTaskResponse { state: Some(state), sent_outputs }))
        })
        .unary("runner.v1.RunnerService/UpdateLog", |request: Request<UpdateLogRequest>| async move {
            authenticate(&request)?;
            let m = request.message;
            Ok(Response::new(UpdateLogResponse { ack_index: m.index + m.rows.len() as i64 }))
        })
}

/// A running server on 127.0.0.1; dropped → shut down.
pub struct TestServer {
    pub addr: std::net::SocketAddr,
    shutdown: CancellationToken,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl TestServer {
    pub async fn start(router: Router) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(connect::serve(listener, Arc::new(router), shutdown.clone(), Duration::from_secs(2)));
        TestServer { addr, shutdown, task: Some(task) }
    }

    pub fn base_url(&self) -> String {
        format!("http://{}/api/actions", self.addr)
    }

    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            task.await.unwrap().unwrap();
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}
