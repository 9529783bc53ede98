//! The vm.opensandbox placement end to end: the real Gitea 1.23.8, the controller with
//! the OpenSandbox driver, the real opensandbox-server (Docker runtime — the stand-in
//! for Kata here) creating one sandbox per job from the runner image, the static
//! supervisor as the sandbox's PID 1 reaching the facade over the development-mode TCP
//! listener, and the real gitea-runner v3.3.0 running the job. Nothing is faked.
//!
//! The Docker runtime's sandboxes are unprivileged containers (no loop devices, no
//! nested dockerd), so the job-local dockerd is off here (`SUPERVISOR_DOCKER=false`); in a
//! Kata VM it is on. Sandboxes reach the facade over the development-mode TCP listener,
//! or — in the SPIFFE test — over mTLS with an SVID from their own SPIRE entry.

use std::time::{Duration, Instant};

use e2e::{
    docker::host,
    stack::{Controller, Options, SandboxOptions, SandboxSpire},
};
use testkit::{
    gitea::{Gitea, GiteaOptions, Repo, TaskInfo, strip_log_timestamps},
    opensandbox::OpenSandbox,
    spire::{SpireAgent, SpireServer},
    wait_until,
};

const SANDBOXED: &str = r#"name: sandboxed
on: push
jobs:
  build:
    runs-on: [disposable, vm]
    steps:
      - name: first
        run: echo "step one in a sandbox"
      - name: gitea through the loopback
        run: |
          curl -sSf "$GITHUB_SERVER_URL/api/v1/version"; echo
      - name: who is PID 1
        run: echo "pid1=$(cat /proc/1/comm)"
  failing:
    runs-on: [disposable, vm]
    steps:
      - run: echo "before the failure"
      - run: exit 3
"#;

fn status_of<'a>(tasks: &'a [TaskInfo], job: &str) -> &'a str {
    tasks.iter().find(|t| t.name == job).map_or("missing", |t| t.status.as_str())
}

/// The real opensandbox-server on the shared Docker host, Gitea on the host's bridge, a
/// repository, and a controller for vm.opensandbox whose facade listens on the bridge.
async fn setup(name: &str) -> (OpenSandbox, Gitea, Repo, Controller, tokio::sync::MutexGuard<'static, ()>) {
    let turn = e2e::exclusive().await;
    let docker = host();
    let image = docker.image("gitea-runner");
    let server = tokio::task::block_in_place(|| OpenSandbox::start(&docker.url(), &image));
    let gitea = Gitea::start(GiteaOptions { bind: docker.bridge_ip.into(), ..GiteaOptions::default() }).await;
    let repo = gitea.create_repo(name).await;
    let token = gitea.runner_registration_token().await;
    let mut options = Options::new(&gitea.url(), &token, &image, &docker.socket);
    options.opensandbox = Some(SandboxOptions::on_host(&server, docker));
    let controller = Controller::start(options).await;
    (server, gitea, repo, controller, turn)
}

fn all_done(tasks: &[TaskInfo], expected: usize) -> bool {
    tasks.len() >= expected && tasks.iter().all(|t| !t.is_open())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_run_in_opensandbox_sandboxes() {
    let (server, gitea, repo, mut controller, _turn) = setup("sandboxed").await;
    let committed = Instant::now();
    gitea.commit_workflow(&repo, "sandboxed.yml", SANDBOXED).await;
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(180), |t| all_done(t, 2)).await;
    eprintln!("commit → both sandboxed jobs finished: {:?}", committed.elapsed());
    let run = tasks[0].run_number;
    // Job indexes follow the workflow's order.
    let build = strip_log_timestamps(&gitea.job_log(&repo, run, 0).await);
    assert_eq!(status_of(&tasks, "build"), "success", "{tasks:?}\n{build}\n{}", server.log());
    for expected in ["step one in a sandbox", r#""version":"1.23.8""#, "pid1=supervisor"] {
        assert!(build.contains(expected), "{expected:?} missing from the job log:\n{build}");
    }
    assert_eq!(status_of(&tasks, "failing"), "failure", "{tasks:?}");
    let failing = strip_log_timestamps(&gitea.job_log(&repo, run, 1).await);
    assert!(failing.contains("before the failure"), "{failing}");

    let label = controller.environment_label();
    wait_until("every sandbox is deleted", Duration::from_secs(60), || host().containers(&label).is_empty()).await;
    let records = controller.records().await;
    assert_eq!(records.len(), 2, "{records:?}");
    assert!(records.iter().all(|r| r.is_terminal()), "{records:?}");
    controller.assert_running();
    controller.stop().await;
}

const SLEEPER: &str = r#"name: sleeper
on: push
jobs:
  sleeper:
    runs-on: [disposable, vm]
    steps:
      - run: echo "started sleeping"
      - run: sleep 300
"#;

/// A sandbox that dies mid-job (its container killed under the server): the task fails
/// in Gitea with the server's reason as the last log line, and the sandbox is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_lost_mid_job_fails_the_task_with_the_servers_reason() {
    let (_server, gitea, repo, mut controller, _turn) = setup("lost-sandbox").await;
    gitea.commit_workflow(&repo, "sleeper.yml", SLEEPER).await;
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(120), |t| t.iter().any(|t| t.status == "running")).await;
    let run = tasks[0].run_number;
    gitea.wait_for_log(&repo, run, 0, "started sleeping").await;
    let label = controller.environment_label();
    let sandboxes = host().containers(&label);
    assert_eq!(sandboxes.len(), 1, "{sandboxes:?}");
    let killed_at = Instant::now();
    let output = host().docker(&["kill", &sandboxes[0]]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(60), |t| all_done(t, 1)).await;
    eprintln!("sandbox killed → task failed in Gitea after {:?}", killed_at.elapsed());
    assert_eq!(tasks[0].status, "failure");
    let log = strip_log_timestamps(&gitea.job_log(&repo, run, 0).await);
    let last = log.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_default();
    assert!(last.contains("gitea-dynamic-runner:") && last.contains("ended before the job finished") && last.contains("Failed"), "last line: {last:?}\n{log}");
    assert!(log.contains("started sleeping"), "the rows written before were lost:\n{log}");
    wait_until("the sandbox is deleted", Duration::from_secs(60), || host().containers(&label).is_empty()).await;
    controller.stop().await;
}

const IDENTIFIED: &str = r#"name: identified
on: push
jobs:
  build:
    runs-on: [disposable, vm]
    steps:
      - run: echo "claimed over mTLS"
      - run: sleep 8
"#;

/// SPIFFE instead of the development mode: the real SPIRE server and an agent whose socket
/// every sandbox mounts, the facade's mTLS listener with the controller's SVID, and one
/// SPIRE entry per sandbox made by the controller. Two jobs of two repositories run at
/// once behind that one agent, so each supervisor (uid 2000) is offered both jobs' SVIDs:
/// each presents exactly its own (the facade accepts a claim only from the assignment's
/// identity), and each entry is gone with its sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_claims_its_job_with_exactly_its_svid_from_its_spire_entry() {
    const AGENT: &str = "spiffe://e2e.test/gdr/node";
    const CONTROLLER: &str = "spiffe://e2e.test/gdr/controller";
    let _turn = e2e::exclusive().await;
    let docker = host();
    let image = docker.image("gitea-runner");
    let spire = tokio::task::block_in_place(|| SpireServer::start("e2e.test"));
    let agent = tokio::task::block_in_place(|| SpireAgent::start(&spire, AGENT));
    // The controller runs in this test process: its SVID is this executable's.
    let exe = std::env::current_exe().unwrap();
    let entry = spire.cli(&["entry", "create", "-parentID", AGENT, "-spiffeID", CONTROLLER, "-selector", &format!("unix:path:{}", exe.display())]);
    assert!(entry.status.success(), "{}", String::from_utf8_lossy(&entry.stderr));
    let mount = format!("{}:{}:ro", agent.socket_dir().display(), SandboxSpire::SOCKET_IN_SANDBOX.trim_end_matches("/agent.sock"));
    let server = tokio::task::block_in_place(|| OpenSandbox::start_with_binds(&docker.url(), &image, &[mount]));
    let gitea = Gitea::start(GiteaOptions { bind: docker.bridge_ip.into(), ..GiteaOptions::default() }).await;
    let repo = gitea.create_repo("identified").await;
    let second = gitea.create_repo("identified-too").await;
    let token = gitea.runner_registration_token().await;
    let mut options = Options::new(&gitea.url(), &token, &image, &docker.socket);
    options.opensandbox = Some(SandboxOptions {
        spire: Some(SandboxSpire { server_socket: spire.socket(), agent_socket: agent.socket(), controller_id: CONTROLLER.into(), parent_id: AGENT.into() }),
        ..SandboxOptions::on_host(&server, docker)
    });
    let mut controller = Controller::start(options).await;

    gitea.commit_workflow(&repo, "identified.yml", IDENTIFIED).await;
    gitea.commit_workflow(&second, "identified.yml", IDENTIFIED).await;
    // One identity per task: the repository, the job key and the task's id.
    let task = gitea.wait_for_tasks(&repo, Duration::from_secs(120), |t| !t.is_empty()).await[0].id;
    let second_task = gitea.wait_for_tasks(&second, Duration::from_secs(120), |t| !t.is_empty()).await[0].id;
    let job_id = format!("spiffe://e2e.test/ci/{}/{}/build/{task}", repo.owner, repo.name);
    let second_id = format!("spiffe://e2e.test/ci/{}/{}/build/{second_task}", second.owner, second.name);
    let path =
        |e: &serde_json::Value| format!("spiffe://{}{}", e["spiffe_id"]["trust_domain"].as_str().unwrap_or(""), e["spiffe_id"]["path"].as_str().unwrap_or(""));
    wait_until("both sandboxes' SPIRE entries exist at once", Duration::from_secs(120), || {
        let entries = spire.entries();
        entries.iter().any(|e| path(e) == job_id) && entries.iter().any(|e| path(e) == second_id)
    })
    .await;
    let entry = spire.entries().into_iter().find(|e| path(e) == job_id).unwrap();
    assert_eq!(entry["parent_id"]["path"], "/gdr/node", "{entry}");
    assert_eq!(entry["selectors"][0]["value"], "uid:2000", "{entry}");
    assert!(entry["id"].as_str().unwrap().starts_with("gdr-"), "named after the sandbox: {entry}");

    for repo in [&repo, &second] {
        let tasks = gitea.wait_for_tasks(repo, Duration::from_secs(180), |t| all_done(t, 1)).await;
        let log = strip_log_timestamps(&gitea.job_log(repo, tasks[0].run_number, 0).await);
        assert_eq!(tasks[0].status, "success", "{}: {tasks:?}\n{log}\n{}\n{}", repo.name, server.log(), agent.log());
        assert!(log.contains("claimed over mTLS"), "{log}");
    }
    wait_until("the entries are removed with the sandboxes", Duration::from_secs(60), || {
        !spire.entries().iter().any(|e| path(e) == job_id || path(e) == second_id)
    })
    .await;
    let mut left: Vec<String> = spire.entries().iter().map(path).collect();
    left.sort();
    assert_eq!(left, [CONTROLLER, AGENT], "only the controller's entry and the agent's alias stay");
    controller.assert_running();
    controller.stop().await;
}
