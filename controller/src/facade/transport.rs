//! The facade's listeners: unix sockets (one per environment, see `sockets`; a shared one
//! for tests), TCP with SPIFFE mTLS (the peer's SPIFFE ID is attached to every request and
//! checked against the assignment's identity per call) and the development mode's plain
//! TCP. Every listener feeds one server loop ([`serve_connections`]), which bounds what
//! one peer may hold: [`MAX_CONNECTIONS_PER_PEER`] connections, [`MAX_STREAMS`] requests
//! at once on each, [`REQUEST_TIMEOUT`] per request, and a connection that stops
//! answering HTTP/2 pings is closed.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use super::{Facade, Peer};

/// A connection whose [`Peer`] was established by the transport; tonic copies the
/// peer into every request of the connection.
#[derive(Debug)]
pub struct Authenticated<S> {
    stream: S,
    peer: Peer,
    /// Its place among its peer's connections, until it closes.
    _slot: Option<Slot>,
}

impl<S> Authenticated<S> {
    pub fn new(stream: S, peer: Peer) -> Self {
        Authenticated { stream, peer, _slot: None }
    }
}

/// Connections one peer (an environment, a SPIFFE ID, an address) may hold at once: a
/// supervisor needs two or three.
pub const MAX_CONNECTIONS_PER_PEER: usize = 16;
/// Requests in progress at once on one connection (HTTP/2 streams).
pub const MAX_STREAMS: u32 = 64;
/// How long one request may take, its body included (a cache chunk of 32 MiB on a slow
/// link takes seconds; a request parked for longer is abandoned).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);
/// HTTP/2 pings on an idle connection, and how long an answer may take before the
/// connection is closed: a peer that vanished gives its resources back.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// Connections open, by peer.
#[derive(Debug, Default)]
struct PeerConnections(Mutex<HashMap<String, usize>>);

/// One connection of a peer, counted until dropped.
#[derive(Debug)]
struct Slot {
    connections: Arc<PeerConnections>,
    peer: String,
}

impl PeerConnections {
    fn counts(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A slot for `peer`, or `None` when it holds as many connections as it may. The
    /// shared test socket (every caller the same `Local` peer) is not counted.
    fn take(self: &Arc<Self>, peer: &Peer) -> Option<Option<Slot>> {
        let key = match peer {
            Peer::Local => return Some(None),
            Peer::Spiffe(id) => id.clone(),
            Peer::Environment { assignment_id } => format!("environment {assignment_id}"),
            Peer::Address(address) => address.to_string(),
        };
        let mut counts = self.counts();
        let count = counts.entry(key.clone()).or_default();
        if *count >= MAX_CONNECTIONS_PER_PEER {
            return None;
        }
        *count += 1;
        Some(Some(Slot { connections: Arc::clone(self), peer: key }))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut counts = self.connections.counts();
        if let Some(count) = counts.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.peer);
            }
        }
    }
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

/// Serves the facade on one unix socket shared by every caller (capability only), until
/// `shutdown`. Environments get their own sockets instead (`sockets`); this one is for
/// tests of the service itself.
///
/// # Errors
/// When the socket cannot be bound or the server fails.
pub async fn serve_unix(facade: Arc<Facade>, path: &std::path::Path, shutdown: tokio_util::sync::CancellationToken) -> Result<(), FacadeError> {
    let _ = std::fs::remove_file(path);
    let listener = tokio::net::UnixListener::bind(path).map_err(|source| FacadeError::Bind { address: path.display().to_string(), source })?;
    use std::os::unix::fs::PermissionsExt;
    // Environments connect as the runner uid; the capability is what authenticates.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
        .map_err(|source| FacadeError::Bind { address: path.display().to_string(), source })?;
    let incoming = futures_util::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _)| Authenticated::new(stream, Peer::Local));
        Some((accepted, listener))
    });
    serve_connections(facade, incoming, shutdown).await
}

/// Serves the facade over plain TCP (HTTP/2 without TLS), the capability and the
/// caller's address only (a session is bound to the address that claimed): the
/// development mode for environments that cannot mount the unix socket (sandbox VMs) on
/// hosts without SPIRE. `contract::facade::insecure_address` keeps it to loopback and
/// private addresses; the configuration checks that before binding.
///
/// # Errors
/// When the server fails.
pub async fn serve_insecure_tcp(
    facade: Arc<Facade>,
    listener: tokio::net::TcpListener,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(), FacadeError> {
    let incoming = futures_util::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, address)| {
            let _ = stream.set_nodelay(true);
            Authenticated::new(stream, Peer::Address(address.ip()))
        });
        Some((accepted, listener))
    });
    serve_connections(facade, incoming, shutdown).await
}

/// HTTP/2 flow-control windows of the facade's server (and the supervisor's client).
pub const STREAM_WINDOW: u32 = 4 << 20;
pub const CONNECTION_WINDOW: u32 = 16 << 20;

/// The facade's gRPC server over connections whose [`Peer`] a listener established.
pub(super) async fn serve_connections<S>(
    facade: Arc<Facade>,
    incoming: impl futures_util::Stream<Item = std::io::Result<Authenticated<S>>>,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(), FacadeError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let cache = facade.cache_route();
    let connections = Arc::new(PeerConnections::default());
    let metrics = facade.metrics().cloned();
    let incoming = futures_util::StreamExt::filter_map(incoming, move |accepted| {
        let admitted = match accepted {
            Ok(mut connection) => match connections.take(&connection.peer) {
                Some(slot) => {
                    connection._slot = slot;
                    Some(Ok(connection))
                }
                None => {
                    tracing::warn!(peer = ?connection.peer, "facade connection refused: its peer holds {MAX_CONNECTIONS_PER_PEER} connections already");
                    if let Some(metrics) = &metrics {
                        metrics.error(crate::metrics::ErrorSource::Facade, "facade_connections_per_peer");
                    }
                    None
                }
            },
            Err(error) => Some(Err(error)),
        };
        std::future::ready(admitted)
    });
    tonic::transport::Server::builder()
        // An archive streams through one connection with the reports: windows large
        // enough that a cache download is not a trickle of 64 KiB round trips.
        .initial_stream_window_size(Some(STREAM_WINDOW))
        .initial_connection_window_size(Some(CONNECTION_WINDOW))
        .max_concurrent_streams(Some(MAX_STREAMS))
        .timeout(REQUEST_TIMEOUT)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .layer(tower::util::MapResponseLayer::new(oversize_is_resource_exhausted))
        .add_service(facade.service())
        .add_service(cache)
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
                        let _ = sender.send(Ok(Authenticated::new(stream, Peer::Spiffe(id.to_string())))).await;
                    }
                    None => tracing::warn!(%address, "facade client presented no X.509 SVID"),
                }
            });
        }
    });
    let served = serve_connections(facade, tokio_stream::wrappers::ReceiverStream::new(receiver), shutdown).await;
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
    let config = spiffe_rustls::mtls_server(source).authorize(authorizer).with_alpn_protocols([b"h2"]).build().map_err(|e| FacadeError::Tls(e.to_string()))?;
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
    #[error("the environments' facade sockets are already being served")]
    AlreadyServing,
}
