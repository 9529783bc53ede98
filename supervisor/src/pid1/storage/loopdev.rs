//! Loop devices through hand-written ioctls on `/dev/loop-control` and `/dev/loopN`
//! (rules L2, L5, L7 of the storage module).
//!
//! Why hand-written instead of a crate: `loopdev` and `loopdev-3` generate their bindings
//! with bindgen at build time (libclang plus kernel headers on the build host, which is
//! friction for the static musl build), only know the two-step `LOOP_SET_FD` +
//! `LOOP_SET_STATUS64` path (no `LOOP_CONFIGURE`), have no EBUSY/EAGAIN retries and never
//! create a missing `/dev/loopN`. `libc` lacks `LOOP_CONFIGURE` and `struct loop_config`.
//! The uapi below is small and frozen, so it is spelled out here with size assertions.
//!
//! The retry policy mirrors util-linux (`lib/loopdev.c`, `sys-utils/losetup.c`), with
//! shorter sleeps: `LOOP_CTL_GET_FREE` reserves nothing, so another process on the same
//! (host-global, under runc) kernel can bind the index first and we then start over.
//!
//! `unsafe` is confined to the four ioctl wrappers in this file. (The workspace habit is
//! to keep `unsafe` in a `sys` module; this module *is* the storage code's sys layer.)

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::stat::{Mode, SFlag, makedev, mknod};

// ---- <linux/loop.h> ------------------------------------------------------------------
// ioctl numbers are ('L' << 8) | n; values as in the kernel uapi header.

/// `LOOP_SET_FD` = 0x4C00: bind the device to an open file (legacy step 1).
const LOOP_SET_FD: libc::Ioctl = 0x4C00;
/// `LOOP_CLR_FD` = 0x4C01: unbind; with other openers it only sets autoclear.
const LOOP_CLR_FD: libc::Ioctl = 0x4C01;
/// `LOOP_SET_STATUS64` = 0x4C04: flags, name, offset (legacy step 2).
const LOOP_SET_STATUS64: libc::Ioctl = 0x4C04;
/// `LOOP_GET_STATUS64` = 0x4C05: read back the binding (backing dev/inode, flags).
const LOOP_GET_STATUS64: libc::Ioctl = 0x4C05;
/// `LOOP_CONFIGURE` = 0x4C0A (Linux 5.8): fd + status + block size in one call.
const LOOP_CONFIGURE: libc::Ioctl = 0x4C0A;
/// `LOOP_CTL_GET_FREE` = 0x4C82, on `/dev/loop-control`: a free index, allocating one.
const LOOP_CTL_GET_FREE: libc::Ioctl = 0x4C82;
/// `LO_FLAGS_AUTOCLEAR` = 4: detach on the last close (i.e. after the final umount).
const LO_FLAGS_AUTOCLEAR: u32 = 4;
/// `LO_NAME_SIZE` = 64, `LO_KEY_SIZE` = 32.
const LO_NAME_SIZE: usize = 64;
const LO_KEY_SIZE: usize = 32;
/// `/dev/loop-control` is misc char 10:237 (Documentation/admin-guide/devices.txt).
const LOOP_CONTROL_MAJOR: u64 = 10;
const LOOP_CONTROL_MINOR: u64 = 237;

/// `struct loop_info64`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct LoopInfo64 {
    pub lo_device: u64,
    pub lo_inode: u64,
    pub lo_rdevice: u64,
    pub lo_offset: u64,
    pub lo_sizelimit: u64,
    pub lo_number: u32,
    pub lo_encrypt_type: u32,
    pub lo_encrypt_key_size: u32,
    pub lo_flags: u32,
    pub lo_file_name: [u8; LO_NAME_SIZE],
    pub lo_crypt_name: [u8; LO_NAME_SIZE],
    pub lo_encrypt_key: [u8; LO_KEY_SIZE],
    pub lo_init: [u64; 2],
}

/// `struct loop_config`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

// The kernel copies exactly these sizes; a layout slip would corrupt the call silently.
const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);
const _: () = assert!(std::mem::size_of::<LoopConfig>() == 304);

impl LoopInfo64 {
    const fn zeroed() -> Self {
        Self {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: 0,
            lo_file_name: [0; LO_NAME_SIZE],
            lo_crypt_name: [0; LO_NAME_SIZE],
            lo_encrypt_key: [0; LO_KEY_SIZE],
            lo_init: [0; 2],
        }
    }

    /// Status for a new binding: autoclear, and the image path as the (informational,
    /// NUL-terminated, truncated) file name, like losetup.
    fn for_image(image: &Path) -> Self {
        let mut info = Self::zeroed();
        info.lo_flags = LO_FLAGS_AUTOCLEAR;
        let bytes = image.as_os_str().as_bytes();
        let n = bytes.len().min(LO_NAME_SIZE - 1);
        info.lo_file_name[..n].copy_from_slice(&bytes[..n]);
        info
    }
}

fn ioctl_arg(fd: BorrowedFd<'_>, request: libc::Ioctl, arg: libc::c_ulong) -> Result<i32, Errno> {
    // SAFETY: only called with requests whose argument is an integer passed by value
    // (LOOP_CTL_GET_FREE ignores it, LOOP_SET_FD takes an fd, LOOP_CLR_FD takes 0); the
    // kernel never dereferences it, and `fd` is a live descriptor for the call's duration.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request, arg) };
    Errno::result(rc)
}

fn ioctl_configure(fd: BorrowedFd<'_>, config: &LoopConfig) -> Result<(), Errno> {
    // SAFETY: LOOP_CONFIGURE reads a `struct loop_config` (304 bytes, asserted above)
    // through the pointer; `config` is a live, properly aligned #[repr(C)] value and the
    // kernel does not keep the pointer after the call.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), LOOP_CONFIGURE, std::ptr::from_ref(config)) };
    Errno::result(rc).map(drop)
}

fn ioctl_set_status(fd: BorrowedFd<'_>, info: &LoopInfo64) -> Result<(), Errno> {
    // SAFETY: LOOP_SET_STATUS64 reads a `struct loop_info64` (232 bytes, asserted above)
    // from a live, aligned #[repr(C)] value; the pointer is not retained.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), LOOP_SET_STATUS64, std::ptr::from_ref(info)) };
    Errno::result(rc).map(drop)
}

fn ioctl_get_status(fd: BorrowedFd<'_>) -> Result<LoopInfo64, Errno> {
    let mut info = LoopInfo64::zeroed();
    // SAFETY: LOOP_GET_STATUS64 writes one `struct loop_info64` (232 bytes, asserted
    // above) into the exclusive, aligned, fully initialised buffer we pass.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), LOOP_GET_STATUS64, std::ptr::from_mut(&mut info)) };
    Errno::result(rc).map(|_| info)
}

// ---- errors --------------------------------------------------------------------------

/// Why the contents of `/sys/block/loopN/dev` could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SysDevError {
    #[error("expected \"major:minor\", found {0:?}")]
    Malformed(String),
}

/// A loop-device step that failed. Display says what to check; the source says why.
#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    #[error("no free loop device: {path} is missing and mknod failed — is the container privileged (CAP_MKNOD) with a writable /dev?")]
    MknodControl {
        path: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("cannot open {path} — is the container privileged (device cgroup must allow c 10:237 rw)?")]
    OpenControl {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("no free loop device: LOOP_CTL_GET_FREE on {path} failed — is the loop driver loaded and max_loop not exhausted?")]
    GetFree {
        path: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("cannot read the device number of a new loop device from {path} — is /sys mounted?")]
    ReadSysDev {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot parse the device number in {path}")]
    ParseSysDev {
        path: PathBuf,
        #[source]
        source: SysDevError,
    },
    #[error("{path} is missing (container /dev is populated once at start) and mknod failed — is the container privileged (CAP_MKNOD)?")]
    MknodLoop {
        path: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("{path} exists but is not block device {major}:{minor} ({found}); refusing to use it")]
    NodeMismatch { path: PathBuf, major: u32, minor: u32, found: String },
    #[error("cannot open {path} — check that /dev is not mounted nodev and the device cgroup allows b 7:* rw")]
    OpenLoop {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("binding {image} to {device} with {ioctl} failed")]
    Bind {
        device: PathBuf,
        image: PathBuf,
        ioctl: &'static str,
        #[source]
        source: Errno,
    },
    #[error("no free loop device after {tries} attempts: another process bound each free index first (last tried {device})")]
    Exhausted {
        device: PathBuf,
        tries: u32,
        #[source]
        source: Errno,
    },
    #[error("reading back the status of {device} failed")]
    Status {
        device: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("{device} was bound but does not look like ours: {what}")]
    Verify { device: PathBuf, what: String },
    #[error("cannot stat backing file {path} to verify which loop device is ours")]
    StatImage {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("detaching {device} (LOOP_CLR_FD) failed")]
    Detach {
        device: PathBuf,
        #[source]
        source: Errno,
    },
}

// ---- pure helpers --------------------------------------------------------------------

/// Parses `/sys/block/loopN/dev` ("7:3\n"): strict decimal, one colon, surrounding
/// whitespace ignored.
///
/// # Errors
/// Anything else.
pub fn parse_sys_dev(text: &str) -> Result<(u32, u32), SysDevError> {
    let malformed = || SysDevError::Malformed(text.to_owned());
    let (major, minor) = text.trim().split_once(':').ok_or_else(malformed)?;
    let number = |s: &str| -> Result<u32, SysDevError> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(malformed());
        }
        s.parse().map_err(|_| malformed())
    };
    Ok((number(major)?, number(minor)?))
}

/// Whether a sysfs `backing_file` value names `image` (the kernel appends " (deleted)"
/// once the file is unlinked).
fn names_image(backing: &[u8], image: &Path) -> bool {
    let backing = backing.strip_suffix(b"\n").unwrap_or(backing);
    let backing = backing.strip_suffix(b" (deleted)").unwrap_or(backing);
    backing == image.as_os_str().as_bytes()
}

// ---- the real thing ------------------------------------------------------------------

/// Where the loop nodes and their sysfs directories live. Only tests use other values
/// (a scratch `dev_dir` exercises the mknod paths without touching `/dev`).
#[derive(Debug, Clone)]
pub(crate) struct LoopPaths {
    pub dev_dir: PathBuf,
    pub sys_block: PathBuf,
}

impl Default for LoopPaths {
    fn default() -> Self {
        Self { dev_dir: PathBuf::from("/dev"), sys_block: PathBuf::from("/sys/block") }
    }
}

impl LoopPaths {
    fn control(&self) -> PathBuf {
        self.dev_dir.join("loop-control")
    }
    pub fn node(&self, index: u32) -> PathBuf {
        self.dev_dir.join(format!("loop{index}"))
    }
    fn sys(&self, index: u32) -> PathBuf {
        self.sys_block.join(format!("loop{index}"))
    }
}

/// Which attach path to take. `LegacyOnly` exists so tests can exercise the fallback on
/// kernels that have `LOOP_CONFIGURE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Strategy {
    Auto,
    #[cfg_attr(not(test), expect(dead_code, reason = "only tests force the fallback"))]
    LegacyOnly,
}

/// A bound loop device. Dropping `fd` after the mount lets autoclear fire on umount.
#[derive(Debug)]
pub(crate) struct Attached {
    pub index: u32,
    pub device: PathBuf,
    pub fd: File,
    pub used_configure: bool,
    pub tries: u32,
}

const OPEN_RETRIES: u32 = 16;
const OPEN_RETRY_DELAY: Duration = Duration::from_millis(25);
const ATTACH_TRIES: u32 = 64;
const STATUS_RETRIES: u32 = 40;
const STATUS_RETRY_DELAY: Duration = Duration::from_millis(50);

/// Short, growing pauses before the next GET_FREE after losing a race: the next free
/// index is usually a different one, so there is nothing to wait for at first.
fn race_backoff() -> contract::backoff::Backoff {
    contract::backoff::Backoff::new(Duration::from_millis(10), Duration::from_millis(200))
}

/// Opens read-write (std adds O_CLOEXEC), retrying ENOENT/EACCES 16×25 ms like
/// util-linux: a node can appear or get its permissions a moment after creation.
fn open_rw_retry(path: &Path) -> io::Result<File> {
    let mut attempt = 0;
    loop {
        match OpenOptions::new().read(true).write(true).custom_flags(libc::O_CLOEXEC).open(path) {
            Ok(file) => return Ok(file),
            Err(error) if attempt + 1 < OPEN_RETRIES && matches!(error.raw_os_error(), Some(libc::ENOENT | libc::EACCES)) => {
                attempt += 1;
                sleep(OPEN_RETRY_DELAY);
            }
            Err(error) => return Err(error),
        }
    }
}

/// L2: create `/dev/loop-control` (c 10:237, 0660) if the container's /dev lacks it.
fn ensure_control(paths: &LoopPaths) -> Result<PathBuf, LoopError> {
    let path = paths.control();
    if path.symlink_metadata().is_err() {
        tracing::info!(path = %path.display(), "creating missing loop-control node");
        match mknod(&path, SFlag::S_IFCHR, Mode::from_bits_truncate(0o660), makedev(LOOP_CONTROL_MAJOR, LOOP_CONTROL_MINOR)) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(source) => return Err(LoopError::MknodControl { path, source }),
        }
    }
    Ok(path)
}

/// L5: make sure `/dev/loopN` exists and is the right block device, creating it from the
/// sysfs device number if missing (container /dev never sees devices added later).
fn ensure_node(paths: &LoopPaths, index: u32) -> Result<PathBuf, LoopError> {
    let sys_dev = paths.sys(index).join("dev");
    let text = std::fs::read_to_string(&sys_dev).map_err(|source| LoopError::ReadSysDev { path: sys_dev.clone(), source })?;
    let (major, minor) = parse_sys_dev(&text).map_err(|source| LoopError::ParseSysDev { path: sys_dev.clone(), source })?;
    let node = paths.node(index);
    let wanted = makedev(u64::from(major), u64::from(minor));
    for _ in 0..2 {
        match node.symlink_metadata() {
            Ok(meta) if meta.file_type().is_block_device() && meta.rdev() == wanted => {
                return Ok(node);
            }
            Ok(meta) => {
                let found = if meta.file_type().is_block_device() {
                    format!("block device {}:{}", nix::sys::stat::major(meta.rdev()), nix::sys::stat::minor(meta.rdev()))
                } else {
                    format!("{:?}", meta.file_type())
                };
                return Err(LoopError::NodeMismatch { path: node, major, minor, found });
            }
            Err(_) => {
                tracing::debug!(path = %node.display(), major, minor, "creating missing loop node");
                match mknod(&node, SFlag::S_IFBLK, Mode::from_bits_truncate(0o660), wanted) {
                    // EEXIST: someone created it meanwhile; check what it is.
                    Ok(()) | Err(Errno::EEXIST) => {}
                    Err(source) => return Err(LoopError::MknodLoop { path: node, source }),
                }
            }
        }
    }
    Ok(node)
}

enum BindOutcome {
    Bound {
        used_configure: bool,
    },
    /// Someone else bound this index first (EBUSY/EAGAIN): start over with GET_FREE.
    Lost(Errno),
}

fn bind(dev: &File, device: &Path, image: &File, image_path: &Path, try_configure: &mut bool) -> Result<BindOutcome, LoopError> {
    let bind_error = |ioctl, source| LoopError::Bind { device: device.to_path_buf(), image: image_path.to_path_buf(), ioctl, source };
    let image_fd = u32::try_from(image.as_raw_fd()).map_err(|_| bind_error("fd", Errno::EBADF))?;
    let info = LoopInfo64::for_image(image_path);

    if *try_configure {
        let config = LoopConfig { fd: image_fd, block_size: 0, info, reserved: [0; 8] };
        match ioctl_configure(dev.as_fd(), &config) {
            Ok(()) => {
                return Ok(BindOutcome::Bound { used_configure: true });
            }
            Err(e @ (Errno::EBUSY | Errno::EAGAIN)) => return Ok(BindOutcome::Lost(e)),
            // util-linux falls back on exactly these: pre-5.8 kernels (EINVAL/ENOTTY),
            // 32-bit compat (ENOTTY), stubs (ENOSYS).
            Err(e @ (Errno::EINVAL | Errno::ENOTTY | Errno::ENOSYS)) => {
                tracing::info!(error = %e, "LOOP_CONFIGURE unavailable; using LOOP_SET_FD + LOOP_SET_STATUS64");
                *try_configure = false;
            }
            Err(source) => return Err(bind_error("LOOP_CONFIGURE", source)),
        }
    }

    match ioctl_arg(dev.as_fd(), LOOP_SET_FD, libc::c_ulong::from(image_fd)) {
        Ok(_) => {}
        Err(e @ (Errno::EBUSY | Errno::EAGAIN)) => return Ok(BindOutcome::Lost(e)),
        Err(source) => return Err(bind_error("LOOP_SET_FD", source)),
    }
    let mut attempt = 0;
    loop {
        match ioctl_set_status(dev.as_fd(), &info) {
            Ok(()) => {
                return Ok(BindOutcome::Bound { used_configure: false });
            }
            Err(Errno::EAGAIN) if attempt + 1 < STATUS_RETRIES => {
                attempt += 1;
                sleep(STATUS_RETRY_DELAY);
            }
            Err(source) => {
                // We bound it with SET_FD, so it is ours to undo (util-linux does the
                // same unless the error was EBUSY, which SET_STATUS64 does not return).
                if let Err(error) = ioctl_arg(dev.as_fd(), LOOP_CLR_FD, 0) {
                    tracing::warn!(device = %device.display(), %error, "LOOP_CLR_FD after failed LOOP_SET_STATUS64");
                }
                return Err(bind_error("LOOP_SET_STATUS64", source));
            }
        }
    }
}

/// L5: GET_FREE → sysfs dev → node (mknod if missing) → open (retry) → bind with
/// autoclear (LOOP_CONFIGURE, or the two-step fallback) → verify; start over on EBUSY.
pub(crate) fn attach(paths: &LoopPaths, image: &File, image_path: &Path, strategy: Strategy) -> Result<Attached, LoopError> {
    let control_path = ensure_control(paths)?;
    let control = open_rw_retry(&control_path).map_err(|source| LoopError::OpenControl { path: control_path.clone(), source })?;
    let mut try_configure = strategy == Strategy::Auto;
    let mut last = (PathBuf::new(), Errno::EBUSY);
    let mut pauses = race_backoff();
    for attempt in 1..=ATTACH_TRIES {
        let index = ioctl_arg(control.as_fd(), LOOP_CTL_GET_FREE, 0).map_err(|source| LoopError::GetFree { path: control_path.clone(), source })?;
        let index = u32::try_from(index).map_err(|_| LoopError::GetFree { path: control_path.clone(), source: Errno::ERANGE })?;
        let device = ensure_node(paths, index)?;
        let dev = open_rw_retry(&device).map_err(|source| LoopError::OpenLoop { path: device.clone(), source })?;
        match bind(&dev, &device, image, image_path, &mut try_configure)? {
            BindOutcome::Bound { used_configure } => {
                verify_binding(&dev, &device, image, image_path)?;
                return Ok(Attached { index, device, fd: dev, used_configure, tries: attempt });
            }
            BindOutcome::Lost(errno) => {
                tracing::debug!(device = %device.display(), %errno, attempt, "loop device taken meanwhile; retrying");
                last = (device, errno);
                sleep(pauses.next_delay());
            }
        }
    }
    Err(LoopError::Exhausted { device: last.0, tries: ATTACH_TRIES, source: last.1 })
}

/// Reads the binding back: it must be our image (by device and inode, as the kernel
/// reports them via `vfs_getattr`, i.e. the same numbers `fstat` gives) with autoclear.
fn verify_binding(dev: &File, device: &Path, image: &File, image_path: &Path) -> Result<(), LoopError> {
    let info = ioctl_get_status(dev.as_fd()).map_err(|source| LoopError::Status { device: device.to_path_buf(), source })?;
    let meta = image.metadata().map_err(|source| LoopError::StatImage { path: image_path.to_path_buf(), source })?;
    if (info.lo_device, info.lo_inode) != (meta.dev(), meta.ino()) {
        return Err(LoopError::Verify {
            device: device.to_path_buf(),
            what: format!("backing dev/inode {}/{} instead of {}/{}", info.lo_device, info.lo_inode, meta.dev(), meta.ino()),
        });
    }
    if info.lo_flags & LO_FLAGS_AUTOCLEAR == 0 {
        // Ours but without autoclear: it would outlive the mount. Undo it.
        if let Err(error) = ioctl_arg(dev.as_fd(), LOOP_CLR_FD, 0) {
            tracing::warn!(device = %device.display(), %error, "LOOP_CLR_FD after missing autoclear");
        }
        return Err(LoopError::Verify { device: device.to_path_buf(), what: format!("flags {:#x} lack LO_FLAGS_AUTOCLEAR", info.lo_flags) });
    }
    Ok(())
}

/// For `doctor`: opens `loop_control` read-write and asks for the next free index
/// (`LOOP_CTL_GET_FREE`). Binds nothing; the only side effect is the kernel allocating
/// an unbound `loopN` when none is free, which any later `losetup -f` would do too.
///
/// # Errors
/// The open or the ioctl failed (not privileged, device cgroup, no loop driver).
pub fn probe_loop_control(loop_control: &Path) -> Result<u32, LoopError> {
    let control = open_rw_retry(loop_control).map_err(|source| LoopError::OpenControl { path: loop_control.to_path_buf(), source })?;
    let get_free_error = |source| LoopError::GetFree { path: loop_control.to_path_buf(), source };
    let index = ioctl_arg(control.as_fd(), LOOP_CTL_GET_FREE, 0).map_err(get_free_error)?;
    u32::try_from(index).map_err(|_| get_free_error(Errno::ERANGE))
}

/// What [`detach_if_ours`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Detached {
    /// Unbound by autoclear (the normal case after the final umount).
    Autocleared,
    /// Still bound to our image after umount; LOOP_CLR_FD unbound it.
    Cleared,
    /// The index is now bound to someone else's file: ours was detached, theirs is left.
    Reused,
    /// Ours, but something still holds it open (e.g. a lazily unmounted fs); autoclear is
    /// set, so it detaches when that goes away.
    Deferred,
}

const DETACH_POLLS: u32 = 40;
const DETACH_POLL_DELAY: Duration = Duration::from_millis(25);

/// `Some(true)`: bound to `image`; `Some(false)`: bound to something else; `None`:
/// unbound (the `loop/` sysfs group only exists while bound).
fn sys_bound_to(paths: &LoopPaths, index: u32, image: &Path) -> Option<bool> {
    std::fs::read(paths.sys(index).join("loop/backing_file")).ok().map(|backing| names_image(&backing, image))
}

fn poll_unbound(paths: &LoopPaths, index: u32, image: &Path) -> Option<bool> {
    for _ in 0..DETACH_POLLS {
        match sys_bound_to(paths, index, image) {
            Some(true) => sleep(DETACH_POLL_DELAY),
            other => return other,
        }
    }
    Some(true)
}

/// L7-safe detach: only ever clears `index` if it is still bound to *our* image, judged
/// first by the sysfs path and then by backing device + inode. Other processes' loops
/// (the host's, under runc) are never opened for writing or cleared.
///
/// `still_busy`: the filesystem was detached lazily (`MNT_DETACH`) and is known to be in
/// use, so the device cannot unbind yet; autoclear (verified at attach) will do it when
/// the last user goes, and neither waiting nor LOOP_CLR_FD would change that.
pub(crate) fn detach_if_ours(paths: &LoopPaths, index: u32, device: &Path, image: &Path, still_busy: bool) -> Result<Detached, LoopError> {
    let bound = if still_busy { sys_bound_to(paths, index, image) } else { poll_unbound(paths, index, image) };
    match bound {
        None => return Ok(Detached::Autocleared),
        Some(false) => return Ok(Detached::Reused),
        Some(true) if still_busy => return Ok(Detached::Deferred),
        Some(true) => {}
    }
    let meta = std::fs::metadata(image).map_err(|source| LoopError::StatImage { path: image.to_path_buf(), source })?;
    let dev = open_rw_retry(device).map_err(|source| LoopError::OpenLoop { path: device.to_path_buf(), source })?;
    let info = match ioctl_get_status(dev.as_fd()) {
        Ok(info) => info,
        Err(Errno::ENXIO) => return Ok(Detached::Autocleared),
        Err(source) => {
            return Err(LoopError::Status { device: device.to_path_buf(), source });
        }
    };
    if (info.lo_device, info.lo_inode) != (meta.dev(), meta.ino()) {
        return Ok(Detached::Reused);
    }
    tracing::warn!(device = %device.display(), "loop device still bound after unmount; clearing it");
    match ioctl_arg(dev.as_fd(), LOOP_CLR_FD, 0) {
        Ok(_) => {}
        Err(Errno::ENXIO) => return Ok(Detached::Autocleared),
        // Older kernels refuse with EBUSY while others hold it open; autoclear is set.
        Err(Errno::EBUSY) => return Ok(Detached::Deferred),
        Err(source) => {
            return Err(LoopError::Detach { device: device.to_path_buf(), source });
        }
    }
    // With other openers CLR_FD only marks the device for rundown; our close may be the
    // last one, which then unbinds it.
    drop(dev);
    match poll_unbound(paths, index, image) {
        Some(true) => Ok(Detached::Deferred),
        None | Some(false) => Ok(Detached::Cleared),
    }
}

/// `/sys/block/loopN/loop/backing_file` without the trailing newline, if bound.
#[cfg(test)]
fn sys_backing_file(paths: &LoopPaths, index: u32) -> Option<Vec<u8>> {
    std::fs::read(paths.sys(index).join("loop/backing_file")).ok().map(|mut b| {
        if b.ends_with(b"\n") {
            b.pop();
        }
        b
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sys_dev_table() {
        let good: &[(&str, (u32, u32))] = &[
            ("7:3\n", (7, 3)),
            ("7:3", (7, 3)),
            ("7:0\n", (7, 0)),
            ("259:12\n", (259, 12)),
            ("7:1048575\n", (7, 1_048_575)),
            (" 7:3 \n", (7, 3)),
            ("4294967295:0", (u32::MAX, 0)),
        ];
        for (text, expected) in good {
            assert_eq!(parse_sys_dev(text), Ok(*expected), "{text:?}");
        }
        let bad = ["", "\n", "7", "7:", ":3", "7:3:1", "7 :3", "7: 3", "+7:3", "7:-3", "x:3", "7:3x", "4294967296:0", "7;3", "7:3\n8:4\n"];
        for text in bad {
            assert_eq!(parse_sys_dev(text), Err(SysDevError::Malformed(text.to_owned())), "{text:?}");
        }
    }

    #[test]
    fn backing_file_matching() {
        let image = Path::new("/var/lib/supervisor/docker.img");
        let cases: &[(&[u8], bool)] = &[
            (b"/var/lib/supervisor/docker.img\n", true),
            (b"/var/lib/supervisor/docker.img", true),
            (b"/var/lib/supervisor/docker.img (deleted)\n", true),
            (b"/var/lib/supervisor/docker.img.old\n", false),
            (b"/other.img\n", false),
            (b"\n", false),
        ];
        for (backing, expected) in cases {
            assert_eq!(names_image(backing, image), *expected, "{}", String::from_utf8_lossy(backing));
        }
    }

    #[test]
    fn status_name_is_truncated_and_terminated() {
        let long = PathBuf::from(format!("/{}", "x".repeat(100)));
        let info = LoopInfo64::for_image(&long);
        assert_eq!(info.lo_file_name[LO_NAME_SIZE - 1], 0);
        assert_eq!(&info.lo_file_name[..2], b"/x");
        assert_eq!(info.lo_flags, LO_FLAGS_AUTOCLEAR);
        let short = LoopInfo64::for_image(Path::new("/a.img"));
        assert_eq!(&short.lo_file_name[..7], b"/a.img\0");
    }

    #[test]
    fn backoff_stays_small() {
        let mut pauses = race_backoff();
        let first = pauses.next_delay();
        let total: Duration = first + (2..=ATTACH_TRIES).map(|_| pauses.next_delay()).sum::<Duration>();
        assert!(first <= Duration::from_millis(12), "{first:?}");
        // 64 tries: 200 ms each after the first few, ±20 %.
        assert!(total <= Duration::from_secs(16), "{total:?}");
    }

    // ---- privileged: real loop devices, nodes created in a scratch dev dir ----------

    static LOOP_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// Fails loudly, never skips: CI runs these as root.
    fn require_privileges() {
        assert!(nix::unistd::geteuid().is_root() && Path::new("/dev/loop-control").exists(), "loop device tests need root and /dev/loop-control");
    }

    struct Scratch(PathBuf);
    impl Scratch {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("supervisor-loopdev-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("scratch dir");
            Self(dir)
        }
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Attaches `image` in a scratch dev dir (so both mknod paths run), checks the
    /// binding through sysfs, then closes the fd and expects autoclear to unbind it.
    fn attach_and_autoclear(strategy: Strategy) {
        let _lock = LOOP_LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        require_privileges();
        let scratch = Scratch::new(match strategy {
            Strategy::Auto => "auto",
            Strategy::LegacyOnly => "legacy",
        });
        let paths = LoopPaths { dev_dir: scratch.0.join("dev"), sys_block: PathBuf::from("/sys/block") };
        std::fs::create_dir(&paths.dev_dir).expect("dev dir");
        let image_path = scratch.0.join("img");
        let image = File::options().read(true).write(true).create_new(true).open(&image_path).expect("image");
        image.set_len(8 << 20).expect("size");

        let attached = attach(&paths, &image, &image_path, strategy).expect("attach");
        assert_eq!(attached.used_configure, strategy == Strategy::Auto);
        assert!(paths.control().exists(), "loop-control was mknod'ed");
        assert!(attached.device.starts_with(&paths.dev_dir), "node was mknod'ed");
        let backing = sys_backing_file(&paths, attached.index);
        assert_eq!(backing.as_deref(), Some(image_path.as_os_str().as_bytes()), "bound to our image");
        let autoclear = std::fs::read_to_string(paths.sys(attached.index).join("loop/autoclear")).expect("autoclear attr");
        assert_eq!(autoclear.trim(), "1");

        let index = attached.index;
        let device = attached.device.clone();
        drop(attached); // last close: autoclear unbinds
        assert_eq!(detach_if_ours(&paths, index, &device, &image_path, false).expect("detach"), Detached::Autocleared);
        assert_eq!(sys_backing_file(&paths, index), None);
    }

    #[test]
    fn attach_with_loop_configure_and_mknod() {
        attach_and_autoclear(Strategy::Auto);
    }

    #[test]
    fn attach_with_legacy_two_step() {
        attach_and_autoclear(Strategy::LegacyOnly);
    }

    /// A binding without autoclear (as `losetup` makes) to our image is cleared; asking
    /// about an image it is *not* bound to leaves it alone (L7).
    #[test]
    fn detach_clears_ours_and_leaves_others() {
        let _lock = LOOP_LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        require_privileges();
        let scratch = Scratch::new("clear");
        let image_path = scratch.0.join("img");
        File::create(&image_path).and_then(|f| f.set_len(8 << 20)).expect("image");
        let out = std::process::Command::new("losetup").args(["-f", "--show"]).arg(&image_path).output().expect("losetup runs");
        assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
        let device = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        let index: u32 = device.to_string_lossy().trim_start_matches("/dev/loop").parse().expect("loop index");
        let paths = LoopPaths::default();
        // Safety net: whatever happens below, do not leak the device.
        struct Guard(PathBuf);
        impl Drop for Guard {
            fn drop(&mut self) {
                let _ = std::process::Command::new("losetup").arg("-d").arg(&self.0).status();
            }
        }
        let _guard = Guard(device.clone());

        let other = scratch.0.join("not-this-one");
        assert_eq!(detach_if_ours(&paths, index, &device, &other, false).expect("no error"), Detached::Reused);
        assert!(sys_backing_file(&paths, index).is_some(), "left alone");

        assert_eq!(detach_if_ours(&paths, index, &device, &image_path, false).expect("detach"), Detached::Cleared);
        assert_eq!(sys_backing_file(&paths, index), None);
    }
}
