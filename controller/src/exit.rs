//! Every code the controller exits with, in one place. `run` exits 0 after a clean stop
//! and 1 when a component failed (printed once by `main`).

/// Invalid configuration or arguments (EX_USAGE).
pub const USAGE: u8 = 64;
/// `run-local`: a job failed (its log says why).
pub const JOB_FAILED: u8 = 1;
/// `run-local`: the run was cancelled (as a shell reports SIGINT).
pub const CANCELLED: u8 = 130;
