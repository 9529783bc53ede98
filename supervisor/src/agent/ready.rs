//! The readiness protocol between the agent and `supervisor job-started`: one JSON
//! line each way over a unix socket owned by the runner uid. Both ends live here: the
//! agent's server ([`bind`], [`serve`]), the hook's client ([`wait`]), and the reports
//! from PID 1 about dockerd that feed the answer ([`read_docker_reports`]; the reports
//! themselves are [`super::docker::report`]'s).
//!
//! request:  `{"wait_ms": 30000}` — answer when everything is ready, something failed,
//!           or after `wait_ms`, whichever comes first;
//! response: `{"identity": {"state": "ready", "detail": "…"}, "docker": {…}}`.

use std::{
    io::{BufRead, BufReader, Write},
    os::fd::{FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt},
    net::{UnixListener, UnixStream},
    sync::{mpsc, watch},
};

use super::docker::report::{DOCKER_FD, DockerReport};

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", content = "detail", rename_all = "snake_case")]
pub enum Status {
    /// Not required in this environment.
    #[default]
    Off,
    Waiting(String),
    /// dockerd is starting behind its socket, which already takes connections: a
    /// `docker` call waits for dockerd instead of failing, so steps need not wait.
    Starting(String),
    Ready(String),
    Failed(String),
}

impl Status {
    /// Whether what needs it may go on (a starting dockerd counts: see [`Status::Starting`]).
    pub fn is_ready(&self) -> bool {
        matches!(self, Status::Off | Status::Starting(_) | Status::Ready(_))
    }

    /// Whether nothing more will change.
    pub fn is_final(&self) -> bool {
        matches!(self, Status::Off | Status::Ready(_) | Status::Failed(_))
    }

    pub fn is_failed(&self) -> bool {
        matches!(self, Status::Failed(_))
    }

    pub fn is_off(&self) -> bool {
        matches!(self, Status::Off)
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Status::Off => f.write_str("off"),
            Status::Waiting(detail) => write!(f, "waiting ({detail})"),
            Status::Starting(detail) => write!(f, "starting ({detail})"),
            Status::Ready(detail) => write!(f, "ready ({detail})"),
            Status::Failed(detail) => write!(f, "failed ({detail})"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Readiness {
    pub identity: Status,
    pub docker: Status,
    /// A host-mode job's `services:`, which the agent starts ([`super::docker::services`]).
    #[serde(default, skip_serializing_if = "Status::is_off")]
    pub services: Status,
}

impl Readiness {
    pub fn is_ready(&self) -> bool {
        self.parts().iter().all(|(_, status)| status.is_ready())
    }

    pub fn is_settled(&self) -> bool {
        self.is_ready() || self.parts().iter().any(|(_, status)| status.is_failed())
    }

    /// "identity: waiting (…); dockerd: failed (…)" for what is not ready.
    pub fn missing(&self) -> String {
        let parts = self.parts().into_iter().filter(|(_, status)| !status.is_ready());
        parts.map(|(name, status)| format!("{name}: {status}")).collect::<Vec<_>>().join("; ")
    }

    /// "identity: ready (…); dockerd: …" and the services when the agent starts any.
    pub fn describe(&self) -> String {
        let parts = self.parts().into_iter().filter(|(name, status)| *name != "services" || !status.is_off());
        parts.map(|(name, status)| format!("{name}: {status}")).collect::<Vec<_>>().join("; ")
    }

    fn parts(&self) -> [(&'static str, &Status); 3] {
        [("identity", &self.identity), ("dockerd", &self.docker), ("services", &self.services)]
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub wait_ms: u64,
}

/// The readiness socket's mode: it answers readiness only, and a `container:` job's
/// image may run the hook as any user.
pub const SOCKET_MODE: u32 = 0o666;

/// Answers every request on `listener` from `readiness`; `passed` hears of each answer
/// that let the hook through.
pub async fn serve(listener: UnixListener, readiness: watch::Receiver<Readiness>, passed: mpsc::UnboundedSender<()>) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                connections.spawn(answer(stream, readiness.clone(), passed.clone()));
            }
            Err(error) => {
                tracing::warn!(%error, "readiness socket accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        while connections.try_join_next().is_some() {}
    }
}

async fn answer(stream: UnixStream, mut readiness: watch::Receiver<Readiness>, passed: mpsc::UnboundedSender<()>) {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let mut reader = tokio::io::BufReader::new(read.take(4096));
    if reader.read_line(&mut line).await.is_err() {
        return;
    }
    let wait = serde_json::from_str::<Request>(&line).map_or(Duration::ZERO, |r| Duration::from_millis(r.wait_ms));
    let _ = tokio::time::timeout(wait, readiness.wait_for(Readiness::is_settled)).await;
    let current = readiness.borrow().clone();
    let mut answer = serde_json::to_vec(&current).unwrap_or_default();
    answer.push(b'\n');
    if write.write_all(&answer).await.is_ok() && current.is_ready() {
        let _ = passed.send(());
    }
}

/// Why the hook could not ask the agent. The hook prints it to the job's log as it is
/// (one line, no cause chain), so each message carries its cause.
#[derive(Debug, thiserror::Error)]
pub enum AskError {
    #[error("connect: {0}")]
    Connect(std::io::Error),
    #[error("send: {0}")]
    Send(std::io::Error),
    #[error("receive: {0}")]
    Receive(std::io::Error),
    #[error("unreadable answer {answer:?}: {error}")]
    Unreadable { answer: String, error: serde_json::Error },
    #[error("cannot ask the supervisor agent at {} ({last}); is this environment started by `supervisor run`?", .socket.display())]
    NoAnswer { socket: PathBuf, last: String },
}

/// The hook's side: asks the agent, reconnecting while its socket is not there yet,
/// until `timeout`.
///
/// # Errors
/// [`AskError::NoAnswer`] when the agent could not be asked at all before the deadline.
pub fn wait(socket: &Path, timeout: Duration) -> Result<Readiness, AskError> {
    let deadline = Instant::now() + timeout;
    let mut last_error;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match ask(socket, left) {
            Ok(readiness) if readiness.is_settled() || left.is_zero() => return Ok(readiness),
            Ok(readiness) => {
                // The agent answered early without being settled (its wait was shorter).
                last_error = readiness.missing();
                if Instant::now() >= deadline {
                    return Ok(readiness);
                }
            }
            Err(error) => last_error = error.to_string(),
        }
        if Instant::now() >= deadline {
            return Err(AskError::NoAnswer { socket: socket.to_owned(), last: last_error });
        }
        std::thread::sleep(Duration::from_millis(100).min(deadline.saturating_duration_since(Instant::now())));
    }
}

fn ask(socket: &Path, wait: Duration) -> Result<Readiness, AskError> {
    let mut stream = std::os::unix::net::UnixStream::connect(socket).map_err(AskError::Connect)?;
    stream.set_read_timeout(Some(wait + Duration::from_secs(5))).map_err(AskError::Connect)?;
    let request = Request { wait_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX) };
    let mut line = serde_json::to_vec(&request).unwrap_or_default();
    line.push(b'\n');
    stream.write_all(&line).map_err(AskError::Send)?;
    let mut answer = String::new();
    BufReader::new(stream).read_line(&mut answer).map_err(AskError::Receive)?;
    serde_json::from_str(&answer).map_err(|error| AskError::Unreadable { answer, error })
}

/// Reads PID 1's reports about dockerd from [`DOCKER_FD`], one line each, until the
/// last (`ready` or `failed`), passing each on.
pub fn read_docker_reports(mut report: impl FnMut(Status)) {
    // SAFETY: fd 3 was installed by PID 1 (dup2 in the pre-exec step) for this
    // process alone; fcntl confirms it is open before ownership is taken, and nothing
    // else in the agent uses fd 3.
    let open = unsafe { libc::fcntl(DOCKER_FD, libc::F_GETFD) } != -1;
    if !open {
        return report(Status::Failed("PID 1 gave the agent no dockerd report channel (fd 3)".into()));
    }
    // SAFETY: see above; the fd is open and owned by nobody else in this process.
    let fd = unsafe { OwnedFd::from_raw_fd(DOCKER_FD) };
    let mut reader = BufReader::new(std::fs::File::from(fd));
    loop {
        let mut line = String::new();
        let status = match reader.read_line(&mut line) {
            Ok(0) => Status::Failed("PID 1 closed the dockerd report channel without a final word".into()),
            Ok(_) => docker_status(&line),
            Err(error) => Status::Failed(format!("reading PID 1's dockerd report failed: {error}")),
        };
        let last = status.is_final();
        report(status);
        if last {
            return;
        }
    }
}

/// What one of PID 1's report lines means for the job: a line that is no report
/// fails dockerd's readiness, saying so.
fn docker_status(line: &str) -> Status {
    match DockerReport::parse(line) {
        Ok(DockerReport::Listening(detail)) => Status::Starting(detail),
        Ok(DockerReport::Ready(detail)) => Status::Ready(detail),
        Ok(DockerReport::Failed(detail)) => Status::Failed(detail),
        Err(unreadable) => Status::Failed(unreadable.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format() {
        let readiness = Readiness { identity: Status::Ready("spiffe://example.org/ci/o/r/j".into()), docker: Status::Off, services: Status::Off };
        let json = serde_json::to_string(&readiness).unwrap();
        assert_eq!(json, r#"{"identity":{"state":"ready","detail":"spiffe://example.org/ci/o/r/j"},"docker":{"state":"off"}}"#);
        assert_eq!(serde_json::from_str::<Readiness>(&json).unwrap(), readiness);
        assert!(readiness.is_ready());
    }

    #[test]
    fn missing_names_what_is_not_ready() {
        let readiness = Readiness {
            identity: Status::Waiting("no identity issued".into()),
            docker: Status::Failed("dockerd exited with 1".into()),
            services: Status::Waiting("pulling nginx for service `web`".into()),
        };
        assert!(!readiness.is_ready());
        assert!(readiness.is_settled());
        assert_eq!(
            readiness.missing(),
            "identity: waiting (no identity issued); dockerd: failed (dockerd exited with 1); services: waiting (pulling nginx for service `web`)"
        );
        let services = Readiness { services: Status::Failed("service `web` did not come up".into()), ..readiness.clone() };
        assert!(services.is_settled());
        let starting = Readiness { identity: Status::Off, docker: Status::Ready("up".into()), services: Status::Waiting("starting".into()) };
        assert!(!starting.is_ready() && !starting.is_settled(), "the hook waits for a host-mode job's services");
        let json = serde_json::to_string(&starting).unwrap();
        assert!(json.ends_with(r#""services":{"state":"waiting","detail":"starting"}}"#), "{json}");
        assert_eq!(starting.describe(), "identity: off; dockerd: ready (up); services: waiting (starting)");
    }

    #[test]
    fn a_starting_dockerd_holds_nothing_back() {
        let readiness = Readiness {
            identity: Status::Ready("spiffe://example.org/ci/o/r/j".into()),
            docker: Status::Starting("socket bound".into()),
            services: Status::Off,
        };
        assert_eq!(readiness.describe(), "identity: ready (spiffe://example.org/ci/o/r/j); dockerd: starting (socket bound)");
        assert!(readiness.is_ready() && readiness.is_settled());
        assert!(!readiness.docker.is_final());
        let json = serde_json::to_string(&readiness.docker).unwrap();
        assert_eq!(json, r#"{"state":"starting","detail":"socket bound"}"#);
    }

    #[test]
    fn docker_reports() {
        let table: &[(&str, Status)] = &[
            ("ready /var/run/docker.sock answered in 412ms\n", Status::Ready("/var/run/docker.sock answered in 412ms".into())),
            ("failed dockerd exited with 1\n", Status::Failed("dockerd exited with 1".into())),
            ("ready\n", Status::Ready(String::new())),
            ("listening /var/run/docker.sock\n", Status::Starting("/var/run/docker.sock".into())),
            ("bogus\n", Status::Failed("unreadable dockerd report \"bogus\"".into())),
        ];
        for (line, want) in table {
            assert_eq!(&docker_status(line), want, "{line:?}");
        }
    }
}
