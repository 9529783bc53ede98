//! The loopback RunnerService: what an unmodified `gitea-runner daemon --once` expects
//! from Gitea, served on 127.0.0.1 by the agent (see docs/architecture.md, "The loopback"). It is
//! "Gitea as the runner sees it": every other path goes to the real Gitea through
//! [`super::proxy`].
//!
//! - Declare and Ping are answered here; Register is refused (the `.runner` file is
//!   written by the agent, no registration happens).
//! - FetchTask returns the claimed Task — again on every FetchTask until the runner
//!   first reports on it, so a reply lost on the way (a timeout) cannot strand the
//!   environment — then nothing. A runner without job hooks (act_runner, gitea-runner
//!   before v3) gets the task only once dockerd's socket takes connections, held inside its fetch
//!   timeout, since nothing else would keep its first step from starting earlier.
//! - UpdateTask and UpdateLog go to the controller's facade through [`Upstream`], cut
//!   into pieces under the facade's limit where a runner's backlog is larger
//!   (`proto::pieces`), and the replies come back unchanged — including a cancellation.
//! - Every call but Ping must carry the local credential of the `.runner` file
//!   (`x-runner-uuid` = assignment id, `x-runner-token` = a random local secret); the
//!   runner's real Gitea credential never exists in the environment.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use async_trait::async_trait;
use connect::{Code, ConnectError, Fallback, Request, Response, Router};
use proto::{
    ping::v1::{PingRequest, PingResponse},
    runner::v1::{
        DeclareRequest, DeclareResponse, FetchTaskRequest, FetchTaskResponse, RegisterRequest, RegisterResponse, Runner, Task, UpdateLogRequest,
        UpdateLogResponse, UpdateTaskRequest, UpdateTaskResponse,
    },
};
use serde::Serialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::config::RunnerHooks;

/// The largest request the loopback takes from the runner: its whole unacknowledged
/// log backlog comes in one UpdateLog, so this is generous; it goes on in pieces.
pub const MAX_RUNNER_REQUEST_BYTES: usize = 256 << 20;
/// The largest piece sent on to the facade (whose limit is 4 MiB).
pub const MAX_PIECE_BYTES: usize = 2 << 20;
/// How long one UpdateLog of the runner sends pieces on: well inside its client's
/// timeout (a minute), so a backlog Gitea takes long to write is acknowledged in parts.
pub const LOG_CALL_BUDGET: std::time::Duration = std::time::Duration::from_secs(20);
/// A log row longer than this (one "line" of megabytes, e.g. a binary dumped to the
/// log) is cut, so that every row fits a piece: the rest of the job's log must not be
/// lost for it.
pub const MAX_ROW_BYTES: usize = 1 << 20;

/// Cuts rows over [`MAX_ROW_BYTES`] (at a character boundary) and says so in the row.
fn cut_long_rows(request: &mut UpdateLogRequest) {
    for row in &mut request.rows {
        if row.content.len() > MAX_ROW_BYTES {
            let mut end = MAX_ROW_BYTES;
            while !row.content.is_char_boundary(end) {
                end -= 1;
            }
            let cut = row.content.len() - end;
            row.content.truncate(end);
            row.content.push_str(&format!(" [gitea-dynamic-runner: {cut} more bytes of this line were cut]"));
        }
    }
}

/// Where UpdateTask and UpdateLog go: the controller's facade.
#[async_trait]
pub trait Upstream: Send + Sync + 'static {
    async fn update_task(&self, request: UpdateTaskRequest) -> Result<UpdateTaskResponse, ConnectError>;
    async fn update_log(&self, request: UpdateLogRequest) -> Result<UpdateLogResponse, ConnectError>;
}

/// The local registration gitea-runner uses.
#[derive(Clone)]
pub struct LocalRunner {
    pub assignment_id: String,
    /// A fresh random secret, known only to this environment.
    pub token: String,
    pub labels: Vec<String>,
}

impl std::fmt::Debug for LocalRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalRunner").field("assignment_id", &self.assignment_id).field("labels", &self.labels).finish_non_exhaustive()
    }
}

/// The `.runner` file gitea-runner loads (gitea-runner's internal/pkg/config/registration.go): field order and a trailing
/// newline as gitea-runner writes it.
#[derive(Serialize)]
struct RunnerFile<'a> {
    #[serde(rename = "WARNING")]
    warning: &'a str,
    id: i64,
    uuid: &'a str,
    name: &'a str,
    token: &'a str,
    address: &'a str,
    labels: &'a [String],
    ephemeral: bool,
}

impl LocalRunner {
    /// A registration with a random local token.
    ///
    /// # Errors
    /// When the system has no randomness to offer.
    pub fn new(assignment_id: &str, labels: Vec<String>) -> std::io::Result<Self> {
        Ok(LocalRunner { assignment_id: assignment_id.to_owned(), token: random_hex(32)?, labels })
    }

    /// The `.runner` JSON pointing gitea-runner at `address`.
    pub fn runner_file(&self, address: &str) -> Vec<u8> {
        let file = RunnerFile {
            warning: "This file is automatically generated by gitea-dynamic-runner. Do not edit it manually unless you know what you are doing.",
            id: 0,
            uuid: &self.assignment_id,
            name: &self.assignment_id,
            token: &self.token,
            address,
            labels: &self.labels,
            ephemeral: true,
        };
        let mut json = serde_json::to_vec_pretty(&file).unwrap_or_default();
        json.push(b'\n');
        json
    }
}

/// Random bytes from the kernel, hex-encoded.
///
/// # Errors
/// When /dev/urandom cannot be read.
pub fn random_hex(bytes: usize) -> std::io::Result<String> {
    use std::io::Read;
    let mut buffer = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buffer)?;
    Ok(buffer.iter().map(|b| format!("{b:02x}")).collect())
}

/// What the loopback serves.
#[allow(missing_debug_implementations)] // Holds the task (secrets) and a trait object.
pub struct Served {
    pub runner: LocalRunner,
    pub task: Task,
    /// Answered to the runner's Declare in [`proto::CAPABILITIES_HEADER`] as Gitea
    /// answered the controller's (empty: no header, as before Gitea 1.27).
    pub gitea_capabilities: String,
    pub upstream: Arc<dyn Upstream>,
    pub hooks: RunnerHooks,
    /// True once the job's steps may run (dockerd's socket takes connections, or no dockerd).
    pub steps_may_run: watch::Receiver<bool>,
    /// Set once the environment was told to stop (SIGTERM or SIGINT passed on to the
    /// runner) while the job ran.
    pub stopping: Arc<std::sync::atomic::AtomicBool>,
}

/// What the loopback learns from the runner while it serves the task.
#[derive(Default)]
struct Progress {
    /// The runner's version, from its Declare.
    version: Option<String>,
    /// The runner has reported on the task: it has it, stop handing it out.
    reported: bool,
    handed_out: usize,
}

/// Whether a runner of this version runs the job-started hook (gitea-runner v3.0+).
pub fn runner_has_hooks(version: &str) -> bool {
    let version = version.trim_start_matches('v');
    version.split('.').next().and_then(|major| major.parse::<u32>().ok()).is_some_and(|major| major >= 3)
}

/// The router of the runner protocol: one method of [`Loopback`] per procedure.
pub fn router(served: Served) -> Router {
    let loopback = Arc::new(Loopback { served, progress: Mutex::default() });
    Router::new(proto::descriptor_pool().clone())
        .with_prefix("/api/actions")
        .with_max_request_bytes(MAX_RUNNER_REQUEST_BYTES)
        .unary("ping.v1.PingService/Ping", |request: Request<PingRequest>| async move {
            Ok(Response::new(PingResponse { data: format!("Hello, {}!", request.message.data) }))
        })
        .unary("runner.v1.RunnerService/Register", |_: Request<RegisterRequest>| async move {
            Err::<Response<RegisterResponse>, _>(ConnectError::permission_denied("this runner is registered by its environment: nothing to register"))
        })
        .unary("runner.v1.RunnerService/Declare", with(&loopback, Loopback::declare))
        .unary("runner.v1.RunnerService/FetchTask", with(&loopback, Loopback::fetch_task))
        .unary("runner.v1.RunnerService/UpdateTask", with(&loopback, Loopback::update_task))
        .unary("runner.v1.RunnerService/UpdateLog", with(&loopback, Loopback::update_log))
}

/// A handler that calls `method` on the shared loopback.
fn with<Req, Fut>(
    loopback: &Arc<Loopback>,
    method: impl Fn(Arc<Loopback>, Request<Req>) -> Fut + Send + Sync + 'static,
) -> impl Fn(Request<Req>) -> Fut + Send + Sync + 'static {
    let loopback = Arc::clone(loopback);
    move |request| method(Arc::clone(&loopback), request)
}

/// The served task and what the runner did with it so far, shared by the procedures.
struct Loopback {
    served: Served,
    progress: Mutex<Progress>,
}

impl Loopback {
    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Declare: the runner as it declared itself, with the capabilities Gitea answered.
    async fn declare(self: Arc<Self>, request: Request<DeclareRequest>) -> Result<Response<DeclareResponse>, ConnectError> {
        let served = &self.served;
        authenticate(&served.runner, &request)?;
        tracing::info!(version = %request.message.version, labels = ?request.message.labels, "the runner declared itself");
        self.progress().version = Some(request.message.version.clone());
        let mut response = Response::new(DeclareResponse {
            runner: Some(Runner {
                uuid: served.runner.assignment_id.clone(),
                name: served.runner.assignment_id.clone(),
                version: request.message.version,
                labels: request.message.labels,
                ephemeral: true,
                ..Default::default()
            }),
        });
        if let Ok(value) = http::HeaderValue::from_str(&served.gitea_capabilities)
            && !served.gitea_capabilities.is_empty()
        {
            response.headers.insert(proto::CAPABILITIES_HEADER, value);
        }
        Ok(response)
    }

    /// FetchTask: the task until the runner reports on it (a runner without hooks only
    /// once its steps may run), then nothing.
    async fn fetch_task(self: Arc<Self>, request: Request<FetchTaskRequest>) -> Result<Response<FetchTaskResponse>, ConnectError> {
        let served = &self.served;
        authenticate(&served.runner, &request)?;
        let (reported, version) = {
            let progress = self.progress();
            (progress.reported, progress.version.clone())
        };
        let nothing = || Ok(Response::new(FetchTaskResponse { task: None, tasks_version: 1 }));
        if reported {
            return nothing();
        }
        if self.holds_back(version.as_deref()) && !self.steps_may_run_within(request.deadline).await {
            tracing::info!("holding the task back until dockerd's socket takes connections (the runner has no job-started hook)");
            return nothing();
        }
        let times = {
            let mut progress = self.progress();
            progress.handed_out += 1;
            progress.handed_out
        };
        if times == 1 {
            tracing::info!(task_id = served.task.id, "task handed to the runner");
        } else {
            tracing::warn!(task_id = served.task.id, times, "task handed to the runner again (it has not reported on it yet)");
        }
        Ok(Response::new(FetchTaskResponse { task: Some(served.task.clone()), tasks_version: 1 }))
    }

    /// Whether the task waits for the steps to be allowed to run: nothing else would
    /// keep the first step of a runner without the job-started hook from starting.
    fn holds_back(&self, version: Option<&str>) -> bool {
        match self.served.hooks {
            RunnerHooks::JobStarted => false,
            RunnerHooks::None => true,
            RunnerHooks::Auto => !version.is_some_and(runner_has_hooks),
        }
    }

    /// Whether the steps may run, waiting for it until shortly before the fetch's
    /// `deadline`, so the poll ends as "no task yet" rather than as a timeout.
    async fn steps_may_run_within(&self, deadline: Option<tokio::time::Instant>) -> bool {
        if *self.served.steps_may_run.borrow() {
            return true;
        }
        let budget =
            deadline.map_or(Duration::from_secs(4), |d| d.saturating_duration_since(tokio::time::Instant::now()).saturating_sub(Duration::from_millis(500)));
        let mut ready = self.served.steps_may_run.clone();
        let _ = tokio::time::timeout(budget, ready.wait_for(|ready| *ready)).await;
        *ready.borrow()
    }

    /// UpdateTask: on to the facade in pieces; the last reply comes back.
    async fn update_task(self: Arc<Self>, request: Request<UpdateTaskRequest>) -> Result<Response<UpdateTaskResponse>, ConnectError> {
        let served = &self.served;
        authenticate(&served.runner, &request)?;
        if request.message.state.as_ref().is_some_and(|s| s.id == served.task.id) {
            self.progress().reported = true;
        }
        let mut message = request.message;
        // A runner told to stop mid-job reports an end of its own (gitea-runner
        // v3.3.0 reports `success` for a job its shutdown cancelled). That end is
        // not the job's: keep the steps' progress, leave the result to the
        // controller, which fails the task with the reason once the environment
        // has ended — one writer of the end, so nothing races it.
        if served.stopping.load(std::sync::atomic::Ordering::SeqCst)
            && let Some(state) = message.state.as_mut()
            && state.result != proto::runner::v1::Result::Unspecified as i32
        {
            tracing::warn!(task_id = state.id, result = state.result, "the environment is stopping: the runner's own end of the job is not passed on");
            state.result = proto::runner::v1::Result::Unspecified as i32;
            state.stopped_at = None;
        }
        let mut last = None;
        for piece in proto::pieces::task_pieces(&message, MAX_PIECE_BYTES) {
            last = Some(served.upstream.update_task(piece).await?);
        }
        last.map(Response::new).ok_or_else(|| ConnectError::internal("nothing was sent"))
    }

    /// UpdateLog: on to the facade in pieces, answering what went through.
    async fn update_log(self: Arc<Self>, request: Request<UpdateLogRequest>) -> Result<Response<UpdateLogResponse>, ConnectError> {
        let served = &self.served;
        authenticate(&served.runner, &request)?;
        if request.message.task_id == served.task.id {
            self.progress().reported = true;
        }
        let mut message = request.message;
        cut_long_rows(&mut message);
        // Stopping: the log stays open for the controller's reason (see update_task).
        if served.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            message.no_more = false;
        }
        let upstream = &served.upstream;
        let answer = proto::pieces::send_log_in_pieces(message, MAX_PIECE_BYTES, LOG_CALL_BUDGET, |piece| upstream.update_log(piece)).await?;
        Ok(Response::new(answer))
    }
}

fn authenticate<M>(runner: &LocalRunner, request: &Request<M>) -> Result<(), ConnectError> {
    let header = |name: &str| request.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("");
    // Constant-time comparison of the token: it is the only secret here.
    let token_ok = constant_time_eq(header("x-runner-token").as_bytes(), runner.token.as_bytes());
    if header("x-runner-uuid") == runner.assignment_id && token_ok { Ok(()) } else { Err(ConnectError::new(Code::Unauthenticated, "unregistered runner")) }
}

/// Compares without an early exit on the first differing byte.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Serves the loopback RunnerService on 127.0.0.1 (random port) until `shutdown`,
/// with every other path answered by `fallback` (the pass-through to Gitea).
///
/// # Errors
/// When the port cannot be bound.
pub async fn start(
    router: Router,
    fallback: Fallback,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>)> {
    // Loopback only: nothing outside this environment may talk to it.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let server = tokio::spawn(connect::serve_with_fallback(listener, Arc::new(router), Some(fallback), shutdown, Duration::from_secs(5)));
    Ok((address, server))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runner_file_has_gitea_runners_shape() {
        let runner = LocalRunner { assignment_id: "gitea-task-7".into(), token: "local".into(), labels: vec!["self-hosted".into(), "container".into()] };
        let file = String::from_utf8(runner.runner_file("http://127.0.0.1:4321")).unwrap();
        assert!(file.ends_with("}\n"));
        let keys: Vec<&str> = file.lines().filter_map(|l| l.trim().strip_prefix('"')?.split('"').next()).collect();
        assert_eq!(keys, ["WARNING", "id", "uuid", "name", "token", "address", "labels", "self-hosted", "container", "ephemeral"]);
        let value: serde_json::Value = serde_json::from_str(&file).unwrap();
        assert_eq!(value["uuid"], "gitea-task-7");
        assert_eq!(value["address"], "http://127.0.0.1:4321");
        assert_eq!(value["ephemeral"], true);
    }

    #[test]
    fn rows_of_megabytes_are_cut_to_fit() {
        use proto::runner::v1::LogRow;
        let long = "é".repeat(MAX_ROW_BYTES); // two bytes each
        let mut request = UpdateLogRequest {
            task_id: 1,
            index: 0,
            rows: vec![LogRow { time: None, content: long }, LogRow { time: None, content: "short".into() }],
            no_more: false,
        };
        cut_long_rows(&mut request);
        assert!(request.rows[0].content.len() < MAX_ROW_BYTES + 100);
        assert!(request.rows[0].content.ends_with(&format!("[gitea-dynamic-runner: {} more bytes of this line were cut]", MAX_ROW_BYTES)));
        assert_eq!(request.rows[1].content, "short");
    }

    #[test]
    fn runners_with_hooks() {
        for (version, hooks) in [("v3.3.0", true), ("3.0.0", true), ("v10.1", true), ("v2.9.9", false), ("v0.2.12", false), ("dev", false), ("", false)] {
            assert_eq!(runner_has_hooks(version), hooks, "{version}");
        }
    }

    #[test]
    fn random_tokens_differ() {
        let a = random_hex(32).unwrap();
        assert_eq!(a.len(), 64);
        assert_ne!(a, random_hex(32).unwrap());
    }

    #[test]
    fn equality_without_early_exit() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
