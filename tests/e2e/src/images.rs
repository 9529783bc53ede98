//! Job images pushed to a real registry that a job's dockerd pulls through as its
//! registry mirror (Docker Hub's `library/NAME`): made here from files of this host,
//! because nothing else can be downloaded.
//!
//! - [`push_busybox`]: busybox with every applet linked, `/www/index.html` and
//!   `/etc/gdr-image` saying what it is;
//! - [`push_build_image`]: the same plus what a build image such as `node:22` brings to a
//!   `container:` job — Node.js (the runner image's), git with its HTTP transport and GNU
//!   tar — each with the shared libraries it loads, so that `actions/checkout`,
//!   `actions/cache` and the artifact actions run in it as in `node:22`.

use std::{
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::Command,
};

use testkit::registry::Registry;

use crate::docker::host;

/// A busybox root in `root`: every applet in /bin, `/www/index.html` saying `greeting`,
/// `/etc/gdr-image` naming the image.
fn busybox_root(root: &Path, name: &str, greeting: &str) {
    for sub in ["bin", "www", "etc", "tmp", "root"] {
        std::fs::create_dir_all(root.join(sub)).unwrap();
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    let list = Command::new("/bin/busybox").arg("--list").output().unwrap();
    for applet in String::from_utf8_lossy(&list.stdout).lines().filter(|a| *a != "busybox") {
        symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    std::fs::write(root.join("www/index.html"), greeting).unwrap();
    std::fs::write(root.join("etc/gdr-image"), format!("{name} from the mirror\n")).unwrap();
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    std::fs::write(root.join("etc/group"), "root:x:0:\n").unwrap();
}

/// Imports `root` as `library/NAME` running `cmd` with `path`, pushes it to `registry`
/// and drops the local tag (a job's dockerd must pull it through its mirror).
fn push_root(registry: &Registry, root: &Path, name: &str, cmd: &str, path: &str) {
    let tag = format!("127.0.0.1:{}/library/{name}:latest", registry.port);
    let docker = host();
    let script = format!(
        "tar -C '{}' -c . | docker import -c 'CMD {cmd}' -c 'ENV PATH={path}' - '{tag}' >/dev/null && docker push -q '{tag}' >/dev/null",
        root.display()
    );
    let pushed = Command::new("sh").arg("-c").arg(&script).env("DOCKER_HOST", format!("unix://{}", docker.socket.display())).output().unwrap();
    assert!(pushed.status.success(), "pushing {tag}: {}", String::from_utf8_lossy(&pushed.stderr));
    docker.docker(&["rmi", &tag]);
}

/// A busybox image as `library/NAME` running `cmd`; `/www/index.html` says `greeting`.
pub fn push_busybox(registry: &Registry, name: &str, cmd: &str, greeting: &str) {
    let dir = tempfile::tempdir().unwrap();
    busybox_root(dir.path(), name, greeting);
    push_root(registry, dir.path(), name, cmd, "/bin");
}

/// A build image as `library/NAME`: busybox, the runner image `runner_image`'s Node.js,
/// git and GNU tar; its command serves `/www` on port 80 (busybox httpd) saying
/// `greeting`, so that one image is both a job container (whose command the runner
/// replaces) and a service.
pub fn push_build_image(registry: &Registry, runner_image: &str, name: &str, greeting: &str) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    busybox_root(root, name, greeting);
    let docker = host();
    let created = docker.docker(&["create", "--entrypoint", "/bin/true", runner_image]);
    assert!(created.status.success(), "docker create {runner_image}: {}", String::from_utf8_lossy(&created.stderr));
    let container = String::from_utf8_lossy(&created.stdout).trim().to_owned();
    std::fs::create_dir_all(root.join("usr/local/bin")).unwrap();
    let copied = docker.docker(&["cp", &format!("{container}:/usr/local/bin/node"), &root.join("usr/local/bin/node").display().to_string()]);
    docker.docker(&["rm", &container]);
    assert!(copied.status.success(), "copying node out of {runner_image}: {}", String::from_utf8_lossy(&copied.stderr));
    // git with every helper it runs (`git submodule` is a script there), its templates, and GNU tar.
    for tree in ["/usr/lib/git-core", "/usr/share/git-core"] {
        std::fs::create_dir_all(root.join(&tree[1..]).parent().unwrap()).unwrap();
        let copied = Command::new("cp").args(["-a", tree]).arg(root.join(&tree[1..])).output().unwrap();
        assert!(copied.status.success(), "cp -a {tree}: {}", String::from_utf8_lossy(&copied.stderr));
    }
    let mut programs = vec![PathBuf::from("/usr/bin/git"), PathBuf::from("/usr/bin/tar"), root.join("usr/local/bin/node")];
    programs.extend(std::fs::read_dir("/usr/lib/git-core").unwrap().map(|entry| entry.unwrap().path()));
    copy_file(Path::new("/usr/bin/git"), root);
    copy_file(Path::new("/usr/bin/tar"), root);
    // The dynamic loader and the libraries each loads (node was built against the same glibc).
    for program in programs {
        for library in libraries_of(&program) {
            copy_file(&library, root);
        }
    }
    push_root(registry, root, name, r#"["/bin/httpd", "-f", "-p", "80", "-h", "/www"]"#, "/usr/local/bin:/usr/bin:/bin");
}

/// The files `ldd` resolves for `program` (the loader included); none for a script.
fn libraries_of(program: &Path) -> Vec<PathBuf> {
    let output = Command::new("ldd").arg(program).output().unwrap();
    String::from_utf8_lossy(&output.stdout).lines().filter_map(|line| line.split_whitespace().find(|word| word.starts_with('/')).map(PathBuf::from)).collect()
}

/// Copies the file `path` (a link followed) to the same path under `root`.
fn copy_file(path: &Path, root: &Path) {
    let target = root.join(path.strip_prefix("/").unwrap());
    if target.exists() {
        return;
    }
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    std::fs::copy(path, &target).unwrap_or_else(|error| panic!("copying {} into the image: {error}", path.display()));
}
