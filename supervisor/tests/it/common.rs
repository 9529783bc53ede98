//! What the tests share: running the real supervisor binary as PID 1 of a new PID
//! namespace (`unshare --pid --fork --mount-proc`) or as a subreaper, scratch
//! directories the runner uid can write, and the locks on what the tests of this one
//! process share with each other ([`loop_devices`], [`PROCESS_MEMORY`]).

#![allow(dead_code, clippy::unwrap_used)]

use std::{
    os::unix::fs::PermissionsExt,
    path::Path,
    process::{Command, Stdio},
    sync::{Mutex, MutexGuard, PoisonError},
};

pub const SUPERVISOR: &str = env!("CARGO_BIN_EXE_supervisor");

/// The host's loop devices and mount table, one test at a time: the storage tests and
/// the tests that start dockerd on loop-backed storage. (A storage test checks that the
/// set of bound loop devices does not change while it runs.)
pub fn loop_devices() -> MutexGuard<'static, ()> {
    static LOOP_DEVICES: Mutex<()> = Mutex::new(());
    LOOP_DEVICES.lock().unwrap_or_else(PoisonError::into_inner)
}

/// This process's memory, which the hostile-input test bounds: that test holds it
/// alone, and a test that moves megabytes through this process holds it shared.
pub static PROCESS_MEMORY: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// A scratch directory everyone can write (the job runs as uid 2000).
pub fn scratch() -> tempfile::TempDir {
    let dir = tempfile::Builder::new().prefix("supervisor-test-").tempdir_in("/tmp").unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    dir
}

/// `supervisor run` with identity and Docker off, in its own PID namespace.
pub fn run_as_pid1(state: &Path, extra: &[&str], job: &str) -> Command {
    let mut command = Command::new("unshare");
    command.args(["--pid", "--fork", "--mount-proc", "--kill-child", SUPERVISOR]);
    command.args(base_args(state, extra, job));
    command
}

/// `supervisor run` in this PID namespace (it becomes a child subreaper).
pub fn run_as_subreaper(state: &Path, extra: &[&str], job: &str) -> Command {
    let mut command = Command::new(SUPERVISOR);
    command.args(base_args(state, extra, job));
    command
}

fn base_args(state: &Path, extra: &[&str], job: &str) -> Vec<String> {
    let mut args: Vec<String> = vec!["run".into(), format!("--state-dir={}", state.display())];
    for default in ["--identity=false", "--docker=false"] {
        let flag = default.split('=').next().unwrap_or(default);
        if !extra.iter().any(|e| e.starts_with(flag)) {
            args.push(default.into());
        }
    }
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    args.extend(["--".into(), "sh".into(), "-c".into(), job.to_owned()]);
    args
}

/// The host pid of a process whose parent is `parent` (unshare's forked child).
pub fn child_of(parent: u32) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok()?.split_whitespace().next()?.parse().ok()
}

pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map(|stat| !stat.contains(") Z ")).unwrap_or(false)
}

pub fn quiet(command: &mut Command) -> &mut Command {
    command.stdin(Stdio::null())
}
