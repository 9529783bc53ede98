//! Storage and dockerd for real: the supervisor creates loop-backed ext4 for the data
//! root, starts a job-local dockerd (default bridge, in a private network namespace
//! so the host's networking is untouched), and the job runs `docker run` on an image
//! imported from busybox-static. Afterwards no mount, loop device or process is left.
//! Also the already-a-mountpoint path. Root only; one at a time, with the storage tests
//! (real loop devices: `common::loop_devices`).

#![allow(clippy::unwrap_used)]

use std::{fs, path::Path, process::Command, time::Duration};

use crate::common::*;

/// A busybox rootfs tarball the runner uid can read, for `docker import`.
fn busybox_tarball(dir: &Path) -> std::path::PathBuf {
    let rootfs = dir.join("rootfs");
    fs::create_dir_all(rootfs.join("bin")).unwrap();
    fs::copy("/bin/busybox", rootfs.join("bin/busybox")).expect("busybox-static is not installed: run scripts/install test-peers");
    // Relative links: `busybox --install -s` would point at this host path.
    let applets = Command::new("/bin/busybox").arg("--list").output().unwrap();
    for applet in String::from_utf8(applets.stdout).unwrap().lines().filter(|a| *a != "busybox") {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
    }
    let tarball = dir.join("busybox.tar");
    let status = Command::new("tar").arg("-C").arg(&rootfs).args(["-cf"]).arg(&tarball).arg(".").status().unwrap();
    assert!(status.success());
    tarball
}

struct Layout {
    args: Vec<String>,
    data_root: std::path::PathBuf,
    image: std::path::PathBuf,
}

fn layout(dir: &Path) -> Layout {
    let data_root = dir.join("docker");
    let image = dir.join("img/docker.img");
    let args = vec![
        "--docker=true".to_owned(),
        format!("--docker-data-root={}", data_root.display()),
        format!("--docker-exec-root={}", dir.join("exec").display()),
        format!("--docker-socket={}", dir.join("docker.sock").display()),
        format!("--docker-pidfile={}", dir.join("docker.pid").display()),
        format!("--dockerd-log={}", dir.join("dockerd.log").display()),
        format!("--storage-image={}", image.display()),
        "--storage-size=2G".to_owned(),
        "--drain-timeout=20s".to_owned(),
    ];
    Layout { args, data_root, image }
}

fn job(tarball: &Path, out: &Path) -> String {
    format!(
        "set -e; docker import {tar} bb:test >/dev/null; \
         docker run --rm bb:test sh -c 'echo hello-from-a-container; ls /' > {out}; \
         docker info --format '{{{{.Driver}}}} {{{{.DockerRootDir}}}}' >> {out}",
        tar = tarball.display(),
        out = out.display()
    )
}

fn mounted(path: &Path) -> bool {
    let path = path.to_str().unwrap();
    fs::read_to_string("/proc/self/mountinfo").unwrap().lines().any(|line| line.split(' ').nth(4) == Some(path))
}

fn loop_backed_by(image: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for entry in fs::read_dir("/sys/block").unwrap().flatten() {
        let name = entry.file_name().into_string().unwrap();
        if let Ok(backing) = fs::read_to_string(entry.path().join("loop/backing_file"))
            && backing.trim().starts_with(image.to_str().unwrap())
        {
            found.push(name);
        }
    }
    found
}

fn processes_mentioning(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in fs::read_dir("/proc").unwrap().flatten() {
        if entry.file_name().to_str().is_some_and(|n| n.parse::<u32>().is_ok())
            && let Ok(cmdline) = fs::read(entry.path().join("cmdline"))
        {
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if cmdline.contains(text) {
                found.push(cmdline);
            }
        }
    }
    found
}

fn supervisor_in_private_netns(state: &Path, extra: &[String], job: &str) -> Command {
    let inner = run_as_subreaper(state, &extra.iter().map(String::as_str).collect::<Vec<_>>(), job);
    let mut command = Command::new("unshare");
    command.arg("--net").arg(inner.get_program()).args(inner.get_args());
    command
}

#[test]
fn loop_backed_storage_dockerd_and_docker_run() {
    let _loop_devices = loop_devices();
    let dir = scratch();
    let tarball = busybox_tarball(dir.path());
    let out = dir.path().join("out");
    let layout = layout(dir.path());
    let output = supervisor_in_private_netns(&dir.path().join("state"), &layout.args, &job(&tarball, &out)).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{}\n{stderr}\ndockerd log:\n{}", output.status, fs::read_to_string(dir.path().join("dockerd.log")).unwrap_or_default());
    let seen = fs::read_to_string(&out).unwrap();
    assert!(seen.contains("hello-from-a-container"), "{seen}");
    assert!(seen.contains(&format!("overlay2 {}", layout.data_root.display())), "{seen}");
    assert!(stderr.contains("storage ready"), "{stderr}");

    // Nothing left behind.
    assert!(!mounted(&layout.data_root), "the data root is still mounted");
    assert_eq!(loop_backed_by(&layout.image), Vec::<String>::new(), "loop devices left attached");
    assert!(!layout.image.exists(), "the image file was not removed");
    let left = processes_mentioning(&dir.path().display().to_string());
    assert!(left.is_empty(), "processes left: {left:?}");
}

#[test]
fn an_existing_mountpoint_is_used_and_left_alone() {
    let _loop_devices = loop_devices();
    let dir = scratch();
    let tarball = busybox_tarball(dir.path());
    let out = dir.path().join("out");
    let layout = layout(dir.path());
    fs::create_dir_all(&layout.data_root).unwrap();
    let status = Command::new("mount").args(["-t", "tmpfs", "-o", "size=1g", "tmpfs"]).arg(&layout.data_root).status().unwrap();
    assert!(status.success());
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0).status();
        }
    }
    let _unmount = Unmount(&layout.data_root);

    let output = supervisor_in_private_netns(&dir.path().join("state"), &layout.args, &job(&tarball, &out)).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{}\n{stderr}", output.status);
    assert!(fs::read_to_string(&out).unwrap().contains("hello-from-a-container"));
    assert!(!layout.image.exists(), "an image was created although the data root was a mountpoint");
    assert!(mounted(&layout.data_root), "the supervisor unmounted a mount it did not create");
    assert_eq!(loop_backed_by(&layout.image), Vec::<String>::new());
}

#[test]
fn dockerd_that_cannot_start_fails_the_environment_with_its_log() {
    let _loop_devices = loop_devices();
    let dir = scratch();
    let layout = layout(dir.path());
    let mut args = layout.args.clone();
    // An unknown flag: dockerd exits at once.
    let fake = dir.path().join("dockerd");
    fs::write(&fake, "#!/bin/sh\necho 'dockerd: unknown flag --bogus' >&2\nexit 1\n").unwrap();
    std::os::unix::fs::PermissionsExt::set_mode(&mut fs::metadata(&fake).unwrap().permissions(), 0o755);
    fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    args.push(format!("--dockerd={}", fake.display()));
    let started = std::time::Instant::now();
    let output = supervisor_in_private_netns(&dir.path().join("state"), &args, "true").output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(72), "{stderr}");
    assert!(stderr.contains("unknown flag --bogus"), "the dockerd log tail is not in the error: {stderr}");
    assert!(started.elapsed() < Duration::from_secs(30));
    assert!(!mounted(&layout.data_root));
    assert_eq!(loop_backed_by(&layout.image), Vec::<String>::new());
}
