//! The supervisor's command line.

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "supervisor", version, about = "PID 1 of a Gitea dynamic runner job environment.")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the version.
    Version,
}
