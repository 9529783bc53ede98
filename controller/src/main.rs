use std::process::ExitCode;

use clap::Parser;
use controller::{
    cli::Cli,
    commands::{Build, run},
    telemetry,
};

/// The revision comes from scripts/build static (GDR_REVISION): only this file reads
/// it, so a new commit rebuilds this binary's main and nothing else.
const BUILD: Build = Build {
    version: env!("CARGO_PKG_VERSION"),
    revision: match option_env!("GDR_REVISION") {
        Some(revision) => revision,
        None => "unknown",
    },
};

fn main() -> ExitCode {
    let cli = Cli::parse();
    telemetry::init(cli.log_json, "info");
    match run(cli, BUILD) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("controller: {error:#}");
            ExitCode::FAILURE
        }
    }
}
