//! `container:` jobs as on GitHub, through the real Gitea, the controller, the runner image
//! and the real gitea-runner, in both Docker modes of the docker placement (the
//! job-local dockerd and the rootless one) and in Kubernetes Pods with their job-local
//! dockerd (the real cluster), every image pulled through the operator's
//! registry mirror (a real registry on the host): in a build image (`e2e::images`, what
//! `node:22` brings), the real `actions/checkout@v4` checks out the run's commit,
//! `actions/cache@v4` saves in one job and restores in the next, `upload-artifact@v4`
//! and `download-artifact@v4` carry a file between the two, and a `services:` container is
//! reached by its name from the job container; a host-mode job's service (started by
//! the agent, since gitea-runner starts none there) answers on its published port on the
//! environment's 127.0.0.1. `supervisor doctor --step` says, from
//! inside the job container and in a host-mode job, that the loopback, the runtime
//! service and the cache answer; and a step there reaches
//! neither its environment's loopback services on the environment's address nor
//! another environment's loopback, cache or published service.

use std::{collections::BTreeMap, time::Duration};

use e2e::{
    docker::host,
    images::push_build_image,
    kubernetes::{Cluster, cluster},
    stack::{Controller, Options, PodOptions},
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
          # job runs beside, its service published on its own 127.0.0.1:8080; two run at a time).
          gateway=$(ip route | awk '/^default/ { print $3 }')
          port=${GITHUB_SERVER_URL##*:}; port=${port%%/*}
          for target in "$gateway:$port" "$gateway:41731" $(for i in $(seq 2 6); do echo "NEIGHBOURS.$i:41731 NEIGHBOURS.$i:8080"; done); do
            if wget -q -S -T 1 -O /dev/null "http://$target/" 2>&1 | grep -q 'HTTP/'; then echo "attack-reached=[$target]"; fi
          done
          echo "attack-tried=[gateway $gateway, ports $port and 41731; NEIGHBOURS.2-6:41731 and :8080]"
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
    # gitea-runner starts no services for a host-mode job: the agent does, published on
    # this environment's 127.0.0.1 (GitHub's `localhost:<port>`), healthy before the first step.
    services:
      web:
        image: gdr-build
        ports: ['8080:80']
        options: --health-cmd "wget -q -O /dev/null http://127.0.0.1/" --health-interval 1s
    steps:
      - run: |
          supervisor doctor --step
          echo "host-service=[$(curl -sS --max-time 5 http://127.0.0.1:8080/)]"
          sleep 10
"#;

/// The workflow's jobs, in its order.
const JOBS: [&str; 3] = ["save", "restore", "host"];

/// Where the environments run and which job Docker they get.
#[derive(Clone, Copy, Debug)]
enum Mode {
    JobDockerd,
    Rootless,
    /// A Kubernetes Pod with its own root dockerd (the Pods' only Docker mode so far).
    PodJobDockerd,
}

async fn container_jobs_work_as_on_github(mode: Mode) {
    let turn = e2e::exclusive().await;
    let docker = host();
    let host_image = docker.image("gitea-runner");
    let registry = tokio::task::block_in_place(Registry::start);
    tokio::task::block_in_place(|| push_build_image(&registry, &host_image, "gdr-build", "hello from the web service"));
    // The cluster first: it brings the Pods' bridge, whose address Gitea binds.
    let pods = matches!(mode, Mode::PodJobDockerd).then(|| tokio::task::block_in_place(cluster));
    // The address the environments reach the host on (Gitea, the mirror, the facade).
    let host_ip = match mode {
        Mode::JobDockerd | Mode::Rootless => docker.bridge_ip,
        Mode::PodJobDockerd => Cluster::HOST_IP,
    };
    let gitea = e2e::actions::gitea_with_actions(host_ip.into()).await;
    let token = gitea.runner_registration_token().await;
    let mirror = format!("registry_mirrors = [\"http://{host_ip}:{}\"]", registry.port);
    let mut namespace = None;
    let mut options = match mode {
        Mode::JobDockerd | Mode::Rootless => Options::new(&gitea.url(), &token, &host_image, &docker.socket),
        Mode::PodJobDockerd => {
            let cluster = pods.expect("the cluster is started for Pods");
            let image = tokio::task::block_in_place(|| cluster.image("gitea-runner"));
            let name = tokio::task::block_in_place(|| cluster.namespace("gdr-e2e"));
            let mut options = Options::new(&gitea.url(), &token, &image, std::path::Path::new("/nonexistent"));
            let mut pods = PodOptions::on(cluster, &name);
            pods.extra = mirror.clone();
            options.kubernetes = Some(pods);
            namespace = Some(name);
            options
        }
    };
    options.capacity = 2;
    match mode {
        Mode::JobDockerd => options.docker_extra = mirror,
        Mode::Rootless => {
            options.job_dockerd = false;
            options.docker_extra = format!("job_docker = \"rootless\"\n{mirror}");
        }
        Mode::PodJobDockerd => {}
    }
    let mut controller = Controller::start(options).await;
    let repo = gitea.create_repo("container-jobs").await;
    gitea.commit_file(&repo, "main", "payload.txt", b"the payload\n").await;
    let neighbours = host_ip.to_string().rsplit_once('.').unwrap().0.to_owned();
    let mut workflow = WORKFLOW.replace("NEIGHBOURS", &neighbours);
    if namespace.is_some() {
        workflow = workflow.replace("[disposable, container, docker]", "[disposable, container, kubernetes]");
    }
    let commit = gitea.commit_workflow(&repo, "container.yml", &workflow).await;

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
    // The host-mode job's service: started by the agent, healthy before the first step
    // (the hook said so), and answering its published port on the environment's 127.0.0.1.
    let host = e2e::actions::said(&logs["host"]);
    println!("{mode:?}: host-mode service: {}", get(&host, "host-service"));
    assert_eq!(get(&host, "host-service"), "hello from the web service", "a host-mode job reached its service at 127.0.0.1:8080");
    assert!(logs["host"].contains("services: ready (web (gdr-build) on 127.0.0.1:8080->80/tcp)"), "the hook did not wait for the service:\n{all}");
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
    match &namespace {
        None => testkit::wait_until("every environment is removed", Duration::from_secs(90), || docker.containers(&label).is_empty()).await,
        Some(namespace) => {
            testkit::wait_until("every Pod is deleted", Duration::from_secs(90), || cluster().pods(namespace, &label).is_empty()).await;
            tokio::task::block_in_place(|| cluster().kubectl_ok(&["delete", "namespace", namespace, "--wait=false"]));
        }
    }
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkout_cache_artifacts_and_services_in_container_jobs_in_pods_with_the_job_dockerd() {
    container_jobs_work_as_on_github(Mode::PodJobDockerd).await;
}
