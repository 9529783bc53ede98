//! The assignment's capability as PID 1 hands it to the agent: on the agent's fd
//! [`CAPABILITY_FD`], a pipe PID 1 wrote it into and closed, never in the agent's
//! environment. An environment variable is inherited by every child and readable in
//! `/proc/<pid>/environ` of any of them that is dumpable (every exec'd child is), by a
//! step of the same uid: a pipe is read once and is gone.

use std::{
    io::Read as _,
    os::fd::{FromRawFd as _, OwnedFd},
};

use super::config::CAPABILITY_ENV;

/// The agent's fd on which PID 1 hands over the capability.
pub const CAPABILITY_FD: i32 = 4;

/// The capability from [`CAPABILITY_FD`]; else (an agent started by hand, without PID 1)
/// from [`CAPABILITY_ENV`], which the agent's children never see.
pub fn take() -> Option<String> {
    // SAFETY: fd 4 is installed by PID 1 (dup2 in the pre-exec step) for this process
    // alone, read here once before anything else of the agent runs; fcntl confirms it is
    // open before ownership is taken.
    let open = unsafe { libc::fcntl(CAPABILITY_FD, libc::F_GETFD) } != -1;
    if open {
        // SAFETY: see above; nothing else in the agent uses fd 4.
        let fd = unsafe { OwnedFd::from_raw_fd(CAPABILITY_FD) };
        let mut capability = String::new();
        if std::fs::File::from(fd).read_to_string(&mut capability).is_ok() && !capability.trim().is_empty() {
            return Some(capability.trim().to_owned());
        }
    }
    std::env::var(CAPABILITY_ENV).ok().filter(|capability| !capability.trim().is_empty())
}
