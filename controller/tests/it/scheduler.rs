//! The scheduler and the registrations against the fake Gitea, for what needs fault
//! injection or exact counts: one registration per placement with its own labels and
//! credential, reused on later starts; clear errors for a wrong token and an unknown
//! runner; an outage ridden out; tasks_version honoured (Gitea is asked to pick a task
//! only when something changed); a full placement leaves its jobs waiting in Gitea;
//! tasks that cannot run here failed at once with the reason. The same behaviours
//! against the real Gitea are in tests/e2e.

use std::{sync::Arc, time::Duration};

use crate::common::{
    counting_store::{CountingStore, Event},
    fake_gitea::{FakeGitea, Job, REGISTRATION_TOKEN},
};
use controller::{
    assignment::{
        Assignment, Placement, Rules,
        placement::{LabelPolicy, declared_labels},
    },
    gitea::{
        self, GiteaError,
        registrations::{RegistrationSettings, Registrations},
    },
    lifecycle::Lifecycle,
    placements::Placements,
    scheduler::{Outcome, Scheduler, SchedulerConfig},
    store::{State, Store, embedded::Embedded},
};
use proto::runner::v1::Result as TaskResult;
use tokio_util::sync::CancellationToken;

const DOCKER: Placement = Placement::CONTAINER_DOCKER;
const KUBERNETES: Placement = Placement::CONTAINER_KUBERNETES;

fn settings(fake: &FakeGitea, dir: &std::path::Path) -> RegistrationSettings {
    let token_file = dir.join("registration-token");
    std::fs::write(&token_file, format!("{REGISTRATION_TOKEN}\n")).unwrap();
    RegistrationSettings {
        url: fake.url(),
        credential_dir: dir.join("runners"),
        registration_token_file: Some(token_file),
        runner_name: "ctl".into(),
        labels: LabelPolicy::default(),
    }
}

fn rules() -> Rules {
    Rules { trust_domain: "example.org".into(), labels: LabelPolicy::default() }
}

#[tokio::test]
async fn one_registration_per_placement_registered_once_then_reused() {
    let fake = FakeGitea::start().await;
    let dir = tempfile::tempdir().unwrap();
    let settings = settings(&fake, dir.path());
    Registrations::open(&settings, &[DOCKER, KUBERNETES]).await.unwrap();
    use std::os::unix::fs::PermissionsExt;
    for placement in [DOCKER, KUBERNETES] {
        let file = settings.credential_file(placement);
        assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600, "{}", file.display());
    }
    let first: Vec<_> = [DOCKER, KUBERNETES].map(|p| gitea::Credential::load(&settings.credential_file(p)).unwrap().unwrap()).into();
    Registrations::open(&settings, &[DOCKER, KUBERNETES]).await.unwrap();
    let second: Vec<_> = [DOCKER, KUBERNETES].map(|p| gitea::Credential::load(&settings.credential_file(p)).unwrap().unwrap()).into();
    assert_eq!(first, second);
    assert_eq!(first[0].name, "ctl-container.docker");
    fake.with(|s| {
        assert_eq!(s.registrations, 2, "a later start registered again");
        assert_eq!(s.declares, 4);
        assert_eq!(s.capabilities, ["cancelling"]);
        assert_eq!(s.runners[&first[0].uuid].1, declared_labels(DOCKER, &LabelPolicy::default()));
        assert_eq!(s.runners[&first[1].uuid].1, ["container", "disposable", "kubernetes"]);
    });
}

#[tokio::test]
async fn a_wrong_registration_token_and_an_unknown_runner_are_clear_errors() {
    let fake = FakeGitea::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut settings = settings(&fake, dir.path());
    let wrong = dir.path().join("wrong-token");
    std::fs::write(&wrong, "wrong").unwrap();
    settings.registration_token_file = Some(wrong);
    let error = Registrations::open(&settings, &[DOCKER]).await.unwrap_err();
    assert!(matches!(error, GiteaError::RegistrationRefused(_)), "{error}");
    assert!(error.to_string().contains("registration token"), "{error}");

    let file = settings.credential_file(DOCKER);
    let stale = gitea::Credential { id: 1, uuid: "gone".into(), name: "ctl".into(), token: "t".into(), address: fake.url() };
    stale.store(&file).unwrap();
    let error = Registrations::open(&settings, &[DOCKER]).await.unwrap_err();
    assert!(matches!(error, GiteaError::Unregistered { .. }), "{error}");
    assert!(error.to_string().contains(&file.display().to_string()), "{error}");
    assert!(error.to_string().contains("unregistered runner"), "{error}");
}

struct Started {
    store: Arc<dyn Store>,
    placements: Placements,
    lifecycle: Lifecycle,
    outcomes: tokio::sync::mpsc::UnboundedReceiver<Outcome>,
    shutdown: CancellationToken,
    running: tokio::task::JoinHandle<Result<(), GiteaError>>,
}

/// A scheduler for container.docker (capacity given) beside an enabled container.kubernetes.
async fn start(fake: &FakeGitea, dir: &std::path::Path, capacity: usize) -> Started {
    start_with(fake, dir, capacity, Arc::new(Embedded::open(&dir.join("store.redb")).unwrap())).await
}

async fn start_with(fake: &FakeGitea, dir: &std::path::Path, capacity: usize, store: Arc<dyn Store>) -> Started {
    let interval = Duration::from_millis(50);
    start_paced(fake, dir, capacity, store, (interval, interval)).await
}

/// As [`start_with`], with the loops' (fetch_interval, fetch_interval_max).
async fn start_paced(fake: &FakeGitea, dir: &std::path::Path, capacity: usize, store: Arc<dyn Store>, pace: (Duration, Duration)) -> Started {
    let registrations = Registrations::open(&settings(fake, dir), &[DOCKER]).await.unwrap();
    let mut placements = Placements::new();
    placements.add(DOCKER, capacity, None);
    placements.add(KUBERNETES, 10, None);
    let (observer, outcomes) = tokio::sync::mpsc::unbounded_channel();
    let config = SchedulerConfig { fetch_interval: pace.0, fetch_interval_max: pace.1, ..crate::common::scheduler_config(rules()) };
    let scheduler = Arc::new(
        Scheduler::new(DOCKER, registrations.fetcher(DOCKER).unwrap().clone(), Arc::clone(&store), placements.clone(), config).with_observer(observer),
    );
    let lifecycle = Lifecycle::new(Arc::clone(&store), placements.clone(), registrations);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(Arc::clone(&scheduler).run(shutdown.clone()));
    Started { store, placements, lifecycle, outcomes, shutdown, running }
}

async fn collect(outcomes: &mut tokio::sync::mpsc::UnboundedReceiver<Outcome>, n: usize) -> Vec<Outcome> {
    let mut seen = Vec::new();
    while seen.len() < n {
        let outcome = tokio::time::timeout(Duration::from_secs(20), outcomes.recv()).await.expect("scheduler stalled").unwrap();
        seen.push(outcome);
    }
    seen
}

#[tokio::test]
async fn tasks_become_persisted_assignments_and_bad_ones_fail_at_once() {
    let fake = FakeGitea::start().await;
    let dir = tempfile::tempdir().unwrap();
    for _ in 0..3 {
        fake.add_job(Job::new(&["disposable", "container", "docker"]));
    }
    fake.add_job(Job::new(&["disposable", "docker"])); // a driver without a class
    fake.add_job(Job::new(&["disposable", "container"])); // kubernetes by default
    let mut started = start(&fake, dir.path(), 10).await;
    let seen = collect(&mut started.outcomes, 5).await;
    started.shutdown.cancel();
    started.running.await.unwrap().unwrap();

    let rejected: Vec<_> = seen
        .iter()
        .filter_map(|o| match o {
            Outcome::Rejected { task_id, reason } => Some((*task_id, reason.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(rejected.len(), 1, "{seen:?}");
    let (bad_task, reason) = &rejected[0];
    assert!(reason.contains("without a workload class"), "{reason}");
    fake.with(|s| {
        let record = &s.tasks[bad_task];
        assert_eq!(record.final_result, Some(TaskResult::Failure as i32));
        assert!(record.stopped_at > 0, "the final state carries stopped_at");
        assert!(record.sealed);
        assert_eq!(record.log.last().unwrap(), &format!("gitea-dynamic-runner: this job cannot run: {reason}"));
        assert!(s.waiting.is_empty());
        assert_eq!(s.tasks.len(), 5, "each job handed out exactly once");
    });

    let records = started.store.list().await.unwrap();
    assert_eq!(records.len(), 4);
    let mut placements: Vec<_> = records.iter().map(|r| r.value.placement).collect();
    placements.sort();
    assert_eq!(placements, [KUBERNETES, DOCKER, DOCKER, DOCKER]);
    let runner = fake.with(|s| s.runners.keys().next().unwrap().clone());
    for record in &records {
        assert_eq!(record.value.state, State::Pending);
        assert_eq!(record.value.runner, runner, "the fetching runner is recorded");
        let assignment = Assignment::decode(&record.value.envelope, &rules()).unwrap();
        assert_eq!(assignment.id, record.value.assignment_id);
        assert_eq!(assignment.identity.spiffe_id, format!("spiffe://example.org/ci/owner/repo/build/{}", assignment.task.id));
        assert!(fake.with(|s| s.tasks.contains_key(&assignment.task.id)));
    }
    // The kubernetes task fetched by the docker registration counts against kubernetes.
    assert_eq!(started.placements.get(KUBERNETES).unwrap().admission.usage(), (1, 0));
    assert_eq!(started.placements.get(DOCKER).unwrap().admission.usage(), (3, 0));
}

/// A bare 401 (a proxy's, during a rollout) is retried; a runner Gitea no longer knows
/// stops its own placement only — said in `/readyz` and a metric — while the other
/// placement keeps fetching and nothing stops the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_runner_stops_its_placement_only_and_a_bare_401_is_retried() {
    let fake = FakeGitea::start().await;
    let dir = tempfile::tempdir().unwrap();
    let registrations = Registrations::open(&settings(&fake, dir.path()), &[DOCKER, KUBERNETES]).await.unwrap();
    let store: Arc<dyn Store> = Arc::new(Embedded::open(&dir.path().join("store.redb")).unwrap());
    let mut placements = Placements::new();
    placements.add(DOCKER, 4, None);
    placements.add(KUBERNETES, 4, None);
    let metrics = Arc::new(controller::metrics::Metrics::new());
    metrics.set_ready(true);
    let (observer, mut outcomes) = tokio::sync::mpsc::unbounded_channel();
    let config = SchedulerConfig { max_loops: 2, ..crate::common::scheduler_config(rules()) };
    let shutdown = CancellationToken::new();
    let mut running = Vec::new();
    for placement in [DOCKER, KUBERNETES] {
        let scheduler = Scheduler::new(placement, registrations.fetcher(placement).unwrap().clone(), Arc::clone(&store), placements.clone(), config.clone())
            .with_observer(observer.clone())
            .with_metrics(Arc::clone(&metrics));
        running.push(tokio::spawn(Arc::new(scheduler).run(shutdown.clone())));
    }
    fake.with(|s| s.unauthorized_fetches = 6);
    fake.add_job(Job::new(&["disposable", "container", "docker"]));
    assert!(matches!(collect(&mut outcomes, 1).await[0], Outcome::Persisted { .. }), "fetched after the 401s");
    assert_eq!(fake.with(|s| s.unauthorized_fetches), 0);

    let docker_uuid = controller::gitea::TaskReports::runner_uuid(registrations.fetcher(DOCKER).unwrap()).to_owned();
    fake.with(|s| s.runners.remove(&docker_uuid));
    testkit::wait_until("the docker placement stops fetching", Duration::from_secs(10), || {
        metrics.encode().contains("gdr_placement_fetching{placement=\"container.docker\"} 0")
    })
    .await;
    fake.add_job(Job::new(&["disposable", "container", "kubernetes"]));
    assert!(matches!(collect(&mut outcomes, 1).await[0], Outcome::Persisted { placement: KUBERNETES, .. }));
    assert!(!shutdown.is_cancelled(), "one deleted runner stopped the whole controller");
    assert!(metrics.encode().contains("gdr_placement_fetching{placement=\"container.kubernetes\"} 1"));
    shutdown.cancel();
    for scheduler in running {
        scheduler.await.unwrap().unwrap();
    }
}

/// On JetStream (a real nats-server, its default 1 MiB max_payload): a task with a large
/// event payload is stored; one that no server would take fails in Gitea at once with
/// the reason, and the loop goes on fetching (it once retried the write until shutdown).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_the_store_cannot_take_fails_in_gitea_with_the_reason() {
    let nats = testkit::nats::NatsServer::start();
    let store: Arc<dyn Store> =
        Arc::new(controller::store::jetstream::JetStream::connect(&nats.url, "ci.assignments", "ci-assignments", Duration::from_secs(30)).await.unwrap());
    let fake = FakeGitea::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut large = Job::new(&["disposable", "container", "docker"]);
    large.event = Some(format!("{{\"commits\": \"{}\"}}", "c".repeat(600 << 10)));
    let mut too_large = Job::new(&["disposable", "container", "docker"]);
    // Secrets do not compress: 2 MiB of them, well over what the server takes.
    too_large.secrets = (0..32).map(|i| (format!("SECRET_{i}"), fastrand::alphanumeric().to_string().repeat(64 << 10))).collect();
    let after = Job::new(&["disposable", "container", "docker"]);
    for job in [large, too_large, after] {
        fake.add_job(job);
    }
    let mut started = start_with(&fake, dir.path(), 10, store).await;
    let seen = collect(&mut started.outcomes, 3).await;
    started.shutdown.cancel();
    started.running.await.unwrap().unwrap();
    let rejected: Vec<&Outcome> = seen.iter().filter(|o| matches!(o, Outcome::Rejected { .. })).collect();
    assert_eq!(rejected.len(), 1, "{seen:?}");
    let Outcome::Rejected { task_id, reason } = rejected[0] else { unreachable!() };
    assert!(reason.contains("cannot store this task") && reason.contains("max_payload"), "{reason}");
    fake.with(|s| {
        let record = &s.tasks[task_id];
        assert_eq!(record.final_result, Some(TaskResult::Failure as i32));
        assert!(record.log.last().unwrap().contains("max_payload"), "{:?}", record.log);
    });
    let stored = started.store.list().await.unwrap();
    assert_eq!(stored.len(), 2, "the large task and the one after it");
    assert_eq!(started.placements.get(DOCKER).unwrap().admission.usage(), (2, 0), "the refused task holds no room");
}

#[tokio::test]
async fn an_outage_of_gitea_is_ridden_out_and_tasks_version_is_honoured() {
    let fake = FakeGitea::start().await;
    let dir = tempfile::tempdir().unwrap();
    fake.with(|s| s.fail_fetches = 3);
    let mut started = start(&fake, dir.path(), 4).await;
    // Idle polls with the latest tasks_version: Gitea is asked, but not to pick a task.
    testkit::wait_until("the loops poll through the outage (8 fetches)", Duration::from_secs(20), || fake.with(|s| s.fetches) >= 8).await;
    assert_eq!(fake.with(|s| s.fail_fetches), 0, "the outage was not ridden out");
    let (picks_while_idle, fetches) = fake.with(|s| (s.picks, s.fetches));
    assert!(picks_while_idle <= 4, "idle polls with the latest tasks_version asked Gitea to pick: {picks_while_idle}");
    // Two more rounds of the 4 loops' idle polls: with the latest tasks_version, none picks.
    testkit::wait_until("8 more idle polls", Duration::from_secs(20), || fake.with(|s| s.fetches) >= fetches + 8).await;
    assert_eq!(fake.with(|s| s.picks), picks_while_idle, "polls with the latest tasks_version must not pick");
    fake.add_job(Job::new(&["disposable", "container", "docker"]));
    collect(&mut started.outcomes, 1).await;
    assert!(fake.with(|s| s.picks) > picks_while_idle, "a new job (version bumped) was not picked");
    started.shutdown.cancel();
    started.running.await.unwrap().unwrap();
    assert_eq!(started.store.list().await.unwrap().len(), 1);
}

/// Capacity 1: the second job stays waiting in Gitea (not fetched, not in our queue)
/// until the first assignment ends; then it is fetched at once.
#[tokio::test]
async fn a_full_placement_leaves_its_jobs_waiting_in_gitea() {
    let fake = FakeGitea::start().await;
    let dir = tempfile::tempdir().unwrap();
    fake.add_job(Job::new(&["disposable", "container", "docker"]));
    fake.add_job(Job::new(&["disposable", "container", "docker"]));
    let store = CountingStore::new(Arc::new(Embedded::open(&dir.path().join("store.redb")).unwrap()));
    let mut started = start_with(&fake, dir.path(), 1, Arc::clone(&store) as Arc<dyn Store>).await;
    let first = match collect(&mut started.outcomes, 1).await.remove(0) {
        Outcome::Persisted { assignment_id, .. } => assignment_id,
        other => panic!("{other:?}"),
    };
    // The full loop's chance: it looks again at the store for room (is the first
    // assignment over?), and still does not fetch.
    let seen = store.events().len();
    let looked = Event::Get { assignment_id: first.clone() };
    testkit::wait_until("the full loop looked at its room again", Duration::from_secs(10), || store.events()[seen..].contains(&looked)).await;
    fake.with(|s| {
        assert_eq!(s.tasks.len(), 1, "a task was fetched beyond capacity");
        assert_eq!(s.waiting.len(), 1, "the second job must wait in Gitea");
    });
    assert!(started.outcomes.try_recv().is_err());
    let ended = std::time::Instant::now();
    started.lifecycle.finish(&first, TaskResult::Success as i32).await.unwrap();
    let second = collect(&mut started.outcomes, 1).await;
    assert!(matches!(second[0], Outcome::Persisted { .. }), "{second:?}");
    assert!(ended.elapsed() < Duration::from_secs(2), "the freed slot was not used at once: {:?}", ended.elapsed());
    fake.with(|s| assert!(s.waiting.is_empty() && s.tasks.len() == 2));
    started.shutdown.cancel();
    started.running.await.unwrap().unwrap();
}

/// The poll's pace: idle loops back off to `fetch_interval_max` (an idle controller costs
/// Gitea no more than that), and a job that ends — which often queues the jobs that need
/// it — makes them fetch at once and poll fast again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_loops_back_off_and_an_ended_job_brings_them_back_at_once() {
    let fake = FakeGitea::start().await;
    let dir = tempfile::tempdir().unwrap();
    fake.add_job(Job::new(&["disposable", "container", "docker"]));
    let store: Arc<dyn Store> = Arc::new(Embedded::open(&dir.path().join("store.redb")).unwrap());
    // Two loops, 100 ms doubling to 1.6 s: after 100+200+400+800 ms each waits 1.6 s.
    let mut started = start_paced(&fake, dir.path(), 2, store, (Duration::from_millis(100), Duration::from_millis(1600))).await;
    let first = match collect(&mut started.outcomes, 1).await.remove(0) {
        Outcome::Persisted { assignment_id, .. } => assignment_id,
        other => panic!("{other:?}"),
    };
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let before = fake.with(|s| s.fetches);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let idle_fetches = fake.with(|s| s.fetches) - before;
    // Without the backoff: two loops every 100 ms, about 32.
    assert!((1..=4).contains(&idle_fetches), "{idle_fetches} fetches in 1.6 s of idling (two loops backed off to 1.6 s: 2)");

    let before = fake.with(|s| s.fetches);
    started.lifecycle.finish(&first, TaskResult::Success as i32).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let at_once = fake.with(|s| s.fetches) - before;
    tokio::time::sleep(Duration::from_millis(750)).await;
    let soon_after = fake.with(|s| s.fetches) - before;
    assert!(at_once >= 1, "no loop fetched within 50 ms of the job's end");
    // Each loop at once, then after 100, 200 and 400 ms: 8; backed off: at most 2.
    assert!(soon_after >= 5, "{soon_after} fetches in the 800 ms after a job ended: the loops did not poll fast again");
    started.shutdown.cancel();
    started.running.await.unwrap().unwrap();
}

/// Two schedulers of one registration (as in two controller replicas, each with its own
/// admission) share one store: only the lease holder fetches, so together they never take
/// more than the capacity from Gitea; a clean stop hands over at once, a vanished holder
/// after the lease's time-to-live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_schedulers_of_one_registration_take_turns() {
    let fake = FakeGitea::start().await;
    let dir = tempfile::tempdir().unwrap();
    for _ in 0..3 {
        fake.add_job(Job::new(&["disposable", "container", "docker"]));
    }
    let registrations = Registrations::open(&settings(&fake, dir.path()), &[DOCKER]).await.unwrap();
    let store = CountingStore::new(Arc::new(Embedded::open(&dir.path().join("store.redb")).unwrap()));
    let replica = |lease_ttl: Duration| {
        let mut placements = Placements::new();
        placements.add(DOCKER, 1, None);
        let (observer, outcomes) = tokio::sync::mpsc::unbounded_channel();
        let config = crate::common::scheduler_config(rules());
        let scheduler = Arc::new(
            Scheduler::new(DOCKER, registrations.fetcher(DOCKER).unwrap().clone(), Arc::clone(&store) as Arc<dyn Store>, placements.clone(), config)
                .with_observer(observer)
                .with_lease_ttl(lease_ttl),
        );
        let lifecycle = Lifecycle::new(Arc::clone(&store) as Arc<dyn Store>, placements, registrations.clone());
        (scheduler, lifecycle, outcomes)
    };
    let unfinished = || fake.with(|s| s.tasks.values().filter(|t| t.final_result.is_none()).count());
    let (first, first_lifecycle, mut first_outcomes) = replica(Duration::from_secs(2));
    let (second, _, mut second_outcomes) = replica(Duration::from_secs(2));
    let (stop_first, stop_second) = (CancellationToken::new(), CancellationToken::new());
    let running_first = tokio::spawn(Arc::clone(&first).run(stop_first.clone()));
    let assignment = match collect(&mut first_outcomes, 1).await.remove(0) {
        Outcome::Persisted { assignment_id, .. } => assignment_id,
        other => panic!("{other:?}"),
    };
    let leader = store.events().iter().find_map(|e| match e {
        Event::Lease { holder, granted: true } => Some(holder.clone()),
        _ => None,
    });
    let refused_to_standby =
        || store.events().iter().filter(|e| matches!(e, Event::Lease { holder, granted: false } if Some(holder) != leader.as_ref())).count();
    let running_second = tokio::spawn(Arc::clone(&second).run(stop_second.clone()));
    // The standby's chances: it asked for the lease twice, was refused, and did not fetch.
    testkit::wait_until("the standby was refused the lease twice", Duration::from_secs(10), || refused_to_standby() >= 2).await;
    assert_eq!(fake.with(|s| s.tasks.len()), 1, "the standby fetched beyond the capacity of 1");
    assert!(second_outcomes.try_recv().is_err());

    // The leader stops cleanly with its assignment still live: the standby takes over at
    // once, counts that assignment, and fetches only once it has ended.
    stop_first.cancel();
    running_first.await.unwrap().unwrap();
    // Its chance: it took the lease, then looked at its room (is that assignment over?)
    // — since the leader stopped, only it reads the store.
    let stopped = store.events().len();
    let looked = Event::Get { assignment_id: assignment.clone() };
    testkit::wait_until("the standby took over and looked at its room", Duration::from_secs(10), || {
        let events = store.events();
        let took = events.iter().position(|e| matches!(e, Event::Lease { holder, granted: true } if Some(holder) != leader.as_ref()));
        took.is_some_and(|took| events[took.max(stopped)..].contains(&looked))
    })
    .await;
    assert_eq!(unfinished(), 1, "the new leader fetched while an assignment was live");
    assert_eq!(fake.with(|s| s.tasks.len()), 1);
    first_lifecycle.finish(&assignment, TaskResult::Success as i32).await.unwrap();
    fake.with(|s| s.tasks.values_mut().for_each(|t| t.final_result = t.final_result.or(Some(TaskResult::Success as i32))));
    let taken = collect(&mut second_outcomes, 1).await;
    assert!(matches!(taken[0], Outcome::Persisted { .. }), "{taken:?}");
    assert_eq!(unfinished(), 1);
    stop_second.cancel();
    running_second.await.unwrap().unwrap();
}
