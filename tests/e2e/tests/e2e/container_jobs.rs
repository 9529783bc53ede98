//! `container:` jobs as on GitHub, through the real Gitea, the controller, the runner image
//! and the real gitea-runner, in both Docker modes of the docker placement (the
//! job-local dockerd and the rootless one), every image pulled through the operator's
//! registry mirror (a real registry on the host): in a build image (`e2e::images`, what
//! `node:22` brings), the real `actions/checkout@v4` checks out the run's commit,
//! `actions/cache@v4` saves in one job and restores in the next, `upload-artifact@v4`
//! and `download-artifact@v4` carry a file between the two, and a `services:` container is
//! reached by its name from the job container. `supervisor doctor --step` says, from
//! inside the job container and in a host-mode job, that the loopback, the runtime
//! service and the cache answer; and a step there reaches
//! neither its environment's loopback services on the environment's address nor
//! another environment's.

use std::{collections::BTreeMap, time::Duration};

use e2e::{
    docker::host,
    images::push_build_image,
    stack::{Controller, Options},
};
use testkit::{
    gitea::{TaskInfo, strip_log_timestamps},
    registry::Registry,
};

const WORKFLOW: &str = r#"name: container-jobs
on: push
jobs:
  save:
    runs-on: [disposable, container, docker]
    container:
      image: gdr-build
    services:
      web:
        image: gdr-build
    steps:
      - uses: actions/checkout@v4
      - run: |
          echo "head=[$(git rev-parse HEAD)]"
          echo "payload=[$(cat payload.txt)]"
          echo "image=[$(cat /etc/gdr-image)]"
      - run: /usr/local/lib/gitea-dynamic-runner/job-started doctor --step
      - run: |
          for i in $(seq 60); do out=$(wget -qO- http://web/ 2>&1) && break; sleep 1; done
          echo "service=[$out]"
          mkdir -p cached out
          echo "cached-$(head -c 6 /dev/urandom | od -An -tx1 | tr -d ' \n')" > cached/value
          echo "saved=[$(cat cached/value)]"
          echo "artifact-$(head -c 6 /dev/urandom | od -An -tx1 | tr -d ' \n')" > out/a.txt
          echo "made=[$(cat out/a.txt)]"
      - uses: actions/cache@v4
        with:
          path: cached
          key: container-${{ github.sha }}
      - uses: actions/upload-artifact@v4
        with:
          name: a
          path: out/a.txt
  restore:
    needs: save
    runs-on: [disposable, container, docker]
    container:
      image: gdr-build
    steps:
      - name: the environment's loopback and the neighbours' from the job container
        run: |
          # What answers HTTP at each address: this environment from its job network (the
          # gateway), and the first environments' addresses on the host's bridge (the host-mode
          # job runs beside; two run at a time).
          gateway=$(ip route | awk '/^default/ { print $3 }')
          port=${GITHUB_SERVER_URL##*:}; port=${port%%/*}
          for target in "$gateway:$port" "$gateway:41731" $(for i in $(seq 2 6); do echo "NEIGHBOURS.$i:41731"; done); do
            if wget -q -S -T 1 -O /dev/null "http://$target/" 2>&1 | grep -q 'HTTP/'; then echo "attack-reached=[$target]"; fi
          done
          echo "attack-tried=[gateway $gateway, ports $port and 41731; NEIGHBOURS.2-6:41731]"
      - uses: actions/cache@v4
        id: cache
        with:
          path: cached
          key: container-${{ github.sha }}
      - uses: actions/download-artifact@v4
        with:
          name: a
          path: got
      - run: |
          echo "hit=[${{ steps.cache.outputs.cache-hit }}]"
          echo "restored=[$(cat cached/value)]"
          echo "got=[$(cat got/a.txt)]"
  host:
    # After `save`, beside `restore` (whose attack finds this environment on the bridge).
    # (Run beside `save` instead, it ended first, and Gitea 1.23.8 once left `restore`
    # blocked after `save` succeeded: status 7 in action_run_job, no error in its log.)
    needs: save
    runs-on: [disposable, container, docker]
    steps:
      - run: supervisor doctor --step && sleep 10
"#;

/// The workflow's jobs, in its order.
const JOBS: [&str; 3] = ["save", "restore", "host"];

/// Which job Docker the environments get.
#[derive(Clone, Copy, Debug)]
enum Mode {
    JobDockerd,
    Rootless,
}

async fn container_jobs_work_as_on_github(mode: Mode) {
    let turn = e2e::exclusive().await;
    let docker = host();
    let image = docker.image("gitea-runner");
    let registry = tokio::task::block_in_place(Registry::start);
    tokio::task::block_in_place(|| push_build_image(&registry, &image, "gdr-build", "hello from the web service"));
    let gitea = e2e::actions::gitea_with_actions(docker.bridge_ip.into()).await;
    let token = gitea.runner_registration_token().await;
    let mut options = Options::new(&gitea.url(), &token, &image, &docker.socket);
    options.capacity = 2;
    let mirror = format!("registry_mirrors = [\"http://{}:{}\"]", docker.bridge_ip, registry.port);
    options.docker_extra = match mode {
        Mode::JobDockerd => mirror,
        Mode::Rootless => {
            options.job_dockerd = false;
            format!("job_docker = \"rootless\"\n{mirror}")
        }
    };
    let mut controller = Controller::start(options).await;
    let repo = gitea.create_repo("container-jobs").await;
    gitea.commit_file(&repo, "main", "payload.txt", b"the payload\n").await;
    let neighbours = docker.bridge_ip.to_string().rsplit_once('.').unwrap().0.to_owned();
    let commit = gitea.commit_workflow(&repo, "container.yml", &WORKFLOW.replace("NEIGHBOURS", &neighbours)).await;

    // Every job ended, or one failed (then `restore` never becomes a task).
    let ended = |t: &[TaskInfo]| t.iter().all(|t| !t.is_open()) && (t.len() >= 3 || t.iter().any(|t| t.status != "success"));
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(600), |t| !t.is_empty() && ended(t)).await;
    let run = tasks[0].run_number;
    let mut logs = BTreeMap::new();
    // A job's log by its index in the workflow (a job that never started has none).
    for task in &tasks {
        let index = JOBS.iter().position(|job| *job == task.name).unwrap_or_else(|| panic!("an unknown job {task:?}"));
        logs.insert(JOBS[index], strip_log_timestamps(&gitea.job_log(&repo, run, index).await));
    }
    let all: String = logs.iter().map(|(job, log)| format!("--- {job}:\n{log}\n")).collect();
    let statuses: Vec<(&str, &str)> = tasks.iter().map(|t| (t.name.as_str(), t.status.as_str())).collect();
    assert!(tasks.len() == 3 && tasks.iter().all(|t| t.status == "success"), "{mode:?}: {statuses:?}\n{all}\nregistry:\n{}", registry.log());
    let (save, restore) = (e2e::actions::said(&logs["save"]), e2e::actions::said(&logs["restore"]));
    let get = |map: &BTreeMap<String, String>, key: &str| map.get(key).cloned().unwrap_or_else(|| panic!("no {key}= in:\n{all}"));
    println!(
        "{mode:?}: checkout@v4 {} in {}; service by name: {}; cache {} -> {} (hit {}); artifact {} -> {}",
        get(&save, "head"),
        get(&save, "image"),
        get(&save, "service"),
        get(&save, "saved"),
        get(&restore, "restored"),
        get(&restore, "hit"),
        get(&save, "made"),
        get(&restore, "got"),
    );
    assert_eq!(get(&save, "head"), commit, "actions/checkout@v4 checked out the run's commit in the job container");
    assert_eq!(get(&save, "payload"), "the payload");
    assert_eq!(get(&save, "image"), "gdr-build from the mirror", "the steps ran in the job container");
    assert_eq!(get(&save, "service"), "hello from the web service", "the service answered by its name");
    assert_eq!((get(&restore, "hit").as_str(), get(&restore, "restored")), ("true", get(&save, "saved")), "actions/cache@v4 restored what the first job saved");
    assert_eq!(get(&restore, "got"), get(&save, "made"), "upload/download-artifact@v4 carried the file");
    // The job-started hook relayed the loopback into both job containers, not into the
    // host-mode job, and doctor found every URL a step gets answering in both shapes.
    for job in ["save", "restore"] {
        assert!(logs[job].contains("reaches the environment's loopback"), "{job}: no relay line:\n{all}");
    }
    assert!(!logs["host"].contains("reaches the environment's loopback"), "{all}");
    for (job, check) in ["save", "host"].into_iter().flat_map(|job| ["server", "runtime", "results", "cache"].map(|check| (job, check))) {
        assert!(logs[job].lines().any(|l| l.trim_start().starts_with(&format!("PASS  {check} "))), "{job}: doctor --step: {check} did not pass:\n{all}");
    }
    // Attack: from the job container, neither this environment's loopback services (on its
    // address in the job network) nor another environment's answer.
    println!("{mode:?}: attack from a container: step: tried {}", get(&restore, "attack-tried"));
    assert_eq!(restore.get("attack-reached"), None, "a container: step reached a loopback service over the network:\n{all}");
    let pulled = registry.log();
    assert!(pulled.contains("/v2/library/gdr-build/manifests/latest"), "gdr-build was not pulled through the mirror:\n{pulled}");

    let label = controller.environment_label();
    testkit::wait_until("every environment is removed", Duration::from_secs(90), || docker.containers(&label).is_empty()).await;
    controller.stop().await;
    drop(turn);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkout_cache_artifacts_and_services_in_container_jobs_with_the_job_dockerd() {
    container_jobs_work_as_on_github(Mode::JobDockerd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkout_cache_artifacts_and_services_in_container_jobs_with_the_rootless_dockerd() {
    container_jobs_work_as_on_github(Mode::Rootless).await;
}
