//! The signals that reach the job: PID 1 forwards them to its child, and the agent to the
//! runner it started — one list, so that both pass on the same ones.

use nix::sys::signal::Signal;

/// Signals forwarded to the job child.
pub const FORWARDED: [Signal; 7] = [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP, Signal::SIGQUIT, Signal::SIGUSR1, Signal::SIGUSR2, Signal::SIGWINCH];
