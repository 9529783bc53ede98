//! The JetStream store on a real three-node nats-server cluster with three replicas:
//! a fresh store takes a write at once; it keeps working when one node dies (SIGKILL) and after it comes back, refuses
//! cleanly (no panic, no lost write) while two are down, and nothing persisted is lost.

use std::time::Duration;

use controller::{
    assignment::Placement,
    store::{Queue as _, Record, Records as _, Store, jetstream::JetStream},
};
use testkit::nats::NatsCluster;

fn record(n: u64) -> Record {
    Record::pending(&format!("gitea-task-{n}"), Placement::CONTAINER_DOCKER, "runner", format!("envelope {n}").into_bytes(), 1)
}

/// Retries `op` for up to 30 s: a client fails over to another node and JetStream elects
/// new stream and bucket leaders after a node dies, which takes a few seconds.
async fn eventually<T, F, Fut>(what: &str, op: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, controller::store::StoreError>>,
{
    testkit::poll(Duration::from_secs(30), op).await.unwrap_or_else(|error| panic!("{what} still fails after 30 s: {error}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_survive_one_node_and_recover_from_two() {
    let mut cluster = tokio::task::spawn_blocking(|| NatsCluster::start(3)).await.unwrap();
    // A replicated store is usable the moment opening it returns: its streams answer
    // creation before they elect leaders, and before the client's server has learnt of
    // them a write gets "no responders" (one CI run in a dozen failed here). Ten fresh
    // stores, each written at once, give that window ten chances (on this cluster: a
    // third cluster in this binary started concurrently was itself a source of flakes).
    for n in 1..=10 {
        let fresh =
            JetStream::connect_replicated(&cluster.url(), &format!("fresh{n}.assignments"), &format!("fresh{n}"), Duration::from_secs(30), 3).await.unwrap();
        assert!(fresh.persist(&record(n)).await.unwrap_or_else(|error| panic!("fresh store {n}: the first write failed: {}", controller::error_chain(&error))));
    }
    let store = JetStream::connect_replicated(&cluster.url(), "ci.assignments", "assignments", Duration::from_secs(30), 3).await.unwrap();
    for n in 1..=5 {
        store.persist(&record(n)).await.unwrap();
    }

    // One node down: everything keeps working (after leader elections).
    cluster.kill(0);
    for n in 6..=10 {
        let record = record(n);
        eventually("persisting with one node down", || store.persist(&record)).await;
    }
    let listed = eventually("listing with one node down", || store.list()).await;
    assert_eq!(listed.len(), 10);
    // Behind a lock: each pull borrows the consumer mutably, which a probe's future cannot.
    let consumer = tokio::sync::Mutex::new(eventually("a consumer with one node down", || store.consumer(Placement::CONTAINER_DOCKER, 20)).await);
    let mut delivered = Vec::new();
    while delivered.len() < 10 {
        // A pull may be answered 503 while the new consumer's leader is being elected;
        // the worker retries those, and so does this loop.
        let delivery = eventually("pulling with one node down", || async { consumer.lock().await.next(Duration::from_secs(5)).await })
            .await
            .expect("every persisted assignment is queued");
        delivered.push(delivery.assignment_id().to_owned());
        delivery.ack().await.unwrap();
    }
    delivered.sort();
    delivered.dedup();
    assert_eq!(delivered.len(), 10, "each assignment delivered once");

    // Two of three down: no quorum. Writes fail cleanly, none is half-done.
    cluster.kill(1);
    let refused = tokio::time::timeout(Duration::from_secs(60), store.persist(&record(11))).await;
    assert!(matches!(refused, Ok(Err(_)) | Err(_)), "a write without quorum must not succeed: {refused:?}");
    assert!(store.healthy().await.is_err(), "the store must not report healthy without quorum");

    // Both back: the store answers again on its own, and nothing was lost.
    let cluster = tokio::task::spawn_blocking(move || {
        // Together: one node alone with a peer still down may take longer than the
        // health wait to catch up with its replicas.
        cluster.restart_stopped();
        cluster
    })
    .await
    .unwrap();
    eventually("healthy again", || store.healthy()).await;
    let again = record(12);
    eventually("persisting again", || store.persist(&again)).await;
    let listed = eventually("listing again", || store.list()).await;
    let ids: Vec<String> = listed.iter().map(|r| r.value.assignment_id.clone()).collect();
    for n in 1..=10 {
        assert!(ids.contains(&format!("gitea-task-{n}")), "gitea-task-{n} was lost: {ids:?}");
    }
    assert!(ids.contains(&"gitea-task-12".to_owned()));
    drop(cluster);
}

/// A controller started while the cluster has no quorum (two of three nodes down, as in
/// the seconds after nodes restart) waits for it instead of exiting: opening the store
/// succeeds once the nodes are back. Found by the kill campaign, where a controller
/// started during a node's restart exited with "jetstream request timed out".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opening_the_store_waits_for_a_cluster_without_quorum() {
    let mut cluster = tokio::task::spawn_blocking(|| NatsCluster::start(3)).await.unwrap();
    let url = cluster.url();
    // The stream and buckets exist; a second process opens them later.
    JetStream::connect_replicated(&url, "ci.assignments", "ci-assignments", Duration::from_secs(30), 3).await.unwrap();
    cluster.kill(1);
    cluster.kill(2);
    let opening = {
        let url = url.clone();
        tokio::spawn(async move { JetStream::connect_replicated(&url, "ci.assignments", "ci-assignments", Duration::from_secs(30), 3).await })
    };
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(!opening.is_finished(), "opening the store gave up while the cluster had no quorum: {:?}", opening.await.unwrap().err());
    let cluster = tokio::task::spawn_blocking(move || {
        cluster.restart_stopped();
        cluster
    })
    .await
    .unwrap();
    let store = tokio::time::timeout(Duration::from_secs(60), opening).await.expect("still opening 60 s after the nodes came back").unwrap().unwrap();
    let first = record(1);
    let stored = eventually("a write after the cluster came back", || store.persist(&first)).await;
    assert!(stored);
    drop(cluster);
}
