//! What an operator sees, checked by a real Prometheus scraping the controller while real
//! jobs run (the real Gitea, the runner image, gitea-runner): an environment killed
//! mid-job, a backlog beyond capacity, jobs that succeed and one that fails. Every panel
//! of the chart's dashboard must have data, and every alert of its rules must be in the
//! state the scenario implies: the lost environment's alert fires, no other.

use std::time::{Duration, Instant};

use e2e::docker::host;
use testkit::{gitea::strip_log_timestamps, prometheus::Prometheus};

use crate::jobs::{FAILING, environments_gone, finished, setup_with, start_sleeper, status_of};

const MATRIX: &str = r#"name: matrix
on: push
jobs:
  three:
    strategy:
      matrix:
        n: [1, 2, 3]
    runs-on: [disposable, container, docker]
    steps:
      - run: echo "matrix job ${{ matrix.n }}" && sleep 3
"#;

/// The dashboard's queries: (panel title, query) with Grafana's `$__rate_interval` as a
/// window that spans the whole scenario.
fn dashboard_queries() -> Vec<(String, String)> {
    let path = e2e::paths::repository().join("charts/gitea-dynamic-runner/files/dashboard.json");
    let dashboard: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let panels = dashboard["panels"].as_array().unwrap();
    panels
        .iter()
        .filter(|p| p["type"] != "row")
        .flat_map(|panel| {
            let title = panel["title"].as_str().unwrap().to_owned();
            panel["targets"].as_array().unwrap().iter().map(move |t| (title.clone(), t["expr"].as_str().unwrap().replace("$__rate_interval", "10m")))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_sees_where_the_time_goes_and_pages_for_the_lost_environment() {
    let port = testkit::free_local_port();
    let (gitea, repo, mut controller, _turn) = setup_with("observed", "gitea-runner", |options| {
        options.capacity = 2;
        options.http_listen = format!("127.0.0.1:{port}");
    })
    .await;
    let rules = e2e::paths::repository().join("deploy/prometheus/gitea-dynamic-runner.rules.yaml");
    let prometheus = Prometheus::start("gitea-dynamic-runner", &format!("127.0.0.1:{port}"), &rules).await;
    // As an operator's would, it has scraped the controller before the first job: each
    // outcome's series at 0 (the first job starts within two seconds here).
    let lost = r#"gdr_environments_ended_total{outcome="lost"}"#;
    if testkit::poll(Duration::from_secs(30), || async { if prometheus.query(lost).await.is_empty() { Err(()) } else { Ok(()) } }).await.is_err() {
        panic!("Prometheus never scraped {lost}: {:?}\n{}", prometheus.target_health().await, prometheus.log());
    }

    // An environment killed mid-job: the task fails in Gitea within 30 s, with the reason
    // as the last line of its log, after the rows the job had already written.
    let run = start_sleeper(&gitea, &repo).await;
    let containers = host().containers(&controller.environment_label());
    assert_eq!(containers.len(), 1, "{containers:?}");
    let killed_at = Instant::now();
    let output = host().docker(&["kill", &containers[0]]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(30), |t| finished(t, 1)).await;
    eprintln!("environment killed → task failed in Gitea after {:?}", killed_at.elapsed());
    assert_eq!(tasks[0].status, "failure");
    let log = strip_log_timestamps(&gitea.job_log(&repo, run, 0).await);
    let last = log.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_default();
    assert!(
        last.contains("gitea-dynamic-runner:") && last.contains("ended before the job finished") && last.contains("exited with code 137"),
        "last line: {last:?}\n{log}"
    );
    assert!(log.contains("started sleeping"), "the rows written before were lost:\n{log}");
    environments_gone(&controller).await;

    // Four jobs at capacity 2: three that succeed and one that fails, the rest waiting in
    // Gitea until a slot frees.
    let matrix = gitea.create_repo("observed-matrix").await;
    let failing = gitea.create_repo("observed-failing").await;
    gitea.commit_workflow(&matrix, "matrix.yml", MATRIX).await;
    gitea.commit_workflow(&failing, "failing.yml", FAILING).await;
    let tasks = gitea.wait_for_tasks(&matrix, Duration::from_secs(300), |t| finished(t, 3)).await;
    assert!(tasks.iter().all(|t| t.status == "success"), "{tasks:?}");
    let tasks = gitea.wait_for_tasks(&failing, Duration::from_secs(120), |t| finished(t, 1)).await;
    assert_eq!(status_of(&tasks, "broken"), "failure", "{tasks:?}");
    controller.wait_until_all_terminal(Duration::from_secs(30)).await;
    environments_gone(&controller).await;
    // Never more than two live at once: each was fetched while at most one other lived.
    let records = controller.records().await;
    assert_eq!(records.len(), 5, "{records:?}");
    for record in &records {
        let live = records
            .iter()
            .filter(|o| o.assignment_id != record.assignment_id && o.created_at_ms <= record.created_at_ms && o.updated_at_ms > record.created_at_ms)
            .count();
        assert!(live < 2, "{} was fetched while {live} others were live: beyond capacity 2", record.assignment_id);
    }

    // Prometheus has scraped the end: five jobs, one of them lost, their environments gone.
    let scraped = testkit::poll(Duration::from_secs(30), || async {
        let ended = prometheus.query("sum(gdr_environments_ended_total)").await;
        let in_use = prometheus.query("sum(gdr_pool_in_use)").await;
        let teardowns = prometheus.query("sum(gdr_job_phase_seconds_count{phase=\"teardown\"})").await;
        let value = |v: &[(serde_json::Map<String, serde_json::Value>, String)]| v.first().map(|(_, value)| value.clone()).unwrap_or_default();
        let seen = (value(&ended), value(&in_use), value(&teardowns));
        if seen == ("5".to_owned(), "0".to_owned(), "5".to_owned()) { Ok(seen) } else { Err(seen) }
    })
    .await;
    if let Err(seen) = scraped {
        panic!("Prometheus never saw 5 environments ended, 0 in use and 5 torn down: {seen:?}\n{:?}\n{}", prometheus.target_health().await, prometheus.log());
    }
    for (outcome, count) in [("lost", "1"), ("success", "3"), ("failure", "1"), ("refused", "0")] {
        let got = prometheus.query(&format!("sum(gdr_environments_ended_total{{outcome=\"{outcome}\"}})")).await;
        assert_eq!(got.first().map(|(_, v)| v.as_str()), Some(count), "environments ended as {outcome}");
    }

    // The backlog shows as the placement full: two of two slots in use at the peak.
    let peak = prometheus.query("max_over_time(sum(gdr_pool_in_use)[10m:1s]) / max(gdr_pool_capacity)").await;
    assert_eq!(peak.first().map(|(_, v)| v.as_str()), Some("1"), "the placement was never seen full: {peak:?}");

    // Every panel's query has data.
    eprintln!("dashboard panels:");
    let mut empty = Vec::new();
    for (title, expr) in dashboard_queries() {
        let series = prometheus.query(&expr).await;
        let values: Vec<String> = series
            .iter()
            .map(|(labels, value)| {
                let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default())).collect();
                format!("{{{}}} {value}", labels.join(","))
            })
            .collect();
        eprintln!("  {title}\n    {expr}\n    = {}", if values.is_empty() { "(no data)".to_owned() } else { values.join("; ") });
        if series.is_empty() {
            empty.push(title);
        }
    }
    assert!(empty.is_empty(), "panels without data: {empty:?}");

    // The lost environment's alert fires (it has no `for`: within a few evaluations); every
    // other alert is inactive once the jobs are done (GdrPlacementFull was pending while
    // the placement was full), and its expression is empty.
    let states = testkit::poll(Duration::from_secs(30), || async {
        let states = prometheus.alert_states().await;
        let settled = states.iter().all(|(name, (state, _))| state == if name == "GdrEnvironmentsFailing" { "firing" } else { "inactive" });
        if settled { Ok(states) } else { Err(states) }
    })
    .await
    .unwrap_or_else(|states| panic!("not GdrEnvironmentsFailing firing and every other alert inactive: {states:?}"));
    eprintln!("alerts:");
    for (name, (state, query)) in &states {
        let series = prometheus.query(query).await;
        eprintln!("  {name}: {state} ({} series now)", series.len());
        if name == "GdrEnvironmentsFailing" {
            let lost = series.iter().any(|(labels, _)| labels.get("outcome").and_then(|o| o.as_str()) == Some("lost"));
            assert!(lost, "the firing alert is not about the lost environment: {series:?}");
        } else {
            assert_eq!(state, "inactive", "{name} is {state} though nothing in the scenario implies it");
            assert!(series.is_empty(), "{name}'s expression holds: {series:?}");
        }
    }
    assert_eq!(states.len(), 8, "the rules file has eight alerts: {states:?}");
    controller.stop().await;
}
