//! Undoing exactly what `prepare` created: unmount (with retries and a lazy last resort), loop detach, image and directory removal.

use std::io;
use std::path::Path;
use std::thread::sleep;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::mount::MntFlags;

use super::loopdev::{Detached, LoopPaths};
use super::*;

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

pub(super) fn cleanup_with(prepared: &Prepared, paths: &LoopPaths) -> Result<(), StorageError> {
    let Prepared::Created { image_path, loop_device, loop_index, mountpoint, created_mountpoint_dir, created_image } = prepared else {
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
    note(match loopdev::detach_if_ours(paths, *loop_index, loop_device, image_path, lazily) {
        Ok(Detached::Deferred) => {
            tracing::warn!(device = %loop_device.display(), "loop device still in use (lazily unmounted); autoclear will detach it when released");
            Ok(())
        }
        Ok(outcome) => {
            tracing::debug!(device = %loop_device.display(), ?outcome, "loop device released");
            Ok(())
        }
        Err(source) => Err(StorageError::DetachLoop { device: loop_device.clone(), source }),
    });
    if *created_image {
        note(remove_file_if_present(image_path).map_err(|source| StorageError::RemoveImage { path: image_path.clone(), source }));
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
    tracing::info!(unmount_ms, elapsed_ms = started.elapsed().as_millis(), "storage cleaned up");
    first_error.map_or(Ok(()), Err)
}

pub(super) fn remove_file_if_present(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// Unmounts our mount at `mountpoint` if it is still there. Mounts below it (dockerd's
/// overlay and shm mounts) live on our filesystem and would keep it busy, so they go
/// first, deepest first. A foreign mount stacked on top of ours is not touched.
pub(super) fn unmount_ours(mountpoint: &Path, device: &Path) -> Result<Unmounted, StorageError> {
    let Some(resolved) = canonical(mountpoint)? else {
        return Ok(Unmounted::WasGone);
    };
    let entries = read_mountinfo()?;
    let is_ours = |entry: &mountinfo::MountEntry| entry.fstype == "ext4" && entry.source == device.as_os_str();
    match mountinfo::mount_at(&entries, &resolved) {
        Some(top) if is_ours(top) => {}
        Some(_) if entries.iter().any(|e| e.mount_point == resolved && is_ours(e)) => {
            return Err(StorageError::Covered { mountpoint: mountpoint.to_path_buf() });
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
pub(super) enum Unmounted {
    Cleanly,
    /// Still busy after the retries: detached with `MNT_DETACH`; the filesystem (and the
    /// loop device, by autoclear) is released when its last user goes.
    Lazily,
    /// Nothing (of ours) was mounted there.
    WasGone,
}

pub(super) const UMOUNT_TRIES: u32 = 12;

/// `umount2(path, 0)`, retrying EBUSY with a short growing backoff (10 ms → 300 ms,
/// ~2 s in all: long enough for just-killed processes to exit), then `MNT_DETACH`.
pub(super) fn unmount_retry(path: &Path) -> Result<Unmounted, StorageError> {
    let unmount_error = |source| StorageError::Unmount { mountpoint: path.to_path_buf(), source };
    let mut pauses = contract::backoff::Backoff::new(Duration::from_millis(10), Duration::from_millis(300));
    for _ in 0..UMOUNT_TRIES {
        match nix::mount::umount2(path, MntFlags::empty()) {
            Ok(()) => return Ok(Unmounted::Cleanly),
            Err(Errno::EBUSY) => sleep(pauses.next_delay()),
            // Not a mountpoint (any more): nothing to do.
            Err(Errno::EINVAL) => return Ok(Unmounted::WasGone),
            Err(source) => return Err(unmount_error(source)),
        }
    }
    tracing::warn!(mountpoint = %path.display(), "still busy; detaching lazily (MNT_DETACH)");
    nix::mount::umount2(path, MntFlags::MNT_DETACH).map(|()| Unmounted::Lazily).map_err(unmount_error)
}
