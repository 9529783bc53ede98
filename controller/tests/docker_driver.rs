//! The docker driver against a real dockerd (Debian's, started here in a private
//! network namespace with the vfs storage driver so it needs no loop devices): one
//! container per assignment with the environment contract and recovery labels,
//! creation idempotent by assignment id, listing by labels, removal once terminal.
//! Uses the explicit capability list, because `--privileged` is refused on these hosts.

#![allow(clippy::unwrap_used)]

use std::{
    collections::BTreeMap,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use controller::{
    driver::{self, Driver, EnvironmentSpec, Phase, docker::{DockerConfig, DockerDriver}},
    placement::Placement,
};

struct Dockerd {
    child: Child,
    socket: std::path::PathBuf,
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

fn dockerd() -> Dockerd {
    let dir = tempfile::Builder::new().prefix("gdr-dockerd-").tempdir_in("/tmp").unwrap();
    let d = dir.path();
    let socket = d.join("docker.sock");
    let child = Command::new("unshare")
        .args(["--net", "dockerd"])
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
fn import_image(docker: &Dockerd) {
    let dir = tempfile::tempdir().unwrap();
    let rootfs = dir.path().join("rootfs");
    std::fs::create_dir_all(rootfs.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", rootfs.join("bin/busybox")).expect("busybox-static is not installed: run scripts/install-test-peers");
    for applet in ["sh", "sleep"] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
    }
    let mut tar = Command::new("tar").arg("-C").arg(&rootfs).args(["-c", "."]).stdout(Stdio::piped()).spawn().unwrap();
    let status = Command::new("docker")
        .env("DOCKER_HOST", format!("unix://{}", docker.socket.display()))
        .args(["import", "--change", r#"ENTRYPOINT ["/bin/sleep", "3600"]"#, "-", "gdr-runner:test"])
        .stdin(tar.stdout.take().unwrap())
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    assert!(tar.wait().unwrap().success());
}

fn spec(assignment_id: &str, facade_socket: &str) -> EnvironmentSpec {
    EnvironmentSpec {
        assignment_id: assignment_id.to_owned(),
        name: driver::environment_name(assignment_id),
        labels: driver::labels_for(assignment_id, Placement::CONTAINER_DOCKER),
        env: BTreeMap::from([
            ("CI_ASSIGNMENT_ID".to_owned(), assignment_id.to_owned()),
            ("CI_RUNNER_CAPABILITY".to_owned(), "v1.capability".to_owned()),
            ("CI_RUNNER_FACADE_URL".to_owned(), format!("unix://{facade_socket}")),
        ]),
    }
}

fn inspect(docker: &Dockerd, name: &str, format: &str) -> String {
    let output = Command::new("docker")
        .env("DOCKER_HOST", format!("unix://{}", docker.socket.display()))
        .args(["inspect", "--format", format, name])
        .output()
        .unwrap();
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_container_per_assignment_idempotent_listed_and_removed() {
    let docker = dockerd();
    import_image(&docker);
    let facade_dir = tempfile::tempdir().unwrap();
    let facade_socket = facade_dir.path().join("facade.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&facade_socket).unwrap();
    let facade_socket = facade_socket.display().to_string();
    let mut config = DockerConfig::unprivileged_loop_capable("gdr-runner:test");
    config.socket = docker.socket.display().to_string();
    config.facade_socket = Some(facade_socket.clone());
    config.stop_seconds = 1;
    let driver = DockerDriver::connect(config).await.unwrap();

    let first = driver.create(&spec("gitea-task-7", &facade_socket)).await.unwrap();
    let again = driver.create(&spec("gitea-task-7", &facade_socket)).await.unwrap();
    assert_eq!(first, again);
    assert_eq!(first.phase, Phase::Running);
    assert_eq!(first.assignment_id, "gitea-task-7");
    let name = &first.name;
    let env = inspect(&docker, name, "{{json .Config.Env}}");
    assert!(env.contains("CI_ASSIGNMENT_ID=gitea-task-7") && env.contains("CI_RUNNER_CAPABILITY=v1.capability"), "{env}");
    assert_eq!(inspect(&docker, name, "{{.HostConfig.Privileged}}"), "false");
    assert!(inspect(&docker, name, "{{json .HostConfig.DeviceCgroupRules}}").contains("c 10:237 rmw"));
    assert!(inspect(&docker, name, "{{json .HostConfig.Binds}}").contains(&facade_socket));

    driver.create(&spec("gitea-task-8", &facade_socket)).await.unwrap();
    let selector = BTreeMap::from([(driver::LABEL_PLACEMENT.to_owned(), "container.docker".to_owned())]);
    let mut listed: Vec<String> = driver.list(&selector).await.unwrap().into_iter().map(|e| e.assignment_id).collect();
    listed.sort();
    assert_eq!(listed, ["gitea-task-7", "gitea-task-8"], "exactly one container per assignment");

    driver.mark_terminal(name).await.unwrap();
    assert_eq!(driver.get(name).await.unwrap(), None, "a terminal container was not removed");
    driver.delete(name).await.unwrap();
    driver.delete(&driver::environment_name("gitea-task-8")).await.unwrap();
    assert!(driver.list(&selector).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_image_is_a_clear_refusal() {
    let docker = dockerd();
    let mut config = DockerConfig::unprivileged_loop_capable("gdr-runner:absent");
    config.socket = docker.socket.display().to_string();
    let driver = DockerDriver::connect(config).await.unwrap();
    let error = driver.create(&spec("gitea-task-9", "/nonexistent")).await.unwrap_err();
    assert!(error.to_string().contains("gdr-runner:absent"), "{error}");
}

#[tokio::test]
async fn a_missing_socket_is_named() {
    let mut config = DockerConfig::unprivileged_loop_capable("x");
    config.socket = "/nonexistent/docker.sock".into();
    let error = DockerDriver::connect(config).await.unwrap_err();
    assert!(error.to_string().contains("/nonexistent/docker.sock"), "{error}");
}
