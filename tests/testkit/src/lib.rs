//! Test-only helpers shared by the workspace's tests (a dev-dependency only).
//!
//! - [`workload`]: a fake SPIFFE Workload API server, scripted by the test.
//! - [`wait`]: waiting on a condition instead of a fixed sleep, async and blocking.
//! - [`fake_gitea`]: a fake Gitea runner API that follows the protocol reference.
//! - [`fault_proxy`]: a proxy in front of the real Gitea that answers 401/503 on demand.
//! - [`nats`]: a real nats-server with JetStream.
//! - [`controller_config`]: the controller's TOML for a test, from a builder.
//! - [`dockerd`]: a real dockerd, private (own network namespace) or on a bridge.
//! - [`gitea`]: a REAL Gitea server, 1.23.8 or 1.27.3 (built from pinned upstream sources by scripts/install test-peers).
//! - [`opensandbox`]: a REAL opensandbox-server (PyPI) with its Docker runtime.
//! - [`spire`]: a REAL SPIRE server and agent.
//! - [`process`]: a controller process of the real binary, stopped and started again.
//! - [`s3`]: a REAL S3-compatible server (versitygw).
//! - [`prometheus`]: a REAL Prometheus scraping one target and evaluating alert rules.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_debug_implementations)]

pub mod controller_config;
pub mod dockerd;
pub mod fake_gitea;
pub mod fault_proxy;
pub mod gitea;
pub mod nats;
pub mod opensandbox;
pub mod process;
pub mod prometheus;
pub mod registry;
pub mod s3;
pub mod spire;
pub mod wait;
pub mod workload;

pub use wait::{poll, poll_blocking, wait_for, wait_for_async, wait_for_blocking, wait_for_exit, wait_until, wait_until_async, wait_until_blocking};

use std::{path::PathBuf, time::Duration};

/// A port free on `ip` now, picked before the caller binds it: below the kernel's
/// ephemeral range (32768–60999 by default), because a port the kernel handed out (bind
/// to port 0) can be taken in the meantime as the source port of an outgoing connection
/// (a NATS cluster started next to another had a node that never became healthy), and
/// distinct within this process, so two peers of one test never pick the same one.
/// Another process may still take it first: callers that must not race retry, as the
/// Gitea fixture does.
pub fn free_port(ip: std::net::IpAddr) -> u16 {
    const FIRST: u32 = 20_000;
    const COUNT: u32 = 12_000;
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let offset = std::process::id().wrapping_mul(7_919);
    loop {
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        assert!(n < COUNT, "no free port left on {ip} in {FIRST}..{}", FIRST + COUNT);
        let port = u16::try_from(FIRST + offset.wrapping_add(n) % COUNT).expect("below 32000");
        if std::net::TcpListener::bind((ip, port)).is_ok() {
            return port;
        }
    }
}

/// A child process that is killed and reaped when the test lets go of it — also when an
/// assertion fails first, so that no process of a failed test outlives it.
#[derive(Debug)]
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl std::ops::Deref for KillOnDrop {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for KillOnDrop {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}

/// `GET url`: the status and the body as text (a controller's `/metrics`, …); panics
/// when nothing answers.
pub async fn http_get(url: &str) -> (u16, String) {
    let response = gitea::http_client().get(url).send().await.unwrap_or_else(|e| panic!("GET {url}: {e}"));
    (response.status().as_u16(), response.text().await.unwrap_or_default())
}

/// `bytes` changed one to three times at random — a byte replaced, one inserted, the rest
/// cut off, junk appended or spliced in — for the tests that feed hostile input to a
/// parser (the facade's, the loopback's): one mutator, so both campaigns try the same.
pub fn mutate(rng: &mut fastrand::Rng, mut bytes: Vec<u8>) -> Vec<u8> {
    for _ in 0..rng.usize(1..4) {
        match rng.u8(0..5) {
            0 if !bytes.is_empty() => {
                let i = rng.usize(..bytes.len());
                bytes[i] = rng.u8(..);
            }
            1 => {
                let i = rng.usize(..=bytes.len());
                bytes.insert(i, rng.u8(..));
            }
            2 if !bytes.is_empty() => bytes.truncate(rng.usize(..bytes.len())),
            3 => {
                let n = rng.usize(0..64);
                bytes.extend((0..n).map(|_| rng.u8(..)));
            }
            _ => {
                let i = rng.usize(..=bytes.len());
                let junk: Vec<u8> = (0..rng.usize(1..16)).map(|_| rng.u8(..)).collect();
                bytes.splice(i..i, junk);
            }
        }
    }
    bytes
}

/// The value of the sample `name` (with its labels, e.g. `gdr_errors_total{source="store",kind="x"}`) in
/// a Prometheus text exposition, 0 when absent.
pub fn metric(metrics: &str, name: &str) -> u64 {
    metrics.lines().find(|l| l.starts_with(name)).and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse::<f64>().ok()).map_or(0, |v| v as u64)
}

/// The last `lines` lines of the log at `path`, or `None` when it cannot be read.
pub fn log_tail(path: &std::path::Path, lines: usize) -> Option<String> {
    let text = std::fs::read(path).ok()?;
    let text = String::from_utf8_lossy(&text);
    let all: Vec<&str> = text.lines().collect();
    Some(all[all.len().saturating_sub(lines)..].join("\n"))
}

/// [`free_port`] on 127.0.0.1.
pub fn free_local_port() -> u16 {
    free_port(std::net::Ipv4Addr::LOCALHOST.into())
}

/// Where `scripts/install test-peers` keeps the peers: `$PEERS_CACHE`, default
/// `~/.cache/gitea-dynamic-runner/peers`.
pub fn peers_cache() -> PathBuf {
    std::env::var_os("PEERS_CACHE")
        .map_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cache/gitea-dynamic-runner/peers"), PathBuf::from)
}

/// A peer binary, `$PEERS_CACHE/bin/<name>`; panics with what to run when it is missing
/// (a missing peer fails the test, it never skips it).
pub fn peer(name: &str) -> PathBuf {
    let path = peers_cache().join("bin").join(name);
    assert!(path.exists(), "{} is missing: run scripts/install test-peers", path.display());
    path
}

/// This process's resident memory in KiB (VmRSS of /proc/self/status), for tests and
/// benchmarks that report or bound memory; 0 where it cannot be read.
pub fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

/// What a hostile-input test tried: requests by input class, then by outcome.
pub type HostileOutcomes<C, O> = std::collections::BTreeMap<C, std::collections::BTreeMap<O, usize>>;

/// The report of a hostile-input test — a header with the rate, seed and memory before and
/// after, and a table of outcomes by input class — and how many requests ended in an
/// outcome `is_violation` calls one.
#[allow(clippy::cast_precision_loss)]
pub fn hostile_report<C: std::fmt::Debug, O: std::fmt::Debug>(
    title: &str,
    total: usize,
    elapsed: Duration,
    seed: u64,
    rss_kib: (u64, u64),
    outcomes: &HostileOutcomes<C, O>,
    is_violation: impl Fn(&O) -> bool,
) -> (String, usize) {
    let mut report = format!(
        "\n{title}: {total} requests in {:.1} s ({:.0}/s), seed {seed}, RSS {} → {} MiB\n| class | tried | outcomes |\n|---|---|---|\n",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64(),
        rss_kib.0 / 1024,
        rss_kib.1 / 1024
    );
    let mut violations = 0;
    for (class, by_outcome) in outcomes {
        let tried: usize = by_outcome.values().sum();
        let text = by_outcome.iter().map(|(o, n)| format!("{o:?} {n}")).collect::<Vec<_>>().join(", ");
        report += &format!("| {class:?} | {tried} | {text} |\n");
        violations += by_outcome.iter().filter(|(o, _)| is_violation(o)).map(|(_, n)| n).sum::<usize>();
    }
    (report, violations)
}
