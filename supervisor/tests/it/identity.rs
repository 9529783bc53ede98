//! The agent waits for the exact SPIFFE ID through the Workload API: a fake server
//! first refuses, then offers a wrong ID, then the right one; the job starts only on
//! the exact ID, and every call carried `workload.spiffe.io: true`.

#![allow(clippy::unwrap_used)]

use std::{process::Stdio, time::Duration};

use crate::common::*;
use testkit::workload::{FakeWorkloadApi, Offer};

const EXPECTED: &str = "spiffe://example.org/ci/owner/repo/build";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_starts_only_on_the_exact_spiffe_id() {
    let dir = scratch();
    let fake = FakeWorkloadApi::start(dir.path()).await;
    let started = dir.path().join("started");
    let mut command = tokio::process::Command::from(run_as_subreaper(
        &dir.path().join("state"),
        &["--identity=true", &format!("--spiffe-id={EXPECTED}"), &format!("--spiffe-endpoint={}", fake.endpoint()), "--identity-timeout=60s"],
        &format!("touch {}", started.display()),
    ));
    // The agent's log, to see which offers it has judged.
    let log = dir.path().join("supervisor.log");
    let mut supervisor = command.stdin(Stdio::null()).stderr(std::fs::File::create(&log).unwrap()).kill_on_drop(true).spawn().unwrap();
    let logged = || std::fs::read_to_string(&log).unwrap_or_default();

    // Refused: the agent keeps asking (and reconnecting), the job does not start.
    testkit::wait_until("the agent asked again after a refusal", Duration::from_secs(30), || fake.calls_with_header() >= 2).await;
    assert!(!started.exists(), "the job started without an identity");
    let refused_calls = fake.calls_with_header();

    // A wrong ID (and one that only shares a prefix) must not do: once the agent has
    // judged that offer (and logged so), the job has not started.
    fake.set(Offer::Ids(vec!["spiffe://example.org/ci/owner/other/build".into(), format!("{EXPECTED}-x")]));
    testkit::wait_until("the agent judged the wrong IDs", Duration::from_secs(30), || {
        logged().lines().any(|l| l.contains("offers other identities") && l.contains(&format!("{EXPECTED}-x")))
    })
    .await;
    assert!(!started.exists(), "the job started with the wrong identity");

    // The exact ID, as the second SVID of the update: proceed.
    fake.set(Offer::Ids(vec!["spiffe://example.org/ci/owner/other/build".into(), EXPECTED.into()]));
    let status = tokio::time::timeout(Duration::from_secs(30), supervisor.wait()).await.unwrap().unwrap();
    assert!(status.success(), "{status}\n{}", logged());
    assert!(started.exists());
    assert_eq!(fake.calls_without_header(), 0, "a call lacked workload.spiffe.io: true");
    assert!(fake.calls_with_header() > refused_calls);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_deadline_names_the_missing_id() {
    let dir = scratch();
    let fake = FakeWorkloadApi::start(dir.path()).await;
    fake.set(Offer::Ids(vec!["spiffe://example.org/ci/owner/other/build".into()]));
    let output = tokio::process::Command::from(run_as_subreaper(
        &dir.path().join("state"),
        &["--identity=true", &format!("--spiffe-id={EXPECTED}"), &format!("--spiffe-endpoint={}", fake.endpoint()), "--identity-timeout=2s"],
        "true",
    ))
    .stdin(Stdio::null())
    .output()
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(71), "{stderr}");
    assert!(stderr.contains(EXPECTED) && stderr.contains("spiffe://example.org/ci/owner/other/build"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_started_hook_waits_for_identity_and_names_what_is_missing() {
    let dir = scratch();
    let fake = FakeWorkloadApi::start(dir.path()).await;
    let state = dir.path().join("state");
    let mut supervisor = tokio::process::Command::from(run_as_subreaper(
        &state,
        &["--identity=true", &format!("--spiffe-id={EXPECTED}"), &format!("--spiffe-endpoint={}", fake.endpoint())],
        "sleep 30",
    ))
    .stdin(Stdio::null())
    .kill_on_drop(true)
    .spawn()
    .unwrap();
    let socket = state.join("agent/agent.sock");
    let hook = |timeout: &str| {
        tokio::process::Command::new(SUPERVISOR)
            .args(["job-started", &format!("--socket={}", socket.display()), &format!("--timeout={timeout}")])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };

    // Not ready within the hook's deadline: non-zero, naming identity.
    let output = hook("1s").wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(74), "{stderr}");
    assert!(stderr.contains("identity: waiting"), "{stderr}");
    assert!(!stderr.contains("dockerd:"), "dockerd is off and must not be named: {stderr}");

    // Identity arrives while the hook waits: it returns 0.
    let waiting = hook("30s");
    let pid = waiting.id().unwrap();
    testkit::wait_until("the hook is connected to the agent", Duration::from_secs(30), || holds_a_socket(pid)).await;
    fake.set(Offer::Ids(vec![EXPECTED.into()]));
    let output = waiting.wait_with_output().await.unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout} {}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains(EXPECTED), "{stdout}");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(supervisor.id().unwrap() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), supervisor.wait()).await.unwrap().unwrap();
    assert_eq!(status.code(), Some(143));
}

/// Whether process `pid` has a socket open (the hook: its connection to the agent; it
/// inherits none, its standard streams are pipes).
fn holds_a_socket(pid: u32) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    fds.flatten().any(|fd| std::fs::read_link(fd.path()).is_ok_and(|target| target.to_string_lossy().starts_with("socket:")))
}
