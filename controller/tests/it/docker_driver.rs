//! The docker driver against a real dockerd (Debian's, started here in a private
//! network namespace with the vfs storage driver so it needs no loop devices): one
//! container per assignment with the environment contract and recovery labels,
//! creation idempotent by assignment id, listing by labels, removal once terminal, and
//! the host's address in the containers' network.
//! Uses the explicit capability list, because `--privileged` is refused on these hosts.

use std::{collections::BTreeMap, process::Command};

use crate::common::dockerd::{Dockerd, dockerd, import_image};
use controller::{
    assignment::Placement,
    driver::{
        self, Driver, EnvironmentSpec, Phase,
        docker::{DockerConfig, DockerDriver},
    },
};

fn spec(assignment_id: &str, facade_dir: &std::path::Path) -> EnvironmentSpec {
    EnvironmentSpec {
        assignment_id: assignment_id.to_owned(),
        name: driver::environment_name("test", assignment_id),
        labels: driver::labels_for("test", assignment_id, Placement::CONTAINER_DOCKER),
        env: BTreeMap::from([
            ("CI_ASSIGNMENT_ID".to_owned(), assignment_id.to_owned()),
            ("CI_RUNNER_CAPABILITY_FILE".to_owned(), "/run/gitea-dynamic-runner/capability".to_owned()),
            ("CI_RUNNER_FACADE_URL".to_owned(), "unix:///run/gitea-dynamic-runner/facade.sock".to_owned()),
        ]),
        facade_dir: Some(driver::FacadeDir { host: facade_dir.join(assignment_id), capability: "v1.capability".into() }),
    }
}

fn inspect(docker: &Dockerd, name: &str, format: &str) -> String {
    let output =
        Command::new("docker").env("DOCKER_HOST", format!("unix://{}", docker.socket.display())).args(["inspect", "--format", format, name]).output().unwrap();
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_container_per_assignment_idempotent_listed_and_removed() {
    let docker = dockerd();
    import_image(&docker, "gdr-runner:test");
    let facade_dir = tempfile::tempdir().unwrap();
    let facade_dir = facade_dir.path();
    std::fs::create_dir_all(facade_dir.join("gitea-task-7")).unwrap();
    std::fs::create_dir_all(facade_dir.join("gitea-task-8")).unwrap();
    let mut config = DockerConfig::unprivileged_loop_capable("gdr-runner:test");
    config.socket = docker.socket.display().to_string();
    config.stop_seconds = 1;
    config.memory = "512M".into();
    config.cpus = "0.5".into();
    config.pids_limit = 300;
    let driver = DockerDriver::connect(config).await.unwrap();

    let first = driver.create(&spec("gitea-task-7", facade_dir)).await.unwrap();
    let again = driver.create(&spec("gitea-task-7", facade_dir)).await.unwrap();
    assert_eq!(first, again);
    assert_eq!(first.phase, Phase::Running);
    assert_eq!(first.assignment_id, "gitea-task-7");
    let name = &first.name;
    let env = inspect(&docker, name, "{{json .Config.Env}}");
    assert!(env.contains("CI_ASSIGNMENT_ID=gitea-task-7") && env.contains("SUPERVISOR_STORAGE_SIZE=10G"), "{env}");
    assert!(!env.contains("v1.capability"), "the capability is in the container's configuration: {env}");
    assert_eq!(inspect(&docker, name, "{{.HostConfig.Privileged}}"), "false");
    assert!(inspect(&docker, name, "{{json .HostConfig.DeviceCgroupRules}}").contains("c 10:237 rmw"));
    let own = format!("{}:/run/gitea-dynamic-runner", facade_dir.join("gitea-task-7").display());
    assert_eq!(inspect(&docker, name, "{{json .HostConfig.Binds}}"), format!("[\"{own}\"]"), "only its own facade directory is mounted");
    let limits = inspect(&docker, name, "{{.HostConfig.Memory}} {{.HostConfig.MemorySwap}} {{.HostConfig.NanoCpus}} {{.HostConfig.PidsLimit}}");
    assert_eq!(limits, "536870912 536870912 500000000 300");

    // This dockerd made its default bridge itself, as on a machine's first start, so the
    // network reports a subnet and no gateway: the host's address must still be the one
    // Docker gives the container as its gateway (run-local serves the repository there).
    let gateway = inspect(&docker, name, "{{.NetworkSettings.Gateway}}");
    assert!(!gateway.is_empty(), "the container has no gateway on the default bridge");
    assert_eq!(driver.host_address().await.unwrap().to_string(), gateway);

    driver.create(&spec("gitea-task-8", facade_dir)).await.unwrap();
    let selector = BTreeMap::from([(driver::LABEL_PLACEMENT.to_owned(), "container.docker".to_owned())]);
    let mut listed: Vec<String> = driver.list(&selector).await.unwrap().into_iter().map(|e| e.assignment_id).collect();
    listed.sort();
    assert_eq!(listed, ["gitea-task-7", "gitea-task-8"], "exactly one container per assignment");

    driver.stop(name).await.unwrap();
    assert_eq!(driver.get(name).await.unwrap(), None, "a terminal container was not removed");
    driver.delete(name).await.unwrap();
    driver.delete(&driver::environment_name("test", "gitea-task-8")).await.unwrap();
    assert!(driver.list(&selector).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_image_is_a_clear_refusal() {
    let docker = dockerd();
    let mut config = DockerConfig::unprivileged_loop_capable("gdr-runner:absent");
    config.socket = docker.socket.display().to_string();
    let driver = DockerDriver::connect(config).await.unwrap();
    let error = driver.create(&spec("gitea-task-9", std::path::Path::new("/nonexistent"))).await.unwrap_err();
    assert!(error.to_string().contains("gdr-runner:absent"), "{error}");
}

#[tokio::test]
async fn a_missing_socket_is_named() {
    let mut config = DockerConfig::unprivileged_loop_capable("x");
    config.socket = "/nonexistent/docker.sock".into();
    let error = DockerDriver::connect(config).await.unwrap_err();
    assert!(error.to_string().contains("/nonexistent/docker.sock"), "{error}");
}

/// A rootless environment: the default mode's capabilities, the operator's seccomp profile
/// opened for the namespace calls, /proc unmasked, the tun device, an anonymous volume for
/// the images (removed with the container), no `no-new-privileges`, the mirrors passed on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rootless_environment_is_made_as_documented() {
    let docker = dockerd();
    import_image(&docker, "gdr-runner:test");
    let facade_dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(facade_dir.path().join("gitea-task-5")).unwrap();
    let mut config = DockerConfig::rootless("gdr-runner:test");
    config.socket = docker.socket.display().to_string();
    config.stop_seconds = 1;
    config.registry_mirrors = vec!["http://10.0.0.1:5000".into()];
    let driver = DockerDriver::connect(config.clone()).await.unwrap();
    let name = driver.create(&spec("gitea-task-5", facade_dir.path())).await.unwrap().name;

    let env = inspect(&docker, &name, "{{json .Config.Env}}");
    for wanted in ["SUPERVISOR_DOCKER_ROOTLESS=true", "SUPERVISOR_DOCKER_SOCKET=/run/user/2000/docker.sock", "SUPERVISOR_REGISTRY_MIRRORS=http://10.0.0.1:5000"]
    {
        assert!(env.contains(wanted), "{wanted} missing: {env}");
    }
    assert!(!env.contains("SUPERVISOR_DOCKER=false") && !env.contains("SUPERVISOR_STORAGE_SIZE"), "{env}");
    assert_eq!(inspect(&docker, &name, "{{.HostConfig.Privileged}} {{json .HostConfig.CapAdd}}"), "false null");
    let dropped = inspect(&docker, &name, "{{json .HostConfig.CapDrop}}");
    assert!(dropped.contains("NET_RAW") && dropped.contains("MKNOD"), "{dropped}");
    let options = inspect(&docker, &name, "{{json .HostConfig.SecurityOpt}}");
    assert!(!options.contains("no-new-privileges") && options.contains("apparmor=unconfined"), "{options}");
    assert!(options.contains("gitea-dynamic-runner: a rootless dockerd"), "the profile is not the opened one: {}", &options[..options.len().min(300)]);
    assert_eq!(inspect(&docker, &name, "{{json .HostConfig.MaskedPaths}} {{json .HostConfig.ReadonlyPaths}}"), "[] []");
    assert_eq!(inspect(&docker, &name, "{{range .HostConfig.Devices}}{{.PathOnHost}} {{.CgroupPermissions}}{{end}}"), "/dev/net/tun rwm");
    let volume = inspect(&docker, &name, "{{range .Mounts}}{{if eq .Destination \"/var/lib/docker\"}}{{.Name}}{{end}}{{end}}");
    assert!(!volume.is_empty(), "no volume at /var/lib/docker");
    driver.stop(&name).await.unwrap();
    driver.delete(&name).await.unwrap();
    let volumes = Command::new("docker").env("DOCKER_HOST", format!("unix://{}", docker.socket.display())).args(["volume", "ls", "-q"]).output().unwrap();
    assert!(!String::from_utf8_lossy(&volumes.stdout).contains(&volume), "the image volume outlived its container");

    // Without the profile the placement does not start, and says which package has it.
    config.seccomp_profile = "/nonexistent/seccomp.json".into();
    let error = DockerDriver::connect(config).await.unwrap_err().to_string();
    assert!(error.contains("golang-github-containers-common") && error.contains("/nonexistent/seccomp.json"), "{error}");
}

/// `docker.runner_ids`: each container holds a runner uid of its own (label and
/// environment), a repeated create keeps it, none is handed out twice — not even by two
/// drivers (two controllers) on one host at the same moment —, a full range is a retryable
/// wait, and a removed container's uid is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_environment_holds_a_runner_uid_of_its_own_until_it_is_removed() {
    use controller::driver::docker::{LABEL_RUNNER_UID, ids::RunnerIds};
    let docker = dockerd();
    import_image(&docker, "gdr-runner:test");
    let facade_dir = tempfile::tempdir().unwrap();
    let facade_dir = facade_dir.path();
    for id in ["gitea-task-21", "gitea-task-22", "gitea-task-23"] {
        std::fs::create_dir_all(facade_dir.join(id)).unwrap();
    }
    let mut config = DockerConfig::unprivileged_loop_capable("gdr-runner:test");
    config.socket = docker.socket.display().to_string();
    config.stop_seconds = 1;
    config.memory = "512M".into();
    config.runner_ids = RunnerIds { first_uid: 5_000_000, count: 2, first_subordinate: 6_000_000 };
    let one = DockerDriver::connect(config.clone()).await.unwrap();
    let other = DockerDriver::connect(config).await.unwrap();
    let uid_of = |name: &str| inspect(&docker, name, &format!("{{{{index .Config.Labels \"{LABEL_RUNNER_UID}\"}}}}"));

    // Two controllers at once: each container ends up with a uid no other holds.
    let (first, second) = (spec("gitea-task-21", facade_dir), spec("gitea-task-22", facade_dir));
    let (a, b) = tokio::join!(one.create(&first), other.create(&second));
    let mut retried = 0;
    for (driver, created, id) in [(&one, a, "gitea-task-21"), (&other, b, "gitea-task-22")] {
        if let Err(error) = created {
            assert!(error.to_string().contains("taken at the same moment"), "{error}");
            retried += 1;
            driver.create(&spec(id, facade_dir)).await.unwrap();
        }
    }
    let names = ["gitea-task-21", "gitea-task-22"].map(|id| driver::environment_name("test", id));
    let mut uids = names.clone().map(|name| uid_of(&name));
    println!("uids {uids:?} (creates yielded and retried: {retried})");
    uids.sort();
    assert_eq!(uids, ["5000000", "5000001"]);
    let env = inspect(&docker, &names[0], "{{json .Config.Env}}");
    let uid = uid_of(&names[0]);
    let subordinate = 6_000_000 + (uid.parse::<u32>().unwrap() - 5_000_000) * 65_536;
    for expected in [format!("SUPERVISOR_RUNNER_UID={uid}"), format!("SUPERVISOR_RUNNER_GID={uid}"), format!("SUPERVISOR_SUBORDINATE_IDS={subordinate}:65536")]
    {
        assert!(env.contains(&expected), "{expected} not in {env}");
    }
    // Again: the same container, the same uid.
    one.create(&spec("gitea-task-21", facade_dir)).await.unwrap();
    assert_eq!(uid_of(&names[0]), uid);

    // All held: the next one waits (a retryable error that says why).
    let error = one.create(&spec("gitea-task-23", facade_dir)).await.unwrap_err();
    assert!(matches!(error, driver::DriverError::Waiting { .. }) && error.to_string().contains("every runner uid"), "{error}");
    // A removed container's uid is free again.
    one.delete(&names[0]).await.unwrap();
    one.create(&spec("gitea-task-23", facade_dir)).await.unwrap();
    assert_eq!(uid_of(&driver::environment_name("test", "gitea-task-23")), uid);
    for id in ["gitea-task-22", "gitea-task-23"] {
        one.delete(&driver::environment_name("test", id)).await.unwrap();
    }
}
