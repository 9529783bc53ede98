//! A REAL OCI registry, the job dockerds' registry mirror in the rootless-Docker tests:
//! go-containerregistry's `registry` (in memory; from the Go module proxy by
//! scripts/install test-peers). It listens on 127.0.0.1 only, so a plain TCP forwarder
//! offers it on every address, where environments reach it on the host's bridge address.
//! The registry stops when dropped; the forwarder with the test binary.

use std::{process::Stdio, time::Duration};

#[derive(Debug)]
pub struct Registry {
    _process: crate::KillOnDrop,
    dir: tempfile::TempDir,
    /// The forwarder's port, on every address of the host.
    pub port: u16,
}

impl Registry {
    /// Starts the registry and waits (up to 30 s) until it takes connections.
    pub fn start() -> Registry {
        let binary = crate::peer("registry");
        let dir = tempfile::Builder::new().prefix("gdr-test-registry-").tempdir().unwrap();
        let port = crate::free_local_port();
        let log = std::fs::File::create(dir.path().join("registry.log")).unwrap();
        let child = std::process::Command::new(&binary)
            .arg("-port")
            .arg(port.to_string())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("{} cannot start: {e}: run scripts/install test-peers", binary.display()));
        crate::wait_until_blocking("the registry answers", Duration::from_secs(30), || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
        Registry { _process: crate::KillOnDrop(child), dir, port: forward_everywhere(port) }
    }

    /// What it logged: every request it served.
    pub fn log(&self) -> String {
        crate::log_tail(&self.dir.path().join("registry.log"), 200).unwrap_or_default()
    }
}

/// A port of every address whose connections are relayed to `127.0.0.1:port`, one thread
/// per direction.
fn forward_everywhere(port: u16) -> u16 {
    let listener = std::net::TcpListener::bind(("0.0.0.0", 0)).unwrap();
    let outer = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Ok(upstream) = std::net::TcpStream::connect(("127.0.0.1", port)) else { continue };
            for (mut from, mut to) in [(client.try_clone().unwrap(), upstream.try_clone().unwrap()), (upstream, client)] {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut to);
                    let _ = to.shutdown(std::net::Shutdown::Write);
                });
            }
        }
    });
    outer
}
