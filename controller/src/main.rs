use std::process::ExitCode;

use clap::Parser;
use controller::{cli::Cli, run, telemetry};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_level = if matches!(cli.command, controller::cli::Command::RunLocal(_)) { "warn" } else { "info" };
    telemetry::init(cli.log_json, default_level);
    match run(cli) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("controller: {error:#}");
            ExitCode::FAILURE
        }
    }
}
