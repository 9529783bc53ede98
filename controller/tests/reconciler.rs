//! The reconciler against a real nats-server: a pending record whose queue message was
//! never stored — the scheduler writes the record, then the message, and one that died
//! in between (its publish timed out during a leader election) left a record nobody
//! would deliver; found by the kill campaign — is queued again, exactly once.

#![allow(clippy::unwrap_used)]

mod common;

use std::{sync::Arc, time::Duration};

use common::{
    fake_gitea::{FakeGitea, REGISTRATION_TOKEN},
    memory_driver::MemoryDriver,
};
use controller::{
    assignment::{Placement, placement::LabelPolicy},
    driver::Driver,
    gitea::registrations::{RegistrationSettings, Registrations},
    lifecycle::Lifecycle,
    placements::Placements,
    store::{Record, Store, jetstream::JetStream, now_ms},
    worker::reconciler::Reconciler,
};

const DOCKER: Placement = Placement::CONTAINER_DOCKER;

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
    let runtime = placements.add(DOCKER, 2, Some(Arc::new(driver.clone()) as Arc<dyn Driver>));
    let lifecycle = Lifecycle::new(Arc::clone(&store), placements.clone(), registrations);
    let reconciler = Reconciler::new(runtime, Arc::new(driver), Arc::clone(&store), lifecycle, "test".into());

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
