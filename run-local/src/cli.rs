//! `run-local`'s command line: a workflow file and what `act` would take with it.

use std::path::PathBuf;

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "run-local",
    version,
    about = "Runs a workflow here, every job in its own disposable environment in needs order, with no Gitea: the logs stream to the \
             terminal and the exit code is the run's (0 success, 1 failure, 130 cancelled). Ctrl-C cancels the run."
)]
pub struct Cli {
    #[command(flatten)]
    pub args: RunLocalArgs,
}

/// What to run and with what, the way `act` takes it.
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
    /// Serve DIR as the action OWNER/NAME at REF (repeatable, also for several refs of
    /// one action): `uses: OWNER/NAME@REF` runs it with no network. Other actions come
    /// from --actions-url.
    #[arg(long = "action", value_name = "OWNER/NAME@REF=DIR")]
    pub actions: Vec<String>,
    /// Where `uses: OWNER/NAME@REF` actions come from (as Gitea's DEFAULT_ACTIONS_URL).
    #[arg(long, value_name = "URL", default_value = "https://github.com")]
    pub actions_url: String,
    /// A runs-on label that means "this host", as act's `-P LABEL=-self-hosted`
    /// (repeatable; given, it replaces the defaults): a job whose runs-on has only such
    /// labels runs in a local environment.
    #[arg(long = "platform", value_name = "LABEL", default_values_t = ["ubuntu-latest", "ubuntu-24.04", "ubuntu-22.04", "ubuntu-20.04"].map(String::from))]
    pub platforms: Vec<String>,
    /// The runner image (scripts/build image tags it gitea-dynamic-runner/runner:latest).
    #[arg(long, env = "GDR_RUNNER_IMAGE", default_value = "gitea-dynamic-runner/runner:latest")]
    pub image: String,
    /// The Docker API socket of the host that runs the environments.
    #[arg(long, env = "GDR_DOCKER_SOCKET", default_value = "/var/run/docker.sock")]
    pub docker_socket: String,
    /// Start the environments with --privileged instead of the explicit capability list
    /// (some hosts refuse --privileged).
    #[arg(long)]
    pub privileged: bool,
    /// The repository the jobs run for (owner/name; github.repository); default: the
    /// `origin` remote's, as act takes it, else local/workflow.
    #[arg(long, value_name = "OWNER/NAME")]
    pub repository: Option<String>,
    /// Where `actions/cache` keeps its entries between runs (as act's
    /// --cache-server-path); default: ~/.cache/gitea-dynamic-runner/run-local-cache.
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// No cache: `actions/cache` restores nothing and saves nothing.
    #[arg(long, conflicts_with = "cache_dir")]
    pub no_cache: bool,
}
