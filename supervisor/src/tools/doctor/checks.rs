//! The checks, in the order a person would look.

use std::{os::unix::fs::FileTypeExt, path::Path, time::Duration};

use super::{Outcome, Settings};
use crate::pid1::{self, cgroup};

pub fn all(settings: &Settings) -> Vec<Outcome> {
    let identity_socket = identity_socket(settings);
    let socket_ok = identity_socket.status == super::Status::Pass;
    vec![
        pid_one(),
        environment(settings),
        identity_socket,
        svid(settings, socket_ok),
        cgroups(&settings.cgroup_root),
        if settings.job_docker.is_rootless() { rootless(settings) } else { loop_devices(&settings.loop_control) },
        storage(settings),
        dockerd(settings),
        facade(settings),
        runner(settings),
        cache(settings),
        runner_file(settings),
        zombies(),
    ]
}

fn pid_one() -> Outcome {
    let comm = std::fs::read_to_string("/proc/1/comm").unwrap_or_default();
    let comm = comm.trim();
    if comm == "supervisor" {
        Outcome::pass("pid1", "PID 1 is the supervisor")
    } else {
        Outcome::fail(
            "pid1",
            format!("PID 1 is {comm:?}, not the supervisor: nothing reaps orphans, forwards signals or drains dockerd"),
            "make `supervisor run` the image ENTRYPOINT; with shareProcessNamespace the pause process is PID 1, so turn it off",
        )
    }
}

fn environment(settings: &Settings) -> Outcome {
    let mut missing = Vec::new();
    if settings.identity {
        if settings.spiffe_id.is_none() {
            missing.push("CI_SPIFFE_ID");
        }
        if settings.spiffe_endpoint.is_none() {
            missing.push("SPIFFE_ENDPOINT_SOCKET");
        }
    }
    if settings.facade_url.is_some() && settings.assignment_id.is_none() {
        missing.push("CI_ASSIGNMENT_ID");
    }
    if missing.is_empty() {
        Outcome::pass("environment", "the environment contract's variables are set")
    } else {
        Outcome::fail(
            "environment",
            format!("missing {}", missing.join(", ")),
            "the driver injects these (empty counts as missing); identity is on when CI_SPIFFE_ID is set or SUPERVISOR_IDENTITY=true",
        )
    }
}

fn identity_socket(settings: &Settings) -> Outcome {
    const ID: &str = "identity-socket";
    if !settings.identity {
        return Outcome::skip(ID, "identity is off (no CI_SPIFFE_ID, or SUPERVISOR_IDENTITY=false)");
    }
    let Some(endpoint) = &settings.spiffe_endpoint else {
        return Outcome::fail(ID, "SPIFFE_ENDPOINT_SOCKET is not set", "set it to the SPIRE agent's socket, e.g. unix:///run/spire/agent/public/api.sock");
    };
    if let Err(reason) = crate::agent::identity::parse_workload_endpoint(endpoint) {
        return Outcome::fail(ID, reason, "use unix:///absolute/path");
    }
    let Some(path) = endpoint.strip_prefix("unix:").map(|p| p.strip_prefix("//").unwrap_or(p)) else {
        return Outcome::pass(ID, format!("{endpoint} is a TCP endpoint (not probed)"));
    };
    match std::fs::metadata(path) {
        Err(error) => Outcome::fail(
            ID,
            format!("no Workload API socket at {path}: {error}"),
            "mount the SPIRE agent's socket directory into the environment; under Kata a host socket does not cross the VM boundary, so run an agent inside",
        ),
        Ok(meta) if !meta.file_type().is_socket() => {
            Outcome::fail(ID, format!("{path} is not a socket"), "point SPIFFE_ENDPOINT_SOCKET at the agent's api.sock")
        }
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => Outcome::pass(ID, format!("{path} accepts connections")),
            Err(error) => Outcome::fail(ID, format!("cannot connect to {path}: {error}"), "is the SPIRE agent running?"),
        },
    }
}

fn svid(settings: &Settings, socket_ok: bool) -> Outcome {
    const ID: &str = "svid";
    if !settings.identity {
        return Outcome::skip(ID, "identity is off");
    }
    if !socket_ok {
        return Outcome::skip(ID, "the Workload API socket is unreachable (see identity-socket)");
    }
    let (Some(endpoint), Some(expected)) = (&settings.spiffe_endpoint, &settings.spiffe_id) else {
        return Outcome::skip(ID, "CI_SPIFFE_ID is not set (see environment)");
    };
    let uid = nix::unistd::getuid();
    let gids: Vec<u32> = nix::unistd::getgroups().unwrap_or_default().iter().map(|g| g.as_raw()).collect();
    let attested_as = format!("attested as uid {uid}, gid {}, groups {gids:?}", nix::unistd::getgid());
    let result = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string()).and_then(|rt| {
        rt.block_on(async {
            let fetch = async {
                let client = spiffe::WorkloadApiClient::connect_to(endpoint).await?;
                client.fetch_x509_context().await
            };
            match tokio::time::timeout(Duration::from_secs(5), fetch).await {
                Ok(Ok(context)) => Ok(context.svids().iter().map(|s| s.spiffe_id().to_string()).collect::<Vec<_>>()),
                Ok(Err(error)) => Err(error.to_string()),
                Err(_) => Err("no answer within 5 s".to_owned()),
            }
        })
    });
    match result {
        Ok(ids) if ids.iter().any(|id| id == expected) => Outcome::pass(ID, format!("offered {ids:?}, including {expected} ({attested_as})")),
        Ok(ids) => Outcome::fail(
            ID,
            format!("offered {ids:?}, not the expected {expected} ({attested_as})"),
            format!(
                "register an entry for {expected} whose selectors match this workload (e.g. unix:uid:{uid}); SPIRE attests the calling uid, so run doctor as the runner user"
            ),
        ),
        Err(error) => Outcome::fail(
            ID,
            format!("no SVID: {error} ({attested_as})"),
            format!("register an entry for {expected} matching uid {uid}; the agent attests the caller once per stream"),
        ),
    }
}

fn cgroups(root: &Path) -> Outcome {
    const ID: &str = "cgroup";
    match cgroup::detect(root) {
        cgroup::Mode::V1 => Outcome::pass(ID, format!("cgroup v1 at {}: nothing to delegate", root.display())),
        cgroup::Mode::V2 => {
            let procs = std::fs::read_to_string(root.join("cgroup.procs")).unwrap_or_default();
            let subtree = std::fs::read_to_string(root.join("cgroup.subtree_control")).unwrap_or_default();
            let in_root = procs.split_whitespace().count();
            if !root.join("init").is_dir() || in_root > 0 {
                Outcome::fail(
                    ID,
                    format!(
                        "cgroup v2 not nested: {in_root} processes in the root cgroup, init/ {}",
                        if root.join("init").is_dir() { "exists" } else { "missing" }
                    ),
                    "the supervisor moves every process into init/ at start; something started processes in the root afterwards (an exec without cgroup fallback?)",
                )
            } else {
                Outcome::pass(ID, format!("cgroup v2 nested into init/; delegated: {}", subtree.trim()))
            }
        }
    }
}

/// What a rootless dockerd needs from its environment: the tun device slirp4netns
/// opens, subordinate ids for the runner, and newuidmap/newgidmap able to map them.
fn rootless(settings: &Settings) -> Outcome {
    const ID: &str = "rootless";
    let tun = Path::new("/dev/net/tun");
    if let Err(error) = std::fs::OpenOptions::new().read(true).write(true).open(tun) {
        return Outcome::fail(
            ID,
            format!("{} cannot be opened: {error}", tun.display()),
            "the environment needs the host's /dev/net/tun (the docker driver passes it; the host's node must be mode 0666, as udev makes it)",
        );
    }
    let user = "runner";
    for file in ["/etc/subuid", "/etc/subgid"] {
        let text = match std::fs::read_to_string(file) {
            Ok(text) => text,
            Err(error) => {
                return Outcome::fail(ID, format!("cannot read {file}: {error}"), "the runner image has /etc/subuid and /etc/subgid, readable by all");
            }
        };
        if !text.lines().any(|line| line.split(':').next() == Some(user) || line.split(':').next() == Some(&settings.runner_user.uid.to_string())) {
            return Outcome::fail(
                ID,
                format!("{file} has no range for {user}"),
                "the runner image gives the runner 100000:65536 in /etc/subuid and /etc/subgid",
            );
        }
    }
    for tool in ["/usr/bin/newuidmap", "/usr/bin/newgidmap"] {
        if !Path::new(tool).exists() {
            return Outcome::fail(ID, format!("{tool} is missing"), "install the uidmap package in the runner image");
        }
    }
    Outcome::pass(ID, "/dev/net/tun opens; the runner has subordinate uids and gids; newuidmap and newgidmap are there")
}

fn loop_devices(loop_control: &Path) -> Outcome {
    const ID: &str = "loop-devices";
    match std::fs::metadata(loop_control) {
        Err(error) => Outcome::fail(
            ID,
            format!("{} is unusable: {error}", loop_control.display()),
            "the environment must be privileged (or allow c 10:237 and b 7:* with CAP_MKNOD) for loop-backed storage; or mount an emptyDir at /var/lib/docker",
        ),
        Ok(meta) if !meta.file_type().is_char_device() => {
            Outcome::fail(ID, format!("{} is not a character device", loop_control.display()), "it must be c 10:237")
        }
        Ok(_) => match pid1::storage::probe_loop_control(loop_control) {
            Ok(free) => Outcome::pass(ID, format!("{} answers; next free loop device /dev/loop{free}", loop_control.display())),
            Err(error) => Outcome::fail(
                ID,
                format!("{} does not work: {}", loop_control.display(), crate::error_chain(&error)),
                "the device cgroup must allow c 10:237 rwm and b 7:* rwm",
            ),
        },
    }
}

fn storage(settings: &Settings) -> Outcome {
    const ID: &str = "storage";
    if !settings.job_docker.runs_dockerd() {
        return Outcome::skip(ID, "Docker is off (SUPERVISOR_DOCKER=false)");
    }
    if settings.job_docker.is_rootless() {
        return match pid1::dockerd::storage_driver_for(&settings.docker_data_root) {
            "overlay2" => Outcome::pass(ID, format!("{} can hold overlay2 in a user namespace", settings.docker_data_root.display())),
            driver => Outcome::fail(
                ID,
                format!(
                    "{} is on the container's overlay: the rootless dockerd falls back to {driver}, which copies every layer",
                    settings.docker_data_root.display()
                ),
                "give the environment a volume there (the docker driver makes an anonymous one)",
            ),
        };
    }
    match pid1::storage::is_mountpoint(&settings.docker_data_root) {
        Ok(Some(fstype)) if matches!(fstype.as_str(), "ext4" | "xfs" | "btrfs") => {
            Outcome::pass(ID, format!("{} is a {fstype} mount", settings.docker_data_root.display()))
        }
        Ok(Some(fstype)) => Outcome::fail(
            ID,
            format!("{} is a {fstype} mount: overlay2 does not work well on it", settings.docker_data_root.display()),
            "let the supervisor create loop-backed ext4 (no volume at /var/lib/docker) or use an ext4/xfs volume",
        ),
        Ok(None) => Outcome::fail(
            ID,
            format!("{} is not a mountpoint: dockerd would write to the container's root filesystem", settings.docker_data_root.display()),
            "the supervisor mounts loop-backed ext4 there at start; see the supervisor's log for the storage error",
        ),
        Err(error) => Outcome::fail(ID, format!("cannot read the mount table: {error}"), "is /proc mounted?"),
    }
}

fn dockerd(settings: &Settings) -> Outcome {
    const ID: &str = "dockerd";
    if !settings.job_docker.runs_dockerd() {
        return Outcome::skip(ID, "Docker is off (SUPERVISOR_DOCKER=false)");
    }
    match pid1::dockerd::ping(&settings.docker_socket, Duration::from_secs(2)) {
        Ok(latency) => Outcome::pass(ID, format!("{} answered /_ping in {} ms", settings.docker_socket.display(), latency.as_millis())),
        Err(error) => {
            let tail = pid1::dockerd::log_tail(&settings.dockerd_log, 10);
            let tail = if tail.is_empty() {
                format!("{} is empty or missing", settings.dockerd_log.display())
            } else {
                format!("last lines of {}:\n{tail}", settings.dockerd_log.display())
            };
            Outcome::fail(
                ID,
                format!("{}; {tail}", crate::error_chain(&error)),
                "dockerd did not start or died: read its log; common causes are no overlay support on the data root and missing privileges",
            )
        }
    }
}

fn facade(settings: &Settings) -> Outcome {
    const ID: &str = "facade";
    let Some(url) = &settings.facade_url else {
        return Outcome::skip(ID, "CI_RUNNER_FACADE_URL is not set (capability-only or local runs)");
    };
    let authority = url.split_once("://").map_or(url.as_str(), |(_, rest)| rest).split('/').next().unwrap_or("");
    if let Some(path) = url.strip_prefix("unix://") {
        return match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => Outcome::pass(ID, format!("{url} accepts connections")),
            Err(error) => Outcome::fail(ID, format!("cannot connect to {url}: {error}"), "the docker driver mounts the facade socket into the container"),
        };
    }
    use std::net::ToSocketAddrs;
    let addrs: Vec<_> = authority.to_socket_addrs().map(Iterator::collect).unwrap_or_default();
    match addrs.iter().find_map(|a| std::net::TcpStream::connect_timeout(a, Duration::from_secs(3)).ok()) {
        Some(_) => Outcome::pass(ID, format!("{authority} accepts connections")),
        None => Outcome::fail(
            ID,
            format!("cannot reach the facade at {authority}"),
            "check the controller's facade listener and the network policy between environments and the controller",
        ),
    }
}

/// The runner binary, its version, and whether the first step waits for the
/// environment: by the job-started hook (gitea-runner v3 and later, which read
/// `runner.hooks.job_started`), or, for runners without hooks (act_runner, which ignores
/// the key), by the supervisor holding the task back until dockerd's socket takes connections.
pub(super) fn runner(settings: &Settings) -> Outcome {
    const ID: &str = "runner";
    let binary = which(&settings.runner);
    let Some(binary) = binary else {
        return Outcome::fail(ID, format!("{} not found", settings.runner.display()), "the runner image must contain gitea-runner on PATH");
    };
    let says = std::process::Command::new(&binary).arg("--version").output().map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
    let Some(version) = runner_version(&says) else {
        return Outcome::fail(
            ID,
            format!(
                "{} --version printed {:?}, not \"gitea-runner version …\" or \"act_runner version …\"",
                binary.display(),
                says.lines().next().unwrap_or_default()
            ),
            "the image must carry gitea-runner (or act_runner) at /usr/local/bin/gitea-runner",
        );
    };
    let has_hooks = crate::agent::loopback::runner_has_hooks(version);
    let what = format!("{} {version}", binary.display());
    match std::fs::read_to_string(&settings.runner_config) {
        Err(error) => {
            Outcome::fail(ID, format!("{what} found, but {}: {error}", settings.runner_config.display()), "the image must carry /etc/gitea-runner/config.yaml")
        }
        Ok(config) if has_hooks && !config.contains("job_started") => Outcome::fail(
            ID,
            format!("{what} runs job hooks, but {} has no runner.hooks.job_started", settings.runner_config.display()),
            "set runner.hooks.job_started to /usr/local/lib/gitea-dynamic-runner/job-started so steps wait for identity and dockerd",
        ),
        Ok(_) if has_hooks => Outcome::pass(ID, format!("{what} with {} (job_started hook set)", settings.runner_config.display())),
        Ok(_) => Outcome::pass(
            ID,
            format!(
                "{what} has no job hooks: the supervisor hands it the task only once dockerd's socket takes connections ({})",
                settings.runner_config.display()
            ),
        ),
    }
}

/// The jobs' cache: the runner's configuration sends `actions/cache` to the agent's
/// proxy (`cache.external_server`), registering each job with the secret the agent
/// writes into the runner's home (`cache.external_secret_file`).
pub(super) fn cache(settings: &Settings) -> Outcome {
    const ID: &str = "cache";
    let Ok(config) = std::fs::read_to_string(&settings.runner_config) else {
        return Outcome::skip(ID, format!("{} is unreadable (see the runner check)", settings.runner_config.display()));
    };
    let value = |key: &str| config.lines().find_map(|line| line.trim().strip_prefix(key)).map(|value| value.trim().trim_matches('"').to_owned());
    let server = format!("{}/", contract::cache::URL);
    let secret = settings.runner_dir.join(contract::cache::SECRET_FILE).display().to_string();
    let configured = format!(
        "{}: cache.external_server {:?}, cache.external_secret_file {:?}",
        settings.runner_config.display(),
        value("external_server:"),
        value("external_secret_file:")
    );
    if value("external_server:").as_deref() != Some(server.as_str()) || value("external_secret_file:").as_deref() != Some(secret.as_str()) {
        return Outcome::fail(
            ID,
            format!("{configured}: the jobs' actions/cache would not reach the controller's cache"),
            format!("set cache.enabled: true, cache.external_server: {server} and cache.external_secret_file: {secret}"),
        );
    }
    Outcome::pass(ID, format!("actions/cache goes to {server} (the agent's proxy to the controller's cache)"))
}

/// The version in a runner's `--version` line: "gitea-runner version v3.3.0" or
/// "act_runner version v0.2.12".
fn runner_version(says: &str) -> Option<&str> {
    let mut words = says.lines().next()?.split_whitespace();
    match (words.next(), words.next(), words.next()) {
        (Some("gitea-runner" | "act_runner"), Some("version"), Some(version)) => Some(version),
        _ => None,
    }
}

/// The `.runner` the agent wrote (and the runner may have rewritten: act_runner drops
/// `ephemeral`, which it does not know, and both write labels as `name:host`): pointing
/// the runner at the loopback RunnerService, for this assignment, not persistent, readable
/// by the runner user only.
fn runner_file(settings: &Settings) -> Outcome {
    const ID: &str = "runner-file";
    let path = settings.runner_dir.join(".runner");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return Outcome::skip(ID, format!("{} does not exist (written once the agent claimed the task)", path.display()));
        }
        Err(error) => return Outcome::fail(ID, format!("cannot read {}: {error}", path.display()), "run doctor as the runner user or as root"),
    };
    let Ok(value) = serde_json::from_str::<serde_json::Value>(&text) else {
        return Outcome::fail(ID, format!("{} is not JSON", path.display()), "the agent writes it; do not edit it");
    };
    let mut problems = Vec::new();
    let address = value["address"].as_str().unwrap_or("");
    if !address.starts_with("http://127.0.0.1:") {
        problems.push(format!("address {address:?} is not the loopback RunnerService"));
    }
    if value["ephemeral"] == false {
        problems.push("not ephemeral".to_owned());
    }
    if let Some(expected) = &settings.assignment_id
        && value["uuid"].as_str() != Some(expected.as_str())
    {
        problems.push(format!("uuid {} is not the assignment {expected}", value["uuid"]));
    }
    use std::os::unix::fs::PermissionsExt;
    if std::fs::metadata(&path).map(|m| m.permissions().mode() & 0o077).unwrap_or(0) != 0 {
        problems.push("readable by others (it holds the local runner token)".to_owned());
    }
    if problems.is_empty() {
        Outcome::pass(ID, format!("{} points gitea-runner at {address}", path.display()))
    } else {
        Outcome::fail(
            ID,
            format!("{}: {}", path.display(), problems.join("; ")),
            "the agent rewrites it on its next start; a stale file from another assignment must go",
        )
    }
}

pub(super) fn which(program: &Path) -> Option<std::path::PathBuf> {
    if program.components().count() > 1 {
        return program.exists().then(|| program.to_owned());
    }
    std::env::var_os("PATH").and_then(|path| std::env::split_paths(&path).map(|dir| dir.join(program)).find(|p| p.is_file()))
}

fn zombies() -> Outcome {
    const ID: &str = "zombies";
    let mut zombies = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
            if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                && let Some((ppid, 'Z')) = pid1::parse_stat(&stat)
            {
                zombies.push(format!("{pid} (parent {ppid})"));
            }
        }
    }
    if zombies.is_empty() {
        Outcome::pass(ID, "no zombie processes")
    } else {
        Outcome::fail(
            ID,
            format!("{} zombies: {}", zombies.len(), zombies.join(", ")),
            "a parent is not reaping; if the parent is PID 1, PID 1 is not the supervisor",
        )
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_a_runners_version_line_counts() {
        for (says, expected) in [
            ("gitea-runner version v3.3.0\n", Some("v3.3.0")),
            ("act_runner version v0.2.12", Some("v0.2.12")),
            ("true (GNU coreutils) 9.1\n", None),
            ("", None),
            ("gitea-runner version", None),
        ] {
            assert_eq!(super::runner_version(says), expected, "{says:?}");
        }
    }
}
