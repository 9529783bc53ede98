//! `scripts/bench jobs [RUNS]`: how fast a job starts, end to end, with the real Gitea,
//! the controller, the runner image on a real dockerd and the real gitea-runner (as a
//! container.docker environment, then as a vm.opensandbox sandbox of the real
//! opensandbox-server, then as a container.kubernetes Pod of the real single-node
//! cluster) — and
//! beside it, in the same run and from the same Gitea, a plain gitea-runner (`daemon`,
//! host mode) picking up the same job. Prints medians of RUNS (default 5) jobs,
//! commit → first step and FetchTask reply → first step, broken down by phase. Asserts
//! nothing about timing.
//!
//! Both run with their default settings, as an operator would: the controller's poll
//! (500 ms doubling to 2 s while idle) and, where Gitea sends it (≥ 1.24), its
//! `workflow_job` webhook; gitea-runner's poll (2 s, backing off to 5 s while idle).
//! Jobs are committed at the same pseudo-random pauses (3–9 s after the previous job
//! ended) for both, so neither's poll is in step with the commits.
//!
//! Phases come from the assignment record (fetched; the environment's reported timeline:
//! claimed, runner_started, docker_ready, job_started), Docker (container created and
//! started) and Gitea's job log (the runner's timestamp of the first step's first line).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::BTreeMap,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use e2e::{
    docker::host,
    stack::{Controller, Options},
};
use testkit::gitea::{Gitea, GiteaOptions, GiteaVersion, Repo};

const JOB: &str = "jobs:\n  bench:\n    runs-on: [LABELS]\nCONTAINER    steps:\n      - run: echo first-step-RUN\n";

/// What the benched job runs on: its labels, and for a `container:` job its image.
#[derive(Clone, Copy)]
struct Shape<'a> {
    labels: &'a str,
    container: Option<&'a str>,
}

impl<'a> Shape<'a> {
    fn host(labels: &'a str) -> Self {
        Shape { labels, container: None }
    }
}

fn now_ms() -> i64 {
    i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis()).unwrap()
}

/// Unix ms of an RFC 3339 timestamp `2026-12-01T02:08:05.1234567Z` (UTC only).
fn parse_rfc3339(text: &str) -> Option<i64> {
    let (date, time) = text.trim_end_matches('Z').split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let (hms, fraction) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.split(':').map(|p| p.parse::<i64>());
    let (h, min, s) = (t.next()?.ok()?, t.next()?.ok()?, t.next()?.ok()?);
    let millis: i64 = format!("{:0<3}", &fraction[..fraction.len().min(3)]).parse().ok()?;
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 24 + h) * 60 + min) * 60_000 + s * 1000 + millis)
}

/// The runner's timestamp of the first line of the first step (`::group::Run …`).
fn first_step_ms(log: &str) -> Option<i64> {
    log.lines().find(|l| l.contains("::group::Run echo first-step")).and_then(|l| parse_rfc3339(l.split_whitespace().next()?))
}

/// The runner's timestamp of the job log's first line (the task just arrived).
fn first_line_ms(log: &str) -> Option<i64> {
    log.lines().next().and_then(|l| parse_rfc3339(l.split_whitespace().next()?))
}

/// The pause before job `n`'s commit: 3–9 s, the same sequence for every runner measured.
fn pause(n: usize) -> Duration {
    Duration::from_millis(3000 + (n as u64).wrapping_mul(2_654_435_761) % 6000)
}

/// Gitea's `workflow_job` webhook to the controller (Gitea ≥ 1.24).
struct Webhook {
    url: String,
    secret: &'static str,
}

fn median(mut values: Vec<i64>) -> i64 {
    values.sort_unstable();
    values[values.len() / 2]
}

async fn run_one(gitea: &Gitea, repo: &Repo, shape: Shape<'_>, n: usize) -> (i64, String) {
    let container = shape.container.map(|image| format!("    container:\n      image: {image}\n")).unwrap_or_default();
    let yaml = format!("name: bench-{n}\non: push\n{}", JOB.replace("LABELS", shape.labels).replace("CONTAINER", &container).replace("RUN", &n.to_string()));
    let committed = now_ms();
    gitea.commit_workflow(repo, "bench.yml", &yaml).await;
    let tasks =
        gitea.wait_for_tasks(repo, Duration::from_secs(180), |t| t.len() > n && t.iter().all(|t| !matches!(t.status.as_str(), "waiting" | "running"))).await;
    let task = tasks.iter().max_by_key(|t| t.id).unwrap();
    assert_eq!(task.status, "success", "{task:?}");
    (committed, gitea.job_log(repo, task.run_number, 0).await)
}

/// Docker's created/started times (Unix ms) of each environment, by assignment id,
/// watched while the jobs run (environments are removed right after).
fn watch_containers(label: String, stop: std::sync::Arc<std::sync::atomic::AtomicBool>) -> std::thread::JoinHandle<BTreeMap<String, (i64, i64)>> {
    std::thread::spawn(move || {
        let mut seen = BTreeMap::new();
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let ids = host().docker(&["ps", "-aq", "--filter", &format!("label={label}")]);
            for id in String::from_utf8_lossy(&ids.stdout).lines() {
                let format = "{{index .Config.Labels \"gitea-dynamic-runner/assignment-id\"}} {{.Created}} {{.State.StartedAt}}";
                let out = host().docker(&["inspect", "-f", format, id]);
                let text = String::from_utf8_lossy(&out.stdout).to_string();
                let mut words = text.split_whitespace();
                if let (Some(assignment), Some(created), Some(started)) =
                    (words.next(), words.next().and_then(parse_rfc3339), words.next().and_then(parse_rfc3339))
                    && started > 0
                {
                    seen.entry(assignment.to_owned()).or_insert((created, started));
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        seen
    })
}

/// When each Pod (by assignment id) was first seen and first seen Running (Unix ms),
/// polling the API server every 50 ms: its own timestamps have whole seconds only.
fn watch_pods(namespace: String, label: String, stop: std::sync::Arc<std::sync::atomic::AtomicBool>) -> std::thread::JoinHandle<BTreeMap<String, (i64, i64)>> {
    std::thread::spawn(move || {
        let mut first_seen: BTreeMap<String, i64> = BTreeMap::new();
        let mut seen = BTreeMap::new();
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let output = e2e::kubernetes::cluster().kubectl(&["-n", &namespace, "get", "pods", "-l", &label, "-o", "json"]);
            let now = now_ms();
            if let Ok(list) = serde_json::from_slice::<serde_json::Value>(&output.stdout) {
                for pod in list["items"].as_array().into_iter().flatten() {
                    let Some(assignment) = pod["metadata"]["labels"]["gitea-dynamic-runner/assignment-id"].as_str() else { continue };
                    let created = *first_seen.entry(assignment.to_owned()).or_insert(now);
                    if pod["status"]["phase"] == "Running" {
                        seen.entry(assignment.to_owned()).or_insert((created, now));
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        seen
    })
}

/// Where the environments of a measured placement are watched.
enum Watch {
    Docker,
    Pods(String),
}

/// Runs `runs` jobs through a controller made from `options` and returns their phases
/// (ms), by row name.
async fn measure(
    gitea: &Gitea,
    options: Options,
    repo_name: &str,
    shape: Shape<'_>,
    runs: usize,
    watch: Watch,
    webhook: Option<&Webhook>,
) -> BTreeMap<&'static str, Vec<i64>> {
    let metrics_url = format!("http://{}/metrics", options.http_listen);
    let mut controller = Controller::start(options).await;
    let repo = gitea.create_repo(repo_name).await;
    if let Some(webhook) = webhook {
        gitea.add_webhook(&repo, &webhook.url, webhook.secret, &["workflow_job"]).await;
    }
    let label = controller.environment_label();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pods = matches!(watch, Watch::Pods(_));
    let watcher = match watch {
        Watch::Docker => watch_containers(label, std::sync::Arc::clone(&stop)),
        Watch::Pods(namespace) => watch_pods(namespace, label, std::sync::Arc::clone(&stop)),
    };
    let mut ours = Vec::new();
    for n in 0..runs {
        // The environment before has gone: every run starts from an idle host.
        tokio::time::sleep(pause(n)).await;
        ours.push(run_one(gitea, &repo, shape, n).await);
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let containers = watcher.join().unwrap();
    if webhook.is_some() {
        let (_, metrics) = testkit::http_get(&metrics_url).await;
        let queued = metrics.lines().find(|l| l.starts_with("gdr_webhook_deliveries_total{kind=\"queued\"}")).unwrap_or("none");
        println!("  ({repo_name}: webhook deliveries that woke the fetch loops: {queued})");
    }
    let mut records = controller.records().await;
    records.sort_by_key(|r| r.created_at_ms);
    controller.stop().await;

    let mut rows: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for (i, (committed, log)) in ours.iter().enumerate() {
        let record = &records[i];
        let fetched = record.created_at_ms;
        let at = |phase: &str| record.timeline.iter().find(|(p, _)| p == phase).map(|(_, t)| *t);
        let (created, started) = containers.get(&record.assignment_id).copied().unwrap_or((fetched, fetched));
        let first_step = first_step_ms(log).expect("the first step's line has no timestamp");
        let (claimed, runner_started, job_started) = (at("claimed").unwrap(), at("runner_started").unwrap(), at("job_started").unwrap());
        let mut phases = if pods {
            // The kubelet reports a Pod Running after its container started (the
            // supervisor has often claimed by then), so the Pod's own phases are not
            // comparable: from the reply to the claim is the Pod's whole start.
            vec![
                ("2 FetchTask reply → Pod seen (API poll)", created - fetched),
                ("3 FetchTask reply → claimed (Pod scheduled, sandbox, container, supervisor)", claimed - fetched),
            ]
        } else {
            vec![
                ("2 FetchTask reply → container created", created - fetched),
                ("3 container created → started", started - created),
                ("4 container started → claimed", claimed - started),
            ]
        };
        phases.extend([
            ("1 commit → FetchTask reply", fetched - committed),
            ("5 claimed → runner started", runner_started - claimed),
            ("7 runner started → hook passed", job_started - runner_started),
            ("8 hook passed → first step", first_step - job_started),
            ("= FetchTask reply → first step", first_step - fetched),
            ("= commit → first step", first_step - *committed),
        ]);
        // Only where the environment runs its own dockerd.
        if let Some(docker_ready) = at("docker_ready") {
            phases.push(if pods {
                ("6 claimed → dockerd ready", docker_ready - claimed)
            } else {
                ("6 container started → dockerd ready", docker_ready - started)
            });
        }
        for (name, value) in phases {
            rows.entry(name).or_default().push(value);
        }
    }
    rows
}

/// The floor of an environment's start on this dockerd: a container of one static binary
/// (the controller image) created and started, `runs` times, on the default bridge network
/// as the environments are.
fn floor(runs: usize) -> BTreeMap<&'static str, Vec<i64>> {
    let docker = host();
    let (tag, tar) = e2e::paths::controller_image(None);
    let loaded = docker.docker(&["load", "-i", &tar.display().to_string()]);
    assert!(loaded.status.success(), "docker load: {}", String::from_utf8_lossy(&loaded.stderr));
    let mut rows: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for n in 0..runs {
        let name = format!("gdr-bench-floor-{}-{n}", std::process::id());
        let before = now_ms();
        let created = docker.docker(&["create", "--name", &name, &tag, "version"]);
        let ran = docker.docker(&["start", "--attach", &name]);
        let wall = now_ms() - before;
        let times = docker.docker(&["inspect", "-f", "{{.Created}} {{.State.StartedAt}}", &name]);
        let _ = docker.docker(&["rm", "-f", &name]);
        assert!(created.status.success() && ran.status.success(), "the floor's container did not run: {ran:?}");
        let text = String::from_utf8_lossy(&times.stdout).to_string();
        let mut words = text.split_whitespace().map(parse_rfc3339);
        if let (Some(Some(created)), Some(Some(started))) = (words.next(), words.next()) {
            rows.entry("container created → started").or_default().push(started - created);
        }
        rows.entry("docker create + start --attach (wall)").or_default().push(wall);
    }
    rows
}

fn print_rows(rows: &BTreeMap<&str, Vec<i64>>) {
    if rows.is_empty() {
        println!("  (not measured: GDR_BENCH_PLACEMENTS)");
    }
    for (name, values) in rows {
        println!("  {name:<42} {:>6}   (all: {values:?})", median(values.clone()));
    }
}

/// The docker placement's labels.
const DOCKER: &str = "disposable, container, docker";

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let runs: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(5);
    // GDR_BENCH_PLACEMENTS=docker,docker-rootless,docker-container-job,docker-default,vm,kubernetes (default: all);
    // the plain runner always.
    let chosen = std::env::var("GDR_BENCH_PLACEMENTS").ok();
    let wants = |placement: &str| chosen.as_deref().is_none_or(|list| list.split(',').any(|p| p.trim() == placement));
    let docker = host();
    let image = docker.image("gitea-runner");
    // Gitea delivers webhooks to loopback only where allowed (1.23 has no workflow_job).
    let ini = "[webhook]\nALLOWED_HOST_LIST = loopback\n".to_owned();
    let gitea = Gitea::start(GiteaOptions { bind: docker.bridge_ip.into(), extra_ini: ini, ..GiteaOptions::default() }).await;
    let token = gitea.runner_registration_token().await;

    // The controller: capacity 1, its default poll, and the webhook where Gitea has it.
    let mut options = Options::new(&gitea.url(), &token, &image, &docker.socket);
    options.capacity = 1;
    options.fetch_interval = None;
    let secret_dir = tempfile::tempdir().unwrap();
    let webhook = (gitea.version() != GiteaVersion::V1_23).then(|| {
        let secret = "bench-webhook-secret-0123456789";
        let secret_file = secret_dir.path().join("webhook-secret");
        std::fs::write(&secret_file, secret).unwrap();
        let port = testkit::free_local_port();
        options.http_listen = format!("127.0.0.1:{port}");
        options.extra_gitea = format!("webhook_secret_file = \"{}\"", secret_file.display());
        Webhook { url: format!("http://127.0.0.1:{port}/hooks/gitea"), secret }
    });
    let rows = if wants("docker") {
        measure(&gitea, options.clone(), "bench", Shape::host(DOCKER), runs, Watch::Docker, webhook.as_ref()).await
    } else {
        BTreeMap::new()
    };
    // The docker placement's other two modes, one after the other on the same host: a
    // rootless job dockerd, and no Docker at all (the default).
    let mut rootless_rows = BTreeMap::new();
    if wants("docker-rootless") {
        let mut rootless = options.clone();
        rootless.job_dockerd = false;
        rootless.docker_extra = "rootless_dockerd = true".into();
        rootless_rows = measure(&gitea, rootless, "bench-rootless", Shape::host(DOCKER), runs, Watch::Docker, webhook.as_ref()).await;
    }
    // A `container:` job with the job dockerd: its image (e2e::images' build image, ~55 MB
    // compressed) pulled by the environment's fresh dockerd through a registry mirror on
    // this host, the job-started hook relaying the loopback into it.
    let mut container_job_rows = BTreeMap::new();
    let mut registry = None;
    if wants("docker-container-job") {
        let started = tokio::task::block_in_place(testkit::registry::Registry::start);
        tokio::task::block_in_place(|| e2e::images::push_build_image(&started, &image, "gdr-build", ""));
        let mut container_job = options.clone();
        container_job.docker_extra = format!("registry_mirrors = [\"http://{}:{}\"]", docker.bridge_ip, started.port);
        let shape = Shape { labels: DOCKER, container: Some("gdr-build") };
        container_job_rows = measure(&gitea, container_job, "bench-container-job", shape, runs, Watch::Docker, webhook.as_ref()).await;
        registry = Some(started);
    }
    drop(registry);
    let mut no_docker_rows = BTreeMap::new();
    if wants("docker-default") {
        let mut no_docker = options.clone();
        no_docker.job_dockerd = false;
        no_docker_rows = measure(&gitea, no_docker, "bench-no-docker", Shape::host(DOCKER), runs, Watch::Docker, webhook.as_ref()).await;
    }

    // vm.opensandbox: the real opensandbox-server (Docker runtime) on the same host; the
    // sandbox is unprivileged there, so without the job-local dockerd.
    let mut vm_rows = BTreeMap::new();
    if wants("vm") {
        let server = tokio::task::block_in_place(|| testkit::opensandbox::OpenSandbox::start(&docker.url(), &image));
        options.opensandbox = Some(e2e::stack::SandboxOptions::on_host(&server, docker));
        vm_rows = measure(&gitea, options.clone(), "bench-vm", Shape::host("disposable, vm"), runs, Watch::Docker, webhook.as_ref()).await;
        drop(server);
    }

    // container.kubernetes: Pods of the real single-node cluster reach the host on their
    // bridge only, so a Gitea there.
    let mut pod_rows = BTreeMap::new();
    if wants("kubernetes") {
        let cluster = tokio::task::block_in_place(e2e::kubernetes::cluster);
        let pod_image = tokio::task::block_in_place(|| cluster.image("gitea-runner"));
        let namespace = tokio::task::block_in_place(|| cluster.namespace("gdr-bench"));
        let pod_gitea = Gitea::start(GiteaOptions { bind: e2e::kubernetes::Cluster::HOST_IP.into(), ..GiteaOptions::default() }).await;
        let pod_token = pod_gitea.runner_registration_token().await;
        let mut pod_options = Options::new(&pod_gitea.url(), &pod_token, &pod_image, &docker.socket);
        pod_options.capacity = 1;
        pod_options.fetch_interval = None;
        pod_options.kubernetes = Some(e2e::stack::PodOptions::on(cluster, &namespace));
        pod_rows = measure(&pod_gitea, pod_options, "bench-pod", Shape::host("disposable, container, kubernetes"), runs, Watch::Pods(namespace), None).await;
    }

    // A plain gitea-runner on the host, same Gitea, same job.
    let plain_dir = tempfile::tempdir().unwrap();
    let d = plain_dir.path();
    let runner = e2e::paths::runner("gitea-runner");
    let status = std::process::Command::new(&runner)
        .args(["register", "--no-interactive", "--instance", &gitea.url(), "--token", &token, "--name", "plain", "--labels", "plain-host"])
        .current_dir(d)
        .output()
        .unwrap();
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    // gitea-runner's defaults (fetch_interval 2s, fetch_interval_max 5s), without its
    // cache server, which no job here uses.
    std::fs::write(d.join("config.yaml"), "cache:\n  enabled: false\n").unwrap();
    let mut daemon = std::process::Command::new(&runner)
        .args(["daemon", "--config", "config.yaml"])
        .current_dir(d)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let plain_repo = gitea.create_repo("bench-plain").await;
    let mut plain = Vec::new();
    for n in 0..runs {
        tokio::time::sleep(pause(n)).await;
        plain.push(run_one(&gitea, &plain_repo, Shape::host("plain-host"), n).await);
    }
    let _ = daemon.kill();
    let _ = daemon.wait();

    let floor_rows = tokio::task::block_in_place(|| floor(runs));

    let mut plain_rows: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for (committed, log) in &plain {
        let received = first_line_ms(log).unwrap();
        let first_step = first_step_ms(log).unwrap();
        plain_rows.entry("task received → first step").or_default().push(first_step - received);
        plain_rows.entry("commit → first step").or_default().push(first_step - committed);
    }
    println!(
        "{runs} jobs each; medians in ms (2 cores, the Docker host and Gitea {} on this machine; default polls; {})",
        gitea.version().release(),
        if webhook.is_some() { "the controller also takes Gitea's workflow_job webhook" } else { "no webhook: this Gitea has none" }
    );
    println!("gitea-dynamic-runner (container.docker, gitea-runner v3.3.0 in the image, dockerd on loop-backed ext4):");
    print_rows(&rows);
    println!("gitea-dynamic-runner (container.docker, rootless_dockerd = true: dockerd-rootless.sh as uid 2000, overlay2 on a volume):");
    print_rows(&rootless_rows);
    println!("gitea-dynamic-runner (container.docker, job_dockerd, a `container:` job: its image pulled through a registry mirror on this host):");
    print_rows(&container_job_rows);
    if let (Some(host_job), Some(container_job)) = (rows.get("= FetchTask reply → first step"), container_job_rows.get("= FetchTask reply → first step")) {
        let (host_job, container_job) = (median(host_job.clone()), median(container_job.clone()));
        println!("FetchTask reply → first step, `container:` job − host-mode job: {} ms (median − median)", container_job - host_job);
    }
    println!("gitea-dynamic-runner (container.docker, the default: no Docker in the job):");
    print_rows(&no_docker_rows);
    if let (Some(root), Some(rootless)) = (rows.get("= FetchTask reply → first step"), rootless_rows.get("= FetchTask reply → first step")) {
        let (root, rootless) = (median(root.clone()), median(rootless.clone()));
        println!("FetchTask reply → first step, rootless − job_dockerd: {} ms (median − median)", rootless - root);
    }
    println!("gitea-dynamic-runner (vm.opensandbox via opensandbox-server 1.1.1, Docker runtime, no job-local dockerd):");
    print_rows(&vm_rows);
    println!("gitea-dynamic-runner (container.kubernetes, Kubernetes v1.34.12 single node, containerd + runc, privileged Pod, dockerd on loop-backed ext4;");
    println!("  \"Pod seen\" = first seen by a kubectl poll every 50 ms, each poll itself taking a few hundred ms):");
    print_rows(&pod_rows);
    println!("plain gitea-runner v3.3.0 (daemon, host mode, no isolation, same Gitea):");
    print_rows(&plain_rows);
    println!("the floor: a static hello world (the controller image, `controller version`) on the same dockerd:");
    print_rows(&floor_rows);
    // The figure the product is judged by: how much later than a persistent runner a job
    // starts in its own environment.
    let plain = median(plain_rows["commit → first step"].clone());
    println!("ratio to the plain runner, commit → first step (median / median):");
    for (placement, measured) in [
        ("container.docker", &rows),
        ("docker, rootless", &rootless_rows),
        ("docker, container: job", &container_job_rows),
        ("docker, no Docker", &no_docker_rows),
        ("vm.opensandbox", &vm_rows),
        ("container.kubernetes", &pod_rows),
    ] {
        if let Some(values) = measured.get("= commit → first step") {
            #[allow(clippy::cast_precision_loss)] // milliseconds of a few seconds
            let ratio = median(values.clone()) as f64 / plain as f64;
            println!("  {placement:<22} {ratio:.2}");
        }
    }
}
