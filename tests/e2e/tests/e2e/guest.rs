//! The supervisor inside a real VM guest, as under Kata: a Debian cloud kernel booted by
//! QEMU (TCG: `/dev/kvm` here cannot run stock kernels), cgroup v2 only — unlike this
//! host's hybrid hierarchy —, a root disk made with `mke2fs -d` from the runner image's
//! files, and the static supervisor as PID 1 of a PID namespace in the guest (as Kata's
//! agent starts a container). The job checks what a job would rely on: `/var/lib/docker` on
//! a loop device, dockerd ready on cgroup v2 with overlay2, and a container's `--memory`
//! limit enforced by the kernel (OOM kill at `memory.max`). The supervisor drains in order
//! and the job's exit code comes out through the serial console.
//!
//! Peers: `qemu-system-x86_64` and the unpacked kernel with its modules under
//! `$PEERS_CACHE/guest/current` (scripts/install test-peers). Timing is not a target here:
//! under TCG dockerd alone takes tens of seconds.

use std::{
    path::Path,
    process::{Command, Stdio},
    time::Instant,
};

use e2e::docker::host;

/// The guest's first process (from the initrd): loads the modules the cloud kernel has as
/// modules, mounts the root disk and hands over to `/gdr-init` on it.
const INITRD_INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mkdir -p /proc /sys /dev /newroot
mount -t proc proc /proc
mount -t devtmpfs dev /dev
for module in $(cat /modules/order); do
  insmod /modules/$module.ko || echo "GDR-INITRD: insmod $module failed"
done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done
mount -t ext4 /dev/vda /newroot || { echo "GDR-INITRD: no root disk"; poweroff -f; }
mount --move /dev /newroot/dev
umount /proc
exec switch_root /newroot /gdr-init
"#;

/// The guest's init on the root disk: what Kata's agent provides a container (proc, sys,
/// the cgroup2 hierarchy, tmpfs), then the supervisor as PID 1 of a new PID namespace.
const GUEST_INIT: &str = r#"#!/bin/sh
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs shm /dev/shm
ip link set lo up
echo "GDR-GUEST: kernel $(uname -r), cgroup fs $(stat -fc %T /sys/fs/cgroup)"
SUPERVISOR_DOCKER_BRIDGE=none SUPERVISOR_STORAGE_SIZE=3G SUPERVISOR_DOCKER_READY_TIMEOUT=600s \
  unshare --pid --fork --mount-proc /usr/local/bin/supervisor run --identity=false -- /bin/sh /gdr-job
echo "GDR-EXIT=$?"
sync
/opt/gdr/busybox poweroff -f
"#;

/// The job (uid 2000, as gitea-runner would run it). Every check prints what it saw; the
/// first failing one ends the job with its own exit code.
const JOB: &str = r#"set -u
say() { echo "GDR-JOB: $*"; }
fail() { say "FAIL $2"; exit "$1"; }
source=$(findmnt -n -o SOURCE /var/lib/docker); fstype=$(findmnt -n -o FSTYPE /var/lib/docker)
say "docker storage $source $fstype"
case "$source" in /dev/loop*) ;; *) fail 11 "/var/lib/docker is not on a loop device";; esac
[ "$fstype" = ext4 ] || fail 12 "/var/lib/docker is $fstype"
info=$(docker info --format '{{.CgroupVersion}} {{.CgroupDriver}} {{.Driver}}') || fail 13 "docker info"
say "docker info $info"
case "$info" in "2 "*" overlay2") ;; *) fail 14 "dockerd is not on cgroup v2 with overlay2";; esac
mkdir -p /tmp/img && cp /opt/gdr/busybox /tmp/img/busybox
tar -C /tmp/img -c . | docker import - gdr-busybox >/dev/null || fail 15 "docker import"
docker run --name fits --network none --memory 32m gdr-busybox /busybox sh -c 'echo fits' || fail 16 "a container within its memory did not run"
docker run --name hog --network none --memory 32m --memory-swap 32m --shm-size 256m gdr-busybox \
  /busybox dd if=/dev/zero of=/dev/shm/fill bs=1M count=128
code=$?
oom=$(docker inspect --format '{{.State.OOMKilled}}' hog)
limit=$(docker run --rm --network none --memory 32m gdr-busybox /busybox cat /sys/fs/cgroup/memory.max)
say "hog exit=$code oom_killed=$oom memory.max=$limit"
[ "$code" = 137 ] && [ "$oom" = true ] || fail 17 "the memory limit was not enforced"
[ "$limit" = 33554432 ] || fail 18 "memory.max is $limit"
say "all checks passed"
exit 7
"#;

fn run(command: &mut Command) -> String {
    let output = command.stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(output.status.success(), "{command:?}: {}\n{}", output.status, String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn write_executable(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The host's TSC frequency: the guest kernel's TSC calibration is unreliable under TCG.
fn tsc_khz() -> u64 {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap();
    let mhz: f64 = cpuinfo.lines().find_map(|l| l.strip_prefix("cpu MHz")).and_then(|l| l.split(':').nth(1)).unwrap().trim().parse().unwrap();
    // Truncation is fine: a kHz figure.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let khz = (mhz * 1000.0) as u64;
    khz
}

#[test]
fn the_supervisor_runs_a_job_in_a_cgroup_v2_vm_guest() {
    // Emulated, the guest needs both cores to itself.
    let _turn = e2e::exclusive_blocking();
    let guest = testkit::peers_cache().join("guest/current");
    assert!(guest.join("vmlinuz").exists(), "{} has no kernel: run scripts/install test-peers", guest.display());
    let dir = tempfile::Builder::new().prefix("gdr-guest-").tempdir_in("/var/tmp").unwrap();
    let d = dir.path();

    // The root disk: the runner image's files, the job, and a static busybox (the guest's
    // poweroff, and the job's container image).
    let docker = host();
    let image = docker.image("gitea-runner");
    let container = String::from_utf8_lossy(&docker.docker(&["create", &image]).stdout).trim().to_owned();
    assert!(!container.is_empty(), "docker create {image} failed");
    let export = docker.docker(&["export", "-o", &d.join("rootfs.tar").display().to_string(), &container]);
    docker.docker(&["rm", &container]);
    assert!(export.status.success(), "{}", String::from_utf8_lossy(&export.stderr));
    let root = d.join("root");
    std::fs::create_dir(&root).unwrap();
    run(Command::new("tar").arg("-xf").arg(d.join("rootfs.tar")).arg("-C").arg(&root).arg("--numeric-owner"));
    std::fs::remove_file(d.join("rootfs.tar")).unwrap();
    write_executable(&root.join("gdr-init"), GUEST_INIT);
    write_executable(&root.join("gdr-job"), JOB);
    std::fs::create_dir_all(root.join("opt/gdr")).unwrap();
    std::fs::copy("/bin/busybox", root.join("opt/gdr/busybox")).unwrap();
    let disk = d.join("root.img");
    run(Command::new("truncate").args(["-s", "8G"]).arg(&disk));
    run(Command::new("mkfs.ext4").args(["-q", "-F", "-d"]).arg(&root).arg(&disk));
    std::fs::remove_dir_all(&root).unwrap();

    // The initrd: busybox and the modules.
    let initrd = d.join("initrd");
    std::fs::create_dir_all(initrd.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", initrd.join("bin/busybox")).unwrap();
    write_executable(&initrd.join("init"), INITRD_INIT);
    run(Command::new("cp").arg("-r").arg(guest.join("modules")).arg(&initrd));
    run(Command::new("sh").arg("-c").arg(format!("cd {} && find . | busybox cpio -o -H newc > ../initrd.img 2>/dev/null", initrd.display())));

    let console = d.join("console.log");
    let started = Instant::now();
    let status = Command::new("timeout")
        .arg("900")
        .arg("qemu-system-x86_64")
        .args(["-machine", "microvm", "-accel", "tcg", "-cpu", "qemu64", "-smp", "2", "-m", "1536", "-nographic", "-no-reboot"])
        .arg("-kernel")
        .arg(guest.join("vmlinuz"))
        .arg("-initrd")
        .arg(d.join("initrd.img"))
        .arg("-append")
        .arg(format!("console=ttyS0 panic=-1 tsc_early_khz={} quiet", tsc_khz()))
        .arg("-drive")
        .arg(format!("id=root,file={},format=raw,if=none", disk.display()))
        .args(["-device", "virtio-blk-device,drive=root"])
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&console).unwrap())
        .stderr(Stdio::inherit())
        .status()
        .unwrap();
    let log = std::fs::read_to_string(&console).unwrap_or_default().replace('\r', "");
    eprintln!("guest: booted, ran the job and powered off in {:?}", started.elapsed());
    for line in log.lines().filter(|l| l.contains("GDR-") || l.contains("ready") || l.contains("drain") || l.contains("nested")) {
        eprintln!("guest console: {line}");
    }
    assert!(status.success(), "qemu: {status} (124: the guest did not power off within 900 s)\n{log}");

    assert!(log.contains("GDR-GUEST: kernel 6.1.0-57-cloud-amd64, cgroup fs cgroup2fs"), "{log}");
    assert!(log.contains("cgroup v2: nested into init"), "the supervisor did not nest its cgroups:\n{log}");
    assert!(log.contains("storage ready") && log.contains("dockerd ready"), "{log}");
    assert!(log.contains("GDR-JOB: docker info 2 cgroupfs overlay2") || log.contains("GDR-JOB: docker info 2 systemd overlay2"), "{log}");
    assert!(log.contains("GDR-JOB: hog exit=137 oom_killed=true memory.max=33554432"), "{log}");
    assert!(log.contains("GDR-JOB: all checks passed"), "{log}");
    // The drain runs in order after the job: dockerd, then storage.
    let order = ["stopping dockerd", "storage cleaned up", "drain complete"].map(|line| log.find(line).unwrap_or_else(|| panic!("{line:?} missing:\n{log}")));
    assert!(order.windows(2).all(|w| w[0] < w[1]), "drain out of order:\n{log}");
    assert!(log.contains("GDR-EXIT=7"), "the job's exit code did not come out:\n{log}");
}
