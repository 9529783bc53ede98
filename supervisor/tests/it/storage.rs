//! Real storage tests: root, real loop devices, real mkfs.ext4 and mounts, all under a
//! per-test scratch directory in the temp dir. They skip (loudly) without root,
//! `/dev/loop-control` or `mkfs.ext4`. Tests share the kernel's loop devices and the
//! mount table, so they run one at a time behind [`loop_devices`] (with the docker
//! tests), and a `Scratch` guard undoes everything on drop, also when an assertion failed.

use std::ffi::OsStr;
use std::fs;
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use supervisor::pid1::storage::{self, Prepared, Runner, StorageConfig, StorageError, mountinfo};

use crate::common::loop_devices;

const MIB: u64 = 1024 * 1024;

/// The lock, or `None` (test skipped) when this machine cannot run it.
/// Serialises the tests (loop devices are host-global) and fails loudly when the
/// machine cannot run them: CI runs as root with e2fsprogs from scripts/install test-peers.
fn privileged() -> MutexGuard<'static, ()> {
    let lock = loop_devices();
    let root = nix::unistd::geteuid().is_root();
    let control = Path::new("/dev/loop-control").exists();
    let mkfs = Command::new("mkfs.ext4").arg("-V").output().is_ok();
    assert!(
        root && control && mkfs,
        "storage tests need root, /dev/loop-control and mkfs.ext4 (run scripts/install test-peers as root): \
         root={root} /dev/loop-control={control} mkfs.ext4={mkfs}"
    );
    lock
}

/// Tests are not PID 1, so plain `Command::status()` is fine here. Records durations.
#[derive(Default)]
struct StatusRunner {
    runs: Vec<(String, Duration)>,
}

impl Runner for StatusRunner {
    fn run(&mut self, mut command: Command) -> io::Result<ExitStatus> {
        let argv = format!("{command:?}");
        let started = Instant::now();
        let status = command.status();
        self.runs.push((argv, started.elapsed()));
        status
    }
}

/// A runner that never spawns anything and answers with a fixed exit code.
struct FakeRunner(i32);

impl Runner for FakeRunner {
    fn run(&mut self, _command: Command) -> io::Result<ExitStatus> {
        use std::os::unix::process::ExitStatusExt;
        Ok(ExitStatus::from_raw(self.0 << 8))
    }
}

/// Per-test scratch dir. On drop: `cleanup` of whatever was prepared, lazy unmount of
/// anything still mounted below the dir, `losetup -d` of any loop device still bound to
/// a file below it, then removal of the dir.
struct Scratch {
    dir: PathBuf,
    prepared: Vec<Prepared>,
}

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("supervisor-storage-{name}-{}", std::process::id()));
        let scratch = Self { dir, prepared: Vec::new() };
        scratch.sweep();
        fs::create_dir_all(&scratch.dir).expect("scratch dir");
        scratch
    }

    fn config(&self, size_bytes: u64) -> StorageConfig {
        StorageConfig {
            mountpoint: self.dir.join("docker"),
            image_path: self.dir.join("img/docker.img"),
            size_bytes,
            mkfs: PathBuf::from("mkfs.ext4"),
            state_file: self.dir.join("run/storage.json"),
        }
    }

    fn sweep(&self) {
        for prepared in &self.prepared {
            let _ = storage::cleanup(prepared);
        }
        if let Ok(text) = fs::read("/proc/self/mountinfo")
            && let Ok(entries) = mountinfo::parse(&text)
        {
            let mut below: Vec<&PathBuf> = entries.iter().map(|e| &e.mount_point).filter(|p| p.starts_with(&self.dir)).collect();
            below.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
            for path in below {
                let _ = nix::mount::umount2(path.as_path(), nix::mount::MntFlags::MNT_DETACH);
            }
        }
        for (index, _) in bound_loops_under(&self.dir) {
            let _ = Command::new("losetup").arg("-d").arg(format!("/dev/loop{index}")).status();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        self.sweep();
    }
}

/// Every bound loop device as (index, backing file) from sysfs.
fn bound_loops() -> Vec<(u32, PathBuf)> {
    let mut found = Vec::new();
    let Ok(dir) = fs::read_dir("/sys/block") else {
        return found;
    };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(index) = name.to_str().and_then(|n| n.strip_prefix("loop")).and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if let Ok(backing) = fs::read(entry.path().join("loop/backing_file")) {
            let backing = backing.strip_suffix(b"\n").unwrap_or(&backing);
            found.push((index, PathBuf::from(OsStr::from_bytes(backing))));
        }
    }
    found.sort();
    found
}

fn bound_loops_under(dir: &Path) -> Vec<(u32, PathBuf)> {
    bound_loops().into_iter().filter(|(_, backing)| backing.starts_with(dir)).collect()
}

fn losetup_a() -> String {
    let out = Command::new("losetup").arg("-a").output().expect("losetup runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn mount_entry(path: &Path) -> Option<mountinfo::MountEntry> {
    let text = fs::read("/proc/self/mountinfo").expect("mountinfo");
    let entries = mountinfo::parse(&text).expect("parses");
    mountinfo::mount_at(&entries, path).cloned()
}

fn created(prepared: &Prepared) -> (PathBuf, PathBuf, u32, PathBuf, bool, bool) {
    match prepared.clone() {
        Prepared::Created { image_path, loop_device, loop_index, mountpoint, created_mountpoint_dir, created_image } => {
            (image_path, loop_device, loop_index, mountpoint, created_mountpoint_dir, created_image)
        }
        Prepared::Existing { fstype } => panic!("expected Created, got Existing({fstype})"),
    }
}

/// Asserts the full "prepared" picture: ext4 mount backed by our loop device, which is
/// bound to our image with autoclear, and the state file says so.
fn assert_prepared(config: &StorageConfig, prepared: &Prepared) {
    let (image, device, index, mountpoint, _, created_image) = created(prepared);
    assert_eq!(image, config.image_path);
    assert_eq!(mountpoint, config.mountpoint);
    assert!(created_image);
    assert_eq!(device, Path::new(&format!("/dev/loop{index}")));

    assert_eq!(storage::is_mountpoint(&mountpoint).expect("mountinfo"), Some("ext4".to_owned()));
    let entry = mount_entry(&mountpoint).expect("mounted");
    assert_eq!(entry.source, device.as_os_str(), "mounted from our loop device");
    assert!(entry.mount_options.split(',').any(|o| o == "noatime"), "{}", entry.mount_options);

    let sys = PathBuf::from(format!("/sys/block/loop{index}/loop"));
    let backing = fs::read_to_string(sys.join("backing_file")).expect("bound");
    assert_eq!(backing.trim_end(), image.to_str().expect("utf-8"));
    assert_eq!(fs::read_to_string(sys.join("autoclear")).expect("attr").trim(), "1");
    assert!(losetup_a().contains(image.to_str().expect("utf-8")), "losetup -a lists it");

    assert_eq!(&storage::read_state(&config.state_file).expect("state file"), prepared);
}

/// Asserts nothing of a Created preparation is left.
fn assert_cleaned(config: &StorageConfig, index: u32) {
    assert_eq!(storage::is_mountpoint(&config.mountpoint).expect("mountinfo"), None);
    assert!(mount_entry(&config.mountpoint).is_none());
    let leaked = bound_loops_under(config.image_path.parent().expect("parent"));
    assert!(leaked.is_empty(), "leaked loop devices: {leaked:?}");
    let backing = fs::read(format!("/sys/block/loop{index}/loop/backing_file")).ok();
    assert!(backing.is_none_or(|b| !b.starts_with(config.image_path.as_os_str().as_bytes())), "loop{index} still points at our image");
    let listing = losetup_a();
    assert!(!listing.contains(config.image_path.to_str().expect("utf-8")), "losetup -a: {listing}");
    assert!(!config.image_path.exists(), "image removed");
}

#[test]
fn prepare_mount_write_cleanup() {
    let _lock = privileged();
    let mut scratch = Scratch::new("roundtrip");
    let config = scratch.config(256 * MIB);
    let mut runner = StatusRunner::default();

    let started = Instant::now();
    let prepared = storage::prepare(&config, &mut runner).expect("prepare");
    let prepare_time = started.elapsed();
    scratch.prepared.push(prepared.clone());
    assert_prepared(&config, &prepared);
    let (_, _, index, _, created_dir, _) = created(&prepared);
    assert!(created_dir, "the mountpoint did not exist, so prepare created it");

    let file = config.mountpoint.join("hello");
    let mut f = fs::File::create(&file).expect("create in the mount");
    f.write_all(b"dockerd was here").expect("write");
    f.sync_all().expect("fsync");
    drop(f);
    assert_eq!(fs::read(&file).expect("read back"), b"dockerd was here");
    // The write landed in the image, not on the filesystem under the mountpoint dir.
    let sys_dev = fs::read_to_string(format!("/sys/block/loop{index}/dev")).expect("sysfs dev");
    let (major, minor) = storage::parse_sys_dev(&sys_dev).expect("major:minor");
    assert_eq!(fs::metadata(&file).expect("stat").dev(), nix::sys::stat::makedev(u64::from(major), u64::from(minor)));

    let started = Instant::now();
    storage::cleanup(&prepared).expect("cleanup");
    let cleanup_time = started.elapsed();
    scratch.prepared.clear();
    assert_cleaned(&config, index);
    assert!(!config.mountpoint.exists(), "the mountpoint dir we created is gone");
    eprintln!("256 MiB: prepare {prepare_time:?} (runs: {:?}), cleanup {cleanup_time:?}", runner.runs);
}

#[test]
fn default_20_gib_is_sparse_and_fast() {
    let _lock = privileged();
    let mut scratch = Scratch::new("20g");
    let config = scratch.config(storage::DEFAULT_SIZE_BYTES);
    let mut runner = StatusRunner::default();

    let started = Instant::now();
    let prepared = storage::prepare(&config, &mut runner).expect("prepare");
    let prepare_time = started.elapsed();
    scratch.prepared.push(prepared.clone());
    assert_prepared(&config, &prepared);
    let meta = fs::metadata(&config.image_path).expect("image");
    assert_eq!(meta.len(), 20 * 1024 * MIB);
    let allocated = meta.blocks() * 512;
    assert!(allocated < 64 * MIB, "sparse image allocated {allocated} bytes");
    let (_, _, index, _, _, _) = created(&prepared);

    let started = Instant::now();
    storage::cleanup(&prepared).expect("cleanup");
    let cleanup_time = started.elapsed();
    scratch.prepared.clear();
    assert_cleaned(&config, index);
    eprintln!(
        "20 GiB: prepare {prepare_time:?} (mkfs runs: {:?}), allocated {} KiB, cleanup {cleanup_time:?}",
        runner.runs.iter().map(|(_, d)| *d).collect::<Vec<_>>(),
        allocated / 1024
    );
}

#[test]
fn existing_mount_is_used_and_left_alone() {
    let _lock = privileged();
    let mut scratch = Scratch::new("existing");
    let config = scratch.config(256 * MIB);
    fs::create_dir_all(&config.mountpoint).expect("mountpoint");
    nix::mount::mount(Some("tmpfs"), &config.mountpoint, Some("tmpfs"), nix::mount::MsFlags::empty(), Some("size=1m")).expect("tmpfs mount");
    fs::write(config.mountpoint.join("keep"), b"x").expect("write");
    let before = bound_loops();

    let mut runner = StatusRunner::default();
    let prepared = storage::prepare(&config, &mut runner).expect("prepare");
    scratch.prepared.push(prepared.clone());
    assert_eq!(prepared, Prepared::Existing { fstype: "tmpfs".to_owned() });
    assert!(runner.runs.is_empty(), "mkfs not run");
    assert!(!config.image_path.exists(), "no image created");
    assert_eq!(bound_loops(), before, "no loop device bound");
    assert_eq!(storage::read_state(&config.state_file).expect("state"), prepared);

    storage::cleanup(&prepared).expect("cleanup is a no-op");
    assert_eq!(storage::is_mountpoint(&config.mountpoint).expect("mountinfo"), Some("tmpfs".to_owned()));
    assert_eq!(fs::read(config.mountpoint.join("keep")).expect("still there"), b"x");
    // Scratch's drop unmounts the tmpfs.
}

#[test]
fn three_cycles_leak_no_loop_devices() {
    let _lock = privileged();
    let mut scratch = Scratch::new("cycles");
    let config = scratch.config(64 * MIB);
    let before = bound_loops();
    let mut times = Vec::new();
    for cycle in 0..3 {
        let started = Instant::now();
        let prepared = storage::prepare(&config, &mut StatusRunner::default()).expect("prepare");
        scratch.prepared.push(prepared.clone());
        assert_prepared(&config, &prepared);
        let (_, _, index, _, _, _) = created(&prepared);
        storage::cleanup(&prepared).expect("cleanup");
        scratch.prepared.clear();
        assert_cleaned(&config, index);
        times.push(started.elapsed());
        let after = bound_loops();
        assert_eq!(after, before, "cycle {cycle}: the set of bound loop devices changed");
    }
    eprintln!("prepare+cleanup cycles: {times:?}");
}

#[test]
fn mkfs_failure_rolls_everything_back() {
    let _lock = privileged();
    let scratch = Scratch::new("mkfs-fails");
    let config = scratch.config(64 * MIB);
    let error = storage::prepare(&config, &mut FakeRunner(1)).expect_err("mkfs fails");
    assert!(matches!(error, StorageError::MkfsFailed { .. }), "{error:?}");
    assert!(!config.image_path.exists(), "image removed");
    assert!(!config.mountpoint.exists(), "mountpoint dir removed");
    assert!(bound_loops_under(&scratch.dir).is_empty());
}

#[test]
fn mount_failure_detaches_and_rolls_back() {
    let _lock = privileged();
    let scratch = Scratch::new("mount-fails");
    let config = scratch.config(64 * MIB);
    // "mkfs" succeeds without writing anything, so the ext4 mount fails (EINVAL).
    let error = storage::prepare(&config, &mut FakeRunner(0)).expect_err("mount fails");
    match &error {
        StorageError::Mount { source, .. } => assert_eq!(*source, nix::errno::Errno::EINVAL),
        other => panic!("expected Mount, got {other:?}"),
    }
    assert!(bound_loops_under(&scratch.dir).is_empty(), "loop device released");
    assert!(!config.image_path.exists(), "image removed");
    assert!(!config.mountpoint.exists(), "mountpoint dir removed");
}

#[test]
fn stale_image_is_replaced_and_existing_dir_kept() {
    let _lock = privileged();
    let mut scratch = Scratch::new("stale");
    let config = scratch.config(64 * MIB);
    fs::create_dir_all(config.image_path.parent().expect("parent")).expect("dir");
    fs::write(&config.image_path, vec![0xAB; 1 << 20]).expect("stale image");
    let stale_birth = fs::metadata(&config.image_path).and_then(|m| m.created()).expect("btime");
    fs::create_dir_all(&config.mountpoint).expect("pre-existing mountpoint dir");

    let prepared = storage::prepare(&config, &mut StatusRunner::default()).expect("prepare");
    scratch.prepared.push(prepared.clone());
    assert_prepared(&config, &prepared);
    let (_, _, index, _, created_dir, _) = created(&prepared);
    assert!(!created_dir);
    // ext4 hands the freed inode number straight back, so tell the files apart by
    // birth time and content: the new image is all holes except what mkfs wrote.
    let meta = fs::metadata(&config.image_path).expect("stat");
    assert!(meta.created().expect("btime") > stale_birth, "a new file");
    let mut head = vec![0; 1 << 20];
    io::Read::read_exact(&mut fs::File::open(&config.image_path).expect("open"), &mut head).expect("read image");
    let stale_bytes = head.iter().filter(|&&b| b == 0xAB).count();
    assert!(stale_bytes < 1000, "{stale_bytes} stale bytes survived");

    storage::cleanup(&prepared).expect("cleanup");
    scratch.prepared.clear();
    assert_cleaned(&config, index);
    assert!(config.mountpoint.is_dir(), "a mountpoint dir we did not create stays");
}

#[test]
fn non_file_at_image_path_is_refused() {
    let _lock = privileged();
    let scratch = Scratch::new("not-a-file");
    let config = scratch.config(64 * MIB);
    fs::create_dir_all(&config.image_path).expect("a directory where the image goes");
    let error = storage::prepare(&config, &mut StatusRunner::default()).expect_err("refused");
    assert!(matches!(error, StorageError::ImageNotRegular { .. }), "{error:?}");
    assert!(config.image_path.is_dir(), "left alone");
    assert!(!config.mountpoint.exists(), "mountpoint dir rolled back");
}

#[test]
fn second_prepare_adopts_our_own_mount() {
    let _lock = privileged();
    let mut scratch = Scratch::new("adopt");
    let config = scratch.config(64 * MIB);
    let first = storage::prepare(&config, &mut StatusRunner::default()).expect("prepare");
    scratch.prepared.push(first.clone());
    let mut runner = StatusRunner::default();
    let second = storage::prepare(&config, &mut runner).expect("prepare again");
    assert_eq!(second, first, "recognised as ours via the state file");
    assert!(runner.runs.is_empty(), "nothing re-formatted");
    let (_, _, index, _, _, _) = created(&first);
    storage::cleanup(&second).expect("cleanup");
    scratch.prepared.clear();
    assert_cleaned(&config, index);
}

#[test]
fn cleanup_unmounts_submounts_first() {
    let _lock = privileged();
    let mut scratch = Scratch::new("submounts");
    let config = scratch.config(64 * MIB);
    let prepared = storage::prepare(&config, &mut StatusRunner::default()).expect("prepare");
    scratch.prepared.push(prepared.clone());
    // What dockerd leaves behind: mounts on top of our filesystem.
    for sub in ["overlay2/x/merged", "containers/y/mounts/shm"] {
        let path = config.mountpoint.join(sub);
        fs::create_dir_all(&path).expect("dir");
        nix::mount::mount(Some("tmpfs"), &path, Some("tmpfs"), nix::mount::MsFlags::empty(), Some("size=1m")).expect("submount");
    }
    let (_, _, index, _, _, _) = created(&prepared);
    let started = Instant::now();
    storage::cleanup(&prepared).expect("cleanup");
    scratch.prepared.clear();
    assert!(started.elapsed() < Duration::from_secs(1), "no EBUSY retries needed");
    assert_cleaned(&config, index);
}

#[test]
fn busy_mount_is_detached_lazily_and_loop_follows() {
    let _lock = privileged();
    let mut scratch = Scratch::new("busy");
    let config = scratch.config(64 * MIB);
    let prepared = storage::prepare(&config, &mut StatusRunner::default()).expect("prepare");
    scratch.prepared.push(prepared.clone());
    let (_, _, index, _, _, _) = created(&prepared);
    let holder = fs::File::create(config.mountpoint.join("open")).expect("hold the fs busy");

    let started = Instant::now();
    storage::cleanup(&prepared).expect("cleanup succeeds with MNT_DETACH");
    let took = started.elapsed();
    scratch.prepared.clear();
    assert!(took < Duration::from_secs(5), "EBUSY retries are bounded: {took:?}");
    assert_eq!(storage::is_mountpoint(&config.mountpoint).expect("mountinfo"), None, "detached");
    assert!(!config.image_path.exists(), "image unlinked");
    // The lazily detached fs still holds the loop device until our file goes.
    assert_eq!(bound_loops_under(&scratch.dir).len(), 1, "still bound while busy");

    drop(holder);
    testkit::wait_until_blocking("the loop device autoclears after its last user", Duration::from_secs(5), || bound_loops_under(&scratch.dir).is_empty());
    assert_cleaned(&config, index);
    eprintln!("busy cleanup took {took:?}");
}
