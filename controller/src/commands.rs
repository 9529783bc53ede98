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
        cli::Command::Probe { config, check } => {
            let Some(config) = load_config(&config) else { return Ok(ExitCode::from(exit::USAGE)) };
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(probe(&config, &check))?;
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

/// `GET /<check>` on the controller's own `[http]` listener (its unspecified address
/// reached as loopback).
async fn probe(config: &config::Config, check: &str) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let listen: std::net::SocketAddr = config.http.listen.parse().with_context(|| format!("http.listen {:?} is not an address", config.http.listen))?;
    let host = match listen.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => std::net::IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    let url = format!("http://{}/{check}", std::net::SocketAddr::new(host, listen.port()));
    // reqwest needs a TLS backend even for plain HTTP (its rustls has no provider of its
    // own): one that trusts nothing, as nothing here is TLS. A proxy from the environment
    // must not stand between a Pod and itself.
    let tls = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .context("cannot set up the HTTP client")?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let client = reqwest::Client::builder().tls_backend_preconfigured(tls).timeout(std::time::Duration::from_secs(5)).no_proxy().build()?;
    let response = client.get(&url).send().await.with_context(|| format!("no answer from {url}: is the controller running?"))?;
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    anyhow::ensure!(status.is_success(), "{url} answered {status}: {}", body.trim());
    Ok(())
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
