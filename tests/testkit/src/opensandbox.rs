//! A REAL opensandbox-server (PyPI `opensandbox-server`, installed by
//! `scripts/install test-peers` as `$PEERS_CACHE/bin/opensandbox-server`) with its Docker
//! runtime on a dockerd the test names: its own port, API key file and SQLite store in a
//! temporary directory, killed when dropped.
//!
//! The Docker runtime runs an "execd" image next to every sandbox and copies `/execd`
//! and `/bootstrap.sh` out of it; no registry is reachable here, so
//! [`OpenSandbox::start`] builds a local stand-in (`execd` sleeps; `bootstrap.sh` starts
//! it and `exec`s the sandbox's entrypoint, as the real one does) on top of an image the
//! daemon already has. It serves no execd API — the driver never uses one.

#![allow(clippy::missing_panics_doc)]

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

/// The tag of the stand-in execd image.
pub const EXECD_IMAGE: &str = "opensandbox/execd:gdr-test";

pub struct OpenSandbox {
    child: Option<Child>,
    dir: tempfile::TempDir,
    port: u16,
    docker_host: String,
    api_key: String,
    /// `[docker] sandbox_binds`: host mounts of every sandbox (`host:container[:mode]`).
    binds: Vec<String>,
}

/// `$PEERS_CACHE/bin/opensandbox-server`.
pub fn binary() -> PathBuf {
    crate::peer("opensandbox-server")
}

fn docker(docker_host: &str, args: &[&str]) -> std::process::Output {
    Command::new("docker")
        .arg("-H")
        .arg(docker_host)
        .args(args)
        .env("DOCKER_BUILDKIT", "0")
        .stdin(Stdio::null())
        .output()
        .expect("the docker CLI is missing: run scripts/install test-peers")
}

/// Builds [`EXECD_IMAGE`] from `base` (which must have `sh` and `sleep`) unless the
/// daemon has it.
pub fn ensure_execd_image(docker_host: &str, base: &str) {
    if docker(docker_host, &["image", "inspect", EXECD_IMAGE]).status.success() {
        return;
    }
    let context = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        use std::os::unix::fs::PermissionsExt;
        let path = context.path().join(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    };
    write("execd", "#!/bin/sh\nexec sleep 2147483647\n");
    write("bootstrap.sh", "#!/bin/sh\n/opt/opensandbox/execd &\nexec \"$@\"\n");
    write("Dockerfile", &format!("FROM {base}\nCOPY execd /execd\nCOPY bootstrap.sh /bootstrap.sh\nENTRYPOINT []\nCMD [\"sleep\", \"2147483647\"]\n"));
    let output = docker(docker_host, &["build", "-q", "-t", EXECD_IMAGE, &context.path().display().to_string()]);
    assert!(output.status.success(), "building {EXECD_IMAGE} from {base}: {}", String::from_utf8_lossy(&output.stderr));
}

impl OpenSandbox {
    /// Starts the server against the dockerd at `docker_host` (`unix:///…`), with the
    /// stand-in execd image built from `execd_base`, and waits for `GET /health`.
    pub fn start(docker_host: &str, execd_base: &str) -> OpenSandbox {
        Self::start_with_binds(docker_host, execd_base, &[])
    }

    /// [`OpenSandbox::start`] with host mounts in every sandbox (the server's
    /// `sandbox_binds`, e.g. a SPIRE agent's socket directory).
    pub fn start_with_binds(docker_host: &str, execd_base: &str, binds: &[String]) -> OpenSandbox {
        ensure_execd_image(docker_host, execd_base);
        let dir = tempfile::Builder::new().prefix("gdr-opensandbox-").tempdir().unwrap();
        let api_key = format!("gdr-test-{:016x}", fastrand_u64());
        std::fs::write(dir.path().join("api-key"), &api_key).unwrap();
        let mut server = OpenSandbox { child: None, dir, port: crate::free_local_port(), docker_host: docker_host.to_owned(), api_key, binds: binds.to_vec() };
        server.write_config();
        server.spawn();
        server
    }

    fn write_config(&self) {
        let config = format!(
            r#"[server]
host = "127.0.0.1"
port = {port}
max_sandbox_timeout_seconds = 86400
api_key = "{key}"
[log]
level = "INFO"
[runtime]
type = "docker"
execd_image = "{EXECD_IMAGE}"
[store]
type = "sqlite"
path = "{dir}/opensandbox.db"
[docker]
network_mode = "bridge"
port_range_min = 20000
port_range_max = 29999
publish_host = "127.0.0.1"
sandbox_binds = {binds}
[ingress]
mode = "direct"
"#,
            port = self.port,
            key = self.api_key,
            dir = self.dir.path().display(),
            binds = serde_json::to_string(&self.binds).unwrap(),
        );
        std::fs::write(self.dir.path().join("config.toml"), config).unwrap();
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join("server.log")).unwrap();
        let child = Command::new(binary())
            .arg("--config")
            .arg(self.dir.path().join("config.toml"))
            .env("DOCKER_HOST", &self.docker_host)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", binary().display()));
        self.child = Some(child);
        let healthy = crate::poll_blocking(Duration::from_secs(60), || {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("opensandbox-server exited ({status}):\n{}", self.log());
            }
            if self.healthy() { Ok(()) } else { Err(()) }
        });
        healthy.unwrap_or_else(|()| panic!("opensandbox-server not healthy within 60 s:\n{}", self.log()));
    }

    fn healthy(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else { return false };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let request = format!("GET /health HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n\r\n", self.port);
        if stream.write_all(request.as_bytes()).is_err() {
            return false;
        }
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer);
        answer.starts_with("HTTP/1.1 200")
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The file holding the server's API key.
    pub fn api_key_file(&self) -> PathBuf {
        self.dir.path().join("api-key")
    }

    pub fn api_key(&self) -> &str {
        &self.api_key
    }

    /// Stops the server (SIGKILL), keeping its store for [`OpenSandbox::restart`].
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port with the same store.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for OpenSandbox {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A random-enough number for a test API key (no extra dependency for one value).
fn fastrand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    hasher.finish()
}
