//! The controller: registers with Gitea as one runner, claims tasks, persists them
//! as assignments, creates one disposable environment per task, and is the only
//! path from environments back to Gitea (see docs/architecture.md).
//!
//! Layout (each folder's `//!` says what it owns and what it may touch):
//! - [`assignment`]: the assignment model — pure derivations from a Gitea task: where
//!   it runs, who it is, how it is stored, how it authenticates.
//! - [`gitea`]: the Gitea client on the Connect layer (registrations, calls).
//! - [`scheduler`]: the FetchTask loops that turn tasks into persisted assignments, and
//!   the keep-alive of assignments nobody reports on yet.
//! - [`store`]: durable queue + records (JetStream or embedded redb).
//! - [`worker`]: environments per placement within capacity; the reconciler.
//! - [`driver`]: one per placement, creating and deleting environments.
//! - [`spire`]: the SPIRE entry of each environment that needs its own (OpenSandbox).
//! - [`facade`]: the environments' only path back to Gitea (service and transports).
//! - [`lifecycle`]: the one place where an assignment ends.
//! - [`app`], [`cli`], [`config`], [`metrics`], [`telemetry`], [`signal`], [`exit`]:
//!   wiring and edges.

#![forbid(unsafe_code)]

pub mod app;
pub mod assignment;
pub mod cli;
pub mod config;
pub mod driver;
pub mod exit;
pub mod facade;
pub mod failpoint;
pub mod gitea;
pub mod lifecycle;
pub mod local;
pub mod metrics;
pub mod placements;
pub mod scheduler;
pub mod signal;
pub mod spire;
pub mod store;
pub mod telemetry;
pub mod worker;

use std::process::ExitCode;

pub use contract::error_chain;

/// Runs the command the user asked for.
///
/// # Errors
/// Whatever stopped the command; printed once by `main`.
pub fn run(cli: cli::Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        cli::Command::Version => {
            println!("controller {} (revision {})", env!("CARGO_PKG_VERSION"), contract::REVISION);
            println!("protocols: runner.v1, ping.v1 (Connect over HTTP/1.1); facade.v1 (gRPC)");
            Ok(ExitCode::SUCCESS)
        }
        cli::Command::Register { config } => {
            let Some(config) = load_config(&config) else { return Ok(ExitCode::from(exit::USAGE)) };
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(app::register(&config))?;
            Ok(ExitCode::SUCCESS)
        }
        cli::Command::RunLocal(args) => {
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let code = runtime.block_on(async {
                let (interrupts, received) = tokio::sync::mpsc::unbounded_channel();
                let signals = tokio::spawn(signal::forward_interrupts(interrupts));
                let code = local::run(*args, received).await;
                signals.abort();
                code
            })?;
            Ok(ExitCode::from(code))
        }
        cli::Command::Run { config, components } => {
            let Some(config) = load_config(&config) else { return Ok(ExitCode::from(exit::USAGE)) };
            let components = match app::Components::parse(&components) {
                Ok(components) => components,
                Err(message) => {
                    eprintln!("controller: {message}");
                    return Ok(ExitCode::from(exit::USAGE));
                }
            };
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            runtime.block_on(async {
                let shutdown = tokio_util::sync::CancellationToken::new();
                let signals = tokio::spawn(signal::stop_on_signals(shutdown.clone()));
                let outcome = app::run(config, components, shutdown.clone()).await;
                signals.abort();
                outcome
            })?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The configuration with GDR_* overrides, or `None` after printing what is wrong.
fn load_config(path: &std::path::Path) -> Option<config::Config> {
    let env: std::collections::BTreeMap<String, String> = std::env::vars().filter(|(k, _)| k.starts_with("GDR_")).collect();
    match config::Config::load(path, &env) {
        Ok(config) => Some(config),
        Err(error) => {
            eprintln!("controller: invalid configuration: {}", error_chain(&error));
            None
        }
    }
}
