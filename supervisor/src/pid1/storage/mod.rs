//! Storage for the job-local dockerd: loop-backed ext4 on `/var/lib/docker`. The
//! L-numbers in comments name the rules it follows:
//!
//! - L1: a mountpoint that is already mounted (an emptyDir, a volume) is used as it is.
//! - L2: `/dev/loop-control` (c 10:237) is made if the container's `/dev` lacks it.
//! - L3: the backing file is sparse and never on the mountpoint itself.
//! - L4: `mkfs.ext4` formats the file itself, fast options only ([`mkfs`]).
//! - L5: a loop device is taken with GET_FREE, its node found through sysfs (made if
//!   missing), bound with autoclear, and taken again on a race.
//! - L6: ext4 is mounted `noatime`, then our loop fd is closed, so the last umount
//!   detaches the device.
//! - L7: loop devices this supervisor did not bind are never touched (in a container
//!   they are the host's).
//! - L8: a state file records what was created, for `doctor` and re-runs.
//!
//! [`prepare`] either finds the mountpoint already mounted (an emptyDir or volume:
//! [`Prepared::Existing`], nothing to undo) or creates a sparse image, formats it with
//! `mkfs.ext4` (run through PID 1's [`Runner`], since only PID 1 may wait for children),
//! binds it to a loop device with autoclear, mounts it, and closes the loop fd so the
//! final umount detaches the device. [`cleanup`] undoes exactly what `prepare` created.
//!
//! Layout:
//! - [`mountinfo`]: pure `/proc/self/mountinfo` parser and mountpoint queries.
//! - [`mkfs`]: the `mkfs.ext4` argv.
//! - `loopdev`: hand-written loop ioctls with util-linux's retry policy (the only
//!   `unsafe` here).

mod loopdev;
pub mod mkfs;
pub mod mountinfo;

use std::io;
use std::path::{Component, Path, PathBuf};
use std::process::{Command, ExitStatus};

use serde::{Deserialize, Serialize};

pub use loopdev::{LoopError, SysDevError, parse_sys_dev, probe_loop_control};

const PROC_MOUNTINFO: &str = "/proc/self/mountinfo";
/// 20 GiB: sparse, so it only costs what dockerd writes.
pub const DEFAULT_SIZE_BYTES: u64 = 20 * 1024 * 1024 * 1024;
/// Smaller images are a configuration mistake (ext4 metadata alone is several MiB).
pub const MIN_SIZE_BYTES: u64 = 32 * 1024 * 1024;
/// Warn when the filesystem holding the image has less free space than this, even if
/// it has more than the image's nominal size would need right now.
const FREE_SPACE_FLOOR: u64 = 2 * 1024 * 1024 * 1024;
const STATE_VERSION: u32 = 1;

/// What [`prepare`] works with. Parsed and validated by the caller's config code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageConfig {
    /// Normally `/var/lib/docker`.
    pub mountpoint: PathBuf,
    /// The sparse backing file, e.g. `/var/lib/supervisor/docker.img`; NOT inside
    /// `mountpoint`, and preferably not on tmpfs (it would cost RAM).
    pub image_path: PathBuf,
    /// Nominal size of the sparse image; [`DEFAULT_SIZE_BYTES`] by default.
    pub size_bytes: u64,
    /// `mkfs.ext4` (looked up in `PATH`) or an absolute path.
    pub mkfs: PathBuf,
    /// Where the outcome is recorded for `doctor` and re-runs (L8).
    pub state_file: PathBuf,
}

impl Default for StorageConfig {
    fn default() -> Self {
        Self {
            mountpoint: PathBuf::from("/var/lib/docker"),
            image_path: PathBuf::from("/var/lib/supervisor/docker.img"),
            size_bytes: DEFAULT_SIZE_BYTES,
            mkfs: PathBuf::from("mkfs.ext4"),
            state_file: PathBuf::from("/run/supervisor/storage.json"),
        }
    }
}

/// What [`prepare`] did; pass it back to [`cleanup`]. Also the state file's content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Prepared {
    /// mountpoint was already a mountpoint (emptyDir/volume); nothing created, nothing to clean.
    Existing { fstype: String },
    /// we created these; cleanup undoes exactly them.
    Created { image_path: PathBuf, loop_device: PathBuf, loop_index: u32, mountpoint: PathBuf, created_mountpoint_dir: bool, created_image: bool },
}

/// Runs a child to completion and returns its exit status. PID 1 supplies this (it is the
/// only process allowed to waitpid; so storage code must NEVER call Child::wait / waitpid itself).
pub trait Runner {
    /// Spawns `command`, waits for it through the PID-1 reaper, returns its status.
    ///
    /// # Errors
    /// The spawn failed (e.g. `NotFound` when the program is missing).
    fn run(&mut self, command: Command) -> io::Result<ExitStatus>;
}

mod cleanup;
mod error;
mod prepare;
mod state;

pub use cleanup::cleanup;
use cleanup::*;
pub use error::StorageError;
pub use prepare::prepare;
pub use state::read_state;
use state::*;

// ---- pure decisions ------------------------------------------------------------------

/// Checks a config before any side effect.
///
/// # Errors
/// [`StorageError::InvalidConfig`] naming the offending path.
pub fn validate(config: &StorageConfig) -> Result<(), StorageError> {
    let invalid = |path: &Path, reason| StorageError::InvalidConfig { path: path.to_path_buf(), reason };
    for path in [&config.mountpoint, &config.image_path] {
        if !path.is_absolute() {
            return Err(invalid(path, "must be an absolute path"));
        }
        if path.components().any(|c| matches!(c, Component::ParentDir)) {
            return Err(invalid(path, "must not contain `..`"));
        }
    }
    if config.mountpoint == Path::new("/") {
        return Err(invalid(&config.mountpoint, "cannot mount storage over /"));
    }
    if config.image_path.starts_with(&config.mountpoint) {
        return Err(invalid(&config.image_path, "the image must not live inside the mountpoint it backs"));
    }
    if config.image_path.file_name().is_none() {
        return Err(invalid(&config.image_path, "must name a file"));
    }
    if config.size_bytes < MIN_SIZE_BYTES {
        return Err(invalid(&config.image_path, "size must be at least 32 MiB"));
    }
    Ok(())
}

/// Why an already-mounted docker data root is a poor fit, if it is (L1).
#[must_use]
pub fn existing_fs_concern(fstype: &str) -> Option<&'static str> {
    match fstype {
        "overlay" | "virtiofs" | "9p" | "aufs" => {
            Some("overlay2 cannot use it as a backing filesystem; dockerd will fall back to fuse-overlayfs or vfs (full copies)")
        }
        f if f == "fuse" || f.starts_with("fuse.") => Some("overlay2 cannot use a FUSE backing filesystem; dockerd will fall back to vfs (full copies)"),
        "tmpfs" | "ramfs" => Some("works, but every image layer costs RAM (VM RAM under Kata)"),
        _ => None,
    }
}

// ---- mountinfo access ----------------------------------------------------------------

fn read_mountinfo() -> Result<Vec<mountinfo::MountEntry>, StorageError> {
    let path = PathBuf::from(PROC_MOUNTINFO);
    let text = std::fs::read(&path).map_err(|source| StorageError::ReadMountinfo { path: path.clone(), source })?;
    mountinfo::parse(&text).map_err(|source| StorageError::ParseMountinfo { path, source })
}

/// `path` resolved the way mountinfo shows it, or `None` if it does not exist.
fn canonical(path: &Path) -> Result<Option<PathBuf>, StorageError> {
    match std::fs::canonicalize(path) {
        Ok(resolved) => Ok(Some(resolved)),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(StorageError::ResolvePath { path: path.to_path_buf(), source }),
    }
}

/// The fs type mounted at exactly `path` (after resolving symlinks), per
/// `/proc/self/mountinfo`; `None` if `path` is not a mountpoint or does not exist.
///
/// # Errors
/// mountinfo unreadable or malformed, or `path` unresolvable.
pub fn is_mountpoint(path: &Path) -> Result<Option<String>, StorageError> {
    let Some(resolved) = canonical(path)? else {
        return Ok(None);
    };
    let entries = read_mountinfo()?;
    Ok(mountinfo::mount_at(&entries, &resolved).map(|entry| entry.fstype.clone()))
}

#[cfg(test)]
mod tests {
    use nix::errno::Errno;

    use super::prepare::*;
    use super::*;

    fn config() -> StorageConfig {
        StorageConfig::default()
    }

    #[test]
    fn default_config_is_valid_and_documented_values() {
        let c = config();
        assert_eq!(c.size_bytes, 20 * 1024 * 1024 * 1024);
        assert_eq!(c.mountpoint, Path::new("/var/lib/docker"));
        assert_eq!(validate(&c).ok(), Some(()));
    }

    #[test]
    fn validation_table() {
        let cases: Vec<(&str, StorageConfig, Option<&str>)> = vec![
            ("default", config(), None),
            ("relative mountpoint", StorageConfig { mountpoint: "var/lib/docker".into(), ..config() }, Some("must be an absolute path")),
            ("relative image", StorageConfig { image_path: "docker.img".into(), ..config() }, Some("must be an absolute path")),
            (
                "image inside mountpoint",
                StorageConfig { image_path: "/var/lib/docker/docker.img".into(), ..config() },
                Some("the image must not live inside the mountpoint it backs"),
            ),
            (
                "image is the mountpoint",
                StorageConfig { image_path: "/var/lib/docker".into(), ..config() },
                Some("the image must not live inside the mountpoint it backs"),
            ),
            ("sibling with common string prefix is fine", StorageConfig { image_path: "/var/lib/docker.img".into(), ..config() }, None),
            ("dotdot escape", StorageConfig { image_path: "/var/lib/docker/../x.img".into(), ..config() }, Some("must not contain `..`")),
            ("root mountpoint", StorageConfig { mountpoint: "/".into(), image_path: "/x.img".into(), ..config() }, Some("cannot mount storage over /")),
            ("too small", StorageConfig { size_bytes: MIN_SIZE_BYTES - 1, ..config() }, Some("size must be at least 32 MiB")),
            ("minimum", StorageConfig { size_bytes: MIN_SIZE_BYTES, ..config() }, None),
        ];
        for (name, c, expected) in cases {
            let got = match validate(&c) {
                Ok(()) => None,
                Err(StorageError::InvalidConfig { reason, .. }) => Some(reason),
                Err(other) => panic!("{name}: unexpected {other}"),
            };
            assert_eq!(got, expected, "{name}");
        }
    }

    #[test]
    fn existing_fs_table() {
        let bad = ["overlay", "virtiofs", "9p", "fuse", "fuse.sshfs", "fuse.lxcfs"];
        for fstype in bad {
            assert!(existing_fs_concern(fstype).is_some_and(|c| c.contains("overlay2")), "{fstype}");
        }
        for fstype in ["tmpfs", "ramfs"] {
            assert!(existing_fs_concern(fstype).is_some_and(|c| c.contains("RAM")), "{fstype}");
        }
        for fstype in ["ext4", "xfs", "btrfs", "fuseblk-not-really"] {
            assert_eq!(existing_fs_concern(fstype), None, "{fstype}");
        }
    }

    #[test]
    fn state_file_round_trips_and_is_tagged() {
        let prepared = Prepared::Created {
            image_path: "/var/lib/supervisor/docker.img".into(),
            loop_device: "/dev/loop3".into(),
            loop_index: 3,
            mountpoint: "/var/lib/docker".into(),
            created_mountpoint_dir: true,
            created_image: true,
        };
        let json = serde_json::to_value(StateFile { version: STATE_VERSION, prepared: prepared.clone() }).expect("encodes");
        assert_eq!(json["version"], 1);
        assert_eq!(json["kind"], "created");
        assert_eq!(json["loop_index"], 3);
        assert_eq!(json["loop_device"], "/dev/loop3");
        let back: StateFile = serde_json::from_value(json).expect("decodes");
        assert_eq!(back.prepared, prepared);

        let existing = serde_json::to_value(StateFile { version: STATE_VERSION, prepared: Prepared::Existing { fstype: "xfs".into() } }).expect("encodes");
        assert_eq!(existing, serde_json::json!({"version": 1, "kind": "existing", "fstype": "xfs"}));
    }

    /// A runner that records argv and answers with canned statuses (no process spawned).
    struct Scripted {
        seen: Vec<Vec<std::ffi::OsString>>,
        statuses: Vec<i32>,
    }
    impl Runner for Scripted {
        fn run(&mut self, command: Command) -> io::Result<ExitStatus> {
            use std::os::unix::process::ExitStatusExt;
            self.seen.push(command.get_args().map(ToOwned::to_owned).collect());
            let code = if self.statuses.is_empty() { 0 } else { self.statuses.remove(0) };
            Ok(ExitStatus::from_raw(code << 8))
        }
    }

    #[test]
    fn format_falls_back_without_prezeroed_once() {
        let c = config();
        let prezeroed = mkfs::mkfs_args(&c.image_path, true);
        let plain = mkfs::mkfs_args(&c.image_path, false);

        let mut ok = Scripted { seen: vec![], statuses: vec![0] };
        assert!(format(&c, &mut ok).is_ok());
        assert_eq!(ok.seen, vec![prezeroed.clone()]);

        let mut old = Scripted { seen: vec![], statuses: vec![1, 0] };
        assert!(format(&c, &mut old).is_ok());
        assert_eq!(old.seen, vec![prezeroed.clone(), plain.clone()]);

        let mut broken = Scripted { seen: vec![], statuses: vec![1, 1] };
        match format(&c, &mut broken) {
            Err(StorageError::MkfsFailed { status, .. }) => assert_eq!(status.code(), Some(1)),
            other => panic!("expected MkfsFailed, got {other:?}"),
        }
        assert_eq!(broken.seen, vec![prezeroed, plain]);
    }

    #[test]
    fn missing_mkfs_is_a_spawn_error_naming_e2fsprogs() {
        struct Missing;
        impl Runner for Missing {
            fn run(&mut self, _: Command) -> io::Result<ExitStatus> {
                Err(io::Error::from(io::ErrorKind::NotFound))
            }
        }
        let error = format(&config(), &mut Missing).expect_err("fails");
        assert!(matches!(error, StorageError::SpawnMkfs { .. }));
        assert!(error.to_string().contains("e2fsprogs"), "{error}");
    }

    #[test]
    fn error_display_names_path_and_hint_without_source() {
        let error =
            StorageError::AttachLoop { image: "/img".into(), source: LoopError::MknodControl { path: "/dev/loop-control".into(), source: Errno::EPERM } };
        assert_eq!(error.to_string(), "cannot attach /img to a loop device");
        let source = std::error::Error::source(&error).expect("has a source");
        assert_eq!(
            source.to_string(),
            "no free loop device: /dev/loop-control is missing and mknod failed — is the container privileged (CAP_MKNOD) with a writable /dev?"
        );
    }
}
