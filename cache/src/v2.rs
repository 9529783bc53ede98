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
//!
//! An adapter, as [`crate::v1`] is, over the same rooms ([`crate::uploads`],
//! [`crate::restore`]); it names its saves by key where v1 names them by id.

use bytes::Bytes;
use serde::Deserialize;

use crate::{
    error::CacheError,
    http::{BoxError, Response, json, percent_decode, read_bytes, read_json, respond},
    refusal::Refusal,
    restore::Restores,
    scope::Scope,
    uploads::{Begun, Finished, Piece, Uploads, new_id},
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

pub(crate) async fn create<B>(uploads: &Uploads, scope: &Scope, base: &str, body: B) -> Result<Response, CacheError>
where
    B: http_body::Body<Data = Bytes> + Send,
    B::Error: Into<BoxError>,
{
    let request: Create = read_json(body).await.map_err(Refusal::malformed)?;
    Ok(match uploads.begin_by_key(scope, &request.key, &request.version).await? {
        Begun::Started(upload) => json(200, &serde_json::json!({ "ok": true, "signed_upload_url": contract::cache::blob_url(base, upload.id) })),
        Begun::Exists => not_ok(),
    })
}

pub(crate) async fn finalize<B>(uploads: &Uploads, scope: &Scope, body: B) -> Result<Response, CacheError>
where
    B: http_body::Body<Data = Bytes> + Send,
    B::Error: Into<BoxError>,
{
    let request: Finalize = read_json(body).await.map_err(Refusal::malformed)?;
    let size = match &request.size_bytes {
        None => Some(0),
        Some(serde_json::Value::String(text)) => text.parse().ok(),
        Some(serde_json::Value::Number(number)) => number.as_u64(),
        Some(_) => None,
    };
    let size = size.ok_or_else(|| Refusal::malformed("size_bytes is not a byte count"))?;
    Ok(match uploads.finish_by_key(scope, &request.key, &request.version, size).await? {
        Some(Finished::Committed(entry)) => json(200, &serde_json::json!({ "ok": true, "entry_id": entry.id.to_string() })),
        // No save of the key open to this job, or another committed first: the client
        // says so quietly and goes on.
        None | Some(Finished::Exists) => not_ok(),
    })
}

pub(crate) async fn download_url<B>(restores: &Restores, scope: &Scope, base: &str, body: B) -> Result<Response, CacheError>
where
    B: http_body::Body<Data = Bytes> + Send,
    B::Error: Into<BoxError>,
{
    let request: DownloadUrl = read_json(body).await.map_err(Refusal::malformed)?;
    let keys: Vec<String> = std::iter::once(request.key).chain(request.restore_keys).collect();
    Ok(match restores.restore(scope, &keys, &request.version).await? {
        Some(entry) => json(
            200,
            &serde_json::json!({
                "ok": true,
                "signed_download_url": contract::cache::archive_url(base, entry.id),
                "matched_key": entry.key,
            }),
        ),
        None => not_ok(),
    })
}

/// `PUT blobs/{id}`: the whole archive, a block of it, or the list that orders the blocks.
pub(crate) async fn blob<B>(uploads: &Uploads, scope: &Scope, id: &str, query: &str, headers: &http::HeaderMap, body: B) -> Result<Response, CacheError>
where
    B: http_body::Body<Data = Bytes> + Send + Unpin,
    B::Error: Into<BoxError>,
{
    let upload = uploads.own(scope, id).await?;
    let pairs: Vec<(&str, &str)> = query.split('&').filter_map(|pair| pair.split_once('=')).collect();
    let value = |name: &str| pairs.iter().find(|(key, _)| key.eq_ignore_ascii_case(name)).map(|(_, value)| *value);
    let length = headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    let piece = match value("comp").map(str::to_ascii_lowercase).as_deref() {
        Some("blocklist") => {
            let list = read_bytes(body, MAX_BLOCK_LIST).await.map_err(Refusal::malformed)?;
            uploads.order_blocks(&upload, &block_list(&String::from_utf8_lossy(&list))).await?;
            return Ok(created());
        }
        Some("block") => match value("blockid").map(percent_decode) {
            Some(block) if !block.is_empty() && block.len() <= 256 => Piece::Block(block),
            _ => return Err(Refusal::malformed("a block needs a blockid").into()),
        },
        _ => Piece::Part(0),
    };
    uploads.write(&upload, piece, length, body).await?;
    Ok(created())
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
    let request_id = new_id().unwrap_or(1).to_string();
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
