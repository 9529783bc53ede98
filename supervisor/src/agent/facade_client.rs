//! The agent's client of the controller's facade: over the unix socket the docker
//! driver mounts in (capability only), over SPIFFE mTLS with the job's own SVID (the
//! server must present exactly the facade's SPIFFE ID), or — development mode, see
//! `contract::facade` — plain HTTP/2 to a private address (capability only).

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use connect::{Code, ConnectError};
use contract::facade::FacadeUrl;
use proto::{
    facade::v1::{
        AssignmentCredential, ClaimRequest, Phase, ReportPhaseRequest, UpdateLogRequest, UpdateTaskRequest, facade_service_client::FacadeServiceClient,
    },
    runner::v1::{self as runner, Task},
};
use tonic::transport::Channel;

use super::loopback::Upstream;

#[derive(Debug, thiserror::Error)]
pub enum FacadeClientError {
    #[error("invalid facade URL: {0}")]
    Url(String),
    #[error("https facade URLs need the facade's SPIFFE ID (CI_RUNNER_FACADE_SPIFFE_ID) and a Workload API endpoint")]
    MissingSpiffe,
    #[error("cannot set up mTLS to the facade: {0}")]
    Tls(String),
    #[error("the facade refused the claim of {assignment_id}: {status}")]
    Claim { assignment_id: String, status: tonic::Status },
}

/// What a claim gives the environment.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub task: Task,
    /// Gitea's answer to the runner's Declare ([`proto::CAPABILITIES_HEADER`]), to answer
    /// the local runner the same.
    pub gitea_capabilities: String,
}

#[derive(Clone)]
pub struct FacadeClient {
    inner: FacadeServiceClient<Channel>,
    /// A second connection to the facade, for the cache's plain HTTP requests.
    cache_channel: Channel,
    credential: AssignmentCredential,
}

impl std::fmt::Debug for FacadeClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FacadeClient").field("assignment_id", &self.credential.assignment_id).finish_non_exhaustive()
    }
}

impl FacadeClient {
    /// A client of `url`; for https, with the SVID from `spiffe_endpoint` and only to a
    /// server whose SPIFFE ID is `facade_spiffe_id`. It connects on first use and again
    /// whenever the connection breaks (a controller restarting, its socket not bound
    /// yet): a call meanwhile fails as unavailable and is retried by the caller.
    ///
    /// # Errors
    /// A bad URL, missing SPIFFE settings, or no connection.
    pub async fn connect(
        url: &str,
        facade_spiffe_id: Option<&str>,
        spiffe_endpoint: Option<&str>,
        own_spiffe_id: Option<&str>,
        assignment_id: &str,
        capability: &str,
    ) -> Result<Self, FacadeClientError> {
        let endpoint = tonic::transport::Endpoint::try_from("http://facade.local")
            .map_err(|_| FacadeClientError::Url(url.to_owned()))?
            .connect_timeout(Duration::from_secs(10))
            // Cache archives stream over this connection too: windows that keep it moving.
            .initial_stream_window_size(Some(STREAM_WINDOW))
            .initial_connection_window_size(Some(CONNECTION_WINDOW));
        let parsed = contract::facade::FacadeUrl::parse(url).map_err(FacadeClientError::Url)?;
        let dial = match parsed {
            FacadeUrl::Unix(path) => Dial::Unix(path),
            // Development mode: capability only, to a loopback or private address.
            FacadeUrl::InsecureHttp(address) => Dial::Tcp(address),
            FacadeUrl::Https(authority) => {
                let (Some(facade_id), Some(workload)) = (facade_spiffe_id.filter(|s| !s.is_empty()), spiffe_endpoint) else {
                    return Err(FacadeClientError::MissingSpiffe);
                };
                // The agent presents exactly the SVID it waited for: behind one SPIRE agent
                // with several jobs (or a workload given more than one SVID), the Workload
                // API's first SVID may be another job's, which the facade refuses.
                let builder = spiffe::X509Source::builder().endpoint(workload);
                let builder = match own_spiffe_id {
                    Some(id) => builder.picker(ExactSvid(id.to_owned())),
                    None => builder,
                };
                let source = builder.build().await.map_err(|e| FacadeClientError::Tls(e.to_string()))?;
                let authorizer = spiffe_rustls::authorizer::exact([facade_id]).map_err(|e| FacadeClientError::Tls(e.to_string()))?;
                let config = spiffe_rustls::mtls_client(source)
                    .authorize(authorizer)
                    .with_alpn_protocols([b"h2"])
                    .build()
                    .map_err(|e| FacadeClientError::Tls(e.to_string()))?;
                Dial::Tls(Arc::new(config), authority)
            }
        };
        // The cache has a connection of its own: archives a step reads slowly (or not at
        // all) fill their flow-control windows, and on a shared connection they would hold
        // back the runner's reports and the controller's answers to them (a cancel among
        // them) until the step reads on.
        let (channel, cache_channel) = (dial.channel(&endpoint), dial.channel(&endpoint));
        Ok(FacadeClient {
            inner: FacadeServiceClient::new(channel),
            cache_channel,
            credential: AssignmentCredential { assignment_id: assignment_id.to_owned(), capability: capability.to_owned() },
        })
    }

    /// Claims the task, retrying while the facade is unavailable (until `deadline`); from
    /// then on this client carries the session capability the claim answered (the
    /// environment's own capability only claims).
    ///
    /// # Errors
    /// A refusal (wrong identity or capability, another holder) or the deadline.
    pub async fn claim(&mut self, holder: &str, deadline: Duration) -> Result<Claimed, FacadeClientError> {
        let give_up = tokio::time::Instant::now() + deadline;
        let mut delays = contract::backoff::Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
        loop {
            let request = ClaimRequest { credential: Some(self.credential.clone()), holder: holder.to_owned() };
            let result = self.inner.clone().claim(request).await;
            let delay = delays.next_delay();
            match result {
                Ok(response) => {
                    let response = response.into_inner();
                    if !response.session.is_empty() {
                        self.credential.capability = response.session;
                    }
                    if let Some(task) = response.task {
                        return Ok(Claimed { task, gitea_capabilities: response.gitea_capabilities });
                    }
                    return Err(FacadeClientError::Claim {
                        assignment_id: self.credential.assignment_id.clone(),
                        status: tonic::Status::internal("the facade answered without a task"),
                    });
                }
                // Unavailable, or a connection that failed (e.g. a TLS handshake during an
                // SVID rotation, or a controller restarting): try again.
                Err(status)
                    if (status.code() == tonic::Code::Unavailable || (status.code() == tonic::Code::Unknown && status.message() == "transport error"))
                        && tokio::time::Instant::now() + delay < give_up =>
                {
                    tracing::warn!(%status, retry_in = ?delay, "facade unavailable; retrying the claim");
                    tokio::time::sleep(delay).await;
                }
                Err(status) => return Err(FacadeClientError::Claim { assignment_id: self.credential.assignment_id.clone(), status }),
            }
        }
    }

    /// Best effort: a phase that cannot be reported is only logged.
    pub async fn report(&self, phase: Phase, detail: &str, exit_code: i32) {
        let request = ReportPhaseRequest {
            credential: Some(self.credential.clone()),
            phase: phase as i32,
            at: Some(prost_types::Timestamp::from(std::time::SystemTime::now())),
            detail: detail.chars().take(4096).collect(),
            exit_code,
        };
        if let Err(status) = self.inner.clone().report_phase(request).await {
            tracing::warn!(phase = phase.as_str_name(), %status, "cannot report the phase to the facade");
        }
    }
}

impl FacadeClient {
    /// Sends one request of the job's cache to the facade's cache route
    /// (`contract::cache::PREFIX` + its path), as this environment, with the session of
    /// its claim; the answer streams back.
    ///
    /// # Errors
    /// When the facade cannot be reached.
    pub async fn cache(&self, mut request: http::Request<tonic::body::Body>) -> Result<http::Response<tonic::body::Body>, tonic::transport::Error> {
        use contract::cache::{HEADER_ASSIGNMENT, HEADER_CAPABILITY, PREFIX};
        use tower::ServiceExt as _;
        let path_and_query = request.uri().path_and_query().map_or("/", |p| p.as_str());
        if let Ok(uri) = format!("{PREFIX}{path_and_query}").parse() {
            *request.uri_mut() = uri;
        }
        let headers = request.headers_mut();
        for (name, value) in [(HEADER_ASSIGNMENT, &self.credential.assignment_id), (HEADER_CAPABILITY, &self.credential.capability)] {
            if let Ok(value) = http::HeaderValue::from_str(value) {
                headers.insert(name, value);
            }
        }
        self.cache_channel.clone().oneshot(request).await
    }
}

/// How the agent reaches the facade.
enum Dial {
    Unix(String),
    Tcp(std::net::SocketAddr),
    /// mTLS with the job's SVID, to `host:port`.
    Tls(Arc<rustls::ClientConfig>, String),
}

impl Dial {
    /// A channel of `endpoint` that connects on first use and again after a break.
    fn channel(&self, endpoint: &tonic::transport::Endpoint) -> Channel {
        match self {
            Dial::Unix(path) => {
                let path = path.clone();
                endpoint.connect_with_connector_lazy(tower::service_fn(move |_| {
                    let path = path.clone();
                    async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
                }))
            }
            Dial::Tcp(address) => {
                let address = *address;
                endpoint.connect_with_connector_lazy(tower::service_fn(move |_| async move {
                    let tcp = tokio::net::TcpStream::connect(address).await?;
                    tcp.set_nodelay(true)?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tcp))
                }))
            }
            Dial::Tls(config, authority) => {
                let (config, authority) = (Arc::clone(config), authority.clone());
                endpoint.connect_with_connector_lazy(tower::service_fn(move |_| {
                    let (config, authority) = (Arc::clone(&config), authority.clone());
                    async move {
                        let tcp = tokio::net::TcpStream::connect(&authority).await?;
                        let host = authority.rsplit_once(':').map_or(authority.as_str(), |(host, _)| host).to_owned();
                        // The server is verified by its SPIFFE ID, not by this name.
                        let name = rustls::pki_types::ServerName::try_from(host).map_err(std::io::Error::other)?;
                        let tls = tokio_rustls::TlsConnector::from(config).connect(name, tcp).await?;
                        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
                    }
                }))
            }
        }
    }
}

/// HTTP/2 flow-control windows of the facade connection (the facade's server uses the
/// same): a cache archive is not a trickle of 64 KiB round trips.
const STREAM_WINDOW: u32 = 4 << 20;
const CONNECTION_WINDOW: u32 = 16 << 20;

/// Picks the SVID with exactly this SPIFFE ID.
#[derive(Debug)]
struct ExactSvid(String);

impl spiffe::x509_source::SvidPicker for ExactSvid {
    fn pick_svid(&self, svids: &[Arc<spiffe::X509Svid>]) -> Option<usize> {
        svids.iter().position(|svid| svid.spiffe_id().to_string() == self.0)
    }
}

/// The facade's gRPC status as the Connect error gitea-runner would get from Gitea.
fn to_connect(status: tonic::Status) -> ConnectError {
    let code = Code::from_grpc(status.code() as i32).unwrap_or(Code::Unknown);
    ConnectError::new(code, status.message().to_owned())
}

#[async_trait]
impl Upstream for FacadeClient {
    async fn update_task(&self, request: runner::UpdateTaskRequest) -> Result<runner::UpdateTaskResponse, ConnectError> {
        let request = UpdateTaskRequest { credential: Some(self.credential.clone()), request: Some(request) };
        let response = self.inner.clone().update_task(request).await.map_err(to_connect)?;
        response.into_inner().response.ok_or_else(|| ConnectError::internal("the facade answered without Gitea's reply"))
    }

    async fn update_log(&self, request: runner::UpdateLogRequest) -> Result<runner::UpdateLogResponse, ConnectError> {
        let request = UpdateLogRequest { credential: Some(self.credential.clone()), request: Some(request) };
        let response = self.inner.clone().update_log(request).await.map_err(to_connect)?;
        response.into_inner().response.ok_or_else(|| ConnectError::internal("the facade answered without Gitea's reply"))
    }
}
