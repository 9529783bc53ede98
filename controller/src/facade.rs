//! The facade: the only path from environments back to Gitea (architecture §2).
//!
//! Every call carries the assignment capability, which must verify for that
//! assignment; over SPIFFE mTLS the peer's SPIFFE ID must also equal the identity
//! derived for the assignment. Claim hands the Task over exactly once (a retry by the
//! same holder gets the same Task; anyone else is refused); UpdateTask and UpdateLog
//! are forwarded with the controller's runner credential for the claimed task only,
//! and Gitea's replies, cancellation included, go back unchanged. After Gitea accepts
//! the terminal state, the record becomes terminal, the environment is marked
//! terminal and the pool slot is released.

use std::{collections::HashMap, sync::Arc, time::Duration};

use proto::{
    facade::v1::{
        AssignmentCredential, ClaimRequest, ClaimResponse, Phase, ReportPhaseRequest, ReportPhaseResponse,
        UpdateLogRequest, UpdateLogResponse, UpdateTaskRequest, UpdateTaskResponse,
        facade_service_server::{FacadeService, FacadeServiceServer},
    },
    runner::v1::{Result as TaskResult, Task},
};
use tonic::{Request, Response, Status};

use crate::{
    capability::CapabilityKey,
    driver::Driver,
    envelope::Assignment,
    gitea::{Gitea, GiteaError},
    pool::Pool,
    store::{State, Store, StoreError, Versioned, Record, now_ms},
};

/// Upper bound of one facade request (gitea-runner's UpdateLog batches are far smaller).
pub const MAX_REQUEST_BYTES: usize = 4 << 20;

/// Who is calling, as the transport established it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// Over SPIFFE mTLS: the SPIFFE ID of the client's X.509 SVID.
    Spiffe(String),
    /// Over the local unix socket (docker driver without SPIFFE): capability only.
    Local,
}

/// The facade's state, shared by its listeners.
#[derive(Debug)]
pub struct Facade {
    store: Arc<dyn Store>,
    gitea: Gitea,
    key: Arc<CapabilityKey>,
    trust_domain: String,
    drivers: HashMap<String, Arc<dyn Driver>>,
    pools: HashMap<String, Arc<Pool>>,
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

/// Seconds since `from_ms`, for the histograms.
fn seconds_since(from_ms: i64) -> f64 {
    (now_ms() - from_ms).max(0) as f64 / 1000.0
}

impl Facade {
    pub fn new(
        store: Arc<dyn Store>,
        gitea: Gitea,
        key: Arc<CapabilityKey>,
        trust_domain: String,
        drivers: HashMap<String, Arc<dyn Driver>>,
        pools: HashMap<String, Arc<Pool>>,
    ) -> Self {
        Facade { store, gitea, key, trust_domain, drivers, pools, metrics: None }
    }

    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// The tonic service; the transport must put a [`Peer`] into each request's extensions.
    pub fn service(self: Arc<Self>) -> FacadeServiceServer<Service> {
        FacadeServiceServer::new(Service(self)).max_decoding_message_size(MAX_REQUEST_BYTES)
    }

    /// Capability and peer identity, then the record and its decoded assignment.
    async fn authorize(&self, peer: &Peer, credential: Option<&AssignmentCredential>) -> Result<(Versioned<Record>, Assignment), Status> {
        let credential = credential.ok_or_else(|| Status::unauthenticated("the request carries no credential"))?;
        let id = credential.assignment_id.as_str();
        if id.is_empty() || id.len() > 128 {
            return Err(Status::invalid_argument("credential.assignment_id must be 1 to 128 bytes"));
        }
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        self.key
            .verify(&credential.capability, id, now)
            .map_err(|error| Status::unauthenticated(format!("capability refused for {id}: {error}")))?;
        let record = self
            .store
            .get(id)
            .await
            .map_err(store_status)?
            .ok_or_else(|| Status::not_found(format!("no assignment {id}")))?;
        let assignment = Assignment::decode(&record.value.envelope, &self.trust_domain)
            .map_err(|error| Status::internal(format!("stored assignment {id} is invalid: {}", crate::error_chain(&error))))?;
        if let Peer::Spiffe(peer_id) = peer
            && *peer_id != assignment.identity.spiffe_id
        {
            tracing::warn!(assignment_id = id, peer = %peer_id, expected = %assignment.identity.spiffe_id, "facade refused a peer with the wrong SPIFFE ID");
            return Err(Status::permission_denied(format!(
                "peer {peer_id} is not the identity of {id} ({})",
                assignment.identity.spiffe_id
            )));
        }
        Ok((record, assignment))
    }

    pub async fn claim(&self, peer: &Peer, request: ClaimRequest) -> Result<ClaimResponse, Status> {
        let (mut record, assignment) = self.authorize(peer, request.credential.as_ref()).await?;
        let holder = request.holder;
        if holder.len() < 16 || holder.len() > 128 {
            return Err(Status::invalid_argument("holder must be 16 to 128 characters"));
        }
        loop {
            match &record.value.state {
                State::Claimed { holder: current, claimed_at_ms } if *current == holder => {
                    return Ok(claim_response(assignment.task.clone(), claimed_at_ms.to_owned()));
                }
                State::Claimed { .. } => {
                    tracing::warn!(assignment_id = %assignment.id, "a second holder tried to claim");
                    return Err(Status::failed_precondition(format!("{} is already claimed by another holder", assignment.id)));
                }
                State::Terminal { result } => {
                    return Err(Status::failed_precondition(format!("{} is finished ({result})", assignment.id)));
                }
                State::Pending => {
                    let claimed_at_ms = now_ms();
                    let mut next = record.value.clone();
                    next.state = State::Claimed { holder: holder.clone(), claimed_at_ms };
                    next.updated_at_ms = claimed_at_ms;
                    match self.store.update(&next, record.revision).await {
                        Ok(_) => {
                            tracing::info!(assignment_id = %assignment.id, task_id = assignment.task.id, "claimed");
                            crate::failpoint::hit("after-claim");
                            if let Some(metrics) = &self.metrics
                                && record.value.created_at_ms > 0
                            {
                                metrics.claim_latency.observe(seconds_since(record.value.created_at_ms));
                            }
                            return Ok(claim_response(assignment.task.clone(), claimed_at_ms));
                        }
                        Err(StoreError::Conflict { .. }) => {
                            record = self.store.get(&assignment.id).await.map_err(store_status)?.ok_or_else(|| Status::not_found("assignment vanished"))?;
                        }
                        Err(error) => return Err(store_status(error)),
                    }
                }
            }
        }
    }

    async fn claimed(&self, peer: &Peer, credential: Option<&AssignmentCredential>, task_id: i64) -> Result<(Versioned<Record>, Assignment), Status> {
        let (record, assignment) = self.authorize(peer, credential).await?;
        if task_id != assignment.task.id {
            tracing::warn!(assignment_id = %assignment.id, task_id, "refused a report for another task");
            return Err(Status::permission_denied(format!("{} may only report task {}, not {task_id}", assignment.id, assignment.task.id)));
        }
        match record.value.state {
            State::Claimed { .. } | State::Terminal { .. } => Ok((record, assignment)),
            State::Pending => Err(Status::failed_precondition(format!("{} is not claimed yet", assignment.id))),
        }
    }

    pub async fn update_task(&self, peer: &Peer, request: UpdateTaskRequest) -> Result<UpdateTaskResponse, Status> {
        let inner = request.request.ok_or_else(|| Status::invalid_argument("request is required"))?;
        let task_id = inner.state.as_ref().map_or(0, |s| s.id);
        let (record, assignment) = self.claimed(peer, request.credential.as_ref(), task_id).await?;
        let result = inner.state.as_ref().map_or(0, |s| s.result);
        let response = self.gitea.update_task(&inner).await.map_err(gitea_status)?;
        if result != TaskResult::Unspecified as i32 {
            self.finish(record, &assignment, result).await;
        }
        Ok(UpdateTaskResponse { response: Some(response) })
    }

    pub async fn update_log(&self, peer: &Peer, request: UpdateLogRequest) -> Result<UpdateLogResponse, Status> {
        let inner = request.request.ok_or_else(|| Status::invalid_argument("request is required"))?;
        self.claimed(peer, request.credential.as_ref(), inner.task_id).await?;
        let response = self.gitea.update_log(&inner).await.map_err(gitea_status)?;
        Ok(UpdateLogResponse { response: Some(response) })
    }

    pub async fn report_phase(&self, peer: &Peer, request: ReportPhaseRequest) -> Result<ReportPhaseResponse, Status> {
        let (record, assignment) = self.authorize(peer, request.credential.as_ref()).await?;
        let phase = Phase::try_from(request.phase).unwrap_or(Phase::Unspecified);
        if phase == Phase::Unspecified {
            return Err(Status::invalid_argument("phase is required"));
        }
        if request.detail.len() > 4096 {
            return Err(Status::invalid_argument("detail is longer than 4096 bytes"));
        }
        if phase == Phase::RunnerStarted
            && let Some(metrics) = &self.metrics
            && record.value.created_at_ms > 0
        {
            metrics.job_startup.observe(seconds_since(record.value.created_at_ms));
        }
        tracing::info!(assignment_id = %assignment.id, task_id = assignment.task.id, phase = phase.as_str_name(), exit_code = request.exit_code, detail = %request.detail, "environment phase");
        Ok(ReportPhaseResponse {})
    }

    /// Gitea accepted a final state: record it, mark the environment, free the slot.
    async fn finish(&self, mut record: Versioned<Record>, assignment: &Assignment, result: i32) {
        let name = TaskResult::try_from(result).map_or("RESULT_UNKNOWN", |r| r.as_str_name()).to_owned();
        for _ in 0..10 {
            if matches!(record.value.state, State::Terminal { .. }) {
                break;
            }
            let mut next = record.value.clone();
            next.state = State::Terminal { result: name.clone() };
            next.updated_at_ms = now_ms();
            match self.store.update(&next, record.revision).await {
                Ok(_) => break,
                Err(StoreError::Conflict { .. }) => match self.store.get(&assignment.id).await {
                    Ok(Some(fresh)) => record = fresh,
                    _ => break,
                },
                Err(error) => {
                    tracing::error!(assignment_id = %assignment.id, %error, "cannot record the terminal state");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        let placement = assignment.placement.to_string();
        if let (Some(driver), Some(environment)) = (self.drivers.get(&placement), record.value.environment.as_ref())
            && let Err(error) = driver.mark_terminal(environment).await
        {
            tracing::warn!(assignment_id = %assignment.id, %error, "cannot mark the environment terminal; the reconciler will");
        }
        if let Some(pool) = self.pools.get(&placement) {
            pool.release(&assignment.id);
        }
        tracing::info!(assignment_id = %assignment.id, task_id = assignment.task.id, result = %name, "assignment finished");
    }
}

fn claim_response(task: Task, claimed_at_ms: i64) -> ClaimResponse {
    ClaimResponse {
        task: Some(task),
        claimed_at: Some(prost_types::Timestamp {
            seconds: claimed_at_ms.div_euclid(1000),
            nanos: i32::try_from(claimed_at_ms.rem_euclid(1000) * 1_000_000).unwrap_or(0),
        }),
    }
}

fn store_status(error: StoreError) -> Status {
    match error {
        StoreError::Unavailable { .. } => Status::unavailable(crate::error_chain(&error)),
        other => Status::internal(crate::error_chain(&other)),
    }
}

/// Gitea's errors reach the runner as the same codes it would get from Gitea.
fn gitea_status(error: GiteaError) -> Status {
    match &error {
        GiteaError::Call { error: inner, .. } => Status::new(tonic::Code::from_i32(inner.code.grpc()), inner.message.clone()),
        _ => Status::unavailable(error.to_string()),
    }
}

/// The tonic adapter: reads the [`Peer`] the transport attached.
#[derive(Debug, Clone)]
pub struct Service(Arc<Facade>);

fn peer_of<T>(request: &Request<T>) -> Result<Peer, Status> {
    request
        .extensions()
        .get::<Peer>()
        .cloned()
        .ok_or_else(|| Status::unauthenticated("the transport established no peer identity"))
}

#[tonic::async_trait]
impl FacadeService for Service {
    async fn claim(&self, request: Request<ClaimRequest>) -> Result<Response<ClaimResponse>, Status> {
        let peer = peer_of(&request)?;
        self.0.claim(&peer, request.into_inner()).await.map(Response::new)
    }

    async fn update_task(&self, request: Request<UpdateTaskRequest>) -> Result<Response<UpdateTaskResponse>, Status> {
        let peer = peer_of(&request)?;
        self.0.update_task(&peer, request.into_inner()).await.map(Response::new)
    }

    async fn update_log(&self, request: Request<UpdateLogRequest>) -> Result<Response<UpdateLogResponse>, Status> {
        let peer = peer_of(&request)?;
        self.0.update_log(&peer, request.into_inner()).await.map(Response::new)
    }

    async fn report_phase(&self, request: Request<ReportPhaseRequest>) -> Result<Response<ReportPhaseResponse>, Status> {
        let peer = peer_of(&request)?;
        self.0.report_phase(&peer, request.into_inner()).await.map(Response::new)
    }
}

/// A connection whose [`Peer`] was established by the transport; tonic copies the
/// peer into every request of the connection.
#[derive(Debug)]
pub struct Authenticated<S> {
    stream: S,
    peer: Peer,
}

impl<S> tonic::transport::server::Connected for Authenticated<S> {
    type ConnectInfo = Peer;

    fn connect_info(&self) -> Peer {
        self.peer.clone()
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Authenticated<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Authenticated<S> {
    fn poll_write(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>, buf: &[u8]) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Serves the facade on a unix socket (capability-only authentication), until `shutdown`.
///
/// # Errors
/// When the socket cannot be bound or the server fails.
pub async fn serve_unix(
    facade: Arc<Facade>,
    path: &std::path::Path,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(), FacadeError> {
    let _ = std::fs::remove_file(path);
    let listener = tokio::net::UnixListener::bind(path).map_err(|source| FacadeError::Bind { address: path.display().to_string(), source })?;
    use std::os::unix::fs::PermissionsExt;
    // Environments connect as the runner uid; the capability is what authenticates.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
        .map_err(|source| FacadeError::Bind { address: path.display().to_string(), source })?;
    let incoming = futures_util::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _)| Authenticated { stream, peer: Peer::Local });
        Some((accepted, listener))
    });
    tonic::transport::Server::builder()
        .layer(tower::util::MapResponseLayer::new(oversize_is_resource_exhausted))
        .add_service(facade.service())
        .serve_with_incoming_shutdown(incoming, shutdown.cancelled_owned())
        .await
        .map_err(FacadeError::Serve)
}

/// tonic answers a message above the decoding limit with OUT_OF_RANGE; gRPC's own
/// convention (and what clients retry on) is RESOURCE_EXHAUSTED, so the status is
/// rewritten for exactly that case.
fn oversize_is_resource_exhausted<B>(mut response: http::Response<B>) -> http::Response<B> {
    let headers = response.headers_mut();
    let too_large = headers.get("grpc-status").is_some_and(|v| v == "11")
        && headers
            .get("grpc-message")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|m| m.starts_with("Error,%20decoded%20message%20length%20too%20large") || m.starts_with("Error, decoded message length too large"));
    if too_large {
        headers.insert("grpc-status", http::HeaderValue::from_static("8"));
    }
    response
}

/// Serves the facade over TLS whose client certificates are X.509 SVIDs (the rustls
/// configuration comes from spiffe-rustls and rotates with the SVID source); the
/// client's SPIFFE ID becomes its [`Peer`].
///
/// # Errors
/// When the server fails.
pub async fn serve_mtls(
    facade: Arc<Facade>,
    listener: tokio::net::TcpListener,
    tls: Arc<rustls::ServerConfig>,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(), FacadeError> {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let (sender, receiver) = tokio::sync::mpsc::channel::<std::io::Result<Authenticated<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>>>(16);
    let accept_shutdown = shutdown.clone();
    let accepting = tokio::spawn(async move {
        loop {
            let (stream, address) = tokio::select! {
                () = accept_shutdown.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        tracing::warn!(%error, "facade accept failed");
                        continue;
                    }
                },
            };
            let acceptor = acceptor.clone();
            let sender = sender.clone();
            // Handshakes run concurrently so one slow client cannot stall the rest.
            tokio::spawn(async move {
                let handshake = tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream)).await;
                let stream = match handshake {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(error)) => {
                        tracing::warn!(%address, %error, "facade TLS handshake refused");
                        return;
                    }
                    Err(_) => {
                        tracing::warn!(%address, "facade TLS handshake timed out");
                        return;
                    }
                };
                let peer = stream
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|chain| chain.first())
                    .and_then(|leaf| spiffe::cert::spiffe_id_from_der(leaf.as_ref()).ok());
                match peer {
                    Some(id) => {
                        let _ = sender.send(Ok(Authenticated { stream, peer: Peer::Spiffe(id.to_string()) })).await;
                    }
                    None => tracing::warn!(%address, "facade client presented no X.509 SVID"),
                }
            });
        }
    });
    let incoming = tokio_stream::wrappers::ReceiverStream::new(receiver);
    let served = tonic::transport::Server::builder()
        .layer(tower::util::MapResponseLayer::new(oversize_is_resource_exhausted))
        .add_service(facade.service())
        .serve_with_incoming_shutdown(incoming, shutdown.cancelled_owned())
        .await
        .map_err(FacadeError::Serve);
    accepting.abort();
    let _ = accepting.await;
    served
}

/// The TLS configuration of the mTLS listener: our SVID from `source` (rotating with
/// it), client certificates required and verified as SVIDs of `trust_domain`; the
/// per-assignment identity check happens per call.
///
/// # Errors
/// When the trust domain is invalid or the configuration cannot be built.
pub fn mtls_server_config(source: spiffe::X509Source, trust_domain: &str) -> Result<Arc<rustls::ServerConfig>, FacadeError> {
    let authorizer = spiffe_rustls::authorizer::trust_domains([trust_domain]).map_err(|e| FacadeError::Tls(e.to_string()))?;
    let config = spiffe_rustls::mtls_server(source)
        .authorize(authorizer)
        .with_alpn_protocols([b"h2"])
        .build()
        .map_err(|e| FacadeError::Tls(e.to_string()))?;
    Ok(Arc::new(config))
}

#[derive(Debug, thiserror::Error)]
pub enum FacadeError {
    #[error("cannot set up the facade's mTLS: {0}")]
    Tls(String),
    #[error("cannot listen on {address}")]
    Bind {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the facade server failed")]
    Serve(#[source] tonic::transport::Error),
}
