//! The random kill campaign with real environments: the real Gitea 1.23.8, the real
//! controller binary as two processes (`scheduler,worker` and `facade`, a split
//! deployment) on a real three-node NATS cluster with three replicas, and the runner
//! image with the static supervisor as PID 1 and the real gitea-runner v3.3.0 on a real
//! dockerd. Gitea sits behind a fault proxy for the controller (jobs reach it directly).
//!
//! Every iteration commits a run of two jobs (each prints, sleeps, prints again) and, at
//! a random moment, does one thing to the system:
//! - stops a controller process with SIGTERM, or kills it with SIGKILL, and starts it again;
//! - kills a NATS node and starts it again with its storage;
//! - kills an environment before its claim (the facade held with SIGSTOP meanwhile), or
//!   after it;
//! - makes Gitea answer the runner API with 401 or 503 for a few seconds.
//!
//! Invariants, checked against Gitea's own record of each job: every task ends, exactly
//! once — with its true result (success, its whole log) unless its environment was killed
//! after the claim, and then with the reason as the last line of its log; a job never ran
//! twice (its first line appears once); never more environments than the capacity; at the
//! end no container, no loop device and no live record is left. Tasks lost in the
//! documented window between FetchTask's reply and the persist (a SIGKILL can fall there)
//! are listed, not hidden. A table is printed.
//!
//! `GDR_CAMPAIGN_ITERATIONS` (default 4; `scripts/check chaos` runs 100) and `GDR_CAMPAIGN_SEED`
//! (default: the clock; printed so a failing run can be repeated).

use std::{
    collections::BTreeMap,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use controller::store::{Records as _, State, jetstream::JetStream};
use e2e::docker::host;
use testkit::{
    controller_config::ControllerConfig,
    fault_proxy::FaultProxy,
    gitea::{Gitea, GiteaOptions, Repo, TaskInfo, strip_log_timestamps},
    nats::NatsCluster,
    process::ControllerProcess,
};

const CAPACITY: usize = 3;
const JOBS: usize = 2;
const SUBJECT: &str = "ci.assignments";
const BUCKET: &str = "ci-assignments";
/// How long an iteration's jobs may take to end after the fault.
const SETTLE: Duration = Duration::from_secs(240);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    WorkerTerm,
    WorkerKill,
    FacadeTerm,
    FacadeKill,
    NatsNode,
    EnvironmentBeforeClaim,
    EnvironmentAfterClaim,
    Gitea401,
    Gitea503,
}

impl Fault {
    const ALL: [Fault; 9] = [
        Fault::WorkerTerm,
        Fault::WorkerKill,
        Fault::FacadeTerm,
        Fault::FacadeKill,
        Fault::NatsNode,
        Fault::EnvironmentBeforeClaim,
        Fault::EnvironmentAfterClaim,
        Fault::Gitea401,
        Fault::Gitea503,
    ];
}

/// One controller process of the real binary, started again after each stop.
struct Process {
    name: &'static str,
    process: ControllerProcess,
}

impl std::ops::Deref for Process {
    type Target = ControllerProcess;
    fn deref(&self) -> &ControllerProcess {
        &self.process
    }
}

impl std::ops::DerefMut for Process {
    fn deref_mut(&mut self) -> &mut ControllerProcess {
        &mut self.process
    }
}

/// Up to a minute to drain after SIGTERM; then it is killed like a Pod past its grace period.
const DRAIN: Duration = Duration::from_secs(60);

fn config(dir: &Path, registration_token: &str, proxy: &str, gitea: &str, nats: &str, image: &str, installation: &str) -> ControllerConfig {
    ControllerConfig::new(dir, proxy, registration_token)
        .set("gitea.environment_url", gitea)
        .set("gitea.installation", installation)
        .set("gitea.fetch_interval", "300ms")
        .set("gitea.fetch_interval_max", "300ms")
        .set("gitea.reconcile_interval", "2s")
        .set("gitea.lease_ttl", "3s")
        .set("identity.trust_domain", "e2e.test")
        .jetstream(nats)
        .set("store.subject", SUBJECT)
        .set("store.bucket", BUCKET)
        .set("store.ack_wait", "5s")
        .set("store.replicas", 3)
        .pool("container.docker", CAPACITY)
        .set("docker.image", image)
        .set("docker.socket", host().socket.display().to_string())
        .merge(e2e::stack::JOB_DOCKERD_PRIVILEGES)
        .set("docker.memory", "1G")
        .set("docker.cpus", "1")
}

fn workflow(iteration: usize, rng: &mut fastrand::Rng) -> String {
    let sleep = rng.u32(3..9);
    format!(
        r#"name: campaign
on: push
jobs:
  job:
    strategy:
      matrix:
        n: [1, 2]
    runs-on: [disposable, container, docker]
    steps:
      - run: echo "job-$(( {iteration} * 10 + ${{{{ matrix.n }}}} ))-began"
      - run: sleep {sleep}
      - run: echo "job-$(( {iteration} * 10 + ${{{{ matrix.n }}}} ))-ended"
"#
    )
}

/// What job `n` of `iteration` prints (computed by the shell, so the step's own text in
/// the log does not contain it).
fn marker(iteration: usize, n: usize, what: &str) -> String {
    format!("job-{}-{what}", iteration * 10 + n)
}

/// A matrix job's number from its name in Gitea, `job (2)` → 2.
fn matrix_number(name: &str) -> Option<usize> {
    name.rsplit_once('(')?.1.trim_end_matches(')').trim().parse().ok()
}

/// What became of each task, and the faults done.
#[derive(Debug, Default)]
struct Tally {
    iterations: usize,
    faults: BTreeMap<Fault, usize>,
    /// Faults with nothing to hit (no environment in the right state in time).
    missed: BTreeMap<Fault, usize>,
    tasks: usize,
    succeeded: usize,
    failed_with_reason: usize,
    /// Failures the fault does not explain (a restart or an outage lost a running job),
    /// or failures without a reason.
    wrong: Vec<String>,
    unfinished: Vec<String>,
    /// In the fetch→persist window: no record, never ran (only a controller kill).
    lost: Vec<String>,
    ran_twice: Vec<String>,
    most_at_once: usize,
    leaked: Vec<String>,
    unexpected_exits: Vec<String>,
}

impl Tally {
    fn violations(&self) -> usize {
        self.wrong.len()
            + self.unfinished.len()
            + self.ran_twice.len()
            + self.leaked.len()
            + self.unexpected_exits.len()
            + usize::from(self.most_at_once > CAPACITY)
    }

    fn table(&self, seed: u64, elapsed: Duration) -> String {
        let mut t = format!(
            "\nreal-environment campaign: {} iterations in {:.0} s, GDR_CAMPAIGN_SEED={seed}\n| measure | value |\n|---|---|\n",
            self.iterations,
            elapsed.as_secs_f64()
        );
        for (fault, n) in &self.faults {
            t.push_str(&format!("| fault {fault:?} | {n} (nothing to hit: {}) |\n", self.missed.get(fault).unwrap_or(&0)));
        }
        for (name, value) in [
            ("tasks handed out", self.tasks.to_string()),
            ("succeeded (whole log)", self.succeeded.to_string()),
            ("failed with the reason as last line (environment killed after its claim)", self.failed_with_reason.to_string()),
            ("wrong result (a restart/outage lost a job, or no reason)", format!("{} {:?}", self.wrong.len(), self.wrong)),
            ("unfinished", format!("{} {:?}", self.unfinished.len(), self.unfinished)),
            ("lost in the fetch→persist window", format!("{} {:?}", self.lost.len(), self.lost)),
            ("ran twice", format!("{} {:?}", self.ran_twice.len(), self.ran_twice)),
            ("most environments at once (capacity)", format!("{} ({CAPACITY})", self.most_at_once)),
            ("left at the end (containers, loop devices, live records)", format!("{:?}", self.leaked)),
            ("controller exits nobody asked for", format!("{:?}", self.unexpected_exits)),
            ("violations", self.violations().to_string()),
        ] {
            t.push_str(&format!("| {name} | {value} |\n"));
        }
        t
    }
}

fn loop_devices() -> usize {
    std::fs::read_dir("/sys/block")
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().starts_with("loop") && e.path().join("loop/backing_file").exists())
                .count()
        })
        .unwrap_or(0)
}

fn parse_env<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_faults_with_real_environments_lose_no_job() {
    let _turn = e2e::exclusive().await;
    let iterations: usize = parse_env("GDR_CAMPAIGN_ITERATIONS").unwrap_or(4);
    let seed: u64 = parse_env("GDR_CAMPAIGN_SEED").unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs());
    eprintln!("real-environment campaign: {iterations} iterations, GDR_CAMPAIGN_SEED={seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let started = Instant::now();
    let loops_before = loop_devices();

    let docker = host();
    let image = docker.image("gitea-runner");
    let gitea = Gitea::start(GiteaOptions { bind: docker.bridge_ip.into(), ..GiteaOptions::default() }).await;
    let proxy = FaultProxy::start(&gitea.url()).await;
    let cluster = Arc::new(std::sync::Mutex::new(tokio::task::spawn_blocking(|| NatsCluster::start(3)).await.unwrap()));
    let nats_url = cluster.lock().unwrap().url();
    let dir = e2e::stack::state_dir();
    let d = dir.path();
    let installation = "campaign";
    let token = gitea.runner_registration_token().await;
    config(d, &token, &proxy.url(), &gitea.url(), &nats_url, &image, installation).write("controller.toml");
    let process = |name: &'static str, components: &'static str| Process {
        name,
        process: ControllerProcess::new(e2e::paths::controller(), &d.join("controller.toml"), d.join(format!("controller-{name}.log"))).components(components),
    };
    let (mut worker, mut facade) = (process("worker", "scheduler,worker"), process("facade", "facade"));
    worker.start();
    testkit::wait_until("the runner is registered", Duration::from_secs(120), || d.join("runners").read_dir().is_ok_and(|mut e| e.next().is_some())).await;
    facade.start();
    let store = JetStream::connect_replicated(&nats_url, SUBJECT, BUCKET, Duration::from_secs(30), 3).await.unwrap();
    let label = format!("{}={installation}", controller::driver::LABEL_INSTANCE);

    // Environments at once, sampled every 200 ms for the whole campaign.
    let (most, watching) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(true)));
    let watcher = {
        let (most, watching, label) = (Arc::clone(&most), Arc::clone(&watching), label.clone());
        std::thread::spawn(move || {
            while watching.load(Ordering::SeqCst) {
                let running = host().docker(&["ps", "-q", "--filter", &format!("label={label}")]);
                most.fetch_max(String::from_utf8_lossy(&running.stdout).lines().filter(|l| !l.is_empty()).count(), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };

    let mut tally = Tally::default();
    for iteration in 0..iterations {
        let began = Instant::now();
        let fault = Fault::ALL[rng.usize(..Fault::ALL.len())];
        let repo = gitea.create_repo(&format!("campaign-{iteration}")).await;
        gitea.commit_workflow(&repo, "campaign.yml", &workflow(iteration, &mut rng)).await;
        tokio::time::sleep(Duration::from_millis(rng.u64(0..3000))).await;
        let hit = match fault {
            Fault::WorkerTerm | Fault::FacadeTerm | Fault::WorkerKill | Fault::FacadeKill => {
                let target = if matches!(fault, Fault::WorkerTerm | Fault::WorkerKill) { &mut worker } else { &mut facade };
                tokio::task::block_in_place(|| if matches!(fault, Fault::WorkerTerm | Fault::FacadeTerm) { target.term(DRAIN) } else { target.kill() });
                tokio::time::sleep(Duration::from_millis(rng.u64(0..2000))).await;
                target.start();
                true
            }
            Fault::NatsNode => {
                let (i, pause, cluster) = (rng.usize(..3), Duration::from_millis(rng.u64(1000..4000)), Arc::clone(&cluster));
                tokio::task::spawn_blocking(move || {
                    cluster.lock().unwrap().kill(i);
                    std::thread::sleep(pause);
                    cluster.lock().unwrap().restart(i);
                })
                .await
                .unwrap();
                true
            }
            Fault::EnvironmentBeforeClaim => {
                // Held facade: no claim can happen; an environment that appears now is
                // killed before it claims.
                facade.signal(nix::sys::signal::Signal::SIGSTOP);
                let hit = kill_one(&store, &label, |state| *state == State::Pending, Duration::from_secs(20)).await;
                facade.signal(nix::sys::signal::Signal::SIGCONT);
                hit
            }
            Fault::EnvironmentAfterClaim => kill_one(&store, &label, |state| matches!(state, State::Claimed { .. }), Duration::from_secs(30)).await,
            Fault::Gitea401 | Fault::Gitea503 => {
                proxy.fail_with(if fault == Fault::Gitea401 { 401 } else { 503 });
                tokio::time::sleep(Duration::from_millis(rng.u64(3000..8000))).await;
                proxy.heal();
                true
            }
        };
        *tally.faults.entry(fault).or_default() += 1;
        if !hit {
            *tally.missed.entry(fault).or_default() += 1;
        }
        let tasks = settle(&gitea, &store, &repo).await;
        judge(&gitea, &store, &repo, &tasks, fault, hit, &mut tally, iteration).await;
        for process in [&mut worker, &mut facade] {
            if let Some(status) = process.exited() {
                tally.unexpected_exits.push(format!("{} at iteration {iteration}: {status}", process.name));
                process.start();
            }
        }
        tally.iterations += 1;
        eprintln!(
            "iteration {iteration}: {fault:?}{} → {} tasks settled in {:.1} s",
            if hit { "" } else { " (nothing to hit)" },
            tasks.len(),
            began.elapsed().as_secs_f64()
        );
    }

    // The end: nothing left behind.
    // Not asserted here: what is left after 120 s is counted as leaked.
    let patience = Duration::from_secs(120);
    let ending = Instant::now();
    let _ = testkit::poll(patience, || std::future::ready(if host().containers(&label).is_empty() { Ok(()) } else { Err(()) })).await;
    tally.leaked.extend(host().containers(&label));
    let _ = testkit::poll(patience.saturating_sub(ending.elapsed()), || std::future::ready(if loop_devices() > loops_before { Err(()) } else { Ok(()) })).await;
    if loop_devices() > loops_before {
        tally.leaked.push(format!("{} loop devices", loop_devices() - loops_before));
    }
    let live = store.list().await.unwrap();
    tally.leaked.extend(
        live.iter().filter(|r| !tally.lost.iter().any(|l| l.contains(&r.value.assignment_id))).map(|r| format!("live record {}", r.value.assignment_id)),
    );
    watching.store(false, Ordering::SeqCst);
    watcher.join().unwrap();
    tally.most_at_once = most.load(Ordering::SeqCst);
    worker.term(DRAIN);
    facade.term(DRAIN);

    let table = tally.table(seed, started.elapsed());
    println!("{table}");
    if tally.violations() > 0 {
        let kept = dir.keep();
        panic!("{} invariant violations (controller logs kept in {}):{table}", tally.violations(), kept.display());
    }
    assert_eq!(tally.tasks, iterations * JOBS, "every job became one task");
}

/// Kills one environment of the campaign whose record is in `state`; false when none
/// came within `patience`.
async fn kill_one(store: &JetStream, label: &str, state: impl Fn(&State) -> bool, patience: Duration) -> bool {
    let target = testkit::poll(patience, || async {
        let running = host().containers(label);
        let records = store.list().await.unwrap_or_default();
        records.into_iter().find_map(|record| record.value.environment.filter(|e| running.contains(e) && state(&record.value.state))).ok_or(())
    });
    match target.await {
        Ok(environment) => host().docker(&["kill", &environment]).status.success(),
        Err(()) => false,
    }
}

/// Waits until the run's tasks ended (or [`SETTLE`] passed); returns them. A task that
/// still runs in Gitea with no record after a minute was lost in the fetch→persist window
/// (Gitea ends it after its zombie timeout): no need to wait longer for it.
async fn settle(gitea: &Gitea, store: &JetStream, repo: &Repo) -> Vec<TaskInfo> {
    let started = Instant::now();
    // Err: the tasks so far, not settled yet; after SETTLE, the last of them.
    let settled = testkit::poll(SETTLE, || async {
        let tasks = gitea.tasks(repo).await;
        let open: Vec<&TaskInfo> = tasks.iter().filter(|t| t.is_open()).collect();
        if tasks.len() >= JOBS && open.is_empty() {
            return Ok(tasks);
        }
        let mut unrecorded = 0;
        if tasks.len() >= JOBS && started.elapsed() > Duration::from_secs(60) {
            for task in &open {
                if store.get(&format!("gitea-task-{}", task.id)).await.ok().flatten().is_none() {
                    unrecorded += 1;
                }
            }
        }
        if unrecorded > 0 && unrecorded == open.len() { Ok(tasks) } else { Err(tasks) }
    });
    match settled.await {
        Ok(tasks) | Err(tasks) => tasks,
    }
}

/// Checks each task of one iteration against Gitea's record of it.
#[allow(clippy::too_many_arguments)]
async fn judge(gitea: &Gitea, store: &JetStream, repo: &Repo, tasks: &[TaskInfo], fault: Fault, hit: bool, tally: &mut Tally, iteration: usize) {
    // An environment killed after its claim fails its task: only one of the run's two.
    let mut failures_allowed = usize::from(fault == Fault::EnvironmentAfterClaim && hit);
    tally.tasks += tasks.len();
    if tasks.len() < JOBS {
        tally.unfinished.push(format!("iteration {iteration}: only {} of {JOBS} jobs became tasks", tasks.len()));
    }
    for task in tasks {
        let name = format!("iteration {iteration} task {} ({})", task.id, task.name);
        let record = store.get(&format!("gitea-task-{}", task.id)).await.ok().flatten();
        if task.is_open() {
            // A SIGKILL between FetchTask's reply and the persist: Gitea fails it after
            // its zombie timeout; nothing of it ran.
            if record.is_none() && matches!(fault, Fault::WorkerKill) {
                tally.lost.push(format!("gitea-task-{} ({name})", task.id));
            } else {
                tally.unfinished.push(format!("{name}: {}", task.status));
            }
            continue;
        }
        let Some(n) = matrix_number(&task.name) else {
            tally.wrong.push(format!("{name}: not a job of the campaign's matrix"));
            continue;
        };
        // The run's jobs are indexed in matrix order.
        let log = strip_log_timestamps(&gitea.job_log(repo, task.run_number, n - 1).await);
        let began = log.matches(&marker(iteration, n, "began")).count();
        if began > 1 {
            tally.ran_twice.push(name.clone());
        }
        let ended = log.contains(&marker(iteration, n, "ended"));
        let last = log.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_default();
        match task.status.as_str() {
            "success" if ended && began == 1 => tally.succeeded += 1,
            "failure" if last.contains("gitea-dynamic-runner:") && failures_allowed > 0 => {
                failures_allowed -= 1;
                tally.failed_with_reason += 1;
            }
            status => tally.wrong.push(format!("{name}: {status} after {fault:?} (began {began}×, ended: {ended}); last line: {last:?}")),
        }
    }
}
