//! A private dockerd for tests of the docker driver: Debian's dockerd in its own network
//! namespace with the vfs storage driver (no loop devices needed), its own data root and
//! socket, stopped on drop; and a busybox image that stands in for the runner image.

use std::{
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

impl Dockerd {
    /// `docker` with this daemon as its host.
    pub fn cli(&self) -> Command {
        let mut command = Command::new("docker");
        command.env("DOCKER_HOST", format!("unix://{}", self.socket.display()));
        command
    }
}

pub struct Dockerd {
    child: Child,
    pub socket: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        let _ = nix_term(self.child.id());
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if self.child.try_wait().unwrap().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn nix_term(pid: u32) -> std::io::Result<std::process::ExitStatus> {
    Command::new("kill").arg("-TERM").arg(pid.to_string()).status()
}

pub fn dockerd() -> Dockerd {
    let dir = tempfile::Builder::new().prefix("gdr-dockerd-").tempdir_in("/tmp").unwrap();
    let d = dir.path();
    let socket = d.join("docker.sock");
    // Loopback up: a published port (opensandbox-server publishes sandbox ports on
    // 127.0.0.1) needs it, and a new network namespace starts with it down.
    let child = Command::new("unshare")
        .args(["--net", "sh", "-c", "ip link set lo up && exec dockerd \"$@\"", "dockerd"])
        .arg(format!("--host=unix://{}", socket.display()))
        .arg(format!("--data-root={}", d.join("data").display()))
        .arg(format!("--exec-root={}", d.join("exec").display()))
        .arg(format!("--pidfile={}", d.join("docker.pid").display()))
        .args(["--storage-driver=vfs", "--exec-opt=native.cgroupdriver=cgroupfs"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(d.join("dockerd.log")).unwrap())
        .spawn()
        .expect("dockerd is not installed: run scripts/install-test-peers");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ping(&socket) {
        assert!(Instant::now() < deadline, "dockerd did not start: {}", std::fs::read_to_string(d.join("dockerd.log")).unwrap_or_default());
        std::thread::sleep(Duration::from_millis(20));
    }
    Dockerd { child, socket, _dir: dir }
}

fn ping(socket: &Path) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::os::unix::net::UnixStream::connect(socket) else { return false };
    let _ = stream.write_all(b"GET /_ping HTTP/1.0\r\n\r\n");
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200")
}

/// A busybox image whose ENTRYPOINT stands in for the supervisor (sleeps).
pub fn import_image(docker: &Dockerd, name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let rootfs = dir.path().join("rootfs");
    std::fs::create_dir_all(rootfs.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", rootfs.join("bin/busybox")).expect("busybox-static is not installed: run scripts/install-test-peers");
    // `tail` too: opensandbox-server keeps its execd image's container alive with it.
    for applet in ["sh", "sleep", "tail"] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
    }
    let mut tar = Command::new("tar").arg("-C").arg(&rootfs).args(["-c", "."]).stdout(Stdio::piped()).spawn().unwrap();
    let status = Command::new("docker")
        .env("DOCKER_HOST", format!("unix://{}", docker.socket.display()))
        .args(["import", "--change", r#"ENTRYPOINT ["/bin/sleep", "3600"]"#, "-", name])
        .stdin(tar.stdout.take().unwrap())
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    assert!(tar.wait().unwrap().success());
}
