//! The loopback RunnerService as gitea-runner sees it (reference §3.5), driven by a
//! Connect client that plays gitea-runner with the credential from the `.runner` file
//! (the real gitea-runner is not installable on these machines); the facade side is a
//! recording upstream.

#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use connect::{CallOptions, Client, Code, ConnectError};
use http::{HeaderName, HeaderValue};
use proto::runner::v1::{
    DeclareRequest, DeclareResponse, FetchTaskRequest, FetchTaskResponse, LogRow, RegisterRequest, RegisterResponse, Result as TaskResult, Task,
    TaskState, UpdateLogRequest, UpdateLogResponse, UpdateTaskRequest, UpdateTaskResponse,
};
use supervisor::loopback::{self, LocalRunner, Upstream};
use tokio_util::sync::CancellationToken;

#[derive(Default)]
struct Recording {
    tasks: Mutex<Vec<UpdateTaskRequest>>,
    logs: Mutex<Vec<UpdateLogRequest>>,
}

#[async_trait]
impl Upstream for Recording {
    async fn update_task(&self, request: UpdateTaskRequest) -> Result<UpdateTaskResponse, ConnectError> {
        let id = request.state.as_ref().map_or(0, |s| s.id);
        self.tasks.lock().unwrap().push(request);
        if id == 999 {
            return Err(ConnectError::permission_denied("gitea-task-7 may only report task 7, not 999"));
        }
        // The controller's reply: Gitea cancelled the task.
        Ok(UpdateTaskResponse { state: Some(TaskState { id, result: TaskResult::Cancelled as i32, ..Default::default() }), sent_outputs: vec!["a".into()] })
    }

    async fn update_log(&self, request: UpdateLogRequest) -> Result<UpdateLogResponse, ConnectError> {
        let ack = request.index + request.rows.len() as i64;
        self.logs.lock().unwrap().push(request);
        Ok(UpdateLogResponse { ack_index: ack })
    }
}

fn runner_client(address: &str, uuid: &str, token: &str) -> Client {
    Client::new(&format!("{address}/api/actions"), proto::descriptor_pool().clone())
        .unwrap()
        .with_header(HeaderName::from_static("x-runner-uuid"), HeaderValue::from_str(uuid).unwrap())
        .with_header(HeaderName::from_static("x-runner-token"), HeaderValue::from_str(token).unwrap())
}

#[tokio::test]
async fn gitea_runner_gets_its_task_once_and_reports_through_the_facade() {
    let runner = LocalRunner::new("gitea-task-7", vec!["self-hosted".into(), "container".into(), "docker".into()]).unwrap();
    let task = Task { id: 7, workflow_payload: Some(b"jobs: {}".to_vec()), context: Some(Default::default()), ..Default::default() };
    let upstream = Arc::new(Recording::default());
    let shutdown = CancellationToken::new();
    let (address, server) = loopback::start(loopback::router(runner.clone(), task.clone(), Arc::clone(&upstream) as Arc<dyn Upstream>), shutdown.clone())
        .await
        .unwrap();
    assert!(address.ip().is_loopback());

    // What gitea-runner reads: the .runner file.
    let file: serde_json::Value = serde_json::from_slice(&runner.runner_file(&format!("http://{address}"))).unwrap();
    let base = file["address"].as_str().unwrap().to_owned();
    let client = runner_client(&base, file["uuid"].as_str().unwrap(), file["token"].as_str().unwrap());
    let call = CallOptions::default();
    const S: &str = "runner.v1.RunnerService/";

    let declared: DeclareResponse = client
        .unary(&format!("{S}Declare"), &DeclareRequest { version: "v3".into(), labels: vec!["self-hosted".into()], capabilities: vec!["cancelling".into()] }, &call)
        .await
        .unwrap()
        .message;
    assert_eq!(declared.runner.unwrap().uuid, "gitea-task-7");
    // No capabilities header: job-summary upload stays off.
    let fetched: FetchTaskResponse = client.unary(&format!("{S}FetchTask"), &FetchTaskRequest { tasks_version: 0 }, &call).await.unwrap().message;
    assert_eq!(fetched.task, Some(task));
    assert!(fetched.tasks_version >= 1);
    let again: FetchTaskResponse = client.unary(&format!("{S}FetchTask"), &FetchTaskRequest { tasks_version: fetched.tasks_version }, &call).await.unwrap().message;
    assert_eq!(again.task, None, "the task was handed out twice");

    let log = UpdateLogRequest { task_id: 7, index: 0, rows: vec![LogRow { time: None, content: "hello".into() }], no_more: false };
    let ack: UpdateLogResponse = client.unary(&format!("{S}UpdateLog"), &log, &call).await.unwrap().message;
    assert_eq!(ack.ack_index, 1);
    assert_eq!(upstream.logs.lock().unwrap().as_slice(), [log]);
    let state = UpdateTaskRequest { state: Some(TaskState { id: 7, ..Default::default() }), outputs: Default::default() };
    let reply: UpdateTaskResponse = client.unary(&format!("{S}UpdateTask"), &state, &call).await.unwrap().message;
    assert_eq!(reply.state.unwrap().result, TaskResult::Cancelled as i32, "the cancellation did not come back unchanged");
    assert_eq!(reply.sent_outputs, ["a"]);
    // The facade's refusal reaches gitea-runner with its code.
    let foreign = UpdateTaskRequest { state: Some(TaskState { id: 999, ..Default::default() }), outputs: Default::default() };
    let error = client.unary::<_, UpdateTaskResponse>(&format!("{S}UpdateTask"), &foreign, &call).await.unwrap_err();
    assert_eq!(error.code, Code::PermissionDenied);

    // Anyone without the local credential is an unregistered runner; Register is refused.
    let stranger = runner_client(&base, "gitea-task-7", "not-the-token");
    let error = stranger.unary::<_, FetchTaskResponse>(&format!("{S}FetchTask"), &FetchTaskRequest::default(), &call).await.unwrap_err();
    assert_eq!((error.code, error.message.as_str()), (Code::Unauthenticated, "unregistered runner"));
    let error = client.unary::<_, RegisterResponse>(&format!("{S}Register"), &RegisterRequest::default(), &call).await.unwrap_err();
    assert_eq!(error.code, Code::PermissionDenied);
    assert_eq!(upstream.tasks.lock().unwrap().len(), 2);

    shutdown.cancel();
    server.await.unwrap().unwrap();
}
