//! `supervisor doctor` in deliberately broken environments: each check fails with the
//! expected reason and hint, the others keep running, `--json` parses, and the exit
//! code is non-zero when anything failed.

#![allow(clippy::unwrap_used)]

use std::process::Command;

use crate::common::*;
use serde_json::Value;
use testkit::workload::{FakeWorkloadApi, Offer};

const EXPECTED: &str = "spiffe://example.org/ci/owner/repo/build";

fn doctor(args: &[String]) -> (i32, Value) {
    let output = Command::new(SUPERVISOR)
        .arg("doctor")
        .arg("--json")
        .args(args)
        .env_remove("SPIFFE_ENDPOINT_SOCKET")
        .env_remove("CI_SPIFFE_ID")
        .env_remove("CI_RUNNER_FACADE_URL")
        .env_remove("CI_ASSIGNMENT_ID")
        .output()
        .unwrap();
    let json: Value =
        serde_json::from_slice(&output.stdout).unwrap_or_else(|e| panic!("--json is not JSON ({e}): {}", String::from_utf8_lossy(&output.stdout)));
    (output.status.code().unwrap(), json)
}

fn check<'a>(report: &'a Value, id: &str) -> &'a Value {
    report["checks"].as_array().unwrap().iter().find(|c| c["id"] == id).unwrap_or_else(|| panic!("no check {id}: {report}"))
}

fn assert_check(report: &Value, id: &str, status: &str, reason: &str, hint: &str) {
    let c = check(report, id);
    assert_eq!(c["status"], status, "{id}: {c}");
    assert!(c["reason"].as_str().unwrap().contains(reason), "{id} reason lacks {reason:?}: {c}");
    if !hint.is_empty() {
        assert!(c["hint"].as_str().unwrap_or("").contains(hint), "{id} hint lacks {hint:?}: {c}");
    }
}

fn broken_paths(dir: &std::path::Path) -> Vec<String> {
    vec![
        format!("--docker-data-root={}", dir.join("docker").display()),
        format!("--docker-socket={}", dir.join("docker.sock").display()),
        format!("--dockerd-log={}", dir.join("dockerd.log").display()),
        format!("--loop-control={}", dir.join("loop-control").display()),
        format!("--runner={}", dir.join("gitea-runner").display()),
        format!("--runner-dir={}", dir.join("runner").display()),
    ]
}

#[test]
fn every_check_reports_its_own_failure_and_keeps_going() {
    let dir = scratch();
    std::fs::write(
        dir.path().join("dockerd.log"),
        "level=info msg=\"Starting up\"\nfailed to start daemon: error initializing graphdriver: driver not supported\n",
    )
    .unwrap();
    let mut args = broken_paths(dir.path());
    args.push("--spiffe-endpoint=unix:///nonexistent/api.sock".into());
    args.push(format!("--spiffe-id={EXPECTED}"));
    let (code, report) = doctor(&args);
    assert_eq!(code, 1);
    // The test runs on a host whose PID 1 is not the supervisor.
    assert_check(&report, "pid1", "FAIL", "not the supervisor", "ENTRYPOINT");
    assert_check(&report, "identity-socket", "FAIL", "no Workload API socket at /nonexistent/api.sock", "mount the SPIRE agent's socket");
    assert_check(&report, "svid", "SKIP", "unreachable", "");
    assert_check(&report, "loop-devices", "FAIL", "loop-control is unusable", "privileged");
    assert_check(&report, "storage", "FAIL", "is not a mountpoint", "");
    assert_check(&report, "dockerd", "FAIL", "driver not supported", "read its log");
    assert_check(&report, "runner", "FAIL", "not found", "gitea-runner");
    assert_check(&report, "facade", "SKIP", "CI_RUNNER_FACADE_URL is not set", "");
    assert_check(&report, "environment", "PASS", "set", "");
    assert_eq!(report["failed"].as_u64().unwrap() as usize, report["checks"].as_array().unwrap().iter().filter(|c| c["status"] == "FAIL").count());
}

#[test]
fn missing_environment_variables_are_named() {
    let dir = scratch();
    let mut args = broken_paths(dir.path());
    args.push("--identity=true".into());
    let (code, report) = doctor(&args);
    assert_eq!(code, 1);
    assert_check(&report, "environment", "FAIL", "CI_SPIFFE_ID, SPIFFE_ENDPOINT_SOCKET", "CI_SPIFFE_ID");
    let mut args = broken_paths(dir.path());
    args.push(format!("--spiffe-id={EXPECTED}"));
    args.push("--facade-url=unix:///run/gdr/facade.sock".into());
    let (_, report) = doctor(&args);
    assert_check(&report, "environment", "FAIL", "SPIFFE_ENDPOINT_SOCKET, CI_ASSIGNMENT_ID", "");
    // Without a job SPIFFE ID identity is off, as in the docker driver's default mode.
    let (_, report) = doctor(&broken_paths(dir.path()));
    assert_check(&report, "environment", "PASS", "", "");
    assert_check(&report, "svid", "SKIP", "identity is off", "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_svid_is_named_with_what_was_offered() {
    let dir = scratch();
    let fake = FakeWorkloadApi::start(dir.path()).await;
    fake.set(Offer::Ids(vec!["spiffe://example.org/ci/owner/other/build".into()]));
    let mut args = broken_paths(dir.path());
    args.push(format!("--spiffe-endpoint={}", fake.endpoint()));
    args.push(format!("--spiffe-id={EXPECTED}"));
    let (code, report) = tokio::task::spawn_blocking(move || doctor(&args)).await.unwrap();
    assert_eq!(code, 1);
    assert_check(&report, "identity-socket", "PASS", "accepts connections", "");
    assert_check(&report, "svid", "FAIL", "not the expected spiffe://example.org/ci/owner/repo/build", "unix:uid:0");
    assert!(check(&report, "svid")["reason"].as_str().unwrap().contains("spiffe://example.org/ci/owner/other/build"));

    fake.set(Offer::Ids(vec![EXPECTED.into()]));
    let mut args = broken_paths(dir.path());
    args.push(format!("--spiffe-endpoint={}", fake.endpoint()));
    args.push(format!("--spiffe-id={EXPECTED}"));
    let (_, report) = tokio::task::spawn_blocking(move || doctor(&args)).await.unwrap();
    assert_check(&report, "svid", "PASS", EXPECTED, "");

    fake.set(Offer::Refuse);
    let mut args = broken_paths(dir.path());
    args.push(format!("--spiffe-endpoint={}", fake.endpoint()));
    args.push(format!("--spiffe-id={EXPECTED}"));
    let (_, report) = tokio::task::spawn_blocking(move || doctor(&args)).await.unwrap();
    assert_check(&report, "svid", "FAIL", "no identity issued", "matching uid 0");
}

#[test]
fn a_healthy_loop_control_passes_and_text_output_has_a_summary() {
    let dir = scratch();
    let mut args = broken_paths(dir.path());
    args.retain(|a| !a.starts_with("--loop-control"));
    let (_, report) = doctor(&args);
    assert_check(&report, "loop-devices", "PASS", "next free loop device /dev/loop", "");
    let output = Command::new(SUPERVISOR).arg("doctor").args(&args).output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("PASS  loop-devices"), "{text}");
    assert!(text.lines().any(|l| l.ends_with("skipped") && l.contains("passed,")), "{text}");
}

#[test]
fn doctor_inside_a_supervised_environment_sees_pid1_and_dockerd() {
    // doctor runs as the job (uid 2000) inside the supervisor's PID namespace.
    let dir = scratch();
    let out = dir.path().join("report.json");
    let job = format!("{SUPERVISOR} doctor --json --identity=false --docker=false > {} || true", out.display());
    let status = run_as_pid1(&dir.path().join("state"), &[], &job).status().unwrap();
    assert!(status.success());
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_check(&report, "pid1", "PASS", "PID 1 is the supervisor", "");
    assert_check(&report, "zombies", "PASS", "no zombie", "");
    assert_check(&report, "dockerd", "SKIP", "Docker is off", "");
}

#[test]
fn the_runner_file_is_checked() {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch();
    let runner_dir = dir.path().join("runner");
    let (_, report) = doctor(&broken_paths(dir.path()));
    assert_check(&report, "runner-file", "SKIP", "does not exist", "");
    std::fs::create_dir_all(&runner_dir).unwrap();
    let file = runner_dir.join(".runner");
    std::fs::write(&file, r#"{"uuid":"gitea-task-7","address":"http://127.0.0.1:4000","ephemeral":true}"#).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut args = broken_paths(dir.path());
    args.push("--assignment-id=gitea-task-7".into());
    let (_, report) = doctor(&args);
    assert_check(&report, "runner-file", "PASS", "http://127.0.0.1:4000", "");
    // As act_runner v0.2.12 rewrites it: no `ephemeral`, labels with their schema.
    std::fs::write(&file, r#"{"WARNING":"…","id":0,"uuid":"gitea-task-7","name":"gitea-task-7","token":"t","address":"http://127.0.0.1:4000","labels":["disposable:host","container:host","docker:host"]}"#).unwrap();
    let (_, report) = doctor(&args);
    assert_check(&report, "runner-file", "PASS", "http://127.0.0.1:4000", "");
    std::fs::write(&file, r#"{"uuid":"gitea-task-8","address":"https://gitea.example.com","ephemeral":false}"#).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (_, report) = doctor(&args);
    let outcome = check(&report, "runner-file");
    assert_eq!(outcome["status"], "FAIL");
    for problem in ["not the loopback", "not ephemeral", "is not the assignment gitea-task-7", "readable by others"] {
        assert!(outcome["reason"].as_str().unwrap().contains(problem), "{problem}: {outcome}");
    }
}

/// Both runner generations with the image's configuration: gitea-runner v3 must have
/// the job-started hook set; act_runner (no hooks) passes, the supervisor holds its task.
#[test]
fn both_runner_generations_pass_with_the_image_config() {
    let dir = scratch();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../rootfs/etc/gitea-runner/config.yaml");
    let no_hook = dir.path().join("no-hook.yaml");
    std::fs::write(&no_hook, "runner:\n  capacity: 1\n").unwrap();
    for (runner, config, status, reason) in [
        ("gitea-runner", config, "PASS", "v3.3.0 with"),
        ("gitea-runner", no_hook.to_str().unwrap(), "FAIL", "has no runner.hooks.job_started"),
        ("act_runner", config, "PASS", "v0.2.12 has no job hooks"),
        ("act_runner", no_hook.to_str().unwrap(), "PASS", "v0.2.12 has no job hooks"),
    ] {
        let binary = testkit::peer(runner).display().to_string();
        let mut args = broken_paths(dir.path());
        args.retain(|a| !a.starts_with("--runner="));
        args.push(format!("--runner={binary}"));
        args.push(format!("--runner-config={config}"));
        let (_, report) = doctor(&args);
        assert_check(&report, "runner", status, reason, "");
    }
}

/// `doctor --image` against this host with the repository's config and the real runner:
/// a package list naming a tool that is not here fails by that tool's name and says which
/// package to install, one that is here passes, a binary that is not a runner fails, and
/// the other checks keep running. (scripts/build image runs it in the real image.)
#[test]
fn the_image_mode_names_the_missing_package_and_keeps_going() {
    let dir = scratch();
    let packages = dir.path().join("packages");
    std::fs::write(&packages, "# test list\nbash bash --version\ngdr-missing gdr-no-such-tool --version\nempty-file /dev/null\n").unwrap();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../rootfs/etc/gitea-runner/config.yaml");
    let image = |runner: &str| {
        doctor(&["--image".into(), format!("--packages={}", packages.display()), format!("--runner={runner}"), format!("--runner-config={config}")])
    };
    let (code, report) = image(&testkit::peer("gitea-runner").display().to_string());
    assert_eq!(code, 1, "{report}");
    assert_check(&report, "bash", "PASS", "GNU bash", "");
    assert_check(&report, "gdr-no-such-tool", "FAIL", "not on PATH", "install the Debian package gdr-missing");
    assert_check(&report, "empty-file", "FAIL", "/dev/null is empty", "");
    assert_check(&report, "runner", "PASS", "v3.3.0 with", "");
    assert_check(&report, "cache", "PASS", "http://127.0.0.1:41731/", "");
    // The hook the config names is not installed on this host.
    assert_check(&report, "job-started", "FAIL", "/usr/local/lib/gitea-dynamic-runner/job-started", "");
    assert!(report["checks"].as_array().unwrap().iter().all(|c| c["id"] != "pid1"), "--image runs no environment check: {report}");

    let (_, report) = image("/bin/true");
    assert_check(&report, "runner", "FAIL", "not \"gitea-runner version", "/usr/local/bin/gitea-runner");

    // A runner configuration that keeps the runner's own cache (it dies with the job).
    let own_cache = dir.path().join("own-cache.yaml");
    std::fs::write(&own_cache, "cache:\n  enabled: true\n").unwrap();
    let (_, report) = doctor(&["--image".into(), format!("--packages={}", packages.display()), format!("--runner-config={}", own_cache.display())]);
    assert_check(&report, "cache", "FAIL", "would not reach the controller's cache", "cache.external_server: http://127.0.0.1:41731/");
}
