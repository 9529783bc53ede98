//! Commands run beside the job, not part of PID 1 or the agent: gitea-runner's
//! job-started hook ([`job_started`]), `supervisor doctor` ([`doctor`]) and `docker` where
//! the environment has none ([`docker_shim`]).

pub mod docker_shim;
pub mod doctor;
pub mod job_started;

/// Whether this process was started under the file name `name` (a link to, or a mount
/// of, the supervisor): the image's `docker` and the runner's job-started hook.
pub fn invoked_as(name: &str) -> bool {
    std::env::args_os().next().is_some_and(|zero| std::path::Path::new(&zero).file_name() == Some(std::ffi::OsStr::new(name)))
}
