//! How PID 1 and the agent start children.
//!
//! std's `Command` resets the signal mask and SIGPIPE in the child, but keeps every
//! other ignored disposition, and `.uid()` from root drops all supplementary groups
//! (`setgroups(0)`; `CommandExt::groups` is nightly-only). So the privilege drop is
//! done here, in one pre-exec step: setgroups → setgid → setuid, then verified.

use std::{os::unix::process::CommandExt, process::Command};

use nix::{
    sys::signal::{SigHandler, SigSet, SigmaskHow, Signal, pthread_sigmask, signal},
    unistd::{Gid, Uid, getgroups, setgid, setgroups, setuid},
};

/// Who a child runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Credentials {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups, e.g. the docker group.
    pub groups: [u32; 1],
}

/// Prepares `command` to run with default signal handling and, if given, as `who`.
pub fn prepare(command: &mut Command, who: Option<Credentials>) {
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe system calls (sigprocmask, signal, setgroups, setgid, setuid,
    // getgroups); it allocates nothing on the heap apart from getgroups' small Vec,
    // which is sound here because the parent never holds the allocator lock across
    // fork (the supervisor's PID 1 path is single-threaded when it spawns).
    unsafe {
        command.pre_exec(move || {
            pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None)?;
            for reset in [Signal::SIGPIPE, Signal::SIGTTIN, Signal::SIGTTOU, Signal::SIGTSTP] {
                // SAFETY: SIG_DFL installs no handler code.
                signal(reset, SigHandler::SigDfl)?;
            }
            if let Some(who) = who {
                setgroups(&[Gid::from_raw(who.groups[0])])?;
                setgid(Gid::from_raw(who.gid))?;
                setuid(Uid::from_raw(who.uid))?;
                if !getgroups()?.contains(&Gid::from_raw(who.groups[0])) {
                    return Err(std::io::Error::other("supplementary group was not kept"));
                }
            }
            Ok(())
        });
    }
}

/// Gives the child `fd` as `target` without close-on-exec: how PID 1 hands the agent its
/// dockerd report pipe and dockerd its socket. Nothing else of PID 1's reaches a child
/// (std opens every fd close-on-exec).
pub fn pass_fd(command: &mut Command, fd: std::os::fd::RawFd, target: std::os::fd::RawFd) {
    // SAFETY: dup2 and fcntl are async-signal-safe and touch only the child's table.
    unsafe {
        command.pre_exec(move || {
            if fd == target {
                let flags = libc::fcntl(fd, libc::F_GETFD);
                if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::dup2(fd, target) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// The lowest fd a pipe handed over with [`pass_fd`] is kept at in PID 1: above every
/// target, so that one pass's `dup2` never overwrites the source of another.
const ABOVE_TARGETS: std::os::fd::RawFd = 10;

/// A close-on-exec pipe (read end, write end) whose read end is kept above every fd
/// [`pass_fd`] hands over.
///
/// # Errors
/// When the pipe cannot be made or its read end moved.
pub fn handover_pipe() -> nix::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    use std::os::fd::FromRawFd as _;
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let moved = nix::fcntl::fcntl(&read, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(ABOVE_TARGETS))?;
    // SAFETY: `moved` is a new fd that fcntl just returned; nothing else owns it.
    Ok((unsafe { std::os::fd::OwnedFd::from_raw_fd(moved) }, write))
}

/// The child and everything it starts gain no privilege by exec (setuid and file
/// capabilities do nothing): the agent, the runner and the job's steps. Where the
/// container allows it (the rootless mode, whose dockerd branch of PID 1 needs
/// newuidmap's file capabilities), it is set here for the job's side alone.
pub fn no_new_privileges(command: &mut Command) {
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS) is one async-signal-safe system call.
    unsafe {
        command.pre_exec(|| nix::sys::prctl::set_no_new_privs().map_err(std::io::Error::from));
    }
}
