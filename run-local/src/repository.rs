//! The local repository as the jobs' repository, for `controller run-local`: a
//! snapshot of the working tree (uncommitted and untracked files included, as `act`
//! does) or of one commit, in a scratch bare repository, served read-only over git's
//! smart HTTP protocol where the jobs' Gitea would be. The supervisor's pass-through
//! passes `git clone "$GITHUB_SERVER_URL/$GITHUB_REPOSITORY"` (and checkout actions)
//! here as it would to Gitea; `GITHUB_SHA` and `GITHUB_REF` name what is served.
//!
//! Hand-written on the `git` command (no maintained Rust crate serves git's smart HTTP):
//! the snapshot is made with `git add`/`write-tree`/`commit-tree` into objects of its
//! own (the user's repository is only read), and each request runs `git upload-pack
//! --stateless-rpc`, as `git http-backend` does.

use std::{
    collections::BTreeMap,
    io::Read,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Stdio,
    sync::Arc,
};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum RepositoryError {
    #[error("`git {command}` in {dir} failed: {detail}")]
    Git { command: String, dir: String, detail: String },
    #[error("a scratch directory for the repository snapshot: {0}")]
    Scratch(#[source] std::io::Error),
    #[error("cannot serve the repository on {address}: {source}")]
    Listen {
        address: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// What was served: the commit and the branch it is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    pub sha: String,
    pub branch: String,
    pub message: String,
}

/// A bare repository holding exactly one branch: the snapshot.
#[derive(Debug)]
pub struct Snapshot {
    dir: tempfile::TempDir,
    pub served: Served,
}

async fn git(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Result<String, RepositoryError> {
    let output = tokio::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| RepositoryError::Git { command: args.join(" "), dir: dir.display().to_string(), detail: format!("cannot run git: {e}") })?;
    if !output.status.success() {
        return Err(RepositoryError::Git {
            command: args.join(" "),
            dir: dir.display().to_string(),
            detail: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// `env` and the author and committer of snapshot commits.
fn with_identity<'a>(env: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    const IDENTITY: [(&str, &str); 4] = [
        ("GIT_AUTHOR_NAME", "run-local"),
        ("GIT_AUTHOR_EMAIL", "run-local@localhost"),
        ("GIT_COMMITTER_NAME", "run-local"),
        ("GIT_COMMITTER_EMAIL", "run-local@localhost"),
    ];
    env.iter().copied().chain(IDENTITY).collect()
}

/// The top of the git work tree that holds `path`, if any.
pub async fn work_tree_of(path: &Path) -> Option<PathBuf> {
    let dir = if path.is_dir() { path.to_path_buf() } else { path.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf) };
    let dir = if dir.as_os_str().is_empty() { PathBuf::from(".") } else { dir };
    git(&dir, &["rev-parse", "--show-toplevel"], &[]).await.ok().map(PathBuf::from)
}

/// OWNER/NAME of the repository the `origin` remote of the work tree at `root` points
/// to, as act names a run (`github.repository`): None without an origin or for one that
/// is a local path.
pub async fn origin_name(root: &Path) -> Option<String> {
    let url = git(root, &["remote", "get-url", "origin"], &[]).await.ok()?;
    name_of_remote(&url)
}

/// `https://host/owner/name.git`, `ssh://git@host:22/owner/name`, `git@host:owner/name.git`
/// → `owner/name`; a local path → None.
fn name_of_remote(url: &str) -> Option<String> {
    let path = if let Some((_, rest)) = url.split_once("://") {
        rest.split_once('/')?.1
    } else {
        let (host, path) = url.split_once(':')?;
        if host.contains('/') {
            return None;
        }
        path
    };
    let path = path.trim_end_matches('/');
    let path = path.strip_suffix(".git").unwrap_or(path);
    let mut segments = path.rsplit('/');
    let (name, owner) = (segments.next()?, segments.next()?);
    owner_and_name(&format!("{owner}/{name}"))
}

/// `owner/name` when it is one (two non-empty segments).
pub fn owner_and_name(text: &str) -> Option<String> {
    let (owner, name) = text.split_once('/')?;
    let valid = |part: &str| !part.is_empty() && !part.contains(['/', ' ', ':']);
    (valid(owner) && valid(name)).then(|| text.to_owned())
}

impl Snapshot {
    /// The work tree at `root` as it is now (`commit` None), or the commit `commit`
    /// names, on the branch checked out there (`main` when detached).
    ///
    /// # Errors
    /// When git fails (not a repository, an unknown commit).
    pub async fn take(root: &Path, commit: Option<&str>) -> Result<Snapshot, RepositoryError> {
        let dir = tempfile::Builder::new().prefix("gdr-run-local-repo-").tempdir_in("/tmp").map_err(RepositoryError::Scratch)?;
        let bare = dir.path();
        git(bare, &["init", "--quiet", "--bare", "."], &[]).await?;
        let source_objects = git(root, &["rev-parse", "--path-format=absolute", "--git-common-dir"], &[]).await?;
        // The snapshot reads the user's objects and writes only its own.
        std::fs::write(bare.join("objects/info/alternates"), format!("{source_objects}/objects\n")).map_err(RepositoryError::Scratch)?;
        let branch = git(root, &["symbolic-ref", "--quiet", "--short", "HEAD"], &[]).await.unwrap_or_else(|_| "main".to_owned());
        let head = git(root, &["rev-parse", "--verify", "--quiet", "HEAD^{commit}"], &[]).await.ok();
        let (sha, message) = match commit {
            Some(rev) => {
                let sha = git(root, &["rev-parse", "--verify", &format!("{rev}^{{commit}}")], &[]).await?;
                let message = git(root, &["log", "-1", "--format=%s", &sha], &[]).await?;
                (sha, message)
            }
            None => {
                let objects = bare.join("objects");
                let index = dir.path().join("snapshot.index");
                let (objects, index) = (objects.display().to_string(), index.display().to_string());
                let alternates = format!("{source_objects}/objects");
                let env = with_identity(&[
                    ("GIT_INDEX_FILE", index.as_str()),
                    ("GIT_OBJECT_DIRECTORY", objects.as_str()),
                    ("GIT_ALTERNATE_OBJECT_DIRECTORIES", alternates.as_str()),
                ]);
                if let Some(head) = &head {
                    git(root, &["read-tree", head], &env).await?;
                }
                git(root, &["add", "--all", "."], &env).await?;
                let tree = git(root, &["write-tree"], &env).await?;
                let message = "run-local: the working tree".to_owned();
                let mut args = vec!["commit-tree", tree.as_str(), "-m", message.as_str()];
                if let Some(head) = &head {
                    args.extend(["-p", head.as_str()]);
                }
                (git(root, &args, &env).await?, message)
            }
        };
        git(bare, &["update-ref", &format!("refs/heads/{branch}"), &sha], &[]).await?;
        git(bare, &["symbolic-ref", "HEAD", &format!("refs/heads/{branch}")], &[]).await?;
        Ok(Snapshot { dir, served: Served { sha, branch, message } })
    }

    /// For each (ref, directory): the files of the directory as one commit (no history), on
    /// the branch and the tag named by the ref — one action at several refs (`uses:
    /// OWNER/NAME@v3` in one workflow, `@v4` in another) finds each by either. The first
    /// ref is the default branch.
    ///
    /// # Errors
    /// When git fails (an unreadable directory, a ref git refuses).
    pub async fn of_directories(refs: &[(String, PathBuf)]) -> Result<Snapshot, RepositoryError> {
        let scratch = tempfile::Builder::new().prefix("gdr-run-local-action-").tempdir_in("/tmp").map_err(RepositoryError::Scratch)?;
        let bare = scratch.path();
        git(bare, &["init", "--quiet", "--bare", "."], &[]).await?;
        let git_dir = bare.display().to_string();
        let mut served = None;
        for (n, (git_ref, dir)) in refs.iter().enumerate() {
            let (work_tree, index) = (dir.display().to_string(), bare.join(format!("snapshot-{n}.index")).display().to_string());
            let env = with_identity(&[("GIT_DIR", git_dir.as_str()), ("GIT_WORK_TREE", work_tree.as_str()), ("GIT_INDEX_FILE", index.as_str())]);
            git(dir, &["add", "--all", "."], &env).await?;
            let tree = git(dir, &["write-tree"], &env).await?;
            let message = format!("run-local: {}", dir.display());
            let sha = git(dir, &["commit-tree", &tree, "-m", &message], &env).await?;
            for reference in [format!("refs/heads/{git_ref}"), format!("refs/tags/{git_ref}")] {
                git(bare, &["update-ref", &reference, &sha], &[]).await?;
            }
            served.get_or_insert(Served { sha, branch: git_ref.clone(), message });
        }
        let served = served.ok_or_else(|| RepositoryError::Scratch(std::io::Error::other("an action with no ref to serve")))?;
        git(bare, &["symbolic-ref", "HEAD", &format!("refs/heads/{}", served.branch)], &[]).await?;
        Ok(Snapshot { dir: scratch, served })
    }

    pub fn git_dir(&self) -> &Path {
        self.dir.path()
    }
}

/// Serves each `owner/name` → bare repository over git's smart HTTP (fetch only); a
/// request for another repository is redirected to `elsewhere` (the actions URL, for
/// actions that are not mapped) when given.
///
/// # Errors
/// When `address` cannot be bound.
pub async fn serve(
    address: SocketAddr,
    repositories: BTreeMap<String, PathBuf>,
    elsewhere: Option<String>,
    shutdown: CancellationToken,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), RepositoryError> {
    let listener = tokio::net::TcpListener::bind(address).await.map_err(|source| RepositoryError::Listen { address, source })?;
    let bound = listener.local_addr().map_err(|source| RepositoryError::Listen { address, source })?;
    let repositories = Arc::new(repositories);
    let elsewhere = Arc::new(elsewhere);
    let handle = tokio::spawn(async move {
        let mut connections = tokio::task::JoinSet::new();
        loop {
            let accepted = tokio::select! {
                () = shutdown.cancelled() => break,
                accepted = listener.accept() => accepted,
            };
            let Ok((stream, _)) = accepted else { continue };
            let (repositories, elsewhere) = (Arc::clone(&repositories), Arc::clone(&elsewhere));
            connections.spawn(async move {
                let service = hyper::service::service_fn(move |request| {
                    let (repositories, elsewhere) = (Arc::clone(&repositories), Arc::clone(&elsewhere));
                    async move { Ok::<_, std::convert::Infallible>(answer(&repositories, elsewhere.as_deref(), request).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(hyper_util::rt::TokioIo::new(stream), service).await;
            });
        }
        connections.abort_all();
        while connections.join_next().await.is_some() {}
    });
    Ok((bound, handle))
}

fn text(status: StatusCode, message: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(format!("run-local: {message}\n"))));
    *response.status_mut() = status;
    response.headers_mut().insert(header::CONTENT_TYPE, http::HeaderValue::from_static("text/plain; charset=utf-8"));
    response
}

/// The repository and the git route of a request path: `/owner/name[.git]/info/refs`
/// or `/owner/name[.git]/git-upload-pack` (and receive-pack, refused).
fn route(path: &str) -> Option<(String, &str)> {
    let (repository, service) =
        ["/info/refs", "/git-upload-pack", "/git-receive-pack"].iter().find_map(|suffix| path.strip_suffix(suffix).map(|rest| (rest, *suffix)))?;
    let repository = repository.trim_start_matches('/').trim_end_matches(".git");
    (repository.split('/').count() == 2).then(|| (repository.to_owned(), service))
}

async fn answer(repositories: &BTreeMap<String, PathBuf>, elsewhere: Option<&str>, request: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = request.uri().path().to_owned();
    let known = || repositories.keys().cloned().collect::<Vec<_>>().join(", ");
    let Some((repository, service)) = route(&path) else {
        return text(StatusCode::NOT_FOUND, &format!("{path}: no Gitea runs here; only git fetches of {} are served", known()));
    };
    let Some(git_dir) = repositories.get(&repository) else {
        if let Some(elsewhere) = elsewhere {
            let target = format!("{}{}", elsewhere.trim_end_matches('/'), request.uri().path_and_query().map_or(path.as_str(), |p| p.as_str()));
            let mut response = text(StatusCode::TEMPORARY_REDIRECT, &format!("{repository} is not mapped: {target}"));
            if let Ok(location) = http::HeaderValue::from_str(&target) {
                response.headers_mut().insert(header::LOCATION, location);
            }
            return response;
        }
        return text(StatusCode::NOT_FOUND, &format!("no repository {repository:?} is served here (only {})", known()));
    };
    let query = request.uri().query().unwrap_or_default();
    let protocol = request.headers().get("git-protocol").and_then(|v| v.to_str().ok()).map(str::to_owned);
    match (request.method(), service) {
        (_, "/git-receive-pack") => text(StatusCode::FORBIDDEN, "the local repository is served read-only"),
        (&Method::GET, "/info/refs") if query.split('&').any(|p| p == "service=git-upload-pack") => {
            let Ok(advertisement) = upload_pack(git_dir, true, protocol.as_deref(), Bytes::new()).await else {
                return text(StatusCode::INTERNAL_SERVER_ERROR, "git upload-pack failed");
            };
            let mut body = Vec::new();
            if !protocol.as_deref().is_some_and(|p| p.contains("version=2")) {
                // The smart protocol's header before the refs (not in protocol v2).
                body.extend_from_slice(b"001e# service=git-upload-pack\n0000");
            }
            body.extend_from_slice(&advertisement);
            git_response("application/x-git-upload-pack-advertisement", body)
        }
        (&Method::POST, "/git-upload-pack") => {
            let gzip = request.headers().get(header::CONTENT_ENCODING).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"gzip"));
            let Ok(body) = request.into_body().collect().await.map(http_body_util::Collected::to_bytes) else {
                return text(StatusCode::BAD_REQUEST, "the request body did not arrive");
            };
            let body = if gzip {
                let mut plain = Vec::new();
                if flate2::read::GzDecoder::new(&body[..]).read_to_end(&mut plain).is_err() {
                    return text(StatusCode::BAD_REQUEST, "the request body is not gzip");
                }
                Bytes::from(plain)
            } else {
                body
            };
            match upload_pack(git_dir, false, protocol.as_deref(), body).await {
                Ok(pack) => git_response("application/x-git-upload-pack-result", pack),
                Err(detail) => text(StatusCode::INTERNAL_SERVER_ERROR, &format!("git upload-pack failed: {detail}")),
            }
        }
        _ => text(StatusCode::FORBIDDEN, "only git fetches (upload-pack) are served"),
    }
}

fn git_response(content_type: &'static str, body: Vec<u8>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    response.headers_mut().insert(header::CONTENT_TYPE, http::HeaderValue::from_static(content_type));
    response.headers_mut().insert(header::CACHE_CONTROL, http::HeaderValue::from_static("no-cache"));
    response
}

/// `git upload-pack --stateless-rpc` with `input` on stdin. The whole answer is kept in
/// memory: a local repository's pack, once per job.
async fn upload_pack(git_dir: &Path, advertise: bool, protocol: Option<&str>, input: Bytes) -> Result<Vec<u8>, String> {
    let mut command = tokio::process::Command::new("git");
    command.arg("upload-pack").arg("--stateless-rpc");
    if advertise {
        command.arg("--advertise-refs");
    }
    command.arg(git_dir).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
    if let Some(protocol) = protocol {
        command.env("GIT_PROTOCOL", protocol);
    }
    let mut child = command.spawn().map_err(|e| format!("cannot run git: {e}"))?;
    let mut stdin = child.stdin.take().ok_or("no stdin")?;
    let writer = tokio::spawn(async move {
        let _ = stdin.write_all(&input).await;
    });
    let output = child.wait_with_output().await.map_err(|e| e.to_string())?;
    let _ = writer.await;
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).trim().to_owned());
    }
    Ok(output.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        let table = [
            ("/local/repo/info/refs", Some(("local/repo", "/info/refs"))),
            ("/local/repo.git/git-upload-pack", Some(("local/repo", "/git-upload-pack"))),
            ("/local/repo/git-receive-pack", Some(("local/repo", "/git-receive-pack"))),
            ("/api/v1/repos/local/repo", None),
            ("/a/b/c/info/refs", None),
        ];
        for (path, want) in table {
            assert_eq!(route(path).as_ref().map(|(r, s)| (r.as_str(), *s)), want, "{path}");
        }
    }

    async fn sh(dir: &Path, script: &str) -> String {
        let output = tokio::process::Command::new("sh").arg("-c").arg(script).current_dir(dir).output().await.unwrap();
        assert!(output.status.success(), "{script}: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// Cloned over HTTP by the real git: the snapshot has the uncommitted and untracked
    /// changes, the commit snapshot does not, and the user's repository is unchanged.
    #[tokio::test]
    async fn git_clones_the_working_tree_or_a_commit_and_the_source_is_left_alone() {
        let work = tempfile::tempdir().unwrap();
        let dir = work.path();
        sh(dir, "git init -q -b trunk . && git -c user.name=t -c user.email=t@t commit -q --allow-empty -m first && echo committed > a && git add a && git -c user.name=t -c user.email=t@t commit -q -m second && echo changed > a && echo new > untracked").await;
        let status_before = sh(dir, "git status --porcelain; git rev-parse HEAD; git count-objects").await;

        let tree = Snapshot::take(dir, None).await.unwrap();
        let commit = Snapshot::take(dir, Some("HEAD~1")).await.unwrap();
        assert_eq!(tree.served.branch, "trunk");
        assert_eq!(sh(dir, "git status --porcelain; git rev-parse HEAD; git count-objects").await, status_before, "the user's repository changed");
        assert_eq!(commit.served.sha, sh(dir, "git rev-parse HEAD~1").await);
        assert_eq!(commit.served.message, "first");

        let shutdown = CancellationToken::new();
        let repositories = BTreeMap::from([("me/tree".to_owned(), tree.git_dir().to_path_buf()), ("me/old".to_owned(), commit.git_dir().to_path_buf())]);
        let (address, server) = serve("127.0.0.1:0".parse().unwrap(), repositories, None, shutdown.clone()).await.unwrap();
        let clones = tempfile::tempdir().unwrap();
        for protocol in ["0", "2"] {
            let cloned = sh(clones.path(), &format!("git -c protocol.version={protocol} clone -q http://{address}/me/tree v{protocol} && cat v{protocol}/a v{protocol}/untracked && git -C v{protocol} rev-parse HEAD")).await;
            assert_eq!(cloned, format!("changed\nnew\n{}", tree.served.sha), "protocol {protocol}");
        }
        let old = sh(clones.path(), &format!("git clone -q http://{address}/me/old.git old && ls old | wc -l && git -C old log --format=%s")).await;
        assert_eq!(old, "0\nfirst");
        let refused = tokio::process::Command::new("git")
            .args(["push", &format!("http://{address}/me/tree"), "HEAD:refs/heads/x"])
            .current_dir(clones.path().join("v2"))
            .output()
            .await
            .unwrap();
        assert!(!refused.status.success());
        let unknown = tokio::process::Command::new("git").args(["ls-remote", &format!("http://{address}/me/other")]).output().await.unwrap();
        let said = String::from_utf8_lossy(&unknown.stderr);
        assert!(!unknown.status.success() && said.contains("run-local: no repository \"me/other\" is served here (only me/old, me/tree)"), "{said}");
        shutdown.cancel();
        server.await.unwrap();
    }

    #[test]
    fn a_remote_names_its_repository() {
        let table = [
            ("https://github.com/nektos/act.git", Some("nektos/act")),
            ("https://gitea.example/org/app", Some("org/app")),
            ("https://gitea.example/sub/path/org/app/", Some("org/app")),
            ("ssh://git@gitea.example:2222/org/app.git", Some("org/app")),
            ("git@github.com:acme/tool.git", Some("acme/tool")),
            ("/srv/git/app.git", None),
            ("../app", None),
            ("https://host/only", None),
        ];
        for (url, want) in table {
            assert_eq!(name_of_remote(url).as_deref(), want, "{url}");
        }
        assert_eq!(owner_and_name("a/b").as_deref(), Some("a/b"));
        assert_eq!(owner_and_name("a/b/c"), None);
        assert_eq!(owner_and_name("ab"), None);
    }

    /// An action's directories served at its name, each by its branch and tag; an action
    /// that is not mapped is sent to the actions URL.
    #[tokio::test]
    async fn a_mapped_action_is_cloned_by_its_ref_and_others_are_redirected() {
        let (action, older) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        sh(action.path(), "echo 'runs: {using: composite, steps: []}' > action.yml").await;
        sh(older.path(), "echo 'runs: {using: node16, main: x.js}' > action.yml").await;
        let refs = [("v1".to_owned(), action.path().to_path_buf()), ("v0".to_owned(), older.path().to_path_buf())];
        let snapshot = Snapshot::of_directories(&refs).await.unwrap();
        let shutdown = CancellationToken::new();
        let repositories = BTreeMap::from([("acme/greet".to_owned(), snapshot.git_dir().to_path_buf())]);
        let (address, server) = serve("127.0.0.1:0".parse().unwrap(), repositories, Some("http://actions.invalid/".into()), shutdown.clone()).await.unwrap();
        let clones = tempfile::tempdir().unwrap();
        let cloned = sh(clones.path(), &format!("git clone -q --branch v1 http://{address}/acme/greet a && cat a/action.yml && git -C a tag")).await;
        assert_eq!(cloned, "runs: {using: composite, steps: []}\nv0\nv1");
        let cloned = sh(clones.path(), &format!("git clone -q --branch v0 http://{address}/acme/greet b && cat b/action.yml")).await;
        assert_eq!(cloned, "runs: {using: node16, main: x.js}");

        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        stream.write_all(b"GET /other/thing/info/refs?service=git-upload-pack HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
        let mut answer = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut stream, &mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 307"), "{answer}");
        assert!(answer.to_ascii_lowercase().contains("location: http://actions.invalid/other/thing/info/refs?service=git-upload-pack"), "{answer}");
        shutdown.cancel();
        server.await.unwrap();
    }
}
