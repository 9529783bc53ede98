//! A real nats-server with JetStream for tests and benchmarks: one per call of
//! [`NatsServer::start`], on random ports, with its store in a temporary directory, killed
//! when dropped.
//!
//! The binary comes from `scripts/install test-peers` (`$PEERS_CACHE/bin/nats-server`,
//! default `~/.cache/gitea-dynamic-runner/peers/bin/nats-server`). Without it the caller
//! panics with a message saying so: a missing peer fails the run, it never skips.

#![allow(dead_code, clippy::missing_panics_doc)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

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

/// Where `scripts/install test-peers` puts the binary.
pub fn binary() -> PathBuf {
    crate::peers_cache().join("bin/nats-server")
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
            "nats-server not found at {}: run scripts/install test-peers (it installs the NATS test peer under $PEERS_CACHE)",
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
        let ports = crate::poll_blocking(STARTUP, || {
            self.check_alive();
            // The server may be writing the file: retry until it parses.
            let text = std::fs::read_to_string(&file).map_err(|_| ())?;
            let json = serde_json::from_str::<serde_json::Value>(&text).map_err(|_| ())?;
            let first = |key: &str| json[key][0].as_str().map(str::to_owned);
            first("nats").zip(first("monitoring")).ok_or(())
        });
        ports.unwrap_or_else(|()| panic!("nats-server wrote no ports file within {STARTUP:?}:\n{}", self.log()))
    }

    /// Polls `/healthz?js-enabled-only=true` until it answers 200.
    fn wait_healthy(&mut self) {
        let host = self.monitoring.trim_start_matches("http://").to_owned();
        let healthy = crate::poll_blocking(STARTUP, || {
            self.check_alive();
            if http_status(&host, "/healthz?js-enabled-only=true") == Some(200) { Ok(()) } else { Err(()) }
        });
        healthy.unwrap_or_else(|()| panic!("nats-server JetStream not healthy within {STARTUP:?}:\n{}", self.log()));
    }
}

/// A minimal HTTP/1.0 GET: the status code, or `None` if the server did not answer.
fn http_status(host: &str, path: &str) -> Option<u16> {
    http_get(host, path).map(|(status, _)| status)
}

/// A plain HTTP/1.0 GET of a monitoring endpoint: status and body.
fn http_get(host: &str, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(host).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).unwrap_or_default();
    Some((status, body))
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A real JetStream cluster of nats-servers on loopback ports, for the clustered store:
/// nodes can be killed (SIGKILL, as a crash) and restarted with the same configuration
/// and storage.
#[derive(Debug)]
pub struct NatsCluster {
    nodes: Vec<ClusterNode>,
    /// Holds every node's store and log; removed on drop.
    dir: tempfile::TempDir,
}

#[derive(Debug)]
struct ClusterNode {
    name: String,
    client: u16,
    monitoring: u16,
    args: Vec<String>,
    child: Option<Child>,
}

/// The names of the nodes that `host`'s `/routez` lists (a route pool has several
/// connections per peer).
fn routed_peers(host: &str) -> std::collections::BTreeSet<String> {
    let Some((200, body)) = http_get(host, "/routez") else { return Default::default() };
    let routez: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    routez["routes"].as_array().into_iter().flatten().filter_map(|route| route["remote_name"].as_str().map(str::to_owned)).collect()
}

impl NatsCluster {
    /// Starts `size` nodes (3 for R3 streams) and waits until every one is healthy.
    pub fn start(size: usize) -> Self {
        let bin = binary();
        assert!(bin.is_file(), "nats-server not found at {}: run scripts/install test-peers", bin.display());
        let dir = tempfile::tempdir().expect("temporary directory for the cluster");
        let routes: Vec<u16> = (0..size).map(|_| crate::free_local_port()).collect();
        let route_list = routes.iter().map(|p| format!("nats://127.0.0.1:{p}")).collect::<Vec<_>>().join(",");
        let mut nodes = Vec::new();
        for (i, route) in routes.iter().enumerate() {
            let name = format!("node{i}");
            let (client, monitoring) = (crate::free_local_port(), crate::free_local_port());
            let store = dir.path().join(&name);
            let args = vec![
                "-a".into(),
                "127.0.0.1".into(),
                "-p".into(),
                client.to_string(),
                "-m".into(),
                monitoring.to_string(),
                "-js".into(),
                "-sd".into(),
                store.display().to_string(),
                "-n".into(),
                name.clone(),
                "--cluster_name".into(),
                "gdr".into(),
                "--cluster".into(),
                format!("nats://127.0.0.1:{route}"),
                "--routes".into(),
                route_list.clone(),
            ];
            nodes.push(ClusterNode { name, client, monitoring, args, child: None });
        }
        let mut cluster = NatsCluster { nodes, dir };
        for i in 0..size {
            cluster.spawn(i);
        }
        for i in 0..size {
            cluster.wait_healthy(i);
        }
        cluster.wait_meshed();
        cluster
    }

    fn spawn(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join(format!("{}.log", node.name))).expect("log file");
        let child = Command::new(binary()).args(&node.args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(log).spawn().expect("nats-server starts");
        node.child = Some(child);
    }

    /// `nats://…,nats://…`: every node, for a client that fails over.
    pub fn url(&self) -> String {
        self.nodes.iter().map(|n| format!("nats://127.0.0.1:{}", n.client)).collect::<Vec<_>>().join(",")
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Kills node `i` (SIGKILL) and waits for it.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts node `i` again with its configuration and storage, and waits until healthy.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i);
        self.wait_healthy(i);
    }

    /// Starts every stopped node at once (a lone node cannot become healthy without a
    /// quorum), then waits until all are healthy.
    pub fn restart_stopped(&mut self) {
        let stopped: Vec<usize> = (0..self.nodes.len()).filter(|i| !self.is_running(*i)).collect();
        for i in &stopped {
            self.spawn(*i);
        }
        for i in 0..self.nodes.len() {
            self.wait_healthy(i);
        }
        self.wait_meshed();
    }

    /// Waits until every node has a route to every other. `/healthz` is satisfied once
    /// JetStream's meta group has a leader, and a node may still lack the route to the node
    /// that leads a stream: a client connected to it then gets "no responders" for that
    /// stream's subjects (one CI run in a dozen, on the first write to a fresh cluster).
    fn wait_meshed(&self) {
        for (i, node) in self.nodes.iter().enumerate() {
            let host = format!("127.0.0.1:{}", node.monitoring);
            crate::poll_blocking(Duration::from_secs(60), || {
                let peers = routed_peers(&host);
                if peers.len() + 1 >= self.nodes.len() { Ok(()) } else { Err(peers) }
            })
            .unwrap_or_else(|peers| {
                panic!("{} has routes to {peers:?} only after 60 s, not to all {} other nodes:\n{}", node.name, self.nodes.len() - 1, self.log(i))
            });
        }
    }

    pub fn is_running(&self, i: usize) -> bool {
        self.nodes[i].child.is_some()
    }

    /// Waits until node `i` reports healthy: the full `/healthz` also requires a JetStream
    /// meta leader and current replicas, which `js-enabled-only` does not.
    pub fn wait_healthy(&self, i: usize) {
        let host = format!("127.0.0.1:{}", self.nodes[i].monitoring);
        crate::poll_blocking(Duration::from_secs(60), || if http_status(&host, "/healthz") == Some(200) { Ok(()) } else { Err(()) })
            .unwrap_or_else(|()| panic!("{} not healthy within 60 s:\n{}", self.nodes[i].name, self.log(i)));
    }

    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{}.log", self.nodes[i].name))).unwrap_or_default()
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }
}
