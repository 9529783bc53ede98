//! A REAL Gitea server for end-to-end tests: one per fixture, in its own temp dir, on a
//! free port, with an admin user, an API token and Actions enabled. Two releases are
//! served ([`GiteaVersion`]): 1.23.8 by default, 1.27.3 with `GDR_GITEA=1.27` (how
//! `scripts/test` runs the real-Gitea tests a second time); where their routes differ
//! the fixture speaks each one's (see "Gitea 1.27.3" below), so tests read the same.
//!
//! The binary is built from unmodified upstream sources by `scripts/install test-peers` (the pinned test-peer builder)
//! (called by `scripts/install test-peers`): `$GITEA_BIN`, else `$PEERS_CACHE/bin/gitea`
//! (`PEERS_CACHE` defaults to `~/.cache/gitea-dynamic-runner/peers`). It has no embedded
//! assets, so `[server] STATIC_ROOT_PATH` points at (a symlinked view of) the unpacked
//! source tree `$PEERS_CACHE/build/gitea-v1.23.8` (override: `$GITEA_STATIC_ROOT`). A
//! missing binary or tree is a panic that says how to install it: these tests never skip.
//!
//! How each Gitea 1.23.8 route is reached (read from its sources and verified here):
//! - `/api/v1/...`: the API token (`Authorization: token …`). Basic auth works there too
//!   (used once, to create the token).
//! - Web routes under `/{owner}/{repo}/actions/...` do NOT accept basic auth: Gitea's
//!   `auth.Basic` only fires on `/api/`, `/v2/`, `/attachments/` and git/raw/LFS paths
//!   (services/auth/auth.go), so an `Authorization: Basic` header there is silently
//!   ignored and the request is anonymous (which is enough to read a PUBLIC repo's logs,
//!   never to cancel). The fixture therefore signs in like a browser: `POST /user/login`
//!   (form `user_name`, `password`; no CSRF token needed, the route is "sign-out
//!   required") answers 303 with the session cookie `i_like_gitea` and a `_csrf` cookie
//!   minted for that user. Every web POST (cancel, the run view) then carries the session
//!   cookie plus the `_csrf` value in the `X-Csrf-Token` header (services/context/csrf.go;
//!   a POST without it gets 400 "Invalid CSRF token.").
//! - Job logs: `GET /{o}/{r}/actions/runs/{run}/jobs/{job-index}/logs` (session cookie)
//!   serves the stored log file as is: one line per log row, each prefixed by an RFC 3339
//!   UTC timestamp with 7 fractional digits and a space
//!   (`2025-01-01T12:00:00.1234567Z hello`); see [`strip_log_timestamps`].
//! - Cancel: `POST /{o}/{r}/actions/runs/{run}/cancel` (session + CSRF) answers `{}`; it
//!   marks not-yet-picked jobs cancelled and stops picked ones (`StopTask`): the task is
//!   `cancelled` in Gitea at once, and the runner learns it from its next UpdateTask
//!   reply (gitea-runner reports state every 5 s by default).
//! - A run's jobs before any runner picked them: there is no runs API in 1.23 (only
//!   `GET /api/v1/repos/{o}/{r}/actions/tasks`, one entry per job a runner has picked),
//!   so [`Gitea::run`] asks the web UI's own JSON endpoint
//!   `POST /{o}/{r}/actions/runs/{run}/jobs/0` (session + CSRF).
//! - There is no API to list runners in 1.23 (`/admin/runners` only has
//!   `registration-token`), so there is no `runners()`.
//!
//! Gitea 1.27.3 (read in its `routers/web/web.go` and `routers/api/v1/api.go`, verified
//! here by the same tests):
//! - Web routes of a run take the run's and the job's *ids*, not the run number and job
//!   index: the fixture finds the run's id in `GET /api/v1/repos/{o}/{r}/actions/runs`
//!   (`workflow_runs[].id` by `run_number`) and a job's id in the run view.
//! - The run view is `POST /{o}/{r}/actions/runs/{run_id}` (`…/jobs/0` is a 404), logs
//!   `GET /{o}/{r}/actions/runs/{run_id}/jobs/{job_id}/logs`, cancel
//!   `POST /{o}/{r}/actions/runs/{run_id}/cancel`.
//! - There is no CSRF token: Go's cross-origin protection passes requests without
//!   `Origin`/`Sec-Fetch-Site`, and sign-in mints no `_csrf` cookie.
//! - A cancelled task whose runner declared `cancelling` is `cancelling` until the
//!   runner reports its end (then `cancelled`).

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    io::Read as _,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use base64::Engine as _;
use serde::Deserialize;

/// The admin user every fixture creates.
pub const ADMIN_USER: &str = "gdr-admin";
/// The Gitea releases the fixture runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GiteaVersion {
    /// 1.23.8 (May 2025): the default.
    V1_23,
    /// 1.27.3: `GDR_GITEA=1.27`.
    V1_27,
}

impl GiteaVersion {
    /// `GDR_GITEA`: unset or `1.23` → 1.23.8, `1.27` → 1.27.3; anything else panics
    /// (a typo must not run the suite against the wrong server).
    pub fn from_env() -> GiteaVersion {
        match std::env::var("GDR_GITEA").as_deref() {
            Err(_) | Ok("" | "1.23" | "1.23.8") => GiteaVersion::V1_23,
            Ok("1.27" | "1.27.3") => GiteaVersion::V1_27,
            Ok(other) => panic!("GDR_GITEA={other:?}: the fixture runs Gitea 1.23 (default) or 1.27"),
        }
    }

    /// What `GET /api/v1/version` answers.
    pub fn release(self) -> &'static str {
        match self {
            GiteaVersion::V1_23 => "1.23.8",
            GiteaVersion::V1_27 => "1.27.3",
        }
    }

    /// Whether web routes of a run take ids (1.27) or the run number and job index (1.23).
    pub fn routes_by_id(self) -> bool {
        self == GiteaVersion::V1_27
    }

    /// The binary: `$GITEA_BIN` / `$PEERS_CACHE/bin/gitea` for 1.23,
    /// `$GITEA_127_BIN` / `$PEERS_CACHE/bin/gitea-1.27` for 1.27. Panics when missing.
    pub fn binary(self) -> PathBuf {
        match self {
            GiteaVersion::V1_23 => peer_binary("GITEA_BIN", "gitea"),
            GiteaVersion::V1_27 => peer_binary("GITEA_127_BIN", "gitea-1.27"),
        }
    }
}

/// The release of `GDR_GITEA`, as `GET /api/v1/version` answers it.
pub fn gitea_version() -> &'static str {
    GiteaVersion::from_env().release()
}

/// `$PEERS_CACHE`, default `~/.cache/gitea-dynamic-runner/peers`.
pub use crate::peers_cache;

fn peer_binary(env: &str, name: &str) -> PathBuf {
    let path = std::env::var_os(env).map_or_else(|| peers_cache().join("bin").join(name), PathBuf::from);
    assert!(
        path.is_file(),
        "{name} test peer not found at {}: run scripts/install test-peers (it builds the real {name} from \
         source into $PEERS_CACHE/bin via scripts/install test-peers), or set {env}",
        path.display()
    );
    path
}

/// The Gitea binary of `GDR_GITEA` (see [`GiteaVersion::binary`]).
pub fn gitea_bin() -> PathBuf {
    GiteaVersion::from_env().binary()
}

/// The real runner: `$GITEA_RUNNER_BIN`, else `$PEERS_CACHE/bin/gitea-runner`. Panics when missing.
pub fn gitea_runner_bin() -> PathBuf {
    peer_binary("GITEA_RUNNER_BIN", "gitea-runner")
}

/// Gitea's unpacked source tree (templates, locales): `$GITEA_STATIC_ROOT`, else
/// `$PEERS_CACHE/build/gitea-v<release>`. Panics when missing.
pub fn gitea_static_root() -> PathBuf {
    let path = std::env::var_os("GITEA_STATIC_ROOT")
        .map_or_else(|| peers_cache().join("build").join(format!("gitea-v{}", GiteaVersion::from_env().release())), PathBuf::from);
    assert!(
        path.join("options/locale").is_dir() && path.join("templates").is_dir(),
        "Gitea's source tree (templates, locales) not found at {}: run scripts/install test-peers \
         (which unpacks it there), or set GITEA_STATIC_ROOT",
        path.display()
    );
    path
}

/// Options for [`Gitea::start`].
#[derive(Debug, Clone)]
pub struct GiteaOptions {
    /// Address the server listens on; also the host of `ROOT_URL`. Default 127.0.0.1.
    pub bind: IpAddr,
    /// Extra `[actions]` keys, e.g. `("ZOMBIE_TASK_TIMEOUT", "10s")`.
    pub actions_settings: Vec<(String, String)>,
    /// Appended verbatim to app.ini, for other sections, e.g.
    /// `"[cron.stop_zombie_tasks]\nSCHEDULE = @every 5s\n"` (the zombie/endless/abandoned
    /// sweeps are cron tasks: `[actions]` only holds their timeouts).
    pub extra_ini: String,
    /// Which release; default [`GiteaVersion::from_env`].
    pub version: GiteaVersion,
}

impl Default for GiteaOptions {
    fn default() -> Self {
        GiteaOptions { bind: IpAddr::V4(Ipv4Addr::LOCALHOST), actions_settings: Vec::new(), extra_ini: String::new(), version: GiteaVersion::from_env() }
    }
}

/// A repository owned by the admin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Repo {
    pub owner: String,
    pub name: String,
}

impl Repo {
    /// `owner/name`
    pub fn full_name(&self) -> String {
        format!("{}/{}", self.owner, self.name)
    }
}

/// One entry of `GET /api/v1/repos/{o}/{r}/actions/tasks` (Gitea 1.23 `api.ActionTask`).
/// A task exists only once a runner has picked the job. `status` is one of `waiting`,
/// `running`, `success`, `failure`, `cancelled`, `skipped`, `blocked`, `unknown`.
/// Timestamps are RFC 3339 in the server's local zone; `run_started_at` is
/// `1970-01-01T…` until set.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct TaskInfo {
    pub id: i64,
    /// The job's name (the `name:` of the job, else its key).
    pub name: String,
    pub status: String,
    /// The run's index in the repository (1, 2, …), as in the web URLs.
    pub run_number: i64,
    /// The workflow file name, e.g. `ci.yml`.
    pub workflow_id: String,
    /// The branch name (`main`), not `refs/heads/main`.
    pub head_branch: String,
    pub head_sha: String,
    /// `push`, `pull_request`, …
    pub event: String,
    /// The run's title (the commit message's first line for a push).
    pub display_title: String,
    /// `<ROOT_URL>/{o}/{r}/actions/runs/{run_number}`
    pub url: String,
    pub created_at: String,
    pub updated_at: String,
    pub run_started_at: String,
}

impl TaskInfo {
    /// Not finished yet: waiting, blocked, running — or, on Gitea ≥ 1.27, cancelling (a
    /// cancelled task whose runner has not reported its end yet).
    pub fn is_open(&self) -> bool {
        matches!(self.status.as_str(), "waiting" | "running" | "blocked" | "cancelling")
    }
}

#[derive(Debug, Deserialize)]
struct TaskPage {
    // Gitea 1.23 names the list `workflow_runs` although the entries are tasks.
    #[serde(default)]
    workflow_runs: Option<Vec<TaskInfo>>,
    total_count: i64,
}

/// A run as the web UI sees it (`POST /{o}/{r}/actions/runs/{run}/jobs/0`): it exists as
/// soon as the push is processed, before any runner picks its jobs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunView {
    pub title: String,
    /// `waiting`, `running`, `success`, `failure`, `cancelled`, `skipped`, `blocked`
    pub status: String,
    pub done: bool,
    pub can_cancel: bool,
    pub workflow_id: String,
    /// In job-index order (the `{job-index}` of the logs route).
    pub jobs: Vec<RunJob>,
    /// The step summaries the run shows, rendered (`jobSummaries[].summaryHTML`, Gitea ≥
    /// 1.27; always empty on 1.23, which has none).
    pub summaries: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunJob {
    pub id: i64,
    pub name: String,
    pub status: String,
}

/// A logged-in browser session: cookies by name (`i_like_gitea`, `_csrf`, …).
#[derive(Debug, Default)]
struct WebSession {
    cookies: BTreeMap<String, String>,
}

impl WebSession {
    fn absorb(&mut self, headers: &reqwest::header::HeaderMap) {
        for value in headers.get_all(reqwest::header::SET_COOKIE) {
            let Ok(value) = value.to_str() else { continue };
            let pair = value.split(';').next().unwrap_or_default();
            let Some((name, val)) = pair.split_once('=') else {
                continue;
            };
            let expired = value.split(';').any(|attr| {
                let attr = attr.trim().to_ascii_lowercase();
                attr == "max-age=0" || attr.starts_with("max-age=-")
            });
            if expired || val.is_empty() {
                self.cookies.remove(name.trim());
            } else {
                self.cookies.insert(name.trim().to_owned(), val.trim().to_owned());
            }
        }
    }

    fn cookie_header(&self) -> String {
        self.cookies.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("; ")
    }

    fn csrf(&self) -> String {
        self.cookies.get("_csrf").cloned().unwrap_or_default()
    }
}

/// A running Gitea. Dropping it stops the server (SIGTERM, SIGKILL after 5 s) and removes
/// its directory; when the thread is panicking, the tail of Gitea's log goes to stderr.
pub struct Gitea {
    child: Option<Child>,
    addr: SocketAddr,
    url: String,
    password: String,
    token: String,
    http: reqwest::Client,
    web: tokio::sync::Mutex<Option<WebSession>>,
    bin: PathBuf,
    version: GiteaVersion,
    // Last: removed only after the process is gone.
    dir: tempfile::TempDir,
}

impl std::fmt::Debug for Gitea {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gitea").field("url", &self.url).field("pid", &self.pid()).field("dir", &self.dir.path()).finish_non_exhaustive()
    }
}

fn random_bytes(n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut buf)).expect("read /dev/urandom");
    buf
}

fn random_hex(n: usize) -> String {
    random_bytes(n).iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// `application/x-www-form-urlencoded` / query component encoding.
fn form_encode(pairs: &[(&str, &str)]) -> String {
    fn enc(s: &str) -> String {
        let mut out = String::new();
        for b in s.bytes() {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
                out.push(char::from(b));
            } else {
                let _ = write!(out, "%{b:02X}");
            }
        }
        out
    }
    pairs.iter().map(|(k, v)| format!("{}={}", enc(k), enc(v))).collect::<Vec<_>>().join("&")
}

/// Drops the leading timestamp Gitea stores on every log line (`<RFC 3339> <message>`).
pub fn strip_log_timestamps(log: &str) -> String {
    log.lines()
        .map(|line| match line.split_once(' ') {
            Some((ts, rest)) if ts.len() >= 20 && ts.as_bytes()[4] == b'-' && ts.contains('T') => rest,
            _ => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

pub(crate) fn http_client() -> reqwest::Client {
    // reqwest is built with `rustls-no-provider`: it needs a process-wide provider even
    // for plain-http clients (the builder sets up TLS eagerly). Another test may have
    // installed one already; either is fine.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).timeout(Duration::from_secs(60)).no_proxy().build().expect("build the HTTP client")
}

impl Gitea {
    /// Starts a fresh Gitea: free port on `options.bind`, temp dir, app.ini, `migrate`,
    /// admin `gdr-admin`, `web`, waits for `GET /api/v1/version`, creates an API token
    /// with scope `all`.
    pub async fn start(options: GiteaOptions) -> Gitea {
        let started = Instant::now();
        let bin = options.version.binary();
        let static_root = std::env::var_os("GITEA_STATIC_ROOT")
            .filter(|_| options.version == GiteaVersion::from_env())
            .map_or_else(|| peers_cache().join("build").join(format!("gitea-v{}", options.version.release())), PathBuf::from);
        assert!(
            static_root.join("options/locale").is_dir() && static_root.join("templates").is_dir(),
            "Gitea's source tree (templates, locales) not found at {}: run scripts/install test-peers (which unpacks it there), or set \
             GITEA_STATIC_ROOT",
            static_root.display()
        );
        let dir = tempfile::Builder::new().prefix("gitea-fixture-").tempdir().expect("create Gitea's temp dir");
        let password = format!("pw-{}", random_hex(12));
        let root = dir.path();
        for sub in ["data", "repos", "log", "custom", "home"] {
            std::fs::create_dir_all(root.join(sub)).expect("create Gitea's directories");
        }
        let static_view = root.join("static");
        trimmed_static_root(&static_root, &static_view);
        // The port only matters to `web`: app.ini is rewritten when a port has to be re-picked.
        let write_ini = |port: u16| {
            let addr = SocketAddr::new(options.bind, port);
            let url = format!("http://{addr}");
            let ini = app_ini(root, &static_view, &options, &url, port);
            std::fs::write(root.join("app.ini"), ini).expect("write app.ini");
            (addr, url)
        };
        let (mut addr, mut url) = write_ini(crate::free_port(options.bind));

        let gitea = |args: &[&str]| {
            let mut cmd = tokio::process::Command::new(&bin);
            cmd.arg("-c").arg(root.join("app.ini")).args(args);
            gitea_env(&mut cmd, root);
            cmd
        };
        run_cli(gitea(&["migrate"]), "gitea migrate", root).await;
        let migrated = started.elapsed();
        run_cli(
            gitea(&[
                "admin",
                "user",
                "create",
                "--admin",
                "--username",
                ADMIN_USER,
                "--password",
                &password,
                "--email",
                "gdr-admin@example.invalid",
                "--must-change-password=false",
            ]),
            "gitea admin user create",
            root,
        )
        .await;
        let admin_created = started.elapsed();

        let http = http_client();
        let mut attempt = 1;
        let child = loop {
            let mut child = spawn_web(&bin, root);
            match wait_until_up(&http, &url, options.version, &mut child, root, Duration::from_secs(60)).await {
                Ok(()) => break child,
                // The port was free when picked, but something else took it before Gitea
                // bound it: pick another.
                Err(log) if attempt < 3 && log.contains("bind: address already in use") => {
                    attempt += 1;
                    let _ = std::fs::remove_file(root.join("log/gitea.log"));
                    (addr, url) = write_ini(crate::free_port(options.bind));
                }
                Err(log) => panic!("gitea web exited during start-up\n{log}"),
            }
        };

        let mut gitea = Gitea {
            child: Some(child),
            addr,
            url,
            password,
            token: String::new(),
            http,
            web: tokio::sync::Mutex::new(None),
            bin,
            version: options.version,
            dir,
        };
        gitea.token = gitea.create_token().await;
        eprintln!(
            "gitea fixture: {} up in {:.1?} (migrate {:.1?}, admin {:.1?}, web {:.1?}; dir {})",
            gitea.url,
            started.elapsed(),
            migrated,
            admin_created - migrated,
            started.elapsed() - admin_created,
            gitea.dir.path().display()
        );
        gitea
    }

    async fn create_token(&self) -> String {
        let resp = self
            .http
            .post(format!("{}/api/v1/users/{ADMIN_USER}/tokens", self.url))
            .basic_auth(ADMIN_USER, Some(&self.password))
            .json(&serde_json::json!({ "name": "fixture", "scopes": ["all"] }))
            .send()
            .await
            .expect("POST /api/v1/users/{user}/tokens");
        let body = self.expect_status(resp, &[201], "create the API token").await;
        body["sha1"].as_str().filter(|t| !t.is_empty()).expect("token in the reply").to_owned()
    }

    /// `http://<bind>:<port>`, no trailing slash (also `ROOT_URL`, with one).
    pub fn url(&self) -> String {
        self.url.clone()
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The admin's user name and password.
    pub fn admin(&self) -> (&str, &str) {
        (ADMIN_USER, &self.password)
    }

    /// The admin's API token (scope `all`).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The server's PID while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The fixture's directory (app.ini, data/, repos/, log/).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn api(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http.request(method, format!("{}/api/v1{path}", self.url)).header("Authorization", format!("token {}", self.token))
    }

    /// Checks the status and returns the JSON body (Null when empty); panics with the body
    /// and the log tail otherwise.
    async fn expect_status(&self, resp: reqwest::Response, ok: &[u16], what: &str) -> serde_json::Value {
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap_or_default();
        assert!(ok.contains(&status), "{what}: HTTP {status}: {text}\n--- gitea log ---\n{}", self.log_tail(40));
        if text.trim().is_empty() { serde_json::Value::Null } else { serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)) }
    }

    /// Creates a public repository owned by the admin: `auto_init`, default branch `main`,
    /// Actions enabled (asserted).
    pub async fn create_repo(&self, name: &str) -> Repo {
        let resp = self
            .api(reqwest::Method::POST, "/user/repos")
            .json(&serde_json::json!({
                "name": name, "auto_init": true, "default_branch": "main", "private": false, "readme": "Default",
            }))
            .send()
            .await
            .expect("POST /api/v1/user/repos");
        let body = self.expect_status(resp, &[201], "create the repository").await;
        assert_eq!(body["has_actions"], true, "repository {name} has Actions disabled: {body}");
        assert_eq!(body["default_branch"], "main", "repository {name}: {body}");
        Repo { owner: body["owner"]["login"].as_str().expect("owner.login").to_owned(), name: body["name"].as_str().expect("name").to_owned() }
    }

    /// A public repository of the organisation `owner` (made if missing), as
    /// [`Gitea::create_repo`] makes one: e.g. `actions/cache`, for `uses:` to find it where
    /// `DEFAULT_ACTIONS_URL = self`.
    pub async fn create_org_repo(&self, owner: &str, name: &str) -> Repo {
        let resp = self
            .api(reqwest::Method::POST, "/orgs")
            .json(&serde_json::json!({ "username": owner, "visibility": "public" }))
            .send()
            .await
            .expect("POST /api/v1/orgs");
        self.expect_status(resp, &[201, 422], "create the organisation").await;
        let resp = self
            .api(reqwest::Method::POST, &format!("/orgs/{owner}/repos"))
            .json(&serde_json::json!({ "name": name, "auto_init": true, "default_branch": "main", "private": false, "readme": "Default" }))
            .send()
            .await
            .expect("POST /api/v1/orgs/{owner}/repos");
        let body = self.expect_status(resp, &[201], "create the organisation's repository").await;
        Repo { owner: owner.to_owned(), name: body["name"].as_str().expect("name").to_owned() }
    }

    /// Creates or updates `path` on `branch` through the contents API; returns the commit.
    /// A commit is a push: every `on: push` workflow of the branch starts.
    pub async fn commit_file(&self, repo: &Repo, branch: &str, path: &str, content: &[u8]) -> String {
        let api_path = format!("/repos/{}/{}/contents/{path}", repo.owner, repo.name);
        let existing = self.api(reqwest::Method::GET, &format!("{api_path}?ref={branch}")).send().await.expect("GET contents");
        let existing = self.expect_status(existing, &[200, 404], "look up the file").await;
        let mut body = serde_json::json!({
            "content": base64::engine::general_purpose::STANDARD.encode(content),
            "message": format!("{path}"),
            "branch": branch,
        });
        let (method, ok) = match existing.get("sha").and_then(|s| s.as_str()) {
            Some(sha) => {
                body["sha"] = sha.into();
                (reqwest::Method::PUT, 200)
            }
            None => (reqwest::Method::POST, 201),
        };
        let resp = self.api(method, &api_path).json(&body).send().await.expect("commit the file");
        let reply = self.expect_status(resp, &[ok], "commit the file").await;
        reply["commit"]["sha"].as_str().expect("commit.sha in the reply").to_owned()
    }

    /// A tag `name` at the head of `main`.
    pub async fn create_tag(&self, repo: &Repo, name: &str) {
        let resp = self
            .api(reqwest::Method::POST, &format!("/repos/{}/{}/tags", repo.owner, repo.name))
            .json(&serde_json::json!({ "tag_name": name, "target": "main" }))
            .send()
            .await
            .expect("POST tags");
        self.expect_status(resp, &[201], "create the tag").await;
    }

    /// Pushes the files of `tree` as one commit of its own, tagged `tag`, over git's HTTP
    /// (a tree of thousands of files: the contents API would take one request each). The
    /// repository's branches are untouched; the tag is the only way to the commit.
    pub fn push_tree_as_tag(&self, repo: &Repo, tree: &Path, tag: &str) {
        let git = |args: &[&str]| {
            let output = std::process::Command::new("git")
                .arg("-C")
                .arg(tree)
                .args(["-c", "user.name=gdr-test", "-c", "user.email=gdr-test@example.invalid", "-c", "init.defaultBranch=main"])
                .args(args)
                .env("GIT_TERMINAL_PROMPT", "0")
                .output()
                .expect("git cannot run");
            assert!(
                output.status.success(),
                "git {} in {}: {}{}",
                args.first().unwrap_or(&""),
                tree.display(),
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        };
        let remote = format!("http://{ADMIN_USER}:{}@{}/{}/{}.git", self.password, self.addr, repo.owner, repo.name);
        git(&["init", "-q"]);
        git(&["add", "-A", "-f"]);
        git(&["commit", "-q", "-m", &format!("{} {tag}", repo.full_name())]);
        git(&["tag", tag]);
        git(&["push", "-q", &remote, &format!("refs/tags/{tag}")]);
    }

    /// A branch `name` from the head of `main`.
    pub async fn create_branch(&self, repo: &Repo, name: &str) {
        let resp = self
            .api(reqwest::Method::POST, &format!("/repos/{}/{}/branches", repo.owner, repo.name))
            .json(&serde_json::json!({ "new_branch_name": name, "old_branch_name": "main" }))
            .send()
            .await
            .expect("POST branches");
        self.expect_status(resp, &[201], "create the branch").await;
    }

    /// A pull request of `head` into `main`; its number. It starts the `on: pull_request`
    /// workflows of `head`.
    pub async fn open_pull_request(&self, repo: &Repo, head: &str) -> i64 {
        let resp = self
            .api(reqwest::Method::POST, &format!("/repos/{}/{}/pulls", repo.owner, repo.name))
            .json(&serde_json::json!({ "head": head, "base": "main", "title": format!("{head} into main") }))
            .send()
            .await
            .expect("POST pulls");
        let body = self.expect_status(resp, &[201], "open the pull request").await;
        body["number"].as_i64().expect("number in the reply")
    }

    /// An instance-wide runner registration token, from `gitea actions generate-runner-token`
    /// (talks to the running server through its private API). Gitea returns the current
    /// active token, so repeated calls give the same one.
    pub async fn runner_registration_token(&self) -> String {
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.arg("-c").arg(self.dir.path().join("app.ini")).args(["actions", "generate-runner-token"]);
        gitea_env(&mut cmd, self.dir.path());
        let stdout = run_cli(cmd, "gitea actions generate-runner-token", self.dir.path()).await;
        let token = stdout.lines().map(str::trim).rfind(|l| !l.is_empty()).unwrap_or_default().to_owned();
        assert!(!token.is_empty() && token.chars().all(|c| c.is_ascii_alphanumeric()), "unexpected output of generate-runner-token: {stdout:?}");
        token
    }

    /// A webhook of `repo` for `events` (e.g. `workflow_job`, Gitea ≥ 1.24) to `url`,
    /// signed with `secret`, JSON bodies. Gitea delivers to loopback and private
    /// addresses only where `[webhook] ALLOWED_HOST_LIST` allows them (the fixture's
    /// `extra_ini`).
    pub async fn add_webhook(&self, repo: &Repo, url: &str, secret: &str, events: &[&str]) {
        let body = serde_json::json!({
            "type": "gitea",
            "config": { "url": url, "content_type": "json", "secret": secret },
            "events": events,
            "active": true,
        });
        let resp = self.api(reqwest::Method::POST, &format!("/repos/{}/{}/hooks", repo.owner, repo.name)).json(&body).send().await.expect("POST hooks");
        self.expect_status(resp, &[201], "create the webhook").await;
    }

    /// Creates or updates `.gitea/workflows/<file>` on `main` through the contents API and
    /// returns the new commit's SHA once committed. The push event it fires is processed
    /// asynchronously: the run appears shortly after (see [`Gitea::wait_for_run`]).
    ///
    /// Gitea semantics to keep in mind: every commit is a push that starts EVERY `on: push`
    /// workflow of the branch (committing a second file re-runs the first), and a new push
    /// run cancels the unfinished runs of the same workflow file on the same ref
    /// (`CancelPreviousJobs`), running ones included.
    pub async fn commit_workflow(&self, repo: &Repo, file: &str, yaml: &str) -> String {
        self.commit_file(repo, "main", &format!(".gitea/workflows/{file}"), yaml.as_bytes()).await
    }

    /// All tasks of the repository (every page of `GET /api/v1/repos/{o}/{r}/actions/tasks`),
    /// by ascending id. A job becomes a task only when a runner picks it.
    pub async fn tasks(&self, repo: &Repo) -> Vec<TaskInfo> {
        let mut all = Vec::new();
        for page in 1.. {
            let resp = self
                .api(reqwest::Method::GET, &format!("/repos/{}/{}/actions/tasks?page={page}&limit=50", repo.owner, repo.name))
                .send()
                .await
                .expect("GET actions/tasks");
            let body = self.expect_status(resp, &[200], "list the tasks").await;
            let page: TaskPage = serde_json::from_value(body.clone()).unwrap_or_else(|e| panic!("tasks JSON {body}: {e}"));
            let entries = page.workflow_runs.unwrap_or_default();
            let empty = entries.is_empty();
            all.extend(entries);
            if empty || all.len() as i64 >= page.total_count {
                break;
            }
        }
        all.sort_by_key(|t| t.id);
        all
    }

    /// Polls [`Gitea::tasks`] every 200 ms until `done` holds; panics on timeout with the
    /// last tasks seen and the tail of Gitea's log.
    pub async fn wait_for_tasks(&self, repo: &Repo, timeout: Duration, done: impl Fn(&[TaskInfo]) -> bool) -> Vec<TaskInfo> {
        let tasks = crate::poll(timeout, || async {
            let tasks = self.tasks(repo).await;
            if done(&tasks) { Ok(tasks) } else { Err(tasks) }
        });
        tasks.await.unwrap_or_else(|tasks| {
            panic!("timed out after {timeout:?} waiting for the tasks of {}; last seen: {tasks:#?}\n--- gitea log ---\n{}", repo.full_name(), self.log_tail(60))
        })
    }

    /// Which release this is.
    pub fn version(&self) -> GiteaVersion {
        self.version
    }

    /// The path of a run's web routes: `/{o}/{r}/actions/runs/{run}`, by its number
    /// (1.23) or its id (1.27); None when the run does not exist (yet).
    async fn run_path(&self, repo: &Repo, run_number: i64) -> Option<String> {
        let run = if self.version.routes_by_id() { self.run_id(repo, run_number).await? } else { run_number };
        Some(format!("/{}/{}/actions/runs/{run}", repo.owner, repo.name))
    }

    /// A run's id, from `GET /api/v1/repos/{o}/{r}/actions/runs` (Gitea ≥ 1.24).
    async fn run_id(&self, repo: &Repo, run_number: i64) -> Option<i64> {
        for page in 1..=20 {
            let resp = self
                .api(reqwest::Method::GET, &format!("/repos/{}/{}/actions/runs?page={page}&limit=50", repo.owner, repo.name))
                .send()
                .await
                .expect("GET actions/runs");
            let body = self.expect_status(resp, &[200], "list the runs").await;
            let runs = body["workflow_runs"].as_array().cloned().unwrap_or_default();
            if let Some(run) = runs.iter().find(|run| run["run_number"].as_i64() == Some(run_number)) {
                return run["id"].as_i64();
            }
            if runs.len() < 50 {
                return None;
            }
        }
        None
    }

    /// The run as the web UI shows it, or None when it does not exist (yet).
    pub async fn run(&self, repo: &Repo, run_number: i64) -> Option<RunView> {
        let run = self.run_path(repo, run_number).await?;
        // 1.23 views a run through its first job; 1.27 has a run-level view.
        let path = if self.version.routes_by_id() { run } else { format!("{run}/jobs/0") };
        let resp = self.web_post(&path, Some(serde_json::json!({ "logCursors": [] }))).await;
        if resp.status() == reqwest::StatusCode::NOT_FOUND {
            return None;
        }
        let body = self.expect_status(resp, &[200], &format!("POST {path}")).await;
        let run = &body["state"]["run"];
        let s = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
        Some(RunView {
            title: s(&run["title"]),
            status: s(&run["status"]),
            done: run["done"].as_bool().unwrap_or_default(),
            can_cancel: run["canCancel"].as_bool().unwrap_or_default(),
            workflow_id: s(&run["workflowID"]),
            jobs: run["jobs"]
                .as_array()
                .map(|jobs| jobs.iter().map(|j| RunJob { id: j["id"].as_i64().unwrap_or_default(), name: s(&j["name"]), status: s(&j["status"]) }).collect())
                .unwrap_or_default(),
            summaries: run["jobSummaries"].as_array().map(|all| all.iter().map(|summary| s(&summary["summaryHTML"])).collect()).unwrap_or_default(),
        })
    }

    /// Polls [`Gitea::run`] every 200 ms until the run exists and `done` holds; panics on
    /// timeout with the last view and the log tail.
    pub async fn wait_for_run(&self, repo: &Repo, run_number: i64, timeout: Duration, done: impl Fn(&RunView) -> bool) -> RunView {
        let run = crate::poll(timeout, || async {
            match self.run(repo, run_number).await {
                Some(run) if done(&run) => Ok(run),
                other => Err(other),
            }
        });
        run.await.unwrap_or_else(|run| {
            panic!(
                "timed out after {timeout:?} waiting for run {run_number} of {}; last seen: {run:#?}\n--- gitea log ---\n{}",
                repo.full_name(),
                self.log_tail(60)
            )
        })
    }

    /// A job's log as Gitea serves it (`GET /{o}/{r}/actions/runs/{run}/jobs/{idx}/logs`,
    /// signed-in session): raw lines `<timestamp> <message>`, see [`strip_log_timestamps`].
    /// Panics when the job has no task yet (Gitea: 404 "job is not started").
    pub async fn job_log(&self, repo: &Repo, run_number: i64, job_index: usize) -> String {
        self.try_job_log(repo, run_number, job_index).await.unwrap_or_else(|error| panic!("{error}"))
    }

    /// [`Gitea::job_log`] that says what went wrong instead of panicking (a running job
    /// has no log until its first rows arrive: Gitea 1.23 answers 500 "file does not exist", 1.27 404).
    ///
    /// # Errors
    /// The route's status and body.
    pub async fn try_job_log(&self, repo: &Repo, run_number: i64, job_index: usize) -> Result<String, String> {
        let path = self.job_log_path(repo, run_number, job_index).await?;
        let cookies = self.session().await;
        let resp =
            self.http.get(format!("{}{path}", self.url)).header(reqwest::header::COOKIE, cookies).send().await.unwrap_or_else(|e| panic!("GET {path}: {e}"));
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        if status.is_success() { Ok(text) } else { Err(format!("GET {path}: HTTP {status}: {text}")) }
    }

    /// The web route of a job's log: by run number and job index (1.23), by ids (1.27).
    ///
    /// # Errors
    /// When the run or the job does not exist (yet).
    pub async fn job_log_path(&self, repo: &Repo, run_number: i64, job_index: usize) -> Result<String, String> {
        let run = self.run_path(repo, run_number).await.ok_or_else(|| format!("run {run_number} of {} does not exist", repo.full_name()))?;
        let job = if self.version.routes_by_id() {
            let view = self.run(repo, run_number).await.ok_or_else(|| format!("run {run_number} has no view"))?;
            view.jobs.get(job_index).map(|job| job.id).ok_or_else(|| format!("run {run_number} has no job {job_index}: {view:?}"))?
        } else {
            i64::try_from(job_index).unwrap_or(i64::MAX)
        };
        Ok(format!("{run}/jobs/{job}/logs"))
    }

    /// The web route of a run: by its number (1.23) or its id (1.27); None when it does
    /// not exist (yet).
    pub async fn run_route(&self, repo: &Repo, run_number: i64) -> Option<String> {
        self.run_path(repo, run_number).await
    }

    /// Waits (up to 120 s) until job `job_index` of run `run_number` has logged `needle`.
    pub async fn wait_for_log(&self, repo: &Repo, run_number: i64, job_index: usize, needle: &str) {
        let logged = crate::poll(Duration::from_secs(120), || async {
            let log = self.try_job_log(repo, run_number, job_index).await.unwrap_or_else(|error| error);
            if log.contains(needle) { Ok(()) } else { Err(log) }
        });
        logged.await.unwrap_or_else(|log| panic!("{needle:?} never appeared in the job log:\n{log}"));
    }

    /// Cancels a run the way the web UI's Cancel button does:
    /// `POST /{o}/{r}/actions/runs/{run}/cancel` with a signed-in session cookie and its
    /// CSRF token in `X-Csrf-Token` (basic auth is not accepted on web routes).
    pub async fn cancel_run(&self, repo: &Repo, run_number: i64) {
        let run = self.run_path(repo, run_number).await.unwrap_or_else(|| panic!("run {run_number} of {} does not exist", repo.full_name()));
        let path = format!("{run}/cancel");
        let resp = self.web_post(&path, None).await;
        self.expect_status(resp, &[200], &format!("POST {path}")).await;
    }

    /// The signed-in session's `Cookie` header value (signs in on first use).
    async fn session(&self) -> String {
        let mut web = self.web.lock().await;
        if web.is_none() {
            let mut session = WebSession::default();
            let resp = self
                .http
                .post(format!("{}/user/login", self.url))
                .header(reqwest::header::CONTENT_TYPE, "application/x-www-form-urlencoded")
                .body(form_encode(&[("user_name", ADMIN_USER), ("password", &self.password)]))
                .send()
                .await
                .expect("POST /user/login");
            session.absorb(resp.headers());
            let status = resp.status();
            let location = resp.headers().get(reqwest::header::LOCATION).and_then(|l| l.to_str().ok()).unwrap_or("").to_owned();
            assert!(
                status == reqwest::StatusCode::SEE_OTHER
                    && session.cookies.contains_key("i_like_gitea")
                    && (self.version.routes_by_id() || !session.csrf().is_empty()),
                "web sign-in failed: HTTP {status} (location {location:?}), cookies {:?}\n{}",
                session.cookies.keys().collect::<Vec<_>>(),
                self.log_tail(20)
            );
            *web = Some(session);
        }
        web.as_ref().map(WebSession::cookie_header).unwrap_or_default()
    }

    async fn web_post(&self, path: &str, json: Option<serde_json::Value>) -> reqwest::Response {
        self.session().await;
        let mut web = self.web.lock().await;
        let session = web.as_mut().expect("signed in");
        let mut req =
            self.http.post(format!("{}{path}", self.url)).header(reqwest::header::COOKIE, session.cookie_header()).header("X-Csrf-Token", session.csrf());
        req = match json {
            Some(json) => req.json(&json),
            None => req.header(reqwest::header::CONTENT_TYPE, "application/x-www-form-urlencoded").body(""),
        };
        let resp = req.send().await.unwrap_or_else(|e| panic!("POST {path}: {e}"));
        session.absorb(resp.headers());
        resp
    }

    /// The last `lines` lines of Gitea's own log (`log/gitea.log`), followed by the tail of
    /// the web process's console output when it printed anything.
    pub fn log_tail(&self, lines: usize) -> String {
        let root = self.dir.path();
        let mut out = crate::log_tail(&root.join("log/gitea.log"), lines).unwrap_or_else(|| "(no log/gitea.log)".to_owned());
        if let Some(console) = crate::log_tail(&root.join("web.out"), lines.min(20))
            && !console.trim().is_empty()
        {
            out.push_str("\n--- gitea web stdout/stderr ---\n");
            out.push_str(&console);
        }
        out
    }

    /// Stops the server now (SIGTERM, SIGKILL after 5 s) and waits for it. Idempotent;
    /// Drop does the same.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let Ok(raw) = i32::try_from(child.id()) else {
            return;
        };
        let pid = nix::unistd::Pid::from_raw(raw);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let exited = crate::poll_blocking(Duration::from_secs(5), || match child.try_wait() {
            Ok(Some(_)) | Err(_) => Ok(()),
            Ok(None) => Err(()),
        });
        if exited.is_ok() {
            return;
        }
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = child.wait();
    }
}

impl Drop for Gitea {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- gitea {} log (last 80 lines) ---\n{}\n--- end of gitea log ---", self.url, self.log_tail(80));
        }
        self.stop();
    }
}

/// STATIC_ROOT_PATH for one fixture: symlinks to the source tree's `templates`, `public`
/// and `options/*`, except that `options/license` holds only MIT and Apache-2.0. Gitea
/// builds its license classifier from every file there at start-up (726 licenses: about
/// 2 s of CPU, a third of the start on two cores); repositories created with
/// `license: MIT` or `Apache-2.0` still work.
fn trimmed_static_root(source: &Path, view: &Path) {
    use std::os::unix::fs::symlink;
    let link = |from: PathBuf, to: PathBuf| {
        symlink(&from, &to).unwrap_or_else(|e| panic!("symlink {} -> {}: {e}", to.display(), from.display()));
    };
    std::fs::create_dir_all(view.join("options/license")).expect("create the static root");
    for dir in ["templates", "public"] {
        link(source.join(dir), view.join(dir));
    }
    let options = std::fs::read_dir(source.join("options")).expect("read options/ of Gitea's source tree");
    for entry in options {
        let name = entry.expect("options/ entry").file_name();
        if name != "license" {
            link(source.join("options").join(&name), view.join("options").join(&name));
        }
    }
    for license in ["MIT", "Apache-2.0"] {
        link(source.join("options/license").join(license), view.join("options/license").join(license));
    }
}

fn app_ini(root: &Path, static_root: &Path, options: &GiteaOptions, url: &str, port: u16) -> String {
    let r = root.display();
    let jwt = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(random_bytes(32));
    let mut actions = String::new();
    for (k, v) in &options.actions_settings {
        let _ = writeln!(actions, "{k} = {v}");
    }
    format!(
        r#"APP_NAME = gdr-test
RUN_MODE = prod
WORK_PATH = {r}
I_AM_BEING_UNSAFE_RUNNING_AS_ROOT = true

[server]
PROTOCOL = http
HTTP_ADDR = {bind}
HTTP_PORT = {port}
ROOT_URL = {url}/
LOCAL_ROOT_URL = {url}/
APP_DATA_PATH = {r}/data
STATIC_ROOT_PATH = {static_root}
DISABLE_SSH = true
START_SSH_SERVER = false
OFFLINE_MODE = true
LFS_START_SERVER = false

[database]
DB_TYPE = sqlite3
PATH = {r}/data/gitea.db
SQLITE_JOURNAL_MODE = WAL

[repository]
ROOT = {r}/repos
DEFAULT_BRANCH = main

[security]
INSTALL_LOCK = true
SECRET_KEY = {secret}
INTERNAL_TOKEN = {internal}

[oauth2]
JWT_SECRET = {jwt}

[service]
DISABLE_REGISTRATION = true
REQUIRE_SIGNIN_VIEW = false

[mailer]
ENABLED = false

[indexer]
ISSUE_INDEXER_TYPE = db
REPO_INDEXER_ENABLED = false

[queue]
TYPE = channel

[session]
PROVIDER = memory

[cache]
ADAPTER = memory

[picture]
DISABLE_GRAVATAR = true
ENABLE_FEDERATED_AVATAR = false

[cron.update_checker]
ENABLED = false

[log]
MODE = file
LEVEL = Info
ROOT_PATH = {r}/log

[actions]
ENABLED = true
DEFAULT_ACTIONS_URL = self
{actions}
{extra}
"#,
        bind = options.bind,
        static_root = static_root.display(),
        secret = random_hex(32),
        internal = random_hex(32),
        extra = options.extra_ini,
    )
}

fn spawn_web(bin: &Path, root: &Path) -> Child {
    let console = std::fs::File::create(root.join("web.out")).expect("create web.out");
    let mut web = std::process::Command::new(bin);
    web.arg("-c").arg(root.join("app.ini")).arg("web").stdin(Stdio::null()).stdout(console.try_clone().expect("dup web.out")).stderr(console);
    gitea_env_std(&mut web, root);
    // SAFETY: the closure runs in the forked child before exec and only calls prctl(2),
    // which is async-signal-safe; it touches no memory of the parent.
    unsafe {
        web.pre_exec(|| {
            // The server must not outlive a test binary that is killed (timeout, SIGKILL).
            // PR_SET_PDEATHSIG fires when the spawning THREAD exits: a tokio worker, which
            // lives as long as the test's runtime (do not start Gitea from spawn_blocking).
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).map_err(std::io::Error::from)
        });
    }
    web.spawn().unwrap_or_else(|e| panic!("spawn {} web: {e}", bin.display()))
}

/// Waits until `GET /api/v1/version` answers 1.23.8. `Err(log tail)` when the process
/// exited or could not listen (then killed); panics (after killing it) on timeout.
async fn wait_until_up(http: &reqwest::Client, url: &str, version: GiteaVersion, child: &mut Child, root: &Path, timeout: Duration) -> Result<(), String> {
    let version_url = &format!("{url}/api/v1/version");
    let log = || {
        let mut log = crate::log_tail(&root.join("log/gitea.log"), 60).unwrap_or_default();
        log.push_str("\n--- gitea web stdout/stderr ---\n");
        log.push_str(&crate::log_tail(&root.join("web.out"), 20).unwrap_or_default());
        log
    };
    // Ok(Ok) up, Ok(Err) given up on (exited, or cannot listen): the caller retries.
    let outcome = crate::poll(timeout, || {
        let exited = child.try_wait().ok().flatten();
        async move {
            if let Some(status) = exited {
                return Ok(Err(format!("(exit: {status})\n{}", log())));
            }
            if let Ok(resp) = http.get(version_url).timeout(Duration::from_secs(2)).send().await
                && resp.status().is_success()
            {
                let body: serde_json::Value = resp.json().await.expect("version JSON");
                assert_eq!(body["version"], version.release(), "unexpected Gitea version at {version_url}");
                return Ok(Ok(()));
            }
            // Gitea does not exit when it cannot listen: it logs the error and idles.
            if crate::log_tail(&root.join("log/gitea.log"), 20).is_some_and(|t| t.contains("bind: address already in use")) {
                return Ok(Err(log()));
            }
            Err(())
        }
    });
    let outcome = outcome.await;
    if !matches!(outcome, Ok(Ok(()))) {
        let _ = child.kill();
        let _ = child.wait();
    }
    outcome.unwrap_or_else(|()| panic!("gitea web did not answer {version_url} within {timeout:?}\n{}", log()))
}

fn gitea_env_pairs(root: &Path) -> [(&'static str, PathBuf); 3] {
    [("GITEA_WORK_DIR", root.to_path_buf()), ("GITEA_CUSTOM", root.join("custom")), ("HOME", root.join("home"))]
}

fn gitea_env(cmd: &mut tokio::process::Command, root: &Path) {
    cmd.current_dir(root).envs(gitea_env_pairs(root)).env_remove("GIT_DIR").stdin(Stdio::null());
}

fn gitea_env_std(cmd: &mut std::process::Command, root: &Path) {
    cmd.current_dir(root).envs(gitea_env_pairs(root)).env_remove("GIT_DIR");
}

/// Runs a Gitea CLI command to completion; panics with its output and Gitea's log when it
/// fails. Returns stdout.
async fn run_cli(mut cmd: tokio::process::Command, what: &str, root: &Path) -> String {
    let out = cmd.kill_on_drop(true).output().await.unwrap_or_else(|e| panic!("{what}: spawn: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\nstdout: {stdout}\nstderr: {}\n--- gitea log ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        crate::log_tail(&root.join("log/gitea.log"), 40).unwrap_or_default()
    );
    stdout
}
