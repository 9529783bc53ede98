//! What an operator meets in the first week, with real jobs: the real Gitea 1.23.8, the
//! controller's components, the runner image with the static supervisor as PID 1 and the
//! real gitea-runner v3.3.0 on a real dockerd.
//!
//! - A controller restarted while jobs run (an upgrade, `systemctl restart`) is
//!   invisible to them: every job finishes with its own result, its log complete, once.
//!   (The docker driver once mounted the facade socket *file*: a restarted controller
//!   bound a new inode and every running job lost its way back to Gitea.)
//! - An environment removed before it claimed its job is made again: the task is intact.
//! - Two installations on one Docker host (two Gitea instances, or one Gitea with two
//!   stores during a migration) leave each other's environments alone.

use std::time::{Duration, Instant};

use e2e::{
    docker::host,
    stack::{Controller, Options},
};
use testkit::{
    gitea::{Gitea, GiteaOptions, Repo, TaskInfo, strip_log_timestamps},
    wait_until,
};

/// Jobs running while the controller restarts (`GDR_RESTART_JOBS`, default 4).
fn restart_jobs() -> usize {
    std::env::var("GDR_RESTART_JOBS").ok().and_then(|n| n.parse().ok()).unwrap_or(4)
}

async fn gitea_on_the_bridge() -> Gitea {
    Gitea::start(GiteaOptions { bind: host().bridge_ip.into(), ..GiteaOptions::default() }).await
}

fn options(gitea: &Gitea, token: &str, capacity: usize) -> Options {
    let docker = host();
    let mut options = Options::new(&gitea.url(), token, &docker.image("gitea-runner"), &docker.socket);
    options.capacity = capacity;
    options
}

fn done(tasks: &[TaskInfo], expected: usize) -> bool {
    tasks.len() >= expected && tasks.iter().all(|t| !t.is_open())
}

/// A matrix of `n` jobs that each print, sleep `seconds`, then print again; job 1 fails
/// on purpose (a real result, not one a restart made up). What they print is computed by
/// the shell, so a step's own text in the log never matches it.
fn matrix(n: usize, seconds: u32) -> String {
    let items: Vec<String> = (1..=n).map(|i| i.to_string()).collect();
    format!(
        r#"name: restart
on: push
jobs:
  job:
    strategy:
      matrix:
        n: [{items}]
    runs-on: [disposable, container, docker]
    steps:
      - run: echo "job-$(( ${{{{ matrix.n }}}} ))-started"
      - run: sleep {seconds}
      - run: echo "job-$(( ${{{{ matrix.n }}}} ))-slept"
      - run: '[ "${{{{ matrix.n }}}}" != 1 ] || exit 3'
      - run: echo "job-$(( ${{{{ matrix.n }}}} ))-done"
"#,
        items = items.join(", ")
    )
}

/// The matrix number of the run's job at `index`, from its log (`Matrix: map[n:N]`):
/// Gitea orders a run's jobs by name, so from ten jobs on index and number differ.
async fn job_number(gitea: &Gitea, repo: &Repo, run: i64, index: usize) -> usize {
    const MATRIX: &str = "Matrix: map[n:";
    gitea.wait_for_log(repo, run, index, MATRIX).await;
    let log = gitea.job_log(repo, run, index).await;
    log.split(MATRIX)
        .nth(1)
        .and_then(|rest| rest.split(']').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no matrix number in:\n{log}"))
}

/// Every job's log by its matrix number.
async fn logs(gitea: &Gitea, repo: &Repo, run: i64, jobs: usize) -> std::collections::BTreeMap<usize, String> {
    let mut logs = std::collections::BTreeMap::new();
    for index in 0..jobs {
        let n = job_number(gitea, repo, run, index).await;
        logs.insert(n, strip_log_timestamps(&gitea.job_log(repo, run, index).await));
    }
    assert_eq!(logs.keys().copied().collect::<Vec<_>>(), (1..=jobs).collect::<Vec<_>>(), "the run's jobs are not the matrix");
    logs
}

/// Restarted while every job sleeps: each ends with its own result and its whole log,
/// each ran in one environment (Gitea made one task per job), and nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_restarted_mid_job_is_invisible_to_running_jobs() {
    let _turn = e2e::exclusive().await;
    let jobs = restart_jobs();
    let gitea = gitea_on_the_bridge().await;
    let repo = gitea.create_repo("restart").await;
    let state = e2e::stack::state_dir();
    let mut options = options(&gitea, &gitea.runner_registration_token().await, jobs);
    options.state_dir = Some(state.path().to_owned());
    let mut controller = Controller::start(options.clone()).await;
    gitea.commit_workflow(&repo, "restart.yml", &matrix(jobs, 20)).await;
    let started = gitea.wait_for_tasks(&repo, Duration::from_secs(240), |t| t.len() == jobs && t.iter().all(|t| t.status == "running")).await;
    let run = started[0].run_number;
    for index in 0..jobs {
        let n = job_number(&gitea, &repo, run, index).await;
        gitea.wait_for_log(&repo, run, index, &format!("job-{n}-started")).await;
    }
    let containers = host().containers(&controller.environment_label());
    assert_eq!(containers.len(), jobs, "{containers:?}");

    controller.stop().await;
    drop(controller);
    let restarted_at = Instant::now();
    let controller = Controller::start(options).await;
    eprintln!("controller restarted while {jobs} jobs ran ({:?})", restarted_at.elapsed());

    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(240), |t| done(t, jobs)).await;
    let logs = logs(&gitea, &repo, run, jobs).await;
    assert_eq!(tasks.len(), jobs, "one task per job, none run twice: {tasks:?}");
    for (&n, log) in &logs {
        let task = tasks.iter().find(|t| t.name.ends_with(&format!("({n})"))).unwrap_or_else(|| panic!("no task of job {n}: {tasks:?}"));
        let want = if n == 1 { "failure" } else { "success" };
        assert_eq!(task.status, want, "job {n}: {tasks:?}\n{log}");
        assert!(log.contains(&format!("job-{n}-slept")), "job {n}'s log lost its rows after the restart:\n{log}");
        assert_eq!(log.contains(&format!("job-{n}-done")), n != 1, "job {n}:\n{log}");
        assert_eq!(log.matches(&format!("job-{n}-started")).count(), 1, "job {n} ran twice:\n{log}");
        assert!(!log.contains("gitea-dynamic-runner:"), "the controller ended job {n} itself instead of the runner:\n{log}");
    }
    let label = controller.environment_label();
    wait_until("every environment is removed", Duration::from_secs(90), || host().containers(&label).is_empty()).await;
    controller.wait_until_all_terminal(Duration::from_secs(30)).await;
    let records = controller.records().await;
    assert_eq!(records.len(), jobs, "{records:?}");
    assert!(records.iter().all(|r| r.is_terminal() && r.attempts == 0), "{records:?}");
    finish(controller).await;
}

const SHORT: &str = r#"name: short
on: push
jobs:
  short:
    runs-on: [disposable, container, docker]
    steps:
      - run: echo "short job ran"
"#;

/// `docker rm -f` of an environment that has not claimed its job yet (here: no facade
/// runs, so its claim waits): the reconciler makes a new one, which claims once a full
/// controller runs, and the job succeeds — one task in Gitea, one retry on the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_environment_removed_before_its_claim_is_made_again() {
    let _turn = e2e::exclusive().await;
    let gitea = gitea_on_the_bridge().await;
    let repo = gitea.create_repo("removed").await;
    let state = e2e::stack::state_dir();
    let mut options = options(&gitea, &gitea.runner_registration_token().await, 1);
    options.state_dir = Some(state.path().to_owned());
    let no_facade = Options { components: "scheduler,worker".into(), ..options.clone() };
    let mut controller = Controller::start(no_facade).await;
    gitea.commit_workflow(&repo, "short.yml", SHORT).await;
    let label = controller.environment_label();
    wait_until("the environment runs", Duration::from_secs(60), || host().containers(&label).len() == 1).await;
    let first = host().containers(&label).remove(0);
    let output = host().docker(&["rm", "-f", &first]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let store = std::sync::Arc::clone(&controller.store);
    testkit::wait_until_async("the assignment is queued again", Duration::from_secs(60), || {
        let store = std::sync::Arc::clone(&store);
        async move { store.list().await.unwrap().iter().any(|r| r.value.attempts == 1) }
    })
    .await;
    wait_until("a new environment runs", Duration::from_secs(60), || host().containers(&label).len() == 1).await;
    controller.stop().await;
    // The redb file must be closed before the next controller opens it.
    drop((controller, store));

    let controller = Controller::start(options).await;
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(180), |t| done(t, 1)).await;
    let log = strip_log_timestamps(&gitea.job_log(&repo, tasks[0].run_number, 0).await);
    assert_eq!(tasks.len(), 1, "{tasks:?}");
    assert_eq!(tasks[0].status, "success", "{log}");
    assert!(log.contains("short job ran"), "{log}");
    controller.wait_until_all_terminal(Duration::from_secs(30)).await;
    let records = controller.records().await;
    assert_eq!(records[0].attempts, 1, "{records:?}");
    wait_until("the environment is removed", Duration::from_secs(60), || host().containers(&label).is_empty()).await;
    finish(controller).await;
}

const SLEEPER: &str = r#"name: sleeper
on: push
jobs:
  sleeper:
    runs-on: [disposable, container, docker]
    steps:
      - run: echo "sleeping in $GITHUB_REPOSITORY"
      - run: sleep 15
      - run: echo "slept well"
"#;

/// Two installations for one Gitea on one Docker host, each with its own store and key
/// — first with their default names, then both named alike on purpose — each running a
/// job while the other's reconciler sweeps every two seconds: both jobs succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_installations_on_one_docker_host_leave_each_other_alone() {
    let _turn = e2e::exclusive().await;
    let gitea = gitea_on_the_bridge().await;
    let token = gitea.runner_registration_token().await;
    for (round, named) in [(1, None), (2, Some("shared"))] {
        // Two installations hold two capability keys.
        let start = |key: &str| {
            let mut options = options(&gitea, &token, 1);
            options.capability_key = format!("{key}-capability-key-0123456789abcdef0123456789");
            if let Some(installation) = named {
                options.extra_gitea = format!("installation = \"{installation}\"");
            }
            Controller::start(options)
        };
        let (mut a, mut b) = (start("a").await, start("b").await);
        if named.is_none() {
            assert_ne!(a.config.installation(), b.config.installation(), "two stores are two installations");
        }
        let (first, second) = (gitea.create_repo(&format!("first-{round}")).await, gitea.create_repo(&format!("second-{round}")).await);
        gitea.commit_workflow(&first, "sleeper.yml", SLEEPER).await;
        gitea.commit_workflow(&second, "sleeper.yml", SLEEPER).await;
        for repo in [&first, &second] {
            let tasks = gitea.wait_for_tasks(repo, Duration::from_secs(180), |t| done(t, 1)).await;
            let log = strip_log_timestamps(&gitea.job_log(repo, tasks[0].run_number, 0).await);
            assert_eq!(tasks[0].status, "success", "round {round}, {}: one installation removed the other's job:\n{log}", repo.name);
            assert!(log.contains("slept well"), "{log}");
        }
        let (jobs_a, jobs_b) = (a.records().await.len(), b.records().await.len());
        assert_eq!(jobs_a + jobs_b, 2, "round {round}: {jobs_a} + {jobs_b}");
        for controller in [&a, &b] {
            let label = controller.environment_label();
            wait_until("its environments are removed", Duration::from_secs(60), || host().containers(&label).is_empty()).await;
        }
        a.stop().await;
        b.stop().await;
    }
}

async fn finish(mut controller: Controller) {
    controller.assert_running();
    controller.stop().await;
}
