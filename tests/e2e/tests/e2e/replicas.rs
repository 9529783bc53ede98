//! Two controller replicas on one JetStream, split as an operator may split them: one
//! fetches and creates environments (scheduler, worker), the other is the facade. Gitea
//! accepts reports on a task only from the runner that fetched it, so the replicas share
//! one credential per placement: the task fetched by the first replica is reported
//! through the second with the same runner's credential, and the job succeeds.

use std::time::Duration;

use e2e::{
    docker::host,
    stack::{Controller, Options, state_dir},
};
use testkit::{
    gitea::{Gitea, GiteaOptions, strip_log_timestamps},
    nats::NatsServer,
    wait_until,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_fetched_by_one_replica_is_reported_through_another() {
    let _turn = e2e::exclusive().await;
    let docker = host();
    let image = docker.image("gitea-runner");
    let nats = NatsServer::start();
    let gitea = Gitea::start(GiteaOptions { bind: docker.bridge_ip.into(), ..GiteaOptions::default() }).await;
    let repo = gitea.create_repo("replicas").await;
    let token = gitea.runner_registration_token().await;
    let shared = state_dir();
    let store = format!("kind = \"jetstream\"\nurl = \"{}\"\nack_wait = \"30s\"", nats.url);
    let options = |components: &str| {
        let mut options = Options::new(&gitea.url(), &token, &image, &docker.socket);
        options.state_dir = Some(shared.path().to_owned());
        options.store = Some(store.clone());
        options.components = components.to_owned();
        options.capacity = 1;
        options
    };
    let mut fetcher = Controller::start(options("scheduler,worker")).await;
    let credential = shared.path().join("runners/container.docker.json");
    wait_until("the first replica registered", Duration::from_secs(30), || credential.exists()).await;
    let mut facade = Controller::start(options("facade")).await;

    gitea
        .commit_workflow(
            &repo,
            "echo.yml",
            "on: push\njobs:\n  echo:\n    runs-on: [disposable, container, docker]\n    steps:\n      - run: echo replicas-ok\n",
        )
        .await;
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(180), |t| t.len() == 1 && !matches!(t[0].status.as_str(), "waiting" | "running")).await;
    let log = strip_log_timestamps(&gitea.job_log(&repo, tasks[0].run_number, 0).await);
    assert_eq!(tasks[0].status, "success", "{log}");
    assert!(log.contains("replicas-ok"), "{log}");
    let uuid = serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(&credential).unwrap()).unwrap()["uuid"].as_str().unwrap().to_owned();
    facade.wait_until_all_terminal(Duration::from_secs(30)).await;
    let records = facade.records().await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].runner, uuid, "the record names the runner that fetched the task");
    let label = facade.environment_label();
    wait_until("the environment is removed", Duration::from_secs(60), || host().containers(&label).is_empty()).await;
    fetcher.assert_running();
    facade.assert_running();
    facade.stop().await;
    fetcher.stop().await;
}
