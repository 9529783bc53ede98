//! A Connect unary server on hyper, HTTP/1.1 with keep-alive (what gitea-runner
//! speaks on plain http: its transport never negotiates h2c).
//!
//! Every malformed request gets the Connect error a connect-go handler would give and
//! a log line; nothing in here panics on input.

use std::{collections::HashMap, convert::Infallible, future::Future, net::SocketAddr, pin::Pin, sync::Arc, time::Duration};

use bytes::Bytes;
use contract::error_chain;
use http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use prost_reflect::DescriptorPool;
use tokio::{net::TcpListener, task::JoinSet, time::Instant};
use tokio_util::sync::CancellationToken;

use crate::{
    code::Code,
    codec::{Codec, Message},
    error::ConnectError,
    protocol,
};

/// Default bound on a request body, before and after decompression. gitea-runner's
/// largest requests are UpdateLog batches of at most a few hundred rows.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 4 << 20;
/// Responses at least this large are gzipped when the client accepts gzip (as Gitea).
pub const DEFAULT_COMPRESS_MIN_BYTES: usize = 1024;

/// A decoded request as a handler sees it.
#[derive(Debug)]
pub struct Request<M> {
    pub message: M,
    pub headers: HeaderMap,
    /// From `Connect-Timeout-Ms`; the handler is cancelled at this instant anyway.
    pub deadline: Option<Instant>,
    pub peer: Option<SocketAddr>,
}

/// A handler's answer: the message plus any response headers to add.
#[derive(Debug)]
pub struct Response<M> {
    pub message: M,
    pub headers: HeaderMap,
}

impl<M> Response<M> {
    pub fn new(message: M) -> Self {
        Response { message, headers: HeaderMap::new() }
    }
}

impl<M> From<M> for Response<M> {
    fn from(message: M) -> Self {
        Response::new(message)
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A response body that may stream (the fallback's), or a whole Connect answer. Not
/// `Sync`: hyper needs `Send` only, and a fallback may stream a body that is not `Sync`
/// (a gRPC channel's, for the supervisor's cache proxy).
pub type BoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// Answers every request whose path is none of the router's procedures (the
/// supervisor passes those on to Gitea).
pub type Fallback = Arc<dyn Fn(http::Request<Incoming>) -> BoxFuture<http::Response<BoxBody>> + Send + Sync>;

struct RawRequest {
    body: Bytes,
    codec: Codec,
    headers: HeaderMap,
    deadline: Option<Instant>,
    peer: Option<SocketAddr>,
}

type RawHandler = dyn Fn(RawRequest, DescriptorPool) -> BoxFuture<Result<(Bytes, HeaderMap), ConnectError>> + Send + Sync;

/// Routes `POST <prefix>/<package>.<Service>/<Method>` to typed unary handlers.
#[derive(Clone)]
pub struct Router {
    prefix: String,
    routes: HashMap<String, Arc<RawHandler>>,
    pool: DescriptorPool,
    max_request_bytes: usize,
    compress_min_bytes: usize,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut procedures: Vec<_> = self.routes.keys().collect();
        procedures.sort();
        f.debug_struct("Router").field("prefix", &self.prefix).field("procedures", &procedures).finish_non_exhaustive()
    }
}

impl Router {
    /// `pool` must hold the descriptors of every message the handlers use (for JSON).
    pub fn new(pool: DescriptorPool) -> Self {
        Router {
            prefix: String::new(),
            routes: HashMap::new(),
            pool,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            compress_min_bytes: DEFAULT_COMPRESS_MIN_BYTES,
        }
    }

    /// Serve every procedure under a path prefix, e.g. `/api/actions` as Gitea does.
    pub fn with_prefix(mut self, prefix: &str) -> Self {
        self.prefix = prefix.trim_end_matches('/').to_owned();
        self
    }

    pub fn with_max_request_bytes(mut self, limit: usize) -> Self {
        self.max_request_bytes = limit;
        self
    }

    pub fn with_compress_min_bytes(mut self, min: usize) -> Self {
        self.compress_min_bytes = min;
        self
    }

    /// Adds a unary procedure, named `package.Service/Method`.
    pub fn unary<Req, Resp, F, Fut>(mut self, procedure: &str, handler: F) -> Self
    where
        Req: Message,
        Resp: Message,
        F: Fn(Request<Req>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Response<Resp>, ConnectError>> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let raw: Arc<RawHandler> = Arc::new(move |raw: RawRequest, pool: DescriptorPool| {
            let handler = Arc::clone(&handler);
            Box::pin(async move {
                let message: Req = raw
                    .codec
                    .decode(&raw.body, &pool)
                    .map_err(|error| ConnectError::invalid_argument(format!("cannot decode the request body: {}", error_chain(&error))))?;
                let response = handler(Request { message, headers: raw.headers, deadline: raw.deadline, peer: raw.peer }).await?;
                let body = raw
                    .codec
                    .encode(&response.message, &pool)
                    .map_err(|error| ConnectError::internal(format!("cannot encode the response: {}", error_chain(&error))))?;
                Ok((body, response.headers))
            })
        });
        self.routes.insert(format!("/{}", procedure.trim_start_matches('/')), raw);
        self
    }

    /// Whether `path` names one of this router's procedures.
    pub fn routes(&self, path: &str) -> bool {
        path.strip_prefix(self.prefix.as_str()).is_some_and(|procedure| self.routes.contains_key(procedure))
    }

    /// Answers one HTTP request. Never fails: every problem becomes a Connect error.
    pub async fn handle<B>(&self, request: http::Request<B>, peer: Option<SocketAddr>) -> http::Response<Full<Bytes>>
    where
        B: hyper::body::Body<Data = Bytes> + Send,
        B::Error: std::error::Error + Send + Sync + 'static,
    {
        let method = request.method().clone();
        let path = request.uri().path().to_owned();
        let result = self.dispatch(request, peer).await;
        match result {
            Ok(response) => response,
            Err(rejection) => {
                let Rejection { status, error, extra } = rejection;
                tracing::warn!(
                    %method, %path, peer = ?peer, code = %error.code, status = status.as_u16(),
                    "connect request failed: {}", error.message
                );
                let mut response = error_response(status, &error);
                for (name, value) in extra {
                    response.headers_mut().insert(name, value);
                }
                response
            }
        }
    }

    /// One call, in the order connect-go checks it: the procedure and the method, the
    /// headers, the body (within the call's deadline, with the handler), the answer.
    async fn dispatch<B>(&self, request: http::Request<B>, peer: Option<SocketAddr>) -> Result<http::Response<Full<Bytes>>, Rejection>
    where
        B: hyper::body::Body<Data = Bytes> + Send,
        B::Error: std::error::Error + Send + Sync + 'static,
    {
        let handler = self.route(request.method(), request.uri().path())?;
        let limit = self.max_request_bytes;
        let call = CallHeaders::read(request.headers(), limit)?;
        let (parts, body) = request.into_parts();
        let pool = self.pool.clone();
        let work = async move {
            let body = read_body(body, call.gzipped, limit).await?;
            handler(RawRequest { body, codec: call.codec, headers: parts.headers, deadline: call.deadline, peer }, pool).await
        };
        let outcome = match call.deadline {
            Some(deadline) => tokio::time::timeout_at(deadline, work)
                .await
                .unwrap_or_else(|_| Err(ConnectError::deadline_exceeded("the call's Connect-Timeout-Ms deadline passed"))),
            None => work.await,
        };
        let (body, extra_headers) = outcome.map_err(Rejection::from)?;
        self.respond(&call, body, &extra_headers)
    }

    /// The handler of the procedure at `path`, which only answers POST.
    fn route(&self, method: &Method, path: &str) -> Result<Arc<RawHandler>, Rejection> {
        let handler = path
            .strip_prefix(self.prefix.as_str())
            .and_then(|procedure| self.routes.get(procedure))
            .cloned()
            .ok_or_else(|| Rejection::new(StatusCode::NOT_FOUND, ConnectError::new(Code::Unimplemented, format!("no procedure at {path}"))))?;
        if method != Method::POST {
            return Err(Rejection::new(
                StatusCode::METHOD_NOT_ALLOWED,
                ConnectError::new(Code::Unimplemented, format!("HTTP method {method} is not supported: Connect unary calls use POST")),
            )
            .with_header(header::ALLOW, HeaderValue::from_static("POST")));
        }
        Ok(handler)
    }

    /// The answer: the handler's message in the call's codec, gzipped when the client
    /// takes gzip and it is large enough, with the handler's headers added.
    fn respond(&self, call: &CallHeaders, body: Bytes, extra_headers: &HeaderMap) -> Result<http::Response<Full<Bytes>>, Rejection> {
        let mut response = http::Response::builder().status(StatusCode::OK).header(header::CONTENT_TYPE, call.codec.content_type());
        let body = if call.accepts_gzip && body.len() >= self.compress_min_bytes {
            response = response.header(header::CONTENT_ENCODING, "gzip");
            Bytes::from(protocol::gzip(&body))
        } else {
            body
        };
        let mut response = response.body(Full::new(body)).map_err(|error| Rejection::from(ConnectError::internal(error.to_string())))?;
        for (name, value) in extra_headers {
            response.headers_mut().append(name, value.clone());
        }
        Ok(response)
    }
}

/// What a call's headers say, each checked as connect-go checks it.
struct CallHeaders {
    codec: Codec,
    /// From `Connect-Timeout-Ms`, counted from when the headers were read.
    deadline: Option<Instant>,
    /// The body is gzipped (`Content-Encoding`).
    gzipped: bool,
    /// The client takes a gzipped answer (`Accept-Encoding`).
    accepts_gzip: bool,
}

impl CallHeaders {
    /// The headers of a call whose body may be at most `limit` bytes.
    fn read(headers: &HeaderMap, limit: usize) -> Result<Self, Rejection> {
        let content_type = header_str(headers, header::CONTENT_TYPE.as_str()).unwrap_or("");
        let codec = Codec::from_content_type(content_type).ok_or_else(|| {
            Rejection::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                ConnectError::new(Code::Unknown, format!("unsupported content-type {content_type:?}: use application/proto or application/json")),
            )
            .with_header(
                header::HeaderName::from_static("accept-post"),
                HeaderValue::from_static("application/json, application/json; charset=utf-8, application/proto"),
            )
        })?;

        if let Some(version) = header_str(headers, protocol::PROTOCOL_VERSION_HEADER)
            && version != protocol::PROTOCOL_VERSION
        {
            return Err(Rejection::from(ConnectError::invalid_argument(format!("Connect-Protocol-Version must be \"1\", got {version:?}"))));
        }

        let timeout = header_str(headers, protocol::TIMEOUT_HEADER)
            .map(protocol::parse_timeout)
            .transpose()
            .map_err(|error| Rejection::from(ConnectError::invalid_argument(error.to_string())))?;
        let deadline = timeout.map(|t| Instant::now() + t);

        let gzipped = match header_str(headers, header::CONTENT_ENCODING.as_str()) {
            None | Some("identity") => false,
            Some(value) if value.eq_ignore_ascii_case("gzip") => true,
            Some(other) => {
                return Err(Rejection::from(ConnectError::new(Code::Unimplemented, format!("unsupported content-encoding {other:?}: use gzip or identity"))));
            }
        };
        let accepts_gzip = header_str(headers, header::ACCEPT_ENCODING.as_str()).is_some_and(protocol::accepts_gzip);
        if let Some(length) = header_str(headers, header::CONTENT_LENGTH.as_str()).and_then(|v| v.parse::<u64>().ok())
            && length > u64::try_from(limit).unwrap_or(u64::MAX)
        {
            return Err(Rejection::from(too_large(limit)));
        }
        Ok(CallHeaders { codec, deadline, gzipped, accepts_gzip })
    }
}

/// The request body, at most `limit` bytes before and after decompression.
async fn read_body<B>(body: B, gzipped: bool, limit: usize) -> Result<Bytes, ConnectError>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let body = Limited::new(body, limit)
        .collect()
        .await
        .map_err(|error| {
            if error.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                too_large(limit)
            } else {
                ConnectError::new(Code::Canceled, format!("cannot read the request body: {error}"))
            }
        })?
        .to_bytes();
    if !gzipped {
        return Ok(body);
    }
    protocol::gunzip(&body, limit).map(Bytes::from).map_err(|error| match error {
        protocol::GunzipError::TooLarge { .. } => too_large(limit),
        protocol::GunzipError::Invalid(_) => ConnectError::invalid_argument(format!("cannot decompress the request body: {}", error_chain(&error))),
    })
}

fn too_large(limit: usize) -> ConnectError {
    ConnectError::new(Code::ResourceExhausted, format!("request body is larger than the limit of {limit} bytes"))
}

struct Rejection {
    status: StatusCode,
    error: ConnectError,
    extra: Vec<(header::HeaderName, HeaderValue)>,
}

impl Rejection {
    fn new(status: StatusCode, error: ConnectError) -> Self {
        Rejection { status, error, extra: Vec::new() }
    }

    fn with_header(mut self, name: header::HeaderName, value: HeaderValue) -> Self {
        self.extra.push((name, value));
        self
    }
}

impl From<ConnectError> for Rejection {
    fn from(error: ConnectError) -> Self {
        Rejection::new(error.code.http_status(), error)
    }
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn error_response(status: StatusCode, error: &ConnectError) -> http::Response<Full<Bytes>> {
    let mut response = http::Response::new(Full::new(error.to_json()));
    *response.status_mut() = status;
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// Serves `router` on `listener` until `shutdown` is cancelled, then lets in-flight
/// calls finish for at most `drain` before dropping the remaining connections.
///
/// # Errors
/// Only when accepting fails in a way that is not per-connection.
pub async fn serve(listener: TcpListener, router: Arc<Router>, shutdown: CancellationToken, drain: Duration) -> std::io::Result<()> {
    serve_with_fallback(listener, router, None, shutdown, drain).await
}

/// [`serve`], with every request that is not one of the router's procedures answered
/// by `fallback` (when there is one).
///
/// # Errors
/// Only when accepting fails in a way that is not per-connection.
pub async fn serve_with_fallback(
    listener: TcpListener,
    router: Arc<Router>,
    fallback: Option<Fallback>,
    shutdown: CancellationToken,
    drain: Duration,
) -> std::io::Result<()> {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut connections = JoinSet::new();
    loop {
        let (stream, peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) if is_per_connection(&error) => {
                    tracing::debug!(%error, "accept failed for one connection");
                    continue;
                }
                Err(error) => return Err(error),
            },
        };
        let router = Arc::clone(&router);
        let fallback = fallback.clone();
        let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
            let router = Arc::clone(&router);
            let fallback = fallback.clone();
            async move {
                let response = match fallback {
                    Some(fallback) if !router.routes(request.uri().path()) => fallback(request).await,
                    _ => router.handle(request, Some(peer)).await.map(|body| body.map_err(|never| match never {}).boxed_unsync()),
                };
                Ok::<_, Infallible>(response)
            }
        });
        let connection = hyper::server::conn::http1::Builder::new().keep_alive(true).serve_connection(TokioIo::new(stream), service);
        let connection = graceful.watch(connection);
        connections.spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, ?peer, "connection closed with an error");
            }
        });
        // Reap finished connection tasks so the set does not grow without bound.
        while connections.try_join_next().is_some() {}
    }
    drop(listener);
    if tokio::time::timeout(drain, graceful.shutdown()).await.is_err() {
        tracing::warn!(?drain, "connect server drain timed out; closing remaining connections");
    }
    connections.shutdown().await;
    Ok(())
}

fn is_per_connection(error: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(error.kind(), ConnectionAborted | ConnectionReset | Interrupted | WouldBlock)
}
