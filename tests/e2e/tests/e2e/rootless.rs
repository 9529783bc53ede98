//! A rootless dockerd per job (`docker.rootless_dockerd`), through the real Gitea, the
//! controller, the runner image with the supervisor and the real gitea-runner, on a real
//! dockerd: `docker build` and `docker run`, the image pulled through the operator's
//! registry mirror (a real registry on the host), while a step's attempts at the host
//! through its own Docker (`--privileged`, `-v /:/host`, `--pid=host`, the host's disk as
//! a device) are refused. (`container:` and `services:` in this mode: container_jobs.rs.)

use std::time::Duration;

use e2e::{
    docker::host,
    images::push_busybox,
    stack::{Controller, Options},
};
use testkit::{
    gitea::{Gitea, GiteaOptions, TaskInfo, strip_log_timestamps},
    registry::Registry,
};

/// Each attempt runs a container of the job's own Docker that tries to read a file only
/// the host's root can read, and prints `ATTACK name: reach|refused detail`.
const ATTEMPTS: &str = r#"
set +e
attempt() { # NAME SCRIPT DOCKER-RUN-ARGUMENTS…
  name=$1 script=$2; shift 2
  out=$(docker run --rm "$@" gdr-tools sh -c "$script" 2>&1)
  if printf '%s' "$out" | grep -q "$HOST_MARKER_VALUE"; then echo "ATTACK $name: reach $(printf '%s' "$out" | tr '\n' ' ' | head -c 200)"
  else echo "ATTACK $name: refused $(printf '%s' "$out" | tr '\n' ' ' | head -c 200)"; fi
}
read_marker="cat /host$HOST_MARKER; head -n1 /proc/self/uid_map"
attempt privileged "$read_marker" --privileged -v /:/host
attempt root-filesystem "$read_marker" -v /:/host
attempt host-pid "cat /proc/1/root$HOST_MARKER; ps | head -n3" --pid=host
# The host's disk, by the device number of the filesystem the runtime's /etc/hosts is on.
disk=$(awk '$5 == "/etc/hosts" { for (i = 7; i <= NF; i++) if ($i == "-") { print $3, $(i + 1); exit } }' /proc/self/mountinfo)
set -- $disk
attempt host-disk "mknod /disk b ${1%:*} ${1#*:} && mkdir -p /mnt/host && mount -t $2 /disk /mnt/host && cat /mnt/host$HOST_MARKER" \
  --cap-add ALL --device-cgroup-rule 'b *:* rmw' --security-opt seccomp=unconfined
echo "step: uid $(id -u), setuid files: $(find / -xdev -type f -perm /6000 2>/dev/null | wc -l)"
docker run --rm gdr-tools sh -c 'echo "a container'"'"'s root is uid $(awk "NR == 1 { print \$2 }" /proc/self/uid_map) outside its namespace"'
"#;

fn workflow(marker: &std::path::Path, marker_value: &str) -> String {
    use base64::Engine as _;
    let attempts = base64::engine::general_purpose::STANDARD.encode(ATTEMPTS);
    format!(
        r#"name: rootless
on: push
jobs:
  build:
    runs-on: [disposable, container, docker]
    steps:
      - name: docker build and docker run
        run: |
          printf 'FROM gdr-tools\nRUN echo "built by $(id -u) in the job" > /built\n' > Dockerfile
          docker build -q -t app:1 .
          docker run --rm app:1 cat /built
          docker info --format 'the job docker: {{{{.SecurityOptions}}}}'
      - name: attempts at the host through the job's Docker
        env:
          SCRIPT: "{attempts}"
          HOST_MARKER: "{marker}"
          HOST_MARKER_VALUE: "{marker_value}"
        run: echo "$SCRIPT" | base64 -d > /tmp/attempts.sh && sh /tmp/attempts.sh
"#,
        marker = marker.display(),
    )
}

fn finished(tasks: &[TaskInfo], jobs: usize) -> bool {
    tasks.len() >= jobs && tasks.iter().all(|t| !t.is_open())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rootless_job_docker_builds_runs_and_keeps_the_host_out() {
    let turn = e2e::exclusive().await;
    let docker = host();
    let image = docker.image("gitea-runner");
    let registry = tokio::task::block_in_place(Registry::start);
    tokio::task::block_in_place(|| {
        push_busybox(&registry, "gdr-tools", r#"["/bin/sh"]"#, "");
    });
    let gitea = Gitea::start(GiteaOptions { bind: docker.bridge_ip.into(), ..GiteaOptions::default() }).await;
    let repo = gitea.create_repo("rootless").await;
    let token = gitea.runner_registration_token().await;
    let mut options = Options::new(&gitea.url(), &token, &image, &docker.socket);
    options.job_dockerd = false;
    options.capacity = 1;
    options.docker_extra = format!("job_docker = \"rootless\"\nregistry_mirrors = [\"http://{}:{}\"]", docker.bridge_ip, registry.port);
    let mut controller = Controller::start(options).await;
    let marker = controller.state_dir.join("host-marker");
    let marker_value = format!("host-only-{}", fastrand::u64(..));
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&marker).unwrap();
        std::io::Write::write_all(&mut file, marker_value.as_bytes()).unwrap();
    }

    gitea.commit_workflow(&repo, "rootless.yml", &workflow(&marker, &marker_value)).await;
    let tasks = gitea.wait_for_tasks(&repo, Duration::from_secs(420), |t| finished(t, 1)).await;
    let run = tasks[0].run_number;
    let mut logs = String::new();
    for (index, job) in ["build"].into_iter().enumerate() {
        let log = strip_log_timestamps(&gitea.job_log(&repo, run, index).await);
        println!(
            "--- {job}:\n{}",
            log.lines().filter(|l| l.contains("ATTACK") || l.contains("said") || l.contains("inside") || l.contains("built by")).collect::<Vec<_>>().join("\n")
        );
        logs.push_str(&log);
    }
    let statuses: Vec<(&str, &str)> = tasks.iter().map(|t| (t.name.as_str(), t.status.as_str())).collect();
    assert!(tasks.iter().all(|t| t.status == "success"), "{statuses:?}\n{logs}\nregistry:\n{}", registry.log());

    // Built and run by the job's own Docker, as the runner.
    assert!(logs.contains("built by 0 in the job"), "{logs}");
    assert!(logs.lines().any(|l| l.contains("the job docker: ") && l.contains("name=rootless")), "{logs}");
    let pulled = registry.log();
    assert!(pulled.contains("/v2/library/gdr-tools/manifests/latest"), "gdr-tools was not pulled through the mirror:\n{pulled}");
    // The host stays out of reach.
    // (The log shows the step's environment, the value to look for included.)
    assert!(!logs.lines().any(|l| l.contains("ATTACK") && l.contains(&marker_value)), "the host's file reached the job:\n{logs}");
    for attempt in ["privileged", "root-filesystem", "host-pid", "host-disk"] {
        let line = logs.lines().find(|l| l.contains(&format!("ATTACK {attempt}: "))).unwrap_or_else(|| panic!("{attempt} did not report:\n{logs}"));
        assert!(line.contains(&format!("ATTACK {attempt}: refused")), "{line}");
    }
    // The step runs as a host uid of its own (docker.runner_ids' default range), which is
    // also what the root of its containers is outside their namespace.
    let uid: u32 = logs
        .lines()
        .find_map(|l| l.trim().strip_prefix("step: uid ")?.strip_suffix(", setuid files: 0")?.parse().ok())
        .unwrap_or_else(|| panic!("no step uid with no setuid file:\n{logs}"));
    assert!((2_000_000..2_000_256).contains(&uid), "the step's uid {uid} is not one of docker.runner_ids':\n{logs}");
    assert!(logs.contains(&format!("a container's root is uid {uid} outside its namespace")), "{logs}");

    let label = controller.environment_label();
    testkit::wait_until("every environment is removed", Duration::from_secs(90), || docker.containers(&label).is_empty()).await;
    controller.stop().await;
    drop(turn);
}
