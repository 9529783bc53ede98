//! The agent's job side with the real supervisor binary and the controller's real
//! facade (in this process, over its unix socket, with the fake Gitea behind it): claim,
//! `.runner`, the loopback RunnerService on 127.0.0.1, a stand-in for gitea-runner
//! (tests/fixtures/fake-gitea-runner.py; the real one cannot be installed here) whose
//! log and final state reach Gitea through the facade.

#![allow(clippy::unwrap_used)]

mod common;

use std::{collections::HashMap, os::unix::fs::PermissionsExt, sync::Arc, time::Duration};

use common::*;
use controller::{
    capability::CapabilityKey,
    facade::{self, Facade},
    gitea,
    placement::{self, Placement},
    scheduler::{Outcome, Scheduler, SchedulerConfig},
    store::{State, Store, embedded::Embedded},
};
use proto::runner::v1::Result as TaskResult;
use testkit::fake_gitea::{FakeGitea, Job, REGISTRATION_TOKEN};
use tokio_util::sync::CancellationToken;

const KEY: &[u8] = b"0123456789abcdef0123456789abcdef-runner-side";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_serve_and_report_through_the_facade() {
    let dir = scratch();
    let d = dir.path();
    let fake = FakeGitea::start().await;
    fake.add_job(Job::new(&["self-hosted", "container", "docker"]));
    std::fs::write(d.join("token"), REGISTRATION_TOKEN).unwrap();
    let labels = placement::declared_labels(&[Placement::CONTAINER_DOCKER]);
    let (client, _) = gitea::connect(&fake.url(), &d.join("runner.json"), Some(&d.join("token")), "ctl", &labels).await.unwrap();
    let store: Arc<dyn Store> = Arc::new(Embedded::open(&d.join("store.redb")).unwrap());
    let (observer, mut outcomes) = tokio::sync::mpsc::unbounded_channel();
    let shutdown = CancellationToken::new();
    let scheduler = Arc::new(
        Scheduler::new(client.clone(), Arc::clone(&store), SchedulerConfig {
            trust_domain: "example.org".into(),
            enabled: vec![Placement::CONTAINER_DOCKER],
            loops: 1,
            fetch_interval: Duration::from_millis(50),
            fetch_timeout: Duration::from_secs(5),
        })
        .with_observer(observer),
    );
    tokio::spawn(Arc::clone(&scheduler).run(shutdown.clone()));
    let Some(Outcome::Persisted { assignment_id, .. }) = tokio::time::timeout(Duration::from_secs(20), outcomes.recv()).await.unwrap() else {
        panic!("the task was not persisted");
    };
    let key = Arc::new(CapabilityKey::from_bytes(KEY).unwrap());
    let capability = key.issue(&assignment_id, u64::MAX / 2);
    let socket = d.join("facade.sock");
    let facade = Arc::new(Facade::new(Arc::clone(&store), client, key, "example.org".into(), HashMap::new(), HashMap::new()));
    let serve_socket = socket.clone();
    let serve_shutdown = shutdown.clone();
    tokio::spawn(async move { facade::serve_unix(facade, &serve_socket, serve_shutdown).await });
    while !socket.exists() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let report = d.join("report.json");
    let runner_dir = d.join("runner");
    let fake_runner = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/fake-gitea-runner.py");
    let mut supervisor = run_as_subreaper(
        &d.join("state"),
        &[
            &format!("--facade-url=unix://{}", socket.display()),
            &format!("--assignment-id={assignment_id}"),
            r#"--runner-labels-json=["self-hosted","container","docker"]"#,
            &format!("--runner-dir={}", runner_dir.display()),
        ],
        &format!("python3 {fake_runner}"),
    );
    supervisor.env("CI_RUNNER_CAPABILITY", &capability).env("FAKE_RUNNER_REPORT", &report);
    let output = tokio::task::spawn_blocking(move || supervisor.output().unwrap()).await.unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{}\n{stderr}", output.status);

    let seen: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(seen["env_has_capability"], false, "the capability leaked into gitea-runner's environment");
    assert_eq!(seen["runner"]["uuid"], assignment_id.as_str());
    assert_eq!(seen["runner"]["ephemeral"], true);
    assert_eq!(seen["runner"]["labels"], serde_json::json!(["self-hosted", "container", "docker"]));
    assert!(seen["runner"]["address"].as_str().unwrap().starts_with("http://127.0.0.1:"));
    assert_eq!(seen["log"]["ackIndex"], "2");
    assert!(seen["again"].get("task").is_none(), "the task was handed out twice");
    assert_eq!(std::fs::metadata(runner_dir.join(".runner")).unwrap().permissions().mode() & 0o777, 0o600);

    let task_id: i64 = seen["task_id"].as_str().unwrap().parse().unwrap();
    fake.with(|s| {
        let task = &s.tasks[&task_id];
        assert_eq!(task.final_result, Some(TaskResult::Success as i32));
        assert_eq!(task.log, ["step one", ""]);
        assert!(task.sealed);
    });
    assert!(matches!(store.get(&assignment_id).await.unwrap().unwrap().value.state, State::Terminal { .. }));
    assert!(stderr.contains("claimed") && stderr.contains("task handed to gitea-runner"), "{stderr}");
    shutdown.cancel();
}
