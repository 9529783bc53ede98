//! The Gitea client and the scheduler against the fake Gitea: registration and the
//! stored credential, Declare, tasks_version, tasks persisted as assignments, tasks
//! that break the placement rules failed in Gitea at once with the reason in the log.

#![allow(clippy::unwrap_used)]

mod common;

use std::{sync::Arc, time::Duration};

use common::fake_gitea::{FakeGitea, Job, REGISTRATION_TOKEN};
use controller::{
    envelope::Assignment,
    gitea::{self, GiteaError},
    placement::{self, Placement},
    scheduler::{Outcome, Scheduler, SchedulerConfig},
    store::{State, Store, embedded::Embedded},
};
use proto::runner::v1::Result as TaskResult;
use tokio_util::sync::CancellationToken;

fn enabled() -> Vec<Placement> {
    vec!["container.docker".parse().unwrap(), "container.kubernetes".parse().unwrap()]
}

fn labels() -> Vec<String> {
    placement::declared_labels(&enabled())
}

#[tokio::test]
async fn registers_once_then_reuses_the_stored_credential() {
    let fake = FakeGitea::start().await;
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("registration-token");
    std::fs::write(&token_file, format!("{REGISTRATION_TOKEN}\n")).unwrap();
    let credential_file = dir.path().join("state/runner.json");

    let (_, first) = gitea::connect(&fake.url(), &credential_file, Some(&token_file), "ctl", &labels()).await.unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&credential_file).unwrap().permissions().mode() & 0o777, 0o600);
    let (_, second) = gitea::connect(&fake.url(), &credential_file, Some(&token_file), "ctl", &labels()).await.unwrap();
    assert_eq!(first, second);
    fake.with(|s| {
        assert_eq!(s.registrations, 1, "the second start registered again");
        assert_eq!(s.declares, 2);
        assert_eq!(s.capabilities, ["cancelling"]);
        assert_eq!(s.runners[&first.uuid].1, labels());
    });
}

#[tokio::test]
async fn a_wrong_registration_token_and_an_unknown_runner_are_clear_errors() {
    let fake = FakeGitea::start().await;
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("registration-token");
    std::fs::write(&token_file, "wrong").unwrap();
    let credential_file = dir.path().join("runner.json");
    let error = gitea::connect(&fake.url(), &credential_file, Some(&token_file), "ctl", &labels()).await.unwrap_err();
    assert!(matches!(error, GiteaError::RegistrationRefused(_)), "{error}");
    assert!(error.to_string().contains("registration token"), "{error}");

    let stale = gitea::Credential { id: 1, uuid: "gone".into(), name: "ctl".into(), token: "t".into(), address: fake.url() };
    stale.store(&credential_file).unwrap();
    let error = gitea::connect(&fake.url(), &credential_file, Some(&token_file), "ctl", &labels()).await.unwrap_err();
    assert!(matches!(error, GiteaError::Unregistered { .. }), "{error}");
    assert!(error.to_string().contains(&credential_file.display().to_string()), "{error}");
    assert!(error.to_string().contains("unregistered runner"), "{error}");
}

async fn start(fake: &FakeGitea, dir: &std::path::Path, loops: usize) -> (Arc<Scheduler>, Arc<dyn Store>, tokio::sync::mpsc::UnboundedReceiver<Outcome>) {
    let token_file = dir.join("registration-token");
    std::fs::write(&token_file, REGISTRATION_TOKEN).unwrap();
    let (client, _) = gitea::connect(&fake.url(), &dir.join("runner.json"), Some(&token_file), "ctl", &labels()).await.unwrap();
    let store: Arc<dyn Store> = Arc::new(Embedded::open(&dir.join("store.redb")).unwrap());
    let (observer, outcomes) = tokio::sync::mpsc::unbounded_channel();
    let config = SchedulerConfig {
        trust_domain: "example.org".into(),
        enabled: enabled(),
        loops,
        fetch_interval: Duration::from_millis(50),
        fetch_timeout: Duration::from_secs(5),
    };
    (Arc::new(Scheduler::new(client, Arc::clone(&store), config).with_observer(observer)), store, outcomes)
}

async fn collect(outcomes: &mut tokio::sync::mpsc::UnboundedReceiver<Outcome>, n: usize) -> Vec<Outcome> {
    let mut seen = Vec::new();
    while seen.len() < n {
        let outcome = tokio::time::timeout(Duration::from_secs(20), outcomes.recv()).await.expect("scheduler stalled").unwrap();
        seen.push(outcome);
    }
    seen
}

#[tokio::test]
async fn tasks_become_persisted_assignments_and_bad_ones_fail_at_once() {
    let fake = FakeGitea::start().await;
    let dir = tempfile::tempdir().unwrap();
    for _ in 0..3 {
        fake.add_job(Job::new(&["self-hosted", "container", "docker"]));
    }
    fake.add_job(Job::new(&["self-hosted", "pod", "docker"])); // legacy mixed with a driver
    fake.add_job(Job::new(&["self-hosted", "container"])); // kubernetes by default
    let (scheduler, store, mut outcomes) = start(&fake, dir.path(), 2).await;
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(Arc::clone(&scheduler).run(shutdown.clone()));
    let seen = collect(&mut outcomes, 5).await;
    shutdown.cancel();
    running.await.unwrap().unwrap();

    let rejected: Vec<_> = seen.iter().filter_map(|o| match o { Outcome::Rejected { task_id, reason } => Some((*task_id, reason.clone())), _ => None }).collect();
    assert_eq!(rejected.len(), 1, "{seen:?}");
    let (bad_task, reason) = &rejected[0];
    assert!(reason.contains("pod"), "{reason}");
    fake.with(|s| {
        let record = &s.tasks[bad_task];
        assert_eq!(record.final_result, Some(TaskResult::Failure as i32));
        assert!(record.sealed);
        assert!(record.log.iter().any(|l| l.contains("this job cannot run") && l.contains("pod")), "{:?}", record.log);
        assert!(s.waiting.is_empty());
        assert_eq!(s.tasks.len(), 5, "each job handed out exactly once");
    });

    let records = store.list().await.unwrap();
    assert_eq!(records.len(), 4);
    let mut placements: Vec<_> = records.iter().map(|r| r.value.placement.clone()).collect();
    placements.sort();
    assert_eq!(placements, ["container.docker", "container.docker", "container.docker", "container.kubernetes"]);
    for record in &records {
        assert_eq!(record.value.state, State::Pending);
        let assignment = Assignment::decode(&record.value.envelope, "example.org").unwrap();
        assert_eq!(assignment.id, record.value.assignment_id);
        assert_eq!(assignment.identity.spiffe_id, "spiffe://example.org/ci/owner/repo/build");
        assert!(fake.with(|s| s.tasks.contains_key(&assignment.task.id)));
    }
}

#[tokio::test]
async fn an_outage_of_gitea_is_ridden_out_and_tasks_version_is_honoured() {
    let fake = FakeGitea::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (scheduler, store, mut outcomes) = start(&fake, dir.path(), 1).await;
    fake.with(|s| s.fail_fetches = 3);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(Arc::clone(&scheduler).run(shutdown.clone()));
    tokio::time::sleep(Duration::from_millis(400)).await;
    fake.add_job(Job::new(&["self-hosted", "container", "docker"]));
    collect(&mut outcomes, 1).await;
    // Idle polling with the latest tasks_version: Gitea is not asked to pick a task.
    let before = fake.with(|s| s.fetches);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = fake.with(|s| s.fetches);
    shutdown.cancel();
    running.await.unwrap().unwrap();
    assert!(after > before, "the loop stopped polling");
    assert_eq!(store.list().await.unwrap().len(), 1);
    assert_eq!(fake.with(|s| s.fail_fetches), 0);
}
