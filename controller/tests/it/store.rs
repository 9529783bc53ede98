//! One suite of store cases, run against both backends: `Embedded` on a temporary redb
//! file and `JetStream` on a real nats-server (see `common/nats.rs`).
//!
//! Each case gets a fresh [`Backend`]: a factory that opens the store, and opens it
//! again on the same storage after the previous handle was dropped (a restart).
//! Timing: "nothing comes" is checked by waiting [`QUIET`]; "something comes" allows
//! [`PATIENT`]; delays and ack waits are ≥ 1 s so scheduling noise cannot flip a result.

use testkit::nats;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use controller::assignment::Placement;
use controller::store::{Delivery, Record, Records as _, State, Store, StoreError, embedded::Embedded, jetstream::JetStream, now_ms};

const DOCKER: Placement = Placement::CONTAINER_DOCKER;
const FIRECRACKER: Placement = Placement::VM_OPENSANDBOX;
/// Long enough that a delivery that should not come would have come.
const QUIET: Duration = Duration::from_millis(400);
/// Long enough for anything that should come.
const PATIENT: Duration = Duration::from_secs(5);
/// An ack wait that never expires within a case.
const NO_REDELIVERY: Duration = Duration::from_secs(60);
/// Tolerance for timers of the server or of tokio firing marginally early.
const EARLY: Duration = Duration::from_millis(100);

#[async_trait]
trait Backend: Send + Sync {
    /// Opens the store. Called again after every handle of the previous store (consumers
    /// and deliveries included) was dropped, it reopens the same storage.
    async fn open(&self, ack_wait: Duration) -> Box<dyn Store>;
    /// JetStream: a message is at most the servers' max_payload.
    fn has_payload_limit(&self) -> bool;
    /// JetStream: the finished bucket ages its records out by itself.
    fn prunes_itself(&self) -> bool;
}

struct EmbeddedBackend {
    dir: tempfile::TempDir,
}

impl EmbeddedBackend {
    fn new() -> Self {
        Self { dir: tempfile::tempdir().unwrap() }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("store.redb")
    }
}

#[async_trait]
impl Backend for EmbeddedBackend {
    async fn open(&self, ack_wait: Duration) -> Box<dyn Store> {
        Box::new(Embedded::open(&self.path()).expect("open redb store").with_ack_wait(ack_wait))
    }
    fn has_payload_limit(&self) -> bool {
        false
    }
    fn prunes_itself(&self) -> bool {
        false
    }
}

struct JetStreamBackend {
    server: nats::NatsServer,
}

impl JetStreamBackend {
    fn new() -> Self {
        Self { server: nats::NatsServer::start() }
    }
}

#[async_trait]
impl Backend for JetStreamBackend {
    async fn open(&self, ack_wait: Duration) -> Box<dyn Store> {
        Box::new(JetStream::connect(&self.server.url, "ci.assignments", "assignments", ack_wait).await.expect("connect to JetStream"))
    }
    fn has_payload_limit(&self) -> bool {
        true
    }
    fn prunes_itself(&self) -> bool {
        true
    }
}

fn id(n: u64) -> String {
    format!("gitea-task-{n}")
}

fn record(n: u64, placement: Placement) -> Record {
    Record {
        assignment_id: id(n),
        placement,
        state: State::Pending,
        envelope: format!("envelope of task {n}").into_bytes(),
        environment: None,
        environment_at_ms: 0,
        updated_at_ms: 1_700_000_000_000,
        created_at_ms: 1_700_000_000_000,
        runner: String::new(),
        phase: None,
        timeline: Vec::new(),
        reason: None,
        ended_at_ms: 0,
        attempts: 0,
    }
}

fn claimed(mut record: Record) -> Record {
    record.state = State::Claimed { holder: "controller-a".into(), claimed_at_ms: 1_700_000_000_500 };
    record
}

async fn next(consumer: &mut Box<dyn controller::store::Consumer>, what: &str) -> Box<dyn Delivery> {
    match consumer.next(PATIENT).await {
        Ok(Some(delivery)) => delivery,
        Ok(None) => panic!("{what}: nothing delivered within {PATIENT:?}"),
        Err(e) => panic!("{what}: {e:?}"),
    }
}

async fn nothing(consumer: &mut Box<dyn controller::store::Consumer>, what: &str) {
    match consumer.next(QUIET).await {
        Ok(None) => {}
        Ok(Some(d)) => panic!("{what}: unexpected delivery of {} (attempt {})", d.assignment_id(), d.attempt()),
        Err(e) => panic!("{what}: {e:?}"),
    }
}

/// Takes and acknowledges deliveries until none comes for a while.
async fn drain(consumer: &mut Box<dyn controller::store::Consumer>) -> Vec<String> {
    let mut got = Vec::new();
    while let Ok(Some(delivery)) = consumer.next(QUIET).await {
        got.push(delivery.assignment_id().to_owned());
        delivery.ack().await.unwrap();
    }
    got
}

/// The cases, written once.
mod cases {
    use super::*;

    /// Persist creates a Pending record and one delivery; persisting the same id again
    /// (before and after the delivery is acknowledged) returns false and delivers nothing.
    pub async fn persist_is_idempotent(backend: &dyn Backend) {
        let store = backend.open(NO_REDELIVERY).await;
        let first = record(1, DOCKER);
        assert!(store.persist(&first).await.unwrap(), "first persist creates");
        let stored = store.get(&id(1)).await.unwrap().expect("record exists");
        assert_eq!(stored.value, first);
        assert_eq!(stored.value.state, State::Pending);

        assert!(!store.persist(&first).await.unwrap(), "second persist does not create");
        let mut consumer = store.consumer(DOCKER, 10).await.unwrap();
        let delivery = next(&mut consumer, "first delivery").await;
        assert_eq!(delivery.assignment_id(), id(1));
        assert_eq!(delivery.attempt(), 1);
        nothing(&mut consumer, "no second copy while the first is in flight").await;

        delivery.ack().await.unwrap();
        assert!(!store.persist(&first).await.unwrap(), "persist after ack does not create");
        nothing(&mut consumer, "no copy after ack and re-persist").await;
        assert_eq!(store.get(&id(1)).await.unwrap().unwrap().revision, stored.revision, "record untouched");
        assert_eq!(store.list().await.unwrap().len(), 1);
    }

    /// get/update with compare-and-set and the transition rules.
    pub async fn records_compare_and_set(backend: &dyn Backend) {
        let store = backend.open(NO_REDELIVERY).await;
        assert!(store.get(&id(7)).await.unwrap().is_none());
        assert!(matches!(store.update(&record(7, DOCKER), 1).await, Err(StoreError::NotFound(_))));

        store.persist(&record(7, DOCKER)).await.unwrap();
        let r1 = store.get(&id(7)).await.unwrap().unwrap().revision;

        let claim = claimed(record(7, DOCKER));
        let r2 = store.update(&claim, r1).await.unwrap();
        assert!(r2 > r1, "revision grows: {r1} → {r2}");
        let read = store.get(&id(7)).await.unwrap().unwrap();
        assert_eq!((read.value, read.revision), (claim.clone(), r2));

        // A writer that read at r1 loses.
        let stale = store.update(&claimed(record(7, DOCKER)), r1).await;
        assert!(
            matches!(&stale, Err(StoreError::Conflict { assignment_id, expected }) if *assignment_id == id(7) && *expected == r1),
            "stale revision: {stale:?}"
        );

        // Same state, more data: allowed.
        let mut with_env = claim.clone();
        with_env.environment = Some("ci-gitea-task-7".into());
        let r3 = store.update(&with_env, r2).await.unwrap();
        assert!(r3 > r2);

        let mut done = with_env.clone();
        done.state = State::Terminal { result: "RESULT_SUCCESS".into() };
        let r4 = store.update(&done, r3).await.unwrap();

        // Terminal → Pending is refused, at the right revision, and changes nothing.
        let mut back = done.clone();
        back.state = State::Pending;
        let invalid = store.update(&back, r4).await;
        assert!(
            matches!(&invalid, Err(StoreError::InvalidTransition { from: State::Terminal { .. }, to: State::Pending, .. })),
            "invalid transition: {invalid:?}"
        );
        let read = store.get(&id(7)).await.unwrap().unwrap();
        assert_eq!((read.value, read.revision), (done, r4));
    }

    /// With max_in_flight = 2 and 5 persisted, only 2 come until one is acknowledged;
    /// deliveries come in persist order.
    pub async fn in_flight_limit(backend: &dyn Backend) {
        let store = backend.open(NO_REDELIVERY).await;
        for n in 1..=5 {
            store.persist(&record(n, DOCKER)).await.unwrap();
        }
        let mut consumer = store.consumer(DOCKER, 2).await.unwrap();
        let d1 = next(&mut consumer, "1st").await;
        let d2 = next(&mut consumer, "2nd").await;
        assert_eq!((d1.assignment_id(), d2.assignment_id()), (id(1).as_str(), id(2).as_str()));
        nothing(&mut consumer, "limit of 2 reached").await;

        d1.ack().await.unwrap();
        let d3 = next(&mut consumer, "3rd after an ack").await;
        assert_eq!(d3.assignment_id(), id(3));
        nothing(&mut consumer, "limit of 2 reached again").await;

        d2.ack().await.unwrap();
        d3.ack().await.unwrap();
        let d4 = next(&mut consumer, "4th").await;
        let d5 = next(&mut consumer, "5th").await;
        assert_eq!((d4.assignment_id(), d5.assignment_id()), (id(4).as_str(), id(5).as_str()));
        d4.ack().await.unwrap();
        d5.ack().await.unwrap();
        nothing(&mut consumer, "queue drained").await;
    }

    /// nak(delay): not redelivered before the delay, redelivered after it as attempt 2.
    pub async fn nak_delays_redelivery(backend: &dyn Backend) {
        let store = backend.open(NO_REDELIVERY).await;
        store.persist(&record(3, DOCKER)).await.unwrap();
        let mut consumer = store.consumer(DOCKER, 1).await.unwrap();
        let first = next(&mut consumer, "first delivery").await;
        assert_eq!(first.attempt(), 1);

        let delay = Duration::from_millis(1500);
        let given_back = Instant::now();
        first.nak(delay).await.unwrap();
        nothing(&mut consumer, "within the nak delay").await;
        let again = next(&mut consumer, "after the nak delay").await;
        let waited = given_back.elapsed();
        assert!(waited + EARLY >= delay, "redelivered after {waited:?}, before the delay of {delay:?}");
        assert_eq!(again.assignment_id(), id(3));
        assert_eq!(again.attempt(), 2);
        again.ack().await.unwrap();
        nothing(&mut consumer, "acknowledged").await;
    }

    /// A consumer that was dropped with a delivery unacknowledged (a crashed worker):
    /// a new consumer gets it after the ack wait, as attempt 2.
    pub async fn dropped_consumer_is_redelivered(backend: &dyn Backend) {
        let ack_wait = Duration::from_secs(1);
        let store = backend.open(ack_wait).await;
        store.persist(&record(4, DOCKER)).await.unwrap();
        let mut consumer = store.consumer(DOCKER, 1).await.unwrap();
        let lost = next(&mut consumer, "first delivery").await;
        let delivered = Instant::now();
        assert_eq!(lost.attempt(), 1);
        drop(lost);
        drop(consumer);

        let mut consumer = store.consumer(DOCKER, 1).await.unwrap();
        nothing(&mut consumer, "still within the ack wait").await;
        let again = next(&mut consumer, "after the ack wait").await;
        let waited = delivered.elapsed();
        assert!(waited + EARLY >= ack_wait, "redelivered after {waited:?}, before the ack wait of {ack_wait:?}");
        assert_eq!(again.assignment_id(), id(4));
        assert_eq!(again.attempt(), 2);
        again.ack().await.unwrap();
        nothing(&mut consumer, "acknowledged").await;
    }

    /// After a restart (store dropped and opened again): an acknowledged assignment never
    /// comes again, an unacknowledged one does, an undelivered one does, and records keep
    /// their values and revisions.
    pub async fn ack_is_durable_across_reopen(backend: &dyn Backend) {
        let ack_wait = Duration::from_secs(1);
        let (claimed_revision, records_before) = {
            let store = backend.open(ack_wait).await;
            for n in [10, 11, 12] {
                store.persist(&record(n, DOCKER)).await.unwrap();
            }
            let r1 = store.get(&id(10)).await.unwrap().unwrap().revision;
            let r2 = store.update(&claimed(record(10, DOCKER)), r1).await.unwrap();
            let mut consumer = store.consumer(DOCKER, 5).await.unwrap();
            let acked = next(&mut consumer, "first").await;
            assert_eq!(acked.assignment_id(), id(10));
            acked.ack().await.unwrap();
            let unacked = next(&mut consumer, "second").await;
            assert_eq!(unacked.assignment_id(), id(11));
            let mut before = store.list().await.unwrap();
            before.sort_by(|a, b| a.value.assignment_id.cmp(&b.value.assignment_id));
            // The crash: everything goes away without an ack of gitea-task-11.
            drop(unacked);
            drop(consumer);
            drop(store);
            (r2, before)
        };

        let store = backend.open(ack_wait).await;
        let read = store.get(&id(10)).await.unwrap().expect("record survives");
        assert_eq!((read.value, read.revision), (claimed(record(10, DOCKER)), claimed_revision));
        let mut after = store.list().await.unwrap();
        after.sort_by(|a, b| a.value.assignment_id.cmp(&b.value.assignment_id));
        assert_eq!(after, records_before);

        let mut consumer = store.consumer(DOCKER, 5).await.unwrap();
        let mut attempts = BTreeMap::new();
        for what in ["first after reopen", "second after reopen"] {
            let delivery = next(&mut consumer, what).await;
            attempts.insert(delivery.assignment_id().to_owned(), delivery.attempt());
            delivery.ack().await.unwrap();
        }
        assert_eq!(attempts, BTreeMap::from([(id(11), 2), (id(12), 1)]));
        nothing(&mut consumer, "the acknowledged one never comes again").await;
    }

    /// Placements are separate queues, and queue_depth counts undelivered messages.
    pub async fn placements_are_separate_queues(backend: &dyn Backend) {
        let store = backend.open(NO_REDELIVERY).await;
        for (n, placement) in [(20, DOCKER), (21, FIRECRACKER), (22, DOCKER), (23, FIRECRACKER), (24, DOCKER)] {
            store.persist(&record(n, placement)).await.unwrap();
        }
        assert_eq!(store.queue_depth(DOCKER).await.unwrap(), 3);
        assert_eq!(store.queue_depth(FIRECRACKER).await.unwrap(), 2);
        assert_eq!(store.queue_depth(Placement::CONTAINER_KUBERNETES).await.unwrap(), 0);

        let mut docker = store.consumer(DOCKER, 10).await.unwrap();
        assert_eq!(store.queue_depth(DOCKER).await.unwrap(), 3, "a consumer alone delivers nothing");
        let first = next(&mut docker, "docker 1").await;
        assert_eq!(store.queue_depth(DOCKER).await.unwrap(), 2, "delivered is no longer waiting");
        let mut got = vec![first];
        got.push(next(&mut docker, "docker 2").await);
        got.push(next(&mut docker, "docker 3").await);
        nothing(&mut docker, "only docker assignments on the docker queue").await;
        let ids: Vec<_> = got.iter().map(|d| d.assignment_id().to_owned()).collect();
        assert_eq!(ids, [id(20), id(22), id(24)]);
        assert_eq!(store.queue_depth(DOCKER).await.unwrap(), 0);
        assert_eq!(store.queue_depth(FIRECRACKER).await.unwrap(), 2, "the other queue is untouched");

        let mut firecracker = store.consumer(FIRECRACKER, 10).await.unwrap();
        let f1 = next(&mut firecracker, "firecracker 1").await;
        let f2 = next(&mut firecracker, "firecracker 2").await;
        assert_eq!((f1.assignment_id(), f2.assignment_id()), (id(21).as_str(), id(23).as_str()));
        nothing(&mut firecracker, "firecracker drained").await;
        assert_eq!(store.queue_depth(FIRECRACKER).await.unwrap(), 0);
        for delivery in got.into_iter().chain([f1, f2]) {
            delivery.ack().await.unwrap();
        }
    }

    /// list returns every record at its latest revision.
    pub async fn list_returns_all_records(backend: &dyn Backend) {
        let store = backend.open(NO_REDELIVERY).await;
        assert!(store.list().await.unwrap().is_empty());
        for (n, placement) in [(30, DOCKER), (31, FIRECRACKER), (32, DOCKER)] {
            store.persist(&record(n, placement)).await.unwrap();
        }
        let r = store.get(&id(31)).await.unwrap().unwrap().revision;
        store.update(&claimed(record(31, FIRECRACKER)), r).await.unwrap();

        let mut listed = store.list().await.unwrap();
        listed.sort_by(|a, b| a.value.assignment_id.cmp(&b.value.assignment_id));
        let ids: Vec<_> = listed.iter().map(|v| v.value.assignment_id.clone()).collect();
        assert_eq!(ids, [id(30), id(31), id(32)]);
        for versioned in &listed {
            let read = store.get(&versioned.value.assignment_id).await.unwrap().unwrap();
            assert_eq!(&read, versioned);
        }
        assert_eq!(listed[1].value, claimed(record(31, FIRECRACKER)));
    }

    /// A record that ends leaves the live list (what every sweep reads) for the finished
    /// ones, keeps its reason, survives a reopen, and goes once pruned.
    pub async fn finished_records_leave_the_live_list(backend: &dyn Backend) {
        let store = backend.open(NO_REDELIVERY).await;
        for n in [40, 41] {
            store.persist(&record(n, DOCKER)).await.unwrap();
        }
        let current = store.get(&id(40)).await.unwrap().unwrap();
        let ended = current.value.ended("RESULT_FAILURE".into(), Some("the job's environment ended"));
        let revision = store.update(&ended, current.revision).await.unwrap();
        let live: Vec<String> = store.list().await.unwrap().into_iter().map(|r| r.value.assignment_id).collect();
        assert_eq!(live, [id(41)], "finished records are not in the live list");
        let read = store.get(&id(40)).await.unwrap().unwrap();
        assert_eq!(read.revision, revision);
        assert_eq!(read.value.reason.as_deref(), Some("the job's environment ended"));
        assert!(read.value.ended_at_ms > 0);
        // A phase reported after the end is still recorded, where the record is.
        let mut later = read.value.clone();
        later.timeline.push(("runner_exited".into(), 1));
        let revision = store.update(&later, read.revision).await.unwrap();
        assert_eq!(store.get(&id(40)).await.unwrap().unwrap().revision, revision);
        // Persisting it again (a retried fetch) neither revives it nor queues it.
        assert!(!store.persist(&record(40, DOCKER)).await.unwrap());
        let mut consumer = store.consumer(DOCKER, 4).await.unwrap();
        assert_eq!(drain(&mut consumer).await, [id(40), id(41)], "the first persist's messages, no new one");
        drop(consumer);
        drop(store);

        let store = backend.open(NO_REDELIVERY).await;
        let finished: Vec<String> = store.list_finished().await.unwrap().into_iter().map(|r| r.value.assignment_id).collect();
        assert_eq!(finished, [id(40)]);
        assert_eq!(store.list().await.unwrap().len(), 1);
        let pruned = store.prune(super::now_ms() + 1000).await.unwrap();
        if backend.prunes_itself() {
            assert_eq!(pruned, 0, "the finished bucket's age limit prunes");
        } else {
            assert_eq!(pruned, 1);
            assert!(store.get(&id(40)).await.unwrap().is_none());
            assert!(store.list_finished().await.unwrap().is_empty());
        }
    }

    /// A pending assignment queued again (its environment ended before the claim) is
    /// delivered once more; the same requeue repeated adds nothing.
    pub async fn requeue_delivers_once_more(backend: &dyn Backend) {
        let store = backend.open(NO_REDELIVERY).await;
        let mut consumer = store.consumer(DOCKER, 4).await.unwrap();
        store.persist(&record(50, DOCKER)).await.unwrap();
        next(&mut consumer, "the first delivery").await.ack().await.unwrap();
        nothing(&mut consumer, "after the ack").await;
        let pending = store.get(&id(50)).await.unwrap().unwrap().value;
        store.requeue(&pending, 1).await.unwrap();
        store.requeue(&pending, 1).await.unwrap();
        let again = next(&mut consumer, "the requeued delivery").await;
        assert_eq!(again.assignment_id(), id(50));
        again.ack().await.unwrap();
        nothing(&mut consumer, "a second copy").await;
    }

    /// A record no server takes is refused as too large at once (no retry loop), with
    /// what to do; a large task that fits is stored.
    pub async fn records_that_cannot_be_stored_are_too_large(backend: &dyn Backend) {
        let store = backend.open(NO_REDELIVERY).await;
        let mut fits = record(60, DOCKER);
        fits.envelope = "x".repeat(700 << 10).into_bytes();
        store.persist(&fits).await.unwrap();
        assert_eq!(store.get(&id(60)).await.unwrap().unwrap().value.envelope.len(), 700 << 10);
        let mut huge = record(61, DOCKER);
        huge.envelope = "x".repeat(3 << 20).into_bytes();
        match store.persist(&huge).await {
            Err(StoreError::TooLarge { size, hint, .. }) if backend.has_payload_limit() => {
                assert!(size > 3 << 20, "{size}");
                assert!(hint.contains("max_payload"));
            }
            Ok(_) if !backend.has_payload_limit() => {}
            other => panic!("{other:?}"),
        }
    }

    /// Two workers of one placement (two processes, on JetStream) share its queue: each
    /// assignment goes to exactly one of them.
    pub async fn two_consumers_share_one_queue(backend: &dyn Backend) {
        let store = backend.open(NO_REDELIVERY).await;
        let mut a = store.consumer(DOCKER, 4).await.unwrap();
        let mut b = store.consumer(DOCKER, 4).await.unwrap();
        for n in 1..=20 {
            store.persist(&record(n, DOCKER)).await.unwrap();
        }
        let (from_a, from_b) = tokio::join!(drain(&mut a), drain(&mut b));
        let mut all: Vec<String> = from_a.iter().chain(&from_b).cloned().collect();
        all.sort();
        let mut expected: Vec<String> = (1..=20).map(id).collect();
        expected.sort();
        assert_eq!(all, expected, "each assignment delivered to exactly one consumer (a: {from_a:?}, b: {from_b:?})");
    }

    /// One holder at a time; renewals keep it; an expired or released lease goes to the
    /// next holder. When a lease expires and what a renewal extends is the rule's
    /// (`Lease::take`, table-tested on a made-up clock; the embedded store's expiry under
    /// paused time in its unit test); this checks that each store applies it, with one
    /// real expiry: JetStream's round trips cannot run under a paused clock.
    pub async fn leases_have_one_holder(backend: &dyn Backend) {
        let store = backend.open(NO_REDELIVERY).await;
        let ttl = Duration::from_millis(500);
        assert!(store.lease("scheduler.container.docker", "a", ttl).await.unwrap());
        assert!(!store.lease("scheduler.container.docker", "b", ttl).await.unwrap(), "two holders");
        assert!(store.lease("scheduler.vm.opensandbox", "b", ttl).await.unwrap(), "leases are per name");
        assert!(store.lease("scheduler.container.docker", "a", ttl).await.unwrap(), "renewal");
        assert!(!store.lease("scheduler.container.docker", "b", ttl).await.unwrap(), "a renewal is no release");
        // "b" tries until the lease has expired: it takes it over then (a failed try takes nothing).
        let renewed = std::time::Instant::now();
        testkit::wait_until_async("an expired lease is taken over", Duration::from_secs(10), || async {
            store.lease("scheduler.container.docker", "b", ttl).await.unwrap()
        })
        .await;
        assert!(renewed.elapsed() >= ttl / 2, "taken over {:?} after the renewal, long before the lease's {ttl:?}", renewed.elapsed());
        assert!(!store.lease("scheduler.container.docker", "a", ttl).await.unwrap());
        store.release_lease("scheduler.container.docker", "a").await.unwrap();
        assert!(!store.lease("scheduler.container.docker", "a", ttl).await.unwrap(), "only the holder releases");
        store.release_lease("scheduler.container.docker", "b").await.unwrap();
        assert!(store.lease("scheduler.container.docker", "a", ttl).await.unwrap(), "a released lease is free at once");
        store.healthy().await.unwrap();
    }
}

/// One `#[tokio::test]` per case and backend: `embedded::<case>` and `jetstream::<case>`.
macro_rules! suite {
    ($($case:ident),* $(,)?) => {
        mod embedded {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::cases::$case(&super::EmbeddedBackend::new()).await;
                }
            )*
        }
        mod jetstream {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::cases::$case(&super::JetStreamBackend::new()).await;
                }
            )*
        }
    };
}

suite!(
    persist_is_idempotent,
    two_consumers_share_one_queue,
    records_compare_and_set,
    in_flight_limit,
    nak_delays_redelivery,
    dropped_consumer_is_redelivered,
    ack_is_durable_across_reopen,
    placements_are_separate_queues,
    list_returns_all_records,
    leases_have_one_holder,
    finished_records_leave_the_live_list,
    requeue_delivers_once_more,
    records_that_cannot_be_stored_are_too_large,
);

/// The redb file holds tasks with their secrets: only its owner may read it, also when
/// an earlier build created it with the default umask. Records written by an earlier
/// build (the envelope as an array of byte values, finished records among the live
/// ones) read back, and the finished ones move out of the live list at open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redb_file_is_private_and_earlier_records_read_back() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.redb");
    {
        let store = Embedded::open(&path).unwrap();
        store.persist(&record(70, DOCKER)).await.unwrap();
    }
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    {
        // An earlier build's records, written straight into its table.
        let db = redb::Database::create(&path).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut records = txn.open_table(redb::TableDefinition::<&str, (u64, &[u8])>::new("records")).unwrap();
            for (n, state) in [(71, r#"{"state":"pending"}"#), (72, r#"{"state":"terminal","result":"RESULT_SUCCESS"}"#)] {
                let old = format!(
                    r#"{{"assignment_id":"gitea-task-{n}","placement":"container.docker","runner":"","state":{state},"envelope":[123,125],"environment":null,"updated_at_ms":5,"created_at_ms":5}}"#
                );
                records.insert(format!("gitea-task-{n}").as_str(), (3u64, old.as_bytes())).unwrap();
            }
        }
        txn.commit().unwrap();
    }
    let store = Embedded::open(&path).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600, "an existing file is made private");
    let old = store.get(&id(71)).await.unwrap().unwrap();
    assert_eq!((old.value.envelope.as_slice(), old.revision), (b"{}".as_slice(), 3));
    let mut live: Vec<String> = store.list().await.unwrap().into_iter().map(|r| r.value.assignment_id).collect();
    live.sort();
    assert_eq!(live, [id(70), id(71)]);
    let finished = store.list_finished().await.unwrap();
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0].value.assignment_id, id(72));
    // New records keep the envelope as text, not as an array of numbers.
    let mut text = record(73, DOCKER);
    text.envelope = br#"{"version":2,"task":"CAE="}"#.to_vec();
    store.persist(&text).await.unwrap();
    drop(store);
    let db = redb::Database::create(&path).unwrap();
    let txn = redb::ReadableDatabase::begin_read(&db).unwrap();
    let table = txn.open_table(redb::TableDefinition::<&str, (u64, &[u8])>::new("records")).unwrap();
    let stored = String::from_utf8(table.get(id(73).as_str()).unwrap().unwrap().value().1.to_vec()).unwrap();
    assert!(stored.contains(r#""envelope":"{\"version\":2,\"task\":\"CAE=\"}""#), "{stored}");
}

/// A NATS server that requires a token: the store reaches it with `store.token_file`
/// (never a URL with credentials, which would end up in logs); without the token it is
/// refused, and the error names the server without any secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_server_with_a_token_is_reached_with_the_token_file() {
    use controller::store::jetstream::{Settings, redact_url};
    let server = nats::NatsServer::start_with_config(Some("authorization { token: \"s3cret-nats-token\" }"));
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("nats-token");
    std::fs::write(&token_file, "s3cret-nats-token\n").unwrap();
    let settings = Settings { token_file: Some(token_file), ..Settings::new(&server.url, "ci.assignments", "assignments", Duration::from_secs(30)) };
    let store = JetStream::connect_with(&settings).await.unwrap();
    store.persist(&record(80, DOCKER)).await.unwrap();
    assert!(store.get(&id(80)).await.unwrap().is_some());
    let refused = tokio::time::timeout(Duration::from_secs(20), JetStream::connect_with(&Settings { token_file: None, ..settings.clone() })).await;
    if let Ok(Ok(_)) = refused {
        panic!("a server that requires a token took a client without one");
    }
    assert_eq!(redact_url("nats://user:pw@a:4222, nats://b:4222"), "nats://***@a:4222, nats://b:4222");
    assert!(!format!("{settings:?}").contains("s3cret"));
}

/// The live bucket's stream keeps no trace of finished records: a KV delete leaves a
/// marker per key, and the subjects a sweep reads grew with every record ever finished
/// (13 s per sweep at 100k finished, scripts/bench sweep). A marker left by an earlier
/// version (or a move cut short) is purged by the next list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_records_leave_no_marker_in_the_live_stream() {
    use futures_util::TryStreamExt as _;
    let server = nats::NatsServer::start();
    let store = JetStream::connect(&server.url, "ci.assignments", "assignments", Duration::from_secs(30)).await.unwrap();
    for n in 0..30 {
        store.persist(&record(200 + n, DOCKER)).await.unwrap();
    }
    for n in 0..25 {
        let current = store.get(&id(200 + n)).await.unwrap().unwrap();
        store.update(&current.value.ended("RESULT_SUCCESS".into(), None), current.revision).await.unwrap();
    }
    let client = async_nats::connect(&server.url).await.unwrap();
    let jetstream = async_nats::jetstream::new(client);
    let subjects = || async {
        let stream = jetstream.get_stream("KV_assignments").await.unwrap();
        let subjects: Vec<(String, usize)> = stream.info_with_subjects("$KV.assignments.>").await.unwrap().try_collect().await.unwrap();
        subjects.len()
    };
    assert_eq!(subjects().await, 5, "only the live records have subjects");
    // A marker as an earlier version left it.
    let kv = jetstream.get_key_value("assignments").await.unwrap();
    kv.delete(&id(225)).await.unwrap();
    assert_eq!(subjects().await, 5, "the delete marker has a subject");
    assert_eq!(store.list().await.unwrap().len(), 4);
    assert_eq!(subjects().await, 4, "the list purged the marker");
    assert_eq!(store.list_finished().await.unwrap().len(), 25);
}
