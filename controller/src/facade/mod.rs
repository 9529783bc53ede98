//! The facade: the only path from environments back to Gitea.
//!
//! Every call carries a capability for its assignment and is bound to where it comes
//! from: on an environment's own socket only that environment's assignment is served
//! ([`Peer::Environment`]); over SPIFFE mTLS the peer's SPIFFE ID must equal the
//! identity derived for the assignment. Claim takes the capability the environment was
//! given and hands the Task over exactly once (a retry by the same holder gets the same
//! Task; anyone else is refused), with a *session* capability that every later call
//! carries instead: the given capability claims and nothing else, so a copy of it read
//! after the claim is worth nothing. UpdateTask and UpdateLog are forwarded with the
//! controller's runner credential for the claimed task only, and Gitea's replies,
//! cancellation included, go back unchanged — until [`REPORTS_AFTER_END`] after the
//! assignment ended. After Gitea accepts the terminal state, the record becomes
//! terminal, the environment is marked terminal and the pool slot is released.

use std::sync::Arc;

use proto::{
    facade::v1::{
        AssignmentCredential, ClaimRequest, ClaimResponse, Phase, ReportPhaseRequest, ReportPhaseResponse, UpdateLogRequest, UpdateLogResponse,
        UpdateTaskRequest, UpdateTaskResponse,
        facade_service_server::{FacadeService, FacadeServiceServer},
    },
    runner::v1::{Result as TaskResult, Task},
};
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use crate::{
    assignment::{Assignment, Rules, capability::CapabilityKey},
    gitea::{self, GiteaError, TaskReports, registrations::Registrations},
    lifecycle::Lifecycle,
    metrics::{ErrorSource, JobPhase},
    store::{self, Record, State, Store, StoreError, Versioned, now_ms},
};

pub mod cache;
mod limit;
pub mod sockets;
mod transport;

pub use sockets::EnvironmentSockets;
pub use transport::{FacadeError, mtls_server_config, serve_insecure_tcp, serve_mtls, serve_unix};

/// How long after its assignment ended an environment may still report: the runner
/// flushes its last log rows after Gitea said "cancelled", while the environment is
/// being retired. A capability kept by a job after that is refused.
pub const REPORTS_AFTER_END: std::time::Duration = std::time::Duration::from_secs(120);

/// Upper bound of one facade request. The supervisor sends a runner's UpdateLog
/// backlog up in pieces of a few hundred KiB, and outputs in batches, so this only
/// has to hold the largest single piece; it protects the controller, which every
/// environment shares.
pub const MAX_REQUEST_BYTES: usize = 4 << 20;

/// Who is calling, as the transport established it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// Over SPIFFE mTLS: the SPIFFE ID of the client's X.509 SVID.
    Spiffe(String),
    /// On the socket of one environment (the docker placement): only its assignment.
    Environment { assignment_id: String },
    /// Over the development-mode TCP listener: the caller's address. Its session is bound
    /// to the address that claimed, so a session read elsewhere is worth nothing on
    /// another host (the listener's only binding to an environment).
    Address(std::net::IpAddr),
    /// On a socket any caller may reach (tests of the service itself): the capability
    /// alone.
    Local,
}

/// The scope of the session `peer` gets for `assignment_id`: over the development-mode
/// listener the claiming address is part of it.
pub fn session_scope(peer: &Peer, assignment_id: &str) -> String {
    let scope = crate::assignment::capability::session_scope(assignment_id);
    match peer {
        Peer::Address(address) => format!("{scope}@{}", address.to_canonical()),
        Peer::Spiffe(_) | Peer::Environment { .. } | Peer::Local => scope,
    }
}

/// Which capability a call must carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// The capability the environment was given: Claim.
    Given,
    /// The session Claim answered: reports.
    Session,
    /// Either: phases, which an environment reports before and after its claim.
    Either,
}

/// The facade's state, shared by its listeners.
#[derive(Debug)]
pub struct Facade {
    store: Arc<dyn Store>,
    registrations: Registrations,
    lifecycle: Lifecycle,
    key: Arc<CapabilityKey>,
    rules: Rules,
    metrics: Option<Arc<crate::metrics::Metrics>>,
    /// How long a session capability lasts after the claim.
    session_ttl: std::time::Duration,
    /// Reports per assignment: one environment cannot flood the controller every
    /// environment shares, nor Gitea behind it.
    reports: limit::PerAssignment,
    /// Log bytes per assignment: a job printing without end slows down, its neighbours'
    /// logs do not.
    log_bytes: limit::PerAssignment,
    /// The jobs' cache, served on the facade's transport (`cache`), when configured.
    cache: Option<Arc<::cache::Cache>>,
}

/// Seconds since `from_ms`, for the histograms.
fn seconds_since(from_ms: i64) -> f64 {
    (now_ms() - from_ms).max(0) as f64 / 1000.0
}

impl Facade {
    pub fn new(store: Arc<dyn Store>, registrations: Registrations, lifecycle: Lifecycle, key: Arc<CapabilityKey>, rules: Rules) -> Self {
        Facade {
            store,
            registrations,
            lifecycle,
            key,
            rules,
            metrics: None,
            session_ttl: std::time::Duration::from_secs(24 * 3600),
            reports: limit::PerAssignment::new(limit::REPORTS_PER_SECOND, limit::REPORTS_BURST),
            log_bytes: limit::PerAssignment::new(limit::LOG_BYTES_PER_SECOND, limit::LOG_BYTES_BURST),
            cache: None,
        }
    }

    /// Counts `call`'s answer (`gdr_facade_calls_total`) and wraps it for tonic.
    fn counted<T>(&self, call: &'static str, answer: Result<T, Status>) -> Result<Response<T>, Status> {
        if let Some(metrics) = &self.metrics {
            metrics.facade_call(call, answer.as_ref().map_or_else(Status::code, |_| tonic::Code::Ok));
        }
        answer.map(Response::new)
    }

    pub(crate) fn metrics(&self) -> Option<&Arc<crate::metrics::Metrics>> {
        self.metrics.as_ref()
    }

    /// Serves `cache` to the environments on the facade's transport.
    pub fn with_cache(mut self, cache: Option<Arc<::cache::Cache>>) -> Self {
        self.cache = cache;
        self
    }

    /// The cache route of the facade's server (it says so where no cache is configured).
    pub fn cache_route(self: &Arc<Self>) -> cache::CacheRoute {
        cache::CacheRoute::new(Arc::clone(self), self.cache.clone())
    }

    /// A call with the session capability of `credential`'s assignment (the cache's).
    pub(crate) async fn authorize_session(&self, peer: &Peer, credential: &AssignmentCredential) -> Result<(Versioned<Record>, Assignment), Status> {
        self.authorize(peer, Some(credential), Scope::Session).await
    }

    /// Reports per assignment and second, and the burst allowed (tests that hammer one
    /// assignment on purpose raise it).
    pub fn with_report_limit(mut self, per_second: f64, burst: f64) -> Self {
        self.reports = limit::PerAssignment::new(per_second, burst);
        self
    }

    fn admit_report(&self, assignment_id: &str) -> Result<(), Status> {
        if self.reports.admit(assignment_id) {
            return Ok(());
        }
        if let Some(metrics) = &self.metrics {
            metrics.error(ErrorSource::Facade, "report_rate_limited");
        }
        Err(Status::resource_exhausted(format!("{assignment_id} reports faster than the facade takes them; slow down")))
    }

    /// How long sessions last (`facade.capability_ttl`).
    pub fn with_session_ttl(mut self, ttl: std::time::Duration) -> Self {
        self.session_ttl = ttl;
        self
    }

    /// The session capability of a claim made at `claimed_at_ms` by `peer`: the same for
    /// every retry of that claim.
    fn session(&self, peer: &Peer, assignment_id: &str, claimed_at_ms: i64) -> String {
        let claimed = u64::try_from(claimed_at_ms.div_euclid(1000)).unwrap_or(0);
        self.key.issue(&session_scope(peer, assignment_id), claimed.saturating_add(self.session_ttl.as_secs()))
    }

    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// The tonic service; the transport must put a [`Peer`] into each request's extensions.
    pub fn service(self: Arc<Self>) -> FacadeServiceServer<Service> {
        FacadeServiceServer::new(Service(self)).max_decoding_message_size(MAX_REQUEST_BYTES)
    }

    /// Capability, its scope and the peer, then the record and its decoded assignment.
    async fn authorize(&self, peer: &Peer, credential: Option<&AssignmentCredential>, scope: Scope) -> Result<(Versioned<Record>, Assignment), Status> {
        let credential = credential.ok_or_else(|| Status::unauthenticated("the request carries no credential"))?;
        let id = credential.assignment_id.as_str();
        if id.is_empty() || id.len() > 128 {
            return Err(Status::invalid_argument("credential.assignment_id must be 1 to 128 bytes"));
        }
        if let Peer::Environment { assignment_id } = peer
            && assignment_id != id
        {
            tracing::warn!(assignment.id = id, socket = %assignment_id, "facade refused a call for another environment's assignment");
            return Err(Status::permission_denied(format!("this socket belongs to the environment of {assignment_id}, not of {id}")));
        }
        let now = crate::clock::now_secs();
        let session = session_scope(peer, id);
        let verified = match scope {
            Scope::Given => self.key.verify(&credential.capability, id, now),
            Scope::Session => self.key.verify(&credential.capability, &session, now),
            Scope::Either => self.key.verify(&credential.capability, &session, now).or_else(|_| self.key.verify(&credential.capability, id, now)),
        };
        verified.map_err(|error| match (scope, &error) {
            (Scope::Session, crate::assignment::capability::CapabilityError::WrongAssignment { .. }) => match peer {
                Peer::Address(address) => Status::unauthenticated(format!(
                    "{id}: reports carry the session capability of the claim, sent from the address that claimed (this call came from {address})"
                )),
                _ => Status::unauthenticated(format!("{id}: reports carry the session capability of the claim, not the capability the environment was given")),
            },
            (Scope::Given, crate::assignment::capability::CapabilityError::WrongAssignment { .. }) => {
                Status::unauthenticated(format!("{id}: a claim carries the capability the environment was given"))
            }
            _ => Status::unauthenticated(format!("capability refused for {id}: {error}")),
        })?;
        let record = self.store.get(id).await.map_err(store_status)?.ok_or_else(|| Status::not_found(format!("no assignment {id}")))?;
        let assignment = Assignment::decode(&record.value.envelope, &self.rules)
            .map_err(|error| Status::internal(format!("stored assignment {id} is invalid: {}", crate::error_chain(&error))))?;
        if let Peer::Spiffe(peer_id) = peer
            && *peer_id != assignment.identity.spiffe_id
        {
            tracing::warn!(assignment.id = id, peer = %peer_id, expected = %assignment.identity.spiffe_id, "facade refused a peer with the wrong SPIFFE ID");
            return Err(Status::permission_denied(format!("peer {peer_id} is not the identity of {id} ({})", assignment.identity.spiffe_id)));
        }
        Ok((record, assignment))
    }

    pub async fn claim(&self, peer: &Peer, request: ClaimRequest) -> Result<ClaimResponse, Status> {
        let (mut record, assignment) = self.authorize(peer, request.credential.as_ref(), Scope::Given).await?;
        let holder = request.holder;
        if holder.len() < 16 || holder.len() > 128 {
            return Err(Status::invalid_argument("holder must be 16 to 128 characters"));
        }
        loop {
            match &record.value.state {
                State::Claimed { holder: current, claimed_at_ms } if *current == holder => {
                    return Ok(ClaimResponse {
                        gitea_capabilities: self.gitea_capabilities(&record.value.runner),
                        ..claim_response(assignment.task.clone(), *claimed_at_ms, self.session(peer, &assignment.id, *claimed_at_ms))
                    });
                }
                State::Claimed { .. } => {
                    tracing::warn!(assignment.id = %assignment.id, "a second holder tried to claim");
                    return Err(Status::failed_precondition(format!("{} is already claimed by another holder", assignment.id)));
                }
                State::Terminal { result } => {
                    return Err(Status::failed_precondition(format!("{} is finished ({result})", assignment.id)));
                }
                State::Pending => {
                    let claimed_at_ms = now_ms();
                    let next = record.value.claimed_by(&holder, claimed_at_ms);
                    match self.store.update(&next, record.revision).await {
                        Ok(_) => {
                            tracing::info!(assignment.id = %assignment.id, task_id = assignment.task.id, "claimed");
                            crate::failpoint::hit("after-claim");
                            if let Some(metrics) = &self.metrics {
                                if record.value.created_at_ms > 0 {
                                    metrics.claim_latency.observe(seconds_since(record.value.created_at_ms));
                                }
                                let placement = record.value.placement.to_string();
                                metrics.job_phase(&placement, JobPhase::Claimed, record.value.environment_at_ms, claimed_at_ms);
                            }
                            return Ok(ClaimResponse {
                                gitea_capabilities: self.gitea_capabilities(&record.value.runner),
                                ..claim_response(assignment.task.clone(), claimed_at_ms, self.session(peer, &assignment.id, claimed_at_ms))
                            });
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

    /// What Gitea told the runner that fetched the task it takes besides the protocol.
    fn gitea_capabilities(&self, runner_uuid: &str) -> String {
        self.registrations.reports_for(runner_uuid).map(|reports| reports.server_capabilities().to_owned()).unwrap_or_default()
    }

    /// A report on the claimed task: authorized, for this assignment's task only, and
    /// sent as the runner that fetched it.
    async fn reporting(
        &self,
        peer: &Peer,
        credential: Option<&AssignmentCredential>,
        task_id: i64,
    ) -> Result<(Record, Assignment, Arc<dyn TaskReports>), Status> {
        let (record, assignment) = self.authorize(peer, credential, Scope::Session).await?;
        self.admit_report(&assignment.id)?;
        if task_id != assignment.task.id {
            tracing::warn!(assignment.id = %assignment.id, task_id, "refused a report for another task");
            return Err(Status::permission_denied(format!("{} may only report task {}, not {task_id}", assignment.id, assignment.task.id)));
        }
        if record.value.state == State::Pending {
            return Err(Status::failed_precondition(format!("{} is not claimed yet", assignment.id)));
        }
        let reports = self.registrations.reports_for(&record.value.runner).map_err(|error| {
            tracing::error!(assignment.id = %assignment.id, %error, "no Gitea registration to report this task through");
            Status::failed_precondition(error.to_string())
        })?;
        // A terminal assignment still forwards for a while: after Gitea said "cancelled"
        // the runner flushes its last log rows while its environment is being retired.
        if record.value.is_terminal() && seconds_since(record.value.updated_at_ms) > REPORTS_AFTER_END.as_secs_f64() {
            return Err(Status::failed_precondition(format!(
                "{} ended more than {}s ago; nothing more is reported for it",
                assignment.id,
                REPORTS_AFTER_END.as_secs()
            )));
        }
        Ok((record.value, assignment, reports))
    }

    pub async fn update_task(&self, peer: &Peer, request: UpdateTaskRequest) -> Result<UpdateTaskResponse, Status> {
        let inner = request.request.ok_or_else(|| Status::invalid_argument("request is required"))?;
        let task_id = inner.state.as_ref().map_or(0, |s| s.id);
        let (record, assignment, reports) = self.reporting(peer, request.credential.as_ref(), task_id).await?;
        let response = reports.update_task(&inner).await.map_err(gitea_status)?;
        let reported = inner.state.as_ref().map_or(0, |s| s.result);
        // Gitea's reply carries its own view: a result there means Gitea is done with
        // the task (cancelled, or already finished), whether or not the runner says so.
        let answered = response.state.as_ref().map_or(0, |s| s.result);
        let ended = if reported != TaskResult::Unspecified as i32 { reported } else { answered };
        if reported != TaskResult::Unspecified as i32 {
            self.lifecycle.reported_end(&assignment.id);
        }
        if ended != TaskResult::Unspecified as i32 && !record.is_terminal() {
            let finished = if answered != TaskResult::Unspecified as i32 && reported == TaskResult::Unspecified as i32 {
                tracing::info!(assignment.id = %assignment.id, task_id, result = %crate::lifecycle::result_name(answered), "Gitea ended the task");
                self.lifecycle.ended_by_gitea(&assignment.id, answered).await
            } else {
                // Gitea's result wins where the two differ (a cancelled task stays cancelled).
                let result = if answered != TaskResult::Unspecified as i32 { answered } else { reported };
                self.lifecycle.finish(&assignment.id, result).await
            };
            if let Err(error) = finished {
                tracing::error!(assignment.id = %assignment.id, error = %crate::error_chain(&error), "cannot record the end of the task");
            }
        }
        Ok(UpdateTaskResponse { response: Some(response) })
    }

    pub async fn update_log(&self, peer: &Peer, request: UpdateLogRequest) -> Result<UpdateLogResponse, Status> {
        let inner = request.request.ok_or_else(|| Status::invalid_argument("request is required"))?;
        let (_, assignment, reports) = self.reporting(peer, request.credential.as_ref(), inner.task_id).await?;
        let bytes: usize = inner.rows.iter().map(|row| row.content.len()).sum();
        if !self.log_bytes.admit_cost(&assignment.id, bytes as f64) {
            if let Some(metrics) = &self.metrics {
                metrics.error(ErrorSource::Facade, "log_rate_limited");
            }
            return Err(Status::resource_exhausted(format!("{} logs faster than {} MiB/s; slow down", assignment.id, limit::LOG_BYTES_PER_SECOND / 1048576.0)));
        }
        let response = gitea::update_log_in_pieces(reports.as_ref(), inner).await.map_err(gitea_status)?;
        Ok(UpdateLogResponse { response: Some(response) })
    }

    pub async fn report_phase(&self, peer: &Peer, request: ReportPhaseRequest) -> Result<ReportPhaseResponse, Status> {
        let (record, assignment) = self.authorize(peer, request.credential.as_ref(), Scope::Either).await?;
        self.admit_report(&assignment.id)?;
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
            let placement = crate::metrics::PlacementLabel { placement: record.value.placement.to_string() };
            metrics.job_startup.get_or_create(&placement).observe(seconds_since(record.value.created_at_ms));
        }
        tracing::info!(assignment.id = %assignment.id, task_id = assignment.task.id, phase = phase.as_str_name(), exit_code = request.exit_code, detail = %request.detail, "environment phase");
        let summary = phase_summary(phase, &request.detail, request.exit_code);
        let name = phase.as_str_name().trim_start_matches("PHASE_").to_ascii_lowercase();
        let at_ms = request.at.map_or_else(now_ms, |at| at.seconds.saturating_mul(1000).saturating_add(i64::from(at.nanos / 1_000_000)));
        // The first job_started is the job's first step (a hook that passes twice reports twice).
        if phase == Phase::JobStarted
            && let Some(metrics) = &self.metrics
            && !record.value.timeline.iter().any(|(name, _)| name == "job_started")
        {
            metrics.job_phase(&record.value.placement.to_string(), JobPhase::FirstStep, record.value.claimed_at_ms(), at_ms);
        }
        // Kept on the record so that an environment that dies afterwards is reported
        // with what it last said, and its start-up can be read back (best effort: a phase
        // is not worth failing a call).
        if let Err(error) = store::modify(self.store.as_ref(), &assignment.id, |current| Some(current.with_phase(&summary, &name, at_ms, MAX_TIMELINE))).await {
            tracing::warn!(assignment.id = %assignment.id, error = %crate::error_chain(&error), "cannot record the phase");
        }
        Ok(ReportPhaseResponse {})
    }
}

/// Phases kept per assignment (a supervisor reports about eight).
const MAX_TIMELINE: usize = 32;

/// `failed: dockerd: …`, `runner_exited (exit 1)`.
fn phase_summary(phase: Phase, detail: &str, exit_code: i32) -> String {
    let name = phase.as_str_name().trim_start_matches("PHASE_").to_ascii_lowercase();
    let mut summary = name;
    if !detail.is_empty() {
        summary.push_str(": ");
        summary.push_str(&detail.chars().take(512).collect::<String>());
    }
    if phase == Phase::RunnerExited {
        summary.push_str(&format!(" (exit {exit_code})"));
    }
    summary
}

fn claim_response(task: Task, claimed_at_ms: i64, session: String) -> ClaimResponse {
    ClaimResponse {
        session,
        gitea_capabilities: String::new(),
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
    request.extensions().get::<Peer>().cloned().ok_or_else(|| Status::unauthenticated("the transport established no peer identity"))
}

/// The span of a call: the assignment it claims to be for (checked inside).
fn span_of(credential: Option<&AssignmentCredential>) -> tracing::Span {
    let id = credential.map_or("", |c| c.assignment_id.as_str());
    tracing::info_span!("assignment", assignment.id = %id.chars().take(128).collect::<String>())
}

#[tonic::async_trait]
impl FacadeService for Service {
    async fn claim(&self, request: Request<ClaimRequest>) -> Result<Response<ClaimResponse>, Status> {
        let peer = peer_of(&request)?;
        let span = span_of(request.get_ref().credential.as_ref());
        let answer = self.0.claim(&peer, request.into_inner()).instrument(span).await;
        self.0.counted("claim", answer)
    }

    async fn update_task(&self, request: Request<UpdateTaskRequest>) -> Result<Response<UpdateTaskResponse>, Status> {
        let peer = peer_of(&request)?;
        let span = span_of(request.get_ref().credential.as_ref());
        let answer = self.0.update_task(&peer, request.into_inner()).instrument(span).await;
        self.0.counted("update_task", answer)
    }

    async fn update_log(&self, request: Request<UpdateLogRequest>) -> Result<Response<UpdateLogResponse>, Status> {
        let peer = peer_of(&request)?;
        let span = span_of(request.get_ref().credential.as_ref());
        let answer = self.0.update_log(&peer, request.into_inner()).instrument(span).await;
        self.0.counted("update_log", answer)
    }

    async fn report_phase(&self, request: Request<ReportPhaseRequest>) -> Result<Response<ReportPhaseResponse>, Status> {
        let peer = peer_of(&request)?;
        let span = span_of(request.get_ref().credential.as_ref());
        let answer = self.0.report_phase(&peer, request.into_inner()).instrument(span).await;
        self.0.counted("report_phase", answer)
    }
}
