# A hostile job's step: every way a job's requests could cost the controller what all
# tenants share, from inside a real environment with what any step can read (the cache's
# URL and the job's runtime token). Prints `abuse NAME: ANSWER detail` per abuse, then
# keeps the pressure on (downloads left unread, saves refused, a log flood) for
# HOLD_SECONDS while another repository's job runs beside it.
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse

CACHE = urllib.parse.urlsplit(os.environ["ACTIONS_CACHE_URL"])
HOST, PORT, BASE = CACHE.hostname, CACHE.port, CACHE.path.rstrip("/")
TOKEN = os.environ["ACTIONS_RUNTIME_TOKEN"]
AUTH = {"Authorization": "Bearer " + TOKEN}
VERSION = "ab" * 32
MIB = 1 << 20
HOLD_SECONDS = int(os.environ.get("HOLD_SECONDS", "240"))
LOG_FLOOD_MIB = int(os.environ.get("LOG_FLOOD_MIB", "16"))

connection = http.client.HTTPConnection(HOST, PORT, timeout=120)


def call(method, path, body=None, headers=None):
    global connection
    error = None
    for _ in range(3):
        try:
            connection.request(method, BASE + path, body=body, headers={**AUTH, **(headers or {})})
            response = connection.getresponse()
            return response.status, response.read()
        except (http.client.HTTPException, OSError) as failed:
            error = failed
            connection.close()
            connection = http.client.HTTPConnection(HOST, PORT, timeout=120)
    return 599, str(error).encode()


def reserve(key, size):
    body = json.dumps({"key": key, "version": VERSION, "cacheSize": size})
    status, answer = call("POST", "/_apis/artifactcache/caches", body, {"Content-Type": "application/json"})
    return status, json.loads(answer)["cacheId"] if status == 200 else answer


def patch(cache_id, start, data):
    headers = {"Content-Type": "application/octet-stream", "Content-Range": f"bytes {start}-{start + len(data) - 1}/*"}
    return call("PATCH", f"/_apis/artifactcache/caches/{cache_id}", data, headers)


def commit(cache_id, size):
    return call("POST", f"/_apis/artifactcache/caches/{cache_id}", json.dumps({"size": size}), {"Content-Type": "application/json"})


def say(name, status, detail=""):
    if isinstance(detail, bytes):
        detail = detail.decode(errors="replace")
    print(f"abuse {name}: {status} {' '.join(str(detail).split())[:240]}", flush=True)


def setup_failed(what, status, answer):
    say("setup", "failed", f"{what}: {status} {answer!r}")
    sys.exit(1)


# An archive of its own, to download without reading later.
status, archive = reserve("download-me", 16 * MIB)
if status != 200:
    setup_failed("reserve", status, archive)
for start in range(0, 16 * MIB, 8 * MIB):
    status, answer = patch(archive, start, os.urandom(8 * MIB))
    if status != 204:
        setup_failed("upload", status, answer)
status, answer = commit(archive, 16 * MIB)
if status != 200:
    setup_failed("commit", status, answer)
status, answer = call("GET", f"/_apis/artifactcache/cache?keys=download-me&version={VERSION}")
if status != 200:
    setup_failed("lookup", status, answer)
location = urllib.parse.urlsplit(json.loads(answer)["archiveLocation"])
DOWNLOAD = location.path + ("?" + location.query if location.query else "")

# Parts that overlap, or lie past what was reserved.
status, overlap = reserve("overlap", 4096)
patch(overlap, 0, b"a" * 1024)
say("overlapping-part", *patch(overlap, 512, b"b" * 1024))
say("part-past-the-reservation", *patch(overlap, 4000, b"c" * 200))

# One-byte parts: inodes run out before bytes do.
status, tiny = reserve("one-byte-parts", 4096)
accepted = 0
for offset in range(4096):
    status, answer = patch(tiny, offset, b"x")
    if status != 204:
        break
    accepted += 1
say("one-byte-parts", status, f"after {accepted} accepted: {answer[:160]!r}")

# Bytes uploaded and never committed, then more.
status, never = reserve("never-committed", 40 * MIB)
for start in range(0, 40 * MIB, 8 * MIB):
    patch(never, start, os.urandom(8 * MIB))
say("uploads-never-committed", *reserve("never-committed-more", 32 * MIB))

# A v2 save, whose client names no size, past the largest entry (curl: it stops sending
# when the answer comes first).
twirp = "/twirp/github.actions.results.api.v1.CacheService/"
status, answer = call("POST", twirp + "CreateCacheEntry", json.dumps({"key": "v2-unbounded", "version": VERSION}), {"Content-Type": "application/json"})
if status == 200 and json.loads(answer).get("ok"):
    upload = json.loads(answer)["signed_upload_url"]
    with tempfile.NamedTemporaryFile() as block:
        block.write(os.urandom(24 * MIB))
        block.flush()
        separator = "&" if "?" in upload else "?"
        curl = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "PUT", "--data-binary", "@" + block.name, upload + separator + "comp=block&blockid=AAA%3D"]
        status = subprocess.run(curl, capture_output=True, text=True, check=False).stdout.strip()
        answer = b"a 24 MiB block"
say("v2-block-past-the-largest-entry", status, answer)

# Saves opened and never finished.
opened = 0
for key in range(32):
    status, answer = reserve(f"open-{key}", 1)
    if status != 200:
        break
    opened += 1
say("many-open-saves", status, f"after {opened} more accepted: {answer!r}")


def unread_downloads(count):
    """`count` downloads of the archive whose bodies are never read: their answers."""
    held, statuses = [], []
    for _ in range(count):
        try:
            sock = socket.create_connection((HOST, PORT), timeout=30)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(f"GET {DOWNLOAD} HTTP/1.1\r\nHost: {HOST}:{PORT}\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
            line = b""
            while not line.endswith(b"\n") and len(line) < 200:
                piece = sock.recv(1)
                if not piece:
                    break
                line += piece
            parts = line.split()
            statuses.append(parts[1].decode() if len(parts) > 1 else "closed")
            held.append(sock)
        except OSError as error:
            statuses.append(type(error).__name__)
    return held, statuses


held, statuses = unread_downloads(40)
refused = sorted({s for s in statuses if s != "200"})
say("downloads-left-unread", refused[0] if refused else "none-refused", f"{statuses.count('200')} of 40 answered 200, the others {refused}")

# The pressure stays on while the neighbour runs: a log flood, then downloads left unread
# and saves tried again and again.
print("abuse holding: begins", flush=True)
time.sleep(2)
# The facade's bound is in bytes: lines of 32 KiB reach it with few rows for Gitea.
line = "x" * (32 * 1024 - 1)
for _ in range(LOG_FLOOD_MIB * 32):
    sys.stdout.write(line + "\n")
sys.stdout.flush()
print(f"abuse log-flood: printed {LOG_FLOOD_MIB} MiB", flush=True)
deadline = time.monotonic() + HOLD_SECONDS
while time.monotonic() < deadline:
    for sock in held:
        sock.close()
    held, statuses = unread_downloads(24)
    for key in range(8):
        reserve(f"again-{key}", 8 * MIB)
        patch(overlap, 256, b"d" * 1024)
    time.sleep(5)
print("abuse holding: ends", flush=True)
