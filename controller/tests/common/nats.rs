//! A real nats-server with JetStream for tests and benchmarks: one per call of
//! [`NatsServer::start`], on random ports, with its store in a temporary directory, killed
//! when dropped.
//!
//! The binary comes from `scripts/install-test-peers` (`$PEERS_CACHE/bin/nats-server`,
//! default `~/.cache/gitea-dynamic-runner/peers/bin/nats-server`). Without it the caller
//! panics with a message saying so: a missing peer fails the run, it never skips.

#![allow(dead_code, clippy::missing_panics_doc)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long the server may take to write its ports file and report JetStream healthy.
const STARTUP: Duration = Duration::from_secs(20);

#[derive(Debug)]
pub struct NatsServer {
    child: Child,
    /// Holds the JetStream store, the ports file and the log; removed on drop.
    dir: tempfile::TempDir,
    /// `nats://127.0.0.1:<port>`
    pub url: String,
    /// `http://127.0.0.1:<port>`
    pub monitoring: String,
}

/// Where `scripts/install-test-peers` puts the binary.
pub fn binary() -> PathBuf {
    let cache = std::env::var_os("PEERS_CACHE").map_or_else(
        || {
            let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
            PathBuf::from(home).join(".cache/gitea-dynamic-runner/peers")
        },
        PathBuf::from,
    );
    cache.join("bin/nats-server")
}

impl NatsServer {
    /// Starts a server with JetStream (file storage) and waits until it is healthy.
    pub fn start() -> Self {
        Self::start_with_config(None)
    }

    /// Like [`start`](Self::start), with extra configuration file text (e.g.
    /// `jetstream { sync_interval: always }`) passed as `-c`.
    pub fn start_with_config(config: Option<&str>) -> Self {
        let bin = binary();
        assert!(
            bin.is_file(),
            "nats-server not found at {}: run scripts/install-test-peers (it installs the NATS test peer under $PEERS_CACHE)",
            bin.display()
        );
        let dir = tempfile::tempdir().expect("temporary directory for nats-server");
        let ports = dir.path().join("ports");
        std::fs::create_dir_all(&ports).expect("ports directory");
        let log = std::fs::File::create(dir.path().join("nats-server.log")).expect("log file");
        let mut command = Command::new(&bin);
        command
            .args(["-a", "127.0.0.1", "-p", "-1", "-js", "-m", "-1"])
            .arg("-sd")
            .arg(dir.path().join("js"))
            .arg("--ports_file_dir")
            .arg(&ports)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(config) = config {
            let file = dir.path().join("nats-server.conf");
            std::fs::write(&file, config).expect("config file");
            command.arg("-c").arg(file);
        }
        let child = command.spawn().unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
        let mut server = Self { child, dir, url: String::new(), monitoring: String::new() };
        let (url, monitoring) = server.wait_for_ports(&ports);
        server.url = url;
        server.monitoring = monitoring;
        server.wait_healthy();
        server
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("nats-server.log")).unwrap_or_default()
    }

    fn check_alive(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("nats-server exited during start-up ({status}):\n{}", self.log());
        }
    }

    /// Polls for `<ports>/nats-server_<pid>.ports` and reads the client and monitoring URLs.
    fn wait_for_ports(&mut self, ports: &std::path::Path) -> (String, String) {
        let file = ports.join(format!("nats-server_{}.ports", self.child.id()));
        let started = Instant::now();
        loop {
            self.check_alive();
            // The server may be writing the file: retry until it parses.
            if let Ok(text) = std::fs::read_to_string(&file)
                && let Ok(json) = serde_json::from_str::<serde_json::Value>(&text)
            {
                let first = |key: &str| json[key][0].as_str().map(str::to_owned);
                if let (Some(url), Some(monitoring)) = (first("nats"), first("monitoring")) {
                    return (url, monitoring);
                }
            }
            assert!(started.elapsed() < STARTUP, "nats-server wrote no ports file within {STARTUP:?}:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Polls `/healthz?js-enabled-only=true` until it answers 200.
    fn wait_healthy(&mut self) {
        let host = self.monitoring.trim_start_matches("http://").to_owned();
        let started = Instant::now();
        loop {
            self.check_alive();
            if http_status(&host, "/healthz?js-enabled-only=true") == Some(200) {
                return;
            }
            assert!(started.elapsed() < STARTUP, "nats-server JetStream not healthy within {STARTUP:?}:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A minimal HTTP/1.0 GET: the status code, or `None` if the server did not answer.
fn http_status(host: &str, path: &str) -> Option<u16> {
    let mut stream = TcpStream::connect(host).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    response.split_whitespace().nth(1)?.parse().ok()
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
