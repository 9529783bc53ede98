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
    /// Run one job of a workflow file here, in a local Docker container from the runner
    /// image, with no Gitea: the log streams to the terminal and the exit code is the
    /// job's (0 success, 1 failure, 130 cancelled). Ctrl-C cancels the job.
    RunLocal(Box<RunLocalArgs>),
    /// Print the version and the protocols this build speaks.
    Version,
}

/// `controller run-local`: what to run and with what, the way `act` takes it.
#[derive(Debug, Clone, clap::Args)]
pub struct RunLocalArgs {
    /// The workflow file (e.g. examples/hello.yml).
    #[arg(long, value_name = "FILE")]
    pub workflow: PathBuf,
    /// Run only this job (the jobs it needs count as succeeded, without outputs).
    #[arg(long, short = 'j', value_name = "ID")]
    pub job: Option<String>,
    /// Print the jobs, what each needs, its matrix size and its placement; run nothing.
    #[arg(long, short = 'l')]
    pub list: bool,
    /// How many jobs run at once (jobs that do not need each other run in parallel).
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub parallel: usize,
    /// Keep only the matrix combinations whose KEY is VALUE (repeatable).
    #[arg(long, value_name = "KEY:VALUE")]
    pub matrix: Vec<String>,
    /// The event (github.event_name); default: the workflow's first `on:` event.
    #[arg(long, value_name = "NAME")]
    pub event: Option<String>,
    /// The event's payload (github.event), a JSON object.
    #[arg(long, short = 'e', value_name = "FILE")]
    pub event_file: Option<PathBuf>,
    /// A workflow_dispatch input (repeatable); the workflow's defaults fill the rest.
    #[arg(long = "input", value_name = "NAME=VALUE")]
    pub inputs: Vec<String>,
    /// A secret whose value is read from FILE (repeatable); never from the command line.
    #[arg(long = "secret", value_name = "NAME=@FILE")]
    pub secrets: Vec<String>,
    /// Secrets from a dotenv file (NAME=VALUE lines).
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// A `vars` value (repeatable).
    #[arg(long = "var", value_name = "NAME=VALUE")]
    pub vars: Vec<String>,
    /// `vars` from a dotenv file.
    #[arg(long, value_name = "FILE")]
    pub var_file: Option<PathBuf>,
    /// Environment for every job from a dotenv file (the workflow's `env:` wins).
    #[arg(long, value_name = "FILE")]
    pub env_file: Option<PathBuf>,
    /// Serve this commit (e.g. HEAD, a branch, a sha) as the jobs' repository instead of
    /// the working tree with its uncommitted changes.
    #[arg(long, value_name = "REV")]
    pub commit: Option<String>,
    /// Serve DIR as the action OWNER/NAME at REF (repeatable): `uses: OWNER/NAME@REF`
    /// runs it with no network. Other actions come from --actions-url.
    #[arg(long = "action", value_name = "OWNER/NAME@REF=DIR")]
    pub actions: Vec<String>,
    /// Where `uses: OWNER/NAME@REF` actions come from (as Gitea's DEFAULT_ACTIONS_URL).
    #[arg(long, value_name = "URL", default_value = "https://github.com")]
    pub actions_url: String,
    /// The runner image (scripts/build-image tags it gitea-dynamic-runner/runner:latest).
    #[arg(long, env = "GDR_RUNNER_IMAGE", default_value = "gitea-dynamic-runner/runner:latest")]
    pub image: String,
    /// The Docker API socket of the host that runs the environments.
    #[arg(long, env = "GDR_DOCKER_SOCKET", default_value = "/var/run/docker.sock")]
    pub docker_socket: String,
    /// Start the environments with --privileged instead of the explicit capability list
    /// (some hosts refuse --privileged).
    #[arg(long)]
    pub privileged: bool,
    /// The repository the jobs believe they run for (owner/name).
    #[arg(long, default_value = "local/workflow")]
    pub repository: String,
}
