# shellcheck shell=bash
# Sourced by every script first: its name for messages, how it fails and reports, and
# where the test peers are kept. The caller has `set -euo pipefail`.

me=${me:-$(basename "$0")}
die() { echo "$me: error: $*" >&2; exit 1; }
note() { echo "$me: $*" >&2; }
step() { echo "==> $*"; }
# beside_repository PATH: the first existing PATH in the `shared` folder beside this
# repository, or beside the repository it was cloned from (a fresh clone elsewhere, as CI
# makes, still finds the test peers' build scripts kept beside the original). Empty when
# neither has it.
beside_repository() {
  local repository origin top
  repository=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  origin=$(git -C "$repository" config --get remote.origin.url 2>/dev/null || true)
  for top in "$repository/.." ${origin:+"$origin/.."}; do
    if [ -e "$top/shared/$1" ]; then
      readlink -f "$top/shared/$1"
      return 0
    fi
  done
}
export PEERS_CACHE=${PEERS_CACHE:-$HOME/.cache/gitea-dynamic-runner/peers}
# Where rustup puts cargo when no login shell has sourced its env file (a fresh machine
# right after scripts/install job-deps installed it, or a CI step).
if ! command -v cargo >/dev/null && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH=$HOME/.cargo/bin:$PATH
fi
