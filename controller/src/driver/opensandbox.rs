//! The OpenSandbox driver (placement `vm.opensandbox`): one sandbox per assignment
//! through the OpenSandbox Lifecycle API — in production a Kata or Firecracker VM per
//! job; the Docker runtime of opensandbox-server runs the same API with containers.
//!
//! - **Names.** The server picks sandbox ids, so the environment's name (derived from
//!   the assignment) is kept in the sandbox's metadata and every call finds the sandbox
//!   by it. A create first looks the name up: a create repeated after a crash (or after
//!   a create whose answer was lost) finds the first sandbox instead of making a second.
//! - **Contract.** The runner image, the supervisor as entrypoint (OpenSandbox runs its
//!   own bootstrap first, which `exec`s it, so it is still PID 1), the environment
//!   contract as env, resources and the job's ceiling as the sandbox's timeout.
//! - **Errors** keep the server's `code` and `message`. What a retry can fix (the
//!   server down, 429, 5xx, a rejected API key the operator can replace in its file)
//!   is `Unavailable`: the assignment waits in the queue. What it cannot (a request the
//!   server validates away: 400/422, an image that does not exist) is `Refused`: the
//!   task fails in Gitea with the server's words.
//! - The API key is read from a file, again after a 401/403 so a rotated key is
//!   picked up without a restart; it never appears in logs or errors.

use std::{collections::BTreeMap, path::PathBuf, sync::Arc, time::Duration};

use async_trait::async_trait;
use reqwest::{Method, StatusCode, Url};
use serde::{Deserialize, Serialize};

use super::{Driver, DriverError, Environment, EnvironmentSpec, LABEL_ASSIGNMENT, LABEL_MANAGED, Phase};
use crate::assignment::placement::Placement;

/// The metadata key holding the environment's name (the server names sandboxes itself).
pub const LABEL_ENVIRONMENT: &str = "gitea-dynamic-runner/environment";

/// The header OpenSandbox reads the API key from.
const API_KEY_HEADER: &str = "OPEN-SANDBOX-API-KEY";

/// The server's largest page.
const PAGE_SIZE: usize = 200;

/// How sandboxes are made.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenSandboxConfig {
    /// The Lifecycle API, e.g. `https://opensandbox.example.com` (with or without `/v1`).
    pub url: String,
    /// File holding the API key (`OPEN-SANDBOX-API-KEY`); read again after a 401/403.
    pub api_key_file: PathBuf,
    /// The runner image (as the sandbox runtime pulls it).
    pub image: String,
    /// The supervisor and the runner: OpenSandbox needs the entrypoint spelled out.
    #[serde(default = "super::default_command")]
    pub entrypoint: Vec<String>,
    /// `resourceLimits.cpu`, Kubernetes quantity syntax.
    #[serde(default = "default_cpu")]
    pub cpu: String,
    /// `resourceLimits.memory`, Kubernetes quantity syntax.
    #[serde(default = "default_memory")]
    pub memory: String,
    /// The sandbox's lifetime: the job's ceiling (the server removes it after that).
    #[serde(default = "default_timeout", with = "crate::config::duration")]
    pub timeout: Duration,
    /// More environment for the supervisor (e.g. `SUPERVISOR_DOCKER = "false"` where the
    /// sandbox cannot run a nested dockerd). Never secrets, never contract variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// How long one API request may take.
    #[serde(default = "default_request_timeout", with = "crate::config::duration")]
    pub request_timeout: Duration,
    /// `[opensandbox.spire]`: one SPIRE entry per sandbox, so that the supervisor inside
    /// gets exactly its job's SVID from the sandbox's own agent.
    #[serde(default)]
    pub spire: Option<crate::spire::SpireConfig>,
}

impl std::fmt::Debug for OpenSandboxConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenSandboxConfig")
            .field("url", &self.url)
            .field("api_key_file", &self.api_key_file)
            .field("image", &self.image)
            .field("cpu", &self.cpu)
            .field("memory", &self.memory)
            .field("timeout", &self.timeout)
            .field("spire", &self.spire)
            .finish_non_exhaustive()
    }
}

fn default_cpu() -> String {
    "2".into()
}
fn default_memory() -> String {
    "4Gi".into()
}
fn default_timeout() -> Duration {
    // Gitea's own job timeout.
    Duration::from_secs(3 * 3600)
}
fn default_request_timeout() -> Duration {
    Duration::from_secs(60)
}

impl OpenSandboxConfig {
    /// # Errors
    /// The setting that is wrong, and why.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let invalid = |setting: &str, message: String| Err((format!("opensandbox.{setting}"), message));
        if !(self.url.starts_with("http://") || self.url.starts_with("https://")) || Url::parse(&self.url).is_err() {
            return invalid("url", format!("{:?} must be the http(s) URL of the OpenSandbox Lifecycle API", self.url));
        }
        if self.image.trim().is_empty() {
            return invalid("image", "the runner image is required".into());
        }
        if self.entrypoint.is_empty() {
            return invalid("entrypoint", "must name the supervisor (the default does)".into());
        }
        if self.timeout < Duration::from_secs(60) {
            return invalid("timeout", "must be at least 1m (OpenSandbox's minimum)".into());
        }
        if self.request_timeout.is_zero() {
            return invalid("request_timeout", "must be positive".into());
        }
        if let Err(message) = super::check_extra_env(&self.env) {
            return invalid("env", message);
        }
        if let Some(spire) = &self.spire {
            spire.validate("opensandbox.spire")?;
        }
        Ok(())
    }
}

/// The API key, kept out of every `Debug` output.
struct ApiKey(String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

#[derive(Debug, Clone)]
pub struct OpenSandboxDriver {
    placement: Placement,
    http: reqwest::Client,
    /// `…/v1/` with a trailing slash, for joining.
    base: Url,
    key: Arc<std::sync::RwLock<ApiKey>>,
    config: OpenSandboxConfig,
}

/// A sandbox as the Lifecycle API describes it (only what the driver reads).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Sandbox {
    id: String,
    #[serde(default)]
    status: Status,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    #[serde(default)]
    created_at: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct Status {
    #[serde(default)]
    state: String,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    message: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Page {
    items: Vec<Sandbox>,
    #[serde(default)]
    pagination: Option<Pagination>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Pagination {
    #[serde(default)]
    has_next_page: bool,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct CreateRequest<'a> {
    image: ImageRef<'a>,
    entrypoint: &'a [String],
    resource_limits: BTreeMap<&'static str, &'a str>,
    env: BTreeMap<&'a str, &'a str>,
    metadata: &'a BTreeMap<String, String>,
    timeout: u64,
}

#[derive(Debug, Serialize)]
struct ImageRef<'a> {
    uri: &'a str,
}

/// A failed call: the HTTP status and the server's own code and message.
#[derive(Debug)]
struct ApiError {
    status: Option<StatusCode>,
    code: String,
    message: String,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.status {
            Some(status) if self.code.is_empty() => write!(f, "HTTP {status}: {}", self.message),
            Some(status) => write!(f, "HTTP {status} {}: {}", self.code, self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl ApiError {
    /// Reads `{code, message}` (service errors) or FastAPI's `{detail: [...]}`
    /// (validation errors) from a failed response.
    fn from_body(status: StatusCode, body: &str) -> ApiError {
        #[derive(Deserialize)]
        struct Body {
            code: Option<String>,
            message: Option<String>,
            detail: Option<serde_json::Value>,
        }
        match serde_json::from_str::<Body>(body) {
            Ok(Body { code, message, detail }) => {
                let message = match (message, detail) {
                    (Some(message), _) => message,
                    (None, Some(serde_json::Value::Array(items))) => items
                        .iter()
                        .map(|item| {
                            let location: Vec<String> = item["loc"]
                                .as_array()
                                .map(|l| l.iter().map(|p| p.as_str().map_or_else(|| p.to_string(), str::to_owned)).collect())
                                .unwrap_or_default();
                            format!("{}: {}", location.join("."), item["msg"].as_str().unwrap_or("invalid"))
                        })
                        .collect::<Vec<_>>()
                        .join("; "),
                    (None, Some(detail)) => detail.to_string(),
                    (None, None) => body.chars().take(300).collect(),
                };
                ApiError { status: Some(status), code: code.unwrap_or_default(), message }
            }
            Err(_) => ApiError { status: Some(status), code: String::new(), message: body.chars().take(300).collect() },
        }
    }

    /// Whether a retry later can succeed.
    fn is_retryable(&self) -> bool {
        let Some(status) = self.status else { return true };
        match status {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN | StatusCode::TOO_MANY_REQUESTS | StatusCode::REQUEST_TIMEOUT => true,
            StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY | StatusCode::NOT_FOUND | StatusCode::CONFLICT => false,
            // A runner image that does not exist will not appear by retrying; a registry
            // that cannot be reached may come back.
            _ if self.code.ends_with("IMAGE_PULL_FAILED") => !["not found", "manifest unknown", "pull access denied", "does not exist"]
                .iter()
                .any(|needle| self.message.to_ascii_lowercase().contains(needle)),
            _ => status.is_server_error(),
        }
    }
}

impl OpenSandboxDriver {
    /// Reads the API key and checks that the server answers `GET /health`.
    ///
    /// # Errors
    /// An invalid configuration, an unreadable key file, or a server that does not answer.
    pub async fn connect(config: OpenSandboxConfig) -> Result<Self, DriverError> {
        let placement = Placement::VM_OPENSANDBOX;
        let unavailable = |detail: String| DriverError::Unavailable { placement: placement.to_string(), detail };
        config.validate().map_err(|(setting, message)| unavailable(format!("{setting}: {message}")))?;
        let key = read_key(&config.api_key_file).map_err(unavailable)?;
        let tls = connect::client::default_tls().map_err(|e| unavailable(format!("cannot set up TLS: {e}")))?;
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .timeout(config.request_timeout)
            .connect_timeout(Duration::from_secs(10))
            .no_proxy()
            .build()
            .map_err(|e| unavailable(format!("cannot build the HTTP client: {e}")))?;
        let mut root = config.url.trim_end_matches('/').to_owned();
        if !root.ends_with("/v1") {
            root.push_str("/v1");
        }
        let base = Url::parse(&format!("{root}/")).map_err(|e| unavailable(format!("opensandbox.url {:?}: {e}", config.url)))?;
        let driver = OpenSandboxDriver { placement, http, base, key: Arc::new(std::sync::RwLock::new(ApiKey(key))), config };
        let health = base_health(&driver.base);
        match driver.http.get(health.clone()).send().await {
            Ok(response) if response.status().is_success() => Ok(driver),
            Ok(response) => Err(unavailable(format!("{health} answered {}: is opensandbox.url the Lifecycle API?", response.status()))),
            Err(error) => Err(unavailable(format!("the OpenSandbox server at {} does not answer: {}", driver.config.url, crate::error_chain(&error)))),
        }
    }

    fn unavailable(&self, detail: impl Into<String>) -> DriverError {
        DriverError::Unavailable { placement: self.placement.to_string(), detail: detail.into() }
    }

    fn classify(&self, name: &str, doing: &str, error: ApiError) -> DriverError {
        let hint = match error.status {
            Some(StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) => {
                format!(" (check the API key in {}; it is read again on the next attempt)", self.config.api_key_file.display())
            }
            Some(StatusCode::TOO_MANY_REQUESTS) => " (rate-limited; retrying later)".to_owned(),
            _ if error.code.ends_with("IMAGE_PULL_FAILED") => format!(" (can the sandbox runtime pull the runner image {}?)", self.config.image),
            _ => String::new(),
        };
        let detail = format!("{doing} {name}: {error}{hint}");
        if error.is_retryable() {
            self.unavailable(detail)
        } else {
            DriverError::Refused { placement: self.placement.to_string(), name: name.to_owned(), detail }
        }
    }

    /// One API call; a 401/403 re-reads the key file once and tries again.
    async fn call(&self, method: Method, url: Url, body: Option<&CreateRequest<'_>>) -> Result<(StatusCode, String), ApiError> {
        let mut reread = false;
        loop {
            let key = self.key.read().map_or_else(|_| String::new(), |k| k.0.clone());
            let mut request = self.http.request(method.clone(), url.clone()).header(API_KEY_HEADER, key);
            if let Some(body) = body {
                request = request.json(body);
            }
            let response = request.send().await.map_err(|e| ApiError {
                status: None,
                code: String::new(),
                message: format!("{method} {url}: {}", crate::error_chain(&e)),
            })?;
            let status = response.status();
            let text = response.text().await.map_err(|e| ApiError {
                status: Some(status),
                code: String::new(),
                message: format!("reading the answer: {}", crate::error_chain(&e)),
            })?;
            if status.is_success() {
                return Ok((status, text));
            }
            if matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) && !reread {
                reread = true;
                if let Ok(fresh) = read_key(&self.config.api_key_file)
                    && let Ok(mut key) = self.key.write()
                    && key.0 != fresh
                {
                    key.0 = fresh;
                    continue;
                }
            }
            return Err(ApiError::from_body(status, &text));
        }
    }

    /// Every sandbox whose metadata includes all of `metadata`, page by page.
    async fn find(&self, metadata: &BTreeMap<String, String>) -> Result<Vec<Sandbox>, ApiError> {
        let filter = metadata.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&");
        let mut found = Vec::new();
        for page in 1.. {
            let mut url = self.base.join("sandboxes").map_err(|e| ApiError { status: None, code: String::new(), message: e.to_string() })?;
            url.query_pairs_mut().append_pair("metadata", &filter).append_pair("page", &page.to_string()).append_pair("pageSize", &PAGE_SIZE.to_string());
            let (_, text) = self.call(Method::GET, url, None).await?;
            let page: Page =
                serde_json::from_str(&text).map_err(|e| ApiError { status: None, code: String::new(), message: format!("unexpected sandbox list: {e}") })?;
            let more = page.pagination.is_some_and(|p| p.has_next_page) && !page.items.is_empty();
            found.extend(page.items);
            if !more {
                break;
            }
        }
        Ok(found)
    }

    /// The sandboxes carrying environment `name`, oldest first (normally one).
    async fn by_name(&self, name: &str) -> Result<Vec<Sandbox>, DriverError> {
        let selector = BTreeMap::from([(LABEL_ENVIRONMENT.to_owned(), name.to_owned())]);
        let mut found = self.find(&selector).await.map_err(|e| self.classify(name, "looking up", e))?;
        found.sort_by(|a, b| a.created_at.cmp(&b.created_at));
        Ok(found)
    }

    async fn delete_id(&self, name: &str, id: &str) -> Result<(), DriverError> {
        let url = self.base.join(&format!("sandboxes/{id}")).map_err(|e| self.unavailable(e.to_string()))?;
        match self.call(Method::DELETE, url, None).await {
            Ok(_) => Ok(()),
            // Gone already (deleted meanwhile, or expired: the server keeps no tombstone).
            Err(ApiError { status: Some(StatusCode::NOT_FOUND), .. }) => Ok(()),
            Err(error) => Err(self.classify(name, "deleting sandbox", error)),
        }
    }
}

fn base_health(base: &Url) -> Url {
    // `/health` lives at the server's root, next to `/v1`.
    base.join("../health").unwrap_or_else(|_| base.clone())
}

fn read_key(path: &std::path::Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("opensandbox.api_key_file {}: {e}", path.display()))?;
    let key = text.trim();
    if key.is_empty() {
        return Err(format!("opensandbox.api_key_file {} is empty", path.display()));
    }
    Ok(key.to_owned())
}

/// The environment a sandbox is. Paused and transitional states count as running (the
/// sandbox still holds the job); `Unknown` too, so a server that cannot tell does not
/// fail a job that may be fine.
fn environment_of(sandbox: Sandbox) -> Environment {
    let state = sandbox.status.state.as_str();
    let phase = match state {
        "Terminated" | "Failed" => Phase::Exited,
        "Stopping" => Phase::Terminal,
        _ => Phase::Running,
    };
    let detail = if phase == Phase::Running {
        String::new()
    } else {
        let mut detail = format!("the sandbox {} is {state}", sandbox.id);
        if let Some(reason) = sandbox.status.reason.as_deref().filter(|r| !r.is_empty()) {
            detail.push_str(&format!(" ({reason})"));
        }
        if let Some(message) = sandbox.status.message.as_deref().filter(|m| !m.is_empty()) {
            detail.push_str(": ");
            detail.push_str(message);
        }
        detail
    };
    let exit_code = if phase == Phase::Running { None } else { sandbox.status.message.as_deref().and_then(exit_code_in) };
    Environment {
        name: sandbox.metadata.get(LABEL_ENVIRONMENT).cloned().unwrap_or_else(|| sandbox.id.clone()),
        assignment_id: sandbox.metadata.get(LABEL_ASSIGNMENT).cloned().unwrap_or_default(),
        labels: sandbox.metadata,
        phase,
        detail,
        exit_code,
    }
}

/// The code in the server's "Sandbox container exited with code 75." (the Lifecycle API
/// has no field for it; another wording gives none, and only the explanation is lost).
fn exit_code_in(message: &str) -> Option<i64> {
    let (_, after) = message.split_once("exited with code ")?;
    after.trim_end_matches('.').split_whitespace().next()?.trim_end_matches('.').parse().ok()
}

#[async_trait]
impl Driver for OpenSandboxDriver {
    fn placement(&self) -> Placement {
        self.placement
    }

    async fn create(&self, spec: &EnvironmentSpec) -> Result<Environment, DriverError> {
        if let Some(existing) = self.by_name(&spec.name).await?.into_iter().next() {
            return Ok(environment_of(existing));
        }
        let mut metadata = spec.labels.clone();
        metadata.insert(LABEL_ENVIRONMENT.to_owned(), spec.name.clone());
        let mut env: BTreeMap<&str, &str> = self.config.env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        env.extend(spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let request = CreateRequest {
            image: ImageRef { uri: &self.config.image },
            entrypoint: &self.config.entrypoint,
            resource_limits: BTreeMap::from([("cpu", self.config.cpu.as_str()), ("memory", self.config.memory.as_str())]),
            env,
            metadata: &metadata,
            timeout: self.config.timeout.as_secs(),
        };
        let url = self.base.join("sandboxes").map_err(|e| self.unavailable(e.to_string()))?;
        let created = match self.call(Method::POST, url, Some(&request)).await {
            Ok((_, text)) => serde_json::from_str::<Sandbox>(&text).map_err(|e| self.unavailable(format!("creating {}: unexpected answer: {e}", spec.name)))?,
            Err(error) => {
                // The server may have made it before failing (a lost answer, a timeout):
                // whatever exists under the name is the environment; if nothing does,
                // the error stands.
                if let Ok(Some(existing)) = self.by_name(&spec.name).await.map(|found| found.into_iter().next()) {
                    return Ok(environment_of(existing));
                }
                return Err(self.classify(&spec.name, "creating sandbox", error));
            }
        };
        // The create answer carries state and metadata; a GET would add nothing the
        // driver reads.
        let mut environment = environment_of(Sandbox { metadata: created.metadata.clone(), ..created });
        if environment.name != spec.name {
            environment.name = spec.name.clone();
        }
        Ok(environment)
    }

    async fn get(&self, name: &str) -> Result<Option<Environment>, DriverError> {
        let mut found = self.by_name(name).await?;
        if found.len() > 1 {
            // Two sandboxes for one environment can only come from two creates racing;
            // only one can claim the task, the other is removed.
            for extra in found.split_off(1) {
                tracing::warn!(environment = name, sandbox = %extra.id, "removing a second sandbox of one environment");
                self.delete_id(name, &extra.id).await?;
            }
        }
        Ok(found.into_iter().next().map(environment_of))
    }

    async fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<Environment>, DriverError> {
        let mut metadata = selector.clone();
        metadata.insert(LABEL_MANAGED.to_owned(), "true".to_owned());
        let found = self.find(&metadata).await.map_err(|e| self.classify("sandboxes", "listing", e))?;
        Ok(found.into_iter().map(environment_of).collect())
    }

    /// The Lifecycle API has no graceful stop: deleting is the stop (with Kata, the VM
    /// is shut down; the supervisor's drain does not run).
    async fn stop(&self, name: &str) -> Result<(), DriverError> {
        self.delete(name).await
    }

    async fn delete(&self, name: &str) -> Result<(), DriverError> {
        for sandbox in self.by_name(name).await? {
            self.delete_id(name, &sandbox.id).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_errors_keep_their_words_and_say_whether_to_retry() {
        let cases: &[(u16, &str, &str, bool)] = &[
            (401, r#"{"code":"INVALID_API_KEY","message":"Invalid API key"}"#, "HTTP 401 Unauthorized INVALID_API_KEY: Invalid API key", true),
            (403, r#"{"code":"FORBIDDEN","message":"no"}"#, "FORBIDDEN: no", true),
            (404, r#"{"code":"DOCKER::SANDBOX_NOT_FOUND","message":"Sandbox x not found"}"#, "SANDBOX_NOT_FOUND", false),
            (409, r#"{"code":"CONFLICT","message":"exists"}"#, "CONFLICT", false),
            (
                422,
                r#"{"detail":[{"type":"missing","loc":["body","resourceLimits"],"msg":"Field required","input":{}}]}"#,
                "HTTP 422 Unprocessable Entity: body.resourceLimits: Field required",
                false,
            ),
            (400, r#"{"code":"SANDBOX::UNSUPPORTED_POOL_REF","message":"poolRef is Kubernetes only"}"#, "UNSUPPORTED_POOL_REF", false),
            (429, r#"{"code":"RATE_LIMITED","message":"slow down"}"#, "RATE_LIMITED", true),
            (503, r#"{"code":"DOCKER::SANDBOX_EXECD_START_FAILED","message":"execd"}"#, "EXECD_START_FAILED", true),
            (500, "Internal Server Error", "HTTP 500 Internal Server Error: Internal Server Error", true),
            (
                500,
                r#"{"code":"DOCKER::SANDBOX_IMAGE_PULL_FAILED","message":"pull access denied for x, repository does not exist"}"#,
                "IMAGE_PULL_FAILED",
                false,
            ),
            (500, r#"{"code":"DOCKER::SANDBOX_IMAGE_PULL_FAILED","message":"dial tcp: lookup registry-1.docker.io: no such host"}"#, "no such host", true),
        ];
        for &(status, body, shown, retry) in cases {
            let error = ApiError::from_body(StatusCode::from_u16(status).unwrap(), body);
            assert!(error.to_string().contains(shown), "{status} {body}: {error}");
            assert_eq!(error.is_retryable(), retry, "{status} {body}");
        }
        let down = ApiError { status: None, code: String::new(), message: "connection refused".into() };
        assert!(down.is_retryable());
    }

    #[test]
    fn states_map_to_phases_with_the_servers_reason() {
        let sandbox = |state: &str, reason: &str, message: &str| Sandbox {
            id: "sb-1".into(),
            status: Status { state: state.into(), reason: Some(reason.into()), message: Some(message.into()) },
            metadata: BTreeMap::from([
                (LABEL_ENVIRONMENT.to_owned(), "gdr-x-gitea-task-1".to_owned()),
                (LABEL_ASSIGNMENT.to_owned(), "gitea-task-1".to_owned()),
            ]),
            created_at: String::new(),
        };
        for state in ["Pending", "Running", "Pausing", "Paused", "Resuming", "Unknown", ""] {
            let environment = environment_of(sandbox(state, "", ""));
            assert_eq!((environment.phase, environment.detail.as_str()), (Phase::Running, ""), "{state}");
        }
        let failed = environment_of(sandbox("Failed", "CONTAINER_EXITED_ERROR", "Sandbox container exited with code 3."));
        assert_eq!(failed.phase, Phase::Exited);
        assert_eq!(failed.detail, "the sandbox sb-1 is Failed (CONTAINER_EXITED_ERROR): Sandbox container exited with code 3.");
        assert_eq!((failed.name.as_str(), failed.assignment_id.as_str()), ("gdr-x-gitea-task-1", "gitea-task-1"));
        assert_eq!(failed.exit_code, Some(3));
        let unclaimed = environment_of(sandbox("Failed", "CONTAINER_EXITED_ERROR", "Sandbox container exited with code 75."));
        assert!(
            unclaimed
                .why_unclaimed()
                .ends_with("could not claim the job from the controller: the facade refused it, or is unreachable from the environment at facade.url"),
            "{}",
            unclaimed.why_unclaimed()
        );
        assert_eq!(environment_of(sandbox("Terminated", "CONTAINER_EXITED", "")).exit_code, None);
        assert_eq!(environment_of(sandbox("Terminated", "CONTAINER_EXITED", "")).phase, Phase::Exited);
        assert_eq!(environment_of(sandbox("Stopping", "", "")).phase, Phase::Terminal);
    }

    fn config() -> OpenSandboxConfig {
        toml::from_str(
            r#"
url = "http://127.0.0.1:8080"
api_key_file = "/etc/gdr/opensandbox.key"
image = "gitea-dynamic-runner/runner:latest"
"#,
        )
        .unwrap()
    }

    #[test]
    fn settings_are_validated_with_their_names() {
        let defaults = config();
        assert!(defaults.validate().is_ok());
        assert_eq!(defaults.entrypoint[..3], ["/usr/local/bin/supervisor", "run", "--"]);
        assert_eq!((defaults.cpu.as_str(), defaults.memory.as_str(), defaults.timeout), ("2", "4Gi", Duration::from_secs(10_800)));
        type Change = fn(&mut OpenSandboxConfig);
        let cases: &[(Change, &str)] = &[
            (|c| c.url = "opensandbox:8080".into(), "opensandbox.url"),
            (|c| c.image = " ".into(), "opensandbox.image"),
            (|c| c.entrypoint.clear(), "opensandbox.entrypoint"),
            (|c| c.timeout = Duration::from_secs(30), "opensandbox.timeout"),
            (|c| c.request_timeout = Duration::ZERO, "opensandbox.request_timeout"),
            (|c| _ = c.env.insert("CI_RUNNER_CAPABILITY".into(), "x".into()), "opensandbox.env"),
            (|c| _ = c.env.insert("GITEA_RUNNER_TOKEN".into(), "x".into()), "opensandbox.env"),
        ];
        for &(change, setting) in cases {
            let mut config = config();
            change(&mut config);
            let (named, message) = config.validate().expect_err(setting);
            assert_eq!(named, setting, "{message}");
        }
    }

    #[test]
    fn health_is_next_to_the_versioned_api() {
        let base = Url::parse("https://osb.example.com/prefix/v1/").unwrap();
        assert_eq!(base_health(&base).as_str(), "https://osb.example.com/prefix/health");
    }
}
