//! `supervisor doctor`: independent checks of a (broken) job environment, each
//! PASS, FAIL or SKIP with a reason and, on failure, a hint. Every check runs even
//! after others failed; the exit code is non-zero when any check failed. Read-only.
//!
//! The checks reuse the probes the supervisor itself runs (dockerd's `/_ping`, the
//! storage mountinfo parser, cgroup detection, the identity wait's Workload API
//! client), so doctor and runtime cannot disagree.

mod checks;
mod image;
mod step;

use std::{borrow::Cow, path::PathBuf};

use serde::Serialize;

/// What doctor checks and where: the environment's own settings (converted from the
/// command line, which shares them with `supervisor run`), so that a check can be
/// pointed elsewhere and tests can break one thing at a time.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Whether this environment uses SPIFFE identity at all.
    pub identity: bool,
    pub spiffe_endpoint: Option<String>,
    pub spiffe_id: Option<String>,
    /// Which dockerd the job has (rootless: no loop storage to check).
    pub job_docker: contract::environment::JobDocker,
    pub docker_data_root: PathBuf,
    pub docker_socket: PathBuf,
    pub dockerd_log: PathBuf,
    pub loop_control: PathBuf,
    pub cgroup_root: PathBuf,
    pub facade_url: Option<String>,
    pub runner: PathBuf,
    pub runner_config: PathBuf,
    /// The runner's working directory, where the agent writes `.runner`.
    pub runner_dir: PathBuf,
    pub assignment_id: Option<String>,
    /// What is checked: the environment, an image, or what a step reaches.
    pub mode: Mode,
    /// The image's package list, for `image`.
    pub packages: PathBuf,
    pub runner_user: crate::pid1::RunnerUser,
}

/// Every check of the mode `settings` asks for, in the order a person would look.
pub fn all(settings: &Settings) -> Vec<Outcome> {
    match settings.mode {
        Mode::Environment => checks::all(settings),
        Mode::Image => image::all(settings),
        Mode::Step => step::all(&|name| std::env::var(name).ok()),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A running environment, from inside it.
    Environment,
    /// A runner image (see [`image`]).
    Image,
    /// What a job's steps reach, from where a step runs (see [`step`]).
    Step,
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
    /// A check's name, or for `--image` the command that shows a package is there.
    pub id: Cow<'static, str>,
    pub status: Status,
    pub reason: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub hint: String,
}

impl Outcome {
    pub fn pass(id: impl Into<Cow<'static, str>>, reason: impl Into<String>) -> Self {
        Outcome { id: id.into(), status: Status::Pass, reason: reason.into(), hint: String::new() }
    }

    pub fn fail(id: impl Into<Cow<'static, str>>, reason: impl Into<String>, hint: impl Into<String>) -> Self {
        Outcome { id: id.into(), status: Status::Fail, reason: reason.into(), hint: hint.into() }
    }

    pub fn skip(id: impl Into<Cow<'static, str>>, reason: impl Into<String>) -> Self {
        Outcome { id: id.into(), status: Status::Skip, reason: reason.into(), hint: String::new() }
    }
}

#[derive(Debug, Serialize)]
struct Report<'a> {
    checks: &'a [Outcome],
    passed: usize,
    failed: usize,
    skipped: usize,
}

/// Runs every check; prints text or, with `json`, one JSON document. Returns 1 when any
/// check failed.
pub fn run(settings: &Settings, json: bool) -> u8 {
    let outcomes = all(settings);
    let count = |status| outcomes.iter().filter(|o| o.status == status).count();
    let report = Report { checks: &outcomes, passed: count(Status::Pass), failed: count(Status::Fail), skipped: count(Status::Skip) };
    if json {
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
