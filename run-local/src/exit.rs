//! The codes `run-local` exits with: the run's result as a shell would report a job.

/// Every job succeeded or was skipped.
pub const SUCCESS: u8 = 0;
/// A job failed (its log says why), or the run could not start (the message says why).
pub const JOB_FAILED: u8 = 1;
/// Invalid arguments (EX_USAGE).
pub const USAGE: u8 = 64;
/// The run was cancelled (as a shell reports SIGINT).
pub const CANCELLED: u8 = 130;
