//! The v2 cache API: three Twirp calls of `github.actions.results.api.v1.CacheService`
//! (JSON, proto field names) and the Azure Blob uploads the toolkit always makes to the
//! URL `CreateCacheEntry` hands out. gitea-runner advertises it (ACTIONS_CACHE_SERVICE_V2)
//! when its cache server takes the job's registration, and rewrites actions' bundles so
//! that their client uses it on Gitea.
//!
//! - `CreateCacheEntry {key, version}` → `{ok, signed_upload_url}`; `{ok: false}` without
//!   a message when the key exists already in the job's scope (the client says so
//!   quietly and goes on).
//! - the upload: one `PUT` (up to 128 MiB), or `PUT ?comp=block&blockid=…` per 64 MiB
//!   block then `PUT ?comp=blocklist` naming them in order; every answer 201 with an
//!   `x-ms-request-id` (the Azure SDK fails on anything else).
//! - `FinalizeCacheEntryUpload {key, version, size_bytes}` → `{ok, entry_id}`.
//! - `GetCacheEntryDownloadURL {key, restore_keys, version}` → `{ok, signed_download_url,
//!   matched_key}`, or `{ok: false}` on a miss.

use bytes::Bytes;
use serde::Deserialize;

use crate::{
    CacheError, Refusal, Response, Scope,
    http::{BoxError, json, read_bytes, read_json, respond},
    lookup::{check_key, check_version},
    restore::Restores,
    store::Storage,
    uploads::{Begun, Finished, Piece, Uploads},
    v1::percent_decode,
};

/// The largest block list read (a 10 GiB archive in 64 MiB blocks names 160).
const MAX_BLOCK_LIST: usize = 1 << 20;

#[derive(Deserialize)]
struct Create {
    key: String,
    version: String,
}

#[derive(Deserialize)]
struct Finalize {
    key: String,
    version: String,
    /// An int64 as the proto JSON mapping writes it (a string), or a bare number; absent
    /// for an empty archive (the default is not sent).
    #[serde(default, alias = "sizeBytes")]
    size_bytes: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct DownloadUrl {
    key: String,
    version: String,
    #[serde(default, alias = "restoreKeys")]
    restore_keys: Vec<String>,
}

/// A refusal as the Twirp client reads it: its status, with the code its status means.
pub(crate) fn refused(refusal: &Refusal) -> Response {
    let code = match refusal.status {
        400 | 416 => "invalid_argument",
        403 => "permission_denied",
        404 => "not_found",
        _ => "resource_exhausted",
    };
    json(refusal.status, &serde_json::json!({ "code": code, "msg": refusal.message }))
}

/// A refusal of a blob upload, as the Azure SDK reads it.
pub(crate) fn refused_blob(refusal: &Refusal) -> Response {
    let escaped = refusal.message.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    respond(
        refusal.status,
        Some("application/xml"),
        format!("<?xml version=\"1.0\" encoding=\"utf-8\"?><Error><Code>InvalidInput</Code><Message>{escaped}</Message></Error>"),
    )
}

fn not_ok() -> Response {
    json(200, &serde_json::json!({ "ok": false }))
}

pub(crate) async fn create<B>(uploads: &Uploads, scope: &Scope, base: &str, body: B) -> Result<Result<Response, Refusal>, CacheError>
where
    B: http_body::Body<Data = Bytes> + Send,
    B::Error: Into<BoxError>,
{
    let request: Create = match read_json(body).await {
        Ok(request) => request,
        Err(problem) => return Ok(Err(Refusal::malformed(problem))),
    };
    // Its record and the pending name of its key.
    Ok(match uploads.begin(scope, &request.key, &request.version, 0, 2).await? {
        Begun::Started(upload) => {
            // Finalize names the key, not the upload: the latest upload of the key is the one.
            let pending = Storage::pending_path(&scope.repository, &scope.write, &request.version, &request.key);
            uploads.storage().put_json(&pending, &upload.id).await?;
            Ok(json(200, &serde_json::json!({ "ok": true, "signed_upload_url": format!("{base}/_apis/artifactcache/blobs/{}", upload.id) })))
        }
        Begun::Exists => Ok(not_ok()),
        Begun::Refused(refusal) => Err(refusal),
    })
}

pub(crate) async fn finalize<B>(uploads: &Uploads, scope: &Scope, body: B) -> Result<Result<Response, Refusal>, CacheError>
where
    B: http_body::Body<Data = Bytes> + Send,
    B::Error: Into<BoxError>,
{
    let request: Finalize = match read_json(body).await {
        Ok(request) => request,
        Err(problem) => return Ok(Err(Refusal::malformed(problem))),
    };
    let size = match &request.size_bytes {
        None => Some(0),
        Some(serde_json::Value::String(text)) => text.parse().ok(),
        Some(serde_json::Value::Number(number)) => number.as_u64(),
        Some(_) => None,
    };
    let Some(size) = size else { return Ok(Err(Refusal::malformed("size_bytes is not a byte count"))) };
    let pending = Storage::pending_path(&scope.repository, &scope.write, &request.version, &request.key);
    let Some(id) = uploads.storage().get_json::<u64>(&pending).await? else { return Ok(Ok(not_ok())) };
    let Ok(upload) = uploads.own(scope, &id.to_string()).await? else { return Ok(Ok(not_ok())) };
    let finished = uploads.finish(&upload, size).await?;
    uploads.storage().delete(&pending).await?;
    Ok(match finished {
        Finished::Committed(entry) => Ok(json(200, &serde_json::json!({ "ok": true, "entry_id": entry.id.to_string() }))),
        Finished::Exists => Ok(not_ok()),
        Finished::Refused(refusal) => Err(refusal),
    })
}

pub(crate) async fn download_url<B>(restores: &Restores, scope: &Scope, base: &str, body: B) -> Result<Result<Response, Refusal>, CacheError>
where
    B: http_body::Body<Data = Bytes> + Send,
    B::Error: Into<BoxError>,
{
    let request: DownloadUrl = match read_json(body).await {
        Ok(request) => request,
        Err(problem) => return Ok(Err(Refusal::malformed(problem))),
    };
    let keys: Vec<String> = std::iter::once(request.key).chain(request.restore_keys).collect();
    if let Some(problem) = keys.iter().find_map(|key| check_key(key).err()).or_else(|| check_version(&request.version).err()) {
        return Ok(Err(Refusal::malformed(problem)));
    }
    Ok(Ok(match restores.restore(scope, &keys, &request.version).await? {
        Some(entry) => json(
            200,
            &serde_json::json!({
                "ok": true,
                "signed_download_url": format!("{base}/_apis/artifactcache/artifacts/{}", entry.id),
                "matched_key": entry.key,
            }),
        ),
        None => not_ok(),
    }))
}

/// `PUT blobs/{id}`: the whole archive, a block of it, or the list that orders the blocks.
pub(crate) async fn blob<B>(
    uploads: &Uploads,
    scope: &Scope,
    id: &str,
    query: &str,
    headers: &http::HeaderMap,
    body: B,
) -> Result<Result<Response, Refusal>, CacheError>
where
    B: http_body::Body<Data = Bytes> + Send + Unpin,
    B::Error: Into<BoxError>,
{
    let upload = match uploads.own(scope, id).await? {
        Ok(upload) => upload,
        Err(refusal) => return Ok(Err(refusal)),
    };
    let pairs: Vec<(&str, &str)> = query.split('&').filter_map(|pair| pair.split_once('=')).collect();
    let value = |name: &str| pairs.iter().find(|(key, _)| key.eq_ignore_ascii_case(name)).map(|(_, value)| *value);
    let length = headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    let piece = match value("comp").map(str::to_ascii_lowercase).as_deref() {
        Some("blocklist") => {
            let list = match read_bytes(body, MAX_BLOCK_LIST).await {
                Ok(list) => list,
                Err(problem) => return Ok(Err(Refusal::malformed(problem))),
            };
            let ordered = uploads.order_blocks(&upload, &block_list(&String::from_utf8_lossy(&list))).await?;
            return Ok(ordered.map(|()| created()));
        }
        Some("block") => match value("blockid").map(percent_decode) {
            Some(block) if !block.is_empty() && block.len() <= 256 => Piece::Block(block),
            _ => return Ok(Err(Refusal::malformed("a block needs a blockid"))),
        },
        _ => Piece::Part(0),
    };
    Ok(uploads.write(&upload, piece, length, body).await?.map(|_| created()))
}

/// `<BlockList><Latest>id</Latest>…</BlockList>` → the ids in order. Hand-read: the list
/// is a flat sequence of one element kind, and the ids are base64 (no markup in them);
/// `Committed`/`Uncommitted` elements are taken as `Latest` is.
fn block_list(xml: &str) -> Vec<String> {
    let mut ids = Vec::new();
    let mut rest = xml;
    while let Some(open) = rest.find('<') {
        rest = &rest[open + 1..];
        let Some(close) = rest.find('>') else { break };
        let tag = &rest[..close];
        rest = &rest[close + 1..];
        if ["Latest", "Committed", "Uncommitted"].contains(&tag) {
            let Some(end) = rest.find("</") else { break };
            ids.push(rest[..end].trim().to_owned());
            rest = &rest[end..];
        }
    }
    ids
}

fn created() -> Response {
    let mut response = respond(201, None, Bytes::new());
    let request_id = crate::new_id().unwrap_or(1).to_string();
    if let Ok(value) = http::HeaderValue::from_str(&request_id) {
        // The Azure SDK reads it from every answer.
        response.headers_mut().insert("x-ms-request-id", value);
    }
    response.headers_mut().insert("x-ms-version", http::HeaderValue::from_static("2025-01-05"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_lists_are_read_in_order() {
        let xml = r#"<?xml version="1.0" encoding="utf-8"?><BlockList><Latest>AAA=</Latest><Latest>AAE=</Latest><Uncommitted>AAI=</Uncommitted></BlockList>"#;
        assert_eq!(block_list(xml), ["AAA=", "AAE=", "AAI="]);
        assert!(block_list("<BlockList/>").is_empty());
        assert!(block_list("not xml").is_empty());
    }
}
