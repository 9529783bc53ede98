//! Making the mountpoint ready: adopting an existing mount, or image → mkfs → loop → mount, undone on failure.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use nix::mount::MsFlags;

use super::loopdev::{LoopPaths, Strategy};
use super::*;

// ---- prepare -------------------------------------------------------------------------

/// Makes `config.mountpoint` ready for dockerd (L1–L8). See the module docs.
///
/// # Errors
/// The first step that failed; everything created before it has been undone.
pub fn prepare(config: &StorageConfig, runner: &mut dyn Runner) -> Result<Prepared, StorageError> {
    prepare_with(config, runner, &LoopPaths::default(), Strategy::Auto)
}

pub(super) fn prepare_with(config: &StorageConfig, runner: &mut dyn Runner, paths: &LoopPaths, strategy: Strategy) -> Result<Prepared, StorageError> {
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
pub(super) fn adopt(config: &StorageConfig, entry: &mountinfo::MountEntry) -> Option<Prepared> {
    let previous = read_state(&config.state_file).ok()?;
    match &previous {
        Prepared::Created { image_path, loop_device, mountpoint, .. }
            if *image_path == config.image_path && *mountpoint == config.mountpoint && entry.fstype == "ext4" && entry.source == loop_device.as_os_str() =>
        {
            Some(previous)
        }
        _ => None,
    }
}

/// What `create` has done so far, undone in reverse if a later step fails.
#[derive(Debug, Default)]
pub(super) struct Undo {
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

pub(super) fn create(
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
        loopdev::attach(paths, &image, &config.image_path, strategy).map_err(|source| StorageError::AttachLoop { image: config.image_path.clone(), source })?;
    drop(image); // the loop device holds its own reference now
    let attach_ms = step.elapsed().as_millis();
    let loopdev::Attached { index, device, fd, used_configure, tries } = attached;
    undo.loop_device = Some((index, device.clone(), Some(fd)));

    // L6: ext4, noatime. (noinit_itable is unnecessary: assume_storage_prezeroed marks
    // the tables zeroed, and without it the lazy-init writes are holes on a sparse file.)
    let step = Instant::now();
    nix::mount::mount(Some(device.as_path()), config.mountpoint.as_path(), Some("ext4"), MsFlags::MS_NOATIME, None::<&str>)
        .map_err(|source| StorageError::Mount { device: device.clone(), mountpoint: config.mountpoint.clone(), source })?;
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
pub(super) fn ensure_mountpoint_dir(mountpoint: &Path) -> Result<bool, StorageError> {
    match std::fs::metadata(mountpoint) {
        Ok(meta) if meta.is_dir() => Ok(false),
        Ok(_) => Err(StorageError::MountpointNotDir { path: mountpoint.to_path_buf() }),
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            std::fs::create_dir_all(mountpoint).map_err(|source| StorageError::CreateDir { path: mountpoint.to_path_buf(), source })?;
            Ok(true)
        }
        Err(source) => Err(StorageError::ResolvePath { path: mountpoint.to_path_buf(), source }),
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
pub(super) fn create_image(path: &Path, size: u64) -> Result<File, StorageError> {
    let create_error = |source| StorageError::CreateImage { path: path.to_path_buf(), source };
    let parent = path.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(parent).map_err(|source| StorageError::CreateDir { path: parent.to_path_buf(), source })?;
    match path.symlink_metadata() {
        Ok(meta) if meta.file_type().is_file() => {
            tracing::warn!(image = %path.display(), stale_bytes = meta.len(), "replacing stale image from an earlier boot");
            std::fs::remove_file(path).map_err(|source| StorageError::RemoveStaleImage { path: path.to_path_buf(), source })?;
        }
        Ok(meta) => {
            return Err(StorageError::ImageNotRegular { path: path.to_path_buf(), found: format!("{:?}", meta.file_type()) });
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        Err(source) => return Err(create_error(source)),
    }
    let file = OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).custom_flags(libc::O_CLOEXEC).open(path).map_err(create_error)?;
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
pub(super) fn warn_about_backing_fs(dir: &Path, size: u64) {
    if let Ok(fs) = nix::sys::statfs::statfs(dir)
        && fs.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC
    {
        tracing::warn!(dir = %dir.display(), "image is on tmpfs: every block dockerd writes costs RAM");
    }
    if let Ok(vfs) = nix::sys::statvfs::statvfs(dir) {
        #[allow(clippy::useless_conversion, reason = "fsblkcnt_t and c_ulong are narrower than u64 on 32-bit targets")]
        let free = u64::from(vfs.blocks_available()).saturating_mul(u64::from(vfs.fragment_size()));
        if free < size.min(FREE_SPACE_FLOOR) {
            tracing::warn!(dir = %dir.display(), free_bytes = free, image_bytes = size, "little free space under the image; docker will get I/O errors when it runs out");
        }
    }
}

/// L4: format through the PID-1 runner, with `assume_storage_prezeroed` if mke2fs knows
/// it (1.47.0+); older ones reject the unknown `-E` option with exit 1, so retry once
/// without it.
pub(super) fn format(config: &StorageConfig, runner: &mut dyn Runner) -> Result<(), StorageError> {
    let mut last = None;
    for prezeroed in [true, false] {
        let mut command = Command::new(&config.mkfs);
        command.args(mkfs::mkfs_args(&config.image_path, prezeroed)).stdin(Stdio::null());
        let status = runner.run(command).map_err(|source| StorageError::SpawnMkfs { mkfs: config.mkfs.clone(), source })?;
        if status.success() {
            if !prezeroed {
                tracing::info!("mkfs.ext4 lacks assume_storage_prezeroed (e2fsprogs < 1.47); formatted without it");
            }
            return Ok(());
        }
        tracing::debug!(%status, prezeroed, "mkfs.ext4 failed");
        last = Some(status);
    }
    Err(StorageError::MkfsFailed { mkfs: config.mkfs.clone(), image: config.image_path.clone(), status: last.unwrap_or_default() })
}
