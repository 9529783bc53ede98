//! What ends the agent before its job could end it, and the exit code each failure
//! gives: the one place where an agent failure becomes a code (as firecracker maps its
//! `MainError`), so the code and the message cannot drift apart.

use std::path::PathBuf;

use super::{
    config::{CAPABILITY_ENV, CONFIG_ENV},
    facade_client::FacadeClientError,
    proxy::ProxyError,
};
use crate::exit;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot make itself non-dumpable; refusing to hold the capability where the job's steps could read it")]
    NotDumpable(#[source] nix::Error),
    #[error("invalid {CONFIG_ENV}: {0}; the agent is started by `supervisor run`")]
    Config(String),
    #[error("cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
    #[error("cannot listen on the readiness socket {}", .socket.display())]
    ReadinessSocket { socket: PathBuf, source: std::io::Error },
    #[error("cannot listen on the job's docker socket {} (the rootless dockerd's)", .socket.display())]
    DockerSocket { socket: PathBuf, source: std::io::Error },
    #[error("the readiness state is gone")]
    ReadinessLost,
    #[error("no usable SPIFFE identity for this job: {0}")]
    Identity(String),
    #[error("the job's dockerd failed: {0}")]
    Docker(String),
    #[error("no capability: PID 1 hands it over on fd 4 (from {CAPABILITY_ENV} or the file the driver names); started by hand, set {CAPABILITY_ENV}")]
    NoCapability,
    #[error("cannot reach the controller's facade")]
    Facade(#[source] FacadeClientError),
    #[error("cannot claim the task")]
    Claim(#[source] FacadeClientError),
    #[error("no randomness for the local runner token")]
    Randomness(#[source] std::io::Error),
    #[error("cannot set up the pass-through to Gitea")]
    PassThrough(#[source] ProxyError),
    #[error("cannot listen on 127.0.0.1")]
    Loopback(#[source] std::io::Error),
    #[error("cannot serve the loopback's ports as sockets in {} (a `container:` job's way to them)", .dir.display())]
    PortSockets { dir: PathBuf, source: std::io::Error },
    #[error("cannot write .runner in {}", .dir.display())]
    RunnerFile { dir: PathBuf, source: std::io::Error },
    #[error("no job command")]
    NoCommand,
    #[error("cannot run the job command {program}")]
    Spawn { program: String, source: std::io::Error },
    #[error("waiting for the job failed")]
    Wait(#[source] std::io::Error),
}

impl AgentError {
    /// The code the agent (and so the supervisor) exits with.
    pub fn exit_code(&self) -> u8 {
        match self {
            AgentError::Config(_) | AgentError::NoCapability | AgentError::PassThrough(_) | AgentError::NoCommand => exit::USAGE,
            AgentError::Identity(_) => exit::IDENTITY,
            AgentError::Docker(_) | AgentError::DockerSocket { .. } => exit::DOCKER,
            AgentError::Facade(_) | AgentError::Claim(_) => exit::CLAIM,
            AgentError::Spawn { source, .. } => exit::spawn_failure(source),
            AgentError::NotDumpable(_)
            | AgentError::Runtime(_)
            | AgentError::Signals(_)
            | AgentError::ReadinessSocket { .. }
            | AgentError::ReadinessLost
            | AgentError::Randomness(_)
            | AgentError::Loopback(_)
            | AgentError::PortSockets { .. }
            | AgentError::RunnerFile { .. }
            | AgentError::Wait(_) => exit::INTERNAL,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Error, ErrorKind};

    use super::*;

    #[test]
    fn each_failure_has_its_code() {
        let io = || Error::from(ErrorKind::Other);
        let table: Vec<(AgentError, u8)> = vec![
            (AgentError::Config("missing".into()), exit::USAGE),
            (AgentError::NoCapability, exit::USAGE),
            (AgentError::NoCommand, exit::USAGE),
            (AgentError::PassThrough(ProxyError::Url("ftp://x".into())), exit::USAGE),
            (AgentError::Identity("no SVID".into()), exit::IDENTITY),
            (AgentError::Docker("exited with 1".into()), exit::DOCKER),
            (AgentError::Facade(FacadeClientError::MissingSpiffe), exit::CLAIM),
            (AgentError::Claim(FacadeClientError::Url("x".into())), exit::CLAIM),
            (AgentError::Spawn { program: "gitea-runner".into(), source: Error::from(ErrorKind::NotFound) }, exit::COMMAND_NOT_FOUND),
            (AgentError::Spawn { program: "gitea-runner".into(), source: Error::from(ErrorKind::PermissionDenied) }, exit::COMMAND_NOT_EXECUTABLE),
            (AgentError::Spawn { program: "gitea-runner".into(), source: io() }, exit::INTERNAL),
            (AgentError::Runtime(io()), exit::INTERNAL),
            (AgentError::Signals(io()), exit::INTERNAL),
            (AgentError::ReadinessSocket { socket: "/run/s".into(), source: io() }, exit::INTERNAL),
            (AgentError::ReadinessLost, exit::INTERNAL),
            (AgentError::Randomness(io()), exit::INTERNAL),
            (AgentError::Loopback(io()), exit::INTERNAL),
            (AgentError::PortSockets { dir: "/run/s/loopback".into(), source: io() }, exit::INTERNAL),
            (AgentError::RunnerFile { dir: "/r".into(), source: io() }, exit::INTERNAL),
            (AgentError::Wait(io()), exit::INTERNAL),
            (AgentError::NotDumpable(nix::Error::EPERM), exit::INTERNAL),
        ];
        for (error, code) in table {
            assert_eq!(error.exit_code(), code, "{error}");
        }
    }
}
