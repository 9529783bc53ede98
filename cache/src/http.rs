//! The HTTP plumbing the two APIs share: the response body type, JSON answers, reading a
//! bounded JSON request, a query's pairs, and streaming a request body into an object of
//! the store. A client that stops sending for [`IDLE`] is cut off: a parked request holds
//! memory the controller shares with every job.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, combinators::UnsyncBoxBody};
use object_store::{ObjectStore, ObjectStoreExt as _, WriteMultipart, path::Path};

use crate::{error::CacheError, refusal::Refusal};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the cache answers with: a small body, or an archive streamed from the store.
pub type ResponseBody = UnsyncBoxBody<Bytes, BoxError>;

pub type Response = http::Response<ResponseBody>;

/// The largest JSON request body read (the toolkit's are a few hundred bytes).
const MAX_JSON: usize = 1 << 20;

/// How long a request body may send nothing before the cache gives up on it.
pub const IDLE: Duration = Duration::from_secs(30);

pub fn body(bytes: impl Into<Bytes>) -> ResponseBody {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed_unsync()
}

pub fn respond(status: u16, content_type: Option<&'static str>, bytes: impl Into<Bytes>) -> Response {
    let mut response = http::Response::new(body(bytes));
    *response.status_mut() = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    if let Some(content_type) = content_type {
        response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static(content_type));
    }
    response
}

pub fn json(status: u16, value: &serde_json::Value) -> Response {
    respond(status, Some("application/json"), value.to_string())
}

/// An answer the toolkit's v1 client shows: it reads the body's `message`.
pub fn message(status: u16, text: impl std::fmt::Display) -> Response {
    json(status, &serde_json::json!({ "message": text.to_string() }))
}

pub fn empty(status: u16) -> Response {
    respond(status, None, Bytes::new())
}

/// `body`, holding `guard` until the body is done or dropped: what a request holds (its
/// place among a job's requests in progress) lasts as long as its answer is sent.
pub fn hold<G: Send + Unpin + 'static>(body: ResponseBody, guard: G) -> ResponseBody {
    Held { body, _guard: guard }.boxed_unsync()
}

struct Held<G> {
    body: ResponseBody,
    _guard: G,
}

impl<G> http_body::Body for Held<G>
where
    G: Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        context: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(context)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A JSON request body of at most [`MAX_JSON`] bytes.
///
/// # Errors
/// What is wrong with the body, to tell the client.
pub async fn read_json<B, T>(body: B) -> Result<T, String>
where
    B: http_body::Body<Data = Bytes> + Send,
    B::Error: Into<BoxError>,
    T: for<'de> serde::Deserialize<'de>,
{
    let bytes = read_bytes(body, MAX_JSON).await?;
    serde_json::from_slice(&bytes).map_err(|error| format!("the request is not the JSON expected: {error}"))
}

/// A body read whole, at most `limit` bytes (a v2 block list).
///
/// # Errors
/// When it cannot be read or is larger.
pub async fn read_bytes<B>(body: B, limit: usize) -> Result<Bytes, String>
where
    B: http_body::Body<Data = Bytes> + Send,
    B::Error: Into<BoxError>,
{
    // A small body: all of it within the idle time.
    match tokio::time::timeout(IDLE, http_body_util::Limited::new(body, limit).collect()).await {
        Ok(collected) => collected.map(http_body_util::Collected::to_bytes).map_err(|error| format!("cannot read the request: {error}")),
        Err(_) => Err(format!("the request's body did not arrive within {} s", IDLE.as_secs())),
    }
}

/// Streams `body` into the object at `path` (never whole in memory) in pieces of `chunk`
/// bytes: at most `max` bytes, and exactly `expected` when given; `admit` is asked before
/// each piece of the body is taken (what it may still cost). The object exists only if
/// all went well; what the client sent wrong is refused as malformed.
pub async fn write_object<B>(
    store: &dyn ObjectStore,
    path: &Path,
    body: B,
    (expected, max): (Option<u64>, u64),
    chunk: usize,
    mut admit: impl FnMut(u64) -> Result<(), Refusal> + Send,
) -> Result<u64, CacheError>
where
    B: http_body::Body<Data = Bytes> + Send + Unpin,
    B::Error: Into<BoxError>,
{
    let upload = store.put_multipart(path).await?;
    // One piece in flight: what a parked upload holds is one chunk.
    let mut writer = WriteMultipart::new_with_chunk_size(upload, chunk);
    let mut body = body;
    let mut written = 0u64;
    let outcome: Result<(), CacheError> = loop {
        let frame = match tokio::time::timeout(IDLE, body.frame()).await {
            Ok(frame) => frame,
            Err(_) => break Err(Refusal::malformed(format!("the upload sent nothing for {} s", IDLE.as_secs())).into()),
        };
        match frame {
            None => break Ok(()),
            Some(Err(error)) => break Err(Refusal::malformed(format!("the upload broke off: {}", error.into())).into()),
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else { continue };
                written += data.len() as u64;
                if written > max || expected.is_some_and(|expected| written > expected) {
                    break Err(Refusal::malformed(format!("the upload is larger than {}", expected.unwrap_or(max))).into());
                }
                if let Err(refusal) = admit(data.len() as u64) {
                    break Err(refusal.into());
                }
                if let Err(error) = writer.wait_for_capacity(1).await {
                    break Err(error.into());
                }
                writer.put(data);
            }
        }
    };
    let outcome = outcome.and_then(|()| match expected {
        Some(expected) if expected != written => Err(Refusal::malformed(format!("{written} bytes arrived, the request said {expected}")).into()),
        _ => Ok(()),
    });
    match outcome {
        Ok(()) => {
            writer.finish().await?;
            Ok(written)
        }
        Err(error) => {
            let _ = writer.abort().await;
            Err(error)
        }
    }
}

/// `a=1&b=x%2Cy` → [(a, 1), (b, "x,y")]: the query's pairs, percent-decoded.
pub fn form_urlencoded(query: &str) -> Vec<(String, String)> {
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
pub fn percent_decode(text: &str) -> String {
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
    fn queries_are_read_as_the_toolkit_writes_them() {
        assert_eq!(
            form_urlencoded("keys=deps-linux-abc%2Cdeps-linux-&version=4a12"),
            [("keys".to_owned(), "deps-linux-abc,deps-linux-".to_owned()), ("version".to_owned(), "4a12".to_owned())]
        );
        assert_eq!(percent_decode("a%20b+c%zz%"), "a b c%zz%");
        assert_eq!(percent_decode("%E2%9C%93"), "✓");
    }
}
