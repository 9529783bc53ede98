//! Storage errors: each names the step, the path and what to check.

use std::io;
use std::path::PathBuf;
use std::process::ExitStatus;

use nix::errno::Errno;

use super::*;

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
    MkfsFailed { mkfs: PathBuf, image: PathBuf, status: ExitStatus },
    #[error("cannot attach {image} to a loop device")]
    AttachLoop {
        image: PathBuf,
        #[source]
        source: LoopError,
    },
    #[error("mounting {device} (ext4) on {mountpoint} failed — is the container privileged (CAP_SYS_ADMIN) and ext4 in /proc/filesystems?")]
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
