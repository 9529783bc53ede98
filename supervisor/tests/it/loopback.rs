//! The loopback RunnerService as the runner sees it (docs/architecture.md, "The loopback"), the facade side
//! being a recording upstream that answers as Gitea does and the Gitea side of the
//! pass-through a small HTTP server of the test:
//!
//! - a scripted Connect client for the protocol's edges: the task re-served until the
//!   runner first reports on it, held back (inside the fetch deadline) for runners
//!   without hooks until dockerd is ready, a backlog far over the facade's limit sent
//!   on in pieces, refusals with their codes, the pass-through with bodies and headers
//!   unchanged and a clear 502 without a Gitea URL;
//! - the REAL gitea-runner v3.3.0 and act_runner v0.2.12 (built from upstream by the
//!   test peers) running a host-mode job against it: `$GITHUB_SERVER_URL` is the
//!   loopback, and `curl $GITHUB_SERVER_URL/api/v1/version` gets the Gitea side's answer.

#![allow(clippy::unwrap_used)]

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use async_trait::async_trait;
use bytes::Bytes;
use connect::{CallOptions, Client, Code, ConnectError};
use http::{HeaderName, HeaderValue};
use http_body_util::{BodyExt, Full};
use proto::runner::v1::{
    DeclareRequest, DeclareResponse, FetchTaskRequest, FetchTaskResponse, LogRow, RegisterRequest, RegisterResponse, Result as TaskResult, Task, TaskState,
    UpdateLogRequest, UpdateLogResponse, UpdateTaskRequest, UpdateTaskResponse,
};
use std::sync::atomic::AtomicBool;
use supervisor::agent::{
    config::RunnerHooks,
    loopback::{self, LocalRunner, Served, Upstream},
    proxy,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::common::PROCESS_MEMORY;

/// The facade as the runner experiences it: Gitea's ack and final-state rules.
#[derive(Default)]
struct Recording {
    tasks: Mutex<Vec<UpdateTaskRequest>>,
    logs: Mutex<Vec<UpdateLogRequest>>,
    rows: Mutex<Vec<String>>,
    cancelled: Mutex<bool>,
    first_report: Mutex<Option<Instant>>,
    /// UpdateLog pieces still accepted before the next one is refused as the facade's
    /// log rate does (None: every piece).
    log_pieces_before_refusal: Mutex<Option<usize>>,
}

impl Recording {
    fn reported(&self) {
        self.first_report.lock().unwrap().get_or_insert_with(Instant::now);
    }
}

#[async_trait]
impl Upstream for Recording {
    async fn update_task(&self, request: UpdateTaskRequest) -> Result<UpdateTaskResponse, ConnectError> {
        self.reported();
        let id = request.state.as_ref().map_or(0, |s| s.id);
        self.tasks.lock().unwrap().push(request.clone());
        if id == 999 {
            return Err(ConnectError::permission_denied("gitea-task-7 may only report task 7, not 999"));
        }
        let result = if *self.cancelled.lock().unwrap() { TaskResult::Cancelled as i32 } else { TaskResult::Unspecified as i32 };
        let sent = self.tasks.lock().unwrap().iter().flat_map(|t| t.outputs.keys().cloned()).collect();
        Ok(UpdateTaskResponse { state: Some(TaskState { id, result, ..Default::default() }), sent_outputs: sent })
    }

    async fn update_log(&self, request: UpdateLogRequest) -> Result<UpdateLogResponse, ConnectError> {
        self.reported();
        {
            let mut before_refusal = self.log_pieces_before_refusal.lock().unwrap();
            match before_refusal.as_mut() {
                Some(0) => {
                    *before_refusal = None;
                    return Err(ConnectError::new(Code::ResourceExhausted, "gitea-task-7 logs faster than 1 MiB/s; slow down"));
                }
                Some(left) => *left -= 1,
                None => {}
            }
        }
        let mut rows = self.rows.lock().unwrap();
        let ack = rows.len() as i64;
        if !request.rows.is_empty() && request.index <= ack && request.index + request.rows.len() as i64 > ack {
            rows.extend(request.rows[(ack - request.index) as usize..].iter().map(|r| r.content.clone()));
        }
        let ack = rows.len() as i64;
        self.logs.lock().unwrap().push(request);
        Ok(UpdateLogResponse { ack_index: ack })
    }
}

/// Gitea's side of the pass-through: answers `/api/v1/version`, and echoes what it got.
async fn gitea_side() -> (SocketAddr, Arc<Mutex<Vec<(String, http::HeaderMap, usize)>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let recorded = Arc::clone(&seen);
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let seen = Arc::clone(&recorded);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                    let seen = Arc::clone(&seen);
                    async move {
                        let (parts, body) = request.into_parts();
                        let body = body.collect().await.unwrap().to_bytes();
                        let target = parts.uri.path_and_query().unwrap().to_string();
                        seen.lock().unwrap().push((format!("{} {target}", parts.method), parts.headers.clone(), body.len()));
                        let answer = if target == "/api/v1/version" { r#"{"version":"1.23.8"}"#.to_owned() } else { format!("{} bytes", body.len()) };
                        let mut response = http::Response::new(Full::new(Bytes::from(answer)));
                        response.headers_mut().insert("x-from-gitea", HeaderValue::from_static("yes"));
                        Ok::<_, std::convert::Infallible>(response)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(hyper_util::rt::TokioIo::new(stream), service).await;
            });
        }
    });
    (address, seen)
}

struct Loopback {
    address: String,
    runner: LocalRunner,
    upstream: Arc<Recording>,
    ready: watch::Sender<bool>,
    shutdown: CancellationToken,
}

async fn loopback(task: Task, hooks: RunnerHooks, gitea: Option<&str>, steps_may_run: bool) -> Loopback {
    loopback_stopping(task, hooks, gitea, steps_may_run, Arc::default()).await
}

async fn loopback_stopping(task: Task, hooks: RunnerHooks, gitea: Option<&str>, steps_may_run: bool, stopping: Arc<AtomicBool>) -> Loopback {
    loopback_with(task, hooks, gitea, steps_may_run, stopping, "").await
}

async fn loopback_with(
    task: Task,
    hooks: RunnerHooks,
    gitea: Option<&str>,
    steps_may_run: bool,
    stopping: Arc<AtomicBool>,
    gitea_capabilities: &str,
) -> Loopback {
    let runner = LocalRunner::new("gitea-task-7", vec!["disposable".into(), "container".into(), "docker".into()]).unwrap();
    let upstream = Arc::new(Recording::default());
    let (ready, steps) = watch::channel(steps_may_run);
    let served = Served {
        runner: runner.clone(),
        task,
        gitea_capabilities: gitea_capabilities.to_owned(),
        upstream: Arc::clone(&upstream) as Arc<dyn Upstream>,
        hooks,
        steps_may_run: steps,
        stopping,
    };
    let shutdown = CancellationToken::new();
    let (address, _server) = loopback::start(loopback::router(served), proxy::fallback(gitea).unwrap(), shutdown.clone()).await.unwrap();
    assert!(address.ip().is_loopback());
    Loopback { address: format!("http://{address}"), runner, upstream, ready, shutdown }
}

fn runner_client(address: &str, uuid: &str, token: &str) -> Client {
    Client::new(&format!("{address}/api/actions"), proto::descriptor_pool().clone())
        .unwrap()
        .with_header(HeaderName::from_static("x-runner-uuid"), HeaderValue::from_str(uuid).unwrap())
        .with_header(HeaderName::from_static("x-runner-token"), HeaderValue::from_str(token).unwrap())
}

const S: &str = "runner.v1.RunnerService/";

fn task() -> Task {
    Task { id: 7, workflow_payload: Some(b"jobs: {}".to_vec()), context: Some(Default::default()), ..Default::default() }
}

async fn declare(client: &Client, version: &str) {
    let request = DeclareRequest { version: version.into(), labels: vec!["disposable".into()], capabilities: vec!["cancelling".into()] };
    let declared: DeclareResponse = client.unary(&format!("{S}Declare"), &request, &CallOptions::default()).await.unwrap().message;
    assert_eq!(declared.runner.unwrap().uuid, "gitea-task-7");
}

async fn fetch(client: &Client, timeout: Option<Duration>) -> FetchTaskResponse {
    let options = match timeout {
        Some(timeout) => CallOptions::default().with_timeout(timeout),
        None => CallOptions::default(),
    };
    client.unary(&format!("{S}FetchTask"), &FetchTaskRequest { tasks_version: 0 }, &options).await.unwrap().message
}

/// gitea-runner uploads step summaries only when its Declare reply names "job-summary"
/// (Gitea ≥ 1.27): the loopback answers what Gitea answered the controller, and nothing
/// where Gitea said nothing (1.23 has no summary route).
#[tokio::test]
async fn declare_answers_the_capabilities_gitea_gave() {
    for (capabilities, header) in [("job-summary", Some("job-summary")), ("", None)] {
        let lb = loopback_with(task(), RunnerHooks::JobStarted, None, true, Arc::default(), capabilities).await;
        let file: serde_json::Value = serde_json::from_slice(&lb.runner.runner_file(&lb.address)).unwrap();
        let client = runner_client(file["address"].as_str().unwrap(), file["uuid"].as_str().unwrap(), file["token"].as_str().unwrap());
        let request = DeclareRequest { version: "v3.3.0".into(), labels: vec!["disposable".into()], capabilities: vec!["cancelling".into()] };
        let declared = client.unary::<_, DeclareResponse>(&format!("{S}Declare"), &request, &CallOptions::default()).await.unwrap();
        assert_eq!(declared.headers.get(proto::CAPABILITIES_HEADER).map(|v| v.to_str().unwrap()), header, "{capabilities:?}");
        lb.shutdown.cancel();
    }
}

#[tokio::test]
async fn the_task_is_served_until_the_runner_reports_and_reports_reach_the_facade() {
    let lb = loopback(task(), RunnerHooks::JobStarted, None, false).await;
    // What the runner reads: the .runner file.
    let file: serde_json::Value = serde_json::from_slice(&lb.runner.runner_file(&lb.address)).unwrap();
    let client = runner_client(file["address"].as_str().unwrap(), file["uuid"].as_str().unwrap(), file["token"].as_str().unwrap());
    let call = CallOptions::default();
    declare(&client, "v3.3.0").await;
    // A runner with hooks gets the task at once, even before dockerd is ready; a lost
    // reply is answered by the task again until the runner reports.
    for _ in 0..2 {
        let fetched = fetch(&client, None).await;
        assert_eq!(fetched.task, Some(task()));
        assert!(fetched.tasks_version >= 1);
    }
    let log = UpdateLogRequest { task_id: 7, index: 0, rows: vec![LogRow { time: None, content: "hello".into() }], no_more: false };
    let ack: UpdateLogResponse = client.unary(&format!("{S}UpdateLog"), &log, &call).await.unwrap().message;
    assert_eq!(ack.ack_index, 1);
    assert_eq!(lb.upstream.logs.lock().unwrap().as_slice(), [log]);
    assert_eq!(fetch(&client, None).await.task, None, "the task was handed out after the runner reported on it");

    let state = UpdateTaskRequest { state: Some(TaskState { id: 7, ..Default::default() }), outputs: [("a".into(), "1".into())].into() };
    *lb.upstream.cancelled.lock().unwrap() = true;
    let reply: UpdateTaskResponse = client.unary(&format!("{S}UpdateTask"), &state, &call).await.unwrap().message;
    assert_eq!(reply.state.unwrap().result, TaskResult::Cancelled as i32, "the cancellation did not come back unchanged");
    assert_eq!(reply.sent_outputs, ["a"]);
    // The facade's refusal reaches the runner with its code.
    let foreign = UpdateTaskRequest { state: Some(TaskState { id: 999, ..Default::default() }), outputs: Default::default() };
    let error = client.unary::<_, UpdateTaskResponse>(&format!("{S}UpdateTask"), &foreign, &call).await.unwrap_err();
    assert_eq!(error.code, Code::PermissionDenied);

    // Anyone without the local credential is an unregistered runner; Register is refused.
    let stranger = runner_client(&lb.address, "gitea-task-7", "not-the-token");
    let error = stranger.unary::<_, FetchTaskResponse>(&format!("{S}FetchTask"), &FetchTaskRequest::default(), &call).await.unwrap_err();
    assert_eq!((error.code, error.message.as_str()), (Code::Unauthenticated, "unregistered runner"));
    let error = client.unary::<_, RegisterResponse>(&format!("{S}Register"), &RegisterRequest::default(), &call).await.unwrap_err();
    assert_eq!(error.code, Code::PermissionDenied);
    lb.shutdown.cancel();
}

/// A runner told to stop mid-job (the environment got SIGTERM: a Pod deleted, a node
/// drained, a container stopped) reports an end of its own — gitea-runner v3.3.0 says
/// `success` for the job its shutdown cancelled. Once stopping, the loopback passes its
/// rows and steps on but neither its result nor the log's end: the controller writes the
/// reason and the failure once the environment has ended. Before, both pass unchanged.
#[tokio::test]
async fn a_stopping_runners_own_end_is_not_passed_on() {
    let stopping = Arc::new(AtomicBool::new(false));
    let lb = loopback_stopping(task(), RunnerHooks::JobStarted, None, true, Arc::clone(&stopping)).await;
    let client = runner_client(&lb.address, &lb.runner.assignment_id, &lb.runner.token);
    let call = CallOptions::default();
    declare(&client, "v3.3.0").await;
    let ended = |index: i64| UpdateLogRequest { task_id: 7, index, rows: vec![LogRow { time: None, content: format!("row {index}") }], no_more: true };
    let success = UpdateTaskRequest {
        state: Some(TaskState { id: 7, result: TaskResult::Success as i32, stopped_at: Some(Default::default()), ..Default::default() }),
        outputs: Default::default(),
    };
    let _: UpdateLogResponse = client.unary(&format!("{S}UpdateLog"), &ended(0), &call).await.unwrap().message;
    let _: UpdateTaskResponse = client.unary(&format!("{S}UpdateTask"), &success, &call).await.unwrap().message;
    assert!(lb.upstream.logs.lock().unwrap()[0].no_more, "before a stop, the log's end passes");
    assert_eq!(lb.upstream.tasks.lock().unwrap()[0].state.as_ref().unwrap().result, TaskResult::Success as i32);

    stopping.store(true, std::sync::atomic::Ordering::SeqCst);
    let ack: UpdateLogResponse = client.unary(&format!("{S}UpdateLog"), &ended(1), &call).await.unwrap().message;
    assert_eq!(ack.ack_index, 2, "the rows still reach the facade");
    let _: UpdateTaskResponse = client.unary(&format!("{S}UpdateTask"), &success, &call).await.unwrap().message;
    let logs = lb.upstream.logs.lock().unwrap().clone();
    assert!(!logs[1].no_more, "the log stays open for the controller's reason");
    assert_eq!(logs[1].rows[0].content, "row 1");
    let tasks = lb.upstream.tasks.lock().unwrap().clone();
    let state = tasks[1].state.as_ref().unwrap();
    assert_eq!((state.id, state.result, state.stopped_at.is_some()), (7, TaskResult::Unspecified as i32, false), "the runner's own end passed on");
    lb.shutdown.cancel();
}

/// A runner without hooks (act_runner) gets the task only when steps may run: each
/// FetchTask is held just inside its deadline, then answered empty; readiness during a
/// hold answers it at once with the task.
#[tokio::test]
async fn a_runner_without_hooks_is_held_until_dockerd_is_ready() {
    let lb = loopback(task(), RunnerHooks::Auto, None, false).await;
    let client = runner_client(&lb.address, "gitea-task-7", &lb.runner.token);
    declare(&client, "v0.2.12").await;
    let started = Instant::now();
    let fetched = fetch(&client, Some(Duration::from_millis(1500))).await;
    let held = started.elapsed();
    assert_eq!(fetched.task, None);
    assert!(held >= Duration::from_millis(800) && held < Duration::from_millis(1500), "held {held:?}: inside the runner's deadline");

    let ready = lb.ready.clone();
    tokio::spawn(async move {
        // Ready once the fetch is held: a held fetch waits on a receiver of its own.
        testkit::wait_until("the fetch is held", Duration::from_secs(5), || ready.receiver_count() >= 2).await;
        ready.send(true).unwrap();
    });
    let started = Instant::now();
    let fetched = fetch(&client, Some(Duration::from_secs(5))).await;
    assert_eq!(fetched.task, Some(task()));
    assert!(started.elapsed() < Duration::from_secs(2), "the task waited {:?} after dockerd was ready", started.elapsed());
    lb.shutdown.cancel();
}

/// A backlog far over the facade's 4 MiB goes on in consecutive pieces under the limit;
/// the runner sees one acknowledgement of everything.
#[tokio::test]
async fn a_large_backlog_goes_to_the_facade_in_pieces() {
    // Megabytes through this process: not while the hostile-input test bounds its memory.
    let _memory = PROCESS_MEMORY.read().await;
    let lb = loopback(task(), RunnerHooks::JobStarted, None, true).await;
    let client = runner_client(&lb.address, "gitea-task-7", &lb.runner.token);
    let rows: Vec<LogRow> = (0..20_000).map(|i| LogRow { time: None, content: format!("{i:05} {}", "x".repeat(500)) }).collect();
    let backlog = UpdateLogRequest { task_id: 7, index: 0, rows, no_more: true };
    let ack: UpdateLogResponse = client.unary(&format!("{S}UpdateLog"), &backlog, &CallOptions::default()).await.unwrap().message;
    assert_eq!(ack.ack_index, 20_000);
    let logs = lb.upstream.logs.lock().unwrap().clone();
    assert!(logs.len() >= 5, "{} pieces", logs.len());
    use prost::Message as _;
    for (i, piece) in logs.iter().enumerate() {
        assert!(piece.encoded_len() <= loopback::MAX_PIECE_BYTES, "piece {i}: {} bytes", piece.encoded_len());
        assert_eq!(piece.no_more, i == logs.len() - 1);
    }
    assert_eq!(lb.upstream.rows.lock().unwrap().len(), 20_000);
    lb.shutdown.cancel();
}

/// A piece the facade refuses (its log rate) ends the call with what went through
/// acknowledged, so the runner sends only the rest again; a refusal of the first piece
/// is the runner's error.
#[tokio::test]
async fn a_refused_piece_keeps_the_pieces_before_it_acknowledged() {
    let _memory = PROCESS_MEMORY.read().await;
    let lb = loopback(task(), RunnerHooks::JobStarted, None, true).await;
    let client = runner_client(&lb.address, "gitea-task-7", &lb.runner.token);
    let rows: Vec<LogRow> = (0..20_000).map(|i| LogRow { time: None, content: format!("{i:05} {}", "x".repeat(500)) }).collect();
    let backlog = |from: i64| UpdateLogRequest { task_id: 7, index: from, rows: rows[usize::try_from(from).unwrap()..].to_vec(), no_more: true };
    *lb.upstream.log_pieces_before_refusal.lock().unwrap() = Some(2);
    let ack: UpdateLogResponse = client.unary(&format!("{S}UpdateLog"), &backlog(0), &CallOptions::default()).await.unwrap().message;
    let through = lb.upstream.rows.lock().unwrap().len() as i64;
    assert!(ack.ack_index > 0 && ack.ack_index < 20_000, "two pieces acknowledged, not {}", ack.ack_index);
    assert_eq!(ack.ack_index, through, "what went through, no more and no less");
    *lb.upstream.log_pieces_before_refusal.lock().unwrap() = Some(0);
    let refused = client.unary::<_, UpdateLogResponse>(&format!("{S}UpdateLog"), &backlog(ack.ack_index), &CallOptions::default()).await.unwrap_err();
    assert_eq!(refused.code, Code::ResourceExhausted, "{refused:?}");
    let rest: UpdateLogResponse = client.unary(&format!("{S}UpdateLog"), &backlog(ack.ack_index), &CallOptions::default()).await.unwrap().message;
    assert_eq!(rest.ack_index, 20_000);
    let sent: Vec<String> = lb.upstream.rows.lock().unwrap().clone();
    assert_eq!(sent, rows.iter().map(|r| r.content.clone()).collect::<Vec<_>>(), "every row once, in order");
    lb.shutdown.cancel();
}

#[tokio::test]
async fn every_other_path_goes_to_gitea_unchanged() {
    // Megabytes through this process: not while the hostile-input test bounds its memory.
    let _memory = PROCESS_MEMORY.read().await;
    let (gitea, seen) = gitea_side().await;
    let lb = loopback(task(), RunnerHooks::JobStarted, Some(&format!("http://{gitea}")), true).await;
    let http = connect::client::http_client::<Full<Bytes>>().unwrap();
    let body = Bytes::from(vec![b'z'; 3 << 20]);
    let request = http::Request::post(format!("{}/api/actions_pipeline/_apis/artifact?x=1", lb.address))
        .header("authorization", "Bearer job-token")
        .header("connection", "keep-alive")
        .body(Full::new(body.clone()))
        .unwrap();
    let response = http.request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-from-gitea"], "yes");
    let answer = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(answer, format!("{} bytes", 3 << 20));
    let get = http::Request::get(format!("{}/api/v1/version", lb.address)).body(Full::new(Bytes::new())).unwrap();
    let version = http.request(get).await.unwrap().into_body().collect().await.unwrap().to_bytes();
    assert_eq!(version, r#"{"version":"1.23.8"}"#);
    {
        let seen = seen.lock().unwrap();
        let (line, headers, length) = &seen[0];
        assert_eq!(line, "POST /api/actions_pipeline/_apis/artifact?x=1");
        assert_eq!(headers["authorization"], "Bearer job-token", "headers must pass unchanged");
        assert_eq!(headers["host"], gitea.to_string().as_str());
        assert!(!headers.contains_key("x-runner-token"), "nothing of a runner credential is added");
        assert_eq!(*length, 3 << 20);
    }
    lb.shutdown.cancel();

    // Without a Gitea URL: a 502 that says why.
    let lb = loopback(task(), RunnerHooks::JobStarted, None, true).await;
    let get = http::Request::get(format!("{}/api/v1/version", lb.address)).body(Full::new(Bytes::new())).unwrap();
    let response = http.request(get).await.unwrap();
    assert_eq!(response.status(), 502);
    let text = String::from_utf8(response.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    assert!(text.contains("CI_GITEA_URL"), "{text}");
    lb.shutdown.cancel();
}

const WORKFLOW: &str = r#"name: loopback
on: push
jobs:
  build:
    runs-on: [disposable, container, docker]
    steps:
      - run: echo "hello from $GITEA_ACTIONS_RUNNER_VERSION"
      - run: echo "server=$GITHUB_SERVER_URL"
      - run: curl -sS "$GITHUB_SERVER_URL/api/v1/version"
"#;

fn job_task() -> Task {
    let string = |s: &str| prost_types::Value { kind: Some(prost_types::value::Kind::StringValue(s.to_owned())) };
    let fields = [
        ("repository", "owner/repo"),
        ("repository_owner", "owner"),
        ("event_name", "push"),
        ("run_id", "1"),
        ("job", "1"),
        ("token", "job-token-0123456789"),
        ("sha", "0"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), string(v)))
    .collect();
    // Gitea always sends the job token as secrets; gitea-runner v3.3.0 writes into that
    // map and panics ("assignment to entry in nil map") on a task without secrets.
    let secrets = [("GITEA_TOKEN".to_owned(), "job-token-0123456789".to_owned()), ("GITHUB_TOKEN".to_owned(), "job-token-0123456789".to_owned())].into();
    Task { id: 7, workflow_payload: Some(WORKFLOW.as_bytes().to_vec()), context: Some(prost_types::Struct { fields }), secrets, ..Default::default() }
}

/// Runs the real runner (`daemon --once`) against the loopback in host mode.
async fn run_real_runner(binary: &str, hooks_ready_after: Option<Duration>) -> (Arc<Recording>, String, Vec<(String, http::HeaderMap, usize)>) {
    let (gitea, seen) = gitea_side().await;
    let lb = loopback(job_task(), RunnerHooks::Auto, Some(&format!("http://{gitea}")), hooks_ready_after.is_none()).await;
    let dir = crate::common::scratch();
    let d = dir.path();
    std::fs::write(d.join(".runner"), lb.runner.runner_file(&lb.address)).unwrap();
    let config = format!(
        "log:\n  level: info\nrunner:\n  file: {}/.runner\n  fetch_interval: 1s\n  fetch_timeout: 5s\ncache:\n  enabled: false\nhost:\n  workdir_parent: {}/work\n",
        d.display(),
        d.display()
    );
    std::fs::write(d.join("config.yaml"), config).unwrap();
    if let Some(after) = hooks_ready_after {
        let ready = lb.ready.clone();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            ready.send(true).unwrap();
        });
    }
    let mut command = tokio::process::Command::new(testkit::peer(binary));
    command.args(["daemon", "--once", "--config"]).arg(d.join("config.yaml")).current_dir(d).env("HOME", d).kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(120), command.output()).await.expect("the runner did not finish in 120 s").unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned() + &String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{binary}: {}\n{stderr}", output.status);
    lb.shutdown.cancel();
    let seen = seen.lock().unwrap().clone();
    (Arc::clone(&lb.upstream), lb.address.clone(), seen)
}

fn check_job(binary: &str, upstream: &Recording, address: &str, seen: &[(String, http::HeaderMap, usize)]) {
    let rows = upstream.rows.lock().unwrap().clone();
    let log = rows.join("\n");
    assert!(log.contains("hello from"), "{binary}: {log}");
    assert!(log.contains(&format!("server={address}")), "{binary}: GITHUB_SERVER_URL is not the loopback: {log}");
    assert!(log.contains(r#"{"version":"1.23.8"}"#), "{binary}: curl did not get Gitea's answer through the loopback: {log}");
    assert!(seen.iter().any(|(line, _, _)| line == "GET /api/v1/version"), "{seen:?}");
    let tasks = upstream.tasks.lock().unwrap();
    let last = tasks.last().unwrap().state.clone().unwrap();
    assert_eq!(last.result, TaskResult::Success as i32, "{binary}: {log}");
    assert!(last.stopped_at.is_some());
    assert!(upstream.logs.lock().unwrap().last().unwrap().no_more, "{binary}: the log was not closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_gitea_runner_runs_a_job_against_the_loopback() {
    let (upstream, address, seen) = run_real_runner("gitea-runner", None).await;
    check_job("gitea-runner", &upstream, &address, &seen);
}

/// act_runner has no hooks: it is held until "dockerd" is ready (here after 3 s), then
/// runs the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_act_runner_is_held_until_ready_then_runs_the_job() {
    let ready_at = Instant::now() + Duration::from_secs(3);
    let (upstream, address, seen) = run_real_runner("act_runner", Some(Duration::from_secs(3))).await;
    check_job("act_runner", &upstream, &address, &seen);
    let first = upstream.first_report.lock().unwrap().unwrap();
    assert!(first >= ready_at, "the runner reported on its job {:?} before dockerd was ready", ready_at - first);
}
