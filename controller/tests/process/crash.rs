//! Crash safety with the real nats-server: the real controller process is killed
//! with SIGKILL (`kill -9`, at crash points of the `test-driver` build) between fetch
//! and persist, between persist and environment creation, and right after a claim;
//! it is restarted, and the test, playing each environment's supervisor on the
//! environment's own facade socket, claims and finishes every task. The fake Gitea
//! counts what happened to each task.

use testkit::{controller_config::ControllerConfig, nats, process::ControllerProcess};

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use crate::common::fake_gitea::{FakeGitea, Job, REGISTRATION_TOKEN};
use proto::{
    facade::v1::{AssignmentCredential, ClaimRequest, UpdateTaskRequest, facade_service_client::FacadeServiceClient},
    runner::v1::{Result as TaskResult, TaskState, UpdateTaskRequest as RunnerUpdate},
};

const HOLDER: &str = "crash-test-holder-0123456789";

struct Setup {
    dir: tempfile::TempDir,
    config: PathBuf,
    envs: PathBuf,
}

/// An environment the test driver holds, as its supervisor sees it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Env {
    assignment_id: String,
    /// What PID 1 reads from its facade directory.
    capability: String,
    creates: u64,
    /// Its own facade socket.
    socket: PathBuf,
}

fn setup(gitea: &FakeGitea, nats: &nats::NatsServer) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let config = ControllerConfig::new(d, &gitea.url(), REGISTRATION_TOKEN)
        .jetstream(&nats.url)
        .set("store.ack_wait", "2s")
        .pool("container.docker", 4)
        .set("docker.image", "unused-with-the-test-driver")
        .write("controller.toml");
    Setup { envs: d.join("envs"), dir, config }
}

/// The controller of `setup`, started; with `crash_at`, it dies at that crash point.
fn controller(setup: &Setup, crash_at: Option<&str>) -> ControllerProcess {
    let log = setup.dir.path().join(format!("controller-{}.log", crash_at.unwrap_or("ok")));
    let mut process = ControllerProcess::new(env!("CARGO_BIN_EXE_controller"), &setup.config, log).env("GDR_TEST_DRIVER_DIR", &setup.envs);
    if let Some(point) = crash_at {
        process = process.env("GDR_TEST_CRASH_AT", point);
    }
    process.started()
}

/// The environments the driver holds.
fn environments(dir: &Path) -> Vec<Env> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        if entry.path().extension().is_some_and(|e| e == "json") {
            let value: serde_json::Value = serde_json::from_slice(&std::fs::read(entry.path()).unwrap()).unwrap();
            let assignment_id = value["assignment_id"].as_str().unwrap().to_owned();
            let instance = value["labels"][controller::driver::LABEL_INSTANCE].as_str().unwrap();
            // Written before the environment was created.
            let own = dir.with_file_name("environments").join(controller::driver::environment_name(instance, &assignment_id));
            found.push(Env {
                capability: std::fs::read_to_string(own.join("capability")).unwrap(),
                creates: value["creates"].as_u64().unwrap(),
                socket: own.join("facade.sock"),
                assignment_id,
            });
        }
    }
    found.sort();
    found
}

async fn wait_for_environments(dir: &Path, n: usize, timeout: Duration) -> Vec<Env> {
    let outcome = testkit::poll(timeout, || {
        let found = environments(dir);
        std::future::ready(if found.len() >= n { Ok(found) } else { Err(found) })
    });
    outcome.await.unwrap_or_else(|found| {
        let logs: String = std::fs::read_dir(dir.parent().unwrap())
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".log"))
            .map(|e| format!("--- {}\n{}", e.path().display(), std::fs::read_to_string(e.path()).unwrap_or_default()))
            .collect();
        panic!("only {} of {n} environments after {timeout:?}: {found:?}\n{logs}", found.len())
    })
}

async fn facade(socket: &Path) -> FacadeServiceClient<tonic::transport::Channel> {
    let connected = testkit::poll(Duration::from_secs(10), || {
        let path = socket.to_owned();
        async move {
            tonic::transport::Endpoint::try_from("http://facade.local")
                .unwrap()
                .connect_with_connector(tower::service_fn(move |_| {
                    let path = path.clone();
                    async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
                }))
                .await
        }
    });
    FacadeServiceClient::new(connected.await.unwrap_or_else(|error| panic!("the facade socket {} never answered: {error}", socket.display())))
}

/// Plays the supervisor of one environment on its own socket: claim, then report success.
async fn run_environment(env: &Env) -> Result<i64, tonic::Status> {
    let mut client = facade(&env.socket).await;
    let credential = Some(AssignmentCredential { assignment_id: env.assignment_id.clone(), capability: env.capability.clone() });
    let claimed = client.claim(ClaimRequest { credential, holder: HOLDER.into() }).await?.into_inner();
    let task = claimed.task.unwrap();
    // Reports carry the session the claim gave.
    let credential = Some(AssignmentCredential { assignment_id: env.assignment_id.clone(), capability: claimed.session });
    let done = RunnerUpdate {
        state: Some(TaskState { id: task.id, result: TaskResult::Success as i32, stopped_at: Some(prost_types::Timestamp::default()), ..Default::default() }),
        outputs: Default::default(),
    };
    client.update_task(UpdateTaskRequest { credential, request: Some(done) }).await?;
    Ok(task.id)
}

fn assert_each_finished_once(gitea: &FakeGitea, expected: usize) {
    gitea.with(|state| {
        let finished: Vec<_> = state.tasks.iter().filter(|(_, t)| t.final_result.is_some()).collect();
        assert_eq!(finished.len(), expected, "tasks finished: {:?}", state.tasks.keys().collect::<Vec<_>>());
        for (id, task) in finished {
            assert_eq!(task.final_result, Some(TaskResult::Success as i32), "task {id}");
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_between_persist_and_environment_creation() {
    let nats = nats::NatsServer::start();
    let gitea = FakeGitea::start().await;
    // One job before the crash, so no other task is between fetch and persist when the
    // process dies (that window is the next test's); two more after the restart.
    gitea.add_job(Job::new(&["disposable", "container", "docker"]));
    let setup = setup(&gitea, &nats);
    let mut crashed = controller(&setup, Some("before-create"));
    let status = crashed.wait_for_exit(Duration::from_secs(60), "the controller dies at its crash point");
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "{status}");
    assert!(environments(&setup.envs).is_empty(), "an environment was created before the crash point");
    assert_eq!(gitea.with(|s| s.tasks.len()), 1);
    for _ in 0..2 {
        gitea.add_job(Job::new(&["disposable", "container", "docker"]));
    }

    let _running = controller(&setup, None);
    let envs = wait_for_environments(&setup.envs, 3, Duration::from_secs(60)).await;
    for env in &envs {
        run_environment(env).await.unwrap();
    }
    assert_each_finished_once(&gitea, 3);
    assert_eq!(gitea.with(|s| s.tasks.len()), 3, "a task was fetched twice");
    assert_eq!(environments(&setup.envs).len(), 3, "an environment was created twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_right_after_a_claim() {
    let nats = nats::NatsServer::start();
    let gitea = FakeGitea::start().await;
    for _ in 0..2 {
        gitea.add_job(Job::new(&["disposable", "container", "docker"]));
    }
    let setup = setup(&gitea, &nats);
    let mut crashing = controller(&setup, Some("after-claim"));
    let envs = wait_for_environments(&setup.envs, 2, Duration::from_secs(60)).await;
    // The claim is recorded, then the process dies before answering.
    assert!(run_environment(&envs[0]).await.is_err());
    let status = crashing.wait_for_exit(Duration::from_secs(30), "the controller dies at its crash point");
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "{status}");

    let _running = controller(&setup, None);
    // The same holder retries and gets the same task; another holder would be refused.
    for env in &envs {
        run_environment(env).await.unwrap();
    }
    let second = facade(&envs[0].socket)
        .await
        .claim(ClaimRequest {
            credential: Some(AssignmentCredential { assignment_id: envs[0].assignment_id.clone(), capability: envs[0].capability.clone() }),
            holder: "someone-else-0123456789".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(second.code(), tonic::Code::FailedPrecondition);
    assert_each_finished_once(&gitea, 2);
    assert_eq!(environments(&setup.envs).len(), 2);
}

/// A task Gitea handed over but the process died before persisting it cannot be
/// recovered by the runner: FetchTask never returns it again and the protocol has no
/// way to look it up. It is not run twice; Gitea fails it after its zombie timeout.
/// The others are unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_between_fetch_and_persist() {
    let nats = nats::NatsServer::start();
    let gitea = FakeGitea::start().await;
    for _ in 0..3 {
        gitea.add_job(Job::new(&["disposable", "container", "docker"]));
    }
    let setup = setup(&gitea, &nats);
    let mut crashed = controller(&setup, Some("after-fetch"));
    let status = crashed.wait_for_exit(Duration::from_secs(60), "the controller dies at its crash point");
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "{status}");
    let handed_over = gitea.with(|s| s.tasks.len());
    assert!(handed_over >= 1);

    let _running = controller(&setup, None);
    let envs = wait_for_environments(&setup.envs, 3 - handed_over, Duration::from_secs(60)).await;
    for env in &envs {
        run_environment(env).await.unwrap();
    }
    assert_each_finished_once(&gitea, 3 - handed_over);
    gitea.with(|s| {
        assert_eq!(s.tasks.len(), 3, "every job was handed out exactly once");
        let lost: Vec<_> = s.tasks.iter().filter(|(_, t)| t.final_result.is_none()).map(|(id, t)| (*id, t.updates)).collect();
        assert_eq!(lost.len(), handed_over, "{lost:?}");
        assert!(lost.iter().all(|(_, updates)| *updates == 0), "a lost task was reported: {lost:?}");
    });
}
