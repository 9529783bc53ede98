//! One HTTP/1.0 `GET` on a connected stream, for the synchronous probes (PID 1's
//! `/_ping` of dockerd, doctor's checks of what a step reaches). Hand-written because
//! they run without an async runtime and need nothing but the status line and a short
//! body: a client crate would bring its runtime along.

use std::io::{Read, Write};

/// What a `GET` answered: its status line and body.
#[derive(Debug, PartialEq, Eq)]
pub struct Answer {
    pub status_line: String,
    pub body: String,
}

impl Answer {
    /// The status code, when the status line has one.
    pub fn status(&self) -> Option<u16> {
        self.status_line.split_whitespace().nth(1)?.parse().ok()
    }
}

/// Sends `GET path` with `Host: host` and reads the answer (at most 64 KiB) to the end.
///
/// # Errors
/// When writing or reading fails (a timeout set on the stream included).
pub fn get(mut stream: impl Read + Write, host: &str, path: &str) -> std::io::Result<Answer> {
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").as_bytes())?;
    let mut answer = Vec::with_capacity(512);
    stream.take(64 * 1024).read_to_end(&mut answer)?;
    let text = String::from_utf8_lossy(&answer);
    let status_line = text.lines().next().unwrap_or("").to_owned();
    let body = text.split_once("\r\n\r\n").map_or("", |(_, body)| body).to_owned();
    Ok(Answer { status_line, body })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream that answers `reply` and records what was written.
    struct Canned {
        reply: std::io::Cursor<Vec<u8>>,
        sent: Vec<u8>,
    }

    impl Read for Canned {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.reply.read(buf)
        }
    }

    impl Write for Canned {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.sent.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn the_status_line_and_the_body_of_an_answer() {
        let table: Vec<(&str, Option<u16>, &str)> = vec![
            ("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK", Some(200), "OK"),
            ("HTTP/1.0 404 Not Found\r\n\r\n", Some(404), ""),
            ("", None, ""),
            ("garbage", None, ""),
        ];
        for (reply, status, body) in table {
            let mut stream = Canned { reply: std::io::Cursor::new(reply.as_bytes().to_vec()), sent: Vec::new() };
            let answer = get(&mut stream, "docker", "/_ping").unwrap();
            assert_eq!((answer.status(), answer.body.as_str()), (status, body), "{reply:?}");
            assert_eq!(stream.sent, b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n");
        }
    }
}
