//! A proxy in front of the real Gitea that can answer for it for a while: the faults a
//! real Gitea cannot be made to produce on demand (a reverse proxy's bare 401 during a
//! rollout, a 503 while it restarts). Everything else passes through unchanged. Only
//! the runner API (`/api/actions/`) is faulted: the controller's path, not the jobs'.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU16, AtomicU64, Ordering},
    },
};

use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::{Bytes, Incoming};

/// The prefix of Gitea's runner API.
const RUNNER_API: &str = "/api/actions/";

type Body = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

pub struct FaultProxy {
    address: SocketAddr,
    /// 0 passes through; otherwise the status answered on the runner API.
    status: Arc<AtomicU16>,
    /// Requests answered by the fault.
    faulted: Arc<AtomicU64>,
    serving: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free port of 127.0.0.1 and passes requests to `upstream`
    /// (`http://host:port`).
    pub async fn start(upstream: &str) -> FaultProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (status, faulted) = (Arc::new(AtomicU16::new(0)), Arc::new(AtomicU64::new(0)));
        let client = connect::client::http_client::<Incoming>().unwrap();
        let upstream: http::Uri = upstream.parse().unwrap();
        let serving = {
            let (status, faulted) = (Arc::clone(&status), Arc::clone(&faulted));
            tokio::spawn(async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else { continue };
                    let (client, upstream, status, faulted) = (client.clone(), upstream.clone(), Arc::clone(&status), Arc::clone(&faulted));
                    tokio::spawn(async move {
                        let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
                            let (client, upstream, status, faulted) = (client.clone(), upstream.clone(), Arc::clone(&status), Arc::clone(&faulted));
                            async move { Ok::<_, std::convert::Infallible>(answer(request, &client, &upstream, &status, &faulted).await) }
                        });
                        let _ = hyper::server::conn::http1::Builder::new().serve_connection(hyper_util::rt::TokioIo::new(stream), service).await;
                    });
                }
            })
        };
        FaultProxy { address, status, faulted, serving }
    }

    /// `http://127.0.0.1:<port>`
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Answers the runner API with `status` from now on (401, 503 …).
    pub fn fail_with(&self, status: u16) {
        self.status.store(status, Ordering::SeqCst);
    }

    /// Passes everything through again.
    pub fn heal(&self) {
        self.status.store(0, Ordering::SeqCst);
    }

    /// Requests the fault answered so far.
    pub fn faulted(&self) -> u64 {
        self.faulted.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.serving.abort();
    }
}

type Client = hyper_util::client::legacy::Client<hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>, Incoming>;

async fn answer(request: http::Request<Incoming>, client: &Client, upstream: &http::Uri, status: &AtomicU16, faulted: &AtomicU64) -> http::Response<Body> {
    let fault = status.load(Ordering::SeqCst);
    if fault != 0 && request.uri().path().starts_with(RUNNER_API) {
        faulted.fetch_add(1, Ordering::SeqCst);
        let mut response = http::Response::new(full(format!("fault injected by the test: {fault}\n")));
        *response.status_mut() = http::StatusCode::from_u16(fault).unwrap();
        return response;
    }
    let (mut parts, body) = request.into_parts();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
    parts.uri = http::Uri::builder()
        .scheme(upstream.scheme().unwrap().clone())
        .authority(upstream.authority().unwrap().clone())
        .path_and_query(path.as_str())
        .build()
        .unwrap();
    parts.headers.insert(http::header::HOST, http::HeaderValue::from_str(upstream.authority().unwrap().as_str()).unwrap());
    match client.request(http::Request::from_parts(parts, body)).await {
        Ok(response) => {
            let (parts, body) = response.into_parts();
            http::Response::from_parts(parts, body.map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>).boxed())
        }
        Err(error) => {
            let mut response = http::Response::new(full(format!("the fault proxy could not reach Gitea: {error}\n")));
            *response.status_mut() = http::StatusCode::BAD_GATEWAY;
            response
        }
    }
}

fn full(text: String) -> Body {
    Full::new(Bytes::from(text)).map_err(|never| match never {}).boxed()
}
