//! The jobs' cache, measured (`scripts/bench cache [RUNS]`; prints, asserts only that
//! the jobs succeed and restore). On one real Gitea, the same workflow for two runners:
//!
//! - this project: the controller, the runner image on a real dockerd, the real
//!   gitea-runner, actions/cache@v4 (its steps over the real `@actions/cache`) reaching the
//!   controller's cache through the supervisor and the facade;
//! - a persistent gitea-runner v3.3.0 on the host (`daemon`, host mode) with its built-in
//!   cache, the setup this project replaces.
//!
//! The workflow restores a 200 MB dependency tree (20,000 files of 4 KB and one of 120 MB,
//! random: incompressible) or builds it and saves it. Each runner's first job saves it,
//! then RUNS jobs restore it; printed: commit → job done and the restore step, medians,
//! this project against the persistent runner as a ratio. Then the cache's own
//! throughput on this disk: an archive of 512 MB saved in the toolkit's 32 MB chunks, four
//! at once, and restored, against a plain copy of the same file.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use e2e::{
    docker::host,
    stack::{Controller, Options},
};
use testkit::gitea::{Gitea, Repo};

const WORKFLOW: &str = r#"name: deps
on: push
jobs:
  deps:
    runs-on: [LABELS]
    steps:
      - id: deps
        uses: actions/cache@v4
        with:
          path: deps
          key: deps-v1
      - if: steps.deps.outputs.cache-hit != 'true'
        run: |
          mkdir -p deps/many
          head -c 120000000 /dev/urandom > deps/large.bin
          head -c 80000000 /dev/urandom > deps/all && (cd deps/many && split -b 4000 -a 5 ../all f) && rm deps/all
      - run: echo "restored=${{ steps.deps.outputs.cache-hit }} $(find deps -type f | wc -l) files, $(du -sm deps | cut -f1) MB"
"#;

fn now_ms() -> i64 {
    i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis()).unwrap()
}

/// Unix ms of the runner's timestamp at the start of a log line (RFC 3339, UTC).
fn line_ms(line: &str) -> Option<i64> {
    let text = line.split_whitespace().next()?;
    let (date, time) = text.trim_end_matches('Z').split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let (hms, fraction) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.split(':').map(|p| p.parse::<i64>());
    let (h, min, s) = (t.next()?.ok()?, t.next()?.ok()?, t.next()?.ok()?);
    let millis: i64 = format!("{:0<3}", &fraction[..fraction.len().min(3)]).parse().ok()?;
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    Some(((days * 24 + h) * 60 + min) * 60_000 + s * 1000 + millis)
}

/// The restore step: from its `::group::Run actions/cache@v4` to the line after its
/// "Cache restored from key".
fn restore_ms(log: &str) -> Option<i64> {
    let lines: Vec<&str> = log.lines().collect();
    let start = lines.iter().position(|l| l.contains("::group::Run actions/cache@v4"))?;
    let restored = start + lines[start..].iter().position(|l| l.contains("Cache restored from key"))?;
    Some(line_ms(lines.get(restored + 1).unwrap_or(&lines[restored]))? - line_ms(lines[start])?)
}

fn median(mut values: Vec<i64>) -> i64 {
    values.sort_unstable();
    values[values.len() / 2]
}

/// One job of `repo`: committed now, done when Gitea says so; (commit → done ms, log).
async fn job(gitea: &Gitea, repo: &Repo, labels: &str, n: usize) -> (i64, String) {
    let committed = now_ms();
    if n == 0 {
        gitea.commit_workflow(repo, "deps.yml", &WORKFLOW.replace("LABELS", labels)).await;
    } else {
        gitea.commit_file(repo, "main", "trigger", n.to_string().as_bytes()).await;
    }
    let tasks = gitea.wait_for_tasks(repo, Duration::from_secs(600), |t| t.len() > n && t.iter().all(|t| !t.is_open())).await;
    let task = tasks.iter().max_by_key(|t| t.id).unwrap();
    let done = now_ms();
    let log = gitea.job_log(repo, task.run_number, 0).await;
    assert_eq!(task.status, "success", "{task:?}\n{log}");
    (done - committed, log)
}

/// The saving job, then `runs` restoring ones: their commit → done and restore step.
async fn measure(gitea: &Gitea, repo: &Repo, labels: &str, runs: usize) -> (i64, Vec<i64>, Vec<i64>) {
    let (first, log) = job(gitea, repo, labels, 0).await;
    assert!(log.contains("Cache saved with key: deps-v1"), "{log}");
    let (mut done, mut restore) = (Vec::new(), Vec::new());
    for n in 1..=runs {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (ms, log) = job(gitea, repo, labels, n).await;
        assert!(log.contains("restored=true 20001 files"), "the job did not restore the tree:\n{log}");
        done.push(ms);
        restore.push(restore_ms(&log).expect("no restore step in the log"));
    }
    (first, done, restore)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let runs: usize = std::env::args().skip(1).find(|a| !a.starts_with('-')).and_then(|a| a.parse().ok()).unwrap_or(3);
    e2e::init_logging();
    if std::env::args().any(|a| a == "--throughput") {
        return throughput().await;
    }
    let docker = host();
    let image = docker.image("gitea-runner");
    let gitea = e2e::actions::gitea_with_actions(docker.bridge_ip.into()).await;
    let token = gitea.runner_registration_token().await;

    let mut options = Options::new(&gitea.url(), &token, &image, &docker.socket);
    options.job_dockerd = false;
    options.capacity = 1;
    let mut controller = Controller::start(options).await;
    let ours_repo = gitea.create_repo("bench-ours").await;
    let ours = measure(&gitea, &ours_repo, "disposable, container, docker", runs).await;
    controller.stop().await;

    // The persistent runner, its built-in cache on (its default).
    let plain_dir = tempfile::tempdir().unwrap();
    let d = plain_dir.path();
    let runner = e2e::paths::runner("gitea-runner");
    let registered = std::process::Command::new(&runner)
        .args(["register", "--no-interactive", "--instance", &gitea.url(), "--token", &token, "--name", "plain", "--labels", "plain-host"])
        .current_dir(d)
        .output()
        .unwrap();
    assert!(registered.status.success(), "{}", String::from_utf8_lossy(&registered.stderr));
    std::fs::write(d.join("config.yaml"), format!("cache:\n  enabled: true\n  dir: {}\n", d.join("cache").display())).unwrap();
    let mut daemon = std::process::Command::new(&runner)
        .args(["daemon", "--config", "config.yaml"])
        .current_dir(d)
        .env("HOME", d)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let theirs_repo = gitea.create_repo("bench-plain").await;
    let theirs = measure(&gitea, &theirs_repo, "plain-host", runs).await;
    let _ = daemon.kill();
    let _ = daemon.wait();

    let row = |name: &str, (first, done, restore): &(i64, Vec<i64>, Vec<i64>)| {
        println!("  {name:<52} first (saves) {first:>6} ms   commit → done {:>6} ms   restore step {:>6} ms", median(done.clone()), median(restore.clone()));
    };
    println!("actions/cache@v4, a 200 MB dependency tree (20,000 × 4 KB + 120 MB), {runs} restoring jobs each, medians, Gitea {}:", gitea.version().release());
    row("gitea-dynamic-runner (container.docker, its cache)", &ours);
    row("persistent gitea-runner v3.3.0 (host, built-in cache)", &theirs);
    println!(
        "  ratio ours / persistent: commit → done {:.2}, restore step {:.2}",
        median(ours.1.clone()) as f64 / median(theirs.1.clone()) as f64,
        median(ours.2.clone()) as f64 / median(theirs.2.clone()) as f64
    );
    throughput().await;
}

/// The cache's own figures on this disk: save (v1 chunks, four at once) and restore of
/// a 512 MB archive, against `cp` of the same file. The disk's speed drifts (a virtual
/// disk's host cache), so copies and restores alternate, three of each, and the medians
/// are compared; the download alone (its pieces dropped, not written) says how much of a
/// restore is the cache's.
async fn throughput() {
    use http_body_util::{BodyExt as _, Full};
    const SIZE: usize = 512 << 20;
    const CHUNK: usize = 32 << 20;
    const ROUNDS: usize = 3;
    let dir = tempfile::Builder::new().prefix("gdr-bench-cache-").tempdir_in(e2e::paths::repository().join("target")).unwrap();
    let archive = dir.path().join("archive");
    let data: Vec<u8> = (0..SIZE).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    std::fs::write(&archive, &data).unwrap();
    drop(data);
    let sync = || {
        let _ = std::process::Command::new("sync").status();
    };
    sync();
    let copy = || {
        let target = dir.path().join("copy");
        let _ = std::fs::remove_file(&target);
        sync();
        let started = Instant::now();
        std::fs::copy(&archive, &target).unwrap();
        sync();
        started.elapsed()
    };
    let mut copies = vec![copy()];

    let backend = cache::backend::directory(&dir.path().join("cache")).unwrap();
    let limits = cache::Limits::new(4 << 30, 4 << 30, Duration::from_secs(3600));
    // As the controller runs it: on the cache's own I/O runtime.
    let io = cache::Io::new(16).unwrap();
    let cache = Arc::new(cache::Cache::new(backend, limits, Arc::new(cache::CacheMetrics::default())).with_io(io));
    let scope = cache::Scope::new("bench/app", "refs/heads/main", []).for_job("bench");
    let call = |method: &str, path: String, headers: Vec<(&'static str, String)>, body: bytes::Bytes| {
        let (cache, scope) = (Arc::clone(&cache), scope.clone());
        let mut request = http::Request::builder().method(method).uri(path);
        for (name, value) in headers {
            request = request.header(name, value);
        }
        let request = request.body(Full::new(body)).unwrap();
        async move {
            let response = cache.serve(scope, "http://127.0.0.1:41731".to_owned(), request).await;
            let status = response.status().as_u16();
            (status, response.into_body().collect().await.unwrap().to_bytes())
        }
    };
    let whole = bytes::Bytes::from(std::fs::read(&archive).unwrap());
    let started = Instant::now();
    let reserve = format!(r#"{{"key":"bench","version":"v","cacheSize":{SIZE}}}"#);
    let (_, body) = call("POST", "/_apis/artifactcache/caches".into(), Vec::new(), reserve.into()).await;
    let id = serde_json::from_slice::<serde_json::Value>(&body).unwrap()["cacheId"].as_u64().unwrap();
    let chunks: Vec<usize> = (0..SIZE).step_by(CHUNK).collect();
    for group in chunks.chunks(4) {
        let uploads = group.iter().map(|&start| {
            let bytes = whole.slice(start..(start + CHUNK).min(SIZE));
            let range = format!("bytes {start}-{}/*", start + bytes.len() - 1);
            call("PATCH", format!("/_apis/artifactcache/caches/{id}"), vec![("content-range", range)], bytes)
        });
        for (status, _) in futures_util::future::join_all(uploads).await {
            assert_eq!(status, 204);
        }
    }
    let (status, _) = call("POST", format!("/_apis/artifactcache/caches/{id}"), Vec::new(), format!(r#"{{"size":{SIZE}}}"#).into()).await;
    assert_eq!(status, 200);
    sync();
    let saved = started.elapsed();
    drop(whole);

    // A download of the archive, each piece handed to the sink as it arrives.
    type Sink = Box<dyn FnMut(&[u8]) + Send>;
    let download = |mut sink: Sink| {
        let (cache, scope) = (Arc::clone(&cache), scope.clone());
        async move {
            let request = http::Request::get(format!("/_apis/artifactcache/artifacts/{id}")).body(Full::new(bytes::Bytes::new())).unwrap();
            let response = cache.serve(scope, "http://127.0.0.1:41731".to_owned(), request).await;
            assert_eq!(response.status(), 200);
            let mut body = response.into_body();
            let mut length = 0;
            while let Some(frame) = body.frame().await {
                if let Ok(data) = frame.unwrap().into_data() {
                    length += data.len();
                    sink(&data);
                }
            }
            assert_eq!(length, SIZE);
        }
    };
    let (mut restores, mut served) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        if round > 0 {
            copies.push(copy());
        }
        // Restored as a client does: each piece written to its file as it arrives.
        let target = dir.path().join("restored");
        let _ = std::fs::remove_file(&target);
        sync();
        let started = Instant::now();
        let mut file = std::fs::File::create(&target).unwrap();
        download(Box::new(move |data| std::io::Write::write_all(&mut file, data).unwrap())).await;
        sync();
        restores.push(started.elapsed());
        let started = Instant::now();
        download(Box::new(|_| {})).await;
        served.push(started.elapsed());
    }
    let median = |mut times: Vec<Duration>| {
        times.sort_unstable();
        times[times.len() / 2]
    };
    let mb = |elapsed: Duration| SIZE as f64 / (1 << 20) as f64 / elapsed.as_secs_f64();
    let each = |times: &[Duration]| times.iter().map(|t| format!("{:.0}", mb(*t))).collect::<Vec<_>>().join(", ");
    println!("the cache's own throughput, 512 MB on {} (a directory), medians of {ROUNDS} alternating rounds:", dir.path().display());
    let (copy, restore, served) = (median(copies.clone()), median(restores.clone()), median(served.clone()));
    println!("  plain copy (cp)           {:>7.0} MB/s   (each: {})", mb(copy), each(&copies));
    println!("  save (v1, 32 MB × 4)      {:>7.0} MB/s   {:.2} of the copy", mb(saved), mb(saved) / mb(copy));
    println!("  restore (download)        {:>7.0} MB/s   {:.2} of the copy   (each: {})", mb(restore), mb(restore) / mb(copy), each(&restores));
    println!("  the download, not written {:>7.0} MB/s   {:.2} of the copy", mb(served), mb(served) / mb(copy));
}
