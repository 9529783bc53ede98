//! The job command (gitea-runner, or any command without a facade) and the signals the
//! agent passes on to it: started in its own process group with none of the
//! environment contract, waited for, and its status turned into the agent's code.

use std::{path::Path, process::Stdio, sync::atomic::AtomicBool};

use nix::{sys::signal::Signal, unistd::Pid};
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::mpsc,
};

use super::{AgentConfig, AgentError, config::CONFIG_ENV};
use crate::{exit::ChildStatus, signals::FORWARDED};

/// Runs the job command, passing signals on, and returns the code it ended with;
/// `stopping` is set when a terminating signal is passed on.
///
/// # Errors
/// When there is no command, it cannot be started, or waiting for it fails.
pub async fn run(config: &AgentConfig, cwd: Option<&Path>, signals: &mut Signals, stopping: Option<&AtomicBool>) -> Result<u8, AgentError> {
    let Some((program, args)) = config.command.split_first() else {
        return Err(AgentError::NoCommand);
    };
    let mut command = tokio::process::Command::new(program);
    command.args(args).stdin(Stdio::inherit()).stdout(Stdio::inherit()).stderr(Stdio::inherit());
    // The runner and its steps see none of the contract (the capability least of all).
    command.env_remove(CONFIG_ENV);
    for name in contract::environment::ALL {
        command.env_remove(name);
    }
    if let Some(cwd) = cwd {
        command.current_dir(cwd);
    }
    if let Some(host) = &config.docker_host {
        command.env("DOCKER_HOST", host);
    }
    // Its own process group, so a terminal's job control does not reach the agent.
    command.process_group(0);
    let mut child = command.spawn().map_err(|source| AgentError::Spawn { program: program.clone(), source })?;
    let pid = child.id().and_then(|id| i32::try_from(id).ok()).map(Pid::from_raw);
    tracing::info!(program, pid = ?pid, "job started");
    loop {
        tokio::select! {
            status = child.wait() => {
                let status = ChildStatus::from_std(status.map_err(AgentError::Wait)?);
                tracing::info!(%status, "job ended");
                return Ok(status.exit_code());
            }
            Some(signal) = signals.recv() => {
                if let Some(stopping) = stopping
                    && matches!(signal, Signal::SIGTERM | Signal::SIGINT)
                {
                    stopping.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                if let Some(pid) = pid {
                    tracing::debug!(%signal, %pid, "forwarding signal to the job");
                    let _ = nix::sys::signal::kill(pid, signal);
                }
            }
        }
    }
}

/// Before the job runs there is nothing to forward to: terminating signals end the
/// agent, the rest (SIGUSR1, SIGWINCH…) are ignored.
pub fn stops_before_start(signal: Signal) -> bool {
    matches!(signal, Signal::SIGTERM | Signal::SIGINT | Signal::SIGHUP | Signal::SIGQUIT)
}

/// The forwarded signals as one stream (the agent is not PID 1: tokio handlers are fine).
#[derive(Debug)]
pub struct Signals {
    receiver: mpsc::UnboundedReceiver<Signal>,
}

impl Signals {
    /// Installs a handler for each signal PID 1 forwards.
    ///
    /// # Errors
    /// When a handler cannot be installed.
    pub fn new() -> std::io::Result<Self> {
        let (sender, receiver) = mpsc::unbounded_channel();
        for forwarded in FORWARDED {
            let mut stream = signal(SignalKind::from_raw(forwarded as i32))?;
            let sender = sender.clone();
            tokio::spawn(async move {
                while stream.recv().await.is_some() {
                    if sender.send(forwarded).is_err() {
                        return;
                    }
                }
            });
        }
        Ok(Signals { receiver })
    }

    pub async fn recv(&mut self) -> Option<Signal> {
        self.receiver.recv().await
    }
}
