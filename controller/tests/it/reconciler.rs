//! The reconciler against a real nats-server (environments in memory; the real ones are
//! in tests/e2e/tests/e2e/first_week.rs):
//! - a pending record whose queue message was never stored — the scheduler writes the
//!   record, then the message, and one that died in between (its publish timed out
//!   during a leader election) left a record nobody would deliver; found by the kill
//!   campaign — is queued again, exactly once;
//! - an environment that vanished or ended before its claim is made again, up to
//!   `MAX_ATTEMPTS` environments, then its task fails with the reason;
//! - environments it cannot prove it made are left alone.

use std::{sync::Arc, time::Duration};

use crate::common::{
    fake_gitea::{FakeGitea, REGISTRATION_TOKEN},
    memory_driver::MemoryDriver,
};
use controller::{
    assignment::{Placement, capability::CapabilityKey, placement::LabelPolicy},
    driver::{Driver, EnvironmentSpec, Phase},
    gitea::registrations::{RegistrationSettings, Registrations},
    lifecycle::Lifecycle,
    placements::Placements,
    store::{Record, Store, jetstream::JetStream, now_ms},
    worker::reconciler::{MAX_ATTEMPTS, Reconciler},
};

const DOCKER: Placement = Placement::CONTAINER_DOCKER;

fn key() -> Arc<CapabilityKey> {
    Arc::new(CapabilityKey::from_bytes(b"reconciler-test-key-0123456789abcdef").unwrap())
}

/// A fake Gitea with `jobs` jobs, a JetStream store, a memory driver and a reconciler
/// of installation `test`.
struct Rig {
    _nats: testkit::nats::NatsServer,
    fake: FakeGitea,
    store: Arc<dyn Store>,
    driver: MemoryDriver,
    reconciler: Reconciler,
    placed: Arc<controller::placements::PlacementState>,
    _dir: tempfile::TempDir,
}

async fn rig() -> Rig {
    let nats = testkit::nats::NatsServer::start();
    let store: Arc<dyn Store> = Arc::new(JetStream::connect(&nats.url, "ci.assignments", "ci-assignments", Duration::from_secs(30)).await.unwrap());
    let fake = FakeGitea::start().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("registration-token"), REGISTRATION_TOKEN).unwrap();
    let settings = RegistrationSettings {
        url: fake.url(),
        credential_dir: dir.path().join("runners"),
        registration_token_file: Some(dir.path().join("registration-token")),
        runner_name: "ctl".into(),
        labels: LabelPolicy::default(),
    };
    let registrations = Registrations::open(&settings, &[DOCKER]).await.unwrap();
    let driver = MemoryDriver::new("container.docker");
    let mut placements = Placements::new();
    let placed = placements.add(DOCKER, 2, Some(Arc::new(driver.clone()) as Arc<dyn Driver>));
    let lifecycle = Lifecycle::new(Arc::clone(&store), placements.clone(), registrations);
    let reconciler = Reconciler::new(Arc::clone(&placed), Arc::new(driver.clone()), Arc::clone(&store), lifecycle, "test".into(), key());
    Rig { _nats: nats, fake, store, driver, reconciler, placed, _dir: dir }
}

/// An environment of `assignment_id` as the worker makes it (proof included, unless
/// `proof` says otherwise), recorded on its assignment.
async fn make(rig: &Rig, assignment_id: &str, proof: Option<String>) -> String {
    let attempt = rig.store.get(assignment_id).await.unwrap().map_or(0, |r| r.value.attempts);
    make_attempt(rig, assignment_id, attempt, proof).await
}

/// The environment of one attempt (an earlier one: as a stale listing shows it).
async fn make_attempt(rig: &Rig, assignment_id: &str, attempt: u32, proof: Option<String>) -> String {
    let name = controller::driver::attempt_name("test", assignment_id, attempt);
    let mut labels = controller::driver::labels_for("test", assignment_id, DOCKER);
    labels.insert(controller::driver::LABEL_PROOF.to_owned(), proof.unwrap_or_else(|| key().prove(&name)));
    let spec = EnvironmentSpec { assignment_id: assignment_id.to_owned(), name: name.clone(), labels, ..EnvironmentSpec::default() };
    rig.driver.create(&spec).await.unwrap();
    rig.placed.pool.adopt(assignment_id);
    let environment = Some(name.clone());
    controller::store::modify(rig.store.as_ref(), assignment_id, |r| Some(Record { environment: environment.clone(), ..r.clone() })).await.unwrap();
    name
}

/// A pending record of a task the fake Gitea handed out (so failing it reaches Gitea).
async fn pending(rig: &Rig, n: i64) -> String {
    let id = format!("gitea-task-{n}");
    let runner = rig.fake.with(|s| s.runners.keys().next().cloned().unwrap());
    rig.fake.with(|s| {
        s.tasks.insert(n, crate::common::fake_gitea::TaskRecord { runner_uuid: runner.clone(), ..Default::default() });
    });
    rig.store.persist(&Record::pending(&id, DOCKER, &runner, b"{}".to_vec(), now_ms())).await.unwrap();
    id
}

/// An environment gone before its claim (`docker rm -f`, an expired sandbox): the task
/// is intact, so a new environment is made; its queue message comes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_environment_lost_before_its_claim_is_made_again_then_the_task_fails_after_three() {
    let rig = rig().await;
    let mut consumer = rig.store.consumer(DOCKER, 4).await.unwrap();
    let id = pending(&rig, 31).await;
    consumer.next(Duration::from_secs(5)).await.unwrap().unwrap().ack().await.unwrap();
    for attempt in 1..MAX_ATTEMPTS {
        let name = make(&rig, &id, None).await;
        // Vanished (removed behind the controller's back).
        rig.driver.recorded.lock().unwrap().environments.remove(&name);
        rig.reconciler.sweep().await.unwrap();
        let record = rig.store.get(&id).await.unwrap().unwrap().value;
        assert_eq!((record.attempts, record.environment.as_deref(), record.is_terminal()), (attempt, None, false), "{record:?}");
        assert!(!rig.placed.pool.holds(&id), "the slot of the vanished environment is free");
        let again = consumer.next(Duration::from_secs(5)).await.unwrap().expect("queued again for a new environment");
        assert_eq!(again.assignment_id(), id);
        again.ack().await.unwrap();
    }
    // An earlier attempt's environment, ended, shows up beside the current one (a listing
    // taken before its deletion, a killed process's leftover): it is deleted and neither
    // the current environment's record nor its slot is touched.
    let name = make(&rig, &id, None).await;
    let stale = make_attempt(&rig, &id, 0, None).await;
    controller::store::modify(rig.store.as_ref(), &id, |r| Some(Record { environment: Some(name.clone()), ..r.clone() })).await.unwrap();
    rig.driver.recorded.lock().unwrap().environments.get_mut(&stale).unwrap().1 = Phase::Exited;
    rig.reconciler.sweep().await.unwrap();
    let record = rig.store.get(&id).await.unwrap().unwrap().value;
    assert_eq!((record.attempts, record.environment.as_deref()), (MAX_ATTEMPTS - 1, Some(name.as_str())), "{record:?}");
    assert!(rig.placed.pool.holds(&id), "the current environment keeps its slot");
    assert_eq!(rig.driver.live(), 1, "the earlier attempt's environment was deleted, the current one kept");
    assert_ne!(stale, name);
    // The last allowed environment ends before its claim too (exited): the task fails.
    rig.driver.recorded.lock().unwrap().environments.get_mut(&name).unwrap().1 = Phase::Exited;
    rig.reconciler.sweep().await.unwrap();
    let record = rig.store.get(&id).await.unwrap().unwrap().value;
    assert!(record.is_terminal(), "{record:?}");
    let reason = record.reason.unwrap();
    assert!(reason.contains("before it claimed the job") && reason.contains("gave up after 3 environments"), "{reason}");
    assert_eq!(rig.fake.with(|s| s.tasks[&31].final_result), Some(proto::runner::v1::Result::Failure as i32));
    assert!(rig.fake.with(|s| s.tasks[&31].log.last().unwrap().contains("gave up after 3 environments")));
    assert_eq!(rig.driver.live(), 0, "the exited environment was deleted");
}

/// An environment that names this installation but carries no proof of it (another
/// installation chose the same name), or the proof of another key, is never removed nor
/// counted; one it made, without an assignment, is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environments_it_cannot_prove_it_made_are_left_alone() {
    let rig = rig().await;
    let other_key = CapabilityKey::from_bytes(b"another-installation-key-0123456789ab").unwrap();
    let mut names = Vec::new();
    for (n, proof) in [(41, Some(String::new())), (42, Some(other_key.prove(&controller::driver::environment_name("test", "gitea-task-42")))), (43, None)] {
        let id = format!("gitea-task-{n}");
        let name = controller::driver::environment_name("test", &id);
        let mut labels = controller::driver::labels_for("test", &id, DOCKER);
        labels.insert(controller::driver::LABEL_PROOF.to_owned(), proof.unwrap_or_else(|| key().prove(&name)));
        rig.driver.create(&EnvironmentSpec { assignment_id: id, name: name.clone(), labels, ..EnvironmentSpec::default() }).await.unwrap();
        names.push(name);
    }
    // No records at all: only the third is an orphan of this installation.
    let removed = rig.reconciler.sweep().await.unwrap();
    assert_eq!(removed, 1);
    let left: Vec<String> = rig.driver.recorded.lock().unwrap().environments.keys().cloned().collect();
    assert_eq!(left, names[..2]);
    assert_eq!(rig.placed.pool.in_use(), 0, "another installation's environments take no slot here");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_record_whose_message_was_lost_is_queued_again_once() {
    let nats = testkit::nats::NatsServer::start();
    let store: Arc<dyn Store> = Arc::new(JetStream::connect(&nats.url, "ci.assignments", "ci-assignments", Duration::from_secs(30)).await.unwrap());
    // The records alone, as a scheduler that died before its publish left them: one
    // fetched a minute ago, one just now (it may still be on its way to the queue).
    let client = async_nats::connect(&nats.url).await.unwrap();
    let kv = async_nats::jetstream::new(client).get_key_value("ci-assignments").await.unwrap();
    let stranded = Record::pending("gitea-task-7", DOCKER, "runner", b"envelope 7".to_vec(), now_ms() - 60_000);
    let young = Record::pending("gitea-task-8", DOCKER, "runner", b"envelope 8".to_vec(), now_ms());
    for record in [&stranded, &young] {
        kv.put(&record.assignment_id, serde_json::to_vec(record).unwrap().into()).await.unwrap();
    }
    let mut consumer = store.consumer(DOCKER, 4).await.unwrap();
    assert!(consumer.next(Duration::from_secs(1)).await.unwrap().is_none(), "nothing is queued yet");

    let fake = FakeGitea::start().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("registration-token"), REGISTRATION_TOKEN).unwrap();
    let settings = RegistrationSettings {
        url: fake.url(),
        credential_dir: dir.path().join("runners"),
        registration_token_file: Some(dir.path().join("registration-token")),
        runner_name: "ctl".into(),
        labels: LabelPolicy::default(),
    };
    let registrations = Registrations::open(&settings, &[DOCKER]).await.unwrap();
    let driver = MemoryDriver::new("container.docker");
    let mut placements = Placements::new();
    let placed = placements.add(DOCKER, 2, Some(Arc::new(driver.clone()) as Arc<dyn Driver>));
    let lifecycle = Lifecycle::new(Arc::clone(&store), placements.clone(), registrations);
    let reconciler = Reconciler::new(placed, Arc::new(driver), Arc::clone(&store), lifecycle, "test".into(), key());

    reconciler.sweep().await.unwrap();
    let delivery = consumer.next(Duration::from_secs(5)).await.unwrap().expect("the stranded record is queued again");
    assert_eq!(delivery.assignment_id(), "gitea-task-7");
    // Not yet acknowledged: a sweep now adds no second message (the stream's duplicate
    // window), nor after it is acknowledged.
    reconciler.sweep().await.unwrap();
    delivery.ack().await.unwrap();
    reconciler.sweep().await.unwrap();
    let more = consumer.next(Duration::from_secs(2)).await.unwrap();
    assert!(more.is_none(), "queued twice, or the young record was queued: {:?}", more.map(|d| d.assignment_id().to_owned()));
}
