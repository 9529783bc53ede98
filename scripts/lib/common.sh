# shellcheck shell=bash
# Sourced by every script first: its name for messages, how it fails and reports, and
# where the test peers are kept. The caller has `set -euo pipefail`.

me=${me:-$(basename "$0")}
die() { echo "$me: error: $*" >&2; exit 1; }
note() { echo "$me: $*" >&2; }
step() { echo "==> $*"; }
export PEERS_CACHE=${PEERS_CACHE:-$HOME/.cache/gitea-dynamic-runner/peers}
