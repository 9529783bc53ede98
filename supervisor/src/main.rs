use std::process::ExitCode;

use clap::Parser;
use supervisor::{cli::Cli, run};

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("supervisor: {error:#}");
            ExitCode::FAILURE
        }
    }
}
