//! The controller's command line.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "controller", version, about = "Runs every Gitea Actions job in its own disposable environment.")]
pub struct Cli {
    /// Log as JSON lines instead of human-readable text.
    #[arg(long, global = true, env = "CONTROLLER_LOG_JSON")]
    pub log_json: bool,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the controller: register with Gitea, claim tasks, create environments, serve the facade.
    Run {
        /// The TOML configuration (see config/controller.example.toml); GDR_* variables override it.
        #[arg(long, env = "GDR_CONFIG", value_name = "FILE")]
        config: PathBuf,
        /// Components of this process: scheduler, facade, worker, worker:<placement>,
        /// pod-worker, vm-worker (comma-separated; default: all).
        #[arg(long, env = "GDR_COMPONENTS", default_value = "scheduler,facade,worker")]
        components: String,
    },
    /// Register every configured placement's runner with Gitea (or load the stored
    /// credentials), Declare its labels, print the credential files and exit. Run it
    /// once before starting several replicas: they must share these files.
    Register {
        #[arg(long, env = "GDR_CONFIG", value_name = "FILE")]
        config: PathBuf,
    },
    /// Ask the running controller of this configuration for /readyz or /healthz on its
    /// `[http]` listener and exit 0 if it answers 200: the Kubernetes probe where that
    /// listener is kept off the Pod network (loopback).
    Probe {
        #[arg(long, env = "GDR_CONFIG", value_name = "FILE")]
        config: PathBuf,
        /// `readyz` or `healthz`.
        #[arg(value_parser = ["readyz", "healthz"])]
        check: String,
    },
    /// Print the version and the protocols this build speaks.
    Version,
}
