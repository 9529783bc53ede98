//! The vm.opensandbox placement in the real controller process, against the real
//! opensandbox-server: the process is killed (SIGKILL, the `after-create` crash point of
//! the `test-driver` build) after the sandbox was made and before the record names it.
//! After a restart the pool is rebuilt from the server's listing, the queued assignment
//! finds the sandbox it already has (exactly one exists), the test — playing the
//! supervisor over the development-mode TCP facade — claims and finishes the task once,
//! and the sandbox is deleted. The sandbox's SPIRE entry (real SPIRE server) follows it:
//! made before the crash, exactly one after the restart, gone with the sandbox; an entry
//! left by an earlier crash is swept by the restarted controller.

use std::time::Duration;

use crate::common::{
    dockerd::{Dockerd, dockerd, import_image},
    fake_gitea::{FakeGitea, Job, REGISTRATION_TOKEN},
    pool_in_use,
};
use controller::store::{Records as _, jetstream::JetStream};
use proto::{
    facade::v1::{AssignmentCredential, ClaimRequest, UpdateTaskRequest, facade_service_client::FacadeServiceClient},
    runner::v1::{Result as TaskResult, TaskState, UpdateTaskRequest as RunnerUpdate},
};
use testkit::{controller_config::ControllerConfig, nats::NatsServer, opensandbox::OpenSandbox, process::ControllerProcess, spire::SpireServer};

const IMAGE: &str = "gdr-sandbox:test";

fn sandboxes(docker: &Dockerd) -> Vec<String> {
    let output = docker.cli().args(["ps", "-a", "--filter", "label=gitea-dynamic-runner/placement=vm.opensandbox", "--format", "{{.Names}}"]).output().unwrap();
    String::from_utf8_lossy(&output.stdout).lines().map(str::to_owned).collect()
}

fn env_var(docker: &Dockerd, container: &str, name: &str) -> String {
    let output = docker.cli().args(["inspect", "--format", "{{range .Config.Env}}{{println .}}{{end}}", container]).output().unwrap();
    let prefix = format!("{name}=");
    String::from_utf8_lossy(&output.stdout).lines().find_map(|l| l.strip_prefix(&prefix).map(str::to_owned)).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_create_and_record_keeps_exactly_one_sandbox() {
    let docker = dockerd();
    import_image(&docker, IMAGE);
    let server = tokio::task::block_in_place(|| OpenSandbox::start(&format!("unix://{}", docker.socket.display()), IMAGE));
    let nats = NatsServer::start();
    let spire = tokio::task::block_in_place(|| SpireServer::start("example.org"));
    let gitea = FakeGitea::start().await;
    gitea.add_job(Job::new(&["disposable", "vm"]));

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let facade = format!("127.0.0.1:{}", testkit::free_local_port());
    let metrics = format!("127.0.0.1:{}", testkit::free_local_port());
    let config = ControllerConfig::new(d, &gitea.url(), REGISTRATION_TOKEN)
        .set("gitea.installation", "crash")
        .set("gitea.reconcile_interval", "1s")
        .jetstream(&nats.url)
        .set("store.ack_wait", "2s")
        .unset("facade.environment_socket_dir")
        .set("facade.insecure_listen", facade.as_str())
        .set("facade.url", format!("http://{facade}"))
        .set("facade.environment_spiffe_endpoint_socket", "unix:///run/spire/agent.sock")
        .set("http.listen", metrics.as_str())
        .pool("vm.opensandbox", 2)
        .set("opensandbox.url", server.url())
        .set("opensandbox.api_key_file", server.api_key_file().display().to_string())
        .set("opensandbox.image", IMAGE)
        .set("opensandbox.entrypoint", vec!["/bin/sleep", "3600"])
        .set("opensandbox.cpu", "500m")
        .set("opensandbox.memory", "128Mi")
        .set("opensandbox.timeout", "10m")
        .set("opensandbox.spire.server_socket", spire.socket().display().to_string())
        .set("opensandbox.spire.parent_id", "spiffe://example.org/gdr/sandbox/{environment}")
        .set("opensandbox.spire.stale_after", "1s")
        .write("controller.toml");
    let controller = |crash_at: Option<&str>| {
        let log = d.join(format!("controller-{}.log", crash_at.unwrap_or("ok")));
        let process = ControllerProcess::new(env!("CARGO_BIN_EXE_controller"), &config, log);
        match crash_at {
            Some(point) => process.env("GDR_TEST_CRASH_AT", point),
            None => process,
        }
        .started()
    };
    let logs = || {
        ["controller-after-create.log", "controller-ok.log"]
            .iter()
            .map(|name| format!("--- {name}\n{}", std::fs::read_to_string(d.join(name)).unwrap_or_default()))
            .collect::<String>()
    };

    let mut crashing = controller(Some("after-create"));
    let status = testkit::poll(Duration::from_secs(60), || std::future::ready(crashing.exited().ok_or(())))
        .await
        .unwrap_or_else(|()| panic!("the controller did not reach after-create:\n{}", logs()));
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "{status}\n{}", logs());
    let made = sandboxes(&docker);
    assert_eq!(made.len(), 1, "the crash point comes after the sandbox was made: {made:?}");
    let id = env_var(&docker, &made[0], "CI_ASSIGNMENT_ID");
    let store = JetStream::connect(&nats.url, "ci.assignments", "ci-assignments", Duration::from_secs(2)).await.unwrap();
    let record = store.get(&id).await.unwrap().unwrap().value;
    assert_eq!(record.environment, None, "the record was written before the crash point");
    let entry_ids = || {
        let mut ids: Vec<String> = spire.entries().iter().map(|e| e["id"].as_str().unwrap().to_owned()).collect();
        ids.sort();
        ids
    };
    let instance = "crash";
    let environment = vec![controller::driver::environment_name(instance, &id)];
    assert_eq!(entry_ids(), environment, "the sandbox's entry is made before the sandbox");
    // What an earlier crash could have left: an entry whose sandbox never came.
    let orphan = controller::driver::environment_name(instance, "gitea-task-999");
    let registrar = controller::driver::spire::Registrar::new(
        toml::from_str(&format!("server_socket = \"{}\"\nparent_id = \"spiffe://example.org/x\"", spire.socket().display())).unwrap(),
        controller::assignment::Placement::VM_OPENSANDBOX,
        instance,
    );
    registrar.register(&orphan, "spiffe://example.org/ci/o/r/gone").await.unwrap();

    let _running = controller(None);
    // The pool is rebuilt from the server's listing, and the queued assignment adopts the
    // sandbox it already has.
    testkit::poll(Duration::from_secs(60), || async {
        let recorded = store.get(&id).await.unwrap().unwrap().value.environment;
        if recorded.is_some() && pool_in_use(&metrics).await == Some(1) { Ok(()) } else { Err(()) }
    })
    .await
    .unwrap_or_else(|()| panic!("no recorded environment or pool slot after the restart:\n{}", logs()));
    assert_eq!(sandboxes(&docker), made, "exactly the first sandbox, no second one");
    testkit::poll(Duration::from_secs(30), || std::future::ready(if entry_ids() == environment { Ok(()) } else { Err(entry_ids()) }))
        .await
        .unwrap_or_else(|left| panic!("entries after the restart: {left:?}, expected only {environment:?}:\n{}", logs()));

    // The supervisor's part, over the development-mode facade.
    let capability = env_var(&docker, &made[0], "CI_RUNNER_CAPABILITY");
    assert_eq!(env_var(&docker, &made[0], "CI_RUNNER_FACADE_URL"), format!("http://{facade}"));
    let mut client = FacadeServiceClient::connect(format!("http://{facade}")).await.unwrap();
    let credential = Some(AssignmentCredential { assignment_id: id.clone(), capability });
    let claimed = client.claim(ClaimRequest { credential: credential.clone(), holder: "sandbox-crash-holder-0123456789".into() }).await.unwrap().into_inner();
    let task = claimed.task.unwrap();
    // Reports carry the session the claim gave, not the environment's capability.
    let credential = Some(AssignmentCredential { assignment_id: id.clone(), capability: claimed.session });
    let done = RunnerUpdate {
        state: Some(TaskState { id: task.id, result: TaskResult::Success as i32, stopped_at: Some(prost_types::Timestamp::default()), ..Default::default() }),
        outputs: Default::default(),
    };
    client.update_task(UpdateTaskRequest { credential, request: Some(done) }).await.unwrap();
    gitea.with(|state| {
        assert_eq!(state.tasks.len(), 1);
        assert_eq!(state.tasks.values().next().unwrap().final_result, Some(TaskResult::Success as i32));
    });
    testkit::poll(Duration::from_secs(30), || std::future::ready(if sandboxes(&docker).is_empty() { Ok(()) } else { Err(()) }))
        .await
        .unwrap_or_else(|()| panic!("the finished task's sandbox was not deleted:\n{}", logs()));
    assert!(entry_ids().is_empty(), "the sandbox's entry outlived it: {:?}", entry_ids());
    drop(server);
}
