//! Commands run beside the job, not part of PID 1 or the agent: gitea-runner's
//! job-started hook ([`job_started`]) and `supervisor doctor` ([`doctor`]).

pub mod doctor;
pub mod job_started;
