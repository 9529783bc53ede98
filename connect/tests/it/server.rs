//! The Connect server and client against each other, and the server against raw
//! malformed HTTP requests: every one must get the right Connect error, never a
//! panic or a hang.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use crate::common::*;
use connect::{CallOptions, Client, Code, Codec};
use http::{HeaderValue, header::HeaderName};
use prost::Message;
use proto::{
    ping::v1::{PingRequest, PingResponse},
    runner::v1::{FetchTaskRequest, FetchTaskResponse},
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct RawResponse {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl RawResponse {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }
}

/// Sends bytes exactly as given and reads the whole answer (the request asks the
/// server to close the connection).
async fn raw(addr: std::net::SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> RawResponse {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut request = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    stream.write_all(body).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await.unwrap().unwrap();
    let split = answer.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8(answer[..split].to_vec()).unwrap();
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers = lines
        .map(|line| {
            let (k, v) = line.split_once(':').unwrap();
            (k.trim().to_owned(), v.trim().to_owned())
        })
        .collect();
    RawResponse { status, headers, body: answer[split + 4..].to_vec() }
}

const FETCH: &str = "/api/actions/runner.v1.RunnerService/FetchTask";
const AUTH: [(&str, &str); 2] = [("x-runner-uuid", UUID), ("x-runner-token", TOKEN)];

fn authed(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
    AUTH.iter().copied().chain(extra.iter().copied()).collect()
}

#[tokio::test]
async fn malformed_requests_get_the_right_connect_error() {
    let server = TestServer::start(fixture_router().with_max_request_bytes(1024)).await;
    let valid = FetchTaskRequest { tasks_version: 7 }.encode_to_vec();
    let big = vec![b' '; 2048];
    let bomb = {
        use std::io::Write;
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        encoder.write_all(&vec![0u8; 1 << 20]).unwrap();
        encoder.finish().unwrap()
    };
    struct Case<'a> {
        name: &'a str,
        method: &'a str,
        path: &'a str,
        headers: Vec<(&'a str, &'a str)>,
        body: &'a [u8],
        status: u16,
        code: &'a str,
        message_contains: &'a str,
    }
    let cases = [
        Case { name: "GET", method: "GET", path: FETCH, headers: authed(&[]), body: b"", status: 405, code: "unimplemented", message_contains: "POST" },
        Case {
            name: "unknown method",
            method: "POST",
            path: "/api/actions/runner.v1.RunnerService/FetchSingleTask",
            headers: authed(&[("content-type", "application/proto")]),
            body: &valid,
            status: 404,
            code: "unimplemented",
            message_contains: "FetchSingleTask",
        },
        Case {
            name: "unknown service",
            method: "POST",
            path: "/api/actions/runner.v2.RunnerService/FetchTask",
            headers: authed(&[("content-type", "application/proto")]),
            body: &valid,
            status: 404,
            code: "unimplemented",
            message_contains: "runner.v2",
        },
        Case {
            name: "missing prefix",
            method: "POST",
            path: "/runner.v1.RunnerService/FetchTask",
            headers: authed(&[("content-type", "application/proto")]),
            body: &valid,
            status: 404,
            code: "unimplemented",
            message_contains: "no procedure",
        },
        Case {
            name: "wrong content type",
            method: "POST",
            path: FETCH,
            headers: authed(&[("content-type", "text/plain")]),
            body: &valid,
            status: 415,
            code: "unknown",
            message_contains: "text/plain",
        },
        Case {
            name: "no content type",
            method: "POST",
            path: FETCH,
            headers: authed(&[]),
            body: &valid,
            status: 415,
            code: "unknown",
            message_contains: "content-type",
        },
        Case {
            name: "streaming content type",
            method: "POST",
            path: FETCH,
            headers: authed(&[("content-type", "application/connect+proto")]),
            body: &valid,
            status: 415,
            code: "unknown",
            message_contains: "connect+proto",
        },
        Case {
            name: "bad protobuf",
            method: "POST",
            path: FETCH,
            headers: authed(&[("content-type", "application/proto")]),
            body: &[0x08, 0xff],
            status: 400,
            code: "invalid_argument",
            message_contains: "runner.v1.FetchTaskRequest",
        },
        Case {
            name: "bad JSON",
            method: "POST",
            path: FETCH,
            headers: authed(&[("content-type", "application/json")]),
            body: b"{\"tasksVersion\":",
            status: 400,
            code: "invalid_argument",
            message_contains: "JSON",
        },
        Case {
            name: "JSON of the wrong type",
            method: "POST",
            path: FETCH,
            headers: authed(&[("content-type", "application/json")]),
            body: b"{\"tasksVersion\":\"seven\"}",
            status: 400,
            code: "invalid_argument",
            message_contains: "invalid JSON",
        },
        Case {
            name: "oversize body",
            method: "POST",
            path: FETCH,
            headers: authed(&[("content-type", "application/json")]),
            body: &big,
            status: 429,
            code: "resource_exhausted",
            message_contains: "1024 bytes",
        },
        Case {
            name: "gzip bomb",
            method: "POST",
            path: FETCH,
            headers: authed(&[("content-type", "application/proto"), ("content-encoding", "gzip")]),
            body: &bomb,
            status: 429,
            code: "resource_exhausted",
            message_contains: "1024 bytes",
        },
        Case {
            name: "bad gzip",
            method: "POST",
            path: FETCH,
            headers: authed(&[("content-type", "application/proto"), ("content-encoding", "gzip")]),
            body: b"not gzip",
            status: 400,
            code: "invalid_argument",
            message_contains: "decompress",
        },
        Case {
            name: "unknown content encoding",
            method: "POST",
            path: FETCH,
            headers: authed(&[("content-type", "application/proto"), ("content-encoding", "br")]),
            body: &valid,
            status: 501,
            code: "unimplemented",
            message_contains: "br",
        },
        Case {
            name: "wrong protocol version",
            method: "POST",
            path: FETCH,
            headers: authed(&[("content-type", "application/proto"), ("connect-protocol-version", "2")]),
            body: &valid,
            status: 400,
            code: "invalid_argument",
            message_contains: "Connect-Protocol-Version",
        },
        Case {
            name: "bad timeout",
            method: "POST",
            path: FETCH,
            headers: authed(&[("content-type", "application/proto"), ("connect-timeout-ms", "soon")]),
            body: &valid,
            status: 400,
            code: "invalid_argument",
            message_contains: "Connect-Timeout-Ms",
        },
        Case {
            name: "timeout with 11 digits",
            method: "POST",
            path: FETCH,
            headers: authed(&[("content-type", "application/proto"), ("connect-timeout-ms", "10000000000")]),
            body: &valid,
            status: 400,
            code: "invalid_argument",
            message_contains: "Connect-Timeout-Ms",
        },
        Case {
            name: "unauthenticated",
            method: "POST",
            path: FETCH,
            headers: vec![("content-type", "application/proto")],
            body: &valid,
            status: 401,
            code: "unauthenticated",
            message_contains: "unregistered runner",
        },
    ];
    for case in &cases {
        let response = raw(server.addr, case.method, case.path, &case.headers, case.body).await;
        assert_eq!(response.status, case.status, "{}: {:?}", case.name, String::from_utf8_lossy(&response.body));
        assert_eq!(response.header("content-type"), Some("application/json"), "{}", case.name);
        let json = response.json();
        assert_eq!(json["code"], case.code, "{}: {json}", case.name);
        let message = json["message"].as_str().unwrap_or_default();
        assert!(message.contains(case.message_contains), "{}: {message:?} lacks {:?}", case.name, case.message_contains);
    }
    let get = raw(server.addr, "GET", FETCH, &[], b"").await;
    assert_eq!(get.header("allow"), Some("POST"));
    let unsupported = raw(server.addr, "POST", FETCH, &[("content-type", "text/plain")], b"").await;
    assert!(unsupported.header("accept-post").unwrap().contains("application/proto"));

    // After all of that the server still answers a good call.
    let ok = raw(server.addr, "POST", FETCH, &authed(&[("content-type", "application/json")]), br#"{"tasksVersion":"7"}"#).await;
    assert_eq!(ok.status, 200);
    assert_eq!(ok.json(), serde_json::json!({"tasksVersion": "7"}));
    server.stop().await;
}

#[tokio::test]
async fn server_enforces_the_callers_deadline() {
    let server = TestServer::start(fixture_router()).await;
    let body = FetchTaskRequest { tasks_version: 99 }.encode_to_vec();
    let started = Instant::now();
    let response = raw(server.addr, "POST", FETCH, &authed(&[("content-type", "application/proto"), ("connect-timeout-ms", "150")]), &body).await;
    let elapsed = started.elapsed();
    assert_eq!(response.status, 504);
    assert_eq!(response.json()["code"], "deadline_exceeded");
    assert!(elapsed < Duration::from_secs(2), "the handler was not cut off: {elapsed:?}");
    server.stop().await;
}

#[tokio::test]
async fn large_responses_are_gzipped_when_accepted_and_the_client_decodes_them() {
    let server = TestServer::start(fixture_router().with_compress_min_bytes(64)).await;
    let body = br#"{"tasksVersion":"0"}"#;
    let zipped = raw(server.addr, "POST", FETCH, &authed(&[("content-type", "application/json"), ("accept-encoding", "gzip")]), body).await;
    assert_eq!(zipped.status, 200);
    assert_eq!(zipped.header("content-encoding"), Some("gzip"));
    let plain = raw(server.addr, "POST", FETCH, &authed(&[("content-type", "application/json")]), body).await;
    assert_eq!(plain.header("content-encoding"), None);
    let unzipped: serde_json::Value = serde_json::from_slice(&connect::protocol::gunzip(&zipped.body, 1 << 20).unwrap()).unwrap();
    assert_eq!(unzipped, plain.json());

    // Our client asks for gzip and must decode it transparently.
    for codec in [Codec::Proto, Codec::Json] {
        let client = authed_client(&server, codec);
        let response = client
            .unary::<_, FetchTaskResponse>("runner.v1.RunnerService/FetchTask", &FetchTaskRequest { tasks_version: 0 }, &CallOptions::default())
            .await
            .unwrap();
        assert_eq!(response.headers.get("content-encoding").unwrap(), "gzip");
        assert_eq!(response.message.task, Some(fixture_task()), "{codec:?}");
    }
    server.stop().await;
}

#[tokio::test]
async fn gzipped_requests_are_accepted() {
    let server = TestServer::start(fixture_router()).await;
    let body = connect::protocol::gzip(&PingRequest { data: "zip".into() }.encode_to_vec());
    let response =
        raw(server.addr, "POST", "/api/actions/ping.v1.PingService/Ping", &[("content-type", "application/proto"), ("content-encoding", "gzip")], &body).await;
    assert_eq!(response.status, 200);
    assert_eq!(PingResponse::decode(response.body.as_slice()).unwrap().data, "Hello, zip!");
    server.stop().await;
}

fn authed_client(server: &TestServer, codec: Codec) -> Client {
    Client::new(&server.base_url(), proto::descriptor_pool().clone())
        .unwrap()
        .with_codec(codec)
        .with_header(HeaderName::from_static("x-runner-uuid"), HeaderValue::from_static(UUID))
        .with_header(HeaderName::from_static("x-runner-token"), HeaderValue::from_static(TOKEN))
}

#[tokio::test]
async fn client_reports_transport_failures_as_unavailable() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let client = Client::new(&format!("http://{addr}/api/actions"), proto::descriptor_pool().clone()).unwrap();
    let error = client.unary::<_, PingResponse>("ping.v1.PingService/Ping", &PingRequest::default(), &CallOptions::default()).await.unwrap_err();
    assert_eq!(error.code, Code::Unavailable, "{error}");
}

#[test]
fn client_refuses_bad_base_urls() {
    for url in ["", "ftp://host/x", "/relative", "http://", "http://host/x?y=1"] {
        let error = Client::new(url, proto::descriptor_pool().clone()).unwrap_err();
        assert!(error.to_string().contains(&format!("{url:?}")), "{url}: {error}");
    }
}

#[tokio::test]
async fn client_rejects_a_success_with_the_wrong_content_type() {
    use http_body_util::Full;
    // A server that answers 200 text/html, like a misconfigured proxy.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let service = hyper::service::service_fn(|_req| async {
            let mut response = http::Response::new(Full::new(bytes::Bytes::from_static(b"<html>login</html>")));
            response.headers_mut().insert("content-type", HeaderValue::from_static("text/html"));
            Ok::<_, std::convert::Infallible>(response)
        });
        let _ = hyper::server::conn::http1::Builder::new().serve_connection(hyper_util::rt::TokioIo::new(stream), service).await;
    });
    let client = Client::new(&format!("http://{addr}"), proto::descriptor_pool().clone()).unwrap();
    let error = client.unary::<_, PingResponse>("ping.v1.PingService/Ping", &PingRequest::default(), &CallOptions::default()).await.unwrap_err();
    assert_eq!(error.code, Code::Internal);
    assert!(error.message.contains("text/html"), "{error}");
    server.abort();
}
