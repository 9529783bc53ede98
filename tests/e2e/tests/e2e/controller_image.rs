//! The controller image as an operator gets it: the tar of `scripts/build controller-image`
//! loads into a real dockerd, holds the static controller, run-local (the release's smoke
//! test runs a workflow with it), CA certificates and the user table and nothing else (no shell for a job or an intruder to use), runs as its non-root
//! user, carries its OCI labels, and says which file it could not read when started
//! without a configuration. Building it twice gives the same bytes. The `docker build`
//! context the script lays out (`--context`) builds, with no network, into the same
//! image: the same files, user, entrypoint, command, environment and labels.

use std::{collections::BTreeSet, process::Command};

use e2e::{docker::host, paths};

fn ok(output: &std::process::Output, what: &str) -> String {
    assert!(output.status.success(), "{what}: {}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_image_is_the_controller_alone_as_a_non_root_user() {
    let _turn = e2e::exclusive().await;
    let cache = tempfile::tempdir().unwrap();
    let (tag, tar) = paths::controller_image(Some(cache.path()));
    let bytes = std::fs::read(&tar).unwrap();
    let (again_tag, again_tar) = paths::controller_image(Some(cache.path()));
    assert_eq!((&again_tag, std::fs::read(&again_tar).unwrap() == bytes), (&tag, true), "a second build differs");
    let controller_size = std::fs::metadata(paths::static_controller()).unwrap().len();
    let run_local_size = std::fs::metadata(paths::static_run_local()).unwrap().len();
    eprintln!("controller image {tag}: {} bytes; controller binary {controller_size} bytes, run-local {run_local_size} bytes", bytes.len());
    assert!((bytes.len() as u64) < controller_size + run_local_size + 2 * 1024 * 1024, "the image is more than the controller, run-local and the certificates");

    let docker = host();
    ok(&docker.docker(&["load", "-i", &tar.display().to_string()]), "docker load");
    let config = ok(&docker.docker(&["image", "inspect", "--format", "{{.Config.User}}|{{json .Config.Labels}}", &tag]), "inspect");
    let (user, labels) = config.trim().split_once('|').unwrap();
    assert_eq!(user, "65532:65532");
    let labels: std::collections::BTreeMap<String, String> = serde_json::from_str(labels).unwrap();
    assert_eq!(labels["org.opencontainers.image.version"], env!("CARGO_PKG_VERSION"));
    let head = String::from_utf8(Command::new("git").arg("-C").arg(paths::repository()).args(["rev-parse", "HEAD"]).output().unwrap().stdout).unwrap();
    assert!(labels["org.opencontainers.image.revision"].starts_with(head.trim()), "{labels:?}");

    let version = ok(&docker.docker(&["run", "--rm", "--network", "none", &tag, "version"]), "controller version in the image");
    assert!(version.starts_with(&format!("controller {}", env!("CARGO_PKG_VERSION"))), "{version}");
    // As the image's user, not root.
    let unconfigured = docker.docker(&["run", "--rm", "--network", "none", &tag]);
    assert_eq!(unconfigured.status.code(), Some(64), "{unconfigured:?}");
    let said = String::from_utf8_lossy(&unconfigured.stderr);
    assert!(said.contains("cannot read /etc/gitea-dynamic-runner/controller.toml"), "{said}");

    let files = image_files(&tag, cache.path());
    assert_eq!(
        files,
        BTreeSet::from(
            ["etc/group", "etc/passwd", "etc/ssl/certs/ca-certificates.crt", "tmp/", "usr/local/bin/controller", "usr/local/bin/run-local"].map(String::from)
        )
    );
    let help = ok(&docker.docker(&["run", "--rm", "--network", "none", "--entrypoint", "/usr/local/bin/run-local", &tag, "--help"]), "run-local --help");
    assert!(help.contains("--workflow"), "{help}");

    // `docker build` of the script's context: the same image.
    let context = cache.path().join("context");
    paths::controller_image_with(Some(cache.path()), Some(&context));
    let built = format!("gdr-controller-built:{}", std::process::id());
    ok(&docker.docker(&["build", "--quiet", "--tag", &built, &context.display().to_string()]), "docker build of the context");
    let format = "{{.Config.User}}|{{json .Config.Entrypoint}}|{{json .Config.Cmd}}|{{json .Config.Env}}|{{json .Config.Labels}}|{{.Config.WorkingDir}}";
    let loaded_config = ok(&docker.docker(&["image", "inspect", "--format", format, &tag]), "inspect the loaded image");
    let built_config = ok(&docker.docker(&["image", "inspect", "--format", format, &built]), "inspect the built image");
    assert_eq!(built_config, loaded_config, "docker build made another configuration than the tar");
    assert_eq!(image_files(&built, cache.path()), files, "docker build made another filesystem than the tar");
    let version =
        ok(&docker.docker(&["run", "--rm", "--network", "none", "--entrypoint", "/usr/local/bin/controller", &built, "version"]), "the built image runs");
    assert!(version.starts_with("controller "), "{version}");
    let _ = docker.docker(&["image", "rm", &built]);
}

/// The files (and, ending in `/`, the empty directories) of `image`'s filesystem, without
/// what every container gets from the engine.
fn image_files(image: &str, scratch: &std::path::Path) -> BTreeSet<String> {
    let docker = host();
    let name = format!("gdr-controller-image-{}", std::process::id());
    ok(&docker.docker(&["create", "--name", &name, image]), "docker create");
    let exported = scratch.join("exported.tar");
    let export = docker.docker(&["export", "-o", &exported.display().to_string(), &name]);
    let _ = docker.docker(&["rm", "-f", &name]);
    ok(&export, "docker export");
    let listing = ok(&Command::new("tar").arg("-tvf").arg(&exported).output().unwrap(), "tar -tvf");
    let entries: Vec<(bool, &str)> =
        listing.lines().filter_map(|line| Some((line.starts_with('d'), line.split_whitespace().nth(5)?.trim_start_matches("./")))).collect();
    let is_parent = |dir: &str| entries.iter().any(|(_, path)| path.len() > dir.len() && path.starts_with(dir));
    entries
        .iter()
        .filter(|(directory, path)| !path.is_empty() && (!directory || !is_parent(path)))
        .map(|(_, path)| (*path).to_owned())
        // What every container gets from the engine, not from the image.
        .filter(|path| {
            ![".dockerenv", "etc/hostname", "etc/hosts", "etc/resolv.conf", "etc/mtab"].contains(&path.as_str())
                && !path.starts_with("dev/")
                && !path.starts_with("proc/")
                && !path.starts_with("sys/")
        })
        .collect()
}
