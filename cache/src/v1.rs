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

use bytes::Bytes;
use serde::Deserialize;

use crate::{
    Cache, CacheError, Response, Scope,
    http::{BoxError, WriteError, empty, json, message, read_json, write_object},
    lookup::{check_key, check_version},
    new_id, now_ms,
    store::{EntryMeta, Storage, UploadMeta, check_parts},
};

/// The most keys a restore may name (the toolkit's own limit).
const MAX_KEYS: usize = 10;

pub(crate) async fn lookup(cache: &Cache, scope: &Scope, base: &str, query: &str) -> Result<Response, CacheError> {
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
        return Ok(message(400, format!("a restore names 1 to {MAX_KEYS} keys, this one {}", keys.len())));
    }
    if let Some(problem) = keys.iter().find_map(|key| check_key(key).err()).or_else(|| check_version(&version).err()) {
        return Ok(message(400, problem));
    }
    Ok(match cache.restore(scope, &keys, &version).await? {
        Some(entry) => json(
            200,
            &serde_json::json!({
                "result": "hit",
                "archiveLocation": format!("{base}/_apis/artifactcache/artifacts/{}", entry.id),
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

pub(crate) async fn reserve<B>(cache: &Cache, scope: &Scope, body: B) -> Result<Response, CacheError>
where
    B: http_body::Body<Data = Bytes> + Send,
    B::Error: Into<BoxError>,
{
    let request: Reserve = match read_json(body).await {
        Ok(request) => request,
        Err(problem) => return Ok(message(400, problem)),
    };
    match begin_upload(cache, scope, &request.key, &request.version, request.cache_size.unwrap_or(0)).await? {
        Begun::Started(upload) => Ok(json(200, &serde_json::json!({ "cacheId": upload.id }))),
        Begun::Exists => Ok(message(409, exists(&request.key, &scope.write))),
        Begun::Refused(problem) => Ok(message(400, problem)),
    }
}

/// What a save's first call finds.
pub(crate) enum Begun {
    Started(UploadMeta),
    /// The key is committed already in the job's scope: it is never overwritten.
    Exists,
    Refused(String),
}

pub(crate) fn exists(key: &str, git_ref: &str) -> String {
    format!("the entry {key:?} exists already for {git_ref}: a committed entry is never overwritten")
}

/// Checks a save and records its upload (not visible to restores until committed).
pub(crate) async fn begin_upload(cache: &Cache, scope: &Scope, key: &str, version: &str, size: u64) -> Result<Begun, CacheError> {
    if let Some(problem) = check_key(key).err().or_else(|| check_version(version).err()) {
        return Ok(Begun::Refused(problem));
    }
    let max = cache.limits().max_entry();
    if size > max {
        return Ok(Begun::Refused(format!(
            "Cache size of ~{} MB ({size} B) is over this runner's limit of {} MB per entry (cache.max_repository_size), not saving cache.",
            size >> 20,
            max >> 20
        )));
    }
    if cache.storage().committed(&scope.repository, &scope.write, version, key).await? {
        cache.metrics().save_conflicts.inc();
        return Ok(Begun::Exists);
    }
    let upload = UploadMeta {
        id: new_id()?,
        key: key.to_owned(),
        version: version.to_owned(),
        repository: scope.repository.clone(),
        git_ref: scope.write.clone(),
        size,
        created_ms: now_ms(),
    };
    cache.storage().put_json(&Storage::upload_path(&scope.repository, upload.id), &upload).await?;
    Ok(Begun::Started(upload))
}

/// The job's own upload `id`, or the answer to give instead.
pub(crate) async fn own_upload(cache: &Cache, scope: &Scope, id: &str) -> Result<Result<UploadMeta, Response>, CacheError> {
    let Ok(id) = id.parse::<u64>() else { return Ok(Err(message(400, format!("{id:?} is not an upload id")))) };
    let Some(upload) = cache.storage().get_json::<UploadMeta>(&Storage::upload_path(&scope.repository, id)).await? else {
        return Ok(Err(message(404, format!("no upload {id} of {} is open: reserve it first (or it was committed)", scope.repository))));
    };
    if upload.git_ref != scope.write {
        return Ok(Err(message(403, format!("upload {id} saves for {}, this job saves for {}", upload.git_ref, scope.write))));
    }
    Ok(Ok(upload))
}

pub(crate) async fn upload<B>(cache: &Cache, scope: &Scope, id: &str, headers: &http::HeaderMap, body: B) -> Result<Response, CacheError>
where
    B: http_body::Body<Data = Bytes> + Send + Unpin,
    B::Error: Into<BoxError>,
{
    let upload = match own_upload(cache, scope, id).await? {
        Ok(upload) => upload,
        Err(answer) => return Ok(answer),
    };
    let Some((start, end)) = headers.get(http::header::CONTENT_RANGE).and_then(|v| v.to_str().ok()).and_then(content_range) else {
        return Ok(message(400, "a chunk carries Content-Range: bytes START-END/*"));
    };
    let max = cache.limits().max_entry();
    if end >= max {
        return Ok(message(400, format!("the archive would be larger than this runner's limit of {} MB per entry", max >> 20)));
    }
    let path = Storage::part_path(&scope.repository, upload.id, start);
    match write_object(cache.storage().store().as_ref(), &path, body, Some(end - start + 1), max).await {
        Ok(written) => {
            cache.metrics().bytes_uploaded.inc_by(written);
            Ok(empty(204))
        }
        Err(WriteError::Client(problem)) => Ok(message(400, problem)),
        Err(WriteError::Storage(error)) => Err(error.into()),
    }
}

#[derive(Deserialize)]
struct Commit {
    size: u64,
}

pub(crate) async fn commit<B>(cache: &Cache, scope: &Scope, id: &str, body: B) -> Result<Response, CacheError>
where
    B: http_body::Body<Data = Bytes> + Send,
    B::Error: Into<BoxError>,
{
    let upload = match own_upload(cache, scope, id).await? {
        Ok(upload) => upload,
        Err(answer) => return Ok(answer),
    };
    let request: Commit = match read_json(body).await {
        Ok(request) => request,
        Err(problem) => return Ok(message(400, problem)),
    };
    Ok(match finish_upload(cache, &upload, request.size).await? {
        Finished::Committed(_) => json(200, &serde_json::json!({})),
        Finished::Exists => message(409, exists(&upload.key, &upload.git_ref)),
        Finished::Refused(problem) => message(400, problem),
    })
}

/// What a commit comes to.
pub(crate) enum Finished {
    Committed(EntryMeta),
    Exists,
    Refused(String),
}

/// Commits `upload` of `size` bytes: its parts must be exactly the archive; the entry
/// is written only if its key is not committed yet. Either way the upload is closed.
pub(crate) async fn finish_upload(cache: &Cache, upload: &UploadMeta, size: u64) -> Result<Finished, CacheError> {
    let storage = cache.storage();
    if upload.size > 0 && upload.size != size {
        return Ok(Finished::Refused(format!("the commit says {size} bytes, the reservation {}", upload.size)));
    }
    let parts = storage.parts(&upload.repository, upload.id).await?;
    if let Err(problem) = check_parts(&parts, size) {
        return Ok(Finished::Refused(problem));
    }
    let entry = EntryMeta {
        id: upload.id,
        key: upload.key.clone(),
        version: upload.version.clone(),
        repository: upload.repository.clone(),
        git_ref: upload.git_ref.clone(),
        size,
        created_ms: now_ms(),
    };
    let committed = storage.commit_entry(&entry).await?;
    storage.delete(&Storage::upload_path(&upload.repository, upload.id)).await?;
    if !committed {
        storage.delete_all(&Storage::blob_dir(&upload.repository, upload.id)).await?;
        cache.metrics().save_conflicts.inc();
        return Ok(Finished::Exists);
    }
    tracing::info!(repository = %entry.repository, git_ref = %entry.git_ref, key = %entry.key, size, "cache entry saved");
    cache.note_commit();
    Ok(Finished::Committed(entry))
}

/// `bytes START-END/*` (or `/TOTAL`) → (START, END), END inclusive.
fn content_range(value: &str) -> Option<(u64, u64)> {
    let range = value.trim().strip_prefix("bytes ")?;
    let (span, _) = range.split_once('/')?;
    let (start, end) = span.split_once('-')?;
    let (start, end) = (start.trim().parse().ok()?, end.trim().parse().ok()?);
    (start <= end).then_some((start, end))
}

/// `a=1&b=x%2Cy` → [(a, 1), (b, "x,y")]: the query's pairs, percent-decoded.
fn form_urlencoded(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(name), percent_decode(value))
        })
        .collect()
}

/// `%2C` → `,` and `+` → space, as HTML forms (and the toolkit's encodeURIComponent) write
/// them. Hand-written: a dozen lines; no crate of the tree decodes a query.
pub(crate) fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match (hex_digit(bytes[i + 1]), hex_digit(bytes[i + 2])) {
                (Some(high), Some(low)) => {
                    out.push(high << 4 | low);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            byte => out.push(byte),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex_digit(byte: u8) -> Option<u8> {
    char::from(byte).to_digit(16).and_then(|digit| u8::try_from(digit).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_ranges_and_queries_are_read_as_the_toolkit_writes_them() {
        assert_eq!(content_range("bytes 0-33554431/*"), Some((0, 33_554_431)));
        assert_eq!(content_range("bytes 33554432-40000000/40000001"), Some((33_554_432, 40_000_000)));
        for bad in ["0-1/*", "bytes 5-1/*", "bytes x-1/*", "bytes 0-1"] {
            assert_eq!(content_range(bad), None, "{bad}");
        }
        assert_eq!(
            form_urlencoded("keys=deps-linux-abc%2Cdeps-linux-&version=4a12"),
            [("keys".to_owned(), "deps-linux-abc,deps-linux-".to_owned()), ("version".to_owned(), "4a12".to_owned())]
        );
        assert_eq!(percent_decode("a%20b+c%zz%"), "a b c%zz%");
        assert_eq!(percent_decode("%E2%9C%93"), "✓");
    }
}
