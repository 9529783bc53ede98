//! The facade over its unix socket (capability-only), fed by the real scheduler,
//! store and worker, with the fake Gitea behind it: claim exactly once, forwarding
//! with replies unchanged (cancellation included), the terminal state releasing the
//! slot — and every refusal with its status code.

use std::{sync::Arc, time::Duration};

use crate::common::{
    fake_gitea::{FakeGitea, Job, REGISTRATION_TOKEN},
    memory_driver::MemoryDriver,
};
use controller::{
    assignment::{Placement, Rules, capability::CapabilityKey, placement::LabelPolicy},
    driver::Driver,
    facade::{self, Facade, Peer},
    gitea::registrations::{RegistrationSettings, Registrations},
    lifecycle::Lifecycle,
    metrics::Metrics,
    placements::{PlacementState, Placements},
    scheduler::{Outcome, Scheduler, keepalive::KeepAlive},
    store::{State, Store, embedded::Embedded},
    worker::{EnvironmentSettings, Worker},
};
use proto::{
    facade::v1::{
        AssignmentCredential, ClaimRequest, Phase, ReportPhaseRequest, UpdateLogRequest, UpdateTaskRequest, facade_service_client::FacadeServiceClient,
    },
    runner::v1::{self as runner, Result as TaskResult},
};
use testkit::wait_until;
use tokio_util::sync::CancellationToken;
use tonic::Code;

const KEY: &[u8] = b"0123456789abcdef0123456789abcdef-facade-test-key";
const HOLDER: &str = "holder-0123456789abcdef";
const PLACEMENT: Placement = Placement::CONTAINER_DOCKER;

struct Harness {
    fake: FakeGitea,
    store: Arc<dyn Store>,
    driver: MemoryDriver,
    placed: Arc<PlacementState>,
    registrations: Registrations,
    lifecycle: Lifecycle,
    worker: Arc<Worker>,
    facade: Arc<Facade>,
    metrics: Arc<Metrics>,
    client: FacadeServiceClient<tonic::transport::Channel>,
    shutdown: CancellationToken,
    _dir: tempfile::TempDir,
}

fn rules() -> Rules {
    Rules { trust_domain: "example.org".into(), labels: LabelPolicy::default() }
}

async fn harness(jobs: usize, capacity: usize) -> Harness {
    let fake = FakeGitea::start().await;
    for _ in 0..jobs {
        fake.add_job(Job::new(&["disposable", "container", "docker"]));
    }
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("registration-token");
    std::fs::write(&token_file, REGISTRATION_TOKEN).unwrap();
    let settings = RegistrationSettings {
        url: fake.url(),
        credential_dir: dir.path().join("runners"),
        registration_token_file: Some(token_file),
        runner_name: "ctl".into(),
        labels: LabelPolicy::default(),
    };
    let registrations = Registrations::open(&settings, &[PLACEMENT]).await.unwrap();
    let store: Arc<dyn Store> = Arc::new(Embedded::open(&dir.path().join("store.redb")).unwrap());
    let key = Arc::new(CapabilityKey::from_bytes(KEY).unwrap());
    let driver = MemoryDriver::new("container.docker");
    let mut placements = Placements::new();
    let placed = placements.add(PLACEMENT, capacity, Some(Arc::new(driver.clone()) as Arc<dyn Driver>));
    let metrics = Arc::new(Metrics::new());
    let lifecycle = Lifecycle::new(Arc::clone(&store), placements.clone(), registrations.clone())
        .with_retire_grace(Duration::from_millis(200))
        .with_metrics(Arc::clone(&metrics));
    let shutdown = CancellationToken::new();

    let (observer, mut outcomes) = tokio::sync::mpsc::unbounded_channel();
    let config = crate::common::scheduler_config(rules());
    let scheduler = Arc::new(
        Scheduler::new(PLACEMENT, registrations.fetcher(PLACEMENT).unwrap().clone(), Arc::clone(&store), placements.clone(), config).with_observer(observer),
    );
    tokio::spawn(Arc::clone(&scheduler).run(shutdown.clone()));
    for _ in 0..jobs.min(capacity) {
        let outcome = tokio::time::timeout(Duration::from_secs(20), outcomes.recv()).await.unwrap().unwrap();
        assert!(matches!(outcome, Outcome::Persisted { .. }), "{outcome:?}");
    }
    let socket = dir.path().join("facade.sock");
    let settings = EnvironmentSettings {
        facade_url: format!("unix://{}", socket.display()),
        gitea_url: Some(fake.url()),
        capability_ttl: Duration::from_secs(3600),
        ..EnvironmentSettings::default()
    };
    let worker = Arc::new(
        Worker::new(
            Arc::clone(&placed),
            Arc::new(driver.clone()) as Arc<dyn Driver>,
            Arc::clone(&store),
            Arc::clone(&key),
            settings,
            rules(),
            lifecycle.clone(),
        )
        .with_nak_delay(Duration::from_millis(100))
        .with_hold(Duration::from_millis(200))
        .with_metrics(Arc::clone(&metrics)),
    );
    tokio::spawn(Arc::clone(&worker).run(shutdown.clone()));
    // The hostile-input test sends thousands of reports for one assignment on purpose.
    let facade = Arc::new(
        Facade::new(Arc::clone(&store), registrations.clone(), lifecycle.clone(), key, rules()).with_report_limit(1e9, 1e9).with_metrics(Arc::clone(&metrics)),
    );
    let serving = Arc::clone(&facade);
    let serve_socket = socket.clone();
    let serve_shutdown = shutdown.clone();
    tokio::spawn(async move { facade::serve_unix(serving, &serve_socket, serve_shutdown).await });
    wait_until("the facade socket exists", Duration::from_secs(5), || socket.exists()).await;
    let channel = tonic::transport::Endpoint::try_from("http://facade.local")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(socket).await?)) }
        }))
        .await
        .unwrap();
    Harness { fake, store, driver, placed, registrations, lifecycle, worker, facade, metrics, client: FacadeServiceClient::new(channel), shutdown, _dir: dir }
}

/// Waits until the worker created `n` environments; returns (assignment id, capability) pairs.
async fn environments(h: &Harness, n: usize) -> Vec<(String, String)> {
    testkit::wait_for(&format!("the worker created {n} environments"), Duration::from_secs(10), || {
        let envs: Vec<(String, String)> = h
            .driver
            .recorded
            .lock()
            .unwrap()
            .environments
            .values()
            .map(|(spec, _)| (spec.env["CI_ASSIGNMENT_ID"].clone(), spec.env["CI_RUNNER_CAPABILITY"].clone()))
            .collect();
        (envs.len() >= n).then_some(envs)
    })
    .await
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
    // Without SPIFFE, only the variables with a value: no empty CI_SPIFFE_ID & co.
    let names: Vec<&str> = environment.env.keys().map(String::as_str).collect();
    assert_eq!(names, ["CI_ASSIGNMENT_ID", "CI_GITEA_URL", "CI_RUNNER_CAPABILITY", "CI_RUNNER_FACADE_URL", "CI_RUNNER_LABELS_JSON"]);
    assert_eq!(environment.env["CI_RUNNER_LABELS_JSON"], r#"["disposable","container","docker"]"#);
    assert_eq!(environment.env["CI_GITEA_URL"], h.fake.url());
    assert!(!environment.env.values().any(|v| v.contains("token-1")), "the runner token leaked into the environment");

    // The worker records the environment after the driver made it.
    testkit::wait_until_async("the environment is recorded", Duration::from_secs(5), || async {
        h.store.get(&id).await.unwrap().is_some_and(|r| r.value.environment_at_ms > 0)
    })
    .await;
    let first = h.client.claim(claim(&id, &capability, HOLDER)).await.unwrap().into_inner();
    let task = first.task.clone().unwrap();
    let session = first.session.clone();
    assert!(h.fake.with(|s| s.tasks.contains_key(&task.id)));
    assert!(task.context.is_some() && task.workflow_payload.is_some());
    // An idempotent retry by the same holder gets the same task and claim time.
    let again = h.client.claim(claim(&id, &capability, HOLDER)).await.unwrap().into_inner();
    assert_eq!(again, first);
    // Anyone else is refused.
    let other = h.client.claim(claim(&id, &capability, "another-holder-0000000000")).await.unwrap_err();
    assert_eq!(other.code(), Code::FailedPrecondition, "{other}");

    // Reports carry the session: the capability the environment was given only claims.
    let log = runner::UpdateLogRequest { task_id: task.id, index: 0, rows: vec![runner::LogRow { time: None, content: "not sent".into() }], no_more: false };
    let refused = h.client.update_log(UpdateLogRequest { credential: credential(&id, &capability), request: Some(log) }).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused}");
    assert!(refused.message().contains("session"), "{refused}");
    let status = h.client.claim(claim(&id, &session, HOLDER)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "a session claims nothing: {status}");

    // The job's start, stretch by stretch: fetched → created (the worker), created →
    // claimed (the claim), claimed → first step (the hook's first pass; a second is no
    // new first step).
    for _ in 0..2 {
        let started = ReportPhaseRequest { credential: credential(&id, &session), phase: Phase::JobStarted as i32, ..Default::default() };
        h.client.report_phase(started).await.unwrap();
    }
    let text = h.metrics.encode();
    for phase in ["created", "claimed", "first_step"] {
        let line = format!(r#"gdr_job_phase_seconds_count{{placement="container.docker",phase="{phase}"}} 1"#);
        assert!(text.contains(&line), "no {line} in:\n{text}");
    }

    // UpdateLog goes to Gitea; its ack comes back.
    let log = runner::UpdateLogRequest { task_id: task.id, index: 0, rows: vec![runner::LogRow { time: None, content: "step 1".into() }], no_more: false };
    let ack = h.client.update_log(UpdateLogRequest { credential: credential(&id, &session), request: Some(log) }).await.unwrap().into_inner();
    assert_eq!(ack.response.unwrap().ack_index, 1);
    assert_eq!(h.fake.with(|s| s.tasks[&task.id].log.clone()), ["step 1"]);

    // A running UpdateTask, then Gitea cancels: the reply passes through unchanged, and
    // the assignment ends with it (the runner may send no final state at all).
    let running = runner::UpdateTaskRequest { state: Some(runner::TaskState { id: task.id, ..Default::default() }), outputs: Default::default() };
    let reply = h.client.update_task(UpdateTaskRequest { credential: credential(&id, &session), request: Some(running.clone()) }).await.unwrap().into_inner();
    assert_eq!(reply.response.unwrap().state.unwrap().result, TaskResult::Unspecified as i32);
    assert!(matches!(h.store.get(&id).await.unwrap().unwrap().value.state, State::Claimed { .. }));
    assert_eq!(h.placed.pool.in_use(), 1);
    h.fake.cancel(task.id);
    let reply = h.client.update_task(UpdateTaskRequest { credential: credential(&id, &session), request: Some(running) }).await.unwrap().into_inner();
    assert_eq!(reply.response.unwrap().state.unwrap().result, TaskResult::Cancelled as i32);
    assert_eq!(h.store.get(&id).await.unwrap().unwrap().value.state, State::Terminal { result: "RESULT_CANCELLED".into() });
    assert_eq!(h.placed.admission.usage().0, 0, "the scheduler may fetch again at once (a fetch may already be in flight)");

    // The runner's last log rows and final state still reach Gitea while its
    // environment is retired.
    let last = runner::UpdateLogRequest { task_id: task.id, index: 1, rows: vec![runner::LogRow { time: None, content: "cleaning up".into() }], no_more: true };
    h.client.update_log(UpdateLogRequest { credential: credential(&id, &session), request: Some(last) }).await.unwrap();
    let done = runner::UpdateTaskRequest {
        state: Some(runner::TaskState {
            id: task.id,
            result: TaskResult::Cancelled as i32,
            stopped_at: Some(prost_types::Timestamp::default()),
            ..Default::default()
        }),
        outputs: Default::default(),
    };
    h.client.update_task(UpdateTaskRequest { credential: credential(&id, &session), request: Some(done) }).await.unwrap();
    h.fake.with(|s| {
        assert_eq!(s.tasks[&task.id].final_result, Some(TaskResult::Cancelled as i32));
        assert_eq!(s.tasks[&task.id].log, ["step 1", "cleaning up"]);
        assert!(s.tasks[&task.id].sealed);
    });
    wait_until("the environment is retired", Duration::from_secs(5), || h.driver.live() == 0).await;
    wait_until("its pool slot is free", Duration::from_secs(5), || h.placed.pool.in_use() == 0).await;
    // Ended once (Gitea's cancel), counted once: the runner's own final state after it is no second end.
    let text = h.metrics.encode();
    for line in [
        r#"gdr_jobs_finished_total{placement="container.docker",result="cancelled"} 1"#,
        r#"gdr_job_duration_seconds_count{placement="container.docker",result="cancelled"} 1"#,
    ] {
        assert!(text.contains(line), "no {line} in:\n{text}");
    }

    // Long after the end, a session kept by a job is worth nothing.
    let ended_long_ago = controller::store::now_ms() - i64::try_from(facade::REPORTS_AFTER_END.as_millis()).unwrap() - 1000;
    let stored = h.store.get(&id).await.unwrap().unwrap();
    h.store.update(&controller::store::Record { updated_at_ms: ended_long_ago, ..stored.value }, stored.revision).await.unwrap();
    let replay = runner::UpdateLogRequest { task_id: task.id, index: 2, rows: vec![runner::LogRow { time: None, content: "replayed".into() }], no_more: false };
    let status = h.client.update_log(UpdateLogRequest { credential: credential(&id, &session), request: Some(replay) }).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status}");
    assert!(!h.fake.with(|s| s.tasks[&task.id].log.iter().any(|l| l == "replayed")), "a replayed report reached Gitea");
    h.shutdown.cancel();
}

/// Gitea 1.27 keeps a cancelled task `cancelling` until its runner reports a final
/// state. A runner that never does (stuck in a cleanup step, killed with its
/// environment) would leave it so for Gitea's 10-minute zombie timeout: once the
/// environment is stopped, the controller reports the end Gitea announced itself. A
/// runner that reports its own end is not doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_the_runner_never_confirms_is_ended_in_gitea_when_its_environment_stops() {
    let h = harness(2, 2).await;
    let envs = environments(&h, 2).await;
    let mut updates = Vec::new();
    for (id, capability) in &envs {
        let claimed = h.client.clone().claim(claim(id, capability, HOLDER)).await.unwrap().into_inner();
        let task = claimed.task.unwrap();
        h.fake.cancel_as_1_27(task.id);
        let running = runner::UpdateTaskRequest { state: Some(runner::TaskState { id: task.id, ..Default::default() }), outputs: Default::default() };
        let reply = h.client.clone().update_task(UpdateTaskRequest { credential: credential(id, &claimed.session), request: Some(running) }).await.unwrap();
        assert_eq!(reply.into_inner().response.unwrap().state.unwrap().result, TaskResult::Cancelled as i32, "cancelling: the reply says cancelled");
        assert_eq!(h.fake.with(|s| s.tasks[&task.id].final_result), None, "still cancelling in Gitea");
        updates.push((id.clone(), claimed.session, task.id));
    }
    // The first runner confirms (with the result of its cleanup); the second never does.
    let (id, session, confirmed) = updates[0].clone();
    let done = runner::UpdateTaskRequest {
        state: Some(runner::TaskState {
            id: confirmed,
            result: TaskResult::Success as i32,
            stopped_at: Some(prost_types::Timestamp::default()),
            ..Default::default()
        }),
        outputs: Default::default(),
    };
    h.client.clone().update_task(UpdateTaskRequest { credential: credential(&id, &session), request: Some(done) }).await.unwrap();
    let silent = updates[1].2;
    wait_until("both environments are retired", Duration::from_secs(10), || h.driver.live() == 0).await;
    wait_until("Gitea has the silent runner's end", Duration::from_secs(10), || h.fake.with(|s| s.tasks[&silent].final_result.is_some())).await;
    h.fake.with(|s| {
        assert_eq!(s.tasks[&confirmed].final_result, Some(TaskResult::Cancelled as i32));
        assert_eq!(s.tasks[&silent].final_result, Some(TaskResult::Cancelled as i32));
        // Two UpdateTasks each: the running one, then the runner's end or the controller's.
        assert_eq!((s.tasks[&confirmed].updates, s.tasks[&silent].updates), (2, 2), "an end was reported twice");
    });
    h.shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_have_the_right_status_codes() {
    let mut h = harness(2, 2).await;
    let envs = environments(&h, 2).await;
    let (id, capability) = envs[0].clone();
    let (other_id, other_capability) = envs[1].clone();
    let claimed = h.client.claim(claim(&id, &capability, HOLDER)).await.unwrap().into_inner();
    let (task, session) = (claimed.task.unwrap(), claimed.session);
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
    let status = h.client.update_task(UpdateTaskRequest { credential: credential(&id, &session), request: Some(foreign_state) }).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status}");
    let foreign_log = runner::UpdateLogRequest { task_id: other_task.id, index: 0, rows: vec![], no_more: false };
    let status = h.client.update_log(UpdateLogRequest { credential: credential(&id, &session), request: Some(foreign_log) }).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status}");
    assert!(h.fake.with(|s| s.tasks[&other_task.id].log.is_empty()), "a foreign log reached Gitea");

    // Over the development-mode TCP listener the session is bound to the address that
    // claimed: the same session from another address is refused, and so is a session
    // made for another kind of peer.
    let here = Peer::Address("10.0.0.5".parse().unwrap());
    let there = Peer::Address("10.0.0.6".parse().unwrap());
    let bound = h.facade.claim(&here, claim(&id, &capability, HOLDER)).await.unwrap().session;
    let empty_log = || Some(runner::UpdateLogRequest { task_id: task.id, index: 0, rows: vec![], no_more: false });
    let status = h.facade.update_log(&there, UpdateLogRequest { credential: credential(&id, &bound), request: empty_log() }).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status}");
    assert!(status.message().contains("the address that claimed") && status.message().contains("10.0.0.6"), "{status}");
    let status = h.facade.update_log(&here, UpdateLogRequest { credential: credential(&id, &session), request: empty_log() }).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status}");
    assert!(h.facade.update_log(&here, UpdateLogRequest { credential: credential(&id, &bound), request: empty_log() }).await.is_ok());

    // A task fetched by a runner whose credential this controller does not hold (another
    // replica registered on its own): refused with what to do, nothing reaches Gitea.
    controller::store::modify(h.store.as_ref(), &id, |r| Some(controller::store::Record { runner: "uuid-of-another-registration".into(), ..r.clone() }))
        .await
        .unwrap();
    let running = runner::UpdateTaskRequest { state: Some(runner::TaskState { id: task.id, ..Default::default() }), outputs: Default::default() };
    let updates_before = h.fake.with(|s| s.tasks[&task.id].updates);
    let status = h.client.update_task(UpdateTaskRequest { credential: credential(&id, &session), request: Some(running) }).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status}");
    assert!(status.message().contains("gitea.credential_dir") && status.message().contains("uuid-of-another-registration"), "{status}");
    assert_eq!(h.fake.with(|s| s.tasks[&task.id].updates), updates_before);

    // Oversized: a 5 MiB log batch.
    let huge = runner::UpdateLogRequest { task_id: task.id, index: 0, rows: vec![runner::LogRow { time: None, content: "x".repeat(5 << 20) }], no_more: false };
    let status = h.client.update_log(UpdateLogRequest { credential: credential(&id, &session), request: Some(huge) }).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status}");

    // On an environment's own socket only that environment's assignment is served: a
    // capability copied from another job is refused there, for a claim and for reports.
    let elsewhere = Peer::Environment { assignment_id: other_id.clone() };
    let status = h.facade.claim(&elsewhere, claim(&id, &capability, HOLDER)).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status}");
    let log = runner::UpdateLogRequest { task_id: task.id, index: 0, rows: vec![], no_more: false };
    let status = h.facade.update_log(&elsewhere, UpdateLogRequest { credential: credential(&id, &session), request: Some(log) }).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status}");
    assert!(h.facade.claim(&Peer::Environment { assignment_id: id.clone() }, claim(&id, &capability, HOLDER)).await.is_ok());

    // Over mTLS the peer's SPIFFE ID must be the assignment's identity.
    let peer = Peer::Spiffe("spiffe://example.org/ci/owner/other/build".into());
    let status = h.facade.claim(&peer, claim(&id, &capability, HOLDER)).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status}");
    // Nor another task of the same job key (a fork's pull request may name its job like
    // the base repository's), nor the job-wide identity of envelopes before version 3.
    for same_key in [format!("spiffe://example.org/ci/owner/repo/build/{}", task.id + 1), "spiffe://example.org/ci/owner/repo/build".to_owned()] {
        let status = h.facade.claim(&Peer::Spiffe(same_key.clone()), claim(&id, &capability, HOLDER)).await.unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied, "{same_key}: {status}");
    }
    let right = format!("spiffe://example.org/ci/owner/repo/build/{}", task.id);
    // Every SPIFFE ID one character away from the right one — at every position, by every
    // printable ASCII character — is refused.
    let chars: Vec<char> = right.chars().collect();
    let mut mutations = 0;
    for position in 0..chars.len() {
        for replacement in (0x20u8..0x7f).map(char::from).filter(|c| *c != chars[position]) {
            let mut mutated = chars.clone();
            mutated[position] = replacement;
            let peer = Peer::Spiffe(mutated.into_iter().collect());
            let status = h.facade.claim(&peer, claim(&id, &capability, HOLDER)).await.unwrap_err();
            assert_eq!(status.code(), Code::PermissionDenied, "{peer:?}: {status}");
            mutations += 1;
        }
    }
    println!("{mutations} one-character mutations of {right} refused");
    assert!(h.facade.claim(&Peer::Spiffe(right.clone()), claim(&id, &capability, HOLDER)).await.is_ok());
    h.shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_never_exceeds_capacity() {
    let h = harness(3, 1).await;
    environments(&h, 1).await;
    // The worker holds the queue while the pool is full (and the scheduler does not even
    // fetch beyond capacity): one environment, one record, two jobs waiting in Gitea.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(h.driver.live(), 1, "an environment beyond capacity was created");
    assert_eq!(h.store.list().await.unwrap().len(), 1);
    assert_eq!(h.fake.with(|s| s.waiting.len()), 2);
    h.shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_heartbeats_pending_tasks_and_cleans_up_cancelled_ones() {
    let h = harness(2, 2).await;
    let envs = environments(&h, 2).await;
    let keep_alive = KeepAlive { store: Arc::clone(&h.store), registrations: h.registrations.clone(), lifecycle: h.lifecycle.clone() };
    let task_ids: Vec<i64> = envs.iter().map(|(id, _)| controller::assignment::envelope::task_id_of(id).unwrap()).collect();
    assert_eq!(keep_alive.round().await.unwrap(), 0);
    for task_id in &task_ids {
        assert!(h.fake.with(|s| s.tasks[task_id].updates) >= 1, "no heartbeat for task {task_id}");
    }
    h.fake.cancel(task_ids[0]);
    assert_eq!(keep_alive.round().await.unwrap(), 1);
    let cancelled = &envs.iter().find(|(id, _)| controller::assignment::envelope::task_id_of(id) == Some(task_ids[0])).unwrap().0;
    assert!(matches!(h.store.get(cancelled).await.unwrap().unwrap().value.state, State::Terminal { .. }));
    wait_until("the cancelled task's environment is deleted", Duration::from_secs(5), || h.driver.live() == 1).await;
    assert_eq!(h.placed.pool.in_use(), 1);
    // Gitea 1.27 keeps it cancelling until a runner reports: nothing of it ran, so the
    // keep-alive reports its end at once.
    h.fake.cancel_as_1_27(task_ids[1]);
    assert_eq!(keep_alive.round().await.unwrap(), 1);
    assert_eq!(h.fake.with(|s| s.tasks[&task_ids[1]].final_result), Some(TaskResult::Cancelled as i32), "still cancelling in Gitea");
    h.shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciler_deletes_finished_environments_and_fails_tasks_whose_environment_died() {
    let mut h = harness(2, 2).await;
    let envs = environments(&h, 2).await;
    let reconciler = h.worker.reconciler();
    // Nothing to do while both run.
    assert_eq!(reconciler.sweep().await.unwrap(), 0);

    // One finishes normally (marked terminal by the facade), one dies on its own.
    let (done_id, done_capability) = envs[0].clone();
    let claimed = h.client.claim(claim(&done_id, &done_capability, HOLDER)).await.unwrap().into_inner();
    let (task, done_session) = (claimed.task.unwrap(), claimed.session);
    let finished = runner::UpdateTaskRequest {
        state: Some(runner::TaskState {
            id: task.id,
            result: TaskResult::Success as i32,
            stopped_at: Some(prost_types::Timestamp::default()),
            ..Default::default()
        }),
        outputs: Default::default(),
    };
    h.client.update_task(UpdateTaskRequest { credential: credential(&done_id, &done_session), request: Some(finished) }).await.unwrap();
    // The other dies after its claim (one that dies before is made again: reconciler.rs).
    let (dead_id, dead_capability) = envs[1].clone();
    h.client.claim(claim(&dead_id, &dead_capability, HOLDER)).await.unwrap();
    let dead_task = controller::assignment::envelope::task_id_of(&dead_id).unwrap();
    {
        let mut recorded = h.driver.recorded.lock().unwrap();
        let entry = recorded.environments.values_mut().find(|(spec, _)| spec.assignment_id == dead_id).unwrap();
        entry.1 = controller::driver::Phase::Exited;
    }

    reconciler.sweep().await.unwrap();
    wait_until("every environment is deleted", Duration::from_secs(5), || h.driver.recorded.lock().unwrap().environments.is_empty()).await;
    assert_eq!(h.placed.pool.in_use(), 0);
    h.fake.with(|s| {
        let record = &s.tasks[&dead_task];
        assert_eq!(record.final_result, Some(TaskResult::Failure as i32));
        let last = record.log.last().unwrap();
        assert!(last.contains("ended before the job finished"), "{:?}", record.log);
    });
    assert!(matches!(h.store.get(&dead_id).await.unwrap().unwrap().value.state, State::Terminal { .. }));
    h.shutdown.cancel();
}

/// Two facades (replicas) answer claims for the same assignments at the same moment: each
/// assignment goes to exactly one holder, the other is refused, and the record names the
/// winner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_facades_racing_for_one_claim_give_it_to_exactly_one_holder() {
    let h = harness(4, 4).await;
    let other =
        Arc::new(Facade::new(Arc::clone(&h.store), h.registrations.clone(), h.lifecycle.clone(), Arc::new(CapabilityKey::from_bytes(KEY).unwrap()), rules()));
    let (first, second) = ("holder-first-0123456789", "holder-second-0123456789");
    for (id, capability) in environments(&h, 4).await {
        let (a, b) = tokio::join!(h.facade.claim(&Peer::Local, claim(&id, &capability, first)), other.claim(&Peer::Local, claim(&id, &capability, second)));
        let (winner, loser) = match (&a, &b) {
            (Ok(_), Err(refused)) => (first, refused),
            (Err(refused), Ok(_)) => (second, refused),
            _ => panic!("{id}: exactly one claim must win: {a:?} / {b:?}"),
        };
        assert_eq!(loser.code(), Code::FailedPrecondition, "{loser:?}");
        match h.store.get(&id).await.unwrap().unwrap().value.state {
            State::Claimed { holder, .. } => assert_eq!(holder, winner),
            state => panic!("{id} is {state:?}"),
        }
    }
    h.shutdown.cancel();
}

/// Generated hostile requests against the facade's unix listener, over raw HTTP/2 (the
/// `h2` client, so nothing in tonic's client smooths them): bytes that are not HTTP/2,
/// hostile headers (methods, paths, content types, encodings, timeouts), broken gRPC
/// framing (wrong lengths, compressed flags, truncation), mutated protobuf bodies of every
/// procedure with a valid credential, and messages at and over the 4 MiB limit. Every
/// answer must be a gRPC status with a known code (or, for what is not gRPC, the HTTP/2
/// layer's reset or close); nothing hangs, nothing panics, memory stays bounded, and the
/// facade still serves its holder afterwards. Prints inputs tried and outcomes by class.
/// `GDR_FUZZ_REQUESTS` (default 20,000 here; `scripts/check fuzz` runs 1,000,000) and
/// `GDR_FUZZ_SEED` (default: the clock, printed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generated_requests_get_grpc_statuses() {
    use hostile::{Class, Generator, Outcome};
    let total: usize = std::env::var("GDR_FUZZ_REQUESTS").ok().map_or(20_000, |v| v.parse().expect("GDR_FUZZ_REQUESTS is a number"));
    let seed: u64 = std::env::var("GDR_FUZZ_SEED").ok().map_or_else(
        || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs(),
        |v| v.parse().expect("GDR_FUZZ_SEED is a number"),
    );
    eprintln!("facade hostile input: {total} requests, GDR_FUZZ_SEED={seed}");
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        hostile::PANICS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        default_hook(info);
    }));

    let mut h = harness(1, 1).await;
    let (id, capability) = environments(&h, 1).await.remove(0);
    let claimed = h.client.claim(claim(&id, &capability, HOLDER)).await.unwrap().into_inner();
    let (task, session) = (claimed.task.unwrap(), claimed.session);
    let socket = h._dir.path().join("facade.sock");

    let outcomes: Arc<std::sync::Mutex<std::collections::BTreeMap<Class, std::collections::BTreeMap<Outcome, usize>>>> = Arc::default();
    let samples: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let rss_before = testkit::rss_kib();
    let started = std::time::Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for client in 0..16u64 {
        let (outcomes, samples, next, socket) = (Arc::clone(&outcomes), Arc::clone(&samples), Arc::clone(&next), socket.clone());
        let mut generator = Generator::new(seed.wrapping_add(client), credential(&id, &session), task.id);
        clients.spawn(async move {
            while next.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < total {
                let request = generator.generate();
                let outcome = hostile::judge(&request, hostile::send(&socket, &request).await);
                if outcome.is_violation() {
                    let mut samples = samples.lock().unwrap();
                    if samples.len() < 10 {
                        samples.push(format!("{:?} {outcome:?} for {}", request.class, request.describe()));
                    }
                }
                *outcomes.lock().unwrap().entry(request.class).or_default().entry(outcome).or_default() += 1;
            }
        });
    }
    while let Some(joined) = clients.join_next().await {
        joined.unwrap();
    }
    let elapsed = started.elapsed();
    let rss_after = testkit::rss_kib();

    let outcomes = std::mem::take(&mut *outcomes.lock().unwrap());
    let (report, violations) =
        testkit::hostile_report("facade hostile input", total, elapsed, seed, (rss_before, rss_after), &outcomes, |o: &Outcome| o.is_violation());
    println!("{report}");
    let panics = hostile::PANICS.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(panics, 0, "the facade panicked {panics} times{report}");
    assert_eq!(violations, 0, "improper answers or hangs:\n{}\n{report}", samples.lock().unwrap().join("\n"));
    // Bounded: a leak of even 100 bytes per request would show over the run.
    assert!(rss_after < rss_before + 256 * 1024, "RSS grew from {rss_before} KiB to {rss_after} KiB{report}");
    // Still serving: the holder's idempotent claim gets its task.
    let again = h.client.claim(claim(&id, &capability, HOLDER)).await;
    let state = h.store.get(&id).await.unwrap().unwrap().value.state;
    match again {
        Ok(reply) => assert_eq!(reply.into_inner().task.unwrap().id, task.id),
        // A mutated UpdateTask with the valid credential may have finished the task.
        Err(status) => assert!(matches!(state, State::Terminal { .. }) && status.code() == Code::FailedPrecondition, "{status} in state {state:?}"),
    }
    h.shutdown.cancel();
}

/// The generator and judge of `generated_requests_get_grpc_statuses`.
mod hostile {
    use std::{path::Path, sync::atomic::AtomicUsize, time::Duration};

    use bytes::Bytes;
    use prost::Message as _;
    use proto::{
        facade::v1::{AssignmentCredential, ClaimRequest, Phase, ReportPhaseRequest, UpdateLogRequest, UpdateTaskRequest},
        runner::v1 as runner,
    };
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    pub static PANICS: AtomicUsize = AtomicUsize::new(0);
    const ANSWER_WITHIN: Duration = Duration::from_secs(10);
    const LIMIT: usize = controller::facade::MAX_REQUEST_BYTES;
    const PROCEDURES: [&str; 4] = ["Claim", "UpdateTask", "UpdateLog", "ReportPhase"];

    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
    pub enum Class {
        /// Bytes that are not HTTP/2 (sometimes after a valid preface).
        NotHttp2,
        Headers,
        Framing,
        Protobuf,
        /// A message of exactly the limit: decoded (and then judged by the facade).
        AtLimit,
        /// A message over the limit: refused for its size.
        OverLimit,
    }

    pub struct Request {
        pub class: Class,
        raw: Option<Vec<u8>>,
        method: &'static str,
        path: String,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
        /// Framing whose first message is complete (trailing bytes or a second message
        /// follow it): tonic decodes the first message of a unary call and reads no
        /// further, so it may be served.
        complete_first_message: bool,
    }

    impl Request {
        pub fn describe(&self) -> String {
            match &self.raw {
                Some(raw) => format!("raw {:?}", String::from_utf8_lossy(&raw[..raw.len().min(80)])),
                None => format!("{} {} {:?} body {} bytes {:?}", self.method, self.path, self.headers, self.body.len(), &self.body[..self.body.len().min(40)]),
            }
        }
    }

    #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
    pub enum Outcome {
        /// A gRPC status with a known code.
        Status(String),
        /// The HTTP/2 layer reset the stream or refused the request before any handler.
        Reset(String),
        /// The connection was closed (what is not HTTP/2).
        Closed,
        Improper(String),
        Hang,
    }

    impl Outcome {
        pub fn is_violation(&self) -> bool {
            matches!(self, Outcome::Improper(_) | Outcome::Hang)
        }
    }

    pub struct Generator {
        rng: fastrand::Rng,
        credential: Option<AssignmentCredential>,
        task_id: i64,
    }

    fn frame(flag: u8, message: &[u8]) -> Vec<u8> {
        let mut out = vec![flag];
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    impl Generator {
        pub fn new(seed: u64, credential: Option<AssignmentCredential>, task_id: i64) -> Self {
            Self { rng: fastrand::Rng::with_seed(seed), credential, task_id }
        }

        fn valid_message(&mut self, procedure: &str) -> Vec<u8> {
            let credential = self.credential.clone();
            let task_id = if self.rng.bool() { self.task_id } else { self.rng.i64(..) };
            match procedure {
                "Claim" => ClaimRequest { credential, holder: super::HOLDER.into() }.encode_to_vec(),
                "UpdateTask" => UpdateTaskRequest {
                    credential,
                    request: Some(runner::UpdateTaskRequest {
                        state: Some(runner::TaskState { id: task_id, ..Default::default() }),
                        outputs: Default::default(),
                    }),
                }
                .encode_to_vec(),
                "UpdateLog" => UpdateLogRequest {
                    credential,
                    request: Some(runner::UpdateLogRequest {
                        task_id,
                        index: self.rng.i64(0..3),
                        rows: (0..self.rng.usize(0..3)).map(|i| runner::LogRow { time: None, content: format!("row {i}") }).collect(),
                        no_more: false,
                    }),
                }
                .encode_to_vec(),
                _ => ReportPhaseRequest { credential, phase: Phase::StorageReady as i32, at: Some(prost_types::Timestamp::default()), ..Default::default() }
                    .encode_to_vec(),
            }
        }

        fn mutate(&mut self, bytes: Vec<u8>) -> Vec<u8> {
            testkit::mutate(&mut self.rng, bytes)
        }

        fn grpc(&mut self, class: Class, procedure: &str, body: Vec<u8>) -> Request {
            let headers = vec![("content-type".into(), "application/grpc".into()), ("te".into(), "trailers".into())];
            Request { class, raw: None, method: "POST", path: format!("/facade.v1.FacadeService/{procedure}"), headers, body, complete_first_message: false }
        }

        /// An UpdateLog message of exactly `size` bytes, for another task (so that the
        /// facade decodes it, refuses it, and stores nothing).
        fn update_log_of_size(&self, size: usize) -> Vec<u8> {
            let mut content = size.saturating_sub(200);
            loop {
                let message = UpdateLogRequest {
                    credential: self.credential.clone(),
                    request: Some(runner::UpdateLogRequest {
                        task_id: self.task_id + 1,
                        index: 0,
                        rows: vec![runner::LogRow { time: None, content: "x".repeat(content) }],
                        no_more: false,
                    }),
                }
                .encode_to_vec();
                // Move by the difference (a length prefix may grow by a byte on the way).
                match message.len().cmp(&size) {
                    std::cmp::Ordering::Equal => return message,
                    std::cmp::Ordering::Greater => content -= (message.len() - size).max(1),
                    std::cmp::Ordering::Less => content += 1.max((size - message.len()) / 2),
                }
            }
        }

        pub fn generate(&mut self) -> Request {
            // Messages of 4 MiB are rare: they probe the limit, not throughput.
            let class = match self.rng.u16(0..1000) {
                0..=1 => Class::AtLimit,
                2..=3 => Class::OverLimit,
                4..=200 => Class::NotHttp2,
                201..=450 => Class::Headers,
                451..=700 => Class::Framing,
                _ => Class::Protobuf,
            };
            let procedure = PROCEDURES[self.rng.usize(..PROCEDURES.len())];
            match class {
                Class::NotHttp2 => {
                    let mut raw: Vec<u8> = if self.rng.bool() { b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec() } else { Vec::new() };
                    if self.rng.bool() {
                        raw.truncate(self.rng.usize(..=raw.len()));
                    }
                    raw.extend((0..self.rng.usize(0..200)).map(|_| self.rng.u8(..)));
                    if self.rng.u8(0..4) == 0 {
                        raw.extend_from_slice(b"POST /facade.v1.FacadeService/Claim HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello");
                    }
                    Request { class, raw: Some(raw), method: "POST", path: String::new(), headers: vec![], body: vec![], complete_first_message: false }
                }
                Class::Headers => {
                    let message = self.valid_message(procedure);
                    let mut request = self.grpc(class, procedure, frame(0, &message));
                    request.method = ["POST", "GET", "PUT", "DELETE", "OPTIONS"][self.rng.usize(..5)];
                    if self.rng.bool() {
                        request.path = match self.rng.u8(0..4) {
                            0 => "/".into(),
                            1 => format!("/facade.v1.FacadeService/{procedure}x"),
                            2 => "/runner.v1.RunnerService/FetchTask".into(),
                            _ => format!("/{}", (0..self.rng.usize(1..40)).map(|_| self.rng.alphanumeric()).collect::<String>()),
                        };
                    }
                    let content_types =
                        ["application/grpc", "application/grpc+proto", "application/grpc+json", "application/json", "application/proto", "text/plain", ""];
                    request.headers[0].1 = content_types[self.rng.usize(..content_types.len())].into();
                    if self.rng.bool() {
                        request.headers.remove(1);
                    }
                    let extras = [
                        ("grpc-encoding", "gzip"),
                        ("grpc-encoding", "br"),
                        ("grpc-encoding", "identity"),
                        ("grpc-timeout", "1n"),
                        ("grpc-timeout", "99999999H"),
                        ("grpc-timeout", "nonsense"),
                        ("grpc-accept-encoding", "zstd,nonsense"),
                        ("content-length", "3"),
                        ("x-huge", ""),
                    ];
                    for _ in 0..self.rng.usize(0..3) {
                        let (name, value) = extras[self.rng.usize(..extras.len())];
                        let value = if name == "x-huge" { "v".repeat(self.rng.usize(1..20_000)) } else { value.into() };
                        request.headers.push((name.into(), value));
                    }
                    request
                }
                Class::Framing => {
                    let message = self.valid_message(procedure);
                    let kind = self.rng.u8(0..6);
                    let body = match kind {
                        // Declares more than it sends, up to u32::MAX.
                        0 => {
                            let mut body = frame(0, &message);
                            let declared = (message.len() as u32).saturating_add(self.rng.u32(1..=u32::MAX / 2));
                            body[1..5].copy_from_slice(&declared.to_be_bytes());
                            body
                        }
                        // Declares less: trailing bytes after the message.
                        1 => {
                            let mut body = frame(0, &message);
                            let declared = self.rng.u32(0..message.len().max(1) as u32);
                            body[1..5].copy_from_slice(&declared.to_be_bytes());
                            body
                        }
                        // Compressed flag without a grpc-encoding, or a flag that is not 0/1.
                        2 => frame(self.rng.u8(1..), &message),
                        // Shorter than a frame header.
                        3 => frame(0, &message)[..self.rng.usize(0..5)].to_vec(),
                        // Two messages in a unary call.
                        4 => [frame(0, &message), frame(0, &message)].concat(),
                        _ => {
                            let mut body = frame(0, &message);
                            body.truncate(self.rng.usize(5..body.len().max(6)));
                            body
                        }
                    };
                    let mut request = self.grpc(class, procedure, body);
                    request.complete_first_message = kind == 1 || kind == 4;
                    request
                }
                Class::Protobuf => {
                    let message = self.valid_message(procedure);
                    let message = self.mutate(message);
                    self.grpc(class, procedure, frame(0, &message))
                }
                Class::AtLimit => {
                    let size = LIMIT - self.rng.usize(0..2);
                    let message = self.update_log_of_size(size);
                    self.grpc(class, "UpdateLog", frame(0, &message))
                }
                Class::OverLimit => {
                    let size = LIMIT + 1 + self.rng.usize(0..1024);
                    let message = self.update_log_of_size(size);
                    self.grpc(class, "UpdateLog", frame(0, &message))
                }
            }
        }
    }

    pub enum Answer {
        Closed,
        Grpc { http: u16, status: Option<String> },
        Reset(String),
    }

    pub async fn send(socket: &Path, request: &Request) -> Option<Answer> {
        tokio::time::timeout(ANSWER_WITHIN, exchange(socket, request)).await.ok()
    }

    async fn exchange(socket: &Path, request: &Request) -> Answer {
        let Ok(mut stream) = tokio::net::UnixStream::connect(socket).await else { return Answer::Reset("cannot connect".into()) };
        if let Some(raw) = &request.raw {
            let _ = stream.write_all(raw).await;
            let _ = stream.shutdown().await;
            let mut sink = Vec::new();
            let _ = stream.read_to_end(&mut sink).await;
            return Answer::Closed;
        }
        let (client, connection) = match h2::client::handshake(stream).await {
            Ok(pair) => pair,
            Err(error) => return Answer::Reset(format!("handshake: {error}")),
        };
        let driving = tokio::spawn(async move {
            let _ = connection.await;
        });
        let answer = async {
            let mut client = client.ready().await.map_err(|e| format!("ready: {}", reason(&e)))?;
            let mut builder = http::Request::builder().method(request.method).uri(format!("http://facade.local{}", request.path));
            for (name, value) in &request.headers {
                builder = builder.header(name.as_str(), value.as_str());
            }
            let http_request = builder.body(()).map_err(|e| format!("the client refused the request: {e}"))?;
            let (response, mut send) = client.send_request(http_request, false).map_err(|e| format!("send: {}", reason(&e)))?;
            send.reserve_capacity(request.body.len());
            let _ = send.send_data(Bytes::from(request.body.clone()), true);
            let response = response.await.map_err(|e| reason(&e))?;
            let http = response.status().as_u16();
            let header_status = response.headers().get("grpc-status").and_then(|v| v.to_str().ok()).map(str::to_owned);
            let mut body = response.into_body();
            while let Some(chunk) = body.data().await {
                let chunk = chunk.map_err(|e| reason(&e))?;
                let _ = body.flow_control().release_capacity(chunk.len());
            }
            let trailers = body.trailers().await.map_err(|e| reason(&e))?;
            let status = header_status.or_else(|| trailers.as_ref().and_then(|t| t.get("grpc-status")).and_then(|v| v.to_str().ok()).map(str::to_owned));
            Ok::<_, String>(Answer::Grpc { http, status })
        }
        .await;
        driving.abort();
        answer.unwrap_or_else(Answer::Reset)
    }

    fn reason(error: &h2::Error) -> String {
        match error.reason() {
            Some(reason) => format!("{reason:?}"),
            None if error.is_io() => "io".into(),
            None => "protocol".into(),
        }
    }

    const CODES: [&str; 17] = [
        "Ok",
        "Cancelled",
        "Unknown",
        "InvalidArgument",
        "DeadlineExceeded",
        "NotFound",
        "AlreadyExists",
        "PermissionDenied",
        "ResourceExhausted",
        "FailedPrecondition",
        "Aborted",
        "OutOfRange",
        "Unimplemented",
        "Internal",
        "Unavailable",
        "DataLoss",
        "Unauthenticated",
    ];

    pub fn judge(request: &Request, answer: Option<Answer>) -> Outcome {
        let Some(answer) = answer else { return Outcome::Hang };
        match (request.class, answer) {
            (Class::NotHttp2, Answer::Closed) => Outcome::Closed,
            (_, Answer::Closed) => Outcome::Improper("closed without an answer".into()),
            (Class::NotHttp2, _) => Outcome::Improper("not HTTP/2 but answered".into()),
            // The HTTP/2 layer may refuse a request whose headers or framing it cannot
            // accept (a content-length that lies, a header over its limits).
            (Class::Headers | Class::Framing, Answer::Reset(why)) => Outcome::Reset(why),
            (_, Answer::Reset(why)) => Outcome::Improper(format!("reset ({why}) of a well-formed request")),
            (class, Answer::Grpc { http, status }) => {
                let code = status.as_deref().and_then(|s| s.parse::<usize>().ok()).and_then(|n| CODES.get(n)).copied();
                match (class, code) {
                    // tonic answers a request that is not gRPC at the HTTP level.
                    (Class::Headers, None) if (400..500).contains(&http) => Outcome::Status(format!("HTTP {http}")),
                    (_, None) => Outcome::Improper(format!("HTTP {http} without a known grpc-status ({status:?})")),
                    (_, Some(_)) if http != 200 => Outcome::Improper(format!("grpc-status {status:?} with HTTP {http}")),
                    (Class::OverLimit, Some(code)) if code != "OutOfRange" && code != "ResourceExhausted" => {
                        Outcome::Improper(format!("{code} for a message over the limit"))
                    }
                    (Class::AtLimit, Some(code)) if code == "OutOfRange" || code == "ResourceExhausted" => {
                        Outcome::Improper(format!("{code} for a message within the limit"))
                    }
                    (Class::Framing, Some("Ok")) if request.complete_first_message => Outcome::Status("Ok (first message served, the rest unread)".into()),
                    (Class::Framing, Some("Ok")) => Outcome::Improper("broken framing was served".into()),
                    (_, Some(code)) => Outcome::Status(code.into()),
                }
            }
        }
    }
}
