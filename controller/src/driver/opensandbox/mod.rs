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

//!
//! Layout: [`config`] (the `[opensandbox]` settings and their checks), [`api`] (the
//! Lifecycle API's messages and errors), [`phase`] (what a sandbox's state means for
//! its job); this module is the driver that calls the API.

mod api;
mod config;
mod phase;

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use async_trait::async_trait;
use reqwest::{Method, StatusCode, Url};

pub use self::config::OpenSandboxConfig;
use self::{
    api::{ApiError, CreateRequest, ImageRef, Page, Sandbox},
    phase::environment_of,
};
use super::{Driver, DriverError, Environment, EnvironmentSpec, LABEL_MANAGED};
use crate::assignment::placement::Placement;

/// The metadata key holding the environment's name (the server names sandboxes itself).
pub const LABEL_ENVIRONMENT: &str = "gitea-dynamic-runner/environment";

/// The header OpenSandbox reads the API key from.
const API_KEY_HEADER: &str = "OPEN-SANDBOX-API-KEY";

/// The server's largest page.
const PAGE_SIZE: usize = 200;

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

impl OpenSandboxDriver {
    /// Reads the API key and checks that the server answers `GET /health`.
    ///
    /// # Errors
    /// An invalid configuration, an unreadable key file, or a server that does not answer.
    pub async fn connect(config: OpenSandboxConfig) -> Result<Self, DriverError> {
        let placement = Placement::VM_OPENSANDBOX;
        let unavailable = |detail: String| DriverError::Unavailable { placement: placement.to_string(), detail };
        crate::setting::Problems::check(|problems| config.validate(problems)).map_err(|problems| unavailable(problems.to_string()))?;
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
    fn health_is_next_to_the_versioned_api() {
        let base = Url::parse("https://osb.example.com/prefix/v1/").unwrap();
        assert_eq!(base_health(&base).as_str(), "https://osb.example.com/prefix/health");
    }
}
