//! The controller's client of Gitea's runner protocol (Connect over HTTP/1.1; see
//! docs/architecture.md, "Gitea"): Register once with the registration token (read
//! from a file), keep the runner credential in a 0600 file that later starts reuse,
//! Declare the registration's labels with the `cancelling`
//! capability, then FetchTask / UpdateTask / UpdateLog with `x-runner-uuid` and
//! `x-runner-token`. Transient failures (`unavailable`) are retried with backoff;
//! "unregistered runner" is a clear, final error.

use std::{
    io::Write,
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
    time::Duration,
};

pub mod registrations;

use connect::{CallOptions, Client, Code, ConnectError};
use http::{HeaderName, HeaderValue};
use proto::runner::v1::{
    DeclareRequest, DeclareResponse, FetchTaskRequest, FetchTaskResponse, RegisterRequest, RegisterResponse, UpdateLogRequest, UpdateLogResponse,
    UpdateTaskRequest, UpdateTaskResponse,
};
use serde::{Deserialize, Serialize};

const SERVICE: &str = "runner.v1.RunnerService/";
/// The capability we implement: a cancelled task first becomes `cancelling`, and the
/// runner reports the final state itself.
pub const CAPABILITIES: [&str; 1] = ["cancelling"];
/// The runner's per-RPC timeout (gitea-runner uses the same 60 s).
const RPC_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum GiteaError {
    #[error(
        "Gitea no longer knows this runner ({message}): delete {credential_file} and restart with a valid \
         registration token file to register again"
    )]
    Unregistered { credential_file: String, message: String },
    #[error("Gitea refused the registration: {0}; check the registration token file (tokens are per scope and can be reset)")]
    RegistrationRefused(String),
    #[error("Gitea is too old: it does not implement Declare (need Gitea ≥ 1.21)")]
    TooOld,
    #[error("{call} failed: {error}")]
    Call { call: &'static str, error: ConnectError },
    #[error("invalid Gitea URL {url:?}")]
    InvalidUrl {
        url: String,
        #[source]
        source: connect::client::ClientError,
    },
    #[error("cannot read {path}")]
    ReadFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {path}")]
    WriteFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a valid runner credential file: {reason}")]
    BadCredentialFile { path: PathBuf, reason: String },
}

impl GiteaError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            GiteaError::Unregistered { .. } => "unregistered",
            GiteaError::RegistrationRefused(_) => "registration_refused",
            GiteaError::TooOld => "too_old",
            GiteaError::Call { error, .. } => error.code.as_str(),
            _ => "config",
        }
    }
}

/// The runner credential Gitea issued at registration; stored mode 0600.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Credential {
    pub id: i64,
    pub uuid: String,
    pub name: String,
    pub token: String,
    /// The instance URL it belongs to.
    pub address: String,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credential").field("id", &self.id).field("uuid", &self.uuid).field("name", &self.name).finish_non_exhaustive()
    }
}

impl Credential {
    /// # Errors
    /// When the file cannot be read or is not a credential.
    pub fn load(path: &Path) -> Result<Option<Credential>, GiteaError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(GiteaError::ReadFile { path: path.to_owned(), source }),
        };
        let credential: Credential =
            serde_json::from_str(&text).map_err(|error| GiteaError::BadCredentialFile { path: path.to_owned(), reason: error.to_string() })?;
        if credential.uuid.is_empty() || credential.token.is_empty() {
            return Err(GiteaError::BadCredentialFile { path: path.to_owned(), reason: "empty uuid or token".into() });
        }
        Ok(Some(credential))
    }

    /// Writes atomically (temporary file + rename) with mode 0600.
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn store(&self, path: &Path) -> Result<(), GiteaError> {
        let write_error = |source| GiteaError::WriteFile { path: path.to_owned(), source };
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(write_error)?;
        }
        let temporary = path.with_extension("tmp");
        let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&temporary).map_err(write_error)?;
        file.set_permissions(std::fs::Permissions::from_mode(0o600)).map_err(write_error)?;
        let json = serde_json::to_vec_pretty(self).map_err(|e| write_error(std::io::Error::other(e)))?;
        file.write_all(&json).map_err(write_error)?;
        file.sync_all().map_err(write_error)?;
        std::fs::rename(&temporary, path).map_err(write_error)
    }
}

/// A client of one Gitea instance.
#[derive(Clone, Debug)]
pub struct Gitea {
    client: Client,
    credential_file: PathBuf,
    version: String,
    /// Empty until [`Gitea::authenticated`].
    runner_uuid: String,
    /// From the Declare reply (see [`TaskReports::server_capabilities`]).
    server_capabilities: String,
}

impl Gitea {
    /// A client without a runner credential (for Register).
    ///
    /// # Errors
    /// When the URL is not an http(s) URL.
    pub fn new(instance: &str, credential_file: &Path) -> Result<Self, GiteaError> {
        let base = format!("{}/api/actions", instance.trim_end_matches('/'));
        let client = Client::new(&base, proto::descriptor_pool().clone()).map_err(|source| GiteaError::InvalidUrl { url: instance.to_owned(), source })?;
        Ok(Gitea {
            client,
            credential_file: credential_file.to_owned(),
            version: format!("gitea-dynamic-runner/{}", env!("CARGO_PKG_VERSION")),
            runner_uuid: String::new(),
            server_capabilities: String::new(),
        })
    }

    /// The same client, authenticated as `credential`.
    ///
    /// # Errors
    /// When the credential cannot be sent as HTTP headers.
    pub fn authenticated(mut self, credential: &Credential) -> Result<Self, GiteaError> {
        let header = |name: &'static str, value: &str| {
            HeaderValue::from_str(value)
                .map(|v| (HeaderName::from_static(name), v))
                .map_err(|_| GiteaError::BadCredentialFile { path: self.credential_file.clone(), reason: format!("{name} is not a valid header value") })
        };
        let (uuid_name, uuid) = header("x-runner-uuid", &credential.uuid)?;
        let (token_name, mut token) = header("x-runner-token", &credential.token)?;
        token.set_sensitive(true);
        self.client = self.client.with_header(uuid_name, uuid).with_header(token_name, token);
        self.runner_uuid = credential.uuid.clone();
        Ok(self)
    }

    /// Registers a new runner with the registration token.
    ///
    /// # Errors
    /// A refusal, or Gitea unreachable after retries.
    pub async fn register(&self, name: &str, registration_token: &str, labels: &[String]) -> Result<Credential, GiteaError> {
        let request = RegisterRequest {
            name: name.to_owned(),
            token: registration_token.to_owned(),
            version: self.version.clone(),
            labels: labels.to_vec(),
            ephemeral: false,
            capabilities: CAPABILITIES.iter().map(|c| (*c).to_owned()).collect(),
            ..Default::default()
        };
        let response: RegisterResponse = self.call("Register", &request).await.map_err(|error| match error {
            GiteaError::Call { error, .. } if error.code != Code::Unavailable => GiteaError::RegistrationRefused(error.message),
            other => other,
        })?;
        let runner = response.runner.ok_or_else(|| GiteaError::RegistrationRefused("the reply carries no runner".into()))?;
        Ok(Credential { id: runner.id, uuid: runner.uuid, name: runner.name, token: runner.token, address: String::new() })
    }

    /// # Errors
    /// Unregistered, too old, or unreachable after retries.
    /// The reply, and the server's capabilities ([`proto::CAPABILITIES_HEADER`]; empty
    /// before Gitea 1.27).
    pub async fn declare(&self, labels: &[String]) -> Result<(DeclareResponse, String), GiteaError> {
        let request =
            DeclareRequest { version: self.version.clone(), labels: labels.to_vec(), capabilities: CAPABILITIES.iter().map(|c| (*c).to_owned()).collect() };
        let response = self.call_with_headers("Declare", &request).await.map_err(|error| match error {
            GiteaError::Call { error, .. } if error.code == Code::Unimplemented => GiteaError::TooOld,
            other => other,
        })?;
        let capabilities = response.headers.get(proto::CAPABILITIES_HEADER).and_then(|v| v.to_str().ok()).unwrap_or_default().trim().to_owned();
        Ok((response.message, capabilities))
    }

    /// One FetchTask, answered at once by Gitea.
    ///
    /// # Errors
    /// Unregistered, a deadline (`Call` with `DeadlineExceeded`: the caller says that a
    /// task in the lost reply is lost), or any other failure.
    pub async fn fetch_task(&self, tasks_version: i64, timeout: Duration) -> Result<FetchTaskResponse, GiteaError> {
        let options = CallOptions::default().with_timeout(timeout);
        match self.client.unary(&format!("{SERVICE}FetchTask"), &FetchTaskRequest { tasks_version }, &options).await {
            Ok(response) => Ok(response.message),
            Err(error) => Err(self.classify("FetchTask", error)),
        }
    }

    /// # Errors
    /// Unregistered, or a failure after retries.
    pub async fn update_task(&self, request: &UpdateTaskRequest) -> Result<UpdateTaskResponse, GiteaError> {
        self.call("UpdateTask", request).await
    }

    /// # Errors
    /// Unregistered, or a failure after retries.
    pub async fn update_log(&self, request: &UpdateLogRequest) -> Result<UpdateLogResponse, GiteaError> {
        self.call("UpdateLog", request).await
    }

    /// A call with the runner's 60 s timeout, retried with backoff while Gitea is
    /// unavailable (for at most five minutes, then the error is returned).
    async fn call<Req: connect::Message, Resp: connect::Message>(&self, method: &'static str, request: &Req) -> Result<Resp, GiteaError> {
        self.call_with_headers(method, request).await.map(|response| response.message)
    }

    async fn call_with_headers<Req: connect::Message, Resp: connect::Message>(
        &self,
        method: &'static str,
        request: &Req,
    ) -> Result<connect::client::Response<Resp>, GiteaError> {
        let options = CallOptions::default().with_timeout(RPC_TIMEOUT);
        let mut delays = contract::backoff::Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
        let give_up = tokio::time::Instant::now() + Duration::from_secs(300);
        let procedure = format!("{SERVICE}{method}");
        contract::backoff::retry_until(
            give_up,
            &mut delays,
            |error: &ConnectError| error.code == Code::Unavailable,
            |error, delay| tracing::warn!(call = method, %error, retry_in = ?delay, "Gitea unavailable; retrying"),
            || self.client.unary::<Req, Resp>(&procedure, request, &options),
        )
        .await
        .map_err(|error| self.classify(method, error))
    }

    fn classify(&self, call: &'static str, error: ConnectError) -> GiteaError {
        if is_unregistered(&error) {
            GiteaError::Unregistered { credential_file: self.credential_file.display().to_string(), message: error.message }
        } else {
            GiteaError::Call { call, error }
        }
    }
}

/// Gitea's own answer for a runner it does not know: "unregistered runner", as
/// `unauthenticated` or (servers that send gRPC status errors through connect-go) as
/// `unknown` with the gRPC-style text. gitea-runner takes any `unauthenticated` for it;
/// here a bare 401 — a proxy's, a load balancer's during a restart — is a transient
/// failure, retried, never the end of a registration.
pub fn is_unregistered(error: &ConnectError) -> bool {
    matches!(error.code, Code::Unauthenticated | Code::Unknown) && error.message.contains("unregistered runner")
}

/// What the facade, the keep-alive and the lifecycle need of Gitea: the two calls that
/// report on a task the controller's runner fetched. Gitea's client is the real one;
/// `controller run-local` answers them itself.
#[async_trait::async_trait]
pub trait TaskReports: Send + Sync + std::fmt::Debug {
    /// The runner uuid these reports are made as (Gitea accepts reports on a task only
    /// from the runner that fetched it).
    fn runner_uuid(&self) -> &str;
    /// What Gitea answered this runner's Declare with in [`proto::CAPABILITIES_HEADER`].
    fn server_capabilities(&self) -> &str {
        ""
    }
    async fn update_task(&self, request: &UpdateTaskRequest) -> Result<UpdateTaskResponse, GiteaError>;
    async fn update_log(&self, request: &UpdateLogRequest) -> Result<UpdateLogResponse, GiteaError>;
}

#[async_trait::async_trait]
impl TaskReports for Gitea {
    fn runner_uuid(&self) -> &str {
        &self.runner_uuid
    }

    fn server_capabilities(&self) -> &str {
        &self.server_capabilities
    }

    async fn update_task(&self, request: &UpdateTaskRequest) -> Result<UpdateTaskResponse, GiteaError> {
        Gitea::update_task(self, request).await
    }

    async fn update_log(&self, request: &UpdateLogRequest) -> Result<UpdateLogResponse, GiteaError> {
        Gitea::update_log(self, request).await
    }
}

/// Upper bound of the rows sent to Gitea in one UpdateLog. gitea-runner sends its whole
/// unacknowledged backlog at once; Gitea sits behind proxies with body limits (nginx's
/// default is 1 MiB), so larger batches go up in pieces.
pub const MAX_LOG_BATCH_BYTES: usize = 768 << 10;

/// How long one UpdateLog of an environment sends pieces on to Gitea (whose log store
/// can take a second per hundred short rows) before it answers what went through.
pub const LOG_CALL_BUDGET: std::time::Duration = std::time::Duration::from_secs(10);

/// Sends `request` in pieces of at most [`MAX_LOG_BATCH_BYTES`] for at most
/// [`LOG_CALL_BUDGET`] (see `proto::pieces::send_log_in_pieces`): the answer acknowledges
/// what Gitea took, and the runner resends the rest as it always does.
///
/// # Errors
/// When Gitea refused the first piece.
pub async fn update_log_in_pieces(reports: &dyn TaskReports, request: UpdateLogRequest) -> Result<UpdateLogResponse, GiteaError> {
    proto::pieces::send_log_in_pieces(request, MAX_LOG_BATCH_BYTES, LOG_CALL_BUDGET, |piece| async move { reports.update_log(&piece).await }).await
}

/// Fails a task for good and says why in its log: the reason goes at the index Gitea
/// acknowledges (asked first with an empty UpdateLog, which Gitea answers without
/// writing), so it is the last line of a log that already has rows; then the log is
/// sealed and the final state sent. Used when a task cannot run here, its environment
/// died, or its environment could not be made.
///
/// # Errors
/// When Gitea did not accept the final state.
pub async fn fail_task(reports: &dyn TaskReports, task_id: i64, reason: &str) -> Result<(), GiteaError> {
    use proto::runner::v1::{LogRow, Result as TaskResult, TaskState};
    let now = prost_types::Timestamp::from(std::time::SystemTime::now());
    let ask = UpdateLogRequest { task_id, index: 0, rows: Vec::new(), no_more: false };
    let written = match reports.update_log(&ask).await {
        Ok(ack) => {
            let log = UpdateLogRequest {
                task_id,
                index: ack.ack_index,
                rows: vec![LogRow { time: Some(now), content: format!("gitea-dynamic-runner: {reason}") }],
                no_more: true,
            };
            reports.update_log(&log).await.map(|_| ())
        }
        Err(error) => Err(error),
    };
    if let Err(error) = written {
        tracing::warn!(task_id, %error, "could not write the reason into the job log");
    }
    let state = UpdateTaskRequest {
        state: Some(TaskState { id: task_id, result: TaskResult::Failure as i32, started_at: Some(now), stopped_at: Some(now), steps: Vec::new() }),
        outputs: Default::default(),
    };
    reports.update_task(&state).await.map(|_| ())
}

/// Reports the end Gitea itself announced (`result`, a cancel) for a task whose runner
/// did not report its own before its environment was stopped. Gitea ≥ 1.27 keeps a
/// cancelled task `cancelling` until its runner reports (for up to its zombie timeout,
/// 10 minutes); any result ends it as cancelled. A task already done (1.23 cancels at
/// once) ignores it.
///
/// # Errors
/// When Gitea cannot be told.
pub async fn close_task(reports: &dyn TaskReports, task_id: i64, result: i32) -> Result<(), GiteaError> {
    let now = prost_types::Timestamp::from(std::time::SystemTime::now());
    let state = UpdateTaskRequest {
        state: Some(proto::runner::v1::TaskState { id: task_id, result, started_at: None, stopped_at: Some(now), steps: Vec::new() }),
        outputs: Default::default(),
    };
    reports.update_task(&state).await.map(|_| ())
}

/// Loads the stored credential, or registers with the token in `registration_token_file`
/// and stores the new credential; then Declares `labels`.
///
/// # Errors
/// See [`GiteaError`].
pub async fn connect(
    instance: &str,
    credential_file: &Path,
    registration_token_file: Option<&Path>,
    name: &str,
    labels: &[String],
) -> Result<(Gitea, Credential), GiteaError> {
    let anonymous = Gitea::new(instance, credential_file)?;
    let credential = match Credential::load(credential_file)? {
        Some(credential) => {
            tracing::info!(uuid = %credential.uuid, file = %credential_file.display(), "using the stored runner credential");
            credential
        }
        None => {
            let path = registration_token_file.ok_or_else(|| GiteaError::BadCredentialFile {
                path: credential_file.to_owned(),
                reason: "it does not exist and no registration token file is configured (registration_token_file)".into(),
            })?;
            let token = std::fs::read_to_string(path).map_err(|source| GiteaError::ReadFile { path: path.to_owned(), source })?;
            let mut credential = anonymous.register(name, token.trim(), labels).await?;
            credential.address = instance.to_owned();
            credential.store(credential_file)?;
            tracing::info!(uuid = %credential.uuid, file = %credential_file.display(), "registered with Gitea");
            credential
        }
    };
    let mut gitea = anonymous.authenticated(&credential)?;
    let (_, capabilities) = gitea.declare(labels).await?;
    if !capabilities.is_empty() {
        tracing::info!(%capabilities, "Gitea takes more than the runner protocol from its runners");
    }
    gitea.server_capabilities = capabilities;
    Ok((gitea, credential))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unregistered_detection_follows_gitea_runner() {
        let table: &[(Code, &str, bool)] = &[
            (Code::Unauthenticated, "unregistered runner", true),
            (Code::Unknown, "rpc error: code = Unauthenticated desc = unregistered runner", true),
            // A proxy's bare 401 (Connect maps it to unauthenticated): transient.
            (Code::Unauthenticated, "HTTP status 401 Unauthorized", false),
            (Code::Unauthenticated, "anything", false),
            (Code::PermissionDenied, "unregistered runner", false),
            (Code::Unavailable, "HTTP status 503", false),
        ];
        for &(code, message, want) in table {
            assert_eq!(is_unregistered(&ConnectError::new(code, message)), want, "{code} {message}");
        }
    }

    #[test]
    fn credential_file_round_trip_with_mode_0600() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state/runner.json");
        assert!(Credential::load(&path).unwrap().is_none());
        let credential = Credential { id: 7, uuid: "u".into(), name: "n".into(), token: "secret".into(), address: "http://g".into() };
        credential.store(&path).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(Credential::load(&path).unwrap(), Some(credential.clone()));
        assert!(!format!("{credential:?}").contains("secret"));
        std::fs::write(&path, "{}").unwrap();
        assert!(matches!(Credential::load(&path), Err(GiteaError::BadCredentialFile { .. })));
    }
}
