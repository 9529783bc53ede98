//! The controller: registers with Gitea as one runner, claims tasks, persists them
//! as assignments, creates one disposable environment per task, and is the only
//! path from environments back to Gitea (see docs/architecture.md).
//!
//! Layout:
//! - [`cli`]: the command line; [`telemetry`]: logging set-up.
//! - [`placement`], [`identity`], [`envelope`], [`capability`]: pure derivations from
//!   a Gitea task — where it runs, who it is, how it is stored, how it authenticates.
//! - [`store`]: durable queue + records (JetStream or embedded redb).
//! - [`gitea`]: the Gitea client on the Connect layer.
//! - [`scheduler`]: the FetchTask loops that turn tasks into persisted assignments.
//! - [`driver`], [`pool`], [`worker`]: environments per placement within capacity.

#![forbid(unsafe_code)]

pub mod capability;
pub mod cli;
pub mod driver;
pub mod envelope;
pub mod facade;
pub mod gitea;
pub mod identity;
pub mod keepalive;
pub mod placement;
pub mod pool;
pub mod scheduler;
pub mod store;
pub mod telemetry;
pub mod worker;

use std::process::ExitCode;

/// "outer: inner: innermost" in one line.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

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
