//! The supervisor: PID 1 of every job environment. It prepares storage and a
//! job-local dockerd, waits for the job's exact SPIFFE identity, claims the task from
//! the controller's facade and serves a loopback RunnerService to an unmodified
//! `gitea-runner daemon --once` (see docs/architecture.md).
//!
//! Layout:
//! - [`cli`]: the command line.

pub mod cli;

use std::process::ExitCode;

/// Runs the command the user asked for.
///
/// # Errors
/// Whatever stopped the command; printed once by `main`.
pub fn run(cli: cli::Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        cli::Command::Version => {
            println!("supervisor {}", env!("CARGO_PKG_VERSION"));
            Ok(ExitCode::SUCCESS)
        }
    }
}
