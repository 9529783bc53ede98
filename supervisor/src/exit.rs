//! Exit codes: one home for every code the supervisor can end with.
//!
//! The normal code is the job's: its exit status, or 128+N after signal N (as tini,
//! catatonit and shells do). The supervisor's own failures use 64 and 70–79 so they
//! are not mistaken for a job's; they live in [`contract::exit`], where the controller
//! reads what they mean.

pub use contract::exit::{CLAIM, DOCKER, IDENTITY, INTERNAL, NOT_READY, STORAGE, USAGE};

/// The job command could not be executed: not found (126 for permission, as shells).
pub const COMMAND_NOT_FOUND: u8 = 127;
pub const COMMAND_NOT_EXECUTABLE: u8 = 126;

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildStatus {
    Exited(i32),
    Signaled(i32),
}

impl ChildStatus {
    /// The exit code that reports this status to our own parent.
    pub fn exit_code(self) -> u8 {
        match self {
            // Exit statuses are 0–255 on Linux; the mask only documents that.
            ChildStatus::Exited(code) => (code & 0xff) as u8,
            ChildStatus::Signaled(signal) => 128u8.wrapping_add((signal & 0x7f) as u8),
        }
    }

    pub fn from_std(status: std::process::ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(code), _) => ChildStatus::Exited(code),
            (None, Some(signal)) => ChildStatus::Signaled(signal),
            (None, None) => ChildStatus::Exited(i32::from(INTERNAL)),
        }
    }
}

impl std::fmt::Display for ChildStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChildStatus::Exited(code) => write!(f, "exited with {code}"),
            ChildStatus::Signaled(signal) => write!(f, "killed by signal {signal}"),
        }
    }
}

/// The code for a failure to execute the job command, from the spawn error.
pub fn spawn_failure(error: &std::io::Error) -> u8 {
    match error.kind() {
        std::io::ErrorKind::NotFound => COMMAND_NOT_FOUND,
        std::io::ErrorKind::PermissionDenied => COMMAND_NOT_EXECUTABLE,
        _ => INTERNAL,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_shell_convention() {
        let table: &[(ChildStatus, u8)] = &[
            (ChildStatus::Exited(0), 0),
            (ChildStatus::Exited(1), 1),
            (ChildStatus::Exited(42), 42),
            (ChildStatus::Exited(255), 255),
            (ChildStatus::Signaled(1), 129),
            (ChildStatus::Signaled(2), 130),
            (ChildStatus::Signaled(9), 137),
            (ChildStatus::Signaled(15), 143),
            (ChildStatus::Signaled(31), 159),
        ];
        for &(status, code) in table {
            assert_eq!(status.exit_code(), code, "{status:?}");
        }
    }

    #[test]
    fn spawn_failures_map_like_shells() {
        use std::io::{Error, ErrorKind};
        assert_eq!(spawn_failure(&Error::from(ErrorKind::NotFound)), 127);
        assert_eq!(spawn_failure(&Error::from(ErrorKind::PermissionDenied)), 126);
        assert_eq!(spawn_failure(&Error::from(ErrorKind::Other)), INTERNAL);
    }

    #[test]
    fn from_std_status() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(ChildStatus::from_std(std::process::ExitStatus::from_raw(3 << 8)), ChildStatus::Exited(3));
        assert_eq!(ChildStatus::from_std(std::process::ExitStatus::from_raw(15)), ChildStatus::Signaled(15));
    }
}
