//! The container.kubernetes placement end to end: the real Gitea 1.23.8, the controller
//! with the Kubernetes driver, a real single-node Kubernetes v1.34 cluster (kubelet,
//! containerd, runc) creating one Pod per job from the runner image — privileged with its
//! own dockerd where the tests' jobs need Docker (`job_dockerd`), unprivileged by default —, the
//! static supervisor as the Pod's PID 1 preparing loop-backed storage and a job-local
//! dockerd inside the Pod, and the real gitea-runner v3.3.0 running the job. Pods reach
//! the facade over its development-mode TCP listener on the host address of their
//! bridge (the cluster has no Services or DNS). Nothing is faked.

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use e2e::{
    kubernetes::{Cluster, NodeSpire, cluster},
    stack::{Controller, Options, PodOptions},
};
use testkit::{
    gitea::{Gitea, GiteaOptions, Repo, TaskInfo, strip_log_timestamps},
    wait_until,
};

fn all_done(tasks: &[TaskInfo], expected: usize) -> bool {
    tasks.len() >= expected && tasks.iter().all(|t| !t.is_open())
}

struct Setup {
    gitea: Gitea,
    repo: Repo,
    namespace: String,
    options: Options,
    _turn: tokio::sync::MutexGuard<'static, ()>,
}

/// The cluster, the runner image in its containerd, a fresh namespace, Gitea on the
/// Pods' host address, a repository, and the controller's options (not started).
async fn setup(name: &str, capacity: usize) -> Setup {
    let turn = e2e::exclusive().await;
    let cluster = tokio::task::block_in_place(cluster);
    let image = tokio::task::block_in_place(|| cluster.image("gitea-runner"));
    let namespace = tokio::task::block_in_place(|| cluster.namespace("gdr-e2e"));
    let gitea = Gitea::start(GiteaOptions { bind: Cluster::HOST_IP.into(), ..GiteaOptions::default() }).await;
    let repo = gitea.create_repo(name).await;
    let token = gitea.runner_registration_token().await;
    let mut options = Options::new(&gitea.url(), &token, &image, std::path::Path::new("/nonexistent"));
    options.capacity = capacity;
    options.kubernetes = Some(PodOptions::on(cluster, &namespace));
    Setup { gitea, repo, namespace, options, _turn: turn }
}

fn pods_of(namespace: &str, controller: &Controller) -> Vec<String> {
    tokio::task::block_in_place(|| cluster().pods(namespace, &controller.environment_label()))
}

async fn pods_gone(namespace: &str, controller: &Controller) {
    let label = controller.environment_label();
    wait_until("every Pod is deleted", Duration::from_secs(90), || cluster().pods(namespace, &label).is_empty()).await;
}

/// Every Pod gone, every record terminal, the controller still running, then stopped,
/// and the namespace removed.
async fn finish(namespace: &str, mut controller: Controller) {
    pods_gone(namespace, &controller).await;
    controller.wait_until_all_terminal(Duration::from_secs(30)).await;
    controller.assert_running();
    controller.stop().await;
    tokio::task::block_in_place(|| cluster().kubectl_ok(&["delete", "namespace", namespace, "--wait=false"]));
}

const MATRIX: &str = r#"name: pods
on: push
jobs:
  build:
    strategy:
      matrix:
        n: [1, 2, 3]
    runs-on: [disposable, container, kubernetes]
    steps:
      - name: first
        run: echo "job ${{ matrix.n }} in a Pod"
      - name: who is PID 1
        run: echo "pid1=$(cat /proc/1/comm)"
      - name: the job's own dockerd
        run: echo "docker=$(docker info --format '{{.Driver}} {{.CgroupDriver}}')"
      - name: gitea through the loopback
        run: curl -sSf "$GITHUB_SERVER_URL/api/v1/version"; echo
      - name: no service-account token
        run: test ! -e /var/run/secrets/kubernetes.io/serviceaccount/token && echo "no token mounted"
"#;

const UNPRIVILEGED: &str = r#"name: unprivileged
on: push
jobs:
  build:
    runs-on: [disposable, container, kubernetes]
    steps:
      - run: echo "uid=$(id -u) nnp=$(grep NoNewPrivs /proc/self/status | tr -d '[:space:]')"
      - run: docker info >/dev/null 2>&1 && echo "docker answers" || echo "no docker here"
      - run: grep CapBnd /proc/1/status
"#;

/// By default (`job_dockerd = false`) a job runs in an unprivileged Pod: every capability
/// dropped but the supervisor's six, no privilege escalation, the runtime's seccomp
/// profile, no Docker — and the job still runs to success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_runs_in_an_unprivileged_pod_by_default() {
    let Setup { gitea, repo, namespace, mut options, _turn } = setup("unprivileged", 1).await;
    options.job_dockerd = false;
    let controller = Controller::start(options).await;
    gitea.commit_workflow(&repo, "unprivileged.yml", UNPRIVILEGED).await;
    let label = controller.environment_label();
    let spec = {
        let namespace = namespace.clone();
        testkit::wait_for("a job Pod is made", Duration::from_secs(120), || {
            tokio::task::block_in_place(|| {
                let pod = cluster().pods(&namespace, &label).into_iter().next()?;
                let output = cluster().kubectl(&["-n", &namespace, "get", "pod", &pod, "-o", "json"]);
                output.status.success().then(|| serde_json::from_slice::<serde_json::Value>(&output.stdout).unwrap())
            })
        })
        .await
    };
    let context = &spec["spec"]["containers"][0]["securityContext"];
    assert_eq!(context["privileged"], false, "{context}");
    assert_eq!(context["allowPrivilegeEscalation"], false, "{context}");
    assert_eq!(context["capabilities"]["drop"], serde_json::json!(["ALL"]), "{context}");
    assert_eq!(context["seccompProfile"]["type"], "RuntimeDefault", "{context}");
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(180), |t| all_done(t, 1)).await;
    let log = strip_log_timestamps(&gitea.job_log(&repo, tasks[0].run_number, 0).await);
    assert_eq!(tasks[0].status, "success", "{log}");
    assert!(log.contains("uid=2000 nnp=NoNewPrivs:1"), "{log}");
    assert!(log.contains("no docker here"), "{log}");
    // The bounding set of the supervisor: CHOWN, DAC_OVERRIDE, FOWNER, KILL, SETGID, SETUID.
    assert!(log.contains("00000000000000eb"), "{log}");
    finish(&namespace, controller).await;
}

/// What a watcher of the namespace saw of one Pod.
#[derive(Debug, Default, Clone)]
struct Seen {
    first: Option<Instant>,
    running: Option<Instant>,
    spec: Option<serde_json::Value>,
}

/// Three jobs at capacity two run in three Pods, never more than two running at once; each Pod
/// has the contract and the job's shape (PID 1 supervisor, its own dockerd on loop
/// storage, no token), and all are deleted afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_run_in_pods_never_more_than_capacity() {
    let Setup { gitea, repo, namespace, options, _turn } = setup("pods", 2).await;
    let controller = Controller::start(options).await;
    let label = controller.environment_label();
    let committed = Instant::now();
    gitea.commit_workflow(&repo, "pods.yml", MATRIX).await;

    let most = Arc::new(AtomicUsize::new(0));
    let seen: Arc<Mutex<BTreeMap<String, Seen>>> = Arc::default();
    let watching = {
        let (most, seen, namespace, label) = (Arc::clone(&most), Arc::clone(&seen), namespace.clone(), label.clone());
        tokio::task::spawn_blocking(move || {
            let deadline = Instant::now() + Duration::from_secs(300);
            while Instant::now() < deadline {
                let output = cluster().kubectl_ok(&["-n", &namespace, "get", "pods", "-l", &label, "-o", "json"]);
                let list: serde_json::Value = serde_json::from_str(&output).unwrap();
                let items = list["items"].as_array().cloned().unwrap_or_default();
                // A Pod whose job container ended is being torn down (its sandbox, its
                // network) for a few seconds: its slot is free from the container's end.
                let live = items
                    .iter()
                    .filter(|p| {
                        matches!(p["status"]["phase"].as_str(), Some("Pending" | "Running"))
                            && p["status"]["containerStatuses"][0]["state"]["terminated"].is_null()
                    })
                    .count();
                most.fetch_max(live, Ordering::SeqCst);
                if live > 2 {
                    for p in &items {
                        eprintln!(
                            "over capacity: {} phase={} deleting={} state={}",
                            p["metadata"]["name"], p["status"]["phase"], p["metadata"]["deletionTimestamp"], p["status"]["containerStatuses"][0]["state"]
                        );
                    }
                }
                let mut seen = seen.lock().unwrap();
                for pod in &items {
                    let entry = seen.entry(pod["metadata"]["name"].as_str().unwrap().to_owned()).or_default();
                    entry.first.get_or_insert_with(Instant::now);
                    if pod["status"]["phase"] == "Running" {
                        entry.running.get_or_insert_with(Instant::now);
                    }
                    entry.spec.get_or_insert_with(|| pod.clone());
                }
                if seen.len() >= 3 && items.is_empty() {
                    return;
                }
                drop(seen);
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(300), |t| all_done(t, 3)).await;
    let took = committed.elapsed();
    eprintln!("commit → three jobs finished in Pods: {took:?}");
    let run = tasks[0].run_number;
    for index in 0..3 {
        let raw = gitea.job_log(&repo, run, index).await;
        if took > Duration::from_secs(30) {
            eprintln!("job {index} ({:?}), log with timestamps:\n{raw}", tasks[index]);
        }
        let log = strip_log_timestamps(&raw);
        assert_eq!(tasks[index].status, "success", "{tasks:?}\n{log}");
        if let Some(ready) = log.lines().find(|line| line.contains("supervisor: environment ready")) {
            eprintln!("job {index}: {ready}");
        }
        let version = format!(r#""version":"{}""#, testkit::gitea::gitea_version());
        for expected in ["in a Pod", "pid1=supervisor", "docker=overlay2 cgroupfs", version.as_str(), "no token mounted"] {
            assert!(log.contains(expected), "{expected:?} missing from the job log:\n{log}");
        }
    }
    watching.await.unwrap();
    assert_eq!(most.load(Ordering::SeqCst), 2, "running Pods beyond capacity (or never two at once)");
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "one Pod per job: {:?}", seen.keys());
    for (name, pod) in &seen {
        if let (Some(first), Some(running)) = (pod.first, pod.running) {
            eprintln!("{name}: seen {:?} after the commit, Running {:?} later", first - committed, running - first);
        }
        let pod = pod.spec.as_ref().unwrap();
        let spec = &pod["spec"];
        assert_eq!(spec["restartPolicy"], "Never", "{spec}");
        assert_eq!(spec["automountServiceAccountToken"], false, "{spec}");
        assert_eq!(spec["enableServiceLinks"], false, "{spec}");
        assert!(spec["activeDeadlineSeconds"].as_i64().unwrap() > 0, "{spec}");
        let container = &spec["containers"][0];
        assert_eq!(container["securityContext"]["privileged"], true, "{container}");
        assert_eq!(container["command"][0], "/usr/local/bin/supervisor", "{container}");
        let env: Vec<&str> = container["env"].as_array().unwrap().iter().map(|e| e["name"].as_str().unwrap()).collect();
        for name in ["CI_ASSIGNMENT_ID", "CI_RUNNER_CAPABILITY", "CI_RUNNER_FACADE_URL", "CI_RUNNER_LABELS_JSON", "CI_GITEA_URL"] {
            assert!(env.contains(&name), "{name} missing from the Pod's env: {env:?}");
        }
        let labels = &pod["metadata"]["labels"];
        assert_eq!(labels["gitea-dynamic-runner/placement"], "container.kubernetes", "{labels}");
        assert!(labels["gitea-dynamic-runner/assignment-id"].as_str().unwrap().starts_with("gitea-task-"), "{labels}");
    }
    // The runner's credential never enters a Pod.
    let credential: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(controller.state_dir.join("runners/container.kubernetes.json")).unwrap()).unwrap();
    let token = credential["token"].as_str().unwrap();
    assert!(token.len() >= 16, "{credential}");
    for pod in seen.values() {
        assert!(!pod.spec.as_ref().unwrap().to_string().contains(token), "the runner token is in a Pod");
    }
    finish(&namespace, controller).await;
}

const SLEEPER: &str = r#"name: sleeper
on: push
jobs:
  sleeper:
    runs-on: [disposable, container, kubernetes]
    steps:
      - run: echo "started sleeping"
      - run: sleep SECONDS && echo "slept well"
"#;

async fn start_sleeper(gitea: &Gitea, repo: &Repo, seconds: u32) -> i64 {
    gitea.commit_workflow(repo, "sleeper.yml", &SLEEPER.replace("SECONDS", &seconds.to_string())).await;
    let tasks = gitea.wait_for_tasks(repo, Duration::from_secs(180), |t| t.iter().any(|t| t.status == "running")).await;
    let run = tasks[0].run_number;
    gitea.wait_for_log(repo, run, 0, "started sleeping").await;
    run
}

fn last_line(log: &str) -> &str {
    log.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_default()
}

/// Someone deletes the job's Pod mid-job: the task fails in Gitea with the reason as
/// the last log line, and nothing is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_deleted_mid_job_fails_the_task_with_the_reason() {
    let Setup { gitea, repo, namespace, options, _turn } = setup("deleted-pod", 2).await;
    let controller = Controller::start(options).await;
    let run = start_sleeper(&gitea, &repo, 300).await;
    let pods = pods_of(&namespace, &controller);
    assert_eq!(pods.len(), 1, "{pods:?}");
    let deleted_at = Instant::now();
    tokio::task::block_in_place(|| cluster().kubectl_ok(&["-n", &namespace, "delete", "pod", &pods[0], "--wait=false"]));
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(90), |t| all_done(t, 1)).await;
    eprintln!("Pod deleted → task failed in Gitea after {:?}", deleted_at.elapsed());
    assert_eq!(tasks[0].status, "failure", "{tasks:?}");
    let log = strip_log_timestamps(&gitea.job_log(&repo, run, 0).await);
    assert!(log.contains("started sleeping"), "the rows written before were lost:\n{log}");
    assert!(!log.lines().any(|l| l.trim() == "slept well"), "{log}");
    let last = last_line(&log);
    assert!(last.contains("gitea-dynamic-runner:") && last.contains("deleted"), "last line: {last:?}\n{log}");
    finish(&namespace, controller).await;
}

const ECHO: &str = r#"name: echo
on: push
jobs:
  echo:
    runs-on: [disposable, container, kubernetes]
    steps:
      - run: echo "never runs"
"#;

/// A Pod whose image is not on the node (and may not be pulled) never starts: the task
/// fails at once with the kubelet's reason instead of waiting for the job's deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_cannot_start_fails_the_task_with_the_kubelets_reason() {
    let Setup { gitea, repo, namespace, mut options, _turn } = setup("missing-image", 2).await;
    options.image = "gdr-e2e/no-such-image:missing".into();
    let controller = Controller::start(options).await;
    let committed = Instant::now();
    gitea.commit_workflow(&repo, "echo.yml", ECHO).await;
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(120), |t| all_done(t, 1)).await;
    eprintln!("commit → task failed for a missing image after {:?}", committed.elapsed());
    assert_eq!(tasks[0].status, "failure", "{tasks:?}");
    let log = strip_log_timestamps(&gitea.job_log(&repo, tasks[0].run_number, 0).await);
    let last = last_line(&log);
    assert!(last.contains("gitea-dynamic-runner:") && last.contains("ErrImageNeverPull"), "last line: {last:?}\n{log}");
    assert!(!log.lines().any(|l| l.trim() == "never runs"), "{log}");
    finish(&namespace, controller).await;
}

/// The controller stops mid-job and a new one starts with the same state: it finds the
/// job's Pod by its labels instead of making a second one, and the job finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_restarted_mid_job_adopts_its_pod_and_the_job_finishes() {
    let Setup { gitea, repo, namespace, mut options, _turn } = setup("restarted", 2).await;
    let state = e2e::stack::state_dir();
    options.state_dir = Some(state.path().to_owned());
    let mut controller = Controller::start(options.clone()).await;
    let run = start_sleeper(&gitea, &repo, 25).await;
    let before = pods_of(&namespace, &controller);
    assert_eq!(before.len(), 1, "{before:?}");
    controller.stop().await;
    // Its store (one redb file) must be closed before the next controller opens it.
    drop(controller);
    let stopped_at = Instant::now();
    let controller = Controller::start(options).await;
    eprintln!("controller restarted after {:?}", stopped_at.elapsed());
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(180), |t| all_done(t, 1)).await;
    let log = strip_log_timestamps(&gitea.job_log(&repo, run, 0).await);
    assert_eq!(tasks[0].status, "success", "{tasks:?}\n{log}");
    assert!(log.lines().any(|l| l.trim() == "slept well"), "{log}");
    let records = controller.records().await;
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0].environment.as_deref(), Some(before[0].as_str()), "a second Pod was made: {records:?}");
    finish(&namespace, controller).await;
}

/// The shipped manifests on the real cluster: `rbac.yaml` applies, `controller.yaml`
/// passes the API server's validation and admission (a server-side dry run: no
/// controller image is built here), the controller's ServiceAccount may manage Pods in
/// the jobs namespace and nothing else, and the driver does its whole job with exactly
/// that ServiceAccount's token — and is refused, with a hint, anywhere else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_manifests_apply_and_the_driver_works_with_least_privilege() {
    use controller::{
        assignment::Placement,
        driver::{
            Driver, EnvironmentSpec, Phase,
            kubernetes::{KubernetesConfig, KubernetesDriver},
            labels_for,
        },
    };
    use futures_util::StreamExt as _;

    let _turn = e2e::exclusive().await;
    let cluster = tokio::task::block_in_place(cluster);
    let manifests = e2e::paths::repository().join("config/kubernetes");
    let output = cluster.apply(&std::fs::read_to_string(manifests.join("rbac.yaml")).unwrap(), &[]);
    assert!(output.status.success(), "rbac.yaml: {}", String::from_utf8_lossy(&output.stderr));
    let output = cluster.apply(&std::fs::read_to_string(manifests.join("controller.yaml")).unwrap(), &["--dry-run=server"]);
    let applied = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "controller.yaml: {applied}{}", String::from_utf8_lossy(&output.stderr));
    for kind in [
        "configmap/gitea-dynamic-runner",
        "deployment.apps/gitea-dynamic-runner",
        "service/gitea-dynamic-runner",
        "persistentvolumeclaim/gitea-dynamic-runner-state",
    ] {
        assert!(applied.contains(kind), "{kind} missing from the dry run: {applied}");
    }

    let account = "system:serviceaccount:gitea-dynamic-runner:gitea-dynamic-runner";
    let rows = [
        ("create", "pods", "gitea-jobs", true),
        ("delete", "pods", "gitea-jobs", true),
        ("watch", "pods", "gitea-jobs", true),
        ("get", "secrets", "gitea-jobs", false),
        ("list", "configmaps", "gitea-jobs", false),
        ("create", "pods --subresource=exec", "gitea-jobs", false),
        ("update", "pods", "gitea-jobs", false),
        ("create", "pods", "default", false),
        ("list", "pods", "kube-system", false),
        ("get", "secrets", "gitea-dynamic-runner", false),
        ("create", "pods", "gitea-dynamic-runner", false),
        ("create", "rolebindings", "gitea-jobs", false),
    ];
    for (verb, resource, namespace, allowed) in rows {
        let mut args = vec!["auth", "can-i", verb];
        args.extend(resource.split(' '));
        args.extend(["-n", namespace, "--as", account]);
        let output = cluster.kubectl(&args);
        let answer = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        assert_eq!(answer, if allowed { "yes" } else { "no" }, "{verb} {resource} in {namespace}");
    }
    let output = cluster.kubectl(&["auth", "can-i", "list", "nodes", "--as", account]);
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "no");

    // A kubeconfig holding only the ServiceAccount's token.
    let token = cluster.kubectl_ok(&["-n", "gitea-dynamic-runner", "create", "token", "gitea-dynamic-runner"]).trim().to_owned();
    let admin = std::fs::read_to_string(&cluster.kubeconfig).unwrap();
    let field = |name: &str| admin.lines().find_map(|l| l.trim().strip_prefix(name).map(|v| v.trim().to_owned())).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {}\n    certificate-authority: {}\nusers:\n- name: sa\n  user:\n    token: {token}\ncontexts:\n- name: sa\n  context:\n    cluster: c\n    user: sa\ncurrent-context: sa\n",
            field("server:"),
            field("certificate-authority:")
        ),
    )
    .unwrap();
    let config = |namespace: &str| -> KubernetesConfig {
        toml::from_str(&format!(
            "namespace = \"{namespace}\"\nkubeconfig = \"{}\"\nimage = \"docker.io/library/busybox:local\"\nimage_pull_policy = \"Never\"\ncommand = [\"sh\", \"-c\", \"echo from the job; exit 3\"]\njob_dockerd = true\nprivileged = false\n",
            kubeconfig.display()
        ))
        .unwrap()
    };
    let refused = KubernetesDriver::connect(config("default")).await.unwrap_err().to_string();
    assert!(refused.contains("forbidden") && refused.contains("RBAC"), "{refused}");

    let driver = KubernetesDriver::connect(config("gitea-jobs")).await.unwrap();
    let mut changes = driver.changes().await.unwrap().unwrap();
    let placement = Placement::CONTAINER_KUBERNETES;
    let spec = EnvironmentSpec {
        assignment_id: "gitea-task-7".into(),
        name: "gdr-rbac-gitea-task-7".into(),
        labels: labels_for("rbac", "gitea-task-7", placement),
        env: [("CI_ASSIGNMENT_ID".to_owned(), "gitea-task-7".to_owned())].into(),
        ..EnvironmentSpec::default()
    };
    let created = driver.create(&spec).await.unwrap();
    assert_eq!((created.name.as_str(), created.assignment_id.as_str(), created.phase), ("gdr-rbac-gitea-task-7", "gitea-task-7", Phase::Running));
    // A repeated create (after a crash) adopts the first Pod.
    driver.create(&spec).await.unwrap();
    let listed = driver.list(&controller::driver::selector("rbac", placement)).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    let ended = tokio::time::timeout(Duration::from_secs(90), async {
        loop {
            let change = changes.next().await.expect("the watch ended");
            if change.name == spec.name {
                return change;
            }
        }
    })
    .await
    .expect("the Pod's end was not reported within 90 s");
    assert_eq!(ended.phase, Phase::Exited, "{ended:?}");
    assert!(ended.detail.contains("exited with code 3"), "{ended:?}");
    let pod = cluster.kubectl_ok(&["-n", "gitea-jobs", "get", "pod", &spec.name, "-o", "json"]);
    let pod: serde_json::Value = serde_json::from_str(&pod).unwrap();
    let capabilities = &pod["spec"]["containers"][0]["securityContext"]["capabilities"]["add"];
    assert!(capabilities.as_array().unwrap().iter().any(|c| c == "SYS_ADMIN"), "{capabilities}");
    assert!(!capabilities.as_array().unwrap().iter().any(|c| c == "SYS_RESOURCE"), "{capabilities}");
    driver.delete(&spec.name).await.unwrap();
    assert_eq!(driver.get(&spec.name).await.unwrap(), None);
    driver.delete(&spec.name).await.unwrap();
}

const IDENTIFIED: &str = r#"name: identified
on: push
jobs:
  build:
    runs-on: [disposable, container, kubernetes]
    steps:
      - run: echo "claimed over mTLS from a Pod"
"#;

/// SPIFFE instead of the development mode: the real SPIRE server, a node agent with the
/// `k8s` workload attestor (asking this node's kubelet which Pod a caller is in), its
/// socket directory mounted into every Pod, the facade's mTLS listener with the
/// controller's SVID, and one SPIRE entry per Pod made by the controller for exactly that
/// Pod (`k8s:ns` and `k8s:pod-name`). The supervisor in the Pod waits for its job's SVID
/// and claims over mTLS; the entry is gone with the Pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_claims_its_job_over_mtls_with_the_svid_of_its_own_entry() {
    const CONTROLLER: &str = "spiffe://e2e.test/gdr/controller";
    let Setup { gitea, repo, namespace, mut options, _turn } = setup("identified-pod", 2).await;
    let node = tokio::task::block_in_place(|| NodeSpire::start(cluster()));
    let exe = std::env::current_exe().unwrap();
    node.entry(CONTROLLER, &[format!("unix:path:{}", exe.display())]);
    if let Some(pods) = options.kubernetes.as_mut() {
        pods.spire = Some(node.for_pods(CONTROLLER));
    }
    let (spire, agent) = (&node.server, &node.agent);
    let controller = Controller::start(options).await;

    gitea.commit_workflow(&repo, "identified.yml", IDENTIFIED).await;
    // One identity per task: the repository, the job key and the task's id.
    let task = gitea.wait_for_tasks(&repo, Duration::from_secs(120), |t| !t.is_empty()).await[0].id;
    let job_id = format!("spiffe://e2e.test/ci/{}/{}/build/{task}", repo.owner, repo.name);
    let path =
        |e: &serde_json::Value| format!("spiffe://{}{}", e["spiffe_id"]["trust_domain"].as_str().unwrap_or(""), e["spiffe_id"]["path"].as_str().unwrap_or(""));
    wait_until("the Pod's SPIRE entry exists", Duration::from_secs(120), || spire.entries().iter().any(|e| path(e) == job_id)).await;
    let entry = spire.entries().into_iter().find(|e| path(e) == job_id).unwrap();
    let selectors: Vec<String> =
        entry["selectors"].as_array().unwrap().iter().map(|s| format!("{}:{}", s["type"].as_str().unwrap(), s["value"].as_str().unwrap())).collect();
    assert!(selectors.contains(&format!("k8s:ns:{namespace}")), "{entry}");
    let pod_name = entry["id"].as_str().unwrap().to_owned();
    assert!(selectors.contains(&format!("k8s:pod-name:{pod_name}")), "{entry}");

    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(180), |t| all_done(t, 1)).await;
    let log = strip_log_timestamps(&gitea.job_log(&repo, tasks[0].run_number, 0).await);
    assert_eq!(tasks[0].status, "success", "{tasks:?}\n{log}\n{}", agent.log());
    // The facade listens only with mTLS here: the claim itself proves the SVID.
    assert!(log.contains(&format!("identity: ready ({job_id})")), "the supervisor did not wait for its SVID:\n{log}");
    assert!(log.contains("claimed over mTLS from a Pod"), "{log}");
    wait_until("the entry is removed with the Pod", Duration::from_secs(90), || !spire.entries().iter().any(|e| path(e) == job_id)).await;
    finish(&namespace, controller).await;
}
