//! Signals and reaping, small and synchronous.
//!
//! - [`block_signals`] runs first in `main`, before any thread exists, so every later
//!   thread inherits the mask and no signal is lost (a PID 1 drops unblocked signals
//!   that have no handler; blocked ones stay pending for the signalfd).
//! - [`Pid1`] owns the signalfd and is the *only* caller of `waitpid(-1)`. Children
//!   the supervisor starts are registered at spawn, so their status reaches whoever
//!   waits for them; orphans re-parented to us are reaped and logged.
//! - [`super::spawn`] prepares children: restored signal mask and dispositions, optional
//!   privilege drop in one pre-exec step.

use std::{
    collections::{HashSet, VecDeque},
    process::Command,
    time::{Duration, Instant},
};

use nix::{
    errno::Errno,
    poll::{PollFd, PollFlags, PollTimeout, poll},
    sys::{
        signal::{SigSet, SigmaskHow, Signal, kill, pthread_sigmask},
        signalfd::{SfdFlags, SignalFd},
        wait::{WaitPidFlag, WaitStatus, waitpid},
    },
    unistd::Pid,
};

use crate::{exit::ChildStatus, signals::FORWARDED};

/// tini re-polls every second: SIGCHLD coalesces and could in theory be missed.
const SWEEP_INTERVAL: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum Pid1Error {
    #[error("cannot block signals")]
    Block(#[source] Errno),
    #[error("cannot create the signalfd")]
    SignalFd(#[source] Errno),
    #[error("cannot set the child-subreaper flag")]
    Subreaper(#[source] Errno),
}

/// The signals PID 1 takes over: every forwarded one plus SIGCHLD and the job-control
/// stops that must not stop PID 1. Synchronous fault signals stay unblocked.
fn handled() -> SigSet {
    let mut set = SigSet::empty();
    for signal in FORWARDED {
        set.add(signal);
    }
    for signal in [Signal::SIGCHLD, Signal::SIGTSTP, Signal::SIGTTIN, Signal::SIGTTOU, Signal::SIGPIPE, Signal::SIGALRM] {
        set.add(signal);
    }
    set
}

/// Blocks the signals PID 1 handles. Call before any thread is created.
///
/// # Errors
/// Only if the kernel refuses the mask.
pub fn block_signals() -> Result<(), Pid1Error> {
    pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&handled()), None).map_err(Pid1Error::Block)
}

/// Something PID 1 must react to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    Signal(Signal),
    Exited { pid: Pid, status: ChildStatus },
}

#[derive(Debug)]
pub struct Pid1 {
    signals: SignalFd,
    watched: HashSet<Pid>,
    pending: VecDeque<Event>,
    is_init: bool,
}

impl Pid1 {
    /// Takes over signal handling and reaping. Signals must already be blocked.
    /// When this process is not PID 1 it becomes a child subreaper, so orphans of its
    /// descendants still come to it.
    ///
    /// # Errors
    /// When the signalfd or the subreaper flag cannot be set up.
    pub fn new() -> Result<Self, Pid1Error> {
        let signals = SignalFd::with_flags(&handled(), SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK).map_err(Pid1Error::SignalFd)?;
        let is_init = std::process::id() == 1;
        if !is_init {
            nix::sys::prctl::set_child_subreaper(true).map_err(Pid1Error::Subreaper)?;
            tracing::info!("not PID 1: acting as child subreaper");
        }
        Ok(Pid1 { signals, watched: HashSet::new(), pending: VecDeque::new(), is_init })
    }

    pub fn is_init(&self) -> bool {
        self.is_init
    }

    /// Starts a child and registers it, so that its exit is reported as an event.
    ///
    /// # Errors
    /// The spawn error (e.g. not found).
    pub fn spawn(&mut self, command: &mut Command) -> std::io::Result<Pid> {
        // The Child handle is dropped without waiting: only `reap` waits.
        let child = command.spawn()?;
        let pid = Pid::from_raw(i32::try_from(child.id()).map_err(std::io::Error::other)?);
        self.watched.insert(pid);
        Ok(pid)
    }

    /// The next event, or `None` once `timeout` passes without one.
    pub fn next_event(&mut self, timeout: Duration) -> Option<Event> {
        let deadline = Instant::now() + timeout;
        loop {
            self.reap();
            if let Some(event) = self.pending.pop_front() {
                return Some(event);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            let wait = (deadline - now).min(SWEEP_INTERVAL);
            let mut fds = [PollFd::new(self.signals.as_fd_borrowed(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::try_from(wait).unwrap_or(PollTimeout::MAX)) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(error) => {
                    // Never bail out of PID 1's loop: fall back to the periodic sweep.
                    tracing::error!(%error, "poll on the signalfd failed");
                    std::thread::sleep(wait.min(Duration::from_millis(100)));
                }
            }
            self.read_signals();
        }
    }

    /// Waits for one registered child, keeping every other event for later.
    pub fn wait_child(&mut self, pid: Pid, timeout: Duration) -> Option<ChildStatus> {
        let deadline = Instant::now() + timeout;
        let mut kept = VecDeque::new();
        let found = loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            match self.next_event(remaining) {
                Some(Event::Exited { pid: exited, status }) if exited == pid => break Some(status),
                Some(other) => kept.push_back(other),
                None => break None,
            }
        };
        kept.extend(self.pending.drain(..));
        self.pending = kept;
        found
    }

    /// Signals to act on that arrived while something else was being waited for.
    pub fn take_signals(&mut self) -> Vec<Signal> {
        let mut signals = Vec::new();
        self.pending.retain(|event| match event {
            Event::Signal(signal) => {
                signals.push(*signal);
                false
            }
            Event::Exited { .. } => true,
        });
        signals
    }

    pub fn is_watched(&self, pid: Pid) -> bool {
        self.watched.contains(&pid)
    }

    fn read_signals(&mut self) {
        loop {
            match self.signals.read_signal() {
                Ok(Some(info)) => {
                    let Ok(signal) = Signal::try_from(info.ssi_signo as i32) else { continue };
                    match signal {
                        // Reaping happens on the next loop turn.
                        Signal::SIGCHLD => {}
                        signal if FORWARDED.contains(&signal) => self.pending.push_back(Event::Signal(signal)),
                        other => tracing::debug!(signal = %other, "ignored signal"),
                    }
                }
                Ok(None) | Err(Errno::EAGAIN) => return,
                Err(Errno::EINTR) => {}
                Err(error) => {
                    tracing::error!(%error, "reading the signalfd failed");
                    return;
                }
            }
        }
    }

    /// `waitpid(-1, WNOHANG)` until nothing is left: SIGCHLD coalesces, so one signal
    /// may stand for many exits.
    fn reap(&mut self) {
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => self.reaped(pid, ChildStatus::Exited(code)),
                Ok(WaitStatus::Signaled(pid, signal, _)) => self.reaped(pid, ChildStatus::Signaled(signal as i32)),
                Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return,
                Ok(_) => {}
                Err(Errno::EINTR) => {}
                Err(error) => {
                    tracing::error!(%error, "waitpid failed");
                    return;
                }
            }
        }
    }

    fn reaped(&mut self, pid: Pid, status: ChildStatus) {
        if self.watched.remove(&pid) {
            self.pending.push_back(Event::Exited { pid, status });
        } else {
            tracing::debug!(%pid, %status, "reaped an orphan");
        }
    }

    /// Sends `signal` to a child; a child that is already gone is not an error.
    pub fn signal(&self, pid: Pid, signal: Signal) {
        match kill(pid, signal) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(error) => tracing::warn!(%pid, %signal, %error, "cannot signal child"),
        }
    }

    /// SIGKILLs every process left: as PID 1 every other process of the namespace
    /// (`kill(-1)` never reaches PID 1 itself); otherwise only our descendants, found
    /// through /proc, so a subreaper in a shared namespace never touches strangers.
    pub fn kill_remaining(&mut self) {
        if self.is_init {
            match kill(Pid::from_raw(-1), Signal::SIGKILL) {
                Ok(()) | Err(Errno::ESRCH) => {}
                Err(error) => tracing::warn!(%error, "kill(-1, SIGKILL) failed"),
            }
        } else {
            for pid in descendants(Pid::this()) {
                self.signal(pid, Signal::SIGKILL);
            }
        }
        // Collect what the kills produced so no zombie outlives us.
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline && !descendants(Pid::this()).is_empty() {
            self.reap();
            std::thread::sleep(Duration::from_millis(5));
        }
        self.reap();
    }
}

trait AsFdBorrowed {
    fn as_fd_borrowed(&self) -> std::os::fd::BorrowedFd<'_>;
}

impl AsFdBorrowed for SignalFd {
    fn as_fd_borrowed(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(self)
    }
}

/// Every live descendant of `root`, from the PPid lines of /proc/*/stat.
pub fn descendants(root: Pid) -> Vec<Pid> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    let mut parents = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            && let Some((ppid, state)) = parse_stat(&stat)
            && state != 'Z'
        {
            parents.push((pid, ppid));
        }
    }
    let mut found = vec![root.as_raw()];
    let mut index = 0;
    while index < found.len() {
        let parent = found[index];
        found.extend(parents.iter().filter(|(_, ppid)| *ppid == parent).map(|(pid, _)| *pid));
        index += 1;
    }
    found.into_iter().skip(1).map(Pid::from_raw).collect()
}

/// (ppid, state) from a /proc/<pid>/stat line; the command may contain spaces and
/// parentheses, so fields are counted after the last ')'.
pub fn parse_stat(stat: &str) -> Option<(i32, char)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((ppid, state))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines() {
        let table: &[(&str, Option<(i32, char)>)] = &[
            ("1 (supervisor) S 0 1 1 0 -1", Some((0, 'S'))),
            ("42 (a b) c)) Z 7 42 42", Some((7, 'Z'))),
            ("42 (sh) R 1", Some((1, 'R'))),
            ("garbage", None),
            ("1 (x) S notanumber", None),
        ];
        for &(line, want) in table {
            assert_eq!(parse_stat(line), want, "{line:?}");
        }
    }

    #[test]
    fn forwarded_signals_are_all_handled() {
        let set = handled();
        for signal in FORWARDED {
            assert!(set.contains(signal), "{signal}");
        }
        for fault in [Signal::SIGSEGV, Signal::SIGBUS, Signal::SIGFPE, Signal::SIGILL, Signal::SIGABRT, Signal::SIGKILL] {
            assert!(!set.contains(fault), "{fault}");
        }
    }
}
