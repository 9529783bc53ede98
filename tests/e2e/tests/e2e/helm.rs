//! The production topology on Kubernetes, as an operator installs it: the chart
//! (`charts/gitea-dynamic-runner`) installed with the real `helm` into the real cluster of
//! the tests, the controller running as a Pod from the controller image
//! (`scripts/build controller-image`) with its in-cluster ServiceAccount and no
//! kubeconfig, the embedded store on the chart's PersistentVolumeClaim, SPIRE giving the
//! controller and every job Pod their SVIDs (one entry per Pod, made by the controller),
//! and the real Gitea 1.23.8 on the host. Job Pods reach the facade over mTLS.
//!
//! What the test cluster lacks, and the values that stand in (each a value of the chart,
//! for clusters like it): it has no kube-proxy and no DNS, so a Service's address leads
//! nowhere. The controller shares the node's network (`hostNetwork`), job Pods reach its
//! facade at the node's address on their bridge (`facade.url`), and it reaches the API
//! server, which listens on the node's 127.0.0.1, there (`extraEnv`:
//! `KUBERNETES_SERVICE_HOST`/`PORT`). No storage provisioner runs: the test makes the
//! PersistentVolume the chart's claim binds to.

use std::{
    path::Path,
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use e2e::{
    kubernetes::{Cluster, NodeSpire, cluster},
    paths,
};
use testkit::{
    free_port,
    gitea::{Gitea, GiteaOptions, TaskInfo, strip_log_timestamps},
    wait_until,
};

const RELEASE: &str = "gdr";
/// The chart's name for every object of a release called [`RELEASE`].
const FULLNAME: &str = "gdr-gitea-dynamic-runner";
/// The release's state volume, smaller than the chart's default (which is sized for a cache) the
/// way an operator on a small node would set it; the test's PersistentVolume offers exactly this.
const STATE_SIZE: &str = "2Gi";
/// The cache's volume: its limits (1G, entries of 256M) and their in-flight allowance.
const CACHE_SIZE: &str = "2Gi";

fn helm(kubeconfig: &Path, args: &[&str]) -> Output {
    Command::new("helm").env("KUBECONFIG", kubeconfig).args(args).stdin(Stdio::null()).output().expect("helm cannot run: run scripts/install test-peers")
}

fn helm_ok(kubeconfig: &Path, args: &[&str]) -> String {
    let output = helm(kubeconfig, args);
    assert!(output.status.success(), "helm {args:?}: {}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn done(tasks: &[TaskInfo], expected: usize) -> bool {
    tasks.len() >= expected && tasks.iter().all(|t| !t.is_open())
}

/// The controller Pods of the release: (name, phase, ready).
fn controller_pods(namespace: &str) -> Vec<(String, String, bool)> {
    let jsonpath = r#"{range .items[*]}{.metadata.name} {.status.phase} {.status.containerStatuses[0].ready}{"\n"}{end}"#;
    let out = cluster().kubectl_ok(&["-n", namespace, "get", "pods", "-l", "app.kubernetes.io/instance=gdr", "-o", &format!("jsonpath={jsonpath}")]);
    out.lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            Some((words.next()?.to_owned(), words.next()?.to_owned(), words.next() == Some("true")))
        })
        .collect()
}

/// Why the controller is not up yet, for a failure message.
fn controller_state(namespace: &str) -> String {
    let pods = cluster().kubectl(&["-n", namespace, "get", "pods", "-o", "wide"]);
    let logs = cluster().kubectl(&["-n", namespace, "logs", "-l", "app.kubernetes.io/instance=gdr", "--tail", "40"]);
    let events = cluster().kubectl(&["-n", namespace, "get", "events", "--sort-by", ".lastTimestamp"]);
    format!(
        "{}\n{}{}\n{}",
        String::from_utf8_lossy(&pods.stdout),
        String::from_utf8_lossy(&logs.stdout),
        String::from_utf8_lossy(&logs.stderr),
        String::from_utf8_lossy(&events.stdout)
    )
}

async fn wait_for_one_ready_controller(namespace: &str, not: Option<&str>) -> String {
    let ready = testkit::poll(Duration::from_secs(180), || async {
        match tokio::task::block_in_place(|| controller_pods(namespace)).as_slice() {
            [(name, phase, true)] if phase == "Running" && Some(name.as_str()) != not => Ok(name.clone()),
            _ => Err(()),
        }
    });
    ready.await.unwrap_or_else(|()| panic!("no ready controller Pod after 180 s:\n{}", tokio::task::block_in_place(|| controller_state(namespace))))
}

/// One job succeeds, one fails. The first also tries the controller's HTTP port from its
/// Pod (`controller`: the controller Pod's address and that port) and, to show the Pod
/// reaches that address at all, the facade's (`facade`).
fn jobs(controller: std::net::SocketAddr, facade: std::net::SocketAddr) -> String {
    let connect = |address: std::net::SocketAddr| format!("timeout 5 bash -c 'exec 3<>/dev/tcp/{}/{}' 2>/dev/null", address.ip(), address.port());
    format!(
        r#"name: chart
on: push
jobs:
  build:
    runs-on: [disposable, container, kubernetes]
    steps:
      - run: echo "pid1=$(cat /proc/1/comm)"
      - run: curl -sSf "$GITHUB_SERVER_URL/api/v1/version"; echo
      - run: {controller} && r=reach || r=refused; echo "controller-http=$r"
      - run: {facade} && r=connects || r=refused; echo "facade-port=$r"
  failing:
    runs-on: [disposable, container, kubernetes]
    steps:
      - run: echo "before the failure"
      - run: exit 3
"#,
        controller = connect(controller),
        facade = connect(facade),
    )
}

const SLEEPER: &str = r#"name: sleeper
on: push
jobs:
  sleeper:
    runs-on: [disposable, container, kubernetes]
    steps:
      - run: echo "started sleeping"
      - run: sleep 25 && echo "slept well"
"#;

/// install → jobs succeed and fail in Pods the in-cluster controller made → `helm
/// upgrade` with a new capacity restarts the controller with it → the controller Pod
/// deleted mid-job, the job still finishes → `helm uninstall` leaves no Pod behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_runs_the_controller_in_the_cluster_end_to_end() {
    let _turn = e2e::exclusive().await;
    let cluster = tokio::task::block_in_place(cluster);
    let kubeconfig = cluster.kubeconfig.clone();
    let runner_image = tokio::task::block_in_place(|| cluster.image("gitea-runner"));
    let (controller_image, tar) = tokio::task::block_in_place(|| paths::controller_image(None));
    tokio::task::block_in_place(|| cluster.import(&controller_image, &tar));
    let (repository, tag) = controller_image.rsplit_once(':').unwrap();

    let spire = tokio::task::block_in_place(|| NodeSpire::start(cluster));
    let gitea = Gitea::start(GiteaOptions { bind: Cluster::HOST_IP.into(), ..GiteaOptions::default() }).await;
    let namespace = tokio::task::block_in_place(|| cluster.namespace("gdr-helm"));
    let jobs_namespace = format!("{namespace}-jobs");

    // What an operator makes before installing: the Secret, the SPIRE entry of the
    // controller's ServiceAccount, and here the volume of the claim.
    let secrets = tempfile::tempdir().unwrap();
    std::fs::write(secrets.path().join("registration-token"), gitea.runner_registration_token().await).unwrap();
    std::fs::write(secrets.path().join("capability.key"), format!("helm-test-capability-key-{:032x}", fastrand::u128(..))).unwrap();
    let from = |name: &str| format!("--from-file={name}={}", secrets.path().join(name).display());
    tokio::task::block_in_place(|| {
        cluster.kubectl_ok(&[
            "-n",
            &namespace,
            "create",
            "secret",
            "generic",
            "gitea-dynamic-runner-secrets",
            &from("registration-token"),
            &from("capability.key"),
        ])
    });
    let controller_id = format!("spiffe://{}/ci/controller", NodeSpire::TRUST_DOMAIN);
    spire.entry(&controller_id, &[format!("k8s:ns:{namespace}"), format!("k8s:sa:{FULLNAME}")]);
    let state = tempfile::tempdir().unwrap();
    let volume = format!("{namespace}-state");
    let pv = format!(
        "apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: {volume}}}\nspec:\n  capacity: {{storage: {STATE_SIZE}}}\n  accessModes: [ReadWriteOnce]\n  persistentVolumeReclaimPolicy: Delete\n  hostPath: {{path: {path}, type: Directory}}\n  claimRef: {{namespace: {namespace}, name: {FULLNAME}-state}}\n",
        path = state.path().display()
    );
    let applied = tokio::task::block_in_place(|| cluster.apply(&pv, &[]));
    assert!(applied.status.success(), "{}", String::from_utf8_lossy(&applied.stderr));
    // The jobs' cache on a volume of its own (never the store's).
    let cache_volume = tempfile::tempdir().unwrap();
    let cache_pv = format!(
        "apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: {namespace}-cache}}\nspec:\n  capacity: {{storage: {CACHE_SIZE}}}\n  accessModes: [ReadWriteOnce]\n  persistentVolumeReclaimPolicy: Delete\n  hostPath: {{path: {path}, type: Directory}}\n  claimRef: {{namespace: {namespace}, name: {FULLNAME}-cache}}\n",
        path = cache_volume.path().display()
    );
    let applied = tokio::task::block_in_place(|| cluster.apply(&cache_pv, &[]));
    assert!(applied.status.success(), "{}", String::from_utf8_lossy(&applied.stderr));

    let host = Cluster::HOST_IP;
    let facade_port = free_port(std::net::Ipv4Addr::UNSPECIFIED.into());
    let metrics_port = free_port(std::net::Ipv4Addr::UNSPECIFIED.into());
    let values = |capacity: usize| {
        format!(
            r#"gitea: {{url: "{gitea}"}}
image: {{repository: "{repository}", tag: "{tag}", pullPolicy: Never}}
identity: {{trustDomain: "{trust_domain}"}}
facade: {{port: {facade_port}, url: "https://{host}:{facade_port}"}}
spire:
  agentSocketDir: "{agent_dir}"
  agentSocketName: "{agent_socket}"
  serverSocketDir: "{server_dir}"
  serverSocketName: "{server_socket}"
  parentId: "{parent}"
pools: [{{placement: container.kubernetes, capacity: {capacity}}}]
store: {{embedded: {{size: {STATE_SIZE}}}}}
cache: {{maxSize: 1G, maxRepositorySize: 256M, keepFree: 1%, volume: {{size: {CACHE_SIZE}}}}}
jobs:
  namespace: "{jobs_namespace}"
  image: "{runner_image}"
  imagePullPolicy: Never
  cpu: "1"
  memory: 1Gi
metrics: {{port: {metrics_port}}}
hostNetwork: true
extraEnv:
  - {{name: KUBERNETES_SERVICE_HOST, value: "127.0.0.1"}}
  - {{name: KUBERNETES_SERVICE_PORT, value: "{api_port}"}}
"#,
            gitea = gitea.url(),
            trust_domain = NodeSpire::TRUST_DOMAIN,
            agent_dir = spire.agent.socket().parent().unwrap().display(),
            agent_socket = spire.agent.socket().file_name().unwrap().to_string_lossy(),
            server_dir = spire.server.socket().parent().unwrap().display(),
            server_socket = spire.server.socket().file_name().unwrap().to_string_lossy(),
            parent = NodeSpire::AGENT,
            api_port = cluster.api_port(),
        )
    };
    let values_file = secrets.path().join("values.yaml");
    std::fs::write(&values_file, values(2)).unwrap();
    let chart = paths::repository().join("charts/gitea-dynamic-runner");
    let chart = chart.to_str().unwrap();
    let values_path = values_file.to_str().unwrap();
    let installed = Instant::now();
    tokio::task::block_in_place(|| helm_ok(&kubeconfig, &["install", RELEASE, chart, "-n", &namespace, "-f", values_path]));
    let first = wait_for_one_ready_controller(&namespace, None).await;
    eprintln!("helm install → controller Pod {first} ready in {:?}", installed.elapsed());
    // In the cluster by its ServiceAccount: the configuration names no kubeconfig.
    let config =
        tokio::task::block_in_place(|| cluster.kubectl_ok(&["-n", &namespace, "get", "configmap", FULLNAME, "-o", "jsonpath={.data.controller\\.toml}"]));
    assert!(!config.lines().any(|l| l.trim_start().starts_with("kubeconfig")), "{config}");

    // Jobs: one succeeds, one fails, each in a Pod the controller made.
    let repo = gitea.create_repo("chart").await;
    // The controller Pod is on the host's network here, so its address is the host's.
    let controller_address = |port: u16| std::net::SocketAddr::from((host, port));
    gitea.commit_workflow(&repo, "chart.yml", &jobs(controller_address(metrics_port), controller_address(facade_port))).await;
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(240), |t| done(t, 2)).await;
    let status = |name: &str| tasks.iter().find(|t| t.name == name).map(|t| t.status.clone()).unwrap_or_default();
    let build_log = strip_log_timestamps(&gitea.job_log(&repo, tasks[0].run_number, 0).await);
    assert_eq!(
        (status("build").as_str(), status("failing").as_str()),
        ("success", "failure"),
        "{tasks:?}\n{build_log}\n{}",
        tokio::task::block_in_place(|| controller_state(&namespace))
    );
    assert!(build_log.contains("pid1=supervisor"), "{build_log}");
    assert!(build_log.contains("\"version\""), "Gitea through the job's loopback:\n{build_log}");
    // F7: the controller's HTTP port (metrics, health) is not on the Pod network unless a
    // Service asks for it (gdr.exposeHttp); the same address's facade port is.
    assert!(build_log.contains("facade-port=connects"), "{build_log}");
    assert!(build_log.contains("controller-http=refused"), "a job Pod reached the controller's HTTP port:\n{build_log}");

    // helm upgrade with a new capacity: the controller restarts with the new configuration.
    std::fs::write(&values_file, values(3)).unwrap();
    tokio::task::block_in_place(|| helm_ok(&kubeconfig, &["upgrade", RELEASE, chart, "-n", &namespace, "-f", values_path]));
    let second = wait_for_one_ready_controller(&namespace, Some(&first)).await;
    let config =
        tokio::task::block_in_place(|| cluster.kubectl_ok(&["-n", &namespace, "get", "configmap", FULLNAME, "-o", "jsonpath={.data.controller\\.toml}"]));
    assert!(config.contains("capacity = 3"), "{config}");

    // The controller Pod deleted mid-job: the Deployment makes another, which adopts the
    // job's Pod from the store on the claim; the job finishes with its true result.
    let sleeper = gitea.create_repo("sleeper").await;
    gitea.commit_workflow(&sleeper, "sleeper.yml", SLEEPER).await;
    gitea.wait_for_log(&sleeper, 1, 0, "started sleeping").await;
    tokio::task::block_in_place(|| cluster.kubectl_ok(&["-n", &namespace, "delete", "pod", &second, "--wait=false"]));
    let third = wait_for_one_ready_controller(&namespace, Some(&second)).await;
    let tasks = gitea.wait_for_tasks(&sleeper, Duration::from_secs(240), |t| done(t, 1)).await;
    let log = strip_log_timestamps(&gitea.job_log(&sleeper, tasks[0].run_number, 0).await);
    assert_eq!(tasks[0].status, "success", "{log}\n{}", tokio::task::block_in_place(|| controller_state(&namespace)));
    assert_eq!(log.lines().filter(|l| l.trim() == "slept well").count(), 1, "{log}");
    eprintln!("controller Pods: {first} → (helm upgrade) {second} → (deleted mid-job) {third}");

    // helm uninstall: the controller and every job Pod go (the jobs namespace is the chart's).
    tokio::task::block_in_place(|| helm_ok(&kubeconfig, &["uninstall", RELEASE, "-n", &namespace, "--wait", "--timeout", "120s"]));
    wait_until("no Pod is left after helm uninstall", Duration::from_secs(120), || {
        let left = |ns: &str| cluster.kubectl_ok(&["-n", ns, "get", "pods", "-o", "name"]);
        left(&namespace).trim().is_empty() && left(&jobs_namespace).trim().is_empty()
    })
    .await;
    tokio::task::block_in_place(|| {
        cluster.kubectl_ok(&["delete", "namespace", &namespace, "--wait=false"]);
        let _ = cluster.kubectl(&["delete", "persistentvolume", &volume, "--wait=false"]);
    });
}
