# shellcheck shell=bash disable=SC2154 # build-image's variables, named below
# The parts of scripts/build-image that do the work, so that the script itself reads as the
# order of the steps: the temporary directories and mounts it undoes, the base rootfs
# (debootstrap), and the private dockerd it builds with. Sourced after lib/common.sh; the
# functions share build-image's variables (images, suite, packages, mirror, security_mirror,
# base_tar, cleanup_dirs, chroot_mounts, dockerd_pid, dockerd_dir).

# --- cleanup helpers ---------------------------------------------------------------------------
unmount_under() { # DIR: every mount below DIR, deepest first
  local m
  while read -r m; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done \
    < <(awk -v d="${1%/}/" 'index($2, d) == 1 { print $2 }' /proc/mounts | sort -r)
}
remove_dirs() { # the temporary directories, once nothing runs in them
  local d
  for d in "${cleanup_dirs[@]}"; do
    # A failed debootstrap can leave /proc, /sys or a bind-mounted /dev in its target: unmount
    # whatever is below the directory first, and never let rm cross into another filesystem.
    unmount_under "$d"
    rm -rf --one-file-system "$d" || note "could not remove $d (see above); remove it by hand"
  done
  cleanup_dirs=()
}

# --- the base rootfs ---------------------------------------------------------------------------
# The mirrors apt uses on this machine: the first deb URI that is not a security archive, and
# the first that is. deb822 (.sources) and one-line (.list) formats are both read.
apt_uris() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [[ -f $f ]] || continue
    case $f in
      *.sources) awk '/^[[:space:]]*URIs:/ { for (i = 2; i <= NF; i++) print $i }' "$f" ;;
      *) awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; break } }' "$f" ;;
    esac
  done
}
build_base() {
  local t0=$SECONDS work root
  [[ $(id -u) -eq 0 ]] || die "debootstrapping the base rootfs needs root (or copy a cached $base_tar here)"
  if ! command -v debootstrap >/dev/null; then
    note "base: installing debootstrap with apt-get"
    apt-get install -y --no-install-recommends debootstrap >&2 \
      || { apt-get update >&2 && apt-get install -y --no-install-recommends debootstrap >&2; } \
      || die "cannot install debootstrap; check that apt reaches $mirror"
  fi
  work=$(mktemp -d /tmp/gdr-base.XXXXXX)
  cleanup_dirs+=("$work")
  root=$work/rootfs
  local include
  include=$(IFS=,; echo "${packages[*]}")
  note "base: debootstrap --variant=minbase $suite from $mirror with $include (takes a few minutes)"
  debootstrap --variant=minbase --include="$include" "$suite" "$root" "$mirror" >"$work/debootstrap.log" 2>&1 || {
    tail -n 30 "$work/debootstrap.log" >&2
    [[ -f $root/debootstrap/debootstrap.log ]] && tail -n 30 "$root/debootstrap/debootstrap.log" >&2
    die "debootstrap failed (log above); check that $mirror serves $suite and that the packages exist there"
  }

  # Security and point-release updates, so the image does not ship what the suite had at release.
  {
    echo "deb $mirror $suite main"
    echo "deb $mirror $suite-updates main"
    if [[ -n $security_mirror ]]; then echo "deb $security_mirror $suite-security main"; fi
  } >"$root/etc/apt/sources.list"
  if [[ -n $security_mirror ]]; then
    note "base: applying $suite-updates and $suite-security ($security_mirror)"
  else
    note "base: WARNING no security mirror found in /etc/apt/sources.list* (set DEBIAN_SECURITY_MIRROR); applying $suite-updates only"
  fi
  printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"   # start no services while upgrading
  chmod 0755 "$root/usr/sbin/policy-rc.d"
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  mount -t proc proc "$root/proc"
  chroot_mounts+=("$root/proc")
  chroot "$root" /usr/bin/env DEBIAN_FRONTEND=noninteractive sh -c \
    'apt-get update && apt-get -y -o Dpkg::Options::=--force-confold dist-upgrade' >"$work/upgrade.log" 2>&1 || {
    tail -n 30 "$work/upgrade.log" >&2
    die "updating the base rootfs failed (log above); check that apt reaches $mirror and $security_mirror"
  }
  umount "$root/proc"
  chroot_mounts=()

  # Slim it like debian:*-slim: no docs (copyright notices stay), man pages, translations or
  # apt state; the exclusions also hold for packages a job installs later. docker.io's libnetwork
  # debugging tools (dnet, ovrouter: 28 MB) are not used by dockerd.
  mkdir -p "$root/etc/dpkg/dpkg.cfg.d"
  cat >"$root/etc/dpkg/dpkg.cfg.d/docker-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/locale/*
path-exclude /usr/bin/dnet
path-exclude /usr/sbin/ovrouter
EOF
  chroot "$root" apt-get clean
  find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/lintian/* \
    "$root"/usr/share/locale/* "$root/usr/bin/dnet" "$root/usr/sbin/ovrouter" \
    "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/debconf/*-old \
    "$root"/var/lib/dpkg/*-old "$root"/tmp/* "$root"/var/tmp/* "$root/usr/sbin/policy-rc.d" \
    "$root/etc/hostname" "$root/etc/hosts"
  find "$root/var/log" -type f -delete
  : >"$root/etc/resolv.conf"        # the container runtime provides it

  # Record what is in it: the package versions go into the image as a plain list too.
  # shellcheck disable=SC2016 # dpkg-query's format, not the shell's
  chroot "$root" dpkg-query -W -f '${Package} ${Version}\n' >"$work/packages.txt"
  local p missing=()
  for p in "${packages[@]}"; do grep -q "^$p " "$work/packages.txt" || missing+=("$p"); done
  [[ ${#missing[@]} -eq 0 ]] || die "debootstrap finished but the base lacks: ${missing[*]}"

  # /dev, /proc and /sys are provided by the container runtime; no device nodes in the image.
  tar --numeric-owner --xattrs --xattrs-include='*' -C "$root" \
    --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -cf "$base_tar.tmp" .
  sha "$base_tar.tmp" >"$base_tar.sha256.tmp"
  cp "$work/packages.txt" "$base_tar.packages.txt"
  mv "$base_tar.sha256.tmp" "$base_tar.sha256"
  mv "$base_tar.tmp" "$base_tar"
  unmount_under "$work"
  rm -rf --one-file-system "$work"
  note "base: $base_tar ($(du -h "$base_tar" | cut -f1), $(wc -l <"$base_tar.packages.txt") packages) in $(elapsed "$t0")"
}


# --- the private dockerd ----------------------------------------------------------------------
stop_dockerd() {
  local pid=$dockerd_pid i
  dockerd_pid=
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      note "dockerd $pid did not stop within 30s of SIGTERM; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  fi
  # Mounts dockerd leaves behind (its exec-root netns/default even after a clean exit; more
  # after a SIGKILL), so the directory can be removed.
  unmount_under "$dockerd_dir"
  unmount_under "$images/dockerd"
}

try_dockerd() { # DRIVER DATA_ROOT: start dockerd; 0 once it answers /_ping, 1 (and stopped) if not
  local driver=$1 data=$2 sock=$dockerd_dir/docker.sock i
  mkdir -p "$data" "$dockerd_dir/exec"
  # In a network namespace of its own (loopback up): a dockerd with `--bridge none` in the
  # host's namespace deletes the host's docker0, cutting a running Docker engine's
  # containers (run-local's, a controller's) off the network. The build needs no network.
  unshare --net sh -c 'ip link set lo up && exec dockerd "$@"' dockerd \
    --data-root "$data" --exec-root "$dockerd_dir/exec" \
    --pidfile "$dockerd_dir/docker.pid" --host "unix://$sock" \
    --storage-driver "$driver" --bridge none --iptables=false --ip-masq=false \
    --containerd-namespace "gdr-build-$$" --containerd-plugins-namespace "gdr-build-$$-plugins" \
    >"$dockerd_dir/dockerd.log" 2>&1 9>&- &
  dockerd_pid=$!
  for ((i = 0; i < 300; i++)); do
    if curl -fsS --max-time 2 --unix-socket "$sock" http://localhost/_ping >/dev/null 2>&1; then
      export DOCKER_HOST=unix://$sock
      return 0
    fi
    kill -0 "$dockerd_pid" 2>/dev/null || break
    sleep 0.2
  done
  tail -n 20 "$dockerd_dir/dockerd.log" >&2
  stop_dockerd
  return 1
}

# A private dockerd: sockets and state in a temporary directory under /tmp (unix socket paths
# must stay short), the overlay2 data root kept under the cache so the imported base image
# survives between builds (no 500 MB import and removal each time). Stopped by PID at the end.
start_dockerd() {
  local t0=$SECONDS kept=$images/dockerd/overlay2
  [[ $(id -u) -eq 0 ]] || die "starting a private dockerd needs root; or set DOCKER_HOST to a running engine"
  command -v dockerd >/dev/null || die "dockerd not found (Debian: apt-get install docker.io); or set DOCKER_HOST"
  dockerd_dir=$(mktemp -d /tmp/gdr-dockerd.XXXXXX)
  cleanup_dirs+=("$dockerd_dir")
  if try_dockerd overlay2 "$kept"; then
    note "docker: private dockerd $dockerd_pid (overlay2, data root $kept) ready in $(elapsed "$t0")"
    return 0
  fi
  note "WARNING: dockerd did not start on $kept (log above); removing that data root and retrying"
  unmount_under "$kept"
  rm -rf --one-file-system "$kept"
  if try_dockerd overlay2 "$kept"; then
    note "docker: private dockerd $dockerd_pid (overlay2, fresh data root $kept) ready in $(elapsed "$t0")"
    return 0
  fi
  rm -rf --one-file-system "$kept"
  note "WARNING: dockerd does not start with --storage-driver=overlay2 here (log above); falling back to vfs in a temporary data root (full copies of every layer: slower, more disk)"
  if try_dockerd vfs "$dockerd_dir/data-vfs"; then
    note "docker: private dockerd $dockerd_pid (vfs) ready in $(elapsed "$t0")"
    return 0
  fi
  die "the private dockerd did not answer /_ping within 60s (log above); check that dockerd runs here (cgroups, root) or set DOCKER_HOST"
}

