//! `docker` where the environment has none. The image links /usr/local/bin/docker (ahead of
//! the real CLI in PATH) to the supervisor. In the safe default of the docker and
//! kubernetes placements no dockerd runs, and the CLI's own answer — `Cannot connect to the
//! Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?` — says
//! nothing of why or what to change. Here such a call gets one line saying that this
//! environment has no Docker by design and which setting or placement gives one. With a
//! Docker (`DOCKER_HOST` set, as the supervisor sets it for a job-local dockerd, or a socket
//! at the default path) and for what needs no daemon (`--version`, `--help`), the real CLI
//! runs unchanged.

use std::{
    ffi::{OsStr, OsString},
    os::unix::process::CommandExt,
    path::Path,
    process::Command,
};

/// The Docker CLI the image's docker.io package installs.
pub const REAL_CLI: &str = "/usr/bin/docker";
const DEFAULT_SOCKET: &str = "/var/run/docker.sock";

/// What a step that calls `docker` without a Docker is told (one line).
pub const NO_DOCKER: &str = "docker: this environment has no Docker: jobs here run without one, the default for untrusted code. \
     For docker build, docker run, services: and container: the runner's operator sets job_docker = \"rootless\" \
     (docker placement: a Docker of the job's own, no step is root on the host) or job_docker = \"root\" \
     (a step is root on the host: trusted code only), or the job asks for a VM: runs-on: [disposable, vm].";

#[derive(Debug, PartialEq, Eq)]
pub enum Decision {
    /// Run the real CLI with the same arguments.
    Real,
    /// Say [`NO_DOCKER`] and fail.
    NoDocker,
}

/// `args` without the program name; `docker_host` as the environment has it; whether
/// `DOCKER_CONTEXT` names a context.
pub fn decide(args: &[OsString], docker_host: Option<&OsStr>, docker_context: bool, default_socket_exists: bool) -> Decision {
    let first = args.first().and_then(|a| a.to_str());
    // Global flags (`-H`, `--context`, `--version`) may name another Docker; these
    // commands need none, or a remote one.
    let needs_no_local_daemon = first.is_none_or(|first| {
        first.starts_with('-') || matches!(first, "help" | "completion" | "login" | "logout" | "context" | "manifest" | "buildx" | "trust" | "version")
    });
    if needs_no_local_daemon || docker_host.is_some_and(|host| !host.is_empty()) || docker_context || default_socket_exists {
        Decision::Real
    } else {
        Decision::NoDocker
    }
}

/// Runs as `docker`: execs the real CLI or says why there is none. Returns the exit code
/// (only when the real CLI did not replace this process).
pub fn run() -> u8 {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let context = std::env::var_os("DOCKER_CONTEXT").is_some_and(|c| !c.is_empty());
    match decide(&args, std::env::var_os("DOCKER_HOST").as_deref(), context, Path::new(DEFAULT_SOCKET).exists()) {
        Decision::Real => {
            let error = Command::new(REAL_CLI).args(&args).exec();
            eprintln!("docker: cannot run {REAL_CLI}: {error}");
            127
        }
        Decision::NoDocker => {
            eprintln!("{NO_DOCKER}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_that_needs_a_daemon_is_told_there_is_none_unless_there_is_one() {
        // Arguments, DOCKER_HOST, DOCKER_CONTEXT set, /var/run/docker.sock there, the decision.
        type Case<'a> = (&'a [&'a str], Option<&'a str>, bool, bool, Decision);
        let table: &[Case] = &[
            (&["build", "."], None, false, false, Decision::NoDocker),
            (&["run", "--rm", "alpine"], Some(""), false, false, Decision::NoDocker),
            (&["ps"], Some("unix:///run/gdr/docker.sock"), false, false, Decision::Real),
            (&["ps"], Some("tcp://builder:2375"), false, false, Decision::Real),
            (&["ps"], None, false, true, Decision::Real),
            (&["ps"], None, true, false, Decision::Real),
            (&["-H", "tcp://builder:2375", "build", "."], None, false, false, Decision::Real),
            (&["--context", "remote", "ps"], None, false, false, Decision::Real),
            (&["login", "registry.example.org"], None, false, false, Decision::Real),
            (&["buildx", "build", "."], None, false, false, Decision::Real),
            (&["--version"], None, false, false, Decision::Real),
            (&["--help"], None, false, false, Decision::Real),
            (&[], None, false, false, Decision::Real),
            (&["compose", "up"], None, false, false, Decision::NoDocker),
        ];
        for (args, host, context, socket, want) in table {
            let args: Vec<OsString> = args.iter().map(OsString::from).collect();
            assert_eq!(&decide(&args, host.map(OsStr::new), *context, *socket), want, "{args:?} {host:?} {context} {socket}");
        }
    }
}
