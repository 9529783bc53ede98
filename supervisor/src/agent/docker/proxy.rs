//! The rootless dockerd's socket as the runner and the steps see it, from the agent's
//! start. A rootless dockerd starts behind rootlesskit, which keeps fd 3 for itself, so it
//! cannot be handed a socket bound in advance (what PID 1 does for a root dockerd); it
//! binds its own only once it answers. Until then a `docker` call — gitea-runner's for a
//! `container:` job, which comes before the job-started hook, or a step's — would fail. So
//! the agent binds the public socket at once, and each connection waits there for
//! dockerd's own socket, then is relayed byte for byte (hijacked attach and exec streams
//! included).

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use tokio::{
    net::{UnixListener, UnixStream},
    sync::watch,
    task::JoinSet,
};

use crate::agent::ready::Readiness;

/// How often a waiting connection tries dockerd's socket.
const RETRY: Duration = Duration::from_millis(10);

/// The socket's mode: the runner and its group.
pub const SOCKET_MODE: u32 = 0o660;

/// Relays every connection on `listener` to `upstream` once it takes connections, for up
/// to `patience` from the connection's arrival — none once `readiness` says dockerd
/// failed. Runs until dropped; its connections end with it.
pub async fn serve(listener: UnixListener, upstream: PathBuf, patience: Duration, readiness: watch::Receiver<Readiness>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => {
                    connections.spawn(relay(client, upstream.clone(), patience, readiness.clone()));
                }
                Err(error) => {
                    tracing::warn!(%error, "the docker socket's accept failed");
                    tokio::time::sleep(RETRY).await;
                }
            },
            Some(_) = connections.join_next() => {}
        }
    }
}

async fn relay(mut client: UnixStream, upstream: PathBuf, patience: Duration, readiness: watch::Receiver<Readiness>) {
    let deadline = Instant::now() + patience;
    let mut dockerd = loop {
        match UnixStream::connect(&upstream).await {
            Ok(stream) => break stream,
            // The caller sees its connection closed; the job-started hook says why.
            Err(_) if readiness.borrow().docker.is_failed() => return,
            Err(_) if Instant::now() < deadline => tokio::time::sleep(RETRY).await,
            // The caller sees its connection closed; dockerd's failure is reported on its own.
            Err(error) => {
                tracing::warn!(upstream = %upstream.display(), %error, ?patience, "dockerd's socket did not take a connection in time");
                return;
            }
        }
    };
    let _ = tokio::io::copy_bidirectional(&mut client, &mut dockerd).await;
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;
    use crate::agent::{bind_unix, ready::Status};

    fn bind(socket: &std::path::Path) -> UnixListener {
        bind_unix(socket, SOCKET_MODE).unwrap()
    }

    fn readiness(docker: Status) -> (watch::Sender<Readiness>, watch::Receiver<Readiness>) {
        watch::channel(Readiness { identity: Status::Off, docker, services: Status::Off })
    }

    /// A call made before dockerd's socket exists waits for it and gets dockerd's answer;
    /// one that waits longer than the patience is closed.
    #[tokio::test]
    async fn a_connection_waits_for_dockerd_then_is_relayed() {
        let dir = tempfile::tempdir().unwrap();
        let (public, upstream) = (dir.path().join("docker.sock"), dir.path().join("dockerd.sock"));
        let (_starting, watched) = readiness(Status::Starting(String::new()));
        let proxy = tokio::spawn(serve(bind(&public), upstream.clone(), Duration::from_secs(5), watched));
        let mut early = UnixStream::connect(&public).await.unwrap();
        early.write_all(b"GET /_ping HTTP/1.0\r\n\r\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let dockerd = UnixListener::bind(&upstream).unwrap();
        let (mut served, _) = dockerd.accept().await.unwrap();
        let mut request = [0u8; 23];
        served.read_exact(&mut request).await.unwrap();
        assert_eq!(&request, b"GET /_ping HTTP/1.0\r\n\r\n");
        served.write_all(b"HTTP/1.0 200 OK\r\n\r\nOK").await.unwrap();
        drop(served);
        let mut answer = String::new();
        early.read_to_string(&mut answer).await.unwrap();
        assert_eq!(answer, "HTTP/1.0 200 OK\r\n\r\nOK");
        proxy.abort();

        for (status, patience) in [(Status::Starting(String::new()), Duration::from_millis(100)), (Status::Failed("no".into()), Duration::from_secs(3600))] {
            let (_kept, watched) = readiness(status);
            let closing = tokio::spawn(serve(bind(&public), dir.path().join("never.sock"), patience, watched));
            let mut late = UnixStream::connect(&public).await.unwrap();
            let mut nothing = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(5), late.read_to_end(&mut nothing)).await;
            assert!(matches!(read, Ok(Ok(0))), "the connection was not closed (patience {patience:?}): {read:?}");
            closing.abort();
        }
    }
}
