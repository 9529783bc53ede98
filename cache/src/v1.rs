//! The legacy `_apis/artifactcache` API that `@actions/cache` speaks on Gitea (its
//! client takes every server that is not github.com for a GHES, which speaks v1):
//!
//! - `GET cache?keys=K1,K2&version=V`: 204 on a miss (never 404, which the client
//!   reports as an error), else 200 with `archiveLocation` and `cacheKey`.
//! - `POST caches {key, version, cacheSize}`: `{cacheId}` (a JavaScript number, never
//!   0); 409 when the key exists already in the job's scope (the client says "another
//!   job may be creating this cache" and goes on); 400 when it is too large.
//! - `PATCH caches/{id}` with `Content-Range: bytes S-E/*`: one chunk (32 MiB by
//!   default, four at once, in any order).
//! - `POST caches/{id} {size}`: the commit; the entry becomes visible now.
//!
//! An adapter: each call's request parsed, handed to [`crate::uploads`] or
//! [`crate::restore`], and its answer (or refusal) encoded as the v1 client reads it.

use bytes::Bytes;
use serde::Deserialize;

use crate::{
    error::CacheError,
    http::{BoxError, Response, empty, form_urlencoded, json, message, read_json},
    refusal::Refusal,
    restore::Restores,
    scope::Scope,
    uploads::{Begun, Finished, Piece, Uploads},
};

/// The most keys a restore may name (the toolkit's own limit).
const MAX_KEYS: usize = 10;

/// A refusal as the v1 client reads it: its status, and `message` in the body.
pub(crate) fn refused(refusal: &Refusal) -> Response {
    message(refusal.status, &refusal.message)
}

pub(crate) async fn lookup(restores: &Restores, scope: &Scope, base: &str, query: &str) -> Result<Response, CacheError> {
    let mut keys = Vec::new();
    let mut version = String::new();
    for (name, value) in form_urlencoded(query) {
        match name.as_str() {
            "keys" => keys.extend(value.split(',').map(str::to_owned)),
            "version" => version = value,
            _ => {}
        }
    }
    if keys.is_empty() || keys.len() > MAX_KEYS {
        return Err(Refusal::malformed(format!("a restore names 1 to {MAX_KEYS} keys, this one {}", keys.len())).into());
    }
    Ok(match restores.restore(scope, &keys, &version).await? {
        Some(entry) => json(
            200,
            &serde_json::json!({
                "result": "hit",
                "archiveLocation": contract::cache::archive_url(base, entry.id),
                "cacheKey": entry.key,
            }),
        ),
        None => empty(204),
    })
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Reserve {
    key: String,
    version: String,
    #[serde(default)]
    cache_size: Option<u64>,
}

pub(crate) async fn reserve<B>(uploads: &Uploads, scope: &Scope, body: B) -> Result<Response, CacheError>
where
    B: http_body::Body<Data = Bytes> + Send,
    B::Error: Into<BoxError>,
{
    let request: Reserve = read_json(body).await.map_err(Refusal::malformed)?;
    Ok(match uploads.begin(scope, &request.key, &request.version, request.cache_size.unwrap_or(0), 1).await? {
        Begun::Started(upload) => json(200, &serde_json::json!({ "cacheId": upload.id })),
        Begun::Exists => message(409, exists(&request.key, &scope.write)),
    })
}

fn exists(key: &str, git_ref: &str) -> String {
    format!("the entry {key:?} exists already for {git_ref}: a committed entry is never overwritten")
}

pub(crate) async fn upload<B>(uploads: &Uploads, scope: &Scope, id: &str, headers: &http::HeaderMap, body: B) -> Result<Response, CacheError>
where
    B: http_body::Body<Data = Bytes> + Send + Unpin,
    B::Error: Into<BoxError>,
{
    let upload = uploads.own(scope, id).await?;
    let Some((start, end)) = headers.get(http::header::CONTENT_RANGE).and_then(|v| v.to_str().ok()).and_then(content_range) else {
        return Err(Refusal::malformed("a chunk carries Content-Range: bytes START-END/*").into());
    };
    uploads.write(&upload, Piece::Part(start), Some(end - start + 1), body).await?;
    Ok(empty(204))
}

#[derive(Deserialize)]
struct Commit {
    size: u64,
}

pub(crate) async fn commit<B>(uploads: &Uploads, scope: &Scope, id: &str, body: B) -> Result<Response, CacheError>
where
    B: http_body::Body<Data = Bytes> + Send,
    B::Error: Into<BoxError>,
{
    let upload = uploads.own(scope, id).await?;
    let request: Commit = read_json(body).await.map_err(Refusal::malformed)?;
    Ok(match uploads.finish(&upload, request.size).await? {
        Finished::Committed(_) => json(200, &serde_json::json!({})),
        Finished::Exists => message(409, exists(&upload.key, &upload.git_ref)),
    })
}

/// `bytes START-END/*` (or `/TOTAL`) → (START, END), END inclusive.
fn content_range(value: &str) -> Option<(u64, u64)> {
    let range = value.trim().strip_prefix("bytes ")?;
    let (span, _) = range.split_once('/')?;
    let (start, end) = span.split_once('-')?;
    let (start, end) = (start.trim().parse().ok()?, end.trim().parse().ok()?);
    (start <= end).then_some((start, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_ranges_are_read_as_the_toolkit_writes_them() {
        assert_eq!(content_range("bytes 0-33554431/*"), Some((0, 33_554_431)));
        assert_eq!(content_range("bytes 33554432-40000000/40000001"), Some((33_554_432, 40_000_000)));
        for bad in ["0-1/*", "bytes 5-1/*", "bytes x-1/*", "bytes 0-1"] {
            assert_eq!(content_range(bad), None, "{bad}");
        }
    }
}
