//! A REAL Prometheus (v0.316.0, from the Go module proxy by scripts/install test-peers)
//! scraping one target every second and evaluating a rules file every second, with its
//! HTTP API to query: what an operator's Prometheus would see, sooner.

use std::{process::Stdio, time::Duration};

use serde_json::Value;

#[derive(Debug)]
pub struct Prometheus {
    _process: crate::KillOnDrop,
    dir: tempfile::TempDir,
    url: String,
}

impl Prometheus {
    /// Starts Prometheus scraping `target` (`host:port`, its `/metrics`) as job `job`, with
    /// the alert rules of `rules`; waits (up to 30 s) until it is ready.
    pub async fn start(job: &str, target: &str, rules: &std::path::Path) -> Prometheus {
        let binary = crate::peer("prometheus");
        let dir = tempfile::Builder::new().prefix("gdr-test-prometheus-").tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {rules}\nscrape_configs:\n  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n",
                rules = rules.display()
            ),
        )
        .unwrap();
        let port = crate::free_local_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let child = std::process::Command::new(&binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("{} cannot start: {e}: run scripts/install test-peers", binary.display()));
        let prometheus = Prometheus { _process: crate::KillOnDrop(child), dir, url: format!("http://127.0.0.1:{port}") };
        let ready = format!("{}/-/ready", prometheus.url);
        crate::wait_until_async("Prometheus is ready", Duration::from_secs(30), || {
            let ready = ready.clone();
            async move { crate::gitea::http_client().get(&ready).send().await.is_ok_and(|r| r.status().is_success()) }
        })
        .await;
        prometheus
    }

    /// The instant vector `expr` evaluates to now: (labels, value) per series. Panics with
    /// Prometheus's error when the query is refused.
    pub async fn query(&self, expr: &str) -> Vec<(serde_json::Map<String, Value>, String)> {
        let body = self.api("/api/v1/query", &[("query", expr)]).await;
        let Some(series) = body["data"]["result"].as_array() else { panic!("{expr}: no vector in {body}") };
        series.iter().map(|s| (s["metric"].as_object().cloned().unwrap_or_default(), s["value"][1].as_str().unwrap_or_default().to_owned())).collect()
    }

    /// Every alert's rule: name → (state: `inactive`, `pending` or `firing`; its query).
    pub async fn alert_states(&self) -> std::collections::BTreeMap<String, (String, String)> {
        let body = self.api("/api/v1/rules", &[("type", "alert")]).await;
        let groups = body["data"]["groups"].as_array().cloned().unwrap_or_default();
        let text = |value: &Value| value.as_str().unwrap_or_default().to_owned();
        groups
            .iter()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .map(|r| (text(&r["name"]), (text(&r["state"]), text(&r["query"]))))
            .collect()
    }

    /// The health of the scrape of `job`'s target (`up`, `down`, `unknown`) and its last error.
    pub async fn target_health(&self) -> Vec<(String, String)> {
        let body = self.api("/api/v1/targets", &[]).await;
        let targets = body["data"]["activeTargets"].as_array().cloned().unwrap_or_default();
        targets.iter().map(|t| (t["health"].as_str().unwrap_or_default().to_owned(), t["lastError"].as_str().unwrap_or_default().to_owned())).collect()
    }

    async fn api(&self, path: &str, query: &[(&str, &str)]) -> Value {
        let url = reqwest::Url::parse_with_params(&format!("{}{path}", self.url), query).unwrap();
        let response = crate::gitea::http_client().get(url).send().await.unwrap_or_else(|e| panic!("Prometheus {path}: {e}"));
        let body: Value = response.json().await.unwrap_or_else(|e| panic!("Prometheus {path}: not JSON: {e}"));
        assert_eq!(body["status"], "success", "Prometheus {path} {query:?}: {body}");
        body
    }

    /// What it logged (its last lines).
    pub fn log(&self) -> String {
        crate::log_tail(&self.dir.path().join("prometheus.log"), 60).unwrap_or_default()
    }
}
