//! `supervisor doctor`: independent checks of a (broken) job environment, each
//! PASS, FAIL or SKIP with a reason and, on failure, a hint. Every check runs even
//! after others failed; the exit code is non-zero when any check failed. Read-only.
//!
//! The checks reuse the probes the supervisor itself runs (dockerd's `/_ping`, the
//! storage mountinfo parser, cgroup detection, the identity wait's Workload API
//! client), so doctor and runtime cannot disagree.

mod checks;

use std::path::PathBuf;

use clap::Args;
use serde::Serialize;

pub use checks::all;

/// Where doctor looks; defaults are the environment's real paths, flags exist so a
/// check can be pointed elsewhere (and tests can break one thing at a time).
#[derive(Debug, Clone, Args)]
pub struct Paths {
    /// Whether this environment uses SPIFFE identity at all.
    #[arg(long, env = "SUPERVISOR_IDENTITY", default_value_t = true, action = clap::ArgAction::Set)]
    pub identity: bool,
    #[arg(long, env = "SPIFFE_ENDPOINT_SOCKET")]
    pub spiffe_endpoint: Option<String>,
    #[arg(long, env = "CI_SPIFFE_ID")]
    pub spiffe_id: Option<String>,
    #[arg(long, env = "SUPERVISOR_DOCKER", default_value_t = true, action = clap::ArgAction::Set)]
    pub docker: bool,
    #[arg(long, env = "SUPERVISOR_DOCKER_DATA_ROOT", default_value = "/var/lib/docker")]
    pub docker_data_root: PathBuf,
    #[arg(long, env = "SUPERVISOR_DOCKER_SOCKET", default_value = "/var/run/docker.sock")]
    pub docker_socket: PathBuf,
    #[arg(long, env = "SUPERVISOR_DOCKERD_LOG", default_value = "/var/log/supervisor/dockerd.log")]
    pub dockerd_log: PathBuf,
    #[arg(long, default_value = "/dev/loop-control")]
    pub loop_control: PathBuf,
    #[arg(long, env = "SUPERVISOR_CGROUP_ROOT", default_value = "/sys/fs/cgroup")]
    pub cgroup_root: PathBuf,
    #[arg(long, env = "CI_RUNNER_FACADE_URL")]
    pub facade_url: Option<String>,
    #[arg(long, default_value = "gitea-runner")]
    pub runner: PathBuf,
    #[arg(long, default_value = "/etc/gitea-runner/config.yaml")]
    pub runner_config: PathBuf,
    /// gitea-runner's working directory, where the agent writes `.runner`.
    #[arg(long, env = "SUPERVISOR_RUNNER_DIR", default_value = "/home/runner")]
    pub runner_dir: PathBuf,
    #[arg(long, env = "CI_ASSIGNMENT_ID")]
    pub assignment_id: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Status {
    Pass,
    Fail,
    Skip,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Outcome {
    pub id: &'static str,
    pub status: Status,
    pub reason: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub hint: String,
}

impl Outcome {
    pub fn pass(id: &'static str, reason: impl Into<String>) -> Self {
        Outcome { id, status: Status::Pass, reason: reason.into(), hint: String::new() }
    }

    pub fn fail(id: &'static str, reason: impl Into<String>, hint: impl Into<String>) -> Self {
        Outcome { id, status: Status::Fail, reason: reason.into(), hint: hint.into() }
    }

    pub fn skip(id: &'static str, reason: impl Into<String>) -> Self {
        Outcome { id, status: Status::Skip, reason: reason.into(), hint: String::new() }
    }
}

#[derive(Debug, Serialize)]
struct Report<'a> {
    checks: &'a [Outcome],
    passed: usize,
    failed: usize,
    skipped: usize,
}

/// Runs every check and prints the report; the exit code is 1 when any failed.
pub fn run(args: &crate::cli::DoctorArgs) -> u8 {
    let outcomes = all(&args.paths);
    let count = |status| outcomes.iter().filter(|o| o.status == status).count();
    let report = Report {
        checks: &outcomes,
        passed: count(Status::Pass),
        failed: count(Status::Fail),
        skipped: count(Status::Skip),
    };
    if args.json {
        match serde_json::to_string_pretty(&report) {
            Ok(json) => println!("{json}"),
            Err(error) => eprintln!("doctor: cannot encode the report: {error}"),
        }
    } else {
        for outcome in &outcomes {
            let status = match outcome.status {
                Status::Pass => "PASS",
                Status::Fail => "FAIL",
                Status::Skip => "SKIP",
            };
            println!("{status}  {:<16} {}", outcome.id, outcome.reason);
            if !outcome.hint.is_empty() {
                println!("      {:<16} hint: {}", "", outcome.hint);
            }
        }
        println!("{} passed, {} failed, {} skipped", report.passed, report.failed, report.skipped);
    }
    u8::from(report.failed > 0)
}
