//! cgroup set-up for a job-local dockerd.
//!
//! On cgroup v2, a non-root cgroup may enable domain controllers for its children only
//! while it has no processes of its own, and dockerd (cgroupfs driver) puts containers
//! in `<root>/docker/<id>`. So every process moves into `<root>/init` (the name Kata's
//! agent expects for exec) and the controllers are enabled one at a time; `docker
//! exec`-style joins can race new processes into the root, hence the bounded retry
//! (moby's hack/dind does the same). On v1 nothing is needed.

use std::{
    fs,
    io::ErrorKind,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    V1,
    V2,
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::V1 => "v1",
            Mode::V2 => "v2",
        })
    }
}

/// v2 when the root has `cgroup.controllers` (a cgroup2 mount), v1 otherwise.
pub fn detect(root: &Path) -> Mode {
    if root.join("cgroup.controllers").exists() { Mode::V2 } else { Mode::V1 }
}

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cannot create {path}")]
    CreateInit {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot remount {path} read-write (the environment needs CAP_SYS_ADMIN, or --privileged, for a nested dockerd on cgroup v1)")]
    Remount {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "processes kept appearing in {root}/cgroup.procs for {waited:?}, so controllers cannot be delegated; \
         is something exec-ing into the environment in a loop?"
    )]
    StillBusy { root: PathBuf, waited: Duration },
}

/// What nesting did, for the logs and `doctor`.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct Nested {
    pub moved: usize,
    pub enabled: Vec<String>,
    pub failed: Vec<String>,
}

/// Remounts every read-only mount at or under `root` read-write (each keeps its other
/// flags: nosuid, nodev, noexec). Returns the mount points it changed.
///
/// # Errors
/// The first mount that cannot be remounted (e.g. without CAP_SYS_ADMIN).
pub fn make_v1_writable(root: &Path) -> Result<Vec<PathBuf>, CgroupError> {
    use nix::mount::{MsFlags, mount};
    let mountinfo = fs::read("/proc/self/mountinfo").map_err(|source| CgroupError::Read { path: "/proc/self/mountinfo".into(), source })?;
    let entries = super::storage::mountinfo::parse(&mountinfo)
        .map_err(|error| CgroupError::Read { path: "/proc/self/mountinfo".into(), source: std::io::Error::other(error.to_string()) })?;
    let mut changed = Vec::new();
    // Shallowest first: the tmpfs at the root before the hierarchies in it.
    let mut under: Vec<_> = entries.iter().filter(|e| e.mount_point.starts_with(root)).collect();
    under.sort_by_key(|e| e.mount_point.components().count());
    for entry in under {
        let options: Vec<&str> = entry.mount_options.split(',').collect();
        if !options.contains(&"ro") {
            continue;
        }
        let mut flags = MsFlags::MS_REMOUNT | MsFlags::MS_BIND;
        for (name, flag) in [("nosuid", MsFlags::MS_NOSUID), ("nodev", MsFlags::MS_NODEV), ("noexec", MsFlags::MS_NOEXEC), ("relatime", MsFlags::MS_RELATIME)] {
            if options.contains(&name) {
                flags |= flag;
            }
        }
        mount(None::<&str>, &entry.mount_point, None::<&str>, flags, None::<&str>)
            .map_err(|errno| CgroupError::Remount { path: entry.mount_point.clone(), source: std::io::Error::from(errno) })?;
        changed.push(entry.mount_point.clone());
    }
    Ok(changed)
}

/// Moves every process of `root` into `root/init` and enables the available
/// controllers for `root`'s children, retrying on EBUSY until `deadline`.
///
/// # Errors
/// When `init` cannot be created or processes keep reappearing until the deadline.
pub fn nest_v2(root: &Path, deadline: Duration) -> Result<Nested, CgroupError> {
    let init = root.join("init");
    match fs::create_dir(&init) {
        Ok(()) => {}
        Err(error) if error.kind() == ErrorKind::AlreadyExists => {}
        Err(source) => return Err(CgroupError::CreateInit { path: init, source }),
    }
    let controllers_path = root.join("cgroup.controllers");
    let available = fs::read_to_string(&controllers_path).map_err(|source| CgroupError::Read { path: controllers_path, source })?;
    let started = Instant::now();
    let mut nested = Nested::default();
    loop {
        nested.moved += move_all(&root.join("cgroup.procs"), &init.join("cgroup.procs"));
        let mut busy = false;
        nested.enabled.clear();
        nested.failed.clear();
        for controller in parse_controllers(&available) {
            match fs::write(root.join("cgroup.subtree_control"), format!("+{controller}")) {
                Ok(()) => nested.enabled.push(controller.to_owned()),
                Err(error) if error.raw_os_error() == Some(libc::EBUSY) => {
                    busy = true;
                    break;
                }
                Err(error) => {
                    tracing::warn!(controller, %error, "cannot enable cgroup controller");
                    nested.failed.push(controller.to_owned());
                }
            }
        }
        if !busy {
            return Ok(nested);
        }
        if started.elapsed() >= deadline {
            return Err(CgroupError::StillBusy { root: root.to_owned(), waited: started.elapsed() });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Moves each pid listed in `from` to `to`; pids that vanished meanwhile are skipped.
fn move_all(from: &Path, to: &Path) -> usize {
    let Ok(procs) = fs::read_to_string(from) else { return 0 };
    let mut moved = 0;
    for pid in procs.split_whitespace() {
        match fs::write(to, pid) {
            Ok(()) => moved += 1,
            Err(error) if matches!(error.raw_os_error(), Some(libc::ESRCH | libc::EINVAL)) => {}
            Err(error) => tracing::debug!(pid, %error, "cannot move process into the init cgroup"),
        }
    }
    moved
}

/// The names in a `cgroup.controllers` line.
pub fn parse_controllers(text: &str) -> Vec<&str> {
    text.split_whitespace().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controllers() {
        assert_eq!(parse_controllers("cpuset cpu io memory pids\n"), ["cpuset", "cpu", "io", "memory", "pids"]);
        assert!(parse_controllers("\n").is_empty());
    }

    #[test]
    fn detection_by_cgroup_controllers() {
        let dir = std::env::temp_dir().join(format!("cgroup-detect-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        assert_eq!(detect(&dir), Mode::V1);
        fs::write(dir.join("cgroup.controllers"), "cpu\n").unwrap();
        assert_eq!(detect(&dir), Mode::V2);
        fs::remove_dir_all(&dir).unwrap();
    }
}
