//! The random kill campaign: two real controller processes (every component; the
//! `test-driver` build, whose environments are JSON files) on a real three-node NATS
//! cluster with three replicas, jobs streaming in from the fake Gitea, and the test playing
//! each environment's agent (claim, work for a while, report success). Every iteration
//! adds jobs and, at a random moment, kills one random thing:
//! - a controller process (SIGKILL; started again after a random pause),
//! - a NATS node (SIGKILL; started again with its storage),
//! - an environment (its container dies: the driver reports it terminal),
//! - an environment's agent in the middle of its job (it reports nothing more, and the
//!   environment, whose PID 1 it is, dies with it).
//!
//! The campaign with real environments (the runner image, the real supervisor and
//! gitea-runner, the real Gitea) is tests/e2e/tests/e2e/campaign.rs; this one is about the
//! store and the controller processes under many more kills than real jobs allow.
//!
//! Then it waits for the system to settle and checks: every task Gitea handed out ran in
//! at most one environment; every task is finished (success, or failed with a reason in
//! its log) — except tasks lost in the documented window between FetchTask's reply and
//! the first persist, which only a controller kill can cause and which are listed; at the
//! end no environment is left and every pool is back to zero. A table is printed.
//!
//! `GDR_CHAOS_ITERATIONS` (default 20) and `GDR_CHAOS_SEED` (default: the clock; printed,
//! so a failing run can be repeated). `scripts/check chaos N` runs the long mode.

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use crate::common::{
    fake_gitea::{FakeGitea, Job, REGISTRATION_TOKEN},
    pool_in_use,
};
use controller::store::{Records as _, jetstream::JetStream};
use proto::{
    facade::v1::{AssignmentCredential, ClaimRequest, UpdateTaskRequest, facade_service_client::FacadeServiceClient},
    runner::v1::{Result as TaskResult, Task, TaskState, UpdateTaskRequest as RunnerUpdate},
};
use testkit::{controller_config::ControllerConfig, nats::NatsCluster, process::ControllerProcess};
use tokio_util::sync::CancellationToken;
use tonic::Code;

const JOBS_PER_ITERATION: usize = 3;
const CAPACITY: usize = 4;
/// How long the system may take to finish what it was given after a kill.
const SETTLE: Duration = Duration::from_secs(120);
const SUBJECT: &str = "ci.assignments";
const BUCKET: &str = "ci-assignments";

/// One campaign at a time: each runs three NATS nodes, two controllers and their
/// environments, and two cores starved by three campaigns at once delay leader elections
/// past what the campaigns measure.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kill {
    Controller,
    NatsNode,
    Environment,
    Agent,
}

impl Kill {
    const ALL: [Kill; 4] = [Kill::Controller, Kill::NatsNode, Kill::Environment, Kill::Agent];
}

/// One controller process, started again after each kill with the same configuration.
struct Replica {
    name: &'static str,
    metrics: String,
    process: ControllerProcess,
}

impl std::ops::Deref for Replica {
    type Target = ControllerProcess;
    fn deref(&self) -> &ControllerProcess {
        &self.process
    }
}

impl std::ops::DerefMut for Replica {
    fn deref_mut(&mut self) -> &mut ControllerProcess {
        &mut self.process
    }
}

fn replica(dir: &Path, name: &'static str, gitea: &FakeGitea, nats: &str, envs: &Environments) -> Replica {
    let port = testkit::free_local_port();
    let config = ControllerConfig::new(dir, &gitea.url(), REGISTRATION_TOKEN)
        .set("gitea.reconcile_interval", "1s")
        .set("gitea.lease_ttl", "2s")
        .jetstream(nats)
        .set("store.subject", SUBJECT)
        .set("store.bucket", BUCKET)
        .set("store.ack_wait", "2s")
        .set("store.replicas", 3)
        .set("http.listen", format!("127.0.0.1:{port}"))
        .pool("container.docker", CAPACITY)
        .merge(&envs.docker_section())
        .write(&format!("controller-{name}.toml"));
    let Environments::Files(driver_dir) = envs;
    let process =
        ControllerProcess::new(env!("CARGO_BIN_EXE_controller"), &config, dir.join(format!("controller-{name}.log"))).env("GDR_TEST_DRIVER_DIR", driver_dir);
    Replica { name, metrics: format!("127.0.0.1:{port}"), process }
}

/// An environment as the test driver stores it.
#[derive(Debug, Clone)]
struct Env {
    name: String,
    assignment_id: String,
    capability: String,
    terminal: bool,
    /// Its own facade socket (both replicas serve environments' sockets; whichever bound
    /// it last answers).
    socket: PathBuf,
}

/// Where the environments live: the test driver's JSON files. (The campaign with the
/// real docker driver runs real environments: tests/e2e/tests/e2e/campaign.rs.)
#[derive(Clone)]
enum Environments {
    Files(PathBuf),
}

impl Environments {
    fn docker_section(&self) -> String {
        "[docker]\nimage = \"unused-with-the-test-driver\"\n".into()
    }

    async fn list(&self) -> Vec<Env> {
        match self {
            Environments::Files(dir) => files(dir),
        }
    }

    /// The environment dies (its container exits, or its PID 1 with the runner).
    async fn end(&self, name: &str) -> bool {
        match self {
            Environments::Files(dir) => end_file(dir, name),
        }
    }
}

/// Each assignment's own facade directory (`facade.environment_socket_dir`), beside the
/// test driver's.
fn own_dir(driver_dir: &Path, name: &str) -> PathBuf {
    driver_dir.with_file_name("environments").join(name)
}

fn files(dir: &Path) -> Vec<Env> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        // Gone between listing and reading: deleted by a reconciler.
        let Ok(bytes) = std::fs::read(&path) else { continue };
        let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let name = value["name"].as_str().unwrap().to_owned();
        let assignment_id = value["assignment_id"].as_str().unwrap();
        // One directory per assignment, whichever attempt's environment this is.
        let instance = value["labels"][controller::driver::LABEL_INSTANCE].as_str().unwrap();
        let own = own_dir(dir, &controller::driver::environment_name(instance, assignment_id));
        // What PID 1 would read: the capability file the worker wrote before the create.
        let Ok(capability) = std::fs::read_to_string(own.join("capability")) else { continue };
        found.push(Env {
            assignment_id: value["assignment_id"].as_str().unwrap().to_owned(),
            capability,
            terminal: value["terminal"].as_bool().unwrap(),
            socket: own.join("facade.sock"),
            name,
        });
    }
    found.sort_by(|a, b| a.name.cmp(&b.name));
    found
}

/// The container dies: the driver reports the environment terminal from now on.
fn end_file(dir: &Path, name: &str) -> bool {
    let path = dir.join(format!("{name}.json"));
    let Ok(bytes) = std::fs::read(&path) else { return false };
    let mut value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    value["terminal"] = serde_json::Value::Bool(true);
    let temporary = dir.join(format!(".{name}.chaos.tmp"));
    // A reconciler may delete it meanwhile (and a rename may bring it back, as a stale
    // listing of a real backend would: the controller must not mind).
    std::fs::write(&temporary, serde_json::to_vec_pretty(&value).unwrap()).is_ok() && std::fs::rename(&temporary, &path).is_ok()
}

/// What the agents did, by task and environment.
#[derive(Debug, Default)]
struct Ledger {
    /// Task id → the environments whose agent claimed it and started the job.
    ran: BTreeMap<i64, BTreeSet<String>>,
    /// Environments an agent was started for.
    taken: HashSet<String>,
    /// Environments whose agent reported success.
    reported: HashSet<String>,
    /// Environments (or agents) the campaign killed: nothing more is reported from them.
    killed: HashSet<String>,
}

type Shared = Arc<Mutex<Ledger>>;

async fn facade(socket: &Path) -> Result<FacadeServiceClient<tonic::transport::Channel>, tonic::Status> {
    let socket = socket.to_owned();
    let channel = tonic::transport::Endpoint::try_from("http://facade.local")
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(socket).await?)) }
        }))
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    Ok(FacadeServiceClient::new(channel))
}

/// Asks each facade in turn until one answers: a facade that is down, or answers
/// Unavailable/Unknown/Internal/Cancelled (its store without quorum, its process dying), is
/// skipped; any other answer is final.
async fn ask_any_facade<T, F, Fut>(sockets: &[PathBuf], what: &str, call: F) -> Result<T, tonic::Status>
where
    F: Fn(FacadeServiceClient<tonic::transport::Channel>) -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    let mut last = tonic::Status::unavailable("no facade answered");
    for socket in sockets {
        let client = match facade(socket).await {
            Ok(client) => client,
            Err(status) => {
                last = status;
                continue;
            }
        };
        match tokio::time::timeout(Duration::from_secs(10), call(client)).await {
            Ok(Ok(answer)) => return Ok(answer),
            Ok(Err(status)) if matches!(status.code(), Code::Unavailable | Code::Unknown | Code::Internal | Code::Cancelled) => last = status,
            Ok(Err(status)) => return Err(status),
            Err(_) => last = tonic::Status::deadline_exceeded(what.to_owned()),
        }
    }
    Err(last)
}

async fn claim_anywhere(sockets: &[PathBuf], request: &ClaimRequest) -> Result<(Task, String), tonic::Status> {
    ask_any_facade(sockets, "claim", |mut client| async move {
        let claimed = client.claim(request.clone()).await?.into_inner();
        Ok((claimed.task.unwrap(), claimed.session))
    })
    .await
}

async fn report_anywhere(sockets: &[PathBuf], request: &UpdateTaskRequest) -> Result<(), tonic::Status> {
    ask_any_facade(sockets, "update_task", |mut client| async move { client.update_task(request.clone()).await.map(drop) }).await
}

fn is_killed(ledger: &Shared, name: &str) -> bool {
    ledger.lock().unwrap().killed.contains(name)
}

/// Plays one environment's agent: claim (through whichever facade answers), work, report
/// success, end the environment. A final refusal (finished, failed, claimed by another
/// holder) ends it.
async fn agent(env: Env, envs: Environments, ledger: Shared, work: Duration, stop: CancellationToken) {
    let sockets = vec![env.socket.clone()];
    let credential = Some(AssignmentCredential { assignment_id: env.assignment_id.clone(), capability: env.capability.clone() });
    let claim = ClaimRequest { credential, holder: format!("agent-{}", env.name) };
    let Some((task, session)) = ask_until_final(&env, &ledger, &stop, || claim_anywhere(&sockets, &claim)).await else { return };
    ledger.lock().unwrap().ran.entry(task.id).or_default().insert(env.name.clone());
    tokio::time::sleep(work).await;
    let done = UpdateTaskRequest {
        credential: Some(AssignmentCredential { assignment_id: env.assignment_id.clone(), capability: session }),
        request: Some(RunnerUpdate {
            state: Some(TaskState {
                id: task.id,
                result: TaskResult::Success as i32,
                stopped_at: Some(prost_types::Timestamp::default()),
                ..Default::default()
            }),
            outputs: Default::default(),
        }),
    };
    if ask_until_final(&env, &ledger, &stop, || report_anywhere(&sockets, &done)).await.is_some() {
        ledger.lock().unwrap().reported.insert(env.name.clone());
        // The runner exits after its final report, and the supervisor, PID 1, with it: the
        // environment ends on its own.
        envs.end(&env.name).await;
    }
}

/// Asks (a facade, through `ask`) again while the answer is a transient failure, until
/// the agent is killed or the campaign stops; `None` then, or on a final refusal.
async fn ask_until_final<T, Fut>(env: &Env, ledger: &Shared, stop: &CancellationToken, mut ask: impl FnMut() -> Fut) -> Option<T>
where
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    let answered = testkit::poll(Duration::MAX, || {
        let asked = ask();
        async move {
            if stop.is_cancelled() || is_killed(ledger, &env.name) {
                return Ok(None);
            }
            match asked.await {
                Ok(answer) => Ok(Some(answer)),
                Err(status) if matches!(status.code(), Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Internal | Code::Cancelled) => {
                    Err(status)
                }
                Err(_) => Ok(None),
            }
        }
    });
    answered.await.ok().flatten()
}

/// Starts an agent for every new environment until `stop`.
async fn play(envs: Environments, ledger: Shared, seed: u64, stop: CancellationToken) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut agents = tokio::task::JoinSet::new();
    while !stop.is_cancelled() {
        for env in envs.list().await {
            if env.terminal || !ledger.lock().unwrap().taken.insert(env.name.clone()) {
                continue;
            }
            let work = Duration::from_millis(rng.u64(100..800));
            agents.spawn(agent(env, envs.clone(), Arc::clone(&ledger), work, stop.clone()));
        }
        while agents.try_join_next().is_some() {}
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    while agents.join_next().await.is_some() {}
}

/// Where a task Gitea handed out stands.
#[derive(Debug, PartialEq, Eq)]
enum Standing {
    Finished,
    /// No record in the store: lost between FetchTask's reply and the persist, if it stays so.
    NoRecord,
    Open,
}

async fn standing(gitea: &FakeGitea, store: &JetStream) -> Result<BTreeMap<i64, Standing>, String> {
    let tasks: Vec<(i64, bool)> = gitea.with(|s| s.tasks.iter().map(|(id, t)| (*id, t.final_result.is_some())).collect());
    let mut standing = BTreeMap::new();
    for (id, finished) in tasks {
        let state = if finished {
            Standing::Finished
        } else {
            match store.get(&format!("gitea-task-{id}")).await {
                Ok(Some(_)) => Standing::Open,
                Ok(None) => Standing::NoRecord,
                Err(error) => return Err(error.to_string()),
            }
        };
        standing.insert(id, state);
    }
    Ok(standing)
}

/// Waits until every job was handed out and every task is finished or stays without a
/// record for 3 s; returns the tasks that did not finish within [`SETTLE`], those lost,
/// and how many jobs were still waiting in Gitea then (never fetched).
async fn settle(gitea: &FakeGitea, store: &JetStream) -> (Vec<i64>, Vec<i64>, usize) {
    let quiet_since = std::cell::Cell::new(None::<Instant>);
    // Ok: the tasks lost (no record for 3 s). Not yet: the open ones, those without a
    // record and the jobs waiting in Gitea — or the store's error.
    let settled = testkit::poll(SETTLE, || async {
        let waiting = gitea.with(|s| s.waiting.len());
        let now = standing(gitea, store).await.map_err(Err)?;
        let open: Vec<i64> = now.iter().filter(|(_, s)| **s == Standing::Open).map(|(id, _)| *id).collect();
        let no_record: Vec<i64> = now.iter().filter(|(_, s)| **s == Standing::NoRecord).map(|(id, _)| *id).collect();
        if waiting == 0 && open.is_empty() {
            let since = quiet_since.get().unwrap_or_else(Instant::now);
            quiet_since.set(Some(since));
            if no_record.is_empty() || since.elapsed() > Duration::from_secs(3) {
                return Ok(no_record);
            }
        } else {
            quiet_since.set(None);
        }
        Err(Ok((open, no_record, waiting)))
    });
    match settled.await {
        Ok(lost) => (Vec::new(), lost, 0),
        Err(Ok((mut unfinished, no_record, waiting))) => {
            unfinished.extend(no_record);
            (unfinished, Vec::new(), waiting)
        }
        Err(Err(error)) => panic!("the store did not answer within {SETTLE:?}: {error}"),
    }
}

#[derive(Debug, Default)]
struct Tally {
    driver: &'static str,
    iterations: usize,
    kills: BTreeMap<Kill, usize>,
    /// A kill that found nothing to kill (no environment or agent at that moment).
    missed: BTreeMap<Kill, usize>,
    tasks: usize,
    succeeded: usize,
    failed: usize,
    lost: Vec<(i64, Kill)>,
    run_twice: Vec<(i64, Vec<String>)>,
    unfinished: Vec<i64>,
    /// Jobs still waiting in Gitea when a settle gave up: the controllers stopped fetching.
    never_fetched: usize,
    failed_without_reason: Vec<i64>,
    unexpected_exits: Vec<String>,
    leaked: Vec<String>,
    pools_not_zero: Vec<String>,
}

impl Tally {
    fn violations(&self) -> usize {
        self.run_twice.len()
            + self.unfinished.len()
            + self.never_fetched
            + self.failed_without_reason.len()
            + self.unexpected_exits.len()
            + self.leaked.len()
            + self.pools_not_zero.len()
    }

    fn table(&self, seed: u64, elapsed: Duration) -> String {
        let kills = Kill::ALL
            .iter()
            .map(|k| format!("{k:?} {} (missed {})", self.kills.get(k).copied().unwrap_or(0), self.missed.get(k).copied().unwrap_or(0)))
            .collect::<Vec<_>>()
            .join(", ");
        let row = |name: &str, value: String| format!("| {name:<34} | {value} |\n");
        let mut out = String::from("\nchaos campaign\n| measure | value |\n|---|---|\n");
        out += &row("driver", self.driver.to_owned());
        out += &row("seed", seed.to_string());
        out += &row("iterations", self.iterations.to_string());
        out += &row("wall time", format!("{:.0} s", elapsed.as_secs_f64()));
        out += &row("kills by kind", kills);
        out += &row("tasks handed out by Gitea", self.tasks.to_string());
        out += &row("succeeded", self.succeeded.to_string());
        out += &row("failed with a reason", self.failed.to_string());
        out += &row("lost in the fetch→persist window", format!("{} {:?}", self.lost.len(), self.lost));
        out += &row("run-once violations", format!("{} {:?}", self.run_twice.len(), self.run_twice));
        out += &row("unfinished", format!("{} {:?}", self.unfinished.len(), self.unfinished));
        out += &row("never fetched from Gitea", self.never_fetched.to_string());
        out += &row("failed without a reason", format!("{} {:?}", self.failed_without_reason.len(), self.failed_without_reason));
        out += &row("controllers that exited on their own", format!("{} {:?}", self.unexpected_exits.len(), self.unexpected_exits));
        out += &row("leaked environments", format!("{} {:?}", self.leaked.len(), self.leaked));
        out += &row("pools not back to zero", format!("{} {:?}", self.pools_not_zero.len(), self.pools_not_zero));
        out
    }
}

fn parse_env<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().map(|v| v.parse().unwrap_or_else(|_| panic!("{name}={v:?} is not a number")))
}

/// Two controller replicas on a three-node NATS cluster, the fake Gitea, and the agents.
struct Rig {
    cluster: Arc<Mutex<NatsCluster>>,
    gitea: FakeGitea,
    dir: tempfile::TempDir,
    replicas: [Replica; 2],
    store: JetStream,
    ledger: Shared,
    envs: Environments,
    stop: CancellationToken,
    player: Option<tokio::task::JoinHandle<()>>,
}

impl Rig {
    async fn start(seed: u64) -> Rig {
        let cluster = Arc::new(Mutex::new(tokio::task::spawn_blocking(|| NatsCluster::start(3)).await.unwrap()));
        let nats_url = cluster.lock().unwrap().url();
        let gitea = FakeGitea::start().await;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let envs = Environments::Files(d.join("envs"));
        let mut replicas = [replica(d, "a", &gitea, &nats_url, &envs), replica(d, "b", &gitea, &nats_url, &envs)];
        // The first registers; the second finds the credentials.
        replicas[0].start();
        let first = &mut replicas[0];
        // Ok(None) once registered, Ok(Some) if it exited first.
        let registered = testkit::poll(Duration::from_secs(120), || {
            let registered = d.join("runners").read_dir().is_ok_and(|mut e| e.next().is_some());
            std::future::ready(if registered { Ok(None) } else { first.exited().map(Some).ok_or(()) })
        });
        if let Err(()) | Ok(Some(_)) = registered.await {
            panic!("the first replica did not register ({:?}):\n{}", replicas[0].exited(), replicas[0].log_tail(200));
        }
        replicas[1].start();
        let store = JetStream::connect_replicated(&nats_url, SUBJECT, BUCKET, Duration::from_secs(30), 3).await.unwrap();
        let ledger: Shared = Arc::default();
        let stop = CancellationToken::new();
        let player = tokio::spawn(play(envs.clone(), Arc::clone(&ledger), seed, stop.clone()));
        Rig { cluster, gitea, dir, replicas, store, ledger, envs, stop, player: Some(player) }
    }

    fn add_jobs(&self, n: usize) {
        for _ in 0..n {
            self.gitea.add_job(Job::new(&["disposable", "container", "docker"]));
        }
    }

    /// The end checks: no environment left, every pool at zero, nothing run twice, and
    /// how each task ended. Stops the agents.
    /// A controller that exited on its own is a bug (or a refused start): counted, and
    /// started again so the campaign goes on.
    fn restart_exited(&mut self, tally: &mut Tally, iteration: usize) {
        for replica in &mut self.replicas {
            if let Some(status) = replica.exited() {
                tally.unexpected_exits.push(format!("replica {} at iteration {iteration}: {status}", replica.name));
                replica.start();
            }
        }
    }

    async fn finish(&mut self, tally: &mut Tally) {
        // Not asserted here: what is left is counted as leaked, and the tally fails the test.
        let _ = testkit::poll(Duration::from_secs(60), || async { if self.envs.list().await.is_empty() { Ok(()) } else { Err(()) } }).await;
        tally.leaked = self.envs.list().await.into_iter().map(|e| e.name).collect();
        for replica in &self.replicas {
            let drained = testkit::poll(Duration::from_secs(30), || async {
                let in_use = pool_in_use(&replica.metrics).await;
                if in_use == Some(0) { Ok(()) } else { Err(in_use) }
            });
            if let Err(in_use) = drained.await {
                tally.pools_not_zero.push(format!("replica {}: {in_use:?}", replica.name));
            }
        }
        self.stop.cancel();
        if let Some(player) = self.player.take() {
            player.await.unwrap();
        }
        let lost: HashSet<i64> = tally.lost.iter().map(|(id, _)| *id).collect();
        {
            let ledger = self.ledger.lock().unwrap();
            tally.run_twice = ledger.ran.iter().filter(|(_, names)| names.len() > 1).map(|(id, names)| (*id, names.iter().cloned().collect())).collect();
        }
        self.gitea.with(|s| {
            tally.tasks = s.tasks.len();
            for (id, task) in &s.tasks {
                if lost.contains(id) {
                    continue;
                }
                match task.final_result {
                    Some(r) if r == TaskResult::Success as i32 => tally.succeeded += 1,
                    Some(_) if task.log.last().is_some_and(|l| !l.trim().is_empty()) => tally.failed += 1,
                    Some(_) => tally.failed_without_reason.push(*id),
                    None => {}
                }
            }
        });
    }

    /// Panics with the table (keeping the logs) if any invariant was violated.
    fn verdict(self, tally: &Tally, seed: u64, elapsed: Duration) {
        let table = tally.table(seed, elapsed);
        println!("{table}");
        if tally.violations() > 0 {
            let kept = self.dir.keep();
            panic!("{} invariant violations (logs kept in {}):{table}", tally.violations(), kept.display());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_kills_lose_nothing_and_run_nothing_twice() {
    let _turn = TURN.lock().await;
    campaign(parse_env("GDR_CHAOS_ITERATIONS").unwrap_or(20)).await;
}

async fn campaign(iterations: usize) {
    let seed: u64 = parse_env("GDR_CHAOS_SEED").unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs());
    let driver = "test driver";
    eprintln!("chaos ({driver}): {iterations} iterations, GDR_CHAOS_SEED={seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let started = Instant::now();

    let mut rig = Rig::start(rng.u64(..)).await;
    let mut tally = Tally { driver, ..Tally::default() };
    for iteration in 0..iterations {
        let began = Instant::now();
        let kind = Kill::ALL[rng.usize(..Kill::ALL.len())];
        rig.add_jobs(JOBS_PER_ITERATION);
        tokio::time::sleep(Duration::from_millis(rng.u64(0..2000))).await;
        let hit = match kind {
            Kill::Controller => {
                let i = rng.usize(..rig.replicas.len());
                rig.replicas[i].kill();
                tokio::time::sleep(Duration::from_millis(rng.u64(0..1500))).await;
                rig.replicas[i].start();
                true
            }
            Kill::NatsNode => {
                let i = rng.usize(..3);
                let pause = Duration::from_millis(rng.u64(500..3000));
                let cluster = Arc::clone(&rig.cluster);
                tokio::task::spawn_blocking(move || {
                    cluster.lock().unwrap().kill(i);
                    std::thread::sleep(pause);
                    cluster.lock().unwrap().restart(i);
                })
                .await
                .unwrap();
                true
            }
            Kill::Environment | Kill::Agent => {
                // Waits a little for a target: one that exists (Environment), or whose
                // agent is mid-job (Agent: claimed, not reported).
                let candidates = testkit::poll(Duration::from_secs(5), || async {
                    let listed = rig.envs.list().await;
                    let ledger = rig.ledger.lock().unwrap();
                    let candidates: Vec<String> = listed
                        .into_iter()
                        .filter(|e| !e.terminal && !ledger.reported.contains(&e.name))
                        .filter(|e| kind == Kill::Environment || ledger.ran.values().any(|names| names.contains(&e.name)))
                        .map(|e| e.name)
                        .collect();
                    if candidates.is_empty() { Err(()) } else { Ok(candidates) }
                });
                match candidates.await {
                    Ok(candidates) => {
                        let target = &candidates[rng.usize(..candidates.len())];
                        rig.ledger.lock().unwrap().killed.insert(target.clone());
                        rig.envs.end(target).await
                    }
                    Err(()) => false,
                }
            }
        };
        *tally.kills.entry(kind).or_default() += 1;
        if !hit {
            *tally.missed.entry(kind).or_default() += 1;
        }
        let (unfinished, lost, never_fetched) = settle(&rig.gitea, &rig.store).await;
        tally.never_fetched += never_fetched;
        for id in &lost {
            tally.lost.push((*id, kind));
        }
        if !lost.is_empty() && kind != Kill::Controller {
            // Only a controller's death can fall between FetchTask's reply and the persist.
            tally.unfinished.extend(lost.iter().copied());
        }
        tally.unfinished.extend(unfinished);
        // Lost tasks are accounted for once: Gitea times them out; the fake does not.
        rig.gitea.with(|s| {
            for id in &lost {
                if let Some(task) = s.tasks.get_mut(id) {
                    task.final_result = Some(TaskResult::Failure as i32);
                    task.log.push("chaos: lost in the fetch→persist window (Gitea times it out)".into());
                }
            }
        });
        rig.restart_exited(&mut tally, iteration);
        tally.iterations += 1;
        eprintln!(
            "iteration {iteration}: {kind:?}{}, settled in {:.1} s → {} tasks so far",
            if hit { "" } else { " (nothing to kill)" },
            began.elapsed().as_secs_f64(),
            rig.gitea.with(|s| s.tasks.len())
        );
    }
    rig.finish(&mut tally).await;
    // The verdict first: it keeps the logs when a job was never fetched.
    let tasks = tally.tasks;
    rig.verdict(&tally, seed, started.elapsed());
    assert_eq!(tasks, iterations * JOBS_PER_ITERATION, "every job was handed out once");
}

async fn ready(metrics: &str) -> Option<bool> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(metrics).await.ok()?;
    stream.write_all(format!("GET /readyz HTTP/1.0\r\nHost: {metrics}\r\n\r\n").as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    Some(response.split_whitespace().nth(1)? == "200")
}

/// Every NATS node down for 30 s while jobs run: both replicas report not-ready within a
/// few seconds and stay so, then recover on their own once the cluster is back; no task
/// is lost or run twice, and every one succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_30_s_outage_of_every_nats_node_loses_nothing() {
    let _turn = TURN.lock().await;
    let started = Instant::now();
    let mut rig = Rig::start(7).await;
    rig.add_jobs(6);
    testkit::wait_until("an agent mid-job", Duration::from_secs(60), || !rig.ledger.lock().unwrap().ran.is_empty()).await;
    rig.add_jobs(6);

    let cluster = Arc::clone(&rig.cluster);
    tokio::task::spawn_blocking(move || {
        let mut cluster = cluster.lock().unwrap();
        for i in 0..cluster.len() {
            cluster.kill(i);
        }
    })
    .await
    .unwrap();
    let down = Instant::now();
    let mut noticed = Vec::new();
    for replica in &rig.replicas {
        testkit::wait_until_async(&format!("replica {} is not ready in the outage", replica.name), Duration::from_secs(15), || async {
            ready(&replica.metrics).await == Some(false)
        })
        .await;
        noticed.push(down.elapsed());
    }
    while down.elapsed() < Duration::from_secs(30) {
        for replica in &rig.replicas {
            assert_eq!(ready(&replica.metrics).await, Some(false), "replica {} ready during the outage", replica.name);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let cluster = Arc::clone(&rig.cluster);
    tokio::task::spawn_blocking(move || cluster.lock().unwrap().restart_stopped()).await.unwrap();
    let back = Instant::now();
    let mut recovered = Vec::new();
    for replica in &rig.replicas {
        testkit::wait_until_async(&format!("replica {} is ready after the cluster came back", replica.name), Duration::from_secs(60), || async {
            ready(&replica.metrics).await == Some(true)
        })
        .await;
        recovered.push(back.elapsed());
    }
    eprintln!("outage: not-ready noticed after {noticed:?}; ready again {recovered:?} after the cluster was back");

    let mut tally = Tally { driver: "test driver", iterations: 1, ..Tally::default() };
    let (unfinished, lost, never_fetched) = settle(&rig.gitea, &rig.store).await;
    tally.unfinished = unfinished;
    tally.never_fetched = never_fetched;
    // No controller died: nothing may be lost.
    tally.unfinished.extend(lost);
    rig.restart_exited(&mut tally, 0);
    rig.finish(&mut tally).await;
    let (tasks, succeeded) = (tally.tasks, tally.succeeded);
    rig.verdict(&tally, 7, started.elapsed());
    assert_eq!(tasks, 12, "every job was handed out once");
    assert_eq!(succeeded, 12, "every job succeeded");
}
