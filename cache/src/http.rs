//! The HTTP plumbing the two APIs share: the response body type, JSON answers, reading a
//! bounded JSON request, and streaming a request body into an object of the store. A
//! client that stops sending for [`IDLE`] is cut off: a parked request holds memory the
//! controller shares with every job.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, combinators::UnsyncBoxBody};
use object_store::{ObjectStore, ObjectStoreExt as _, WriteMultipart, path::Path};

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

/// Why a part could not be written.
#[derive(Debug)]
pub enum WriteError {
    /// The client's fault: said to it as a 400.
    Client(String),
    /// More than the client may upload now.
    Refused(crate::Refusal),
    Storage(object_store::Error),
}

/// Streams `body` into the object at `path` (never whole in memory) in pieces of `chunk`
/// bytes: at most `max` bytes, and exactly `expected` when given; `admit` is asked before
/// each piece of the body is taken (what it may still cost). The object exists only if
/// all went well.
pub async fn write_object<B>(
    store: &dyn ObjectStore,
    path: &Path,
    body: B,
    (expected, max): (Option<u64>, u64),
    chunk: usize,
    mut admit: impl FnMut(u64) -> Result<(), crate::Refusal> + Send,
) -> Result<u64, WriteError>
where
    B: http_body::Body<Data = Bytes> + Send + Unpin,
    B::Error: Into<BoxError>,
{
    let upload = store.put_multipart(path).await.map_err(WriteError::Storage)?;
    // One piece in flight: what a parked upload holds is one chunk.
    let mut writer = WriteMultipart::new_with_chunk_size(upload, chunk);
    let mut body = body;
    let mut written = 0u64;
    let outcome = loop {
        let frame = match tokio::time::timeout(IDLE, body.frame()).await {
            Ok(frame) => frame,
            Err(_) => break Err(WriteError::Client(format!("the upload sent nothing for {} s", IDLE.as_secs()))),
        };
        match frame {
            None => break Ok(()),
            Some(Err(error)) => break Err(WriteError::Client(format!("the upload broke off: {}", error.into()))),
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else { continue };
                written += data.len() as u64;
                if written > max || expected.is_some_and(|expected| written > expected) {
                    break Err(WriteError::Client(format!("the upload is larger than {}", expected.unwrap_or(max))));
                }
                if let Err(refusal) = admit(data.len() as u64) {
                    break Err(WriteError::Refused(refusal));
                }
                if let Err(error) = writer.wait_for_capacity(1).await {
                    break Err(WriteError::Storage(error));
                }
                writer.put(data);
            }
        }
    };
    let outcome = outcome.and_then(|()| match expected {
        Some(expected) if expected != written => Err(WriteError::Client(format!("{written} bytes arrived, the request said {expected}"))),
        _ => Ok(()),
    });
    match outcome {
        Ok(()) => {
            writer.finish().await.map_err(WriteError::Storage)?;
            Ok(written)
        }
        Err(error) => {
            let _ = writer.abort().await;
            Err(error)
        }
    }
}
