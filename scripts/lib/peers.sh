# shellcheck shell=bash
# Shared by scripts/install job-deps and scripts/install test-peers (sourced after
# lib/common.sh): pinned Debian packages and the peers built from pinned upstream sources.

# install_debs NAME=VERSION…: installs what is missing or at another version, then prints
# each as a "peer deb" line. A bare NAME takes the version the machine has or the mirror
# offers: for packages that must match the installed libc (libc6-dev), which security
# updates move on.
install_debs() {
  local spec name want have missing=()
  for spec in "$@"; do
    name=${spec%%=*} want=${spec#*=}
    [[ $spec == *=* ]] || want=
    have=$(dpkg-query -W -f='${db:Status-Status} ${Version}' "$name" 2>/dev/null || true)
    if [ -n "$want" ]; then
      [ "$have" = "installed $want" ] || missing+=("$spec")
    else
      [[ $have == "installed "* ]] || missing+=("$spec")
    fi
  done
  if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || die "need root to apt-get install ${missing[*]}"
    apt-get update -qq || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
      || die "apt-get install ${missing[*]} failed"
  fi
  for spec in "$@"; do
    name=${spec%%=*}
    echo "peer deb $name $(dpkg-query -W -f='${Version}' "$name")"
  done
}

# build_peer NAME…: builds each with the test-peer builder, which keeps it by the hash of
# its pinned sources and links $PEERS_CACHE/bin/NAME to it. The Go module proxy refuses
# gitea.com/gitea/runner and act_runner, so these come from unmodified upstream source
# snapshots kept beside the repository (../shared/peers/build); a clone elsewhere finds the
# builder beside the repository it was cloned from, or through PEERS_BUILD.
build_peer() {
  local peers_build=${PEERS_BUILD:-$(beside_repository peers/build)} peer line
  { [ -n "$peers_build" ] && [ -x "$peers_build" ]; } || die "the test-peer builder (shared/peers/build) is not beside the repository nor beside its origin: set PEERS_BUILD (for gitea-runner alone, RUNNER_BIN=a binary from Gitea's releases skips the build)"
  for peer in "$@"; do
    line=$("$peers_build" "$peer" | tail -n 1) || die "building $peer failed"
    echo "$line"
    [ -x "$PEERS_CACHE/bin/$peer" ] || die "$peer: $PEERS_CACHE/bin/$peer is not executable after the build"
  done
}
