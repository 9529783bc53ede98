use std::process::ExitCode;

use clap::Parser;
use controller::{cli::Cli, run, telemetry};

fn main() -> ExitCode {
    let cli = Cli::parse();
    telemetry::init(cli.log_json);
    match run(cli) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("controller: {error:#}");
            ExitCode::FAILURE
        }
    }
}
