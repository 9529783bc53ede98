//! Storage for the job-local dockerd: loop-backed ext4 on `/var/lib/docker`
//! (docs: `shared/reference/supervisor-runtime.md` §3, rules L1–L8).
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

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags};
use serde::{Deserialize, Serialize};

use loopdev::{Detached, LoopPaths, Strategy};
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
    Created {
        image_path: PathBuf,
        loop_device: PathBuf,
        loop_index: u32,
        mountpoint: PathBuf,
        created_mountpoint_dir: bool,
        created_image: bool,
    },
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

/// A storage step that failed. Display names the step, the path and what to check;
/// the source (printed by the top level) says why.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("invalid storage configuration for {path}: {reason}")]
    InvalidConfig { path: PathBuf, reason: &'static str },
    #[error("cannot read {path} — is /proc mounted?")]
    ReadMountinfo {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot parse {path}")]
    ParseMountinfo {
        path: PathBuf,
        #[source]
        source: mountinfo::ParseError,
    },
    #[error("cannot resolve {path}")]
    ResolvePath {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot create directory {path} — is the filesystem writable?")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} exists but is not a directory; cannot mount storage there")]
    MountpointNotDir { path: PathBuf },
    #[error("{path} exists and is {found}, not a regular file; refusing to replace it")]
    ImageNotRegular { path: PathBuf, found: String },
    #[error("cannot remove the stale image {path} from an earlier boot")]
    RemoveStaleImage {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot create the sparse image {path} — is its filesystem writable and large enough?")]
    CreateImage {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot run {mkfs} — is e2fsprogs installed in the image (mkfs.ext4 in PATH)?")]
    SpawnMkfs {
        mkfs: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{mkfs} failed to format {image} ({status}); its output above says why")]
    MkfsFailed {
        mkfs: PathBuf,
        image: PathBuf,
        status: ExitStatus,
    },
    #[error("cannot attach {image} to a loop device")]
    AttachLoop {
        image: PathBuf,
        #[source]
        source: LoopError,
    },
    #[error(
        "mounting {device} (ext4) on {mountpoint} failed — is the container privileged (CAP_SYS_ADMIN) and ext4 in /proc/filesystems?"
    )]
    Mount {
        device: PathBuf,
        mountpoint: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("{mountpoint} is covered by a mount we did not create; not unmounting it")]
    Covered { mountpoint: PathBuf },
    #[error("unmounting {mountpoint} failed")]
    Unmount {
        mountpoint: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("cannot detach loop device {device}")]
    DetachLoop {
        device: PathBuf,
        #[source]
        source: LoopError,
    },
    #[error("cannot remove the image {path}")]
    RemoveImage {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot read state file {path}")]
    ReadState {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("state file {path} is not valid storage state")]
    DecodeState {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot write state file {path}")]
    WriteState {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The on-disk form of the state file (L8).
#[derive(Debug, Serialize, Deserialize)]
struct StateFile {
    version: u32,
    #[serde(flatten)]
    prepared: Prepared,
}

// ---- pure decisions ------------------------------------------------------------------

/// Checks a config before any side effect.
///
/// # Errors
/// [`StorageError::InvalidConfig`] naming the offending path.
pub fn validate(config: &StorageConfig) -> Result<(), StorageError> {
    let invalid = |path: &Path, reason| StorageError::InvalidConfig {
        path: path.to_path_buf(),
        reason,
    };
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
        return Err(invalid(
            &config.image_path,
            "the image must not live inside the mountpoint it backs",
        ));
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
        "overlay" | "virtiofs" | "9p" | "aufs" => Some(
            "overlay2 cannot use it as a backing filesystem; dockerd will fall back to fuse-overlayfs or vfs (full copies)",
        ),
        f if f == "fuse" || f.starts_with("fuse.") => Some(
            "overlay2 cannot use a FUSE backing filesystem; dockerd will fall back to vfs (full copies)",
        ),
        "tmpfs" | "ramfs" => Some("works, but every image layer costs RAM (VM RAM under Kata)"),
        _ => None,
    }
}

// ---- mountinfo access ----------------------------------------------------------------

fn read_mountinfo() -> Result<Vec<mountinfo::MountEntry>, StorageError> {
    let path = PathBuf::from(PROC_MOUNTINFO);
    let text = std::fs::read(&path).map_err(|source| StorageError::ReadMountinfo {
        path: path.clone(),
        source,
    })?;
    mountinfo::parse(&text).map_err(|source| StorageError::ParseMountinfo { path, source })
}

/// `path` resolved the way mountinfo shows it, or `None` if it does not exist.
fn canonical(path: &Path) -> Result<Option<PathBuf>, StorageError> {
    match std::fs::canonicalize(path) {
        Ok(resolved) => Ok(Some(resolved)),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(StorageError::ResolvePath {
            path: path.to_path_buf(),
            source,
        }),
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

// ---- state file ----------------------------------------------------------------------

/// Reads a state file written by [`prepare`] (for `doctor`).
///
/// # Errors
/// Unreadable or not valid state.
pub fn read_state(path: &Path) -> Result<Prepared, StorageError> {
    let text = std::fs::read(path).map_err(|source| StorageError::ReadState {
        path: path.to_path_buf(),
        source,
    })?;
    let state: StateFile =
        serde_json::from_slice(&text).map_err(|source| StorageError::DecodeState {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(state.prepared)
}

/// Atomically (write + rename) records `prepared`.
fn write_state(path: &Path, prepared: &Prepared) -> Result<(), StorageError> {
    let write_error = |source| StorageError::WriteState {
        path: path.to_path_buf(),
        source,
    };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(write_error)?;
    }
    let state = StateFile {
        version: STATE_VERSION,
        prepared: prepared.clone(),
    };
    let mut json = serde_json::to_vec_pretty(&state).map_err(|e| write_error(e.into()))?;
    json.push(b'\n');
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, json).map_err(write_error)?;
    std::fs::rename(&tmp, path).map_err(write_error)
}

/// The state file is advisory (doctor, re-runs): storage works without it, so failing
/// to write it is logged, not fatal. `cleanup` leaves it in place (`Prepared` does not
/// carry its path); readers must confirm it against sysfs/mountinfo, as `adopt` does.
fn record_state(config: &StorageConfig, prepared: &Prepared) {
    if let Err(error) = write_state(&config.state_file, prepared) {
        tracing::warn!(error = %error, cause = %error_source(&error), "storage state not recorded");
    }
}

fn error_source(error: &dyn std::error::Error) -> String {
    error.source().map(ToString::to_string).unwrap_or_default()
}

// ---- prepare -------------------------------------------------------------------------

/// Makes `config.mountpoint` ready for dockerd (L1–L8). See the module docs.
///
/// # Errors
/// The first step that failed; everything created before it has been undone.
pub fn prepare(config: &StorageConfig, runner: &mut dyn Runner) -> Result<Prepared, StorageError> {
    prepare_with(config, runner, &LoopPaths::default(), Strategy::Auto)
}

fn prepare_with(
    config: &StorageConfig,
    runner: &mut dyn Runner,
    paths: &LoopPaths,
    strategy: Strategy,
) -> Result<Prepared, StorageError> {
    validate(config)?;
    if let Some(resolved) = canonical(&config.mountpoint)? {
        let entries = read_mountinfo()?;
        if let Some(entry) = mountinfo::mount_at(&entries, &resolved) {
            if let Some(ours) = adopt(config, entry) {
                tracing::info!(mountpoint = %config.mountpoint.display(), "storage already prepared by this supervisor; reusing it");
                return Ok(ours);
            }
            // Deviation from L1, which skips only for overlay-capable types: any existing
            // mount is used as is, with a warning for poor types. Mounting ext4 over a
            // volume someone deliberately put here would hide it; the warning (and
            // `doctor`'s storage check) makes the degradation visible instead.
            let fstype = entry.fstype.clone();
            match existing_fs_concern(&fstype) {
                Some(concern) => {
                    tracing::warn!(mountpoint = %config.mountpoint.display(), %fstype, concern, "using existing mount for docker storage")
                }
                None => {
                    tracing::info!(mountpoint = %config.mountpoint.display(), %fstype, "using existing mount for docker storage")
                }
            }
            let prepared = Prepared::Existing { fstype };
            record_state(config, &prepared);
            return Ok(prepared);
        }
    }

    let started = Instant::now();
    let mut undo = Undo::default();
    match create(config, runner, paths, strategy, &mut undo) {
        Ok(prepared) => {
            tracing::info!(
                mountpoint = %config.mountpoint.display(),
                image = %config.image_path.display(),
                size_bytes = config.size_bytes,
                elapsed_ms = started.elapsed().as_millis(),
                "loop-backed ext4 storage ready"
            );
            record_state(config, &prepared);
            Ok(prepared)
        }
        Err(error) => {
            undo.run(paths);
            Err(error)
        }
    }
}

/// L8: a mount at the mountpoint that our state file says we made (same loop device as
/// source, same image) is ours from an earlier `prepare` in this container; reuse it
/// rather than report it as foreign (which would leak it at cleanup).
fn adopt(config: &StorageConfig, entry: &mountinfo::MountEntry) -> Option<Prepared> {
    let previous = read_state(&config.state_file).ok()?;
    match &previous {
        Prepared::Created {
            image_path,
            loop_device,
            mountpoint,
            ..
        } if *image_path == config.image_path
            && *mountpoint == config.mountpoint
            && entry.fstype == "ext4"
            && entry.source == loop_device.as_os_str() =>
        {
            Some(previous)
        }
        _ => None,
    }
}

/// What `create` has done so far, undone in reverse if a later step fails.
#[derive(Debug, Default)]
struct Undo {
    mountpoint_dir: Option<PathBuf>,
    image: Option<PathBuf>,
    /// Index, device, and the open fd (dropping it lets autoclear unbind).
    loop_device: Option<(u32, PathBuf, Option<File>)>,
    mounted: Option<PathBuf>,
}

impl Undo {
    fn run(mut self, paths: &LoopPaths) {
        if let Some(mountpoint) = self.mounted.take()
            && let Err(error) = unmount_retry(&mountpoint)
        {
            tracing::warn!(%error, cause = %error_source(&error), "rollback: unmount failed");
        }
        if let Some((index, device, fd)) = self.loop_device.take() {
            drop(fd);
            if let Some(image) = &self.image {
                match loopdev::detach_if_ours(paths, index, &device, image, false) {
                    Ok(outcome) => tracing::debug!(?outcome, "rollback: loop device released"),
                    Err(error) => tracing::warn!(%error, "rollback: loop detach failed"),
                }
            }
        }
        if let Some(image) = self.image.take()
            && let Err(error) = remove_file_if_present(&image)
        {
            tracing::warn!(image = %image.display(), %error, "rollback: cannot remove image");
        }
        if let Some(dir) = self.mountpoint_dir.take()
            && let Err(error) = std::fs::remove_dir(&dir)
        {
            tracing::warn!(dir = %dir.display(), %error, "rollback: cannot remove mountpoint dir");
        }
    }
}

fn create(
    config: &StorageConfig,
    runner: &mut dyn Runner,
    paths: &LoopPaths,
    strategy: Strategy,
    undo: &mut Undo,
) -> Result<Prepared, StorageError> {
    let created_mountpoint_dir = ensure_mountpoint_dir(&config.mountpoint)?;
    if created_mountpoint_dir {
        undo.mountpoint_dir = Some(config.mountpoint.clone());
    }

    let step = Instant::now();
    let image = create_image(&config.image_path, config.size_bytes)?;
    undo.image = Some(config.image_path.clone());
    let image_ms = step.elapsed().as_millis();

    let step = Instant::now();
    format(config, runner)?;
    let mkfs_ms = step.elapsed().as_millis();

    let step = Instant::now();
    let attached =
        loopdev::attach(paths, &image, &config.image_path, strategy).map_err(|source| {
            StorageError::AttachLoop {
                image: config.image_path.clone(),
                source,
            }
        })?;
    drop(image); // the loop device holds its own reference now
    let attach_ms = step.elapsed().as_millis();
    let loopdev::Attached {
        index,
        device,
        fd,
        used_configure,
        tries,
    } = attached;
    undo.loop_device = Some((index, device.clone(), Some(fd)));

    // L6: ext4, noatime. (noinit_itable is unnecessary: assume_storage_prezeroed marks
    // the tables zeroed, and without it the lazy-init writes are holes on a sparse file.)
    let step = Instant::now();
    nix::mount::mount(
        Some(device.as_path()),
        config.mountpoint.as_path(),
        Some("ext4"),
        MsFlags::MS_NOATIME,
        None::<&str>,
    )
    .map_err(|source| StorageError::Mount {
        device: device.clone(),
        mountpoint: config.mountpoint.clone(),
        source,
    })?;
    undo.mounted = Some(config.mountpoint.clone());
    let mount_ms = step.elapsed().as_millis();

    // L6: close our loop fd; the mount now holds the device, and autoclear detaches it
    // when the final umount releases it.
    if let Some((_, _, fd)) = undo.loop_device.as_mut() {
        drop(fd.take());
    }
    tracing::info!(
        device = %device.display(),
        loop_configure = used_configure,
        attach_tries = tries,
        image_ms,
        mkfs_ms,
        attach_ms,
        mount_ms,
        "attached and mounted"
    );

    // Success: nothing left to undo.
    *undo = Undo::default();
    Ok(Prepared::Created {
        image_path: config.image_path.clone(),
        loop_device: device,
        loop_index: index,
        mountpoint: config.mountpoint.clone(),
        created_mountpoint_dir,
        created_image: true,
    })
}

/// Creates the mountpoint directory if missing; `true` if we created (the leaf of) it.
fn ensure_mountpoint_dir(mountpoint: &Path) -> Result<bool, StorageError> {
    match std::fs::metadata(mountpoint) {
        Ok(meta) if meta.is_dir() => Ok(false),
        Ok(_) => Err(StorageError::MountpointNotDir {
            path: mountpoint.to_path_buf(),
        }),
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            std::fs::create_dir_all(mountpoint).map_err(|source| StorageError::CreateDir {
                path: mountpoint.to_path_buf(),
                source,
            })?;
            Ok(true)
        }
        Err(source) => Err(StorageError::ResolvePath {
            path: mountpoint.to_path_buf(),
            source,
        }),
    }
}

/// L3: a new, empty sparse file of `size` bytes.
///
/// A regular file already at `path` is a stale image from an earlier boot of this
/// container (the mount and loop died with that boot's mount namespace). It is unlinked
/// and a new file created rather than re-formatted in place: if a leaked loop device
/// still holds the old inode, it keeps its own (now deleted) file instead of having a
/// live filesystem formatted underneath it, and the new file is all holes, which is what
/// `assume_storage_prezeroed` relies on. Anything other than a regular file is refused.
fn create_image(path: &Path, size: u64) -> Result<File, StorageError> {
    let create_error = |source| StorageError::CreateImage {
        path: path.to_path_buf(),
        source,
    };
    let parent = path.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(parent).map_err(|source| StorageError::CreateDir {
        path: parent.to_path_buf(),
        source,
    })?;
    match path.symlink_metadata() {
        Ok(meta) if meta.file_type().is_file() => {
            tracing::warn!(image = %path.display(), stale_bytes = meta.len(), "replacing stale image from an earlier boot");
            std::fs::remove_file(path).map_err(|source| StorageError::RemoveStaleImage {
                path: path.to_path_buf(),
                source,
            })?;
        }
        Ok(meta) => {
            return Err(StorageError::ImageNotRegular {
                path: path.to_path_buf(),
                found: format!("{:?}", meta.file_type()),
            });
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        Err(source) => return Err(create_error(source)),
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(create_error)?;
    // Remove the half-made file if sizing fails; the caller's undo only knows it after
    // this function returns.
    if let Err(source) = file.set_len(size) {
        drop(file);
        let _ = std::fs::remove_file(path);
        return Err(create_error(source));
    }
    // Make the new directory entry durable (L3); advisory for a disposable container.
    if let Err(error) = File::open(parent).and_then(|dir| dir.sync_all()) {
        tracing::debug!(dir = %parent.display(), %error, "fsync of image directory failed");
    }
    warn_about_backing_fs(parent, size);
    Ok(file)
}

/// L3 advice: the image lives on this filesystem; warn if it is RAM or nearly full.
/// (L3 says "not tmpfs unless configured"; the config has no such switch, so this only
/// warns rather than refusing a placement the operator chose.)
fn warn_about_backing_fs(dir: &Path, size: u64) {
    if let Ok(fs) = nix::sys::statfs::statfs(dir)
        && fs.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC
    {
        tracing::warn!(dir = %dir.display(), "image is on tmpfs: every block dockerd writes costs RAM");
    }
    if let Ok(vfs) = nix::sys::statvfs::statvfs(dir) {
        #[allow(
            clippy::useless_conversion,
            reason = "fsblkcnt_t and c_ulong are narrower than u64 on 32-bit targets"
        )]
        let free = u64::from(vfs.blocks_available()).saturating_mul(u64::from(vfs.fragment_size()));
        if free < size.min(FREE_SPACE_FLOOR) {
            tracing::warn!(dir = %dir.display(), free_bytes = free, image_bytes = size, "little free space under the image; docker will get I/O errors when it runs out");
        }
    }
}

/// L4: format through the PID-1 runner, with `assume_storage_prezeroed` if mke2fs knows
/// it (1.47.0+); older ones reject the unknown `-E` option with exit 1, so retry once
/// without it.
fn format(config: &StorageConfig, runner: &mut dyn Runner) -> Result<(), StorageError> {
    let mut last = None;
    for prezeroed in [true, false] {
        let mut command = Command::new(&config.mkfs);
        command
            .args(mkfs::mkfs_args(&config.image_path, prezeroed))
            .stdin(Stdio::null());
        let status = runner
            .run(command)
            .map_err(|source| StorageError::SpawnMkfs {
                mkfs: config.mkfs.clone(),
                source,
            })?;
        if status.success() {
            if !prezeroed {
                tracing::info!(
                    "mkfs.ext4 lacks assume_storage_prezeroed (e2fsprogs < 1.47); formatted without it"
                );
            }
            return Ok(());
        }
        tracing::debug!(%status, prezeroed, "mkfs.ext4 failed");
        last = Some(status);
    }
    Err(StorageError::MkfsFailed {
        mkfs: config.mkfs.clone(),
        image: config.image_path.clone(),
        status: last.unwrap_or_default(),
    })
}

// ---- cleanup -------------------------------------------------------------------------

/// Undoes exactly what [`prepare`] created: unmounts (submounts deepest first, retrying
/// EBUSY, `MNT_DETACH` as a last resort), checks that autoclear detached the loop device
/// (clearing it only if it is still bound to our image), removes the image we created
/// and the mountpoint directory we created. `Existing` is left alone. Every step runs
/// even if an earlier one failed.
///
/// # Errors
/// The first step that failed.
pub fn cleanup(prepared: &Prepared) -> Result<(), StorageError> {
    cleanup_with(prepared, &LoopPaths::default())
}

fn cleanup_with(prepared: &Prepared, paths: &LoopPaths) -> Result<(), StorageError> {
    let Prepared::Created {
        image_path,
        loop_device,
        loop_index,
        mountpoint,
        created_mountpoint_dir,
        created_image,
    } = prepared
    else {
        tracing::debug!("storage was an existing mount; nothing to clean up");
        return Ok(());
    };
    let started = Instant::now();
    let mut first_error: Option<StorageError> = None;
    let mut note = |result: Result<(), StorageError>| {
        if let Err(error) = result {
            tracing::warn!(%error, cause = %error_source(&error), "storage cleanup step failed");
            first_error.get_or_insert(error);
        }
    };

    let unmounted = unmount_ours(mountpoint, loop_device);
    let lazily = matches!(unmounted, Ok(Unmounted::Lazily));
    note(unmounted.map(drop));
    let unmount_ms = started.elapsed().as_millis();
    note(
        match loopdev::detach_if_ours(paths, *loop_index, loop_device, image_path, lazily) {
            Ok(Detached::Deferred) => {
                tracing::warn!(device = %loop_device.display(), "loop device still in use (lazily unmounted); autoclear will detach it when released");
                Ok(())
            }
            Ok(outcome) => {
                tracing::debug!(device = %loop_device.display(), ?outcome, "loop device released");
                Ok(())
            }
            Err(source) => Err(StorageError::DetachLoop {
                device: loop_device.clone(),
                source,
            }),
        },
    );
    if *created_image {
        note(
            remove_file_if_present(image_path).map_err(|source| StorageError::RemoveImage {
                path: image_path.clone(),
                source,
            }),
        );
    }
    if *created_mountpoint_dir {
        match std::fs::remove_dir(mountpoint) {
            Ok(()) => {}
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            // Not worth failing over: the container is about to go away.
            Err(error) => {
                tracing::warn!(dir = %mountpoint.display(), %error, "mountpoint directory left in place");
            }
        }
    }
    tracing::info!(
        unmount_ms,
        elapsed_ms = started.elapsed().as_millis(),
        "storage cleaned up"
    );
    first_error.map_or(Ok(()), Err)
}

fn remove_file_if_present(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// Unmounts our mount at `mountpoint` if it is still there. Mounts below it (dockerd's
/// overlay and shm mounts) live on our filesystem and would keep it busy, so they go
/// first, deepest first. A foreign mount stacked on top of ours is not touched.
fn unmount_ours(mountpoint: &Path, device: &Path) -> Result<Unmounted, StorageError> {
    let Some(resolved) = canonical(mountpoint)? else {
        return Ok(Unmounted::WasGone);
    };
    let entries = read_mountinfo()?;
    let is_ours = |entry: &mountinfo::MountEntry| {
        entry.fstype == "ext4" && entry.source == device.as_os_str()
    };
    match mountinfo::mount_at(&entries, &resolved) {
        Some(top) if is_ours(top) => {}
        Some(_)
            if entries
                .iter()
                .any(|e| e.mount_point == resolved && is_ours(e)) =>
        {
            return Err(StorageError::Covered {
                mountpoint: mountpoint.to_path_buf(),
            });
        }
        _ => {
            tracing::warn!(mountpoint = %mountpoint.display(), "our storage mount is already gone");
            return Ok(Unmounted::WasGone);
        }
    }
    for sub in mountinfo::submounts_deepest_first(&entries, &resolved) {
        // A failure here surfaces as EBUSY (then MNT_DETACH) on our own mount below.
        if let Err(error) = unmount_retry(&sub.mount_point) {
            tracing::warn!(%error, cause = %error_source(&error), "cannot unmount a mount below the storage mount");
        }
    }
    unmount_retry(&resolved)
}

/// How an unmount ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unmounted {
    Cleanly,
    /// Still busy after the retries: detached with `MNT_DETACH`; the filesystem (and the
    /// loop device, by autoclear) is released when its last user goes.
    Lazily,
    /// Nothing (of ours) was mounted there.
    WasGone,
}

const UMOUNT_TRIES: u32 = 12;

/// `umount2(path, 0)`, retrying EBUSY with a short growing backoff (10 ms → 300 ms,
/// ~2 s in all: long enough for just-killed processes to exit), then `MNT_DETACH`.
fn unmount_retry(path: &Path) -> Result<Unmounted, StorageError> {
    let unmount_error = |source| StorageError::Unmount {
        mountpoint: path.to_path_buf(),
        source,
    };
    for attempt in 0..UMOUNT_TRIES {
        match nix::mount::umount2(path, MntFlags::empty()) {
            Ok(()) => return Ok(Unmounted::Cleanly),
            Err(Errno::EBUSY) => {
                sleep(Duration::from_millis((10u64 << attempt.min(5)).min(300)));
            }
            // Not a mountpoint (any more): nothing to do.
            Err(Errno::EINVAL) => return Ok(Unmounted::WasGone),
            Err(source) => return Err(unmount_error(source)),
        }
    }
    tracing::warn!(mountpoint = %path.display(), "still busy; detaching lazily (MNT_DETACH)");
    nix::mount::umount2(path, MntFlags::MNT_DETACH)
        .map(|()| Unmounted::Lazily)
        .map_err(unmount_error)
}

#[cfg(test)]
mod tests {
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
            (
                "relative mountpoint",
                StorageConfig {
                    mountpoint: "var/lib/docker".into(),
                    ..config()
                },
                Some("must be an absolute path"),
            ),
            (
                "relative image",
                StorageConfig {
                    image_path: "docker.img".into(),
                    ..config()
                },
                Some("must be an absolute path"),
            ),
            (
                "image inside mountpoint",
                StorageConfig {
                    image_path: "/var/lib/docker/docker.img".into(),
                    ..config()
                },
                Some("the image must not live inside the mountpoint it backs"),
            ),
            (
                "image is the mountpoint",
                StorageConfig {
                    image_path: "/var/lib/docker".into(),
                    ..config()
                },
                Some("the image must not live inside the mountpoint it backs"),
            ),
            (
                "sibling with common string prefix is fine",
                StorageConfig {
                    image_path: "/var/lib/docker.img".into(),
                    ..config()
                },
                None,
            ),
            (
                "dotdot escape",
                StorageConfig {
                    image_path: "/var/lib/docker/../x.img".into(),
                    ..config()
                },
                Some("must not contain `..`"),
            ),
            (
                "root mountpoint",
                StorageConfig {
                    mountpoint: "/".into(),
                    image_path: "/x.img".into(),
                    ..config()
                },
                Some("cannot mount storage over /"),
            ),
            (
                "too small",
                StorageConfig {
                    size_bytes: MIN_SIZE_BYTES - 1,
                    ..config()
                },
                Some("size must be at least 32 MiB"),
            ),
            (
                "minimum",
                StorageConfig {
                    size_bytes: MIN_SIZE_BYTES,
                    ..config()
                },
                None,
            ),
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
        let bad = [
            "overlay",
            "virtiofs",
            "9p",
            "fuse",
            "fuse.sshfs",
            "fuse.lxcfs",
        ];
        for fstype in bad {
            assert!(
                existing_fs_concern(fstype).is_some_and(|c| c.contains("overlay2")),
                "{fstype}"
            );
        }
        for fstype in ["tmpfs", "ramfs"] {
            assert!(
                existing_fs_concern(fstype).is_some_and(|c| c.contains("RAM")),
                "{fstype}"
            );
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
        let json = serde_json::to_value(StateFile {
            version: STATE_VERSION,
            prepared: prepared.clone(),
        })
        .expect("encodes");
        assert_eq!(json["version"], 1);
        assert_eq!(json["kind"], "created");
        assert_eq!(json["loop_index"], 3);
        assert_eq!(json["loop_device"], "/dev/loop3");
        let back: StateFile = serde_json::from_value(json).expect("decodes");
        assert_eq!(back.prepared, prepared);

        let existing = serde_json::to_value(StateFile {
            version: STATE_VERSION,
            prepared: Prepared::Existing {
                fstype: "xfs".into(),
            },
        })
        .expect("encodes");
        assert_eq!(
            existing,
            serde_json::json!({"version": 1, "kind": "existing", "fstype": "xfs"})
        );
    }

    /// A runner that records argv and answers with canned statuses (no process spawned).
    struct Scripted {
        seen: Vec<Vec<std::ffi::OsString>>,
        statuses: Vec<i32>,
    }
    impl Runner for Scripted {
        fn run(&mut self, command: Command) -> io::Result<ExitStatus> {
            use std::os::unix::process::ExitStatusExt;
            self.seen
                .push(command.get_args().map(ToOwned::to_owned).collect());
            let code = if self.statuses.is_empty() {
                0
            } else {
                self.statuses.remove(0)
            };
            Ok(ExitStatus::from_raw(code << 8))
        }
    }

    #[test]
    fn format_falls_back_without_prezeroed_once() {
        let c = config();
        let prezeroed = mkfs::mkfs_args(&c.image_path, true);
        let plain = mkfs::mkfs_args(&c.image_path, false);

        let mut ok = Scripted {
            seen: vec![],
            statuses: vec![0],
        };
        assert!(format(&c, &mut ok).is_ok());
        assert_eq!(ok.seen, vec![prezeroed.clone()]);

        let mut old = Scripted {
            seen: vec![],
            statuses: vec![1, 0],
        };
        assert!(format(&c, &mut old).is_ok());
        assert_eq!(old.seen, vec![prezeroed.clone(), plain.clone()]);

        let mut broken = Scripted {
            seen: vec![],
            statuses: vec![1, 1],
        };
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
        let error = StorageError::AttachLoop {
            image: "/img".into(),
            source: LoopError::MknodControl {
                path: "/dev/loop-control".into(),
                source: Errno::EPERM,
            },
        };
        assert_eq!(error.to_string(), "cannot attach /img to a loop device");
        let source = std::error::Error::source(&error).expect("has a source");
        assert_eq!(
            source.to_string(),
            "no free loop device: /dev/loop-control is missing and mknod failed — is the container privileged (CAP_MKNOD) with a writable /dev?"
        );
    }
}
