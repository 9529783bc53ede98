//! An archive served from its parts, streamed (never whole in memory), with its length
//! (the toolkit checks the bytes it wrote against `Content-Length`) and single byte
//! ranges (`Range: bytes=a-b`, `a-`, `-n`), as other clients and resumed downloads ask.
//!
//! A download is a task that reads one piece ahead of the client: it holds no thread
//! while it waits (a client that stops reading costs three pieces of memory — one read,
//! one queued, one in HTTP/2's send buffer — and is cut off after [`crate::http::IDLE`]),
//! and each read of a directory's file is one short blocking call on the runtime the
//! cache's I/O runs on.

use bytes::Bytes;
use futures_util::StreamExt as _;
use http_body_util::{BodyExt as _, StreamBody};
use object_store::{GetOptions, GetRange, GetResultPayload, ObjectStore};

use crate::{
    error::CacheError,
    http::{BoxError, IDLE, Response, empty},
    metrics::CacheMetrics,
    store::{Object, part_offset},
};

/// How much of an archive's file is read at once: small enough that the downloads a job
/// may leave unread (as many as it may have requests in progress) hold little, large
/// enough that a download streams at several GB/s (`scripts/bench cache --throughput`).
const READ_PIECE: usize = 1 << 20;

/// The answer to a download of the archive made of `parts` (in order), all of it or the
/// range `headers` ask for; `io` runs the reads.
pub fn serve(
    store: std::sync::Arc<dyn ObjectStore>,
    metrics: std::sync::Arc<CacheMetrics>,
    io: &tokio::runtime::Handle,
    parts: Vec<Object>,
    head_only: bool,
    headers: &http::HeaderMap,
) -> Result<Response, CacheError> {
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
        if head_only { empty(if requested.is_some() { 206 } else { 200 }) } else { stream(store, metrics, io, parts, range.clone(), requested.is_some()) };
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

type Piece = Result<Bytes, BoxError>;

/// The bytes `range` of the archive made of `parts`, part after part.
fn stream(
    store: std::sync::Arc<dyn ObjectStore>,
    metrics: std::sync::Arc<CacheMetrics>,
    io: &tokio::runtime::Handle,
    parts: Vec<Object>,
    range: std::ops::Range<u64>,
    partial: bool,
) -> Response {
    let mut pieces = Vec::new();
    for part in parts {
        let Some(start) = part_offset(&part.path) else { continue };
        let end = start + part.size;
        if end <= range.start || start >= range.end {
            continue;
        }
        pieces.push((part.path, range.start.max(start) - start..range.end.min(end) - start));
    }
    // One piece waits for the client while the next is read.
    let (sender, mut receiver) = tokio::sync::mpsc::channel::<Piece>(1);
    io.spawn(async move {
        for (path, local) in pieces {
            if let Err(error) = send_part(store.as_ref(), &path, local, &sender).await {
                let _ = tokio::time::timeout(IDLE, sender.send(Err(error))).await;
                return;
            }
        }
    });
    let body = futures_util::stream::poll_fn(move |cx| receiver.poll_recv(cx)).map(move |piece: Piece| {
        piece.map(|bytes| {
            metrics.bytes_downloaded.inc_by(bytes.len() as u64);
            http_body::Frame::data(bytes)
        })
    });
    let mut response = http::Response::new(StreamBody::new(body).boxed_unsync());
    *response.status_mut() = if partial { http::StatusCode::PARTIAL_CONTENT } else { http::StatusCode::OK };
    response
}

/// Sends the bytes `local` of the part at `path`; `Ok` also when the client went away.
async fn send_part(
    store: &dyn ObjectStore,
    path: &object_store::path::Path,
    local: std::ops::Range<u64>,
    sender: &tokio::sync::mpsc::Sender<Piece>,
) -> Result<(), BoxError> {
    let options = GetOptions { range: Some(GetRange::Bounded(local.clone())), ..GetOptions::default() };
    let result = store.get_opts(path, options).await?;
    match result.payload {
        // A file of the directory: read in large pieces (object_store's own stream reads
        // 8 KiB at a time, a seventh of the disk's speed).
        GetResultPayload::File(file, _) => {
            let mut file = Some(file);
            let mut at = local.start;
            while at < local.end {
                let length = usize::try_from((local.end - at).min(READ_PIECE as u64)).unwrap_or(READ_PIECE);
                let taken = file.take().ok_or("the archive's file was lost")?;
                let (back, piece) = tokio::task::spawn_blocking(move || read_at(taken, at, length)).await?;
                file = Some(back);
                let piece = piece?;
                at += piece.len() as u64;
                if !deliver(sender, Ok(piece)).await {
                    return Ok(());
                }
            }
        }
        GetResultPayload::Stream(mut stream) => {
            while let Some(piece) = stream.next().await {
                if !deliver(sender, piece.map_err(BoxError::from)).await {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

/// `length` bytes of `file` from `at`, and the file back.
fn read_at(file: std::fs::File, at: u64, length: usize) -> (std::fs::File, std::io::Result<Bytes>) {
    use std::os::unix::fs::FileExt as _;
    let mut piece = vec![0u8; length];
    let read = file.read_exact_at(&mut piece, at).map(|()| Bytes::from(piece));
    (file, read)
}

/// Hands `piece` to the client's body; false when it went away or read nothing for [`IDLE`].
async fn deliver(sender: &tokio::sync::mpsc::Sender<Piece>, piece: Piece) -> bool {
    matches!(tokio::time::timeout(IDLE, sender.send(piece)).await, Ok(Ok(())))
}

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
