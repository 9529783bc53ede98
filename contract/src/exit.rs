//! The supervisor's own exit codes. An environment's main process is the supervisor, so
//! the code its environment ends with is one of these when the supervisor itself gave
//! up, and the job's when a job ran: the controller names the first kind in what it
//! tells Gitea and the operator.
//!
//! The job's codes are its exit status, or 128+N after signal N (as tini, catatonit and
//! shells do); the supervisor's own failures use 64 and 70–79 so they are not mistaken
//! for a job's.

/// Invalid configuration (EX_USAGE).
pub const USAGE: u8 = 64;
/// An unexpected failure of the supervisor itself.
pub const INTERNAL: u8 = 70;
/// The job's SPIFFE identity was not offered before the deadline.
pub const IDENTITY: u8 = 71;
/// dockerd did not become ready.
pub const DOCKER: u8 = 72;
/// Storage for /var/lib/docker could not be prepared.
pub const STORAGE: u8 = 73;
/// `job-started`: identity or dockerd not ready before the hook's deadline.
pub const NOT_READY: u8 = 74;
/// The task could not be claimed from the facade (refused, or unreachable).
pub const CLAIM: u8 = 75;

/// What an environment that ended with `code` before its job was claimed was telling:
/// the supervisor's reason and where to look, or `None` for a code it does not use.
pub fn meaning(code: i64) -> Option<&'static str> {
    let meaning = match u8::try_from(code).ok()? {
        USAGE => "the supervisor's configuration is invalid: its log names the setting (check the placement's environment settings and the image)",
        INTERNAL => "the supervisor failed unexpectedly: its log says where",
        IDENTITY => "the job's SPIFFE identity was not issued in time (check the SPIRE agent on the node and the job's registration entry)",
        DOCKER => "the job's dockerd did not become ready (run `supervisor doctor` in the image)",
        STORAGE => "storage for the job's dockerd could not be prepared (loop devices, free disk)",
        CLAIM => "the supervisor could not claim the job from the controller: the facade refused it, or is unreachable from the environment at facade.url",
        _ => return None,
    };
    Some(meaning)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_supervisors_own_codes_have_a_meaning() {
        for code in [USAGE, INTERNAL, IDENTITY, DOCKER, STORAGE, CLAIM] {
            assert!(meaning(i64::from(code)).is_some(), "{code}");
        }
        // A job's codes, signals, and the hook's (which fails the job, not the environment).
        for code in [0, 1, 3, 63, 65, 69, i64::from(NOT_READY), 76, 126, 127, 137, 143, 256, -1] {
            assert_eq!(meaning(code), None, "{code}");
        }
    }
}
