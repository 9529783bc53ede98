//! Conformance against an independent Connect implementation: the official
//! connect-es (`@connectrpc/connect-node`), with code generated from our .proto files
//! by protoc-gen-es. Both directions, both codecs, the cases of
//! tests/conformance/README.md:
//!
//! - our client → their server (`tests/conformance/server.mjs`);
//! - their client (`tests/conformance/client.mjs`) → our server.
//!
//! The Node packages come from `scripts/install test-peers`; when they are missing
//! the tests fail and say so.

#![allow(clippy::unwrap_used)]

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    sync::OnceLock,
    time::{Duration, Instant},
};

use crate::common::*;
use connect::{CallOptions, Client, Code, Codec, ConnectError};
use http::{HeaderMap, HeaderValue};
use proto::{
    ping::v1::{PingRequest, PingResponse},
    runner::v1::{
        DeclareRequest, DeclareResponse, FetchTaskRequest, FetchTaskResponse, RegisterRequest, RegisterResponse, Result as TaskResult, Runner, RunnerStatus,
        TaskState, UpdateLogResponse, UpdateTaskRequest, UpdateTaskResponse,
    },
};
use tokio::io::{AsyncBufReadExt, BufReader};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn conformance_dir() -> PathBuf {
    repo_root().join("tests/conformance")
}

/// Generates the connect-es code for our protos once per test binary.
fn generated() -> &'static Path {
    static GENERATED: OnceLock<PathBuf> = OnceLock::new();
    GENERATED.get_or_init(|| {
        let dir = conformance_dir();
        assert!(
            dir.join("node_modules/@connectrpc/connect-node").exists(),
            "the Node conformance peer is not installed at {}: run scripts/install test-peers",
            dir.join("node_modules").display()
        );
        let out = dir.join("gen");
        let status = std::process::Command::new(dir.join("generate")).arg(&out).status().unwrap();
        assert!(status.success(), "tests/conformance/generate failed: {status}");
        out
    })
}

fn auth_headers(token: &'static str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert("x-runner-uuid", HeaderValue::from_static(UUID));
    headers.insert("x-runner-token", HeaderValue::from_static(token));
    headers
}

fn authed() -> CallOptions {
    CallOptions { headers: auth_headers(TOKEN), ..Default::default() }
}

fn expect_error(result: Result<impl std::fmt::Debug, ConnectError>, code: Code, message: &str) -> Result<(), String> {
    match result {
        Err(error) if error.code == code && error.message == message => Ok(()),
        other => Err(format!("expected {code} {message:?}, got {other:?}")),
    }
}

fn check<T: PartialEq + std::fmt::Debug>(what: &str, got: T, want: T) -> Result<(), String> {
    if got == want { Ok(()) } else { Err(format!("{what}: got {got:?}, want {want:?}")) }
}

/// One case of tests/conformance/README.md, run by our client.
async fn run_case(client: &Client, name: &str) -> Result<(), String> {
    const RUNNER: &str = "runner.v1.RunnerService/";
    let none = CallOptions::default();
    match name {
        "ping" => {
            let r = client
                .unary::<_, PingResponse>("ping.v1.PingService/Ping", &PingRequest { data: "conformance".into() }, &none)
                .await
                .map_err(|e| e.to_string())?;
            check("data", r.message.data.as_str(), "Hello, conformance!")
        }
        "register" => {
            let request = RegisterRequest {
                name: "runner-1".into(),
                token: REGISTRATION_TOKEN.into(),
                version: "v9".into(),
                labels: vec!["self-hosted".into(), "container".into()],
                ephemeral: true,
                capabilities: vec!["cancelling".into()],
                ..Default::default()
            };
            let r = client.unary::<_, RegisterResponse>(&format!("{RUNNER}Register"), &request, &none).await.map_err(|e| e.to_string())?;
            let want = Runner {
                id: 1,
                uuid: UUID.into(),
                token: TOKEN.into(),
                name: "runner-1".into(),
                version: "v9".into(),
                labels: vec!["self-hosted".into(), "container".into()],
                ephemeral: true,
                status: RunnerStatus::Idle as i32,
                ..Default::default()
            };
            check("runner", r.message.runner, Some(want))
        }
        "register-bad-token" => {
            let request = RegisterRequest { name: "runner-1".into(), token: "nope".into(), ..Default::default() };
            expect_error(
                client.unary::<_, RegisterResponse>(&format!("{RUNNER}Register"), &request, &none).await,
                Code::PermissionDenied,
                "runner registration token not found",
            )
        }
        "declare" => {
            let request = DeclareRequest { version: "v9".into(), labels: vec!["self-hosted".into()], capabilities: vec!["cancelling".into()] };
            let r = client.unary::<_, DeclareResponse>(&format!("{RUNNER}Declare"), &request, &authed()).await.map_err(|e| e.to_string())?;
            let runner = r.message.runner.ok_or("no runner")?;
            check("name", runner.name.as_str(), "conformance")?;
            check("version", runner.version.as_str(), "v9")?;
            check("labels", runner.labels, vec!["self-hosted".to_owned()])?;
            check("status", runner.status, RunnerStatus::Active as i32)
        }
        "fetch-task" => {
            let r = client
                .unary::<_, FetchTaskResponse>(&format!("{RUNNER}FetchTask"), &FetchTaskRequest { tasks_version: 0 }, &authed())
                .await
                .map_err(|e| e.to_string())?;
            check("tasks_version", r.message.tasks_version, 7)?;
            check("task", r.message.task, Some(fixture_task()))
        }
        "fetch-empty" => {
            let r = client
                .unary::<_, FetchTaskResponse>(&format!("{RUNNER}FetchTask"), &FetchTaskRequest { tasks_version: 7 }, &authed())
                .await
                .map_err(|e| e.to_string())?;
            check("response", r.message, FetchTaskResponse { task: None, tasks_version: 7 })
        }
        "update-task" => {
            let request = update_task_request();
            let r = client.unary::<_, UpdateTaskResponse>(&format!("{RUNNER}UpdateTask"), &request, &authed()).await.map_err(|e| e.to_string())?;
            check("state", r.message.state, request.state)?;
            check("sent_outputs", r.message.sent_outputs, vec!["a".to_owned(), "b".to_owned()])
        }
        "update-task-cancelled" => {
            let request = UpdateTaskRequest { state: Some(TaskState { id: 13, ..Default::default() }), ..Default::default() };
            let r = client.unary::<_, UpdateTaskResponse>(&format!("{RUNNER}UpdateTask"), &request, &authed()).await.map_err(|e| e.to_string())?;
            check("result", r.message.state.map(|s| s.result), Some(TaskResult::Cancelled as i32))
        }
        "update-log" => {
            let r = client.unary::<_, UpdateLogResponse>(&format!("{RUNNER}UpdateLog"), &update_log_request(), &authed()).await.map_err(|e| e.to_string())?;
            check("ack_index", r.message.ack_index, 7)
        }
        "unauthenticated" => {
            let options = CallOptions { headers: auth_headers("wrong"), ..Default::default() };
            let request = DeclareRequest { version: "v9".into(), ..Default::default() };
            expect_error(
                client.unary::<_, DeclareResponse>(&format!("{RUNNER}Declare"), &request, &options).await,
                Code::Unauthenticated,
                "unregistered runner",
            )
        }
        "deadline" => {
            let options = authed().with_timeout(Duration::from_millis(200));
            let started = Instant::now();
            let result = client.unary::<_, FetchTaskResponse>(&format!("{RUNNER}FetchTask"), &FetchTaskRequest { tasks_version: 99 }, &options).await;
            let elapsed = started.elapsed();
            match result {
                Err(error) if error.code == Code::DeadlineExceeded && elapsed < Duration::from_secs(2) => Ok(()),
                other => Err(format!("expected deadline_exceeded within 2 s, got {other:?} after {elapsed:?}")),
            }
        }
        other => Err(format!("unknown case {other}")),
    }
}

/// Written straight to stderr, past the test harness's output capture, so that a
/// normal `cargo test` run shows which cases ran against the independent peer.
fn report(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "conformance: {line}");
}

const CASES: [&str; 11] = [
    "ping",
    "register",
    "register-bad-token",
    "declare",
    "fetch-task",
    "fetch-empty",
    "update-task",
    "update-task-cancelled",
    "update-log",
    "unauthenticated",
    "deadline",
];

#[tokio::test]
async fn our_client_against_connect_node_server() {
    generated();
    let mut server = tokio::process::Command::new("node")
        .arg(conformance_dir().join("server.mjs"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("cannot start node: run scripts/install test-peers");
    let mut lines = BufReader::new(server.stdout.take().unwrap()).lines();
    let port = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(port) = line.strip_prefix("LISTENING ") {
                return port.trim().parse::<u16>().unwrap();
            }
        }
        panic!("server.mjs exited before listening");
    })
    .await
    .expect("server.mjs did not print LISTENING within 30 s");
    let base_url = format!("http://127.0.0.1:{port}/api/actions");

    let mut failures = Vec::new();
    for codec in [Codec::Proto, Codec::Json] {
        let client = Client::new(&base_url, proto::descriptor_pool().clone()).unwrap().with_codec(codec);
        for case in CASES {
            match run_case(&client, case).await {
                Ok(()) => report(&format!("ok {case} ({codec:?}) — Rust client → connect-node server")),
                Err(reason) => {
                    report(&format!("not ok {case} ({codec:?}) — Rust client → connect-node server: {reason}"));
                    failures.push(format!("{case} ({codec:?}): {reason}"));
                }
            }
        }
    }
    drop(server.stdin.take());
    let _ = tokio::time::timeout(Duration::from_secs(5), server.wait()).await;
    assert!(failures.is_empty(), "failed cases:\n{}", failures.join("\n"));
}

#[tokio::test]
async fn connect_node_client_against_our_server() {
    generated();
    let server = TestServer::start(fixture_router()).await;
    let mut failures = Vec::new();
    for codec in ["proto", "json"] {
        let output = tokio::process::Command::new("node")
            .arg(conformance_dir().join("client.mjs"))
            .arg(server.base_url())
            .arg(codec)
            .kill_on_drop(true)
            .output()
            .await
            .expect("cannot start node: run scripts/install test-peers");
        let stdout = String::from_utf8_lossy(&output.stdout);
        for line in stdout.lines() {
            report(&format!("{line} — connect-node client → Rust server"));
        }
        eprint!("{}", String::from_utf8_lossy(&output.stderr));
        if !output.status.success() {
            failures.push(format!("client.mjs {codec} exited with {}", output.status));
        }
        for case in CASES {
            if !stdout.lines().any(|l| l.starts_with(&format!("ok {case} ("))) {
                failures.push(format!("{case} ({codec}) did not pass"));
            }
        }
    }
    server.stop().await;
    assert!(failures.is_empty(), "failed:\n{}", failures.join("\n"));
}
