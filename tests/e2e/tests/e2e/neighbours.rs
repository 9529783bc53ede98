//! One hostile job costs the other tenants nothing: the real Gitea, the controller's own
//! binary, the runner image with the supervisor as PID 1, the real gitea-runner, on the
//! docker placement in the default and the rootless modes. A hostile job's step (hostile/abuse.py) runs every abuse of the cache and the facade a step can
//! reach — parts that overlap, lie past the reservation or are one byte each, uploads never
//! committed, a v2 save past the largest entry, saves left open, downloads left unread, a
//! log flood — and keeps the pressure on while another repository's ordinary job (a clone
//! with the job token, `actions/cache@v4` restoring and saving) runs beside it. The test
//! proves the neighbour unharmed: it succeeds, its FetchTask reply → first step stays
//! within 1.5× of the same job without the hostile one (medians of five, each started once
//! the previous one's environment is gone), the controller
//! stays below 256 MiB resident and the cache's directory below its quota plus the
//! in-flight allowance, and every abuse is answered with the status docs/security.md names
//! and counted in a metric. Every environment has one CPU (`docker.cpus`), so the hostile
//! job measures what the controller shares, not the CPU.
//!
//! The kernel's per-user budgets are the second test's: a job holding every inotify
//! instance of its uid leaves another job its own, because each environment runs as a host
//! uid of its own (`docker.runner_ids`).

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use e2e::{
    docker::host,
    stack::{Options, read_config},
};
use testkit::{
    gitea::{Gitea, Repo, TaskInfo},
    metric,
    process::ControllerProcess,
};

const MIB: u64 = 1 << 20;
/// `cache.max_size` and `cache.max_repository_size` of the test: the documented bound of
/// the cache's directory is their sum with the in-flight allowance (twice the second).
const MAX_SIZE: u64 = 256 * MIB;
const MAX_REPOSITORY_SIZE: u64 = 64 * MIB;
const MAX_UPLOADING: u64 = 2 * MAX_REPOSITORY_SIZE;
const RSS_LIMIT: u64 = 256 * MIB;
/// The neighbour's jobs measured alone and beside the hostile one (medians).
const RUNS: usize = 5;

/// The ordinary job: a clone with the job's token, then `actions/cache@v4` restoring the
/// previous run's save and saving its own.
const NEIGHBOUR: &str = r#"name: neighbour
on: push
jobs:
  build:
    runs-on: [disposable, container, docker]
    steps:
      - uses: actions/checkout@v4
        with:
          path: src
      - run: echo "checked-out=$(git -C src rev-parse HEAD)"
      - id: deps
        uses: actions/cache@v4
        with:
          path: deps
          key: deps-${{ github.run_number }}
          restore-keys: deps-
      - run: rm -rf deps && mkdir deps && head -c 2000000 /dev/urandom > deps/blob
"#;

fn hostile_workflow(hold_seconds: u64) -> String {
    use base64::Engine as _;
    let script = base64::engine::general_purpose::STANDARD.encode(include_str!("hostile/abuse.py"));
    format!(
        r#"name: hostile
on: push
jobs:
  abuse:
    runs-on: [disposable, container, docker]
    steps:
      - env:
          HOLD_SECONDS: "{hold_seconds}"
        run: echo '{script}' | base64 -d > "$RUNNER_TEMP/abuse.py" && python3 "$RUNNER_TEMP/abuse.py"
"#
    )
}

/// What each abuse must be answered (docs/security.md, "What one job can cost the
/// others") and the metric that counts it.
const EXPECTED: &[(&str, &[&str], &str)] = &[
    ("overlapping-part", &["416"], "gdr_cache_refusals_total{reason=\"overlap\"}"),
    ("part-past-the-reservation", &["416"], "gdr_cache_refusals_total{reason=\"outside_reservation\"}"),
    ("one-byte-parts", &["429"], "gdr_cache_refusals_total{reason=\"parts\"}"),
    ("uploads-never-committed", &["429"], "gdr_cache_refusals_total{reason=\"job_uploading\"}"),
    ("v2-block-past-the-largest-entry", &["429", "400"], "gdr_cache_refusals_total{reason=\"job_uploading\"}"),
    ("many-open-saves", &["429"], "gdr_cache_refusals_total{reason=\"open_uploads\"}"),
    ("downloads-left-unread", &["429"], "gdr_cache_refusals_total{reason=\"job_requests\"}"),
    ("log-flood", &["printed", "(none)"], "gdr_errors_total{source=\"facade\",kind=\"log_rate_limited\"}"),
];

/// Resident memory of process `pid`.
fn resident_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok()).map_or(0, |kb| kb * 1024)
}

/// Bytes the files under `dir` take on the disk.
fn disk_bytes(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .filter_map(Result::ok)
        .map(|entry| match entry.metadata() {
            Ok(meta) if meta.is_dir() => disk_bytes(&entry.path()),
            Ok(meta) => meta.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}

/// The highest resident memory and cache bytes seen while it runs, every 200 ms.
struct Watch {
    rss: Arc<AtomicU64>,
    disk: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watch {
    fn start(pid: u32, cache_dir: std::path::PathBuf) -> Watch {
        let (rss, disk, stop) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
        let thread = {
            let (rss, disk, stop) = (Arc::clone(&rss), Arc::clone(&disk), Arc::clone(&stop));
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    rss.fetch_max(resident_bytes(pid), Ordering::SeqCst);
                    disk.fetch_max(disk_bytes(&cache_dir), Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(200));
                }
            })
        };
        Watch { rss, disk, stop, thread: Some(thread) }
    }

    /// (most resident bytes, most cache bytes)
    fn stop(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap();
        (self.rss.load(Ordering::SeqCst), self.disk.load(Ordering::SeqCst))
    }
}

/// The neighbour's next job, run to its end and its environment removed (so that the next
/// one's start is not measured beside this one's removal, which in the rootless mode stops
/// a dockerd): its task's id.
async fn neighbour_job(gitea: &Gitea, repo: &Repo, n: usize, environments: &str) -> i64 {
    if n == 0 {
        gitea.commit_workflow(repo, "neighbour.yml", NEIGHBOUR).await;
    } else {
        gitea.commit_file(repo, "main", "trigger", n.to_string().as_bytes()).await;
    }
    let tasks = gitea.wait_for_tasks(repo, Duration::from_secs(300), |t| t.len() > n && t.iter().all(|t| !t.is_open())).await;
    let task = tasks.iter().max_by_key(|t| t.id).unwrap();
    let log = testkit::gitea::strip_log_timestamps(&gitea.job_log(repo, task.run_number, 0).await);
    assert_eq!(task.status, "success", "the neighbour's job {n}:\n{log}");
    assert!(log.contains("checked-out="), "{log}");
    assert!(log.contains(&format!("Cache saved with key: deps-{}", task.run_number)), "{log}");
    if n > 0 {
        assert!(log.contains("Cache restored from key: deps-"), "the neighbour's job {n} restored nothing:\n{log}");
    }
    let own = format!("gitea-task-{}", task.id);
    testkit::wait_until("the neighbour's environment is removed", Duration::from_secs(90), || {
        host().containers(environments).iter().all(|name| !name.ends_with(&own))
    })
    .await;
    task.id
}

/// FetchTask reply → first step of `task_id`, in ms, from the controller's record of it,
/// and each phase on the way (ms after the reply).
fn startup_ms(records: &[controller::store::Record], task_id: i64) -> (i64, String) {
    let record = records.iter().find(|r| r.assignment_id == format!("gitea-task-{task_id}")).unwrap_or_else(|| panic!("no record of task {task_id}"));
    let started = record.timeline.iter().find(|(p, _)| p == "job_started").unwrap_or_else(|| panic!("task {task_id} never reported job_started: {record:?}")).1;
    let phases: Vec<String> =
        record.timeline.iter().take_while(|(p, _)| p != "runner_exited").map(|(p, at)| format!("{p} {}", at - record.created_at_ms)).collect();
    (started - record.created_at_ms, phases.join(", "))
}

fn median(values: &[i64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    sorted[sorted.len() / 2] as f64
}

async fn hostile_job_leaves_the_neighbour_unharmed(mode: &str, docker_extra: &str) {
    let turn = e2e::exclusive().await;
    let docker = host();
    let image = docker.image("gitea-runner");
    let gitea = e2e::actions::gitea_with_actions(docker.bridge_ip.into()).await;
    let token = gitea.runner_registration_token().await;
    let metrics_port = testkit::free_local_port();
    let mut options = Options::new(&gitea.url(), &token, &image, &docker.socket);
    options.job_dockerd = false;
    options.capacity = 2;
    options.http_listen = format!("127.0.0.1:{metrics_port}");
    options.docker_extra = format!("cpus = \"1\"\n{docker_extra}");
    options.extra = format!("[cache]\nmax_size = \"{}M\"\nmax_repository_size = \"{}M\"\n", MAX_SIZE / MIB, MAX_REPOSITORY_SIZE / MIB);
    let dir = e2e::stack::state_dir();
    let config_file = options.write_config(dir.path());
    let config = read_config(&config_file);
    let mut controller = ControllerProcess::new(e2e::paths::controller(), &config_file, dir.path().join("controller.log")).started();
    let pid = controller.id().unwrap();
    let metrics_url = format!("http://127.0.0.1:{metrics_port}/metrics");
    let up = testkit::poll(Duration::from_secs(60), || async { if reqwest::get(&metrics_url).await.is_ok() { Ok(()) } else { Err(()) } }).await;
    assert!(up.is_ok(), "the controller did not start:\n{}", controller.log_tail(40));
    let cache_dir = dir.path().join("cache");
    let label = format!("{}={}", controller::driver::LABEL_INSTANCE, config.installation());

    // Alone: a first run that saves, then two that restore and save.
    let neighbour = gitea.create_repo("neighbour").await;
    neighbour_job(&gitea, &neighbour, 0, &label).await;
    let mut alone_tasks = Vec::new();
    for n in 1..=RUNS {
        alone_tasks.push(neighbour_job(&gitea, &neighbour, n, &label).await);
    }
    let rss_alone = resident_bytes(pid);

    // Beside the hostile job, once it has run every abuse and holds the pressure.
    let watch = Watch::start(pid, cache_dir.clone());
    let hostile = gitea.create_repo("hostile").await;
    gitea.commit_workflow(&hostile, "hostile.yml", &hostile_workflow(240)).await;
    let run = gitea.wait_for_tasks(&hostile, Duration::from_secs(120), |t| !t.is_empty()).await[0].run_number;
    gitea.wait_for_log(&hostile, run, 0, "abuse holding: begins").await;
    let mut beside_tasks = Vec::new();
    for n in RUNS + 1..=2 * RUNS {
        beside_tasks.push(neighbour_job(&gitea, &neighbour, n, &label).await);
    }
    if !gitea.tasks(&hostile).await.iter().all(TaskInfo::is_open) {
        let log = testkit::gitea::strip_log_timestamps(&gitea.try_job_log(&hostile, run, 0).await.unwrap_or_default());
        let said: Vec<&str> = log.lines().filter(|l| l.contains("abuse ")).collect();
        panic!("the hostile job ended before its neighbour's jobs did: the test measured nothing beside it\n{}", said.join("\n"));
    }
    // The flood passes the facade's burst: refused, counted, sent again by the runner.
    // (Watched on the metric: the test reading the job's 16 MiB log would count in the
    // resident memory it measures.)
    let flooded = testkit::poll(Duration::from_secs(180), || async {
        let (_, metrics) = testkit::http_get(&metrics_url).await;
        if metric(&metrics, "gdr_errors_total{source=\"facade\",kind=\"log_rate_limited\"}") > 0 { Ok(metrics) } else { Err(metrics) }
    })
    .await;
    let metrics = flooded.unwrap_or_else(|metrics| {
        let environment = docker
            .containers(&label)
            .into_iter()
            .map(|id| String::from_utf8_lossy(&docker.docker(&["logs", "--tail", "60", &id]).stderr).into_owned())
            .collect::<Vec<_>>();
        let counters: Vec<&str> = metrics.lines().filter(|l| l.starts_with("gdr_errors_total")).collect();
        panic!("the hostile job's log flood was never refused at the facade:\n{}\n{}", counters.join("\n"), environment.join("\n---\n"));
    });
    gitea.cancel_run(&hostile, run).await;
    gitea.wait_for_tasks(&hostile, Duration::from_secs(180), |t| t.iter().all(|t| !t.is_open())).await;
    let (rss, disk) = watch.stop();
    testkit::wait_until("every environment is removed", Duration::from_secs(90), || docker.containers(&label).is_empty()).await;
    assert!(controller.exited().is_none(), "the controller ended:\n{}", controller.log_tail(40));
    // The records of the neighbour's jobs, read back from the store once the controller
    // has stopped (it holds the embedded store's file while it runs).
    controller.term(Duration::from_secs(60));
    let store = controller::app::open_store(&config).await.unwrap();
    let records: Vec<controller::store::Record> =
        store.list().await.unwrap().into_iter().chain(store.list_finished().await.unwrap()).map(|r| r.value).collect();
    drop(store);
    let (alone, alone_phases): (Vec<i64>, Vec<String>) = alone_tasks.iter().map(|id| startup_ms(&records, *id)).unzip();
    let (beside, beside_phases): (Vec<i64>, Vec<String>) = beside_tasks.iter().map(|id| startup_ms(&records, *id)).unzip();
    let hostile_log = testkit::gitea::strip_log_timestamps(&gitea.try_job_log(&hostile, run, 0).await.unwrap_or_default());

    let answers: Vec<(&str, String)> = hostile_log
        .lines()
        .filter_map(|l| l.trim().strip_prefix("abuse "))
        .filter_map(|rest| rest.split_once(": "))
        .map(|(name, answer)| (name, answer.to_owned()))
        .collect();
    let mut table = vec![format!("{mode}: {:<34} {:<8} {:<10} {:<48} counted", "abuse", "answer", "expected", "metric")];
    let mut wrong = Vec::new();
    for (name, expected, counter) in EXPECTED {
        // The flood's last line may still be on its way when the job is cancelled: its
        // refusal is the metric.
        let answer = answers.iter().find(|(n, _)| n == name).map(|(_, a)| a.clone()).unwrap_or_else(|| "(none)".into());
        let status = answer.split_whitespace().next().unwrap_or_default().to_owned();
        let counted = metric(&metrics, counter);
        table.push(format!("{mode}: {name:<34} {status:<8} {:<10} {counter:<48} {counted}", expected.join("/")));
        if !expected.contains(&status.as_str()) || counted == 0 {
            wrong.push(format!("{name}: {answer} (counted {counted})"));
        }
    }
    let (alone_ms, beside_ms) = (median(&alone), median(&beside));
    table.push(format!("{mode}: the neighbour's FetchTask reply → first step: alone {alone:?} ms (median {alone_ms:.0}), beside the hostile job {beside:?} ms (median {beside_ms:.0}), ratio {:.2}", beside_ms / alone_ms));
    for (when, phases) in alone_phases.iter().map(|p| ("alone", p)).chain(beside_phases.iter().map(|p| ("beside", p))) {
        table.push(format!("{mode}:   {when}: {phases}"));
    }
    table.push(format!(
        "{mode}: resident memory of the controller {} MiB before the hostile job, at most {} MiB beside it (limit {}), most bytes in the cache's directory {} MiB (bound {} MiB)",
        rss_alone / MIB,
        rss / MIB,
        RSS_LIMIT / MIB,
        disk / MIB,
        (MAX_SIZE + MAX_UPLOADING) / MIB
    ));
    println!("{}", table.join("\n"));
    assert!(
        wrong.is_empty(),
        "abuses not refused as documented: {wrong:?}\n{}\nthe hostile job's abuse lines:\n{}",
        table.join("\n"),
        answers.iter().map(|(n, a)| format!("{n}: {a}")).collect::<Vec<_>>().join("\n")
    );
    assert!(beside_ms <= 1.5 * alone_ms, "the neighbour started more than 1.5× slower beside the hostile job:\n{}", table.join("\n"));
    assert!(rss < RSS_LIMIT, "{}", table.join("\n"));
    assert!(disk < MAX_SIZE + MAX_UPLOADING, "{}", table.join("\n"));

    drop(turn);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_job_costs_its_neighbour_nothing_in_the_default_mode() {
    hostile_job_leaves_the_neighbour_unharmed("default", "").await;
}

/// Takes every inotify instance its uid may have (the kernel counts them per user:
/// `fs.inotify.max_user_instances`) and holds them for `$HOLD` seconds.
const HOG: &str = r#"
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
held = []
while True:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    held.append(fd)
print(f"hog: held {len(held)} inotify instances as uid {os.getuid()} (then errno {ctypes.get_errno()})", flush=True)
time.sleep(float(os.environ["HOLD"]))
"#;

/// Asks for one inotify instance and says what it got.
const PROBE: &str = r#"
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
print(f"probe: uid {os.getuid()}: " + ("inotify ok" if fd >= 0 else f"inotify refused, errno {ctypes.get_errno()}"))
"#;

fn python_workflow(name: &str, script: &str, hold_seconds: u64) -> String {
    use base64::Engine as _;
    let script = base64::engine::general_purpose::STANDARD.encode(script);
    format!(
        "name: {name}\non: push\njobs:\n  {name}:\n    runs-on: [disposable, container, docker]\n    steps:\n      - env:\n          HOLD: \"{hold_seconds}\"\n        run: echo '{script}' | base64 -d > \"$RUNNER_TEMP/{name}.py\" && python3 \"$RUNNER_TEMP/{name}.py\"\n"
    )
}

/// The hog's line and the probe's, with `docker_extra` in `[docker]`.
async fn inotify_beside_a_hog(docker_extra: &str) -> (String, String) {
    let _turn = e2e::exclusive().await;
    let docker = host();
    let gitea = Gitea::start(testkit::gitea::GiteaOptions { bind: docker.bridge_ip.into(), ..Default::default() }).await;
    let token = gitea.runner_registration_token().await;
    let mut options = Options::new(&gitea.url(), &token, &docker.image("gitea-runner"), &docker.socket);
    options.job_dockerd = false;
    options.capacity = 2;
    options.docker_extra = docker_extra.to_owned();
    let mut controller = e2e::stack::Controller::start(options).await;
    let hog = gitea.create_repo("hog").await;
    gitea.commit_workflow(&hog, "hog.yml", &python_workflow("hog", HOG, 300)).await;
    gitea.wait_for_log(&hog, 1, 0, "hog: held").await;
    let probe = gitea.create_repo("probe").await;
    gitea.commit_workflow(&probe, "probe.yml", &python_workflow("probe", PROBE, 0)).await;
    let tasks = gitea.wait_for_tasks(&probe, Duration::from_secs(180), |t| !t.is_empty() && t.iter().all(|t| !t.is_open())).await;
    let line = |log: String, prefix: &str| log.lines().find_map(|l| l.find(prefix).map(|at| l[at..].trim().to_owned())).unwrap_or_default();
    let probe_log = testkit::gitea::strip_log_timestamps(&gitea.job_log(&probe, tasks[0].run_number, 0).await);
    assert_eq!(tasks[0].status, "success", "{probe_log}");
    let hog_line = line(testkit::gitea::strip_log_timestamps(&gitea.job_log(&hog, 1, 0).await), "hog: held");
    gitea.cancel_run(&hog, 1).await;
    controller.wait_until_all_terminal(Duration::from_secs(60)).await;
    controller.stop().await;
    (hog_line, line(probe_log, "probe: uid"))
}

/// F3 of the review: one job holding every inotify instance its uid may have leaves the
/// next job its own, because each environment runs as a host uid of its own
/// (`docker.runner_ids`). With `count = 0` — every job as the image's uid 2000, as before —
/// the same hog takes them from the other job: what the first half would catch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_holding_its_uids_kernel_budget_leaves_the_next_job_its_own() {
    let (hog, probe) = inotify_beside_a_hog("").await;
    println!("own uids:    {hog}\n             {probe}");
    let uid = |line: &str| line.split("uid ").nth(1).and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next()).unwrap_or_default().to_owned();
    assert!(hog.starts_with("hog: held ") && !hog.starts_with("hog: held 0 "), "{hog}");
    assert_ne!(uid(&hog), uid(&probe), "{hog} / {probe}");
    assert!(uid(&hog).parse::<u32>().unwrap() >= 2_000_000, "{hog}");
    assert!(probe.ends_with("inotify ok"), "{hog} / {probe}");

    let (hog, probe) = inotify_beside_a_hog("runner_ids = { count = 0 }").await;
    println!("one uid:     {hog}\n             {probe}");
    assert_eq!((uid(&hog).as_str(), uid(&probe).as_str()), ("2000", "2000"), "{hog} / {probe}");
    assert!(probe.ends_with("inotify refused, errno 24"), "{hog} / {probe}");
}

/// The same with a rootless dockerd in each environment (the hostile job's and the
/// neighbour's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_job_costs_its_neighbour_nothing_in_the_rootless_mode() {
    hostile_job_leaves_the_neighbour_unharmed("rootless", "rootless_dockerd = true").await;
}
