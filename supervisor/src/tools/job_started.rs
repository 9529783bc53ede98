//! `supervisor job-started`: gitea-runner's job-started hook. It runs as the runner
//! uid before the first step and blocks it until the identity is ready, dockerd's
//! socket takes connections (dockerd itself may still be starting: a `docker` call waits
//! for it) and a host-mode job's services are up, by asking the agent over its unix
//! socket ([`ready::wait`]). In a `container:`
//! job's container it then brings the loopback in ([`relay::bring_in`]). A non-zero exit
//! fails the job with the message printed here.

use std::{path::Path, time::Duration};

use crate::{
    agent::{ready, relay},
    exit,
};

/// The file name under which the runner's config names the hook: the supervisor runs as
/// `supervisor job-started` when started under it.
pub const HOOK_NAME: &str = "job-started";

/// Asks the agent at `socket` for up to `timeout`; 0 once the environment is ready.
pub fn run(socket: &Path, timeout: Duration) -> u8 {
    match ready::wait(socket, timeout) {
        Ok(readiness) if readiness.is_ready() => {
            println!("supervisor: environment ready — {}", readiness.describe());
            match relay::bring_in(&relay::dir(socket)) {
                Ok(ports) if ports.is_empty() => 0,
                Ok(ports) => {
                    println!("supervisor: this container reaches the environment's loopback (127.0.0.1 ports {ports:?}) through a relay");
                    0
                }
                Err(reason) => {
                    eprintln!("supervisor job-started: this container cannot reach the environment's loopback: {reason}");
                    exit::NOT_READY
                }
            }
        }
        Ok(readiness) if readiness.is_settled() => {
            eprintln!("supervisor job-started: the environment cannot run this job: {}", readiness.missing());
            exit::NOT_READY
        }
        Ok(readiness) => {
            eprintln!("supervisor job-started: the environment is not ready after {timeout:?}: {}", readiness.missing());
            exit::NOT_READY
        }
        Err(reason) => {
            eprintln!("supervisor job-started: {reason}");
            exit::NOT_READY
        }
    }
}
