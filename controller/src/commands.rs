//! The controller's commands: what `controller <command>` does, once its arguments
//! are parsed and logging is set up.

use std::process::ExitCode;

use crate::{app, cli, config, error_chain, exit, signal};

/// The build: its version and the source revision its binary was built from.
#[derive(Debug, Clone, Copy)]
pub struct Build {
    pub version: &'static str,
    pub revision: &'static str,
}

/// Runs the command the user asked for.
///
/// # Errors
/// Whatever stopped the command; printed once by `main`.
pub fn run(cli: cli::Cli, build: Build) -> anyhow::Result<ExitCode> {
    match cli.command {
        cli::Command::Version => {
            println!("controller {} (revision {})", build.version, build.revision);
            println!("protocols: runner.v1, ping.v1 (Connect over HTTP/1.1); facade.v1 (gRPC)");
            Ok(ExitCode::SUCCESS)
        }
        cli::Command::Register { config } => {
            let Some(config) = load_config(&config) else { return Ok(ExitCode::from(exit::USAGE)) };
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(app::register(&config))?;
            Ok(ExitCode::SUCCESS)
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
            tracing::info!(version = build.version, revision = build.revision, "controller starting");
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
