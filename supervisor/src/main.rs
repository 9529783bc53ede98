//! The `supervisor` binary: parses the command line (flags, then the environment
//! contract), sets up logging and hands each command to its module.

use std::process::ExitCode;

use clap::Parser;
use supervisor::{
    agent,
    cli::{Cli, Command},
    exit, init_logging,
    pid1::{self, run},
    tools::{self, docker_shim, doctor, job_started},
};

/// The revision comes from scripts/build static (GDR_REVISION): only this file reads it,
/// so a new commit rebuilds this binary's main and no library.
const REVISION: &str = match option_env!("GDR_REVISION") {
    Some(revision) => revision,
    None => "unknown",
};

fn main() -> ExitCode {
    // The image's /usr/local/bin/docker is this binary.
    if tools::invoked_as("docker") {
        return ExitCode::from(docker_shim::run());
    }
    // gitea-runner runs its job-started hook by path and without arguments — in the
    // environment, or in a `container:` job's container, where the hook's path is this
    // binary mounted (/etc/gitea-runner/config.yaml). With arguments it is the
    // supervisor there (`job-started doctor --step`).
    let hook = tools::invoked_as(job_started::HOOK_NAME) && std::env::args_os().len() == 1;
    let parsed = if hook { Cli::try_parse_from(["supervisor", "job-started"]) } else { Cli::try_parse() };
    let cli = match parsed {
        Ok(cli) => cli,
        Err(error) => {
            let _ = error.print();
            return ExitCode::from(if error.use_stderr() { exit::USAGE } else { 0 });
        }
    };
    let code = match cli.command {
        Command::Run(mut args) => {
            // Before anything else, and before any thread exists: see pid1::block_signals.
            if let Err(error) = pid1::block_signals() {
                eprintln!("supervisor: {}", supervisor::error_chain(&error));
                return ExitCode::from(exit::INTERNAL);
            }
            init_logging("supervisor");
            tracing::info!(version = env!("CARGO_PKG_VERSION"), revision = REVISION, "supervisor");
            let contract = contract::environment::Contract::from_process_env();
            if let Err(message) = supervisor::cli::apply_contract(&mut args, &contract).and_then(|()| supervisor::cli::validate(&args)) {
                eprintln!("error: {message}\n\nFor more information, try 'supervisor run --help'.");
                return ExitCode::from(exit::USAGE);
            }
            run::run(args.settings())
        }
        Command::Agent => {
            init_logging("supervisor agent");
            agent::run()
        }
        Command::JobStarted(args) => job_started::run(&args.socket, args.timeout),
        Command::Doctor(mut args) => {
            let contract = contract::environment::Contract::from_process_env();
            if let Err(message) = args.environment.apply_contract(&contract) {
                eprintln!("error: {message}");
                return ExitCode::from(exit::USAGE);
            }
            doctor::run(&args.settings(), args.json)
        }
        Command::LoopbackRelay { dir } => agent::relay::run_relay(&dir),
        Command::Activate(args) => pid1::dockerd::activate(&args),
        Command::Version => {
            println!("supervisor {} (revision {REVISION})", env!("CARGO_PKG_VERSION"));
            0
        }
    };
    ExitCode::from(code)
}
