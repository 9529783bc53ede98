//! `controller run-local` as a user runs it: the static controller binary, the runner
//! image on a real dockerd, the real gitea-runner — no Gitea. The example workflow of
//! the README succeeds with its log on stdout; a failing step gives exit 1; Ctrl-C
//! cancels the job (exit 130) and removes its environment.

#![allow(clippy::unwrap_used)]

use std::{
    process::Stdio,
    time::{Duration, Instant},
};

use e2e::{docker::host, paths};
use tokio::io::{AsyncBufReadExt, BufReader};

fn run_local(workflow: &std::path::Path, image: &str) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(paths::static_controller());
    command
        .args(["run-local", "--workflow"])
        .arg(workflow)
        .args(["--image", image, "--docker-socket"])
        .arg(&host().socket)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    command
}

fn local_environments() -> Vec<String> {
    host().containers("gitea-dynamic-runner/instance=local")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_workflow_runs_and_a_failing_one_fails() {
    let _turn = e2e::exclusive().await;
    let image = host().image("gitea-runner");
    let output =
        tokio::time::timeout(Duration::from_secs(180), run_local(&paths::repository().join("examples/hello.yml"), &image).output()).await.unwrap().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("Hello from a disposable environment") && stdout.contains("as runner"), "{stdout}");
    assert!(stdout.contains("storage overlay2"), "the job's own dockerd did not answer: {stdout}");
    assert!(stderr.contains("run-local: job success"), "{stderr}");

    let dir = tempfile::tempdir().unwrap();
    let failing = dir.path().join("failing.yml");
    std::fs::write(
        &failing,
        "on: push\njobs:\n  broken:\n    runs-on: [disposable, container, docker]\n    steps:\n      - run: echo before\n      - run: exit 3\n",
    )
    .unwrap();
    let output = tokio::time::timeout(Duration::from_secs(180), run_local(&failing, &image).output()).await.unwrap().unwrap();
    assert_eq!(output.status.code(), Some(1), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(String::from_utf8_lossy(&output.stdout).contains("before"));
    testkit::wait_until("run-local's environments are gone", Duration::from_secs(30), || local_environments().is_empty()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_cancels_the_job_and_removes_its_environment() {
    let _turn = e2e::exclusive().await;
    let image = host().image("gitea-runner");
    let dir = tempfile::tempdir().unwrap();
    let sleeper = dir.path().join("sleeper.yml");
    std::fs::write(
        &sleeper,
        "on: push\njobs:\n  sleeper:\n    runs-on: [disposable, container, docker]\n    steps:\n      - run: echo sleeping-now && sleep 300\n",
    )
    .unwrap();
    let mut child = run_local(&sleeper, &image).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let line = tokio::time::timeout_at(deadline.into(), lines.next_line()).await.expect("the job never started").unwrap().expect("stdout closed");
        if line.contains("sleeping-now") && !line.contains("echo") {
            break;
        }
    }
    let interrupted = Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(i32::try_from(child.id().unwrap()).unwrap()), nix::sys::signal::Signal::SIGINT).unwrap();
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait()).await.expect("run-local did not end after Ctrl-C").unwrap();
    let mut stderr = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).await.unwrap();
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("cancelling the job"), "{stderr}");
    eprintln!("Ctrl-C → run-local exited after {:?}", interrupted.elapsed());
    assert!(local_environments().is_empty(), "the environment was left behind: {:?}", local_environments());
}

/// The project's own workflows (`.gitea/workflows/`) and the examples, as run-local reads
/// them: every job parses into a task and its `runs-on` names a placement (run-local
/// refuses one that does not before any environment starts).
#[test]
fn the_projects_own_workflows_parse_and_name_a_placement() {
    use controller::local::{
        assignment_for,
        task::{self, RunContext},
    };
    let mut seen = Vec::new();
    for dir in [".gitea/workflows", "examples"] {
        for entry in std::fs::read_dir(paths::repository().join(dir)).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read(&path).unwrap();
            let jobs = task::job_names(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            for job in jobs {
                let (key, payload, needs) = task::single_job(&text, Some(&job)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                let context = task::context(&RunContext::default(), &key, 1);
                let task = task::task(1, payload, context, &needs, Default::default(), Default::default(), "job-token");
                let (assignment, _) = assignment_for(task).unwrap_or_else(|e| panic!("{}: job {job}: {e}", path.display()));
                seen.push(format!("{}: {job} → {}", path.strip_prefix(paths::repository()).unwrap().display(), assignment.placement));
            }
        }
    }
    seen.sort();
    println!("{}", seen.join("\n"));
    for expected in
        [".gitea/workflows/ci.yml: test", ".gitea/workflows/release.yml: images", ".gitea/workflows/release.yml: smoke", "examples/hello.yml: hello"]
    {
        assert!(seen.iter().any(|s| s.starts_with(expected)), "{expected} missing from {seen:?}");
    }
}
