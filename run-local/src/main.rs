use std::process::ExitCode;

use clap::Parser;
use run_local::cli::Cli;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The terminal is the jobs' log: only this program's warnings besides it.
    controller::telemetry::init(false, "warn");
    match run_local::run::main(cli.args) {
        Ok(code) => ExitCode::from(code),
        Err(error) => {
            eprintln!("run-local: {error:#}");
            ExitCode::from(run_local::exit::JOB_FAILED)
        }
    }
}
