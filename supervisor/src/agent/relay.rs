//! The loopback, reached from a `container:` job's container (docs/architecture.md, "A
//! `container:` job"). gitea-runner hands every step the loopback's URLs — the "Gitea"
//! the runner talks to (`GITHUB_SERVER_URL`, and with it the runtime and results
//! service) and the cache (`ACTIONS_CACHE_URL`) — all on 127.0.0.1, which a job
//! container on its own Docker network does not share.
//!
//! Both halves keep the loopback contract (nothing listens beyond a loopback):
//! - the agent serves each loopback port also as a unix socket, `<port>` in
//!   [`dir`] beside the readiness socket — the directory the runner's configuration
//!   already mounts into a job container ([`serve_ports`]);
//! - the job-started hook, which gitea-runner runs inside the job container before the
//!   first step, finds each port of that directory that does not answer on the
//!   container's own 127.0.0.1 and leaves a relay there, from the port to its socket
//!   ([`bring_in`], [`run_relay`]). Steps and `docker://` actions (which share the
//!   job container's network) reach the same URLs as a host-mode step; the sockets
//!   reach nothing a host-mode step could not.

use std::{
    net::{Ipv4Addr, SocketAddr, TcpStream},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use tokio::{
    net::{TcpListener, UnixListener, UnixStream},
    task::JoinSet,
};
use tokio_util::sync::CancellationToken;

/// The directory of the port sockets, beside the readiness socket.
pub const DIR_NAME: &str = "loopback";
/// The sockets' mode: whoever a job container's user is (its root is the runner uid
/// under a rootless dockerd, another uid with `--user`), it may connect; only this
/// environment and its own containers see the directory.
pub const SOCKET_MODE: u32 = 0o666;
/// How long the hook waits for the relay it started to answer.
const RELAY_START: Duration = Duration::from_secs(5);

/// Where the port sockets are for the readiness socket `readiness_socket`.
pub fn dir(readiness_socket: &Path) -> PathBuf {
    readiness_socket.parent().unwrap_or(Path::new("/")).join(DIR_NAME)
}

/// Agent side: serves each of `ports` (loopback ports of this environment) as the unix
/// socket `<dir>/<port>` until `shutdown`.
///
/// # Errors
/// When the directory cannot be made or a socket bound.
pub fn serve_ports(dir: &Path, ports: &[u16], shutdown: CancellationToken) -> std::io::Result<tokio::task::JoinHandle<()>> {
    std::fs::create_dir_all(dir)?;
    let mut listeners = Vec::new();
    for &port in ports {
        listeners.push((port, super::bind_unix(&dir.join(port.to_string()), SOCKET_MODE)?));
    }
    Ok(tokio::spawn(async move {
        let mut served = JoinSet::new();
        for (port, listener) in listeners {
            served.spawn(to_loopback(listener, port));
        }
        shutdown.cancelled().await;
        served.shutdown().await;
    }))
}

async fn to_loopback(listener: UnixListener, port: u16) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((mut client, _)) => {
                    connections.spawn(async move {
                        if let Ok(mut upstream) = tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                        }
                    });
                }
                Err(error) => {
                    tracing::warn!(port, %error, "a loopback port's socket failed to accept");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = connections.join_next() => {}
        }
    }
}

/// The ports `dir` has sockets for (file names that are port numbers).
pub fn ports_in(dir: &Path) -> Vec<u16> {
    let mut ports: Vec<u16> =
        std::fs::read_dir(dir).map(|entries| entries.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect()).unwrap_or_default();
    ports.sort_unstable();
    ports
}

/// Whether something takes connections on 127.0.0.1:`port` here.
fn answers(port: u16) -> bool {
    TcpStream::connect_timeout(&SocketAddr::from((Ipv4Addr::LOCALHOST, port)), Duration::from_secs(1)).is_ok()
}

/// Hook side: when a port of `dir` does not answer here (this is a job container, not
/// the environment), starts a relay for those ports that outlives the hook, and returns
/// once they answer. `Ok(ports relayed)`; empty in the environment itself.
///
/// # Errors
/// What kept the relay from answering, for the job's log.
pub fn bring_in(dir: &Path) -> Result<Vec<u16>, String> {
    let missing: Vec<u16> = ports_in(dir).into_iter().filter(|&port| !answers(port)).collect();
    if missing.is_empty() {
        return Ok(missing);
    }
    use std::os::unix::process::CommandExt as _;
    // Its own process group, stdio closed: gitea-runner's `docker exec` of the hook ends
    // when the hook exits, and the relay lives on in the container until it is removed.
    let mut relay = std::process::Command::new("/proc/self/exe")
        .arg("loopback-relay")
        .arg(dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|error| format!("cannot start the loopback relay: {error}"))?;
    let deadline = Instant::now() + RELAY_START;
    loop {
        if missing.iter().all(|&port| answers(port)) {
            return Ok(missing);
        }
        if let Ok(Some(status)) = relay.try_wait() {
            return Err(format!("the loopback relay for 127.0.0.1 ports {missing:?} exited at once ({status}): a port is taken in this container"));
        }
        if Instant::now() > deadline {
            return Err(format!("the loopback relay does not answer on 127.0.0.1 ports {missing:?} after {RELAY_START:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `supervisor loopback-relay DIR` (started by [`bring_in`]): listens on 127.0.0.1 for
/// every port of `dir` nothing answers on, each connection relayed to its socket, until
/// the container goes. Exit 1 when a port cannot be bound.
pub fn run_relay(dir: &Path) -> u8 {
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return 1 };
    runtime.block_on(async {
        let mut relays = JoinSet::new();
        for port in ports_in(dir).into_iter().filter(|&port| !answers(port)) {
            let Ok(listener) = TcpListener::bind((Ipv4Addr::LOCALHOST, port)).await else { return 1 };
            relays.spawn(to_socket(listener, dir.join(port.to_string())));
        }
        while relays.join_next().await.is_some() {}
        0
    })
}

async fn to_socket(listener: TcpListener, socket: PathBuf) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((mut client, _)) => {
                    let socket = socket.clone();
                    connections.spawn(async move {
                        if let Ok(mut upstream) = UnixStream::connect(&socket).await {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                        }
                    });
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            },
            Some(_) = connections.join_next() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    #[test]
    fn only_port_numbers_are_ports() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["41731", "39001", "agent.sock", "70000", "x1"] {
            std::fs::write(dir.path().join(name), "").unwrap();
        }
        assert_eq!(ports_in(dir.path()), vec![39001, 41731]);
        assert_eq!(ports_in(&dir.path().join("absent")), Vec::<u16>::new());
    }

    #[test]
    fn the_directory_is_beside_the_readiness_socket() {
        assert_eq!(dir(Path::new("/run/supervisor/agent/agent.sock")), Path::new("/run/supervisor/agent/loopback"));
    }

    /// A loopback port served on its socket reaches the port's listener, both ways.
    #[tokio::test]
    async fn a_ports_socket_reaches_the_loopback_port() {
        let echo = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let port = echo.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut stream, _) = echo.accept().await.unwrap();
            let mut line = [0u8; 4];
            stream.read_exact(&mut line).await.unwrap();
            stream.write_all(&[b"got ".as_slice(), &line].concat()).await.unwrap();
        });
        let dir = tempfile::tempdir().unwrap();
        let shutdown = CancellationToken::new();
        let served = serve_ports(dir.path(), &[port], shutdown.clone()).unwrap();
        assert_eq!(ports_in(dir.path()), vec![port]);
        let mut client = UnixStream::connect(dir.path().join(port.to_string())).await.unwrap();
        client.write_all(b"ping").await.unwrap();
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.unwrap();
        assert_eq!(answer, b"got ping");
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), served).await.unwrap().unwrap();
    }
}
