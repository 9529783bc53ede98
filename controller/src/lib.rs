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

pub mod app;
pub mod capability;
pub mod cli;
pub mod config;
pub mod driver;
pub mod envelope;
pub mod facade;
pub mod failpoint;
pub mod gitea;
pub mod identity;
pub mod keepalive;
pub mod local;
pub mod metrics;
pub mod placement;
pub mod pool;
pub mod scheduler;
pub mod store;
pub mod telemetry;
#[cfg(feature = "test-driver")]
pub mod test_driver;
pub mod worker;

use std::process::ExitCode;

pub use connect::error_chain;

/// Exit code for invalid configuration (EX_USAGE).
pub const EXIT_USAGE: u8 = 64;

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
        cli::Command::Run { config, components } => {
            let env: std::collections::BTreeMap<String, String> = std::env::vars().filter(|(k, _)| k.starts_with("GDR_")).collect();
            let config = match config::Config::load(&config, &env) {
                Ok(config) => config,
                Err(error) => {
                    eprintln!("controller: invalid configuration: {}", error_chain(&error));
                    return Ok(ExitCode::from(EXIT_USAGE));
                }
            };
            let components = match app::Components::parse(&components) {
                Ok(components) => components,
                Err(message) => {
                    eprintln!("controller: {message}");
                    return Ok(ExitCode::from(EXIT_USAGE));
                }
            };
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            runtime.block_on(async {
                let shutdown = tokio_util::sync::CancellationToken::new();
                let signals = tokio::spawn(stop_on_signals(shutdown.clone()));
                let outcome = app::run(config, components, shutdown.clone()).await;
                signals.abort();
                outcome
            })?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The first SIGTERM or SIGINT starts a graceful stop; a second one ends the process now.
async fn stop_on_signals(shutdown: tokio_util::sync::CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        return;
    };
    for round in 0..2 {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        if round == 0 {
            tracing::info!("stopping: finishing in-flight work (signal again to stop at once)");
            shutdown.cancel();
        } else {
            tracing::warn!("second signal: exiting now");
            std::process::abort();
        }
    }
}
