//! The OpenSandbox driver against the real opensandbox-server (PyPI, Docker runtime) on
//! a real dockerd: one sandbox per assignment with the environment contract and recovery
//! metadata, creation idempotent by assignment (also after the server restarted), the
//! server's reason when a sandbox ends on its own, and the server's errors — a wrong API
//! key, a request it validates away, the server down — told apart and named.

#![allow(clippy::unwrap_used)]

mod common;

use std::{collections::BTreeMap, time::Duration};

use common::dockerd::{Dockerd, dockerd, import_image};
use controller::{
    assignment::Placement,
    driver::{
        self, Driver, DriverError, EnvironmentSpec, Phase,
        opensandbox::{OpenSandboxConfig, OpenSandboxDriver},
    },
};
use testkit::opensandbox::OpenSandbox;

const IMAGE: &str = "gdr-sandbox:test";

fn spec(assignment_id: &str) -> EnvironmentSpec {
    EnvironmentSpec {
        assignment_id: assignment_id.to_owned(),
        name: driver::environment_name("test", assignment_id),
        labels: driver::labels_for("test", assignment_id, Placement::VM_OPENSANDBOX),
        env: BTreeMap::from([
            ("CI_ASSIGNMENT_ID".to_owned(), assignment_id.to_owned()),
            ("CI_RUNNER_CAPABILITY".to_owned(), "v1.capability".to_owned()),
            ("CI_RUNNER_FACADE_URL".to_owned(), "http://10.0.0.1:9444".to_owned()),
        ]),
    }
}

/// A dockerd with the stand-in image, and the real server on it.
fn stack() -> (Dockerd, OpenSandbox) {
    let docker = dockerd();
    import_image(&docker, IMAGE);
    let server = OpenSandbox::start(&format!("unix://{}", docker.socket.display()), IMAGE);
    (docker, server)
}

fn config(server: &OpenSandbox, entrypoint: &[&str]) -> OpenSandboxConfig {
    let mut config: OpenSandboxConfig = toml::from_str(&format!(
        "url = \"{}\"\napi_key_file = \"{}\"\nimage = \"{IMAGE}\"\ncpu = \"500m\"\nmemory = \"128Mi\"\ntimeout = \"10m\"\n",
        server.url(),
        server.api_key_file().display()
    ))
    .unwrap();
    config.entrypoint = entrypoint.iter().map(|s| (*s).to_owned()).collect();
    config.env.insert("SUPERVISOR_DOCKER".into(), "false".into());
    config
}

/// Containers of this dockerd carrying `label`.
fn containers(docker: &Dockerd, label: &str) -> Vec<String> {
    let output = docker.cli().args(["ps", "-a", "--filter", &format!("label={label}"), "--format", "{{.Names}}"]).output().unwrap();
    String::from_utf8_lossy(&output.stdout).lines().map(str::to_owned).collect()
}

fn env_of(docker: &Dockerd, container: &str) -> String {
    let output = docker.cli().args(["inspect", "--format", "{{json .Config.Env}}", container]).output().unwrap();
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sandbox_per_assignment_idempotent_listed_and_deleted() {
    let (docker, mut server) = stack();
    let driver = OpenSandboxDriver::connect(config(&server, &["/bin/sleep", "3600"])).await.unwrap();
    let label = format!("{}=gitea-task-7", driver::LABEL_ASSIGNMENT);

    let first = driver.create(&spec("gitea-task-7")).await.unwrap();
    assert_eq!(first.phase, Phase::Running, "{first:?}");
    assert_eq!((first.name.as_str(), first.assignment_id.as_str()), (driver::environment_name("test", "gitea-task-7").as_str(), "gitea-task-7"));
    let again = driver.create(&spec("gitea-task-7")).await.unwrap();
    assert_eq!(first, again);
    let made = containers(&docker, &label);
    assert_eq!(made.len(), 1, "exactly one sandbox for the assignment: {made:?}");
    let env = env_of(&docker, &made[0]);
    for expected in
        ["CI_ASSIGNMENT_ID=gitea-task-7", "CI_RUNNER_CAPABILITY=v1.capability", "CI_RUNNER_FACADE_URL=http://10.0.0.1:9444", "SUPERVISOR_DOCKER=false"]
    {
        assert!(env.contains(expected), "{expected} missing from the sandbox's env: {env}");
    }

    // The server restarted (its store kept): a repeated create still finds the first.
    tokio::task::block_in_place(|| server.restart());
    let after_restart = driver.create(&spec("gitea-task-7")).await.unwrap();
    assert_eq!(after_restart, first);
    assert_eq!(containers(&docker, &label).len(), 1);

    driver.create(&spec("gitea-task-8")).await.unwrap();
    let selector = driver::selector("test", Placement::VM_OPENSANDBOX);
    let mut listed: Vec<String> = driver.list(&selector).await.unwrap().into_iter().map(|e| e.assignment_id).collect();
    listed.sort();
    assert_eq!(listed, ["gitea-task-7", "gitea-task-8"]);
    assert!(driver.list(&driver::selector("other", Placement::VM_OPENSANDBOX)).await.unwrap().is_empty(), "another installation's listing");

    driver.stop(&first.name).await.unwrap();
    assert_eq!(driver.get(&first.name).await.unwrap(), None);
    assert!(containers(&docker, &label).is_empty(), "the sandbox's container is left");
    driver.delete(&first.name).await.unwrap();
    driver.delete(&driver::environment_name("test", "gitea-task-8")).await.unwrap();
    assert!(driver.list(&selector).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_that_ends_on_its_own_carries_the_servers_reason() {
    let (_docker, server) = stack();
    let driver = OpenSandboxDriver::connect(config(&server, &["/bin/sh", "-c", "exit 3"])).await.unwrap();
    let name = driver.create(&spec("gitea-task-3")).await.unwrap().name;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let ended = loop {
        let environment = driver.get(&name).await.unwrap().expect("the sandbox is listed until deleted");
        if environment.phase != Phase::Running {
            break environment;
        }
        assert!(tokio::time::Instant::now() < deadline, "still running: {environment:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(ended.phase, Phase::Exited);
    assert!(ended.detail.contains("Failed") && ended.detail.contains("exited with code 3"), "{}", ended.detail);
    driver.delete(&name).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_named_and_classified() {
    let (docker, mut server) = stack();

    // A wrong key: retryable (the operator replaces the file), and the file is read again.
    let key_dir = tempfile::tempdir().unwrap();
    let key_file = key_dir.path().join("key");
    std::fs::write(&key_file, "not-the-key").unwrap();
    let mut wrong = config(&server, &["/bin/sleep", "3600"]);
    wrong.api_key_file = key_file.clone();
    let driver = OpenSandboxDriver::connect(wrong).await.unwrap();
    let error = driver.create(&spec("gitea-task-20")).await.unwrap_err();
    assert!(matches!(error, DriverError::Unavailable { .. }), "{error:?}");
    let text = error.to_string();
    assert!(text.contains("401") && text.contains("INVALID_API_KEY") && text.contains(&key_file.display().to_string()), "{text}");
    std::fs::write(&key_file, server.api_key()).unwrap();
    let name = driver.create(&spec("gitea-task-20")).await.unwrap().name;
    driver.delete(&name).await.unwrap();

    // A request the server validates away: a refusal (retrying cannot help), in its words.
    let mut invalid = config(&server, &["/bin/sleep", "3600"]);
    invalid.memory = "lots".into();
    let driver = OpenSandboxDriver::connect(invalid).await.unwrap();
    let error = driver.create(&spec("gitea-task-21")).await.unwrap_err();
    assert!(error.is_refusal(), "{error:?}");
    assert!(error.to_string().contains("memory"), "{error}");
    assert!(containers(&docker, &format!("{}=gitea-task-21", driver::LABEL_ASSIGNMENT)).is_empty());

    // The server down: retryable, and nothing is half-made when it is back.
    let driver = OpenSandboxDriver::connect(config(&server, &["/bin/sleep", "3600"])).await.unwrap();
    tokio::task::block_in_place(|| server.stop());
    let error = driver.create(&spec("gitea-task-22")).await.unwrap_err();
    assert!(matches!(error, DriverError::Unavailable { .. }), "{error:?}");
    assert!(error.to_string().contains(&server.url().replace("http://", "")), "the server's address is named: {error}");
    tokio::task::block_in_place(|| server.restart());
    let name = driver.create(&spec("gitea-task-22")).await.unwrap().name;
    assert_eq!(containers(&docker, &format!("{}=gitea-task-22", driver::LABEL_ASSIGNMENT)).len(), 1);
    driver.delete(&name).await.unwrap();

    // Not a Lifecycle API, or nothing there: connect says so.
    let mut nowhere = config(&server, &["/bin/sleep", "3600"]);
    nowhere.url = "http://127.0.0.1:9".into();
    let error = OpenSandboxDriver::connect(nowhere).await.unwrap_err();
    assert!(error.to_string().contains("does not answer"), "{error}");
}
