//! The jobs' cache for real: the real Gitea (1.23 or 1.27), the runner image with the
//! supervisor as PID 1, the real gitea-runner, and the real `actions/cache@v4` (node20) and
//! `@v5` (node24) at their tags (`e2e::actions`), served by the test Gitea
//! (`DEFAULT_ACTIONS_URL = self`). gitea-runner registers each job with the supervisor's
//! cache proxy and rewrites the action's bundle; the image's Node.js 24 has the global Web
//! Crypto the v2 client's uploads need, so the proxy has gitea-runner advertise v2. A step
//! that empties `ACTIONS_CACHE_SERVICE_V2` makes its client speak v1, as an older client
//! does. Both reach the controller's cache over the facade's own connection.
//!
//! What GitHub promises, checked on Gitea's own records of each job: a save restores in
//! the next job of the repository; another repository with the same key misses; a pull
//! request's job restores the default branch's entry and its own save never reaches the
//! default branch; a restarted controller still has every committed entry. And from
//! inside a job, with all a step can read, the cache gives nothing it should not.

use std::time::Duration;

use e2e::{
    docker::host,
    stack::{Controller, Options},
};
use testkit::{
    gitea::{Gitea, Repo, TaskInfo, strip_log_timestamps},
    metric, wait_until,
};

/// Two cache steps (`shared`: @v4 on v1, `own`: @v5 on v2) and a probe (@v4, v1): what each
/// restores and whether the probe sees the pull request's save.
const WORKFLOW: &str = r#"name: cache
on:
  push:
    branches: [main]
  pull_request:
jobs:
  cache:
    runs-on: [disposable, container, docker]
    steps:
      - id: shared
        uses: actions/cache@v4
        env:
          ACTIONS_CACHE_SERVICE_V2: ""
        with:
          path: shared
          key: shared-v1
      - run: |
          echo "shared-hit=[${{ steps.shared.outputs.cache-hit }}]"
          if [ -f shared/content ]; then echo "shared-content=$(cat shared/content)"; else
            mkdir -p shared/deep && echo "written-by-${{ github.event_name }}" > shared/content
            head -c 3000000 /dev/urandom > shared/deep/blob
          fi
      - id: own
        uses: actions/cache@v5
        env:
          ACTIONS_CACHE_SERVICE_V2: "true"
        with:
          path: own
          key: own-${{ github.event_name }}
      - run: |
          echo "own-hit=[${{ steps.own.outputs.cache-hit }}]"
          mkdir -p own && echo "${{ github.event_name }}" > own/content
      - id: probe
        uses: actions/cache@v4
        env:
          ACTIONS_CACHE_SERVICE_V2: ""
        with:
          path: probe
          key: own-pull_request
          lookup-only: true
      - run: echo "probe-hit=[${{ steps.probe.outputs.cache-hit }}]"
"#;

/// The `key=[value]` lines a job printed, and its whole log.
async fn run_log(gitea: &Gitea, repo: &Repo, task: &TaskInfo) -> (std::collections::BTreeMap<String, String>, String) {
    let log = strip_log_timestamps(&gitea.job_log(repo, task.run_number, 0).await);
    let mut said = std::collections::BTreeMap::new();
    for line in log.lines() {
        for key in ["shared-hit", "shared-content", "own-hit", "probe-hit"] {
            if let Some(value) = line.trim().strip_prefix(&format!("{key}=")) {
                said.insert(key.to_owned(), value.trim_matches(|c| c == '[' || c == ']').to_owned());
            }
        }
    }
    (said, log)
}

/// Runs the next job of `repo` of `workflow` for `event` (started by `start`) to its end;
/// what it printed. (A push runs every workflow of the branch; Gitea 1.27 runs a new pull
/// request's workflows twice: the last one counts.)
async fn next_job(
    gitea: &Gitea,
    repo: &Repo,
    event: &str,
    start: impl std::future::Future<Output = ()>,
) -> (std::collections::BTreeMap<String, String>, String) {
    next_job_of(gitea, repo, "cache.yml", event, start).await
}

async fn next_job_of(
    gitea: &Gitea,
    repo: &Repo,
    workflow: &str,
    event: &str,
    start: impl std::future::Future<Output = ()>,
) -> (std::collections::BTreeMap<String, String>, String) {
    let ours = |t: &TaskInfo| t.event == event && t.workflow_id == workflow;
    let of_event = |tasks: &[TaskInfo]| tasks.iter().filter(|t| ours(t)).count();
    let before = of_event(&gitea.tasks(repo).await);
    start.await;
    let tasks = gitea.wait_for_tasks(repo, Duration::from_secs(300), |t| of_event(t) > before && t.iter().all(|t| !t.is_open())).await;
    let task = tasks.iter().rev().find(|t| ours(t)).unwrap().clone();
    let (said, log) = run_log(gitea, repo, &task).await;
    assert_eq!(task.status, "success", "{task:?}\n{log}");
    (said, log)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_cache_restores_across_jobs_scoped_as_github_and_survives_a_restart() {
    let turn = e2e::exclusive().await;
    let docker = host();
    let image = docker.image("gitea-runner");
    let gitea = e2e::actions::gitea_with_actions(docker.bridge_ip.into()).await;
    let token = gitea.runner_registration_token().await;
    let metrics_port = testkit::free_local_port();
    let dir = e2e::stack::state_dir();
    let options = || {
        let mut options = Options::new(&gitea.url(), &token, &image, &docker.socket);
        options.state_dir = Some(dir.path().to_owned());
        options.http_listen = format!("127.0.0.1:{metrics_port}");
        options.job_dockerd = false;
        options
    };
    let mut controller = Controller::start(options()).await;
    let repo = gitea.create_repo("cache-a").await;

    let mut table = vec![format!("{:<46} {:<12} {:<12} {:<12} {}", "job", "shared-hit", "own-hit", "probe-hit", "shared-content")];
    let mut row = |job: &str, said: &std::collections::BTreeMap<String, String>| {
        let get = |k: &str| said.get(k).cloned().unwrap_or_default();
        table.push(format!("{job:<46} {:<12} {:<12} {:<12} {}", get("shared-hit"), get("own-hit"), get("probe-hit"), get("shared-content")));
    };

    // 1. The first job of the default branch: nothing to restore; it saves both.
    let (first, log) = next_job(&gitea, &repo, "push", async {
        gitea.commit_workflow(&repo, "cache.yml", WORKFLOW).await;
    })
    .await;
    row("cache-a main, first", &first);
    assert_eq!((first["shared-hit"].as_str(), first["own-hit"].as_str()), ("", ""), "{log}");
    for needle in ["Cache not found for input keys: shared-v1", "Cache saved with key: shared-v1", "Cache saved with key: own-push"] {
        assert!(log.contains(needle), "{needle:?} missing:\n{log}");
    }

    // 2. The next job of the default branch restores both (exact hits: nothing saved).
    let (second, log) = next_job(&gitea, &repo, "push", async {
        gitea.commit_file(&repo, "main", "second", b"2").await;
    })
    .await;
    row("cache-a main, second", &second);
    assert_eq!((second["shared-hit"].as_str(), second["own-hit"].as_str()), ("true", "true"), "{log}");
    assert_eq!(second["shared-content"], "written-by-push");
    assert!(log.contains("Cache restored from key: shared-v1") && log.contains("not saving cache"), "{log}");

    // 3. Another repository with the same keys misses.
    let other = gitea.create_repo("cache-b").await;
    let (elsewhere, log) = next_job(&gitea, &other, "push", async {
        gitea.commit_workflow(&other, "cache.yml", WORKFLOW).await;
    })
    .await;
    row("cache-b main (another repository)", &elsewhere);
    assert_eq!((elsewhere["shared-hit"].as_str(), elsewhere["own-hit"].as_str()), ("", ""), "{log}");

    // 4. A pull request restores the default branch's entry; its own save stays its own.
    gitea.create_branch(&repo, "feature").await;
    let (pull, log) = next_job(&gitea, &repo, "pull_request", async {
        gitea.commit_file(&repo, "feature", "feature", b"f").await;
        gitea.open_pull_request(&repo, "feature").await;
    })
    .await;
    row("cache-a pull request", &pull);
    assert_eq!((pull["shared-hit"].as_str(), pull["shared-content"].as_str(), pull["own-hit"].as_str()), ("true", "written-by-push", ""), "{log}");
    // Saved in the pull request's own scope (by this job, or by the first of 1.27's two).
    assert!(log.contains("Cache saved with key: own-pull_request") || log.contains("Unable to reserve cache with key own-pull_request"), "{log}");
    let pull_scope = dir.path().join("cache/entries/gdr-admin%2Fcache-a/refs%2Fpull%2F1%2Fhead");
    assert!(pull_scope.is_dir(), "no entry in the pull request's scope {}", pull_scope.display());

    // 5. The controller restarts; the default branch still has its entries, and never
    //    sees the pull request's.
    controller.stop().await;
    // The embedded store's file is open until the first controller is gone.
    drop(controller);
    let mut controller = Controller::start(options()).await;
    let (after, log) = next_job(&gitea, &repo, "push", async {
        gitea.commit_file(&repo, "main", "third", b"3").await;
    })
    .await;
    row("cache-a main, after a controller restart", &after);
    assert_eq!((after["shared-hit"].as_str(), after["own-hit"].as_str(), after["probe-hit"].as_str()), ("true", "true", ""), "{log}");
    println!("{}", table.join("\n"));

    let (_, metrics) = testkit::http_get(&format!("http://127.0.0.1:{metrics_port}/metrics")).await;
    let (v1, v2) = (metric(&metrics, "gdr_cache_requests_total{api=\"v1\"}"), metric(&metrics, "gdr_cache_requests_total{api=\"v2\"}"));
    println!(
        "after the restart: requests v1 {v1}, v2 {v2}, hits {}, misses {}",
        metric(&metrics, "gdr_cache_hits_total"),
        metric(&metrics, "gdr_cache_misses_total")
    );
    assert!(v1 > 0 && v2 > 0, "both APIs were used after the restart: v1 {v1}, v2 {v2}\n{metrics}");
    let label = controller.environment_label();
    wait_until("every environment is removed", Duration::from_secs(60), || host().containers(&label).is_empty()).await;
    controller.assert_running();
    controller.stop().await;
    drop(turn);
}

/// A step of a job with everything it can read — the runner's configuration, the
/// registration secret in its home, its runtime token — attacking the cache. Each line
/// `attack <name>: <status>`; every status must be a refusal.
const ATTACK: &str = r#"name: attack
on: push
jobs:
  attack:
    runs-on: [disposable, container, docker]
    steps:
      - run: |
          url="${ACTIONS_CACHE_URL%/}"
          version=$(printf 'shared|%s|1.0' "$(command -v zstd >/dev/null && echo zstd-without-long || echo gzip)" | sha256sum | cut -d' ' -f1)
          code() { curl -s -o /dev/null -w '%{http_code}' "$@"; }
          # A credential registered for another repository with the environment's own secret.
          curl -s -X POST "$url/_internal/register" -H "Authorization: Bearer $(cat "$HOME/.cache-secret")" \
            -d '{"token":"forged-token","repo":"gdr-admin/cache-a","results":"","public_url":""}'; echo
          echo "attack register-and-use-a-forged-credential: $(code -H 'Authorization: Bearer forged-token' "$url/_apis/artifactcache/cache?keys=shared-v1&version=$version")"
          echo "attack read-without-the-job-token: $(code "$url/_apis/artifactcache/cache?keys=shared-v1&version=$version")"
          echo "attack read-another-repositorys-entry-by-key: $(code -H "Authorization: Bearer $ACTIONS_RUNTIME_TOKEN" "$url/_apis/artifactcache/cache?keys=shared-v1&version=$version")"
          echo "attack read-another-repositorys-archive-by-id: $(code "$url/_apis/artifactcache/artifacts/TARGET_ID")"
          echo "attack upload-into-another-repositorys-archive: $(code -X PATCH -H "Authorization: Bearer $ACTIONS_RUNTIME_TOKEN" -H 'Content-Range: bytes 0-3/*' --data-binary evil "$url/_apis/artifactcache/caches/TARGET_ID")"
"#;

/// In the repository's own default branch: a committed entry cannot be written again,
/// by either API.
const OVERWRITE: &str = r#"name: overwrite
on: push
jobs:
  overwrite:
    runs-on: [disposable, container, docker]
    steps:
      - run: |
          url="${ACTIONS_CACHE_URL%/}"
          version=$(printf 'shared|%s|1.0' "$(command -v zstd >/dev/null && echo zstd-without-long || echo gzip)" | sha256sum | cut -d' ' -f1)
          auth="Authorization: Bearer $ACTIONS_RUNTIME_TOKEN"
          echo "attack overwrite-a-committed-entry-v1: $(curl -s -o /dev/null -w '%{http_code}' -X POST -H "$auth" -H 'Content-Type: application/json' \
            -d "{\"key\":\"shared-v1\",\"version\":\"$version\",\"cacheSize\":4}" "$url/_apis/artifactcache/caches")"
          echo "attack overwrite-a-committed-entry-v2: $(curl -s -X POST -H "$auth" -H 'Content-Type: application/json' \
            -d "{\"key\":\"shared-v1\",\"version\":\"$version\"}" "$url/twirp/github.actions.results.api.v1.CacheService/CreateCacheEntry" | tr -d ' \n')"
"#;

/// What each attack line says, and whether that is a refusal.
fn verdicts(log: &str) -> Vec<(String, String, bool)> {
    log.lines()
        .filter_map(|line| line.trim().strip_prefix("attack "))
        .filter_map(|rest| rest.split_once(": "))
        .map(|(name, answer)| {
            let refused = matches!(answer, "401" | "403" | "404" | "409" | "204") || answer == r#"{"ok":false}"#;
            (name.to_owned(), answer.to_owned(), refused)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cannot_forge_a_credential_read_another_repository_or_overwrite_an_entry() {
    let turn = e2e::exclusive().await;
    let docker = host();
    let image = docker.image("gitea-runner");
    let gitea = e2e::actions::gitea_with_actions(docker.bridge_ip.into()).await;
    let token = gitea.runner_registration_token().await;
    let mut options = Options::new(&gitea.url(), &token, &image, &docker.socket);
    options.job_dockerd = false;
    let mut controller = Controller::start(options).await;
    let victim = gitea.create_repo("cache-a").await;
    next_job(&gitea, &victim, "push", async {
        gitea.commit_workflow(&victim, "cache.yml", WORKFLOW).await;
    })
    .await;
    // The id of the victim's archive, which the attacker is given (it could not learn it).
    let entries = controller.state_dir.join("cache/blobs").join("gdr-admin%2Fcache-a");
    let target = std::fs::read_dir(&entries).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).next().unwrap();

    let attacker = gitea.create_repo("attacker").await;
    let (_, log) = next_job_of(&gitea, &attacker, "attack.yml", "push", async {
        gitea.commit_workflow(&attacker, "attack.yml", &ATTACK.replace("TARGET_ID", &target)).await;
    })
    .await;
    let mut all = verdicts(&log);
    let (_, log_overwrite) = next_job_of(&gitea, &victim, "overwrite.yml", "push", async {
        gitea.commit_workflow(&victim, "overwrite.yml", OVERWRITE).await;
    })
    .await;
    all.extend(verdicts(&log_overwrite));
    let table: Vec<String> =
        all.iter().map(|(name, answer, refused)| format!("{name:<50} {answer:<14} {}", if *refused { "refused" } else { "ALLOWED" })).collect();
    println!("{:<50} {:<14} verdict\n{}", "attack from inside a job", "answer", table.join("\n"));
    assert_eq!(all.len(), 7, "every attack reported:\n{log}\n{log_overwrite}");
    assert!(all.iter().all(|(_, _, refused)| *refused), "an attack was not refused:\n{}\n{log}\n{log_overwrite}", table.join("\n"));
    // The victim's entry is what its job saved (a push runs both of its workflows).
    let (after, log) = next_job(&gitea, &victim, "push", async {
        gitea.commit_file(&victim, "main", "again", b"again").await;
    })
    .await;
    assert_eq!(after.get("shared-content").map(String::as_str), Some("written-by-push"), "{log}");
    controller.stop().await;
    drop(turn);
}

/// The Pod placement in the test cluster: the cache rides on the facade's TCP
/// connection of each Pod; a second job restores what the first saved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_cache_restores_across_jobs_in_pods() {
    use e2e::kubernetes::{Cluster, cluster};
    let turn = e2e::exclusive().await;
    let cluster = tokio::task::block_in_place(cluster);
    let image = tokio::task::block_in_place(|| cluster.image("gitea-runner"));
    let namespace = tokio::task::block_in_place(|| cluster.namespace("gdr-e2e-cache"));
    let gitea = e2e::actions::gitea_with_actions(Cluster::HOST_IP.into()).await;
    let token = gitea.runner_registration_token().await;
    let mut options = Options::new(&gitea.url(), &token, &image, std::path::Path::new("/nonexistent"));
    options.kubernetes = Some(e2e::stack::PodOptions::on(cluster, &namespace));
    options.job_dockerd = false;
    let mut controller = Controller::start(options).await;
    let repo = gitea.create_repo("cache-pods").await;
    let workflow = WORKFLOW.replace("[disposable, container, docker]", "[disposable, container, kubernetes]");
    let (first, log) = next_job(&gitea, &repo, "push", async {
        gitea.commit_workflow(&repo, "cache.yml", &workflow).await;
    })
    .await;
    assert_eq!(first["shared-hit"], "", "{log}");
    assert!(log.contains("Cache saved with key: shared-v1") && log.contains("Cache saved with key: own-push"), "{log}");
    let (second, log) = next_job(&gitea, &repo, "push", async {
        gitea.commit_file(&repo, "main", "second", b"2").await;
    })
    .await;
    println!("pods: first {first:?}\npods: second {second:?}");
    assert_eq!((second["shared-hit"].as_str(), second["own-hit"].as_str(), second["shared-content"].as_str()), ("true", "true", "written-by-push"), "{log}");
    let label = controller.environment_label();
    wait_until("every Pod is deleted", Duration::from_secs(90), || cluster.pods(&namespace, &label).is_empty()).await;
    controller.stop().await;
    tokio::task::block_in_place(|| cluster.kubectl_ok(&["delete", "namespace", &namespace, "--wait=false"]));
    drop(turn);
}
