//! Jobs run for real: the real Gitea 1.23.8, the controller's components, the runner
//! image with the static supervisor as PID 1 on a real dockerd, and the real
//! gitea-runner v3.3.0 (and act_runner v0.2.12) inside. Nothing is faked here.

use std::time::{Duration, Instant};

use e2e::{
    docker::host,
    stack::{Controller, Options},
};
use testkit::{
    gitea::{Gitea, GiteaOptions, GiteaVersion, Repo, TaskInfo, strip_log_timestamps},
    wait_until,
};

/// Gitea on the Docker host's bridge, so environments reach it; a repository; a
/// controller with the runner image of `variant`. Holds the Docker host's turn.
async fn setup(name: &str, variant: &str, capacity: usize) -> (Gitea, Repo, Controller, tokio::sync::MutexGuard<'static, ()>) {
    setup_with(name, variant, |options| options.capacity = capacity).await
}

/// [`setup`] with the controller's options as `adjust` leaves them.
pub(crate) async fn setup_with(
    name: &str,
    variant: &str,
    adjust: impl FnOnce(&mut Options),
) -> (Gitea, Repo, Controller, tokio::sync::MutexGuard<'static, ()>) {
    let turn = e2e::exclusive().await;
    let docker = host();
    let image = docker.image(variant);
    let gitea = Gitea::start(GiteaOptions { bind: docker.bridge_ip.into(), ..GiteaOptions::default() }).await;
    let repo = gitea.create_repo(name).await;
    let token = gitea.runner_registration_token().await;
    let mut options = Options::new(&gitea.url(), &token, &image, &docker.socket);
    adjust(&mut options);
    let controller = Controller::start(options).await;
    (gitea, repo, controller, turn)
}

/// All `expected` tasks are done — or one failed and the rest are done (a failed job
/// skips its dependents, which then never become tasks).
pub(crate) fn finished(tasks: &[TaskInfo], expected: usize) -> bool {
    let done = tasks.iter().all(|t| !t.is_open());
    done && (tasks.len() >= expected || tasks.iter().any(|t| t.status != "success"))
}

pub(crate) fn status_of<'a>(tasks: &'a [TaskInfo], job: &str) -> &'a str {
    tasks.iter().find(|t| t.name == job).map_or("missing", |t| t.status.as_str())
}

/// Asserts that `needles` appear in `log` in this order.
fn in_order(log: &str, needles: &[&str]) {
    let mut from = 0;
    for needle in needles {
        match log[from..].find(needle) {
            Some(at) => from += at + needle.len(),
            None => panic!("{needle:?} missing (or out of order) in the job log:\n{log}"),
        }
    }
}

pub(crate) async fn environments_gone(controller: &Controller) {
    let label = controller.environment_label();
    wait_until("every environment is removed", Duration::from_secs(60), || host().containers(&label).is_empty()).await;
}

const PIPELINE: &str = r#"name: pipeline
on: push
jobs:
  build:
    runs-on: [disposable, container, docker]
    outputs:
      greeting: ${{ steps.out.outputs.greeting }}
    steps:
      - name: first
        run: echo "step one"
      - name: gitea through the loopback
        run: |
          echo "server=$GITHUB_SERVER_URL"
          curl -sSf "$GITHUB_SERVER_URL/api/v1/version"; echo
      - name: clone with the job token
        env:
          TOKEN: ${{ secrets.GITHUB_TOKEN }}
        run: |
          git clone -q "http://x-access-token:${TOKEN}@${GITHUB_SERVER_URL#http://}/${GITHUB_REPOSITORY}.git" src
          test -f src/.gitea/workflows/pipeline.yml && echo "cloned ok"
      - name: the job's own dockerd
        run: |
          mkdir img && cp /usr/local/bin/supervisor img/
          tar -C img -c . | docker import - local/inner:1 > /dev/null
          docker run --rm local/inner:1 /supervisor version
      - id: out
        run: |
          echo "greeting=hello-from-build" >> "$GITHUB_OUTPUT"
          echo "**summary from the build**" >> "$GITHUB_STEP_SUMMARY"
  check:
    needs: build
    runs-on: [disposable, container, docker]
    steps:
      - run: echo "got=${{ needs.build.outputs.greeting }}"
"#;

pub(crate) const FAILING: &str = r#"name: failing
on: push
jobs:
  broken:
    runs-on: [disposable, container, docker]
    steps:
      - run: echo "before the failure"
      - run: exit 3
      - run: echo "never printed"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_run_through_the_real_gitea_and_runner() {
    let (gitea, repo, mut controller, _turn) = setup("pipeline", "gitea-runner", 2).await;
    gitea.commit_workflow(&repo, "pipeline.yml", PIPELINE).await;
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(240), |t| finished(t, 2)).await;
    let run = tasks[0].run_number;
    let build = strip_log_timestamps(&gitea.job_log(&repo, run, 0).await);
    assert_eq!((status_of(&tasks, "build"), status_of(&tasks, "check")), ("success", "success"), "{tasks:?}\n{build}");
    let version = format!(r#""version":"{}""#, gitea.version().release());
    in_order(&build, &["step one", "server=http://127.0.0.1:", &version, "cloned ok", "supervisor 0.1.0"]);
    let check = strip_log_timestamps(&gitea.job_log(&repo, run, 1).await);
    assert!(check.contains("got=hello-from-build"), "needs.build.outputs did not arrive:\n{check}");
    // Gitea 1.27 answers Declare with "job-summary": the runner behind the loopback then
    // uploads the step's summary through the pass-through, and the run shows it. 1.23
    // has no summaries.
    let view = gitea.run(&repo, run).await.unwrap();
    match gitea.version() {
        GiteaVersion::V1_27 => assert!(view.summaries.iter().any(|s| s.contains("summary from the build")), "no step summary in the run: {view:?}"),
        GiteaVersion::V1_23 => assert!(view.summaries.is_empty(), "{view:?}"),
    }

    // Its own repository: every push runs every `on: push` workflow of a repository.
    let other = gitea.create_repo("failing").await;
    gitea.commit_workflow(&other, "failing.yml", FAILING).await;
    let tasks = gitea.wait_for_tasks(&other, Duration::from_secs(120), |t| finished(t, 1)).await;
    assert_eq!(status_of(&tasks, "broken"), "failure", "{tasks:?}");
    let broken = tasks.iter().find(|t| t.name == "broken").unwrap();
    let log = strip_log_timestamps(&gitea.job_log(&other, broken.run_number, 0).await);
    in_order(&log, &["before the failure", "exit 3"]);
    assert!(!log.contains("never printed\n"), "a step after the failure ran:\n{log}");

    environments_gone(&controller).await;
    let records = controller.records().await;
    assert_eq!(records.len(), 3);
    assert!(records.iter().all(|r| r.is_terminal()), "{records:?}");
    controller.assert_running();
    controller.stop().await;
}

const SLEEPER: &str = r#"name: sleeper
on: push
jobs:
  sleeper:
    runs-on: [disposable, container, docker]
    steps:
      - run: echo "started sleeping"
      - run: sleep 300
"#;

/// Cancelling the run in Gitea (its own route) reaches the runner through the facade:
/// CANCELLED in Gitea, the assignment terminal within seconds, the environment and its
/// storage gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_in_gitea_stops_the_job_and_removes_the_environment() {
    let (gitea, repo, mut controller, _turn) = setup("cancel", "gitea-runner", 2).await;
    let loops_before = loop_devices();
    let run = start_sleeper(&gitea, &repo).await;
    let cancelled_at = Instant::now();
    gitea.cancel_run(&repo, run).await;
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(60), |t| finished(t, 1)).await;
    assert_eq!(tasks[0].status, "cancelled");
    controller.wait_until_all_terminal(Duration::from_secs(20)).await;
    let terminal_after = cancelled_at.elapsed();
    environments_gone(&controller).await;
    let gone_after = cancelled_at.elapsed();
    eprintln!("cancel → assignment terminal {terminal_after:?}, environment removed {gone_after:?}");
    assert!(terminal_after < Duration::from_secs(15), "{terminal_after:?}");
    assert_eq!(controller.records().await[0].state, controller::store::State::Terminal { result: "RESULT_CANCELLED".into() });
    wait_until("the environment's loop device is detached", Duration::from_secs(20), || loop_devices() <= loops_before).await;
    controller.stop().await;
}

/// Commits the sleeper workflow and returns its run once its job is running.
pub(crate) async fn start_sleeper(gitea: &Gitea, repo: &Repo) -> i64 {
    gitea.commit_workflow(repo, "sleeper.yml", SLEEPER).await;
    let tasks = gitea.wait_for_tasks(repo, Duration::from_secs(120), |t| t.iter().any(|t| t.status == "running")).await;
    let run = tasks[0].run_number;
    gitea.wait_for_log(repo, run, 0, "started sleeping").await;
    run
}

/// Loop devices with a backing file, host-wide.
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

const ECHO: &str = r#"name: echo
on: push
jobs:
  echo:
    runs-on: [disposable, container, docker]
    steps:
      - run: echo "hello from $GITEA_ACTIONS_RUNNER_VERSION"
      - run: curl -sSf "$GITHUB_SERVER_URL/api/v1/version"
"#;

/// The same job with the older runner generation in the image: act_runner v0.2.12 has
/// no job hooks, so the supervisor holds its task until dockerd is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_job_passes_with_act_runner() {
    let (gitea, repo, mut controller, _turn) = setup("act", "act_runner", 1).await;
    gitea.commit_workflow(&repo, "echo.yml", ECHO).await;
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(180), |t| finished(t, 1)).await;
    let log = strip_log_timestamps(&gitea.job_log(&repo, tasks[0].run_number, 0).await);
    assert_eq!(tasks[0].status, "success", "{log}");
    in_order(&log, &["hello from v0.2.12", &format!(r#""version":"{}""#, gitea.version().release())]);
    environments_gone(&controller).await;
    controller.stop().await;
}

/// The runner token and the registration token appear nowhere in an environment: not
/// in the environment of any process, their arguments, the files of the environment,
/// nor the image's layers. Checked while a job runs, from the Docker host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_runner_credential_enters_an_environment() {
    let (gitea, repo, mut controller, _turn) = setup("secrets", "gitea-runner", 1).await;
    let run = start_sleeper(&gitea, &repo).await;
    let registration = std::fs::read_to_string(controller.state_dir.join("registration-token")).unwrap();
    let credential: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(controller.state_dir.join("runners/container.docker.json")).unwrap()).unwrap();
    let runner_token = credential["token"].as_str().unwrap().to_owned();
    assert!(runner_token.len() >= 16 && registration.trim().len() >= 16);
    let containers = host().containers(&controller.environment_label());
    assert_eq!(containers.len(), 1);
    let name = &containers[0];
    // Every process's environment and arguments (but the search's own), and every file,
    // inside the environment; the tokens reach grep on stdin, not in its arguments.
    let search = "for p in /proc/[0-9]*; do case ${p#/proc/} in $$) continue;; esac; cat $p/environ $p/cmdline 2>/dev/null; echo; done; \
                  echo '--- files:'; grep -rIl -F -f /dev/stdin / --exclude-dir=proc --exclude-dir=sys 2>/dev/null; true";
    let mut exec = std::process::Command::new("docker")
        .args(["-H", &host().url(), "exec", "-i", name, "sh", "-c", search])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(exec.stdin.as_mut().unwrap(), format!("{runner_token}\n{}\n", registration.trim()).as_bytes()).unwrap();
    drop(exec.stdin.take());
    let output = exec.wait_with_output().unwrap();
    let found = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success());
    let (processes, files) = found.split_once("--- files:").unwrap();
    assert!(processes.contains("CI_ASSIGNMENT_ID"), "the search did not see the supervisor's environment: {processes}");
    assert!(!processes.contains(&runner_token), "the runner token is in a process of the environment");
    assert!(!processes.contains(registration.trim()), "the registration token is in a process of the environment");
    assert!(files.trim().is_empty(), "files of the environment hold a token: {files}");
    // The container's configuration as Docker holds it.
    let inspect = host().docker(&["inspect", name]);
    let config = String::from_utf8_lossy(&inspect.stdout);
    assert!(config.contains("CI_RUNNER_CAPABILITY") && !config.contains(&runner_token) && !config.contains(registration.trim()));
    // The image's layers.
    let image = host().docker(&["save", &controller.config.docker.as_ref().unwrap().image]);
    let bytes = image.stdout;
    assert!(bytes.len() > 1_000_000);
    assert!(!contains(&bytes, runner_token.as_bytes()) && !contains(&bytes, registration.trim().as_bytes()), "a token is in the image");
    gitea.cancel_run(&repo, run).await;
    environments_gone(&controller).await;
    controller.stop().await;
}

const NO_DOCKER: &str = r#"name: no-docker
on: push
jobs:
  build:
    runs-on: [disposable, container, docker]
    steps:
      - run: docker --version
      - run: docker build -t app .
  with-services:
    runs-on: [disposable, container, docker]
    services:
      web:
        image: nginx
    steps:
      - run: echo "a step ran without its service"
"#;

/// In the safe default (no job-local dockerd) a step that calls `docker` is told in one
/// line that this environment has none by design and what gives one — not the CLI's "Is
/// the docker daemon running?"; what needs no daemon still works. A host-mode job that
/// declares `services:` fails before its first step, saying why (gitea-runner alone would
/// run it without them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_calling_docker_where_there_is_none_is_told_why() {
    let (gitea, repo, mut controller, turn) = setup_with("no-docker", "gitea-runner", |options| {
        options.job_dockerd = false;
        options.capacity = 2;
    })
    .await;
    gitea.commit_workflow(&repo, "no-docker.yml", NO_DOCKER).await;
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(180), |t| t.len() == 2 && t.iter().all(|t| !t.is_open())).await;
    let run = tasks[0].run_number;
    let services = strip_log_timestamps(&gitea.job_log(&repo, run, 1).await);
    assert_eq!(status_of(&tasks, "with-services"), "failure", "{services}");
    assert!(services.contains("the job declares services (web) but this environment has no Docker"), "{services}");
    assert!(!services.contains("a step ran without its service"), "{services}");
    println!("the job with services was told: {}", services.lines().find(|l| l.contains("declares services")).unwrap_or_default());
    let log = strip_log_timestamps(&gitea.job_log(&repo, run, 0).await);
    assert_eq!(status_of(&tasks, "build"), "failure", "{log}");
    in_order(
        &log,
        &["Docker version ", "docker: this environment has no Docker", "job_docker = \"rootless\"", "job_docker = \"root\"", "runs-on: [disposable, vm]"],
    );
    assert!(!log.contains("Is the docker daemon running?"), "{log}");
    let told = log.lines().find(|l| l.contains("this environment has no Docker")).unwrap_or_default();
    println!("the step was told: {told}");
    environments_gone(&controller).await;
    controller.stop().await;
    drop(turn);
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// A second start reuses the stored credential: no second registration, and the same
/// runner keeps fetching.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runner_registers_once_and_reuses_its_credential() {
    let turn = e2e::exclusive().await;
    let docker = host();
    let image = docker.image("gitea-runner");
    let gitea = Gitea::start(GiteaOptions { bind: docker.bridge_ip.into(), ..GiteaOptions::default() }).await;
    let repo = gitea.create_repo("reuse").await;
    let state = e2e::stack::state_dir();
    let mut options = Options::new(&gitea.url(), &gitea.runner_registration_token().await, &image, &docker.socket);
    options.state_dir = Some(state.path().to_owned());
    options.capacity = 1;
    let mut controller = Controller::start(options.clone()).await;
    let file = controller.state_dir.join("runners/container.docker.json");
    wait_until("the controller registered", Duration::from_secs(30), || file.exists()).await;
    let first = std::fs::read_to_string(&file).unwrap();
    gitea.commit_workflow(&repo, "echo.yml", ECHO).await;
    gitea.wait_for_tasks(&repo, Duration::from_secs(120), |t| finished(t, 1)).await;
    controller.stop().await;
    environments_gone(&controller).await;
    drop(controller);

    // Same state directory; the registration token file now holds an invalid token, so a
    // second registration would fail the start.
    options.registration_token = "invalid-token-registration-must-not-happen".into();
    let mut again = Controller::start(options).await;
    gitea.commit_workflow(&repo, "echo.yml", &ECHO.replace("name: echo", "name: echo again")).await;
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(120), |t| t.len() == 2 && finished(t, 2)).await;
    assert!(tasks.iter().all(|t| t.status == "success"), "{tasks:?}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), first, "the credential changed: the runner registered again");
    again.assert_running();
    again.stop().await;
    environments_gone(&again).await;
    drop(turn);
}

const FOREIGN: &str = r#"name: foreign
on: push
jobs:
  foreign:
    runs-on: self-hosted
    steps:
      - run: echo "meant for another runner"
"#;

/// A job for another runner (`runs-on: self-hosted`) is not taken: Gitea offers a job to
/// every runner whose labels cover its `runs-on`, and a runner cannot hand a job back, so
/// taking it could only fail it. Committed before ours, it would be handed out first if
/// our registration matched it; ours runs, and the foreign one never becomes a task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_for_another_runner_is_left_waiting_in_gitea() {
    let (gitea, repo, mut controller, _turn) = setup("foreign", "gitea-runner", 1).await;
    gitea.commit_workflow(&repo, "foreign.yml", FOREIGN).await;
    gitea.commit_workflow(&repo, "echo.yml", ECHO).await;
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(180), |t| finished(t, 1)).await;
    assert_eq!(status_of(&tasks, "echo"), "success", "{tasks:?}");
    // Several fetch rounds after ours finished: still no task for the foreign job.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let tasks = gitea.tasks(&repo).await;
    assert!(tasks.iter().all(|t| t.name != "foreign"), "the job meant for another runner was taken: {tasks:?}");
    environments_gone(&controller).await;
    controller.stop().await;
}

const QUICK: &str = r#"name: quick
on: push
jobs:
  quick:
    runs-on: [disposable, container, docker]
    steps:
      - run: echo "picked"
"#;

/// Gitea ≥ 1.24 says when a job is queued (the `workflow_job` webhook): with it the
/// controller fetches at once instead of at its next poll. With a 30 s poll, on 1.27 the
/// job is picked within seconds and the delivery is counted as having woken the fetch
/// loops; on 1.23, which has no such event, the poll still picks it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_job_is_fetched_at_once_when_gitea_says_so() {
    const SECRET: &str = "webhook-secret-0123456789abcdef";
    const POLL: Duration = Duration::from_secs(30);
    let _turn = e2e::exclusive().await;
    let docker = host();
    let image = docker.image("gitea-runner");
    // Gitea delivers to loopback only where allowed (1.27 reads the old [webhook] key too).
    let ini = "[webhook]\nALLOWED_HOST_LIST = loopback\n".to_owned();
    let gitea = Gitea::start(GiteaOptions { bind: docker.bridge_ip.into(), extra_ini: ini, ..GiteaOptions::default() }).await;
    let repo = gitea.create_repo("webhook").await;
    let token = gitea.runner_registration_token().await;
    let secret_dir = tempfile::tempdir().unwrap();
    let secret_file = secret_dir.path().join("webhook-secret");
    std::fs::write(&secret_file, format!("{SECRET}\n")).unwrap();
    let port = testkit::free_local_port();
    let mut options = Options::new(&gitea.url(), &token, &image, &docker.socket);
    options.fetch_interval = Some(format!("{}s", POLL.as_secs()));
    options.http_listen = format!("127.0.0.1:{port}");
    options.extra_gitea = format!("webhook_secret_file = \"{}\"", secret_file.display());
    let _controller = Controller::start(options).await;
    gitea.add_webhook(&repo, &format!("http://127.0.0.1:{port}/hooks/gitea"), SECRET, &["workflow_job"]).await;
    // The fetch loops' first (empty) fetch is behind them: they sit in their 30 s poll.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let committed = Instant::now();
    gitea.commit_workflow(&repo, "quick.yml", QUICK).await;
    gitea.wait_for_tasks(&repo, POLL * 2, |tasks| !tasks.is_empty()).await;
    let picked = committed.elapsed();
    let (_, metrics) = testkit::http_get(&format!("http://127.0.0.1:{port}/metrics")).await;
    let woken = metrics.lines().any(|l| l.starts_with("gdr_webhook_deliveries_total{kind=\"queued\"}"));
    eprintln!("Gitea {}: commit → picked {picked:.1?} with a {POLL:?} poll; webhook woke the fetch loops: {woken}", gitea.version().release());
    match gitea.version() {
        GiteaVersion::V1_27 => {
            assert!(woken, "no queued delivery reached the controller:\n{metrics}");
            assert!(picked < Duration::from_secs(10), "picked after {picked:?}: the webhook did not cut the poll short");
        }
        GiteaVersion::V1_23 => {
            assert!(!woken, "Gitea 1.23 has no workflow_job event:\n{metrics}");
            assert!(picked < POLL + Duration::from_secs(10), "the poll, the fallback, picked it after {picked:?}");
        }
    }
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(120), |t| finished(t, 1)).await;
    assert_eq!(status_of(&tasks, "quick"), "success", "{tasks:?}");
}
