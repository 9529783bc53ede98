//! The OpenSandbox driver against the real opensandbox-server (PyPI, Docker runtime) on
//! a real dockerd: one sandbox per assignment with the environment contract and recovery
//! metadata, creation idempotent by assignment (also after the server restarted), the
//! server's reason when a sandbox ends on its own, and the server's errors — a wrong API
//! key, a request it validates away, the server down — told apart and named; and each
//! sandbox's entry on the real SPIRE server, made and removed with it, swept when left.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use crate::common::dockerd::{Dockerd, dockerd, import_image};
use controller::driver::spire::{Registered, Registrar, SpireConfig};
use controller::{
    assignment::Placement,
    driver::{
        self, Driver, DriverError, EnvironmentSpec, Phase,
        opensandbox::{OpenSandboxConfig, OpenSandboxDriver},
    },
};
use testkit::{opensandbox::OpenSandbox, spire::SpireServer};

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
        ..EnvironmentSpec::default()
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
    config.env.insert(contract::environment::supervisor::DOCKER.into(), "false".into());
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
    let ended = testkit::poll(Duration::from_secs(30), || async {
        let environment = driver.get(&name).await.unwrap().expect("the sandbox is listed until deleted");
        if environment.phase == Phase::Running { Err(environment) } else { Ok(environment) }
    })
    .await
    .unwrap_or_else(|environment| panic!("still running after 30 s: {environment:?}"));
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

const TRUST_DOMAIN: &str = "example.org";

fn spiffe_spec(assignment_id: &str) -> EnvironmentSpec {
    let mut spec = spec(assignment_id);
    spec.env.insert("CI_SPIFFE_ID".into(), format!("spiffe://{TRUST_DOMAIN}/ci/owner/repo/{assignment_id}"));
    spec
}

fn registered(driver: OpenSandboxDriver, spire: &SpireServer, stale_after: &str) -> Registered {
    let config: SpireConfig = toml::from_str(&format!(
        "server_socket = \"{}\"\nparent_id = \"spiffe://{TRUST_DOMAIN}/gdr/sandbox/{{environment}}\"\nstale_after = \"{stale_after}\"\n",
        spire.socket().display()
    ))
    .unwrap();
    controller::setting::Problems::check(|problems| config.validate("opensandbox.spire", problems)).unwrap();
    Registered::new(Arc::new(driver), Registrar::new(config, Placement::VM_OPENSANDBOX, "test"))
}

/// The entry's `(spiffe_id, parent_id, selectors, hint)` as the SPIRE CLI shows it.
fn shown(entry: &serde_json::Value) -> (String, String, Vec<String>, String) {
    let id = |v: &serde_json::Value| format!("spiffe://{}{}", v["trust_domain"].as_str().unwrap(), v["path"].as_str().unwrap());
    let selectors =
        entry["selectors"].as_array().unwrap().iter().map(|s| format!("{}:{}", s["type"].as_str().unwrap(), s["value"].as_str().unwrap())).collect();
    (id(&entry["spiffe_id"]), id(&entry["parent_id"]), selectors, entry["hint"].as_str().unwrap_or_default().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_sandbox_gets_its_spire_entry_and_leaves_none_behind() {
    let (docker, server) = stack();
    let mut spire = tokio::task::block_in_place(|| SpireServer::start(TRUST_DOMAIN));
    let driver = registered(OpenSandboxDriver::connect(config(&server, &["/bin/sleep", "3600"])).await.unwrap(), &spire, "5m");

    // Registered with the sandbox: the job's exact ID, the sandbox's agent as parent.
    let first = driver.create(&spiffe_spec("gitea-task-30")).await.unwrap();
    let entry = spire.entry(&first.name).unwrap_or_else(|| panic!("no entry {}: {:?}", first.name, spire.entries()));
    assert_eq!(
        shown(&entry),
        (
            format!("spiffe://{TRUST_DOMAIN}/ci/owner/repo/gitea-task-30"),
            format!("spiffe://{TRUST_DOMAIN}/gdr/sandbox/{}", first.name),
            vec!["unix:uid:2000".to_owned()],
            "vm.opensandbox".to_owned()
        )
    );
    // A retried create (after a crash between create and record) finds both again.
    assert_eq!(driver.create(&spiffe_spec("gitea-task-30")).await.unwrap(), first);
    assert_eq!(spire.entries().len(), 1, "{:?}", spire.entries());
    assert_eq!(containers(&docker, &format!("{}=gitea-task-30", driver::LABEL_ASSIGNMENT)).len(), 1);

    // Deleted with its sandbox.
    driver.delete(&first.name).await.unwrap();
    assert!(spire.entry(&first.name).is_none(), "{:?}", spire.entries());

    // A sandbox the server refuses leaves no entry.
    let mut invalid = config(&server, &["/bin/sleep", "3600"]);
    invalid.memory = "lots".into();
    let refusing = registered(OpenSandboxDriver::connect(invalid).await.unwrap(), &spire, "5m");
    let error = refusing.create(&spiffe_spec("gitea-task-31")).await.unwrap_err();
    assert!(error.is_refusal(), "{error:?}");
    assert!(spire.entries().is_empty(), "{:?}", spire.entries());

    // Without SPIFFE (no identity to wait for) nothing is registered.
    let plain = driver.create(&spec("gitea-task-32")).await.unwrap();
    assert!(spire.entries().is_empty(), "{:?}", spire.entries());
    driver.delete(&plain.name).await.unwrap();

    // After a crash: an entry whose sandbox is gone is swept once it is old enough;
    // the live sandbox's entry and entries that are not ours stay.
    let live = driver.create(&spiffe_spec("gitea-task-33")).await.unwrap();
    let orphan = driver::environment_name("test", "gitea-task-34");
    let other = spire.cli(&[
        "entry",
        "create",
        "-parentID",
        "spiffe://example.org/node",
        "-spiffeID",
        "spiffe://example.org/someone-else",
        "-selector",
        "unix:uid:1000",
    ]);
    assert!(other.status.success(), "{}", String::from_utf8_lossy(&other.stderr));
    let sweeping = registered(OpenSandboxDriver::connect(config(&server, &["/bin/sleep", "3600"])).await.unwrap(), &spire, "1s");
    let fresh = registered(OpenSandboxDriver::connect(config(&server, &["/bin/sleep", "3600"])).await.unwrap(), &spire, "5m");
    let registrar = Registrar::new(
        toml::from_str(&format!("server_socket = \"{}\"\nparent_id = \"spiffe://{TRUST_DOMAIN}/gdr/sandbox/x\"\n", spire.socket().display())).unwrap(),
        Placement::VM_OPENSANDBOX,
        "test",
    );
    registrar.register(&orphan, "spiffe://example.org/ci/owner/repo/gone").await.unwrap();
    let listed = driver.list(&driver::selector("test", Placement::VM_OPENSANDBOX)).await.unwrap();
    assert_eq!(fresh.sweep_leftovers(&listed).await.unwrap(), 0, "a young entry may belong to a sandbox being created");
    // Entry ages have whole seconds: sweep until the orphan is old enough.
    testkit::poll(Duration::from_secs(10), || async { if sweeping.sweep_leftovers(&listed).await.unwrap() == 0 { Err(()) } else { Ok(()) } })
        .await
        .unwrap_or_else(|()| panic!("the orphan entry was never swept: {:?}", spire.entries()));
    let mut left: Vec<String> = spire.entries().iter().map(|e| shown(e).0).collect();
    left.sort();
    assert_eq!(left, ["spiffe://example.org/ci/owner/repo/gitea-task-33", "spiffe://example.org/someone-else"]);

    // SPIRE down: the sandbox is not created (its supervisor would wait for nothing),
    // and the error is one to retry, naming the socket.
    tokio::task::block_in_place(|| spire.stop());
    let error = driver.create(&spiffe_spec("gitea-task-35")).await.unwrap_err();
    assert!(matches!(error, DriverError::Unavailable { .. }), "{error:?}");
    assert!(error.to_string().contains(&spire.socket().display().to_string()), "{error}");
    assert!(containers(&docker, &format!("{}=gitea-task-35", driver::LABEL_ASSIGNMENT)).is_empty());
    // A sandbox is deleted even then; its entry waits for the next sweep.
    driver.delete(&live.name).await.unwrap();
    assert_eq!(driver.get(&live.name).await.unwrap(), None);
}
