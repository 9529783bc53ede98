//! Scheduler benchmark (run by `scripts/bench controller`): 1,000 tasks from the fake
//! Gitea through the real Gitea client and scheduler into each store backend.
//! Prints assignments persisted per second, p50/p99 latency from FetchTask's reply to
//! persisted, the rate at which the fake Gitea alone hands out tasks (the ceiling the
//! controller must not fall below), and the process RSS with 1,000 pending assignments.
//! Asserts nothing about timing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use testkit::nats;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use controller::{
    assignment::{Placement, Rules, placement::LabelPolicy},
    gitea::{
        self,
        registrations::{RegistrationSettings, Registrations},
    },
    placements::Placements,
    scheduler::{Outcome, Scheduler, SchedulerConfig},
    store::{Store, embedded::Embedded, jetstream::JetStream},
};
use testkit::fake_gitea::{FakeGitea, Job, REGISTRATION_TOKEN};
use tokio_util::sync::CancellationToken;

const TASKS: usize = 1_000;
const LOOPS: usize = 8;

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index].as_secs_f64() * 1000.0
}

async fn gitea_with_jobs(dir: &std::path::Path) -> (FakeGitea, gitea::Gitea) {
    let fake = FakeGitea::start().await;
    for _ in 0..TASKS {
        fake.add_job(Job::new(&["disposable", "container", "docker"]));
    }
    std::fs::write(dir.join("token"), REGISTRATION_TOKEN).unwrap();
    let settings = RegistrationSettings {
        url: fake.url(),
        credential_dir: dir.join("runners"),
        registration_token_file: Some(dir.join("token")),
        runner_name: "bench".into(),
        labels: LabelPolicy::default(),
    };
    let registrations = Registrations::open(&settings, &[Placement::CONTAINER_DOCKER]).await.unwrap();
    (fake, registrations.fetcher(Placement::CONTAINER_DOCKER).unwrap().clone())
}

/// FetchTask alone from LOOPS concurrent callers: how fast the fake hands out tasks.
async fn fetch_ceiling() -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let (_fake, client) = gitea_with_jobs(dir.path()).await;
    let started = Instant::now();
    let mut loops = tokio::task::JoinSet::new();
    let remaining = Arc::new(std::sync::atomic::AtomicUsize::new(TASKS));
    for _ in 0..LOOPS {
        let (client, remaining) = (client.clone(), Arc::clone(&remaining));
        loops.spawn(async move {
            while remaining.load(std::sync::atomic::Ordering::SeqCst) > 0 {
                if client.fetch_task(0, Duration::from_secs(5)).await.unwrap().task.is_some() {
                    remaining.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                }
            }
        });
    }
    while loops.join_next().await.is_some() {}
    TASKS as f64 / started.elapsed().as_secs_f64()
}

async fn pipeline(name: &str, store: Arc<dyn Store>) {
    let dir = tempfile::tempdir().unwrap();
    let (_fake, client) = gitea_with_jobs(dir.path()).await;
    let (observer, mut outcomes) = tokio::sync::mpsc::unbounded_channel();
    // Capacity for every task: this measures fetching and persisting, not admission.
    let mut placements = Placements::new();
    placements.add(Placement::CONTAINER_DOCKER, TASKS, None);
    let scheduler = Arc::new(
        Scheduler::new(
            Placement::CONTAINER_DOCKER,
            client,
            Arc::clone(&store),
            placements,
            SchedulerConfig {
                rules: Rules { trust_domain: "example.org".into(), labels: LabelPolicy::default() },
                max_loops: LOOPS,
                fetch_interval: Duration::from_millis(20),
                fetch_interval_max: Duration::from_millis(20),
                fetch_timeout: Duration::from_secs(5),
            },
        )
        .with_observer(observer),
    );
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let running = tokio::spawn(Arc::clone(&scheduler).run(shutdown.clone()));
    let mut latencies = Vec::with_capacity(TASKS);
    while latencies.len() < TASKS {
        match outcomes.recv().await {
            Some(Outcome::Persisted { latency, .. }) => latencies.push(latency),
            Some(other) => panic!("unexpected {other:?}"),
            None => break,
        }
    }
    let elapsed = started.elapsed();
    shutdown.cancel();
    let _ = running.await;
    latencies.sort();
    println!(
        "{name:<10} {:>7.0} assignments/s   FetchTask reply → persisted: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms   RSS with {} pending: {} KiB",
        TASKS as f64 / elapsed.as_secs_f64(),
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.99),
        percentile(&latencies, 1.0),
        store.list().await.unwrap().len(),
        testkit::rss_kib()
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    println!("{TASKS} tasks from the fake Gitea (in this process), {LOOPS} FetchTask loops, 2 worker threads");
    println!("fake Gitea alone hands out {:.0} tasks/s (FetchTask without persisting)", fetch_ceiling().await);
    let dir = std::env::var_os("BENCH_DIR").map_or_else(std::env::temp_dir, std::path::PathBuf::from);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("pipeline-{}.redb", std::process::id()));
    pipeline("embedded", Arc::new(Embedded::open(&file).unwrap())).await;
    let _ = std::fs::remove_file(&file);
    let server = nats::NatsServer::start();
    let store = JetStream::connect(&server.url, "bench.assignments", "bench-assignments", Duration::from_secs(30)).await.unwrap();
    pipeline("jetstream", Arc::new(store)).await;
    println!("(RSS is this whole process: the fake Gitea's state for 1,000 tasks included)");
}
