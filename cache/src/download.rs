//! An archive served from its parts, streamed (never whole in memory), with its length
//! (the toolkit checks the bytes it wrote against `Content-Length`) and single byte
//! ranges (`Range: bytes=a-b`, `a-`, `-n`), as other clients and resumed downloads ask.

use bytes::Bytes;
use futures_util::{StreamExt as _, TryStreamExt as _};
use http_body_util::{BodyExt as _, StreamBody};

use crate::{
    Cache, CacheError, Response, Scope,
    http::{empty, message},
    store::{Object, part_offset},
};

pub(crate) async fn serve(cache: &Cache, scope: &Scope, id: &str, head_only: bool, headers: &http::HeaderMap) -> Result<Response, CacheError> {
    let Ok(id) = id.parse::<u64>() else { return Ok(message(400, format!("{id:?} is not an archive id"))) };
    let parts = cache.storage().parts(&scope.repository, id).await?;
    if parts.is_empty() {
        return Ok(message(404, format!("no archive {id} in the cache of {}", scope.repository)));
    }
    let total: u64 = parts.iter().map(|part| part.size).sum();
    let requested = headers.get(http::header::RANGE).and_then(|v| v.to_str().ok());
    let range = match requested.map(|value| byte_range(value, total)) {
        None => 0..total,
        Some(Some(range)) => range,
        Some(None) => {
            let mut answer = empty(416);
            if let Ok(value) = http::HeaderValue::from_str(&format!("bytes */{total}")) {
                answer.headers_mut().insert(http::header::CONTENT_RANGE, value);
            }
            return Ok(answer);
        }
    };
    let mut response =
        if head_only { empty(if requested.is_some() { 206 } else { 200 }) } else { stream(cache, parts, range.clone(), requested.is_some()).await? };
    let headers = response.headers_mut();
    headers.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/octet-stream"));
    headers.insert(http::header::ACCEPT_RANGES, http::HeaderValue::from_static("bytes"));
    headers.insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(range.end - range.start));
    if requested.is_some()
        && let Ok(value) = http::HeaderValue::from_str(&format!("bytes {}-{}/{total}", range.start, range.end.saturating_sub(1)))
    {
        headers.insert(http::header::CONTENT_RANGE, value);
    }
    Ok(response)
}

/// The bytes `range` of the archive made of `parts`, part after part.
async fn stream(cache: &Cache, parts: Vec<Object>, range: std::ops::Range<u64>, partial: bool) -> Result<Response, CacheError> {
    let mut pieces = Vec::new();
    for part in parts {
        let Some(start) = part_offset(&part.path) else { continue };
        let end = start + part.size;
        if end <= range.start || start >= range.end {
            continue;
        }
        pieces.push((part.path, range.start.max(start) - start..range.end.min(end) - start));
    }
    let storage = cache.storage().store().clone();
    let metrics = cache.metrics().clone();
    // Each part is opened when the previous one is done, so a download holds one at a time.
    let body = futures_util::stream::iter(pieces)
        .then(move |(path, local)| {
            let storage = storage.clone();
            async move {
                let options = object_store::GetOptions { range: Some(object_store::GetRange::Bounded(local.clone())), ..object_store::GetOptions::default() };
                let result = storage.get_opts(&path, options).await?;
                Ok::<_, object_store::Error>(match result.payload {
                    // A file of the directory backend: read in large pieces (object_store's
                    // own stream reads 8 KiB at a time, a seventh of the disk's speed).
                    object_store::GetResultPayload::File(file, _) => file_range(file, local),
                    object_store::GetResultPayload::Stream(stream) => stream,
                })
            }
        })
        .try_flatten()
        .map_ok(move |bytes: Bytes| {
            metrics.bytes_downloaded.inc_by(bytes.len() as u64);
            http_body::Frame::data(bytes)
        })
        .map_err(|error| -> crate::BoxError { Box::new(error) });
    let mut response = http::Response::new(StreamBody::new(body).boxed_unsync());
    *response.status_mut() = if partial { http::StatusCode::PARTIAL_CONTENT } else { http::StatusCode::OK };
    Ok(response)
}

/// The bytes `range` of `file`, as a stream of pieces of [`READ_PIECE`].
fn file_range(file: std::fs::File, range: std::ops::Range<u64>) -> futures_util::stream::BoxStream<'static, Result<Bytes, object_store::Error>> {
    use std::io::{Read as _, Seek as _};
    let (sender, receiver) = tokio::sync::mpsc::channel::<Result<Bytes, object_store::Error>>(4);
    tokio::task::spawn_blocking(move || {
        let mut file = file;
        let read = |file: &mut std::fs::File, remaining: u64| -> std::io::Result<Bytes> {
            let mut piece = vec![0u8; usize::try_from(remaining.min(READ_PIECE)).unwrap_or(0)];
            file.read_exact(&mut piece)?;
            Ok(Bytes::from(piece))
        };
        let mut remaining = range.end - range.start;
        if let Err(error) = file.seek(std::io::SeekFrom::Start(range.start)) {
            let _ = sender.blocking_send(Err(object_store::Error::Generic { store: "cache", source: Box::new(error) }));
            return;
        }
        while remaining > 0 {
            let piece = read(&mut file, remaining).map_err(|error| object_store::Error::Generic { store: "cache", source: Box::new(error) });
            remaining -= piece.as_ref().map_or(remaining, |piece| piece.len() as u64);
            if sender.blocking_send(piece).is_err() {
                return;
            }
        }
    });
    receiver_stream(receiver)
}

fn receiver_stream(
    mut receiver: tokio::sync::mpsc::Receiver<Result<Bytes, object_store::Error>>,
) -> futures_util::stream::BoxStream<'static, Result<Bytes, object_store::Error>> {
    futures_util::stream::poll_fn(move |cx| receiver.poll_recv(cx)).boxed()
}

/// How much of an archive's file is read at once.
const READ_PIECE: u64 = 1 << 20;

/// `bytes=a-b`, `bytes=a-` or `bytes=-n` of an archive of `total` bytes → the range;
/// `None` when it asks for nothing the archive has (several ranges are not served).
fn byte_range(value: &str, total: u64) -> Option<std::ops::Range<u64>> {
    let spec = value.trim().strip_prefix("bytes=")?;
    if spec.contains(',') {
        return None;
    }
    let (first, last) = spec.split_once('-')?;
    let (first, last) = (first.trim(), last.trim());
    let range = if first.is_empty() {
        let suffix: u64 = last.parse().ok()?;
        total.saturating_sub(suffix)..total
    } else {
        let start: u64 = first.parse().ok()?;
        let end = if last.is_empty() { total } else { last.parse::<u64>().ok()?.saturating_add(1).min(total) };
        start..end
    };
    (range.start < range.end).then_some(range)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_ranges() {
        let table: &[(&str, Option<std::ops::Range<u64>>)] = &[
            ("bytes=0-99", Some(0..100)),
            ("bytes=100-", Some(100..1000)),
            ("bytes=-100", Some(900..1000)),
            ("bytes=900-5000", Some(900..1000)),
            ("bytes=-5000", Some(0..1000)),
            ("bytes=1000-", None),
            ("bytes=5-4", None),
            ("bytes=0-1,5-6", None),
            ("items=0-1", None),
        ];
        for (value, expected) in table {
            assert_eq!(byte_range(value, 1000), *expected, "{value}");
        }
    }
}
