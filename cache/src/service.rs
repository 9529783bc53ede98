//! The cache service: the rooms of one cache put together, a job's request told apart by
//! its [`Call`] and handed to the API's adapter ([`crate::v1`], [`crate::v2`]) over the
//! rooms that do the work — uploads, restores, downloads — with at most
//! [`MAX_REQUESTS_PER_JOB`] of a job's requests (and [`MAX_REQUESTS`] of all jobs') in
//! progress at once, every refusal counted by its reason and answered in its API's
//! format; and the sweep, run over the same rooms. Its file I/O runs on a runtime of its
//! own ([`Io`]) when it has one, so that however many requests jobs make, the blocking
//! threads the controller's store needs stay free.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError},
};

use bytes::Bytes;
use contract::error_chain;

use crate::{
    api::{Call, call_of},
    backend::Backend,
    download,
    error::CacheError,
    http::{BoxError, Response, hold, message},
    metrics::CacheMetrics,
    refusal::Refusal,
    restore::Restores,
    scope::{Limits, Scope},
    store::Storage,
    sweep::{Sweep, Swept},
    uploads::{KeepFree, Uploads},
    v1, v2,
};

/// A job's requests in progress at once (the toolkit makes at most four uploads at once,
/// or one download).
pub const MAX_REQUESTS_PER_JOB: usize = 16;
/// All jobs' requests in progress at once.
pub const MAX_REQUESTS: usize = 512;

/// The cache service.
#[derive(Debug)]
pub struct Cache {
    storage: Arc<Storage>,
    limits: Limits,
    metrics: Arc<CacheMetrics>,
    uploads: Uploads,
    restores: Restores,
    io: Option<tokio::runtime::Handle>,
    /// The runtime `io` is of, when the cache owns it.
    _io_runtime: Option<Io>,
    requests: Arc<Requests>,
}

/// Requests in progress, by job.
#[derive(Debug, Default)]
struct Requests {
    by_job: Mutex<HashMap<String, usize>>,
}

/// One request in progress, until its answer (a download: its last byte) is done.
#[derive(Debug)]
struct InProgress {
    requests: Arc<Requests>,
    job: String,
}

impl Requests {
    fn counts(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.by_job.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn begin(self: &Arc<Self>, job: &str) -> Result<InProgress, Refusal> {
        let mut counts = self.counts();
        let all: usize = counts.values().sum();
        let mine = counts.get(job).copied().unwrap_or(0);
        if mine >= MAX_REQUESTS_PER_JOB {
            return Err(Refusal::too_much("job_requests", format!("this job has {mine} cache requests in progress, the most it may have at once")));
        }
        if all >= MAX_REQUESTS {
            return Err(Refusal::too_much("requests", format!("the cache has {all} requests in progress, the most it takes at once; try again shortly")));
        }
        *counts.entry(job.to_owned()).or_default() += 1;
        Ok(InProgress { requests: Arc::clone(self), job: job.to_owned() })
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        let mut counts = self.requests.counts();
        if let Some(count) = counts.get_mut(&self.job) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.job);
            }
        }
    }
}

impl Cache {
    pub fn new(backend: Backend, limits: Limits, metrics: Arc<CacheMetrics>) -> Cache {
        let storage = Arc::new(Storage::new(Arc::clone(&backend.store)));
        let uploads = Uploads::new(Arc::clone(&storage), limits, Arc::clone(&metrics), backend.directory.clone(), backend.write_chunk());
        let restores = Restores::new(Arc::clone(&storage), Arc::clone(&metrics));
        metrics.max_bytes.set(i64::try_from(limits.max_total).unwrap_or(i64::MAX));
        Cache { storage, limits, metrics, uploads, restores, io: None, _io_runtime: None, requests: Arc::default() }
    }

    /// Runs the cache's requests and file I/O on `io`, which it keeps.
    pub fn with_io(mut self, io: Io) -> Cache {
        self.io = Some(io.handle().clone());
        self._io_runtime = Some(io);
        self
    }

    /// Keeps `keep_free` on a directory's filesystem.
    pub fn keep_free(mut self, keep_free: KeepFree) -> Cache {
        self.uploads = self.uploads.keep_free(keep_free);
        self
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    pub fn metrics(&self) -> &Arc<CacheMetrics> {
        &self.metrics
    }

    /// Answers one request of a job in `scope` on the cache's own runtime (see [`Io`]).
    /// `base` is the cache's URL as the job reaches it.
    pub async fn serve<B>(self: Arc<Self>, scope: Scope, base: String, request: http::Request<B>) -> Response
    where
        B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<BoxError> + Send,
    {
        let Some(io) = self.io.clone() else { return self.handle(&scope, &base, request).await };
        let cache = Arc::clone(&self);
        match io.spawn(async move { cache.handle(&scope, &base, request).await }).await {
            Ok(response) => response,
            Err(error) => message(500, format!("the cache failed: {error}")),
        }
    }

    /// Answers one request of a job in `scope`. `base` is the cache's URL as the job
    /// reaches it (the download and upload URLs it is given start with it).
    pub async fn handle<B>(&self, scope: &Scope, base: &str, request: http::Request<B>) -> Response
    where
        B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<BoxError>,
    {
        let (parts, body) = request.into_parts();
        let call = call_of(&parts.method, parts.uri.path());
        self.metrics.request(call.api());
        let in_progress = match self.requests.begin(&scope.job) {
            Ok(in_progress) => in_progress,
            Err(refusal) => return self.refused(&call, scope, &refusal),
        };
        let answered = self.route(&call, scope, base.trim_end_matches('/'), &parts, body).await;
        self.metrics.uploading_bytes.set(i64::try_from(self.uploads.in_flight().bytes).unwrap_or(i64::MAX));
        match answered {
            Ok(response) => response.map(|body| hold(body, in_progress)),
            Err(CacheError::Refused(refusal)) => self.refused(&call, scope, &refusal),
            Err(error) => {
                let path = parts.uri.path();
                tracing::warn!(repository = %scope.repository, %path, error = %error_chain(&error), "cache request failed");
                message(500, format!("the cache failed: {}", error_chain(&error)))
            }
        }
    }

    /// `call`, run by the room that does it through its API's adapter.
    async fn route<B>(&self, call: &Call, scope: &Scope, base: &str, parts: &http::request::Parts, body: B) -> Result<Response, CacheError>
    where
        B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<BoxError>,
    {
        let query = parts.uri.query().unwrap_or("");
        match call {
            Call::Lookup => v1::lookup(&self.restores, scope, base, query).await,
            Call::Reserve => v1::reserve(&self.uploads, scope, body).await,
            Call::Chunk(id) => v1::upload(&self.uploads, scope, id, &parts.headers, body).await,
            Call::Commit(id) => v1::commit(&self.uploads, scope, id, body).await,
            Call::Download { id, head_only } => {
                let archive = self.restores.archive(scope, id).await?;
                let io = self.io.clone().unwrap_or_else(tokio::runtime::Handle::current);
                download::serve(Arc::clone(self.storage.store()), Arc::clone(&self.metrics), &io, archive, *head_only, &parts.headers)
            }
            Call::Blob(id) => v2::blob(&self.uploads, scope, id, query, &parts.headers, body).await,
            Call::Create => v2::create(&self.uploads, scope, base, body).await,
            Call::Finalize => v2::finalize(&self.uploads, scope, body).await,
            Call::DownloadUrl => v2::download_url(&self.restores, scope, base, body).await,
            Call::UnknownMethod(method) => Err(Refusal::new(404, "malformed", format!("the cache service has no method {method}")).into()),
            Call::Unknown => Err(Refusal::new(404, "malformed", format!("the cache has no {} {}", parts.method, parts.uri.path())).into()),
        }
    }

    /// `refusal`, counted, in the format of `call`'s API.
    fn refused(&self, call: &Call, scope: &Scope, refusal: &Refusal) -> Response {
        self.metrics.refused(refusal.reason);
        if refusal.status == 429 || refusal.status == 507 {
            tracing::info!(repository = %scope.repository, job = %scope.job, reason = refusal.reason, "cache request refused: {}", refusal.message);
        }
        match call {
            Call::Create | Call::Finalize | Call::DownloadUrl | Call::UnknownMethod(_) => v2::refused(refusal),
            Call::Blob(_) => v2::refused_blob(refusal),
            _ => v1::refused(refusal),
        }
    }

    /// The sweep over this cache's rooms.
    fn sweeper(&self) -> Sweep<'_> {
        Sweep { storage: &self.storage, uploads: &self.uploads, metrics: &self.metrics, limits: self.limits }
    }

    /// One sweep over the whole store ([`crate::sweep`]).
    ///
    /// # Errors
    /// When the store cannot be listed (what was deleted before stays deleted).
    pub async fn sweep(&self) -> Result<Swept, CacheError> {
        self.sweeper().once().await
    }

    /// Sweeps every `interval`, and soon after a commit, until `shutdown`.
    pub async fn sweep_loop(&self, interval: std::time::Duration, shutdown: tokio_util::sync::CancellationToken) {
        self.sweeper().every(interval, shutdown).await;
    }
}

/// The cache's own runtime: a worker and at most `blocking_threads` threads for its file
/// I/O (object_store's directory calls and the downloads' reads block), apart from the
/// runtime the controller's store writes on.
#[derive(Debug)]
pub struct Io {
    runtime: Option<tokio::runtime::Runtime>,
}

impl Io {
    /// # Errors
    /// When the runtime's threads cannot be started.
    pub fn new(blocking_threads: usize) -> std::io::Result<Io> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(blocking_threads.max(1))
            .thread_name("cache-io")
            .enable_all()
            .build()?;
        Ok(Io { runtime: Some(runtime) })
    }
}

impl Drop for Io {
    fn drop(&mut self) {
        // Dropped on the controller's runtime, where a runtime may not wait for its threads.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl std::ops::Deref for Io {
    type Target = tokio::runtime::Runtime;

    fn deref(&self) -> &tokio::runtime::Runtime {
        self.runtime.as_ref().expect("taken only when dropped")
    }
}
