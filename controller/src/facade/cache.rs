//! The cache on the facade's own transport: an environment's supervisor forwards its
//! job's `actions/cache` requests here (`/gdr.cache.v1.Cache/<the cache API's path>`),
//! over the same connection — its own unix socket, or SPIFFE mTLS — that carries its
//! reports, with its session capability. So the cache needs no credential of its own in
//! any environment, and a job's scope is what its task says, never what it claims: its
//! repository, the ref it may save under, the refs it may restore from. The cache
//! answers while the assignment is claimed and not finished; the job's runtime token
//! must come with each request too (what the toolkit sends anyway).

use std::{
    convert::Infallible,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use ::cache::{
    Cache, Scope,
    api::{Call, call_of, without_cache},
};
use proto::facade::v1::AssignmentCredential;

use super::{Facade, Peer};
use crate::{
    assignment::context::{cache_scope, runtime_tokens},
    store::State,
};

use contract::cache::{HEADER_ASSIGNMENT, HEADER_CAPABILITY, HEADER_URL, PREFIX};

/// The cache route of the facade's server; without a cache it says so to each job.
#[derive(Debug, Clone)]
pub struct CacheRoute {
    facade: Arc<Facade>,
    cache: Option<Arc<Cache>>,
}

impl CacheRoute {
    pub fn new(facade: Arc<Facade>, cache: Option<Arc<Cache>>) -> Self {
        CacheRoute { facade, cache }
    }
}

/// Why a job's cache does nothing here.
const NO_CACHE: &str = "this runner keeps no cache: its controller's [cache] is off (cache.enabled = false, or no cache.dir nor [cache.s3])";

impl tonic::server::NamedService for CacheRoute {
    const NAME: &'static str = "gdr.cache.v1.Cache";
}

type Body = tonic::body::Body;

impl tower::Service<http::Request<Body>> for CacheRoute {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let route = self.clone();
        Box::pin(async move { Ok(route.answer(request).await.map(Body::new)) })
    }
}

impl CacheRoute {
    async fn answer(&self, request: http::Request<Body>) -> ::cache::Response {
        let (mut parts, body) = request.into_parts();
        let path = parts.uri.path().strip_prefix(PREFIX).unwrap_or("/").to_owned();
        // The cache's own route table: whether the request may come without the token, and
        // what to say where no cache is kept.
        let call = call_of(&parts.method, &path);
        let (scope, base) = match self.admit(&parts, &call).await {
            Ok(admitted) => admitted,
            Err((status, message)) => return ::cache::http::message(status, message),
        };
        let Some(cache) = &self.cache else { return without_cache(&call, NO_CACHE) };
        let path_and_query = match parts.uri.query() {
            Some(query) => format!("{path}?{query}"),
            None => path,
        };
        parts.uri = match path_and_query.parse() {
            Ok(uri) => uri,
            Err(_) => return ::cache::http::message(400, "the request's path is not a URI"),
        };
        Arc::clone(cache).serve(scope, base, http::Request::from_parts(parts, body)).await
    }

    /// The job's scope, and the cache's URL as it reaches it; or why it may not ask.
    async fn admit(&self, request: &http::request::Parts, call: &Call) -> Result<(Scope, String), (u16, String)> {
        let peer = request.extensions.get::<Peer>().cloned().ok_or((401, "the transport established no peer identity".to_owned()))?;
        let header = |name: &str| request.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
        let credential = AssignmentCredential { assignment_id: header(HEADER_ASSIGNMENT), capability: header(HEADER_CAPABILITY) };
        let (record, assignment) = self.facade.authorize_session(&peer, &credential).await.map_err(|status| (401, status.message().to_owned()))?;
        match &record.value.state {
            State::Claimed { .. } => {}
            State::Pending => return Err((403, format!("{} is not claimed yet", assignment.id))),
            State::Terminal { .. } => return Err((403, format!("{} has ended: its job's cache access ended with it", assignment.id))),
        }
        // The archive URLs the cache hands out are fetched and uploaded without the token
        // (the toolkit treats them as signed URLs): this connection is their credential.
        let handed_out = call.is_handed_out();
        let bearer = header(http::header::AUTHORIZATION.as_str());
        let token = bearer.strip_prefix("Bearer ").unwrap_or("");
        // Compared as digests: how long the comparison takes says nothing of the token.
        let digest = |text: &str| ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
        if !handed_out && !runtime_tokens(&assignment.task).iter().any(|known| !known.is_empty() && digest(known).as_ref() == digest(token).as_ref()) {
            return Err((401, "the request does not carry this job's ACTIONS_RUNTIME_TOKEN".to_owned()));
        }
        let base = header(HEADER_URL);
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err((400, format!("{HEADER_URL} must be the cache's URL as the job reaches it")));
        }
        Ok((cache_scope(&assignment.task).for_job(assignment.id.clone()), base))
    }
}
