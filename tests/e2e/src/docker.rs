//! The Docker host of the tests: a real dockerd (Debian's) started once per test binary
//! with its own bridge and subnet, so environment containers reach the host — the real
//! Gitea listens on the bridge's address — and several test binaries or a leftover
//! daemon never collide. It stops when the test binary exits (atexit), taking its
//! containers with it; every test still removes its own environments and checks that.

use std::{
    collections::HashSet,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::Mutex,
    time::{Duration, Instant},
};

use crate::run;

pub struct HostDocker {
    pub socket: PathBuf,
    /// The host's address on the bridge: what containers reach the host at.
    pub bridge_ip: Ipv4Addr,
    bridge: String,
    pid: u32,
    child: Mutex<Option<std::process::Child>>,
    dir: PathBuf,
    loaded: Mutex<HashSet<String>>,
}

static HOST: crate::Shared<HostDocker> = crate::Shared::new();

/// The shared Docker host, started on first use.
pub fn host() -> &'static HostDocker {
    HOST.get_or_start(HostDocker::start)
}

impl HostDocker {
    fn start() -> HostDocker {
        let pid = std::process::id();
        let bridge = format!("gdre{}", pid % 100_000);
        let bridge_ip = Ipv4Addr::new(10, 213, u8::try_from(pid % 250).unwrap(), 1);
        let _ = run("ip", &["link", "del", &bridge]);
        for args in [
            vec!["link", "add", bridge.as_str(), "type", "bridge"],
            vec!["addr", "add", &format!("{bridge_ip}/24"), "dev", bridge.as_str()],
            vec!["link", "set", bridge.as_str(), "up"],
        ] {
            let output = run("ip", &args);
            assert!(output.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&output.stderr));
        }
        let dir = tempfile::Builder::new().prefix("gdr-e2e-dockerd-").tempdir_in("/tmp").unwrap().keep();
        let socket = dir.join("docker.sock");
        let log = std::fs::File::create(dir.join("dockerd.log")).unwrap();
        let child = Command::new("dockerd")
            .arg(format!("--host=unix://{}", socket.display()))
            .arg(format!("--data-root={}", dir.join("data").display()))
            .arg(format!("--exec-root={}", dir.join("exec").display()))
            .arg(format!("--pidfile={}", dir.join("docker.pid").display()))
            .arg(format!("--bridge={bridge}"))
            // The host's firewall is not ours to change: containers only need to reach
            // the host on the bridge, which needs no NAT.
            .args(["--iptables=false", "--ip-masq=false", "--storage-driver=overlay2", "--exec-opt=native.cgroupdriver=cgroupfs"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("dockerd is not installed: run scripts/install-test-peers");
        let host = HostDocker { socket, bridge_ip, bridge, pid: child.id(), child: Mutex::new(Some(child)), dir, loaded: Mutex::new(HashSet::new()) };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !host.ping() {
            assert!(Instant::now() < deadline, "dockerd did not start:\n{}", host.log_tail(40));
            std::thread::sleep(Duration::from_millis(50));
        }
        host
    }

    fn ping(&self) -> bool {
        self.docker(&["version", "--format", "{{.Server.Version}}"]).status.success()
    }

    /// The last lines of dockerd's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(self.dir.join("dockerd.log")).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// `unix://…` for DOCKER_HOST and the controller's docker driver.
    pub fn url(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// Runs the docker CLI against this daemon.
    pub fn docker(&self, args: &[&str]) -> Output {
        Command::new("docker")
            .arg("-H")
            .arg(self.url())
            .args(args)
            .env("DOCKER_BUILDKIT", "0")
            .stdin(Stdio::null())
            .output()
            .expect("the docker CLI is missing: run scripts/install-test-peers")
    }

    /// The runner image of `variant`, built (cached) and loaded into this daemon once;
    /// returns its tag.
    pub fn image(&self, variant: &str) -> String {
        let (tag, tar) = crate::paths::image(variant);
        let mut loaded = self.loaded.lock().unwrap();
        if !loaded.contains(&tag) {
            let output = self.docker(&["load", "-i", &tar.display().to_string()]);
            assert!(output.status.success(), "docker load {}: {}", tar.display(), String::from_utf8_lossy(&output.stderr));
            loaded.insert(tag.clone());
        }
        tag
    }

    /// Names of the containers (running or not) with `label`.
    pub fn containers(&self, label: &str) -> Vec<String> {
        let output = self.docker(&["ps", "-a", "--filter", &format!("label={label}"), "--format", "{{.Names}}"]);
        String::from_utf8_lossy(&output.stdout).lines().map(str::to_owned).filter(|l| !l.is_empty()).collect()
    }

    /// The data directory (for checks of what environments leave behind).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl crate::SharedPeer for HostDocker {
    fn stop(&self) {
        let _ = run("kill", &["-TERM", &self.pid.to_string()]);
        let deadline = Instant::now() + Duration::from_secs(15);
        while Path::new(&format!("/proc/{}", self.pid)).exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = run("kill", &["-KILL", &self.pid.to_string()]);
        if let Some(mut child) = self.child.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take() {
            let _ = child.wait();
        }
        let _ = run("ip", &["link", "del", &self.bridge]);
        // dockerd leaves its netns and overlay mounts behind after a stop.
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let dir = self.dir.display().to_string();
        let mut ours: Vec<&str> = mounts.lines().filter_map(|l| l.split(' ').nth(4)).filter(|m| m.starts_with(&dir)).collect();
        ours.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for mount in ours {
            let _ = run("umount", &["-l", mount]);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
