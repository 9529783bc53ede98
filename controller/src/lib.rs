//! The controller: registers with Gitea as one runner, claims tasks, persists them
//! as assignments, creates one disposable environment per task, and is the only
//! path from environments back to Gitea (see docs/architecture.md).
//!
//! Layout:
//! - [`cli`]: the command line.
//! - [`telemetry`]: logging set-up.

#![forbid(unsafe_code)]

pub mod cli;
pub mod telemetry;

use std::process::ExitCode;

/// Runs the command the user asked for.
///
/// # Errors
/// Whatever stopped the command; printed once by `main`.
pub fn run(cli: cli::Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        cli::Command::Version => {
            println!("controller {}", env!("CARGO_PKG_VERSION"));
            println!("protocols: runner.v1, ping.v1 (Connect over HTTP/1.1); facade.v1 (gRPC)");
            Ok(ExitCode::SUCCESS)
        }
    }
}
