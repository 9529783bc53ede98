//! The fake Gitea (fault injection only) must agree with the real Gitea 1.23.8 on
//! everything tests rely on. One scenario, played by the controller's own Gitea client
//! against both, step by step; the transcripts of what each answered — acks, results,
//! stored output keys, error codes and texts — and the stored logs must be equal.

use std::time::Duration;

use controller::{
    assignment::{Placement, placement::LabelPolicy},
    gitea::{
        Gitea, GiteaError,
        registrations::{RegistrationSettings, Registrations},
    },
};
use proto::runner::v1::{LogRow, Result as TaskResult, TaskState, UpdateLogRequest, UpdateTaskRequest};
use testkit::{
    fake_gitea::{self, FakeGitea, Job},
    gitea::{GiteaOptions, strip_log_timestamps},
};

const WORKFLOW: &str = "name: agree\non: push\njobs:\n  build:\n    runs-on: [disposable, container, docker]\n    steps:\n      - run: echo one\n";

async fn registrations(url: &str, token: &str, dir: &std::path::Path) -> Registrations {
    std::fs::write(dir.join("token"), token).unwrap();
    let settings = RegistrationSettings {
        url: url.to_owned(),
        credential_dir: dir.join("runners"),
        registration_token_file: Some(dir.join("token")),
        runner_name: "agree".into(),
        labels: LabelPolicy::default(),
    };
    Registrations::open(&settings, &[Placement::CONTAINER_DOCKER, Placement::CONTAINER_KUBERNETES]).await.unwrap()
}

fn describe<T: std::fmt::Debug>(outcome: Result<T, GiteaError>) -> String {
    match outcome {
        Ok(value) => format!("{value:?}"),
        Err(GiteaError::Call { error, .. }) => format!("error {} {:?}", error.code, error.message),
        Err(GiteaError::Unregistered { message, .. }) => format!("unregistered: {message}"),
        Err(other) => format!("error {other}"),
    }
}

fn rows(lines: &[&str]) -> Vec<LogRow> {
    lines.iter().map(|l| LogRow { time: Some(prost_types::Timestamp { seconds: 1_700_000_000, nanos: 0 }), content: (*l).to_owned() }).collect()
}

/// Plays the scenario; returns its transcript.
async fn scenario(docker: &Gitea, other: &Gitea) -> (i64, Vec<String>) {
    let task =
        testkit::wait_for_async("a task is handed out", Duration::from_secs(60), || async { docker.fetch_task(0, Duration::from_secs(5)).await.unwrap().task })
            .await;
    let id = task.id;
    let log = |index, lines: &[&str], no_more| UpdateLogRequest { task_id: id, index, rows: rows(lines), no_more };
    let state = |result: TaskResult, outputs: &[(&str, &str)]| UpdateTaskRequest {
        state: Some(TaskState {
            id,
            result: result as i32,
            stopped_at: (result != TaskResult::Unspecified).then_some(prost_types::Timestamp { seconds: 1_700_000_100, nanos: 0 }),
            ..Default::default()
        }),
        outputs: outputs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
    };
    let ack = |outcome: Result<proto::runner::v1::UpdateLogResponse, GiteaError>| describe(outcome.map(|r| r.ack_index));
    let reply = |outcome: Result<proto::runner::v1::UpdateTaskResponse, GiteaError>| {
        describe(outcome.map(|r| {
            let mut sent = r.sent_outputs;
            sent.sort();
            (TaskResult::try_from(r.state.unwrap_or_default().result).unwrap(), sent)
        }))
    };
    let mut transcript = vec![
        format!("task has secrets: {}", !task.secrets.is_empty()),
        format!("task has context: {}", task.context.is_some()),
        ack(docker.update_log(&log(0, &[], false)).await),
        ack(docker.update_log(&log(0, &["a", "b"], false)).await),
        ack(docker.update_log(&log(1, &["b", "c"], false)).await),
        ack(docker.update_log(&log(5, &["gap"], false)).await),
        ack(docker.update_log(&log(0, &[], true)).await),
        ack(docker.update_log(&log(3, &["d"], false)).await),
        reply(docker.update_task(&state(TaskResult::Unspecified, &[("k1", "v1")])).await),
        reply(docker.update_task(&state(TaskResult::Unspecified, &[("k1", "changed"), ("k2", "v2")])).await),
        ack(other.update_log(&log(4, &["intruder"], false)).await),
        reply(other.update_task(&state(TaskResult::Unspecified, &[])).await),
        ack(docker.update_log(&log(4, &["e"], true)).await),
        ack(docker.update_log(&log(5, &["after the seal"], false)).await),
        reply(docker.update_task(&state(TaskResult::Success, &[])).await),
        reply(docker.update_task(&state(TaskResult::Failure, &[])).await),
    ];
    let stranger = docker.clone().authenticated(&controller::gitea::Credential {
        id: 0,
        uuid: "00000000-0000-0000-0000-000000000000".into(),
        name: "stranger".into(),
        token: "not-a-token".into(),
        address: String::new(),
    });
    transcript.push(describe(stranger.unwrap().fetch_task(0, Duration::from_secs(5)).await.map(|r| r.task.is_some())));
    (id, transcript)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fake_answers_as_the_real_gitea() {
    // The real one.
    let real = testkit::gitea::Gitea::start(GiteaOptions::default()).await;
    let repo = real.create_repo("agree").await;
    let dir = tempfile::tempdir().unwrap();
    let real_registrations = registrations(&real.url(), &real.runner_registration_token().await, dir.path()).await;
    real.commit_workflow(&repo, "agree.yml", WORKFLOW).await;
    let docker = real_registrations.fetcher(Placement::CONTAINER_DOCKER).unwrap().clone();
    let other = real_registrations.fetcher(Placement::CONTAINER_KUBERNETES).unwrap().clone();
    let (real_id, real_transcript) = scenario(&docker, &other).await;
    let tasks = real.wait_for_tasks(&repo, Duration::from_secs(30), |t| t.iter().any(|t| t.status == "success")).await;
    assert_eq!(tasks[0].id, real_id);
    let real_log: Vec<String> = strip_log_timestamps(&real.job_log(&repo, tasks[0].run_number, 0).await).lines().map(str::to_owned).collect();

    // The fake.
    let fake = FakeGitea::start().await;
    fake.add_job(Job::new(&["disposable", "container", "docker"]));
    let fake_dir = tempfile::tempdir().unwrap();
    let fake_registrations = registrations(&fake.url(), fake_gitea::REGISTRATION_TOKEN, fake_dir.path()).await;
    let docker = fake_registrations.fetcher(Placement::CONTAINER_DOCKER).unwrap().clone();
    let other = fake_registrations.fetcher(Placement::CONTAINER_KUBERNETES).unwrap().clone();
    let (fake_id, fake_transcript) = scenario(&docker, &other).await;
    let fake_log = fake.with(|s| s.tasks[&fake_id].log.clone());

    for (step, (real, fake)) in real_transcript.iter().zip(&fake_transcript).enumerate() {
        assert_eq!(real, fake, "step {step}: the fake answered differently from Gitea 1.23.8");
    }
    assert_eq!(real_transcript.len(), fake_transcript.len());
    assert_eq!(real_log, fake_log, "stored logs differ");
    assert_eq!(real_log, ["a", "b", "c", "d", "e"]);
}
