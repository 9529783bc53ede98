//! A Connect unary client on hyper (HTTP/1.1 with keep-alive; https through rustls
//! with the ring provider and the system's roots).
//!
//! Every failure comes back as a [`ConnectError`], as with connect-go: transport
//! failures are `unavailable`, an expired deadline is `deadline_exceeded`.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use contract::error_chain;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::{
    client::legacy::{Client as HyperClient, connect::HttpConnector},
    rt::TokioExecutor,
};
use prost_reflect::DescriptorPool;

use crate::{
    code::Code,
    codec::{Codec, Message},
    error::ConnectError,
    protocol,
};

/// Default bound on a response body, after decompression.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 16 << 20;

/// Why a client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid base URL {url:?}: {reason}")]
    InvalidBaseUrl { url: String, reason: String },
    #[error("cannot set up TLS")]
    Tls(#[source] rustls::Error),
}

/// Per-call settings.
#[derive(Debug, Clone, Default)]
pub struct CallOptions {
    /// Sent as `Connect-Timeout-Ms` and enforced locally.
    pub timeout: Option<Duration>,
    /// Added to the client's default headers for this call.
    pub headers: HeaderMap,
}

impl CallOptions {
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
}

/// A successful call: the message and the response headers.
#[derive(Debug, Clone)]
pub struct Response<M> {
    pub message: M,
    pub headers: HeaderMap,
}

#[derive(Clone)]
pub struct Client {
    base_url: String,
    http: HyperClient<HttpsConnector<HttpConnector>, Full<Bytes>>,
    codec: Codec,
    pool: DescriptorPool,
    headers: HeaderMap,
    max_response_bytes: usize,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Default headers may carry credentials (x-runner-token): never print them.
        f.debug_struct("Client").field("base_url", &self.base_url).field("codec", &self.codec).finish_non_exhaustive()
    }
}

/// TLS with the ring provider and the system's roots (also for other HTTP clients of
/// the workspace, so every client trusts the same anchors).
///
/// # Errors
/// When the provider refuses the default protocol versions.
pub fn default_tls() -> Result<rustls::ClientConfig, ClientError> {
    Ok(rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(ClientError::Tls)?
        .with_root_certificates(native_roots())
        .with_no_client_auth())
}

/// How long establishing a connection may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

fn http_client_with<B>(tls: rustls::ClientConfig) -> HyperClient<HttpsConnector<HttpConnector>, B>
where
    B: hyper::body::Body + Send,
    B::Data: Send,
{
    // A peer that never accepts must not hold a caller for the kernel's minutes of SYN
    // retries: connecting is bounded; answers are bounded by each caller.
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(CONNECT_TIMEOUT));
    http.enforce_http(false);
    http.set_nodelay(true);
    let connector = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls).https_or_http().enable_http1().wrap_connector(http);
    HyperClient::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(90)).pool_max_idle_per_host(10).build(connector)
}

/// A plain HTTP/1.1 client for http and https URLs (rustls with ring, the system's
/// roots, keep-alive): the transport under [`Client`], and what the supervisor passes
/// requests to Gitea with.
///
/// # Errors
/// When TLS cannot be set up.
pub fn http_client<B>() -> Result<HyperClient<HttpsConnector<HttpConnector>, B>, ClientError>
where
    B: hyper::body::Body + Send,
    B::Data: Send,
{
    Ok(http_client_with(default_tls()?))
}

impl Client {
    /// A client for procedures under `base_url` (for Gitea: `<instance>/api/actions`).
    ///
    /// # Errors
    /// When the URL is not absolute http(s).
    pub fn new(base_url: &str, pool: DescriptorPool) -> Result<Self, ClientError> {
        Self::with_tls_config(base_url, pool, default_tls()?)
    }

    /// Like [`Client::new`] with a caller-supplied TLS configuration (private CA,
    /// client certificates).
    ///
    /// # Errors
    /// When the URL is not absolute http(s).
    pub fn with_tls_config(base_url: &str, pool: DescriptorPool, tls: rustls::ClientConfig) -> Result<Self, ClientError> {
        let invalid = |reason: &str| ClientError::InvalidBaseUrl { url: base_url.to_owned(), reason: reason.to_owned() };
        let uri: http::Uri = base_url.parse().map_err(|_| invalid("not a URL"))?;
        match uri.scheme_str() {
            Some("http" | "https") => {}
            _ => return Err(invalid("the scheme must be http or https")),
        }
        if uri.host().is_none_or(str::is_empty) {
            return Err(invalid("no host"));
        }
        if uri.query().is_some() {
            return Err(invalid("a query string is not allowed"));
        }
        let http = http_client_with(tls);
        Ok(Client {
            base_url: base_url.trim_end_matches('/').to_owned(),
            http,
            codec: Codec::Proto,
            pool,
            headers: HeaderMap::new(),
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
        })
    }

    pub fn with_codec(mut self, codec: Codec) -> Self {
        self.codec = codec;
        self
    }

    /// A header sent on every call (e.g. `x-runner-uuid`).
    pub fn with_header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.insert(name, value);
        self
    }

    pub fn with_max_response_bytes(mut self, limit: usize) -> Self {
        self.max_response_bytes = limit;
        self
    }

    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// Calls `procedure` (`package.Service/Method`).
    ///
    /// # Errors
    /// The server's Connect error, or a client-side one (see the module docs).
    pub async fn unary<Req: Message, Resp: Message>(&self, procedure: &str, message: &Req, options: &CallOptions) -> Result<Response<Resp>, ConnectError> {
        let call = self.call(procedure, message, options);
        match options.timeout {
            Some(timeout) => tokio::time::timeout(timeout, call)
                .await
                .unwrap_or_else(|_| Err(ConnectError::deadline_exceeded(format!("{procedure}: no answer within {} ms", timeout.as_millis())))),
            None => call.await,
        }
    }

    async fn call<Req: Message, Resp: Message>(&self, procedure: &str, message: &Req, options: &CallOptions) -> Result<Response<Resp>, ConnectError> {
        let url = format!("{}/{}", self.base_url, procedure.trim_start_matches('/'));
        let body =
            self.codec.encode(message, &self.pool).map_err(|error| ConnectError::internal(format!("cannot encode the request: {}", error_chain(&error))))?;
        let mut request = http::Request::builder()
            .method(Method::POST)
            .uri(&url)
            .header(header::CONTENT_TYPE, self.codec.content_type())
            .header(protocol::PROTOCOL_VERSION_HEADER, protocol::PROTOCOL_VERSION)
            .header(header::ACCEPT_ENCODING, "gzip")
            .header(header::USER_AGENT, concat!("gitea-dynamic-runner/", env!("CARGO_PKG_VERSION")));
        if let Some(timeout) = options.timeout.and_then(protocol::format_timeout) {
            request = request.header(protocol::TIMEOUT_HEADER, timeout);
        }
        let mut request = request.body(Full::new(body)).map_err(|error| ConnectError::internal(format!("invalid request to {url}: {error}")))?;
        for (name, value) in self.headers.iter().chain(options.headers.iter()) {
            request.headers_mut().insert(name, value.clone());
        }

        let response = self.http.request(request).await.map_err(|error| ConnectError::unavailable(format!("{url}: {}", error_chain(&error))))?;
        let (parts, body) = response.into_parts();
        let limit = self.max_response_bytes;
        let body = Limited::new(body, limit)
            .collect()
            .await
            .map_err(|error| {
                if error.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                    ConnectError::new(Code::ResourceExhausted, format!("{url}: response larger than {limit} bytes"))
                } else {
                    ConnectError::unavailable(format!("{url}: cannot read the response: {error}"))
                }
            })?
            .to_bytes();
        let body = match parts.headers.get(header::CONTENT_ENCODING).map(HeaderValue::to_str) {
            None | Some(Ok("identity")) => body,
            Some(Ok(value)) if value.eq_ignore_ascii_case("gzip") => Bytes::from(
                protocol::gunzip(&body, limit)
                    .map_err(|error| ConnectError::internal(format!("{url}: cannot decompress the response: {}", error_chain(&error))))?,
            ),
            Some(other) => {
                return Err(ConnectError::internal(format!("{url}: unsupported response content-encoding {other:?}")));
            }
        };

        if parts.status != StatusCode::OK {
            return Err(ConnectError::from_response(parts.status, &body));
        }
        let content_type = parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
        if Codec::from_content_type(content_type) != Some(self.codec) {
            return Err(ConnectError::internal(format!("{url}: invalid content-type {content_type:?}; expected {:?}", self.codec.content_type())));
        }
        let message = self
            .codec
            .decode(&body, &self.pool)
            .map_err(|error| ConnectError::internal(format!("{url}: cannot decode the response: {}", error_chain(&error))))?;
        Ok(Response { message, headers: parts.headers })
    }
}

/// The system's trust anchors. A machine without any still gets a client: plain
/// http works, and https fails with a certificate error that names the problem.
fn native_roots() -> rustls::RootCertStore {
    let mut roots = rustls::RootCertStore::empty();
    let loaded = rustls_native_certs::load_native_certs();
    for error in &loaded.errors {
        tracing::warn!(%error, "cannot load a system CA certificate");
    }
    let (_added, ignored) = roots.add_parsable_certificates(loaded.certs);
    if ignored > 0 {
        tracing::debug!(ignored, "ignored unparsable system CA certificates");
    }
    roots
}
