//! The facade over its unix socket (capability-only), fed by the real scheduler,
//! store and worker, with the fake Gitea behind it: claim exactly once, forwarding
//! with replies unchanged (cancellation included), the terminal state releasing the
//! slot — and every refusal with its status code.

#![allow(clippy::unwrap_used)]

mod common;

use std::{collections::HashMap, sync::Arc, time::Duration};

use common::{
    fake_gitea::{FakeGitea, Job, REGISTRATION_TOKEN},
    memory_driver::MemoryDriver,
};
use controller::{
    capability::CapabilityKey,
    driver::Driver,
    facade::{self, Facade, Peer},
    gitea,
    placement::{self, Placement},
    pool::Pool,
    scheduler::{Outcome, Scheduler, SchedulerConfig},
    store::{State, Store, embedded::Embedded},
    worker::{EnvironmentContract, Worker},
};
use proto::{
    facade::v1::{AssignmentCredential, ClaimRequest, UpdateLogRequest, UpdateTaskRequest, facade_service_client::FacadeServiceClient},
    runner::v1::{self as runner, Result as TaskResult},
};
use tokio_util::sync::CancellationToken;
use tonic::Code;

const KEY: &[u8] = b"0123456789abcdef0123456789abcdef-facade-test-key";
const HOLDER: &str = "holder-0123456789abcdef";

struct Harness {
    gitea: gitea::Gitea,
    fake: FakeGitea,
    store: Arc<dyn Store>,
    driver: MemoryDriver,
    pool: Arc<Pool>,
    facade: Arc<Facade>,
    client: FacadeServiceClient<tonic::transport::Channel>,
    shutdown: CancellationToken,
    _dir: tempfile::TempDir,
}

async fn harness(jobs: usize, capacity: usize) -> Harness {
    let fake = FakeGitea::start().await;
    for _ in 0..jobs {
        fake.add_job(Job::new(&["self-hosted", "container", "docker"]));
    }
    let dir = tempfile::tempdir().unwrap();
    let placement: Placement = "container.docker".parse().unwrap();
    let token_file = dir.path().join("registration-token");
    std::fs::write(&token_file, REGISTRATION_TOKEN).unwrap();
    let labels = placement::declared_labels(&[placement]);
    let (client, _) = gitea::connect(&fake.url(), &dir.path().join("runner.json"), Some(&token_file), "ctl", &labels).await.unwrap();
    let store: Arc<dyn Store> = Arc::new(Embedded::open(&dir.path().join("store.redb")).unwrap());
    let key = Arc::new(CapabilityKey::from_bytes(KEY).unwrap());
    let driver = MemoryDriver::new("container.docker");
    let pool = Arc::new(Pool::new("container.docker", capacity));
    let shutdown = CancellationToken::new();

    let (observer, mut outcomes) = tokio::sync::mpsc::unbounded_channel();
    let scheduler = Arc::new(
        Scheduler::new(
            client.clone(),
            Arc::clone(&store),
            SchedulerConfig { trust_domain: "example.org".into(), enabled: vec![placement], loops: 1, fetch_interval: Duration::from_millis(50), fetch_timeout: Duration::from_secs(5) },
        )
        .with_observer(observer),
    );
    tokio::spawn(Arc::clone(&scheduler).run(shutdown.clone()));
    for _ in 0..jobs {
        let outcome = tokio::time::timeout(Duration::from_secs(20), outcomes.recv()).await.unwrap().unwrap();
        assert!(matches!(outcome, Outcome::Persisted { .. }), "{outcome:?}");
    }
    let socket = dir.path().join("facade.sock");
    let contract = EnvironmentContract {
        facade_url: format!("unix://{}", socket.display()),
        facade_spiffe_id: String::new(),
        spiffe_endpoint_socket: String::new(),
        capability_ttl: Duration::from_secs(3600),
    };
    let worker = Arc::new(
        Worker::new(Arc::clone(&store), Arc::new(driver.clone()) as Arc<dyn Driver>, Arc::clone(&pool), Arc::clone(&key), contract, "example.org".into())
            .with_nak_delay(Duration::from_millis(100)),
    );
    tokio::spawn(Arc::clone(&worker).run(shutdown.clone()));
    let gitea_client = client.clone();
    let facade = Arc::new(Facade::new(
        Arc::clone(&store),
        client,
        key,
        "example.org".into(),
        HashMap::from([("container.docker".to_owned(), Arc::new(driver.clone()) as Arc<dyn Driver>)]),
        HashMap::from([("container.docker".to_owned(), Arc::clone(&pool))]),
    ));
    let serving = Arc::clone(&facade);
    let serve_socket = socket.clone();
    let serve_shutdown = shutdown.clone();
    tokio::spawn(async move { facade::serve_unix(serving, &serve_socket, serve_shutdown).await });
    for _ in 0..100 {
        if socket.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let channel = tonic::transport::Endpoint::try_from("http://facade.local")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(socket).await?)) }
        }))
        .await
        .unwrap();
    Harness { gitea: gitea_client, fake, store, driver, pool, facade, client: FacadeServiceClient::new(channel), shutdown, _dir: dir }
}

impl Harness {
    fn facade_gitea(&self) -> gitea::Gitea {
        self.gitea.clone()
    }
}

/// Waits until the worker created `n` environments; returns (assignment id, capability) pairs.
async fn environments(h: &Harness, n: usize) -> Vec<(String, String)> {
    for _ in 0..500 {
        let envs: Vec<(String, String)> = h
            .driver
            .recorded
            .lock()
            .unwrap()
            .environments
            .values()
            .map(|(spec, _)| (spec.env["CI_ASSIGNMENT_ID"].clone(), spec.env["CI_RUNNER_CAPABILITY"].clone()))
            .collect();
        if envs.len() >= n {
            return envs;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the worker did not create {n} environments");
}

fn credential(id: &str, capability: &str) -> Option<AssignmentCredential> {
    Some(AssignmentCredential { assignment_id: id.to_owned(), capability: capability.to_owned() })
}

fn claim(id: &str, capability: &str, holder: &str) -> ClaimRequest {
    ClaimRequest { credential: credential(id, capability), holder: holder.to_owned() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_forward_and_finish() {
    let mut h = harness(1, 2).await;
    let (id, capability) = environments(&h, 1).await.remove(0);
    let environment = h.driver.recorded.lock().unwrap().environments.values().next().unwrap().0.clone();
    assert_eq!(environment.env["CI_SPIFFE_ID"], "spiffe://example.org/ci/owner/repo/build");
    assert_eq!(environment.env["CI_RUNNER_LABELS_JSON"], r#"["self-hosted","container","docker"]"#);
    assert!(!environment.env.values().any(|v| v.contains("token-1")), "the runner token leaked into the environment");

    let first = h.client.claim(claim(&id, &capability, HOLDER)).await.unwrap().into_inner();
    let task = first.task.clone().unwrap();
    assert!(h.fake.with(|s| s.tasks.contains_key(&task.id)));
    assert!(task.context.is_some() && task.workflow_payload.is_some());
    // An idempotent retry by the same holder gets the same task and claim time.
    let again = h.client.claim(claim(&id, &capability, HOLDER)).await.unwrap().into_inner();
    assert_eq!(again, first);
    // Anyone else is refused.
    let other = h.client.claim(claim(&id, &capability, "another-holder-0000000000")).await.unwrap_err();
    assert_eq!(other.code(), Code::FailedPrecondition, "{other}");

    // UpdateLog goes to Gitea; its ack comes back.
    let log = runner::UpdateLogRequest { task_id: task.id, index: 0, rows: vec![runner::LogRow { time: None, content: "step 1".into() }], no_more: false };
    let ack = h.client.update_log(UpdateLogRequest { credential: credential(&id, &capability), request: Some(log) }).await.unwrap().into_inner();
    assert_eq!(ack.response.unwrap().ack_index, 1);
    assert_eq!(h.fake.with(|s| s.tasks[&task.id].log.clone()), ["step 1"]);

    // A running UpdateTask, then Gitea cancels: the reply passes through unchanged.
    let running = runner::UpdateTaskRequest { state: Some(runner::TaskState { id: task.id, ..Default::default() }), outputs: Default::default() };
    let reply = h.client.update_task(UpdateTaskRequest { credential: credential(&id, &capability), request: Some(running.clone()) }).await.unwrap().into_inner();
    assert_eq!(reply.response.unwrap().state.unwrap().result, TaskResult::Unspecified as i32);
    h.fake.cancel(task.id);
    let reply = h.client.update_task(UpdateTaskRequest { credential: credential(&id, &capability), request: Some(running) }).await.unwrap().into_inner();
    assert_eq!(reply.response.unwrap().state.unwrap().result, TaskResult::Cancelled as i32);
    assert!(matches!(h.store.get(&id).await.unwrap().unwrap().value.state, State::Claimed { .. }));

    // The final state: Gitea records it, the record is terminal, the slot is free.
    assert_eq!(h.pool.in_use(), 1);
    let done = runner::UpdateTaskRequest {
        state: Some(runner::TaskState { id: task.id, result: TaskResult::Cancelled as i32, stopped_at: Some(prost_types::Timestamp::default()), ..Default::default() }),
        outputs: Default::default(),
    };
    h.client.update_task(UpdateTaskRequest { credential: credential(&id, &capability), request: Some(done) }).await.unwrap();
    assert_eq!(h.fake.with(|s| s.tasks[&task.id].final_result), Some(TaskResult::Cancelled as i32));
    assert!(matches!(h.store.get(&id).await.unwrap().unwrap().value.state, State::Terminal { .. }));
    assert_eq!(h.pool.in_use(), 0);
    assert_eq!(h.driver.live(), 0, "the environment was not marked terminal");
    h.shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_have_the_right_status_codes() {
    let mut h = harness(2, 2).await;
    let envs = environments(&h, 2).await;
    let (id, capability) = envs[0].clone();
    let (other_id, other_capability) = envs[1].clone();
    let task = h.client.claim(claim(&id, &capability, HOLDER)).await.unwrap().into_inner().task.unwrap();
    let other_task = h.client.claim(claim(&other_id, &other_capability, HOLDER)).await.unwrap().into_inner().task.unwrap();

    let key = CapabilityKey::from_bytes(KEY).unwrap();
    let wrong_key = CapabilityKey::from_bytes(b"another key of at least thirty-two bytes!!").unwrap();
    let cases: Vec<(&str, ClaimRequest, Code)> = vec![
        ("another assignment's capability", claim(&id, &other_capability, HOLDER), Code::Unauthenticated),
        ("expired capability", claim(&id, &key.issue(&id, 1), HOLDER), Code::Unauthenticated),
        ("capability signed with another key", claim(&id, &wrong_key.issue(&id, u64::MAX / 2), HOLDER), Code::Unauthenticated),
        ("garbage capability", claim(&id, "v1.nope", HOLDER), Code::Unauthenticated),
        ("no credential", ClaimRequest { credential: None, holder: HOLDER.into() }, Code::Unauthenticated),
        ("unknown assignment", claim("gitea-task-999999", &key.issue("gitea-task-999999", u64::MAX / 2), HOLDER), Code::NotFound),
        ("second holder", claim(&id, &capability, "a-different-holder-000000"), Code::FailedPrecondition),
        ("short holder", claim(&id, &capability, "x"), Code::InvalidArgument),
    ];
    for (name, request, code) in cases {
        let status = h.client.claim(request).await.unwrap_err();
        assert_eq!(status.code(), code, "{name}: {status}");
    }

    // Reports for another task id are refused, even with a valid credential.
    let foreign_state = runner::UpdateTaskRequest { state: Some(runner::TaskState { id: other_task.id, ..Default::default() }), outputs: Default::default() };
    let status = h.client.update_task(UpdateTaskRequest { credential: credential(&id, &capability), request: Some(foreign_state) }).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status}");
    let foreign_log = runner::UpdateLogRequest { task_id: other_task.id, index: 0, rows: vec![], no_more: false };
    let status = h.client.update_log(UpdateLogRequest { credential: credential(&id, &capability), request: Some(foreign_log) }).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status}");
    assert!(h.fake.with(|s| s.tasks[&other_task.id].log.is_empty()), "a foreign log reached Gitea");

    // Oversized: a 5 MiB log batch.
    let huge = runner::UpdateLogRequest { task_id: task.id, index: 0, rows: vec![runner::LogRow { time: None, content: "x".repeat(5 << 20) }], no_more: false };
    let status = h.client.update_log(UpdateLogRequest { credential: credential(&id, &capability), request: Some(huge) }).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status}");

    // Over mTLS the peer's SPIFFE ID must be the assignment's identity.
    let peer = Peer::Spiffe("spiffe://example.org/ci/owner/other/build".into());
    let status = h.facade.claim(&peer, claim(&id, &capability, HOLDER)).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status}");
    let right = Peer::Spiffe("spiffe://example.org/ci/owner/repo/build".into());
    assert!(h.facade.claim(&right, claim(&id, &capability, HOLDER)).await.is_ok());
    h.shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_never_exceeds_capacity() {
    let h = harness(3, 1).await;
    environments(&h, 1).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(h.driver.live(), 1, "an environment beyond capacity was created");
    let records = h.store.list().await.unwrap();
    let without_environment = records.iter().filter(|r| r.value.environment.is_none()).count();
    assert_eq!(without_environment, 2, "the others should wait in the queue: {records:?} {:?}", h.driver.recorded.lock().unwrap());
    h.shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_heartbeats_pending_tasks_and_cleans_up_cancelled_ones() {
    let h = harness(2, 2).await;
    let envs = environments(&h, 2).await;
    let keep_alive = controller::keepalive::KeepAlive {
        store: Arc::clone(&h.store),
        gitea: h.facade_gitea(),
        drivers: HashMap::from([("container.docker".to_owned(), Arc::new(h.driver.clone()) as Arc<dyn Driver>)]),
        pools: HashMap::from([("container.docker".to_owned(), Arc::clone(&h.pool))]),
    };
    let task_ids: Vec<i64> = envs.iter().map(|(id, _)| controller::envelope::task_id_of(id).unwrap()).collect();
    assert_eq!(keep_alive.round().await.unwrap(), 0);
    for task_id in &task_ids {
        assert!(h.fake.with(|s| s.tasks[task_id].updates) >= 1, "no heartbeat for task {task_id}");
    }
    h.fake.cancel(task_ids[0]);
    assert_eq!(keep_alive.round().await.unwrap(), 1);
    let cancelled = &envs.iter().find(|(id, _)| controller::envelope::task_id_of(id) == Some(task_ids[0])).unwrap().0;
    assert!(matches!(h.store.get(cancelled).await.unwrap().unwrap().value.state, State::Terminal { .. }));
    assert_eq!(h.driver.live(), 1, "the cancelled task's environment was not deleted");
    assert_eq!(h.pool.in_use(), 1);
    h.shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciler_deletes_finished_environments_and_fails_tasks_whose_environment_died() {
    let mut h = harness(2, 2).await;
    let envs = environments(&h, 2).await;
    let keep_alive = controller::keepalive::KeepAlive {
        store: Arc::clone(&h.store),
        gitea: h.facade_gitea(),
        drivers: HashMap::from([("container.docker".to_owned(), Arc::new(h.driver.clone()) as Arc<dyn Driver>)]),
        pools: HashMap::from([("container.docker".to_owned(), Arc::clone(&h.pool))]),
    };
    // Nothing to do while both run.
    assert_eq!(keep_alive.reconcile().await.unwrap(), 0);

    // One finishes normally (marked terminal by the facade), one dies on its own.
    let (done_id, done_capability) = envs[0].clone();
    let task = h.client.claim(claim(&done_id, &done_capability, HOLDER)).await.unwrap().into_inner().task.unwrap();
    let finished = runner::UpdateTaskRequest {
        state: Some(runner::TaskState { id: task.id, result: TaskResult::Success as i32, stopped_at: Some(prost_types::Timestamp::default()), ..Default::default() }),
        outputs: Default::default(),
    };
    h.client.update_task(UpdateTaskRequest { credential: credential(&done_id, &done_capability), request: Some(finished) }).await.unwrap();
    let (dead_id, _) = envs[1].clone();
    let dead_task = controller::envelope::task_id_of(&dead_id).unwrap();
    {
        let mut recorded = h.driver.recorded.lock().unwrap();
        let entry = recorded.environments.values_mut().find(|(spec, _)| spec.assignment_id == dead_id).unwrap();
        entry.1 = controller::driver::Phase::Exited;
    }

    assert_eq!(keep_alive.reconcile().await.unwrap(), 2);
    assert!(h.driver.recorded.lock().unwrap().environments.is_empty(), "environments left");
    assert_eq!(h.pool.in_use(), 0);
    h.fake.with(|s| {
        let record = &s.tasks[&dead_task];
        assert_eq!(record.final_result, Some(TaskResult::Failure as i32));
        assert!(record.log.iter().any(|l| l.contains("exited before the job finished")), "{:?}", record.log);
    });
    assert!(matches!(h.store.get(&dead_id).await.unwrap().unwrap().value.state, State::Terminal { .. }));
    h.shutdown.cancel();
}
