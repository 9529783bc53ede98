//! The controller's command line.

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
    /// Print the version and the protocols this build speaks.
    Version,
}
