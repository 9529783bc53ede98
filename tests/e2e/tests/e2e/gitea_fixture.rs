//! The real-Gitea fixture against the real Gitea 1.23.8 and the real gitea-runner:
//! start-up, repository, workflow run, registration token, teardown; a job run end to end
//! by `gitea-runner daemon --once` with its log read back; a running job cancelled.

use std::{
    net::TcpStream,
    path::Path,
    process::Stdio,
    time::{Duration, Instant},
};

use testkit::gitea::{Gitea, GiteaOptions, GiteaVersion, TaskInfo, gitea_runner_bin, strip_log_timestamps};

const LABELS: &str = "disposable,container,docker";

fn workflow(step: &str) -> String {
    format!("name: fixture\non: push\njobs:\n  hello:\n    runs-on: [disposable, container, docker]\n    steps:\n      - run: {step}\n")
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists() && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
}

/// `gitea-runner register` in `dir` (writes `dir/.runner`), host mode: the labels have no scheme.
async fn register_runner(gitea: &Gitea, dir: &Path, name: &str) {
    let token = gitea.runner_registration_token().await;
    let out = tokio::process::Command::new(gitea_runner_bin())
        .current_dir(dir)
        .env("HOME", dir)
        .args(["register", "--no-interactive", "--instance", &gitea.url(), "--token", &token, "--name", name])
        .args(["--labels", LABELS])
        .stdin(Stdio::null())
        .output()
        .await
        .expect("spawn gitea-runner register");
    assert!(
        out.status.success() && dir.join(".runner").is_file(),
        "gitea-runner register failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn runner_daemon_once(dir: &Path) -> tokio::process::Child {
    tokio::process::Command::new(gitea_runner_bin())
        .current_dir(dir)
        .env("HOME", dir)
        .args(["daemon", "--once"])
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join("daemon.log")).expect("daemon.log"))
        .stderr(std::fs::File::create(dir.join("daemon.err")).expect("daemon.err"))
        .kill_on_drop(true)
        .spawn()
        .expect("spawn gitea-runner daemon --once")
}

fn runner_output(dir: &Path) -> String {
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    format!("{}{}", read("daemon.log"), read("daemon.err"))
}

#[tokio::test(flavor = "multi_thread")]
async fn fixture_starts_creates_runs_and_stops() {
    let t = Instant::now();
    let gitea = Gitea::start(GiteaOptions::default()).await;
    eprintln!("start: {:?}", t.elapsed());
    let url = gitea.url();
    assert!(url.starts_with("http://127.0.0.1:") && !url.ends_with('/'), "{url}");
    assert!(!gitea.token().is_empty());
    assert_eq!(gitea.admin().0, "gdr-admin");

    let repo = gitea.create_repo("fixture").await;
    assert_eq!(repo.full_name(), "gdr-admin/fixture");

    let token = gitea.runner_registration_token().await;
    assert!(token.len() >= 20, "registration token {token:?}");
    assert_eq!(gitea.runner_registration_token().await, token, "Gitea hands out its current active token");

    // No runner: the run and its job exist, waiting; no task yet.
    assert!(gitea.run(&repo, 1).await.is_none(), "no run before the workflow is committed");
    let sha = gitea.commit_workflow(&repo, "ci.yml", &workflow("echo one")).await;
    assert_eq!(sha.len(), 40, "{sha}");
    let run = gitea.wait_for_run(&repo, 1, Duration::from_secs(20), |_| true).await;
    assert_eq!(run.workflow_id, "ci.yml");
    assert_eq!(run.status, "waiting", "{run:?}");
    assert!(run.can_cancel && !run.done, "{run:?}");
    assert_eq!(run.jobs.len(), 1, "{run:?}");
    assert_eq!((run.jobs[0].name.as_str(), run.jobs[0].status.as_str()), ("hello", "waiting"));
    assert!(gitea.tasks(&repo).await.is_empty(), "a job becomes a task only when a runner picks it");

    // Updating the same file is a second push: run 2. Gitea 1.23 itself cancels the
    // unfinished runs of the same workflow file on the same ref for a new push
    // (CancelPreviousJobs in services/actions/notifier_helper.go); 1.27 leaves them
    // (only a workflow's `concurrency` cancels there).
    let superseded = match gitea.version() {
        GiteaVersion::V1_23 => ("cancelled", true),
        GiteaVersion::V1_27 => ("waiting", false),
    };
    gitea.commit_workflow(&repo, "ci.yml", &workflow("echo two")).await;
    let run2 = gitea.wait_for_run(&repo, 2, Duration::from_secs(20), |_| true).await;
    assert_eq!(run2.status, "waiting", "{run2:?}");
    let run1 = gitea.run(&repo, 1).await.expect("run 1");
    assert_eq!((run1.status.as_str(), run1.done), superseded, "run 1 after run 2: {run1:?}");

    // Committing a second workflow file is a push that starts EVERY `on: push` workflow of
    // the branch: other.yml and ci.yml again (runs 3 and 4, in either order); the new
    // ci.yml run supersedes run 2.
    gitea.commit_workflow(&repo, "other.yml", &workflow("echo three")).await;
    let a = gitea.wait_for_run(&repo, 3, Duration::from_secs(20), |_| true).await;
    let b = gitea.wait_for_run(&repo, 4, Duration::from_secs(20), |_| true).await;
    let (other, ci) = if a.workflow_id == "other.yml" { (3, b) } else { (4, a) };
    assert_eq!(ci.workflow_id, "ci.yml", "{ci:?}");
    assert_eq!(gitea.run(&repo, 2).await.expect("run 2").status, superseded.0, "after a newer run");
    assert_eq!(gitea.run(&repo, other).await.expect("other.yml run").status, "waiting");

    // Why cancel_run signs in: web routes ignore basic auth, so this POST is anonymous:
    // 1.23 refuses it at the CSRF check (400) before any permission check, 1.27 (no CSRF
    // token) as an anonymous user's.
    let (user, password) = gitea.admin();
    let route = gitea.run_route(&repo, other).await.expect("other.yml run");
    let anonymous = reqwest::Client::new().post(format!("{}{route}/cancel", gitea.url())).basic_auth(user, Some(password)).send().await.unwrap();
    let status = anonymous.status();
    match gitea.version() {
        GiteaVersion::V1_23 => assert_eq!(status, 400, "{:?}", anonymous.text().await),
        GiteaVersion::V1_27 => assert!(status.is_client_error(), "{status}: {:?}", anonymous.text().await),
    }
    assert_eq!(gitea.run(&repo, other).await.expect("other.yml run").status, "waiting");

    // Cancelling a waiting run through the web route needs no runner; it touches no other run.
    gitea.cancel_run(&repo, other).await;
    let cancelled = gitea.run(&repo, other).await.expect("other.yml run");
    assert_eq!((cancelled.status.as_str(), cancelled.done), ("cancelled", true), "{cancelled:?}");
    assert_eq!(cancelled.jobs[0].status, "cancelled");
    assert_eq!(ci.status, "waiting");
    let ci_number = if other == 3 { 4 } else { 3 };
    assert_eq!(gitea.run(&repo, ci_number).await.expect("ci.yml run").status, "waiting", "untouched");
    assert!(gitea.tasks(&repo).await.is_empty());

    assert!(gitea.log_tail(20).lines().count() > 0, "Gitea writes its log file");

    // Teardown: process gone, port closed.
    let pid = gitea.pid().expect("running");
    let addr = gitea.addr();
    let dir = gitea.dir().to_path_buf();
    assert!(TcpStream::connect(addr).is_ok());
    let t = Instant::now();
    drop(gitea);
    eprintln!("stop: {:?}", t.elapsed());
    assert!(!pid_alive(pid), "gitea (pid {pid}) still runs after drop");
    assert!(TcpStream::connect(addr).is_err(), "{addr} still accepts connections after drop");
    assert!(!dir.exists(), "{} left behind", dir.display());
}

#[tokio::test(flavor = "multi_thread")]
async fn real_runner_runs_a_job_and_the_fixture_reads_its_log() {
    let gitea = Gitea::start(GiteaOptions::default()).await;
    let repo = gitea.create_repo("hello").await;
    let runner_dir = tempfile::tempdir().unwrap();
    register_runner(&gitea, runner_dir.path(), "fixture").await;

    let t = Instant::now();
    // The shell computes the marker, so the echoed command line itself cannot match it.
    gitea.commit_workflow(&repo, "ci.yml", &workflow("echo \"fixture says $((6*7))\"")).await;
    let mut daemon = runner_daemon_once(runner_dir.path());
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(60), |tasks| tasks.iter().any(|t| t.status == "success" || t.status == "failure")).await;
    eprintln!("job through the real runner: {:?}", t.elapsed());
    let task: &TaskInfo = &tasks[0];
    assert_eq!(tasks.len(), 1, "{tasks:#?}");
    assert_eq!(task.status, "success", "{task:#?}\nrunner:\n{}", runner_output(runner_dir.path()));
    assert_eq!((task.run_number, task.name.as_str()), (1, "hello"));
    assert_eq!((task.workflow_id.as_str(), task.head_branch.as_str(), task.event.as_str()), ("ci.yml", "main", "push"));
    assert_eq!(task.url, format!("{}/gdr-admin/hello/actions/runs/1", gitea.url()));
    eprintln!("task JSON: {task:#?}");

    let status = tokio::time::timeout(Duration::from_secs(20), daemon.wait()).await.expect("daemon --once exits").unwrap();
    assert!(status.success(), "daemon --once: {status}\n{}", runner_output(runner_dir.path()));

    let raw = gitea.job_log(&repo, 1, 0).await;
    eprintln!("raw log:\n{raw}");
    // A public repository's log is readable without signing in at all (why a basic-auth
    // GET, which that route ignores, appears to work).
    let anonymous = reqwest::get(format!("{}{}", gitea.url(), gitea.job_log_path(&repo, 1, 0).await.unwrap())).await.unwrap();
    assert_eq!(anonymous.status(), 200);
    assert_eq!(anonymous.text().await.unwrap(), raw);
    let log = strip_log_timestamps(&raw);
    assert!(log.lines().any(|l| l.trim() == "fixture says 42"), "the step's output is in the job log:\n{raw}");
    assert!(raw.lines().all(|l| l.len() > 28 && l.as_bytes()[27] == b'Z'), "every line has Gitea's timestamp:\n{raw}");
    let run = gitea.run(&repo, 1).await.expect("run 1");
    assert_eq!((run.status.as_str(), run.done), ("success", true), "{run:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn cancel_run_stops_a_running_job_on_the_real_runner() {
    let gitea = Gitea::start(GiteaOptions::default()).await;
    let repo = gitea.create_repo("sleepy").await;
    let runner_dir = tempfile::tempdir().unwrap();
    register_runner(&gitea, runner_dir.path(), "sleeper").await;

    gitea.commit_workflow(&repo, "sleep.yml", &workflow("echo started; sleep 60; echo \"not $((1+1)) reached\"")).await;
    let mut daemon = runner_daemon_once(runner_dir.path());
    gitea.wait_for_tasks(&repo, Duration::from_secs(60), |tasks| tasks.iter().any(|t| t.status == "running")).await;
    // Wait until the step itself runs (its first line reached Gitea), so the cancel hits a live `sleep`.
    // Until then the route answers an error (1.23: 500 "file does not exist"; 1.27: 404).
    let started = testkit::poll(Duration::from_secs(30), || async {
        if gitea.try_job_log(&repo, 1, 0).await.is_ok_and(|log| log.contains("started")) { Ok(()) } else { Err(()) }
    });
    started.await.unwrap_or_else(|()| panic!("the step never started:\n{}", runner_output(runner_dir.path())));

    let t = Instant::now();
    gitea.cancel_run(&repo, 1).await;
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(10), |tasks| tasks.iter().all(|t| t.status == "cancelled")).await;
    assert_eq!(tasks.len(), 1);
    eprintln!("cancel -> task cancelled: {:?}", t.elapsed());
    let status = tokio::time::timeout(Duration::from_secs(20), daemon.wait())
        .await
        .unwrap_or_else(|_| panic!("the runner did not exit after the cancel:\n{}", runner_output(runner_dir.path())))
        .unwrap();
    eprintln!("cancel -> runner exited: {:?} ({status})", t.elapsed());
    // The runner learns of the cancel from its next UpdateTask reply (state_report_interval 5 s).
    assert!(t.elapsed() < Duration::from_secs(20), "the job was not stopped promptly: {:?}", t.elapsed());
    let run = gitea.run(&repo, 1).await.expect("run 1");
    assert_eq!((run.status.as_str(), run.done), ("cancelled", true), "{run:?}");
    let log = gitea.job_log(&repo, 1, 0).await;
    eprintln!("cancelled job's log:\n{log}\nrunner:\n{}", runner_output(runner_dir.path()));
    assert!(strip_log_timestamps(&log).lines().any(|l| l.trim() == "started"), "{log}");
    assert!(!log.contains("not 2 reached"), "the sleep was not interrupted:\n{log}");
}
