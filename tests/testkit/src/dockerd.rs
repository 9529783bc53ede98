//! A REAL dockerd (Debian's) for tests, with its own data root, exec root and socket
//! in a directory of its own, stopped — and its directory unmounted and removed — when it
//! is dropped or [`Dockerd::stop`]ped, whichever comes first. Two network set-ups:
//!
//! - [`Network::Private`]: its own network namespace (loopback up, no bridge to the host)
//!   and the vfs storage driver, which needs no loop device or overlay support — one per
//!   test, for the driver tests that only need containers to exist.
//! - [`Network::Bridge`]: in the host's namespace on a bridge the caller made, overlay2,
//!   no iptables or NAT changes (the host's firewall is not the tests' to change) — the
//!   e2e tests' Docker host, whose containers reach the host on the bridge's address.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::Mutex,
    time::Duration,
};

#[derive(Debug, Clone)]
pub enum Network {
    Private,
    /// The name of an existing Linux bridge.
    Bridge(String),
}

#[derive(Debug)]
pub struct Dockerd {
    pub socket: PathBuf,
    dir: PathBuf,
    pid: u32,
    child: Mutex<Option<Child>>,
}

impl Dockerd {
    /// Starts dockerd and waits (up to 60 s) until it answers; panics with its log if not.
    pub fn start(network: Network) -> Dockerd {
        let dir = tempfile::Builder::new().prefix("gdr-test-dockerd-").tempdir_in("/tmp").unwrap().keep();
        let socket = dir.join("docker.sock");
        let mut command = match &network {
            // Loopback up: a published port (opensandbox-server publishes sandbox ports
            // on 127.0.0.1) needs it, and a new network namespace starts with it down.
            Network::Private => {
                let mut command = Command::new("unshare");
                command.args(["--net", "sh", "-c", "ip link set lo up && exec dockerd \"$@\"", "dockerd", "--storage-driver=vfs"]);
                command
            }
            Network::Bridge(bridge) => {
                let mut command = Command::new("dockerd");
                // Containers get a resolver that refuses at once: no DNS server answers them
                // on this machine, and each name a job's dockerd looks up before it pulls
                // through the mirror (Docker Hub's) waited ~10 s for the sandbox's
                // unreachable one (a `container:` job's pull: 13.3 s, then 2.9 s with this).
                command.arg(format!("--bridge={bridge}")).args(["--iptables=false", "--ip-masq=false", "--storage-driver=overlay2", "--dns=127.0.0.1"]);
                command
            }
        };
        let child = command
            .arg(format!("--host=unix://{}", socket.display()))
            .arg(format!("--data-root={}", dir.join("data").display()))
            .arg(format!("--exec-root={}", dir.join("exec").display()))
            .arg(format!("--pidfile={}", dir.join("docker.pid").display()))
            .arg("--exec-opt=native.cgroupdriver=cgroupfs")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("dockerd.log")).unwrap())
            .spawn()
            .expect("dockerd is not installed: run scripts/install test-peers");
        let dockerd = Dockerd { socket, dir, pid: child.id(), child: Mutex::new(Some(child)) };
        crate::poll_blocking(Duration::from_secs(60), || if dockerd.ping() { Ok(()) } else { Err(()) })
            .unwrap_or_else(|()| panic!("dockerd ({network:?}) did not answer within 60 s:\n{}", dockerd.log_tail(40)));
        dockerd
    }

    /// `GET /_ping` on the socket.
    pub fn ping(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut stream) = std::os::unix::net::UnixStream::connect(&self.socket) else { return false };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = stream.write_all(b"GET /_ping HTTP/1.0\r\n\r\n");
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer);
        answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200")
    }

    /// `unix://…`, for DOCKER_HOST and the controller's docker driver.
    pub fn url(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// The docker CLI with this daemon as its host.
    pub fn cli(&self) -> Command {
        let mut command = Command::new("docker");
        command.env("DOCKER_HOST", self.url()).env("DOCKER_BUILDKIT", "0").stdin(Stdio::null());
        command
    }

    /// Runs the docker CLI against this daemon.
    pub fn docker(&self, args: &[&str]) -> Output {
        self.cli().args(args).output().expect("the docker CLI is missing: run scripts/install test-peers")
    }

    /// Names of the containers (running or not) with `label`.
    pub fn containers(&self, label: &str) -> Vec<String> {
        let output = self.docker(&["ps", "-a", "--filter", &format!("label={label}"), "--format", "{{.Names}}"]);
        String::from_utf8_lossy(&output.stdout).lines().map(str::to_owned).filter(|l| !l.is_empty()).collect()
    }

    /// The last lines of dockerd's log.
    pub fn log_tail(&self, lines: usize) -> String {
        crate::log_tail(&self.dir.join("dockerd.log"), lines).unwrap_or_default()
    }

    /// Its directory (data root and all), for checks of what containers leave behind.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// SIGTERM, up to 20 s to exit (it stops its containers first), then SIGKILL; then
    /// the mounts it leaves (its netns, overlay layers) are undone and its directory
    /// removed. Once; later calls do nothing.
    pub fn stop(&self) {
        let Some(mut child) = self.child.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take() else { return };
        // `unshare` execs dockerd, so this is dockerd's own pid in either set-up.
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(i32::try_from(self.pid).unwrap_or(i32::MAX)), nix::sys::signal::Signal::SIGTERM);
        // Our child stays in /proc as a zombie until reaped: ask it, not /proc.
        let _ = crate::poll_blocking(Duration::from_secs(20), || child.try_wait().ok().flatten().ok_or(()));
        let _ = child.kill();
        let _ = child.wait();
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let dir = self.dir.display().to_string();
        let mut ours: Vec<&str> = mounts.lines().filter_map(|l| l.split(' ').nth(4)).filter(|m| m.starts_with(&dir)).collect();
        ours.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for mount in ours {
            let _ = nix::mount::umount2(mount, nix::mount::MntFlags::MNT_DETACH);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        self.stop();
    }
}
