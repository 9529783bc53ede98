# shellcheck shell=bash
# Sourced by every script first: its name for messages, how it fails and reports, and
# where the test peers are kept. The caller has `set -euo pipefail`.

me=${me:-$(basename "$0")}
die() { echo "$me: error: $*" >&2; exit 1; }
note() { echo "$me: $*" >&2; }
step() { echo "==> $*"; }
export PEERS_CACHE=${PEERS_CACHE:-$HOME/.cache/gitea-dynamic-runner/peers}
# Where rustup puts cargo when no login shell has sourced its env file (a fresh machine
# right after scripts/install-job-deps installed it, or a CI step).
if ! command -v cargo >/dev/null && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH=$HOME/.cargo/bin:$PATH
fi
