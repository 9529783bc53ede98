//! Generated hostile input against the loopback RunnerService, the Connect server an
//! unmodified gitea-runner talks to: a seeded generator writes raw HTTP/1.1 requests of
//! six classes — broken framing, hostile headers, compression (truncated, bombs), mutated
//! protobuf bodies, mutated JSON bodies, and sizes at and over the request limit — and
//! every answer is checked: no panic, no hang, every refusal a proper Connect error (JSON
//! body with a known code and the matching HTTP status) or, for a request that is not
//! HTTP at all, the HTTP layer's own 4xx; memory stays bounded. Prints inputs tried and
//! outcomes by class.
//!
//! `GDR_FUZZ_REQUESTS` (default 100,000 here; `scripts/check fuzz` runs 1,000,000 in an optimised
//! build) and `GDR_FUZZ_SEED` (default: the clock, printed).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::BTreeMap,
    io::Write as _,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use async_trait::async_trait;
use connect::ConnectError;
use prost::Message as _;
use proto::runner::v1::{
    DeclareRequest, FetchTaskRequest, LogRow, Task, TaskState, UpdateLogRequest, UpdateLogResponse, UpdateTaskRequest, UpdateTaskResponse,
};
use supervisor::agent::{
    config::RunnerHooks,
    loopback::{self, LocalRunner, Served, Upstream},
    proxy,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::common::PROCESS_MEMORY;

/// The request limit for this run: the real one is 256 MiB, which a million requests
/// cannot probe; the limit is the same code with a smaller number.
const LIMIT: usize = 64 << 10;
const ANSWER_WITHIN: Duration = Duration::from_secs(10);
const CONCURRENCY: usize = 32;
const PROCEDURES: [&str; 5] = ["Declare", "FetchTask", "UpdateTask", "UpdateLog", "Register"];

/// Answers like Gitea, keeping nothing (a million requests must not grow memory here).
struct Sink;

#[async_trait]
impl Upstream for Sink {
    async fn update_task(&self, request: UpdateTaskRequest) -> Result<UpdateTaskResponse, ConnectError> {
        Ok(UpdateTaskResponse { state: Some(TaskState { id: request.state.map_or(0, |s| s.id), ..Default::default() }), sent_outputs: vec![] })
    }

    async fn update_log(&self, request: UpdateLogRequest) -> Result<UpdateLogResponse, ConnectError> {
        Ok(UpdateLogResponse { ack_index: request.index + request.rows.len() as i64 })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Class {
    Framing,
    Headers,
    Compression,
    Protobuf,
    Json,
    /// Valid requests of exactly the limit or just under it (plain or gzip): served.
    AtLimit,
    /// Valid requests just over the limit or far over it (plain or gzip-inflated): refused
    /// with resource_exhausted.
    OverLimit,
}

const CLASSES: [Class; 7] = [Class::Framing, Class::Headers, Class::Compression, Class::Protobuf, Class::Json, Class::AtLimit, Class::OverLimit];

/// A valid UpdateLog request of exactly `size` encoded bytes.
fn update_log_of_size(size: usize) -> Vec<u8> {
    let mut content = size.saturating_sub(16);
    loop {
        let row = LogRow { time: None, content: "x".repeat(content) };
        let body = UpdateLogRequest { task_id: 7, index: 0, rows: vec![row], no_more: false }.encode_to_vec();
        match body.len().cmp(&size) {
            std::cmp::Ordering::Equal => return body,
            std::cmp::Ordering::Greater => content -= 1,
            std::cmp::Ordering::Less => content += 1,
        }
    }
}

struct Generator {
    rng: fastrand::Rng,
    uuid: String,
    token: String,
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(bytes).unwrap();
    encoder.finish().unwrap()
}

impl Generator {
    fn valid_message(&mut self, procedure: &str) -> (Vec<u8>, String) {
        let rows = (0..self.rng.usize(0..5)).map(|i| LogRow { time: None, content: format!("row {i}") }).collect();
        match procedure {
            "Declare" => {
                let m = DeclareRequest { version: "v3.3.0".into(), labels: vec!["disposable".into()], capabilities: vec![] };
                (m.encode_to_vec(), r#"{"version":"v3.3.0","labels":["disposable"]}"#.into())
            }
            "FetchTask" => (FetchTaskRequest { tasks_version: self.rng.i64(0..100) }.encode_to_vec(), r#"{"tasksVersion":"3"}"#.into()),
            "UpdateTask" => (
                UpdateTaskRequest { state: Some(TaskState { id: 7, ..Default::default() }), outputs: Default::default() }.encode_to_vec(),
                r#"{"state":{"id":"7","result":"RESULT_UNSPECIFIED"}}"#.into(),
            ),
            _ => (
                UpdateLogRequest { task_id: 7, index: 0, rows, no_more: false }.encode_to_vec(),
                r#"{"taskId":"7","index":"0","rows":[{"content":"hello"}],"noMore":false}"#.into(),
            ),
        }
    }

    fn mutate(&mut self, bytes: Vec<u8>) -> Vec<u8> {
        testkit::mutate(&mut self.rng, bytes)
    }

    fn random_bytes(&mut self, max: usize) -> Vec<u8> {
        let n = self.rng.usize(0..max);
        (0..n).map(|_| self.rng.u8(..)).collect()
    }

    fn path(&mut self) -> String {
        format!("/api/actions/runner.v1.RunnerService/{}", PROCEDURES[self.rng.usize(..PROCEDURES.len())])
    }

    /// A request the way a client would write it, with `headers` after the auth.
    fn request(method: &str, path: &str, headers: &[(String, String)], body: &[u8], content_length: bool) -> Vec<u8> {
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
        if content_length {
            head.push_str(&format!("Content-Length: {}\r\n", body.len()));
        } else {
            head.push_str("Transfer-Encoding: chunked\r\n");
        }
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        let mut bytes = head.into_bytes();
        if content_length {
            bytes.extend_from_slice(body);
        } else {
            for chunk in body.chunks(8192) {
                bytes.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
                bytes.extend_from_slice(chunk);
                bytes.extend_from_slice(b"\r\n");
            }
            bytes.extend_from_slice(b"0\r\n\r\n");
        }
        bytes
    }

    fn auth(&self) -> Vec<(String, String)> {
        vec![("x-runner-uuid".into(), self.uuid.clone()), ("x-runner-token".into(), self.token.clone())]
    }

    fn generate(&mut self, class: Class) -> Vec<u8> {
        let path = self.path();
        let procedure = path.rsplit('/').next().unwrap().to_owned();
        let (proto_body, json_body) = self.valid_message(&procedure);
        let mut headers = self.auth();
        match class {
            Class::Framing => match self.rng.u8(0..7) {
                0 => self.random_bytes(512),
                1 => format!("POST {path} HTTP/9.9\r\nHost: x\r\n\r\n").into_bytes(),
                2 => format!("POST {path} HTTP/1.1\r\nHost: x\r\nbroken header line\r\n\r\n").into_bytes(),
                3 => {
                    // Declares more than it sends, then closes.
                    let mut bytes =
                        format!("POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: application/proto\r\nContent-Length: {}\r\n\r\n", proto_body.len() + 100)
                            .into_bytes();
                    bytes.extend_from_slice(&proto_body);
                    bytes
                }
                4 => format!("POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n").into_bytes(),
                5 => format!("POST {path} HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n", "a".repeat(self.rng.usize(1..200_000))).into_bytes(),
                _ => {
                    let valid = Self::request("POST", &path, &[("content-type".into(), "application/proto".into())], &proto_body, true);
                    self.mutate(valid)
                }
            },
            Class::Headers => {
                let content_types = [
                    "application/proto",
                    "application/json",
                    "application/grpc",
                    "text/plain",
                    "",
                    "application/proto; charset=utf-8",
                    "application/json; charset=utf-8",
                    "\u{1}",
                ];
                let content_type = content_types[self.rng.usize(..content_types.len())];
                if !content_type.is_empty() {
                    headers.push(("content-type".into(), content_type.into()));
                }
                let versions = ["1", "2", "", "one", "1 "];
                if self.rng.bool() {
                    headers.push(("connect-protocol-version".into(), versions[self.rng.usize(..versions.len())].into()));
                }
                let timeouts = ["0", "1", "1000", "-5", "99999999999", "abc", "10000000000000000000", "1.5"];
                if self.rng.bool() {
                    headers.push(("connect-timeout-ms".into(), timeouts[self.rng.usize(..timeouts.len())].into()));
                }
                if self.rng.bool() {
                    let encodings = ["identity", "br", "deflate", "zstd", "gzip, gzip"];
                    headers.push(("content-encoding".into(), encodings[self.rng.usize(..encodings.len())].into()));
                }
                match self.rng.u8(0..4) {
                    0 => headers.retain(|(n, _)| n != "x-runner-token"),
                    1 => headers.retain(|(n, _)| n != "x-runner-uuid"),
                    2 => headers[1].1 = self.mutate_text(&self.token.clone()),
                    _ => {}
                }
                let methods = ["POST", "POST", "GET", "PUT", "OPTIONS", "DELETE"];
                let method = methods[self.rng.usize(..methods.len())];
                let path = if self.rng.u8(0..5) == 0 { self.mutate_text(&path) } else { path };
                let body = if content_type.contains("json") { json_body.into_bytes() } else { proto_body };
                {
                    let length = self.rng.bool();
                    Self::request(method, &path, &headers, &body, length)
                }
            }
            Class::Compression => {
                headers.push(("content-type".into(), "application/proto".into()));
                headers.push(("content-encoding".into(), "gzip".into()));
                let body = match self.rng.u8(0..5) {
                    0 => gzip(&proto_body),
                    1 => {
                        let mut g = gzip(&proto_body);
                        g.truncate(self.rng.usize(..g.len()));
                        g
                    }
                    2 => self.random_bytes(256),
                    // A bomb: small on the wire, over the limit inflated.
                    3 => gzip(&vec![0u8; LIMIT + self.rng.usize(1..4 * LIMIT)]),
                    _ => {
                        let g = gzip(&proto_body);
                        self.mutate(g)
                    }
                };
                {
                    let length = self.rng.bool();
                    Self::request("POST", &path, &headers, &body, length)
                }
            }
            Class::Protobuf => {
                headers.push(("content-type".into(), "application/proto".into()));
                let body = if self.rng.u8(0..4) == 0 { self.random_bytes(1024) } else { self.mutate(proto_body) };
                {
                    let length = self.rng.bool();
                    Self::request("POST", &path, &headers, &body, length)
                }
            }
            Class::Json => {
                headers.push(("content-type".into(), "application/json".into()));
                let body = match self.rng.u8(0..4) {
                    0 => "[".repeat(self.rng.usize(1..5000)).into_bytes(),
                    1 => br#"{"taskId":"x","index":{},"rows":7}"#.to_vec(),
                    _ => self.mutate(json_body.into_bytes()),
                };
                {
                    let length = self.rng.bool();
                    Self::request("POST", &path, &headers, &body, length)
                }
            }
            Class::AtLimit | Class::OverLimit => {
                headers.push(("content-type".into(), "application/proto".into()));
                let size = if class == Class::AtLimit { [LIMIT - 1, LIMIT][self.rng.usize(..2)] } else { [LIMIT + 1, 2 * LIMIT][self.rng.usize(..2)] };
                let body = update_log_of_size(size);
                let path = "/api/actions/runner.v1.RunnerService/UpdateLog";
                let length = self.rng.bool();
                if self.rng.bool() {
                    headers.push(("content-encoding".into(), "gzip".into()));
                    return Self::request("POST", path, &headers, &gzip(&body), length);
                }
                Self::request("POST", path, &headers, &body, length)
            }
        }
    }

    fn mutate_text(&mut self, text: &str) -> String {
        let mut chars: Vec<char> = text.chars().collect();
        if chars.is_empty() {
            return "x".into();
        }
        let i = self.rng.usize(..chars.len());
        chars[i] = if chars[i] == 'a' { 'b' } else { 'a' };
        chars.into_iter().collect()
    }
}

/// How one request ended.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    /// 200 with a Connect body.
    Served,
    /// A Connect error with this code.
    Refused(String),
    /// Not a valid HTTP request: the HTTP layer's 4xx/5xx without a Connect body.
    HttpLayer(u16),
    /// Not a valid HTTP request: the connection was closed without an answer.
    ClosedByHttpLayer,
    /// Not a path of the runner protocol: passed on to Gitea (here: a 502 saying there is none).
    PassedToGitea,
    /// A violation: what was wrong.
    Improper(String),
    Hang,
}

fn connect_status(code: &str) -> Option<u16> {
    Some(match code {
        "canceled" => 499,
        "unknown" | "internal" | "data_loss" => 500,
        "invalid_argument" | "failed_precondition" | "out_of_range" => 400,
        "deadline_exceeded" => 504,
        "not_found" | "unimplemented" => 404,
        "already_exists" | "aborted" => 409,
        "permission_denied" => 403,
        "resource_exhausted" => 429,
        "unavailable" => 503,
        "unauthenticated" => 401,
        _ => return None,
    })
}

fn judge(class: Class, answer: &[u8]) -> Outcome {
    let Some(split) = answer.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if class == Class::Framing && answer.is_empty() {
            Outcome::ClosedByHttpLayer
        } else {
            Outcome::Improper(format!("no HTTP head: {:?}", String::from_utf8_lossy(&answer[..answer.len().min(80)])))
        };
    };
    let head = String::from_utf8_lossy(&answer[..split]).into_owned();
    let header =
        |name: &str| head.lines().find_map(|l| l.split_once(':').filter(|(k, _)| k.trim().eq_ignore_ascii_case(name)).map(|(_, v)| v.trim().to_owned()));
    let mut body = &answer[split + 4..];
    // Bytes after a request's body are a second (pipelined) request with its own answer:
    // judge the first.
    if let Some(length) = header("content-length").and_then(|v| v.parse::<usize>().ok()) {
        body = &body[..length.min(body.len())];
    }
    let status: u16 = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let content_type =
        head.lines().find_map(|l| l.split_once(':').filter(|(k, _)| k.trim().eq_ignore_ascii_case("content-type")).map(|(_, v)| v.trim().to_owned()));
    if class == Class::AtLimit && status != 200 {
        return Outcome::Improper(format!("a request within the limit got HTTP {status}: {:?}", String::from_utf8_lossy(&body[..body.len().min(200)])));
    }
    if class == Class::OverLimit && status != 429 {
        return Outcome::Improper(format!("a request over the limit got HTTP {status}, not resource_exhausted"));
    }
    if status == 200 {
        return match content_type.as_deref() {
            Some(t) if t.starts_with("application/proto") || t.starts_with("application/json") => Outcome::Served,
            other => Outcome::Improper(format!("200 with content-type {other:?}")),
        };
    }
    let is_json = content_type.as_deref().is_some_and(|t| t.starts_with("application/json"));
    if is_json && let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) {
        let code = value["code"].as_str().unwrap_or_default().to_owned();
        // The code's own status, or one the Connect protocol prescribes at the HTTP level
        // (405 for a method other than POST, 415 for an unsupported content type, 501 for
        // an HTTP method the server does not know).
        return match connect_status(&code) {
            Some(expected) if (expected == status || [405, 415, 501].contains(&status)) && value["message"].is_string() => Outcome::Refused(code),
            Some(expected) => Outcome::Improper(format!("{code} with HTTP {status}, expected {expected}")),
            None => Outcome::Improper(format!("unknown code {code:?} (HTTP {status})")),
        };
    }
    // Any other path is not the runner protocol: it passes to Gitea, which this
    // environment does not know here.
    if status == 502 && body.starts_with(b"gitea-dynamic-runner: ") && body.windows(19).any(|w| w == b"knows no Gitea (CI_") {
        return Outcome::PassedToGitea;
    }
    // hyper refuses what is not HTTP (bad framing, bytes not allowed in a header) before
    // any handler sees it.
    if matches!(class, Class::Framing | Class::Headers) && (400..600).contains(&status) && body.is_empty() {
        return Outcome::HttpLayer(status);
    }
    Outcome::Improper(format!("HTTP {status} with content-type {content_type:?} and body {:?}", String::from_utf8_lossy(&body[..body.len().min(120)])))
}

async fn send(address: SocketAddr, request: &[u8], half_close: bool) -> Option<Vec<u8>> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(address).await.ok()?;
        // The server may answer (and close) before it read everything: a write error is not
        // a failure, the answer is what counts.
        let _ = stream.write_all(request).await;
        if half_close {
            // A request that promised more than it sent: the client gives up after a while.
            // (Otherwise the write side stays open: hyper treats a half-closed connection as
            // gone and drops the request.)
            tokio::time::sleep(Duration::from_millis(20)).await;
            let _ = stream.shutdown().await;
        }
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer).await;
        Some(answer)
    };
    tokio::time::timeout(ANSWER_WITHIN, exchange).await.ok().flatten()
}

/// Panics on this test's runtime threads (the server's and its clients'). The panic hook
/// is the whole test binary's, so it counts only those: another test failing meanwhile
/// is not the server panicking.
static PANICS: AtomicUsize = AtomicUsize::new(0);
/// The name of this test's runtime threads, by which the panic hook knows them.
const THREADS: &str = "hostile-input";

#[test]
fn generated_hostile_requests_get_proper_connect_errors() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name(THREADS).enable_all().build().unwrap();
    runtime.block_on(hostile_requests());
}

async fn hostile_requests() {
    let total: usize = std::env::var("GDR_FUZZ_REQUESTS").ok().map_or(100_000, |v| v.parse().expect("GDR_FUZZ_REQUESTS is a number"));
    let seed: u64 = std::env::var("GDR_FUZZ_SEED").ok().map_or_else(
        || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs(),
        |v| v.parse().expect("GDR_FUZZ_SEED is a number"),
    );
    eprintln!("hostile input: {total} requests, GDR_FUZZ_SEED={seed}");
    // The memory bound is this process's: no other test moves megabytes meanwhile.
    let _memory = PROCESS_MEMORY.write().await;
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current().name() == Some(THREADS) {
            PANICS.fetch_add(1, Ordering::SeqCst);
        }
        default_hook(info);
    }));

    let runner = LocalRunner::new("gitea-task-7", vec!["disposable".into()]).unwrap();
    let (_ready, steps) = tokio::sync::watch::channel(true);
    let task = Task { id: 7, workflow_payload: Some(b"jobs: {}".to_vec()), context: Some(Default::default()), ..Default::default() };
    let served = Served {
        runner: runner.clone(),
        task,
        gitea_capabilities: String::new(),
        upstream: Arc::new(Sink),
        hooks: RunnerHooks::Auto,
        steps_may_run: steps,
        stopping: Arc::default(),
    };
    let shutdown = CancellationToken::new();
    let router = loopback::router(served).with_max_request_bytes(LIMIT);
    let (address, server) = loopback::start(router, proxy::fallback(None).unwrap(), shutdown.clone()).await.unwrap();

    let outcomes: Arc<Mutex<BTreeMap<Class, BTreeMap<Outcome, usize>>>> = Arc::default();
    let samples: Arc<Mutex<Vec<String>>> = Arc::default();
    let next = Arc::new(AtomicUsize::new(0));
    let rss_before = testkit::rss_kib();
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for client in 0..CONCURRENCY {
        let (outcomes, samples, next) = (Arc::clone(&outcomes), Arc::clone(&samples), Arc::clone(&next));
        let mut generator =
            Generator { rng: fastrand::Rng::with_seed(seed.wrapping_add(client as u64)), uuid: runner.assignment_id.clone(), token: runner.token.clone() };
        clients.spawn(async move {
            while next.fetch_add(1, Ordering::SeqCst) < total {
                let class = CLASSES[generator.rng.usize(..CLASSES.len())];
                let request = generator.generate(class);
                let outcome = match send(address, &request, class == Class::Framing).await {
                    Some(answer) => judge(class, &answer),
                    None => Outcome::Hang,
                };
                if matches!(outcome, Outcome::Improper(_) | Outcome::Hang) {
                    let mut samples = samples.lock().unwrap();
                    if samples.len() < 10 {
                        samples.push(format!("{class:?} {outcome:?} for {:?}", String::from_utf8_lossy(&request[..request.len().min(300)])));
                    }
                }
                *outcomes.lock().unwrap().entry(class).or_default().entry(outcome).or_default() += 1;
            }
        });
    }
    while let Some(joined) = clients.join_next().await {
        joined.unwrap();
    }
    let elapsed = started.elapsed();
    let rss_after = testkit::rss_kib();
    shutdown.cancel();
    server.await.unwrap().unwrap();

    let outcomes = outcomes.lock().unwrap();
    let (report, violations) = testkit::hostile_report("hostile input", total, elapsed, seed, (rss_before, rss_after), &outcomes, |o: &Outcome| {
        matches!(o, Outcome::Improper(_) | Outcome::Hang)
    });
    println!("{report}");
    let panics = PANICS.load(Ordering::SeqCst);
    assert_eq!(panics, 0, "the server panicked {panics} times{report}");
    assert_eq!(violations, 0, "improper answers or hangs:\n{}\n{report}", samples.lock().unwrap().join("\n"));
    // Bounded: requests are at most LIMIT (a bomb is refused at LIMIT inflated), and nothing
    // is kept between them.
    assert!(rss_after < rss_before + 256 * 1024, "memory grew from {rss_before} KiB to {rss_after} KiB");
}
