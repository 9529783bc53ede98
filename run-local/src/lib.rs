//! `run-local`: a workflow file through the controller's whole pipeline — the
//! embedded store, the docker driver, the supervisor in the runner image, the real
//! runner — with this program in Gitea's place (an `act` counterpart).
//!
//! Layout:
//! - [`cli`]: the command line, the way `act` takes it.
//! - [`workflow`]: the file as the jobs Gitea would create (one per matrix
//!   combination, after the jobs they need).
//! - [`expression`]: `${{ }}` in a matrix, evaluated once the jobs it needs ended.
//! - [`task`]: each job's Task as Gitea builds it (needs with results and outputs, the
//!   event, inputs, secrets only from files).
//! - [`repository`]: the local repository and mapped actions, served over git's smart
//!   HTTP where the jobs' Gitea would be.
//! - [`reports`]: the runner's reports, the logs streamed to the terminal.
//! - [`planning`]: the jobs as planned and placed, each job's state in one place,
//!   matrices given by expressions expanded once their needs ended, `--list`.
//! - [`inputs`]: secrets, variables, the event, and what is served as the jobs' Gitea.
//! - [`host`]: the controller's pipeline started for the run
//!   ([`controller::pipeline::Running`]) with the docker driver and the terminal as Gitea.
//! - [`run`]: the run itself — jobs started in `needs` order, Ctrl-C.
//! - [`summary`]: the results at the end and the exit code.
//! - [`exit`]: the codes the program exits with.

#![forbid(unsafe_code)]

pub mod cli;
pub mod exit;
pub mod expression;
pub mod host;
pub mod inputs;
pub mod planning;
pub mod reports;
pub mod repository;
pub mod run;
pub mod summary;
pub mod task;
pub mod workflow;
