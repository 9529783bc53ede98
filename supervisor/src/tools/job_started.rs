//! `supervisor job-started`: gitea-runner's job-started hook. It runs as the runner
//! uid before the first step and blocks it until the identity is ready and dockerd's
//! socket takes connections (dockerd itself may still be starting: a `docker` call waits
//! for it), by
//! asking the agent over its unix socket; a non-zero exit fails the job with the
//! message printed here.

use std::{
    io::{BufRead, BufReader, Write},
    os::unix::net::UnixStream,
    path::Path,
    time::{Duration, Instant},
};

use crate::{
    agent::ready::{Readiness, Request},
    cli::JobStartedArgs,
    exit,
};

pub fn run(args: &JobStartedArgs) -> u8 {
    match wait(&args.socket, args.timeout) {
        Ok(readiness) if readiness.is_ready() => {
            println!("supervisor: environment ready — identity: {}; dockerd: {}", readiness.identity, readiness.docker);
            0
        }
        Ok(readiness) => {
            eprintln!("supervisor job-started: the environment is not ready after {:?}: {}", args.timeout, readiness.missing());
            exit::NOT_READY
        }
        Err(reason) => {
            eprintln!("supervisor job-started: {reason}");
            exit::NOT_READY
        }
    }
}

/// Asks the agent, reconnecting while its socket is not there yet, until `timeout`.
///
/// # Errors
/// When the agent could not be asked at all before the deadline.
pub fn wait(socket: &Path, timeout: Duration) -> Result<Readiness, String> {
    let deadline = Instant::now() + timeout;
    let mut last_error;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match ask(socket, left) {
            Ok(readiness) if readiness.is_settled() || left.is_zero() => return Ok(readiness),
            Ok(readiness) => {
                // The agent answered early without being settled (its wait was shorter).
                last_error = readiness.missing();
                if Instant::now() >= deadline {
                    return Ok(readiness);
                }
            }
            Err(error) => last_error = error,
        }
        if Instant::now() >= deadline {
            return Err(format!("cannot ask the supervisor agent at {} ({last_error}); is this environment started by `supervisor run`?", socket.display()));
        }
        std::thread::sleep(Duration::from_millis(100).min(deadline.saturating_duration_since(Instant::now())));
    }
}

fn ask(socket: &Path, wait: Duration) -> Result<Readiness, String> {
    let mut stream = UnixStream::connect(socket).map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(wait + Duration::from_secs(5))).map_err(|e| e.to_string())?;
    let request = Request { wait_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX) };
    let mut line = serde_json::to_vec(&request).map_err(|e| e.to_string())?;
    line.push(b'\n');
    stream.write_all(&line).map_err(|e| format!("send: {e}"))?;
    let mut answer = String::new();
    BufReader::new(stream).read_line(&mut answer).map_err(|e| format!("receive: {e}"))?;
    serde_json::from_str(&answer).map_err(|e| format!("unreadable answer {answer:?}: {e}"))
}
