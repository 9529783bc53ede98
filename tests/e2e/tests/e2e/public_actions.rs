//! The public actions people write in every workflow, the real ones at their tags
//! (`e2e::actions`): `actions/checkout@v4` (node20) and `@v6` (node24) clone the run's
//! commit over the job's own token, `actions/upload-artifact@v3`/`download-artifact@v3`
//! (Gitea's pipelines API under `ACTIONS_RUNTIME_URL`) and `@v4` (the Twirp
//! `ArtifactService` under `ACTIONS_RESULTS_URL`) carry files from one job to the next —
//! each through the environment's loopback and the controller's facade, on the image's
//! Node.js. (`actions/cache@v4` and `@v5`: tests/e2e/tests/e2e/cache.rs.)

use std::{collections::BTreeMap, time::Duration};

use e2e::{
    docker::host,
    stack::{Controller, Options},
};
use testkit::gitea::strip_log_timestamps;

const WORKFLOW: &str = r#"name: public
on: push
jobs:
  make:
    runs-on: [disposable, container, docker]
    steps:
      - uses: actions/checkout@v4
      - run: |
          echo "v4-head=[$(git rev-parse HEAD)]"
          echo "v4-payload=[$(cat payload.txt)]"
      - uses: actions/checkout@v6
        with:
          path: six
      - run: |
          echo "v6-head=[$(git -C six rev-parse HEAD)]"
          echo "node=[$(node --version)]"
          mkdir -p out
          echo "three-$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \n')" > out/a3.txt
          echo "four-$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \n')" > out/a4.txt
          echo "made3=[$(cat out/a3.txt)]"
          echo "made4=[$(cat out/a4.txt)]"
      - uses: actions/upload-artifact@v3
        with:
          name: a3
          path: out/a3.txt
      - uses: actions/upload-artifact@v4
        with:
          name: a4
          path: out/a4.txt
  use:
    needs: make
    runs-on: [disposable, container, docker]
    steps:
      - uses: actions/download-artifact@v3
        with:
          name: a3
          path: got3
      - uses: actions/download-artifact@v4
        with:
          name: a4
          path: got4
      - run: |
          echo "got3=[$(cat got3/a3.txt)]"
          echo "got4=[$(cat got4/a4.txt)]"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkout_and_the_artifact_actions_run_as_on_github() {
    let turn = e2e::exclusive().await;
    let docker = host();
    let image = docker.image("gitea-runner");
    let gitea = e2e::actions::gitea_with_actions(docker.bridge_ip.into()).await;
    let token = gitea.runner_registration_token().await;
    let mut options = Options::new(&gitea.url(), &token, &image, &docker.socket);
    options.job_dockerd = false;
    let mut controller = Controller::start(options).await;
    let repo = gitea.create_repo("public").await;
    gitea.commit_file(&repo, "main", "payload.txt", b"the payload\n").await;
    let commit = gitea.commit_workflow(&repo, "public.yml", WORKFLOW).await;

    // Both jobs ended, or the first failed (then the second never becomes a task).
    let ended = |t: &[testkit::gitea::TaskInfo]| t.iter().all(|t| !t.is_open()) && (t.len() >= 2 || t.iter().any(|t| t.status != "success"));
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(480), |t| !t.is_empty() && ended(t)).await;
    let run = tasks[0].run_number;
    let mut logs = Vec::new();
    for index in 0..tasks.len() {
        logs.push(strip_log_timestamps(&gitea.job_log(&repo, run, index).await));
    }
    let all = logs.join("\n");
    assert!(tasks.len() == 2 && tasks.iter().all(|t| t.status == "success"), "{tasks:?}\n{all}");
    let (make, used) = (e2e::actions::said(&logs[0]), e2e::actions::said(&logs[1]));
    let get = |map: &BTreeMap<String, String>, key: &str| map.get(key).cloned().unwrap_or_else(|| panic!("no {key}= in:\n{all}"));
    println!("checkout@v4 {} checkout@v6 {} on node {}", get(&make, "v4-head"), get(&make, "v6-head"), get(&make, "node"));
    println!("artifact v3 {} -> {}, v4 {} -> {}", get(&make, "made3"), get(&used, "got3"), get(&make, "made4"), get(&used, "got4"));
    assert_eq!(get(&make, "v4-head"), commit, "actions/checkout@v4 checked out the run's commit");
    assert_eq!(get(&make, "v6-head"), commit, "actions/checkout@v6 checked out the run's commit");
    assert_eq!(get(&make, "v4-payload"), "the payload");
    assert!(get(&make, "node").starts_with("v24."), "the jobs' Node.js is the image's 24");
    assert_eq!(get(&used, "got3"), get(&make, "made3"), "upload/download-artifact@v3 carried the file");
    assert_eq!(get(&used, "got4"), get(&make, "made4"), "upload/download-artifact@v4 carried the file");
    controller.stop().await;
    drop(turn);
}
