//! `run-local` as a user runs it: the static run-local binary, the runner
//! image on a real dockerd, the real gitea-runner — no Gitea. The example workflow of
//! the README succeeds with its log on stdout; a failing step gives exit 1; a workflow
//! of several jobs runs in `needs` order with outputs, matrix, `if:`, inputs and files of
//! secrets, vars and env, checking out the local repository (served by run-local) and
//! using a local and a mapped action; Ctrl-C cancels the job (exit 130) and removes its
//! environment; a step runs a command as root in its own environment
//! (`scripts/lib/ci/as-environment-root`, as the release workflow does).

use std::{
    process::Stdio,
    time::{Duration, Instant},
};

use e2e::{docker::host, paths};
use tokio::io::{AsyncBufReadExt, BufReader};

fn run_local(workflow: &std::path::Path, image: &str) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(paths::static_run_local());
    command.arg("--workflow").arg(workflow).args(["--image", image, "--docker-socket"]).arg(&host().socket).stdin(Stdio::null()).kill_on_drop(true);
    command
}

/// Makes `dir` a git repository with everything in it committed (the state run-local serves).
fn commit_all(dir: &std::path::Path) {
    for args in ["init -q -b main .", "add -A", "commit -q -m first"] {
        let status = std::process::Command::new("sh").arg("-c").arg(format!("git -c user.name=t -c user.email=t@t {args}")).current_dir(dir).status().unwrap();
        assert!(status.success(), "git {args}");
    }
}

/// Gives the repository at `dir` the `origin` remote `url` (run-local names the run after it).
fn add_origin(dir: &std::path::Path, url: &str) {
    let status = std::process::Command::new("git").args(["remote", "add", "origin", url]).current_dir(dir).status().unwrap();
    assert!(status.success(), "git remote add origin {url}");
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
    assert!(stderr.contains("cancelling the run"), "{stderr}");
    eprintln!("Ctrl-C → run-local exited after {:?}", interrupted.elapsed());
    assert!(local_environments().is_empty(), "the environment was left behind: {:?}", local_environments());
}

/// The whole workflow, in a git repository with an uncommitted change: a matrix job
/// whose two combinations run at once, check the repository out (the change is there),
/// use a local composite action and a mapped JavaScript action and set an output; a job
/// that needs it (the output, an input, a secret, a var and env from dotenv files); a
/// failing job, a job skipped because it needs the failed one, and an `if: always()` job
/// that runs anyway and sees the results. The run fails (exit 1). Then `--commit HEAD`
/// serves the committed state instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workflow_runs_every_job_in_needs_order_with_outputs_matrix_if_checkout_and_actions() {
    let _turn = e2e::exclusive().await;
    let image = host().image("gitea-runner");
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
        path
    };
    let workflow = file(
        ".gitea/workflows/pipeline.yml",
        r#"on:
  workflow_dispatch:
    inputs:
      greeting: {default: hello}
      target: {required: true}
env:
  FROM_WORKFLOW: workflow
jobs:
  build:
    runs-on: [disposable, container, docker]
    strategy:
      matrix: {arch: [amd64, arm64]}
    outputs:
      artifact: ${{ steps.make.outputs.artifact }}
    steps:
      - run: |
          git clone -q "$GITHUB_SERVER_URL/$GITHUB_REPOSITORY" .
          echo "checked out: $(cat state.txt), head $(git rev-parse HEAD) sha $GITHUB_SHA"
      - id: greet
        uses: ./.gitea/actions/greet
        with: {who: "${{ matrix.arch }}"}
      - id: js
        uses: acme/hello-js@v1
        with: {who: "${{ matrix.arch }}"}
      - id: make
        run: |
          echo "building for ${{ matrix.arch }} at $(date +%s%N)"
          sleep 3
          echo "built ${{ matrix.arch }} at $(date +%s%N)"
          echo "actions said [${{ steps.greet.outputs.greeting }}] [${{ steps.js.outputs.said }}]"
          echo "artifact=app-${{ matrix.arch }}" >> "$GITHUB_OUTPUT"
  test:
    needs: build
    runs-on: [disposable, container, docker]
    steps:
      - run: |
          echo "testing ${{ needs.build.outputs.artifact }} after ${{ needs.build.result }}"
          echo "inputs ${{ inputs.greeting }}/${{ inputs.target }} var ${{ vars.LEVEL }} env $FROM_FILE/$FROM_WORKFLOW"
          [ "${{ secrets.TOKEN }}" = "s3cret" ] && echo "the secret arrived"
  broken:
    runs-on: [disposable, container, docker]
    steps:
      - run: exit 4
  after-broken:
    needs: broken
    runs-on: [disposable, container, docker]
    steps:
      - run: echo "must not run"
  report:
    needs: [test, broken]
    if: always()
    runs-on: [disposable, container, docker]
    steps:
      - run: echo "report test=${{ needs.test.result }} broken=${{ needs.broken.result }}"
"#,
    );
    file(
        ".gitea/actions/greet/action.yml",
        "inputs:\n  who: {required: true}\noutputs:\n  greeting: {value: \"${{ steps.say.outputs.greeting }}\"}\nruns:\n  using: composite\n  steps:\n    - id: say\n      shell: bash\n      run: echo \"greeting=composite greets ${{ inputs.who }}\" >> \"$GITHUB_OUTPUT\"\n",
    );
    file("state.txt", "committed\n");
    commit_all(dir.path());
    file("state.txt", "uncommitted\n");
    let action = tempfile::tempdir().unwrap();
    std::fs::write(
        action.path().join("action.yml"),
        "inputs:\n  who: {required: true}\noutputs:\n  said: {description: x}\nruns:\n  using: node20\n  main: index.js\n",
    )
    .unwrap();
    std::fs::write(
        action.path().join("index.js"),
        "require('fs').appendFileSync(process.env.GITHUB_OUTPUT, `said=node ${process.version} greets ${process.env.INPUT_WHO}\\n`);\n",
    )
    .unwrap();
    let mapping = format!("acme/hello-js@v1={}", action.path().display());
    let secrets = file("secrets.env", "TOKEN=s3cret\n");
    let vars = file("vars.env", "LEVEL=debug\n");
    let env = file("ci.env", "FROM_FILE=dotenv\nFROM_WORKFLOW=overridden\n");

    let list = run_local(&workflow, &image).arg("--list").output().await.unwrap();
    let table = String::from_utf8_lossy(&list.stdout);
    println!("{table}");
    assert_eq!(list.status.code(), Some(0), "{}", String::from_utf8_lossy(&list.stderr));
    let rows: Vec<Vec<&str>> = table.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(rows[0], ["JOB", "NEEDS", "MATRIX", "PLACEMENT", "RUNS-ON"]);
    assert_eq!(rows[1], ["build", "-", "2", "container.docker", "disposable,container,docker"]);
    assert_eq!(rows[5][..3], ["report", "test,broken", "1"]);
    assert!(local_environments().is_empty(), "--list started an environment");

    let missing = run_local(&workflow, &image).output().await.unwrap();
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(missing.status.code() != Some(0) && stderr.contains("--input target=VALUE"), "a required input was not asked for: {stderr}");

    let started = Instant::now();
    let mut command = run_local(&workflow, &image);
    command.args(["--input", "target=prod", "--action", &mapping, "--secret-file"]).arg(&secrets).arg("--var-file").arg(&vars).arg("--env-file").arg(&env);
    let output = tokio::time::timeout(Duration::from_secs(400), command.output()).await.unwrap().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}\n{stderr}\nthe run took {:?}", started.elapsed());
    assert_eq!(output.status.code(), Some(1), "the failing job must fail the run");
    let line = |needle: &str| stdout.lines().find(|l| l.contains(needle) && !l.contains("echo ")).map(str::to_owned);
    for arch in ["amd64", "arm64"] {
        let checked_out = line(&format!("[build ({arch})] checked out: ")).unwrap_or_else(|| panic!("{stdout}"));
        let words: Vec<&str> = checked_out.split_whitespace().collect();
        assert_eq!(words[4], "uncommitted,", "the working tree was not served: {checked_out}");
        assert_eq!(words[6], words[8], "GITHUB_SHA is not the commit served: {checked_out}");
        assert!(
            line(&format!("[build ({arch})] actions said [composite greets {arch}] [node v")).is_some_and(|l| l.ends_with(&format!("greets {arch}]"))),
            "{stdout}"
        );
    }
    assert!(line("[test] testing app-").is_some_and(|l| l.ends_with("after success")), "{stdout}");
    assert!(line("[test] inputs hello/prod var debug env dotenv/workflow").is_some(), "{stdout}");
    assert!(line("[test] the secret arrived").is_some(), "{stdout}");
    assert!(line("[report] report test=success broken=failure").is_some(), "{stdout}");
    assert!(line("must not run").is_none(), "{stdout}");
    assert!(stderr.contains("job \"after-broken\" skipped"), "{stderr}");
    for (result, job) in [
        ("success", "build (amd64)"),
        ("success", "build (arm64)"),
        ("success", "test"),
        ("failure", "broken"),
        ("skipped", "after-broken"),
        ("success", "report"),
    ] {
        let want = format!("run-local: {result} {job}");
        assert!(stderr.lines().any(|l| l.split_whitespace().collect::<Vec<_>>().join(" ") == want), "{want:?} missing:\n{stderr}");
    }
    // The two combinations ran at once (--parallel 2): each started before the other ended.
    let at =
        |needle: &str| -> u128 { line(needle).and_then(|l| l.rsplit(' ').next().and_then(|n| n.parse().ok())).unwrap_or_else(|| panic!("{needle}: {stdout}")) };
    assert!(at("building for amd64") < at("built arm64") && at("building for arm64") < at("built amd64"), "the matrix ran one after the other:\n{stdout}");

    // --commit: the committed state, one job, one combination.
    let mut command = run_local(&workflow, &image);
    command.args(["--commit", "HEAD", "--job", "build", "--matrix", "arch:arm64", "--input", "target=prod", "--action", &mapping]);
    let output = tokio::time::timeout(Duration::from_secs(200), command.output()).await.unwrap().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.lines().any(|l| l.starts_with("checked out: committed,")), "{stdout}");
    assert!(stdout.contains("greets arm64]") && !stdout.contains("greets amd64"), "the matrix filter did not keep arm64 alone:\n{stdout}");
    testkit::wait_until("run-local's environments are gone", Duration::from_secs(30), || local_environments().is_empty()).await;
}

/// `scripts/lib/ci/as-environment-root`, as the release workflow's build steps use it: from a step
/// (uid 2000) in a real environment with a job-local dockerd, the command runs as root in
/// that environment itself — its PID 1 is the supervisor, the step's directory and exported
/// variables came along, what it writes the step sees, what it left in the workspace is the
/// runner user's again (or the runner could not clean up) — and its exit code is the step's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_runs_a_command_as_root_in_its_own_environment_through_the_job_dockerd() {
    let _turn = e2e::exclusive().await;
    let image = host().image("gitea-runner");
    let dir = tempfile::tempdir().unwrap();
    for script in ["scripts/lib/ci/as-environment-root", "scripts/lib/common.sh"] {
        let to = dir.path().join(script);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(paths::repository().join(script), &to).unwrap();
    }
    let workflow = dir.path().join(".gitea/workflows/root.yml");
    std::fs::create_dir_all(workflow.parent().unwrap()).unwrap();
    std::fs::write(
        &workflow,
        r#"on: push
jobs:
  root:
    runs-on: [disposable, container, docker]
    steps:
      - run: git clone -q "$GITHUB_SERVER_URL/$GITHUB_REPOSITORY" .
      - run: |
          echo "step uid $(id -u)"
          export FROM_STEP="kept 'quoted' value"
          scripts/lib/ci/as-environment-root bash -c 'echo "root uid $(id -u) pid1 $(cat /proc/1/comm) in $PWD from-step $FROM_STEP"; touch /etc/written-by-root; mkdir -p out; touch out/built'
          [ -e /etc/written-by-root ] && echo "the step sees what root wrote"
          echo "the workspace's new files are uid $(stat -c %u out out/built | sort -u)"
          status=0; scripts/lib/ci/as-environment-root sh -c 'exit 7' || status=$?
          echo "exit code $status"
          echo "workspace $PWD"
"#,
    )
    .unwrap();
    commit_all(dir.path());
    let output = tokio::time::timeout(Duration::from_secs(240), run_local(&workflow, &image).output()).await.unwrap().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    let workspace = stdout
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("workspace /"))
        .map(|path| format!("/{path}"))
        .unwrap_or_else(|| panic!("no workspace line:\n{stdout}"));
    for want in [
        "step uid 2000".to_owned(),
        format!("root uid 0 pid1 supervisor in {workspace} from-step kept 'quoted' value"),
        "the step sees what root wrote".to_owned(),
        "the workspace's new files are uid 2000".to_owned(),
        "exit code 7".to_owned(),
    ] {
        assert!(stdout.lines().any(|l| l.ends_with(&want)), "{want:?} missing:\n{stdout}");
    }
    testkit::wait_until("run-local's environments are gone", Duration::from_secs(30), || local_environments().is_empty()).await;
}

/// run-local keeps `actions/cache` entries between its runs (`--cache-dir`), as act's
/// cache server path does; with `--no-cache` a restore misses and a save says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_cache_keeps_its_entries_between_runs() {
    let _turn = e2e::exclusive().await;
    let image = host().image("gitea-runner");
    let dir = tempfile::tempdir().unwrap();
    let workflow = dir.path().join("cache.yml");
    std::fs::write(
        &workflow,
        r#"on: push
jobs:
  deps:
    runs-on: [disposable, container, docker]
    steps:
      - id: deps
        uses: actions/cache@v4
        with: {path: deps, key: deps-v1}
      - run: |
          echo "hit=[${{ steps.deps.outputs.cache-hit }}]"
          [ -f deps/built ] && echo "content=$(cat deps/built)" || { mkdir -p deps && date +%s%N > deps/built; }
"#,
    )
    .unwrap();
    // The real actions/cache@v4, served offline.
    let action = tempfile::tempdir().unwrap();
    e2e::actions::unpack("cache", "v4", &action.path().join("cache"));
    let mapping = format!("actions/cache@v4={}", action.path().join("cache").display());
    let cache = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let mut command = run_local(&workflow, &image);
        command.args(["--action", &mapping]).args(extra);
        command
    };
    let cache_dir = cache.path().display().to_string();
    let mut said = Vec::new();
    for round in ["first", "second"] {
        let output = tokio::time::timeout(Duration::from_secs(240), run(&["--cache-dir", &cache_dir]).output()).await.unwrap().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert_eq!(output.status.code(), Some(0), "{round}: {stdout}\n{}", String::from_utf8_lossy(&output.stderr));
        said.push(stdout);
    }
    assert!(said[0].contains("hit=[]") && said[0].contains("Cache saved with key: deps-v1"), "{}", said[0]);
    assert!(said[1].contains("hit=[true]") && said[1].contains("content="), "the second run did not restore:\n{}", said[1]);
    let output = tokio::time::timeout(Duration::from_secs(240), run(&["--no-cache"]).output()).await.unwrap().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stdout}");
    // The real client says only that it could not reserve the key (the cache's reason,
    // "this runner keeps no cache", is in its answer, which actions/cache@v4 does not print).
    assert!(stdout.contains("hit=[]") && stdout.contains("Unable to reserve cache with key deps-v1"), "--no-cache: {stdout}");
    testkit::wait_until("run-local's environments are gone", Duration::from_secs(30), || local_environments().is_empty()).await;
}

/// What `act` runs and run-local refused or got wrong before: a matrix computed by a
/// `prepare` job (`fromJSON(needs.….outputs.…)`, a key from an output, a constant
/// expression) fanned out once its needs ended and named as Gitea names the jobs; one
/// mapped action at two refs in one workflow; a `shell: python` step; `github.repository`
/// from the clone's `origin` remote; the dependent jobs' logs without the runner's line
/// about each needed job's stand-in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expression_matrices_two_refs_of_an_action_python_and_the_origin_name() {
    let _turn = e2e::exclusive().await;
    let image = host().image("gitea-runner");
    let dir = tempfile::tempdir().unwrap();
    let workflow = dir.path().join(".gitea/workflows/act.yml");
    std::fs::create_dir_all(workflow.parent().unwrap()).unwrap();
    std::fs::write(
        &workflow,
        r#"name: act
on: push
jobs:
  prepare:
    runs-on: ubuntu-latest
    outputs:
      matrix: ${{ steps.plan.outputs.matrix }}
      key: ${{ steps.plan.outputs.key }}
      flavours: ${{ steps.plan.outputs.flavours }}
    steps:
      - id: plan
        shell: python
        run: |
          import json, os, sys
          with open(os.environ["GITHUB_OUTPUT"], "a") as out:
              out.write("matrix=" + json.dumps({"os": ["linux", "bsd", "mac"]}) + "\n")
              out.write("key=flavour\n")
              out.write("flavours=" + json.dumps(["sweet", "sour"]) + "\n")
          print("python %d.%d planned the matrix" % sys.version_info[:2])
  fan:
    needs: prepare
    runs-on: ubuntu-latest
    strategy:
      matrix: ${{ fromJSON(needs.prepare.outputs.matrix) }}
    steps:
      - run: echo "fan over ${{ matrix.os }}"
  keyed:
    needs: prepare
    runs-on: ubuntu-latest
    strategy:
      matrix:
        "${{ needs.prepare.outputs.key }}": ${{ fromJSON(needs.prepare.outputs.flavours) }}
    steps:
      - run: echo "keyed ${{ matrix.flavour }}"
  constant:
    runs-on: ubuntu-latest
    strategy:
      matrix:
        n: ${{ fromJSON('[1, 2]') }}
    steps:
      - run: echo "constant ${{ matrix.n }}"
  refs:
    if: github.repository_owner == 'acme'
    runs-on: ubuntu-latest
    steps:
      - id: old
        uses: acme/say@v1
      - id: new
        uses: acme/say@v2
      - run: echo "said [${{ steps.old.outputs.said }}] [${{ steps.new.outputs.said }}] for ${{ github.repository }}"
"#,
    )
    .unwrap();
    commit_all(dir.path());
    add_origin(dir.path(), "https://gitea.example/acme/app.git");
    let (v1, v2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    for (action, says) in [(&v1, "v1 says hi"), (&v2, "v2 says hi")] {
        let text = format!(
            "outputs:\n  said: {{value: \"${{{{ steps.say.outputs.said }}}}\"}}\nruns:\n  using: composite\n  steps:\n    - id: say\n      shell: bash\n      run: echo \"said={says}\" >> \"$GITHUB_OUTPUT\"\n"
        );
        std::fs::write(action.path().join("action.yml"), text).unwrap();
    }
    let mappings = [format!("acme/say@v1={}", v1.path().display()), format!("acme/say@v2={}", v2.path().display())];

    let list = run_local(&workflow, &image).arg("--list").output().await.unwrap();
    let table = String::from_utf8_lossy(&list.stdout);
    assert!(table.lines().any(|l| l.split_whitespace().take(3).eq(["fan", "prepare", "needs"])), "{table}");

    let mut command = run_local(&workflow, &image);
    command.args(["--parallel", "3", "--action", &mappings[0], "--action", &mappings[1]]);
    let output = tokio::time::timeout(Duration::from_secs(600), command.output()).await.unwrap().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}\n{stderr}");
    assert_eq!(output.status.code(), Some(0), "the run failed");
    let printed = |needle: &str| stdout.lines().any(|l| l.ends_with(needle) && !l.contains("echo "));
    assert!(printed("[prepare] python 3.11 planned the matrix"), "the python step did not run");
    for os in ["linux", "bsd", "mac"] {
        assert!(printed(&format!("[fan ({os})] fan over {os}")), "fan ({os}) did not run");
    }
    for flavour in ["sweet", "sour"] {
        assert!(printed(&format!("[keyed ({flavour})] keyed {flavour}")), "keyed ({flavour}) did not run");
    }
    for n in ["1", "2"] {
        assert!(printed(&format!("[constant ({n})] constant {n}")), "constant ({n}) did not run");
    }
    assert!(printed("[refs] said [v1 says hi] [v2 says hi] for acme/app"), "the two refs or the origin's name did not arrive");
    assert!(stderr.contains("run-local: serving") && stderr.contains(" as acme/app ("), "the repository was not named after its origin");
    assert!(stderr.contains("job \"fan\"'s matrix gives 3: fan (linux), fan (bsd), fan (mac)"), "the expansion was not said");
    assert!(!stdout.contains("'runs-on' key not defined"), "the runner's line about the needed jobs' stand-ins was printed");
    let summary: Vec<String> =
        stderr.lines().filter(|l| l.starts_with("run-local: success ")).map(|l| l.split_whitespace().skip(2).collect::<Vec<_>>().join(" ")).collect();
    for job in ["prepare", "fan (linux)", "fan (bsd)", "fan (mac)", "keyed (sweet)", "keyed (sour)", "constant (1)", "constant (2)", "refs"] {
        assert!(summary.iter().any(|s| s == job), "{job} missing from the summary {summary:?}");
    }

    // Refused with the reason: one ref of one action given twice, a name that is not OWNER/NAME.
    let twice = run_local(&workflow, &image).args(["--action", &mappings[0], "--action", &mappings[0]]).output().await.unwrap();
    assert!(String::from_utf8_lossy(&twice.stderr).contains("acme/say@v1 is served from"), "{}", String::from_utf8_lossy(&twice.stderr));
    let bad = run_local(&workflow, &image).args(["--repository", "acme"]).output().await.unwrap();
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--repository \"acme\" is not OWNER/NAME"), "{}", String::from_utf8_lossy(&bad.stderr));
    testkit::wait_until("run-local's environments are gone", Duration::from_secs(30), || local_environments().is_empty()).await;
}

/// Workflows written by others for GitHub, as published (tests/e2e/workflows/public, each
/// with a SOURCE.md naming its repository, path and commit), run the way act runs them:
/// `runs-on: ubuntu-latest` on this host, the real `actions/checkout@v4` served offline
/// (`e2e::actions`), the clone's `origin` the workflow's own repository.
/// Each one's result, jobs and printed lines are asserted; the lint one also fails on a
/// file it must refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_public_workflows_give_the_results_they_give_on_github() {
    struct Case {
        dir: &'static str,
        origin: &'static str,
        workflow: &'static str,
        /// (result, job) lines of the summary.
        jobs: &'static [(&'static str, &'static str)],
        /// Lines the jobs print, each with how often.
        printed: &'static [(&'static str, usize)],
    }
    let cases = [
        Case {
            dir: "pathogen-optional-need",
            origin: "PathogenPlayground/GitHubActionsTest",
            workflow: ".github/workflows/optional-need.yml",
            jobs: &[
                ("success", "one"),
                ("success", "two"),
                ("skipped", "two-skipped"),
                ("skipped", "two-skipped2"),
                ("success", "end1"),
                ("success", "end2"),
                ("skipped", "end3"),
            ],
            printed: &[("] Hello, world!", 1), ("] I am the last step", 2), ("] Empty world.", 0)],
        },
        Case {
            dir: "kaustubh-dynamic-matrix",
            origin: "kaustubh6686/github-actions-locally",
            workflow: ".github/workflows/dynamic-matrix.yml",
            jobs: &[
                ("success", "Generate Matrix"),
                ("success", "use_generated_matrix (14)"),
                ("success", "use_generated_matrix (16)"),
                ("success", "use_generated_matrix (18)"),
            ],
            printed: &[("] generate_matrix.py", 1), ("] Node version is 14", 1), ("] Node version is 16", 1), ("] Node version is 18", 2)],
        },
        Case {
            dir: "dhruv-passing-var",
            origin: "dhruvkshah75/Github-Actions-Lab",
            workflow: ".github/workflows/05-passing-var.yaml",
            jobs: &[("success", "producer"), ("success", "consumer")],
            printed: &[
                ("] FOO (set via the GITHUB_ENV):    bar", 1),
                ("] FOO (via the github output):     bar", 1),
                ("] FOO (from the output of the producer):    bar", 1),
            ],
        },
        Case { dir: "tpaau-whitespace", origin: "tpaau/shell", workflow: ".github/workflows/whitespace.yml", jobs: &[("success", "build")], printed: &[] },
    ];
    let _turn = e2e::exclusive().await;
    let image = host().image("gitea-runner");
    let actions = tempfile::tempdir().unwrap();
    e2e::actions::unpack("checkout", "v4", &actions.path().join("checkout"));
    let checkout = format!("actions/checkout@v4={}", actions.path().join("checkout").display());
    let run = |root: &std::path::Path, case: &Case| {
        let mut command = run_local(&root.join(case.workflow), &image);
        command.args(["--action", &checkout, "--parallel", "3"]);
        command
    };
    let mut table = Vec::new();
    for case in &cases {
        let root = tempfile::tempdir().unwrap();
        let copied = std::process::Command::new("cp")
            .arg("-a")
            .arg(paths::repository().join("tests/e2e/workflows/public").join(case.dir).join("."))
            .arg(root.path())
            .status();
        assert!(copied.unwrap().success());
        commit_all(root.path());
        add_origin(root.path(), &format!("https://github.com/{}.git", case.origin));
        let started = Instant::now();
        let output = tokio::time::timeout(Duration::from_secs(600), run(root.path(), case).output()).await.unwrap().unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        println!("── {} ──\n{stdout}\n{stderr}", case.dir);
        assert_eq!(output.status.code(), Some(0), "{} failed", case.dir);
        assert!(stderr.contains(&format!(" as {} (", case.origin)), "{}: not named after its origin", case.dir);
        for (result, job) in case.jobs {
            let want = format!("run-local: {result} {job}");
            assert!(stderr.lines().any(|l| l.split_whitespace().collect::<Vec<_>>().join(" ") == want), "{}: {want:?} missing", case.dir);
        }
        for (line, times) in case.printed {
            let seen = stdout.lines().filter(|l| l.ends_with(line) && !l.contains("echo ")).count();
            assert_eq!(seen, *times, "{}: {line:?} printed {seen} times", case.dir);
        }
        table.push(format!("{:<24} {:<40} success, {} jobs, {:.0?}", case.dir, case.origin, case.jobs.len(), started.elapsed()));
        if case.dir == "tpaau-whitespace" {
            // The lint refuses a file with a trailing space: the run fails.
            std::fs::write(root.path().join("bad.txt"), "trailing \n").unwrap();
            let output = tokio::time::timeout(Duration::from_secs(300), run(root.path(), case).output()).await.unwrap().unwrap();
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert_eq!(output.status.code(), Some(1), "the lint passed a trailing space:\n{stderr}");
            assert!(stderr.lines().any(|l| l.split_whitespace().collect::<Vec<_>>().join(" ") == "run-local: failure build"), "{stderr}");
            table.push(format!("{:<24} {:<40} failure with a trailing space, as it must", case.dir, case.origin));
        }
    }
    println!("public workflows through run-local:\n{}", table.join("\n"));
    testkit::wait_until("run-local's environments are gone", Duration::from_secs(30), || local_environments().is_empty()).await;
}
