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
    Cache, CacheError, Response, Scope,
    http::{BoxError, WriteError, json, read_bytes, read_json, respond, write_object},
    lookup::{check_key, check_version},
    store::Storage,
    v1::{Begun, Finished, begin_upload, finish_upload, own_upload, percent_decode},
};

pub const SERVICE: &str = "github.actions.results.api.v1.CacheService";

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

fn twirp_error(status: u16, code: &str, message: impl std::fmt::Display) -> Response {
    json(status, &serde_json::json!({ "code": code, "msg": message.to_string() }))
}

fn not_ok() -> Response {
    json(200, &serde_json::json!({ "ok": false }))
}

pub(crate) async fn call<B>(cache: &Cache, scope: &Scope, base: &str, method: &str, body: B) -> Result<Response, CacheError>
where
    B: http_body::Body<Data = Bytes> + Send,
    B::Error: Into<BoxError>,
{
    match method {
        "CreateCacheEntry" => {
            let request: Create = match read_json(body).await {
                Ok(request) => request,
                Err(problem) => return Ok(twirp_error(400, "malformed", problem)),
            };
            create(cache, scope, base, &request).await
        }
        "FinalizeCacheEntryUpload" => {
            let request: Finalize = match read_json(body).await {
                Ok(request) => request,
                Err(problem) => return Ok(twirp_error(400, "malformed", problem)),
            };
            finalize(cache, scope, &request).await
        }
        "GetCacheEntryDownloadURL" => {
            let request: DownloadUrl = match read_json(body).await {
                Ok(request) => request,
                Err(problem) => return Ok(twirp_error(400, "malformed", problem)),
            };
            let keys: Vec<String> = std::iter::once(request.key).chain(request.restore_keys).collect();
            if let Some(problem) = keys.iter().find_map(|key| check_key(key).err()).or_else(|| check_version(&request.version).err()) {
                return Ok(twirp_error(400, "invalid_argument", problem));
            }
            Ok(match cache.restore(scope, &keys, &request.version).await? {
                Some(entry) => json(
                    200,
                    &serde_json::json!({
                        "ok": true,
                        "signed_download_url": format!("{base}/_apis/artifactcache/artifacts/{}", entry.id),
                        "matched_key": entry.key,
                    }),
                ),
                None => not_ok(),
            })
        }
        other => Ok(twirp_error(404, "bad_route", format!("the cache service has no method {other}"))),
    }
}

async fn create(cache: &Cache, scope: &Scope, base: &str, request: &Create) -> Result<Response, CacheError> {
    Ok(match begin_upload(cache, scope, &request.key, &request.version, 0).await? {
        Begun::Started(upload) => {
            // Finalize names the key, not the upload: the latest upload of the key is the one.
            let pending = Storage::pending_path(&scope.repository, &scope.write, &request.version, &request.key);
            cache.storage().put_json(&pending, &upload.id).await?;
            json(200, &serde_json::json!({ "ok": true, "signed_upload_url": format!("{base}/_apis/artifactcache/blobs/{}", upload.id) }))
        }
        Begun::Exists => not_ok(),
        Begun::Refused(problem) => twirp_error(400, "invalid_argument", problem),
    })
}

async fn finalize(cache: &Cache, scope: &Scope, request: &Finalize) -> Result<Response, CacheError> {
    let size = match &request.size_bytes {
        None => Some(0),
        Some(serde_json::Value::String(text)) => text.parse().ok(),
        Some(serde_json::Value::Number(number)) => number.as_u64(),
        Some(_) => None,
    };
    let Some(size) = size else { return Ok(twirp_error(400, "malformed", "size_bytes is not a byte count")) };
    let pending = Storage::pending_path(&scope.repository, &scope.write, &request.version, &request.key);
    let Some(id) = cache.storage().get_json::<u64>(&pending).await? else { return Ok(not_ok()) };
    let upload = match own_upload(cache, scope, &id.to_string()).await? {
        Ok(upload) => upload,
        Err(_) => return Ok(not_ok()),
    };
    let finished = finish_upload(cache, &upload, size).await?;
    cache.storage().delete(&pending).await?;
    Ok(match finished {
        Finished::Committed(entry) => json(200, &serde_json::json!({ "ok": true, "entry_id": entry.id.to_string() })),
        Finished::Exists => not_ok(),
        Finished::Refused(problem) => twirp_error(400, "invalid_argument", problem),
    })
}

/// `PUT blobs/{id}`: the whole archive, a block of it, or the list that orders the blocks.
pub(crate) async fn blob<B>(cache: &Cache, scope: &Scope, id: &str, query: &str, headers: &http::HeaderMap, body: B) -> Result<Response, CacheError>
where
    B: http_body::Body<Data = Bytes> + Send + Unpin,
    B::Error: Into<BoxError>,
{
    let upload = match own_upload(cache, scope, id).await? {
        Ok(upload) => upload,
        Err(answer) => return Ok(answer),
    };
    let pairs: Vec<(&str, &str)> = query.split('&').filter_map(|pair| pair.split_once('=')).collect();
    let value = |name: &str| pairs.iter().find(|(key, _)| key.eq_ignore_ascii_case(name)).map(|(_, value)| *value);
    let max = cache.limits().max_entry();
    let length = headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    let storage = cache.storage();
    let path = match value("comp").map(str::to_ascii_lowercase).as_deref() {
        Some("blocklist") => {
            let list = match read_bytes(body, MAX_BLOCK_LIST).await {
                Ok(list) => list,
                Err(problem) => return Ok(azure_error(400, problem)),
            };
            return order_blocks(cache, &upload.repository, upload.id, &block_list(&String::from_utf8_lossy(&list))).await;
        }
        Some("block") => match value("blockid").map(percent_decode) {
            Some(block) if !block.is_empty() && block.len() <= 256 => Storage::block_path(&upload.repository, upload.id, &block),
            _ => return Ok(azure_error(400, "a block needs a blockid")),
        },
        _ => Storage::part_path(&upload.repository, upload.id, 0),
    };
    match write_object(storage.store().as_ref(), &path, body, length, max).await {
        Ok(written) => {
            cache.metrics().bytes_uploaded.inc_by(written);
            Ok(created())
        }
        Err(WriteError::Client(problem)) => Ok(azure_error(400, problem)),
        Err(WriteError::Storage(error)) => Err(error.into()),
    }
}

/// Puts the staged blocks, in the list's order, in place as the archive's parts.
async fn order_blocks(cache: &Cache, repository: &str, id: u64, blocks: &[String]) -> Result<Response, CacheError> {
    let storage = cache.storage();
    let staged = storage.list(&Storage::staging_dir(repository, id)).await?;
    let mut offset = 0u64;
    for block in blocks {
        let from = Storage::block_path(repository, id, block);
        let Some(object) = staged.iter().find(|object| object.path == from) else {
            return Ok(azure_error(400, format!("the block list names {block:?}, which was not uploaded")));
        };
        storage.rename(&from, &Storage::part_path(repository, id, offset)).await?;
        offset += object.size;
    }
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
    let request_id = crate::new_id().unwrap_or(1).to_string();
    if let Ok(value) = http::HeaderValue::from_str(&request_id) {
        // The Azure SDK reads it from every answer.
        response.headers_mut().insert("x-ms-request-id", value);
    }
    response.headers_mut().insert("x-ms-version", http::HeaderValue::from_static("2025-01-05"));
    response
}

fn azure_error(status: u16, message: impl std::fmt::Display) -> Response {
    let text = message.to_string();
    let escaped = text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    respond(
        status,
        Some("application/xml"),
        format!("<?xml version=\"1.0\" encoding=\"utf-8\"?><Error><Code>InvalidInput</Code><Message>{escaped}</Message></Error>"),
    )
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
