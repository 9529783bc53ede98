//! The pass-through to Gitea. The runner's `.runner` address is also the Gitea URL it
//! gives to jobs (`GITHUB_SERVER_URL`, `ACTIONS_RUNTIME_URL`, `ACTIONS_RESULTS_URL`,
//! clone URLs of actions), so the loopback is "Gitea as the runner sees it": it answers
//! the runner protocol itself and passes every other request — checkout, artifacts,
//! caches, API calls of steps — to the real Gitea (CI_GITEA_URL), streaming, with
//! method, path, query, headers and bodies unchanged. Only what a proxy must change
//! changes: the Host header becomes Gitea's, hop-by-hop headers are dropped. Nothing of
//! the runner's credential exists here, so nothing is added.

use std::sync::Arc;

use bytes::Bytes;
use connect::{BoxBody, Fallback};
use http::{HeaderMap, HeaderValue, Response, StatusCode, Uri, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;

/// How long Gitea may take to answer a request's headers (a body then streams for as
/// long as it takes: a large artifact download is not cut off).
pub const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// Headers that belong to one connection, not to the request (RFC 9110 §7.6.1); the
/// framing (`transfer-encoding`) is hyper's to choose on each side.
const HOP_BY_HOP: [&str; 9] =
    ["connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"];

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("CI_GITEA_URL {0:?} is not an absolute http(s) URL")]
    Url(String),
    #[error("cannot set up TLS for Gitea")]
    Tls(#[source] connect::client::ClientError),
}

/// The fallback of the loopback: every non-runner-protocol request goes to `gitea`
/// (or, without a Gitea URL, gets a 502 that says why).
///
/// # Errors
/// A Gitea URL that is not absolute http(s), or TLS that cannot be set up.
pub fn fallback(gitea: Option<&str>) -> Result<Fallback, ProxyError> {
    let Some(gitea) = gitea else {
        return Ok(Arc::new(|request: http::Request<Incoming>| {
            let path = request.uri().path().to_owned();
            Box::pin(async move {
                bad_gateway(&format!("{path}: this environment knows no Gitea (CI_GITEA_URL is not set), so only the runner protocol is served here"))
            })
        }));
    };
    let base: Uri = gitea.parse().map_err(|_| ProxyError::Url(gitea.to_owned()))?;
    let (Some(scheme), Some(authority)) = (base.scheme().cloned(), base.authority().cloned()) else {
        return Err(ProxyError::Url(gitea.to_owned()));
    };
    if !matches!(scheme.as_str(), "http" | "https") {
        return Err(ProxyError::Url(gitea.to_owned()));
    }
    let prefix = base.path().trim_end_matches('/').to_owned();
    let host = HeaderValue::from_str(authority.as_str()).map_err(|_| ProxyError::Url(gitea.to_owned()))?;
    let client = connect::client::http_client::<Incoming>().map_err(ProxyError::Tls)?;
    let gitea = gitea.to_owned();
    Ok(Arc::new(move |request: http::Request<Incoming>| {
        let (client, scheme, authority, prefix, host, gitea) = (client.clone(), scheme.clone(), authority.clone(), prefix.clone(), host.clone(), gitea.clone());
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            let path_and_query = parts.uri.path_and_query().map_or("/", |p| p.as_str());
            let target = format!("{prefix}{path_and_query}");
            let Ok(uri) = Uri::builder().scheme(scheme).authority(authority).path_and_query(target.as_str()).build() else {
                return bad_gateway(&format!("cannot form a Gitea URL for {path_and_query}"));
            };
            parts.uri = uri;
            parts.version = http::Version::HTTP_11;
            strip_hop_by_hop(&mut parts.headers);
            parts.headers.insert(header::HOST, host);
            let method = parts.method.clone();
            let answered = tokio::time::timeout(ANSWER_TIMEOUT, client.request(http::Request::from_parts(parts, body))).await;
            let Ok(answered) = answered else {
                tracing::warn!(%method, target = %target, "Gitea did not answer within {}s", ANSWER_TIMEOUT.as_secs());
                let mut response = bad_gateway(&format!("{method} {target}: Gitea at {gitea} did not answer within {}s", ANSWER_TIMEOUT.as_secs()));
                *response.status_mut() = StatusCode::GATEWAY_TIMEOUT;
                return response;
            };
            match answered {
                Ok(response) => {
                    let (mut parts, body) = response.into_parts();
                    strip_hop_by_hop(&mut parts.headers);
                    Response::from_parts(parts, body.map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>).boxed_unsync())
                }
                Err(error) => {
                    tracing::warn!(%method, target = %target, error = %crate::error_chain(&error), "passing a request to Gitea failed");
                    bad_gateway(&format!("{method} {target}: Gitea at {gitea} did not answer: {}", crate::error_chain(&error)))
                }
            }
        })
    }))
}

pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Headers named in Connection are hop-by-hop too.
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|name| name.trim().to_ascii_lowercase()))
        .collect();
    for name in HOP_BY_HOP.iter().map(|n| (*n).to_owned()).chain(named) {
        headers.remove(name.as_str());
    }
}

pub(crate) fn bad_gateway(message: &str) -> Response<BoxBody> {
    let mut response = Response::new(Full::new(Bytes::from(format!("gitea-dynamic-runner: {message}\n"))).map_err(|never| match never {}).boxed_unsync());
    *response.status_mut() = StatusCode::BAD_GATEWAY;
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_go_and_the_rest_stays() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "keep-alive, x-private"),
            ("keep-alive", "timeout=5"),
            ("x-private", "1"),
            ("authorization", "token abc"),
            ("content-type", "application/json"),
            ("transfer-encoding", "chunked"),
        ] {
            headers.insert(http::HeaderName::from_static(name), HeaderValue::from_static(value));
        }
        strip_hop_by_hop(&mut headers);
        let left: Vec<&str> = headers.keys().map(http::HeaderName::as_str).collect();
        assert_eq!(left, ["authorization", "content-type"]);
    }

    #[test]
    fn gitea_urls_are_checked() {
        assert!(fallback(Some("http://10.0.0.1:3000")).is_ok());
        assert!(fallback(Some("https://gitea.example.com/sub/")).is_ok());
        assert!(fallback(None).is_ok());
        for bad in ["gitea:3000", "ftp://gitea", "/relative"] {
            assert!(fallback(Some(bad)).is_err(), "{bad}");
        }
    }
}
