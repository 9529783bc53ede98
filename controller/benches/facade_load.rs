//! Facade load benchmark (run by `scripts/bench facade`): the real controller process
//! (the `test-driver` build: its environments are JSON files) on a real nats-server, 200
//! jobs from the fake Gitea, and 200 concurrent agents, each on its own connection to its
//! environment's own facade socket, claiming its task and streaming 10,000 log rows in UpdateLog
//! batches the size gitea-runner sends (its reporter flushes what accumulated since the
//! last tick). Prints the controller's CPU time and memory, p50/p99/max latency per
//! UpdateLog, rows per second — and fails if Gitea did not store exactly the rows sent,
//! in order. Asserts nothing about timing.
//! `GDR_LOAD_ASSIGNMENTS` (default 200), `GDR_LOAD_ROWS` (default 10,000), `GDR_LOAD_BATCH`
//! (default 100 rows per UpdateLog).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use proto::{
    facade::v1::{AssignmentCredential, ClaimRequest, UpdateLogRequest, facade_service_client::FacadeServiceClient},
    runner::v1::{LogRow, UpdateLogRequest as RunnerLog},
};
use testkit::{
    controller_config::ControllerConfig,
    fake_gitea::{FakeGitea, Job, REGISTRATION_TOKEN},
    nats::NatsServer,
    process::ControllerProcess,
};

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name).ok().map_or(default, |v| v.parse().unwrap_or_else(|_| panic!("{name}={v:?} is not a number")))
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index].as_secs_f64() * 1000.0
}

/// CPU seconds (user + system) of a process, from /proc/<pid>/stat.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    // SC_CLK_TCK is 100 on Linux.
    ticks / 100.0
}

fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap()
}

fn start_controller(dir: &Path, gitea: &FakeGitea, nats: &str, capacity: usize) -> ControllerProcess {
    let port = testkit::free_local_port();
    let config = ControllerConfig::new(dir, &gitea.url(), REGISTRATION_TOKEN)
        .jetstream(nats)
        .set("http.listen", format!("127.0.0.1:{port}"))
        .pool("container.docker", capacity)
        .set("docker.image", "unused-with-the-test-driver")
        .write("controller.toml");
    ControllerProcess::new(env!("CARGO_BIN_EXE_controller"), &config, dir.join("controller.log"))
        .env("GDR_TEST_DRIVER_DIR", dir.join("envs"))
        .env("RUST_LOG", "warn")
        .started()
}

/// (assignment id, capability, facade socket) of every environment the controller
/// created: each has its own facade directory beside the driver's.
fn environments(dir: &Path) -> Vec<(String, String, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let Ok(bytes) = std::fs::read(&path) else { continue };
        let Ok(value) = serde_json::from_slice::<serde_json::Value>(&bytes) else { continue };
        let (Some(id), Some(instance)) = (value["assignment_id"].as_str(), value["labels"][controller::driver::LABEL_INSTANCE].as_str()) else { continue };
        let own = dir.with_file_name("environments").join(controller::driver::environment_name(instance, id));
        let Ok(capability) = std::fs::read_to_string(own.join("capability")) else { continue };
        found.push((id.to_owned(), capability, own.join("facade.sock")));
    }
    found
}

async fn connect(socket: &Path) -> FacadeServiceClient<tonic::transport::Channel> {
    let socket = socket.to_owned();
    let channel = tonic::transport::Endpoint::try_from("http://facade.local")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(socket).await?)) }
        }))
        .await
        .unwrap();
    FacadeServiceClient::new(channel)
}

fn row_text(task_id: i64, n: usize) -> String {
    format!("2026-12-01T04:00:00.000Z task {task_id} line {n:05}: building target x86_64-unknown-linux-gnu, 37 of 120 crates compiled")
}

/// One agent: claim, then stream `rows` rows in batches of `batch`; returns each
/// UpdateLog's latency.
async fn agent(socket: PathBuf, id: String, capability: String, rows: usize, batch: usize) -> (i64, Vec<Duration>) {
    let mut client = connect(&socket).await;
    let given = Some(AssignmentCredential { assignment_id: id.clone(), capability });
    let claimed = client.claim(ClaimRequest { credential: given, holder: format!("load-agent-{id}") }).await.unwrap().into_inner();
    let task = claimed.task.unwrap();
    // Reports carry the session the claim handed out, as the agent's do.
    let credential = Some(AssignmentCredential { assignment_id: id.clone(), capability: claimed.session });
    let mut latencies = Vec::with_capacity(rows / batch + 1);
    let mut index = 0usize;
    while index < rows {
        let end = (index + batch).min(rows);
        let request = UpdateLogRequest {
            credential: credential.clone(),
            request: Some(RunnerLog {
                task_id: task.id,
                index: index as i64,
                rows: (index..end)
                    .map(|n| LogRow { time: Some(prost_types::Timestamp { seconds: 1_796_000_000, nanos: 0 }), content: row_text(task.id, n) })
                    .collect(),
                no_more: end == rows,
            }),
        };
        let started = Instant::now();
        let ack = client.update_log(request).await.unwrap().into_inner().response.unwrap().ack_index;
        latencies.push(started.elapsed());
        // gitea-runner resends from the acknowledged index; the fake acknowledges all.
        assert_eq!(ack, end as i64, "task {} acknowledged {ack}, not {end}", task.id);
        index = end;
    }
    (task.id, latencies)
}

fn main() {
    let assignments = env_or("GDR_LOAD_ASSIGNMENTS", 200);
    let rows = env_or("GDR_LOAD_ROWS", 10_000);
    let batch = env_or("GDR_LOAD_BATCH", 100);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async move {
        let nats = NatsServer::start();
        let gitea = FakeGitea::start().await;
        for _ in 0..assignments {
            gitea.add_job(Job::new(&["disposable", "container", "docker"]));
        }
        let dir = tempfile::tempdir().unwrap();
        let controller = start_controller(dir.path(), &gitea, &nats.url, assignments);
        let pid = controller.id().unwrap();
        let envs = dir.path().join("envs");
        let created = testkit::poll(Duration::from_secs(180), || {
            let created = environments(&envs).len();
            std::future::ready(if created < assignments { Err(created) } else { Ok(()) })
        });
        if let Err(created) = created.await {
            panic!("only {created} environments after 180 s");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let rss_idle = status_kib(pid, "VmRSS:");
        let cpu_before = cpu_seconds(pid);
        let started = Instant::now();
        let mut agents = tokio::task::JoinSet::new();
        for (id, capability, socket) in environments(&envs) {
            agents.spawn(agent(socket, id, capability, rows, batch));
        }
        let mut latencies = Vec::new();
        let mut tasks = Vec::new();
        while let Some(joined) = agents.join_next().await {
            let (task, mut l) = joined.unwrap();
            tasks.push(task);
            latencies.append(&mut l);
        }
        let elapsed = started.elapsed();
        let cpu = cpu_seconds(pid) - cpu_before;
        let rss_peak = status_kib(pid, "VmHWM:");
        let rss_after = status_kib(pid, "VmRSS:");

        // Nothing dropped, nothing reordered, nothing doubled.
        let mut stored_rows = 0usize;
        gitea.with(|s| {
            for task in &tasks {
                let log = &s.tasks[task].log;
                assert_eq!(log.len(), rows, "task {task}: Gitea stored {} rows of {rows}", log.len());
                for (n, line) in log.iter().enumerate() {
                    assert_eq!(*line, row_text(*task, n), "task {task}: row {n} differs");
                }
                stored_rows += log.len();
            }
        });
        latencies.sort();
        let sent = assignments * rows;
        println!(
            "facade load: {assignments} assignments × {rows} rows in batches of {batch} ({} UpdateLog calls, {sent} rows, {:.1} MiB of row text) in {:.1} s",
            latencies.len(),
            (sent * row_text(1, 0).len()) as f64 / (1 << 20) as f64,
            elapsed.as_secs_f64()
        );
        println!("  throughput      {:.0} rows/s, {:.0} UpdateLog/s", sent as f64 / elapsed.as_secs_f64(), latencies.len() as f64 / elapsed.as_secs_f64());
        println!(
            "  UpdateLog       p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            percentile(&latencies, 0.5),
            percentile(&latencies, 0.99),
            latencies.last().unwrap().as_secs_f64() * 1000.0
        );
        println!("  controller CPU  {cpu:.1} s ({:.0} % of one core over the run)", 100.0 * cpu / elapsed.as_secs_f64());
        println!(
            "  controller RSS  {} MiB idle with {assignments} environments, {} MiB peak, {} MiB after",
            rss_idle / 1024,
            rss_peak / 1024,
            rss_after / 1024
        );
        println!("  Gitea stored    {stored_rows} of {sent} rows, each in order (checked)");
        drop(controller);
        drop(nats);
    });
}
