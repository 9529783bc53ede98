//! A controller process of the real binary for tests that stop and start it: started
//! from a configuration file, its stderr appended to one log across restarts, stopped
//! with SIGTERM (and a bounded drain) or killed, and always killed when dropped.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::Duration,
};

#[derive(Debug)]
pub struct ControllerProcess {
    binary: PathBuf,
    config: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Child>,
}

impl ControllerProcess {
    /// `binary run --config <config>`, logging to `log` (appended), not started yet.
    pub fn new(binary: impl Into<PathBuf>, config: &Path, log: impl Into<PathBuf>) -> Self {
        ControllerProcess {
            binary: binary.into(),
            config: config.to_owned(),
            args: Vec::new(),
            env: vec![("RUST_LOG".to_owned(), "info".to_owned())],
            log: log.into(),
            child: None,
        }
    }

    /// `--components <components>`.
    pub fn components(mut self, components: &str) -> Self {
        self.args.extend(["--components".to_owned(), components.to_owned()]);
        self
    }

    /// An environment variable of every start (e.g. `GDR_TEST_DRIVER_DIR`).
    pub fn env(mut self, name: &str, value: impl AsRef<std::ffi::OsStr>) -> Self {
        self.env.retain(|(existing, _)| existing != name);
        self.env.push((name.to_owned(), value.as_ref().to_string_lossy().into_owned()));
        self
    }

    /// Starts it (a running one is killed first).
    pub fn start(&mut self) -> &mut Self {
        self.kill();
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let child = Command::new(&self.binary)
            .args(["run", "--config"])
            .arg(&self.config)
            .args(&self.args)
            .envs(self.env.iter().map(|(name, value)| (name, value)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("{} cannot start: {e}", self.binary.display()));
        self.child = Some(child);
        self
    }

    /// Starts it now, as [`start`](Self::start).
    pub fn started(mut self) -> Self {
        self.start();
        self
    }

    pub fn id(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends `signal` (SIGSTOP and SIGCONT freeze and thaw it).
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        if let Some(pid) = self.id().and_then(|id| i32::try_from(id).ok()) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal);
        }
    }

    /// SIGTERM, then up to `drain` to exit on its own before it is killed (as a Pod past
    /// its grace period).
    pub fn term(&mut self, drain: Duration) {
        self.signal(nix::sys::signal::Signal::SIGTERM);
        if let Some(mut child) = self.child.take() {
            let _ = crate::poll_blocking(drain, || child.try_wait().unwrap().ok_or(()));
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// How it ended, if it did (a controller ends on its own only on a bug, a refused
    /// start or a crash point).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().and_then(|child| child.try_wait().ok().flatten())
    }

    /// Waits up to `timeout` for it to end (killing it then, and failing the test).
    pub fn wait_for_exit(&mut self, timeout: Duration, what: &str) -> ExitStatus {
        let child = self.child.as_mut().unwrap_or_else(|| panic!("waiting until {what}: the controller was not started"));
        let status = crate::wait_for_exit(child, timeout, what);
        self.child = None;
        status
    }

    /// The last `lines` of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        crate::log_tail(&self.log, lines).unwrap_or_default()
    }

    pub fn log(&self) -> &Path {
        &self.log
    }
}

impl Drop for ControllerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixture with `sh` standing in for the binary: starts, restarts, ends, logs.
    #[test]
    fn starts_again_appends_its_log_and_is_killed_when_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("fake-controller");
        std::fs::write(&script, "#!/bin/sh\necho \"started $* $MARK\" >&2\nexec sleep 60\n").unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let config = dir.path().join("controller.toml");
        let mut process = ControllerProcess::new(&script, &config, dir.path().join("log")).components("facade").env("MARK", "m").started();
        let first = process.id().unwrap();
        crate::wait_until_blocking("the first start is logged", Duration::from_secs(10), || process.log_tail(5).contains("started run"));
        process.start();
        assert_ne!(process.id(), Some(first));
        crate::wait_until_blocking("both starts are logged", Duration::from_secs(10), || process.log_tail(5).lines().count() == 2);
        assert!(process.log_tail(1).contains(&format!("run --config {} --components facade m", config.display())), "{}", process.log_tail(5));
        assert!(process.exited().is_none());
        process.term(Duration::from_secs(5));
        assert!(process.id().is_none());
        let pid = { process.start().id().unwrap() };
        drop(process);
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "the process outlived the fixture");
    }
}
