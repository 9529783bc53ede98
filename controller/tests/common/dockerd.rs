//! The driver tests' Docker: a private dockerd (testkit's, in its own network namespace,
//! one per test) and a busybox image that stands in for the runner image.

use std::process::Stdio;

pub use testkit::dockerd::Dockerd;

/// A private dockerd for one test, stopped when dropped.
pub fn dockerd() -> Dockerd {
    Dockerd::start(testkit::dockerd::Network::Private)
}

/// A busybox image whose ENTRYPOINT stands in for the supervisor (sleeps).
pub fn import_image(docker: &Dockerd, name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let rootfs = dir.path().join("rootfs");
    std::fs::create_dir_all(rootfs.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", rootfs.join("bin/busybox")).expect("busybox-static is not installed: run scripts/install test-peers");
    // `tail` too: opensandbox-server keeps its execd image's container alive with it.
    for applet in ["sh", "sleep", "tail"] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
    }
    let mut tar = std::process::Command::new("tar").arg("-C").arg(&rootfs).args(["-c", "."]).stdout(Stdio::piped()).spawn().unwrap();
    let status = docker
        .cli()
        .args(["import", "--change", r#"ENTRYPOINT ["/bin/sleep", "3600"]"#, "-", name])
        .stdin(tar.stdout.take().unwrap())
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    assert!(tar.wait().unwrap().success());
}
