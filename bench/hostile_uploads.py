#!/usr/bin/env python3
"""The gateway's memory under each hostile upload of issue 24 (items 2 and 3), against its own
idle size: a GNU long-name tar header, a PAX header and a GNU long-link header each announcing
96 MiB (under 1 MiB of gzip), a 100,000-entry manifest (about 300 KiB of gzip, nothing
uploaded), and four manifests whose symlink target is 32 MiB (a few KiB of gzip each).
Loopback only, bounded.

For each upload and each of --rounds rounds: start a fresh gateway, read its RSS after it is
idle (the same-run baseline), send the upload, read its peak RSS (VmHWM) and its RSS after
the answer. Reports per upload the HTTP status, and the median and range of idle, peak and
peak - idle in MiB. The target (docs/policy.md): peak - idle under 32 MiB for every upload.

    python3 bench/hostile_uploads.py --bin target/release/mcp-run --rounds 5
"""

import argparse
import gzip
import hashlib
import http.client
import io
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

MIB = 1 << 20


def status_mib(pid, field):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def start(binary):
    tmp = tempfile.mkdtemp(prefix="hostile-uploads-")
    gw = subprocess.Popen([binary, "serve", "--listen", "127.0.0.1:0"],
                          stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                          env={"PATH": "/usr/bin:/bin", "TMPDIR": tmp, "RUST_LOG": "info"})
    for line in gw.stderr:
        m = re.search(r"addr=(\S+)", line)
        if m and "listening" in line:
            host, port = m.group(1).rsplit(":", 1)
            # Keep reading its log, or the gateway blocks once the pipe is full.
            threading.Thread(target=lambda: [None for _ in gw.stderr], daemon=True).start()
            return gw, (host, int(port))
    sys.exit("the gateway did not start")


def post(addr, path, body, headers):
    conn = http.client.HTTPConnection(*addr, timeout=300)
    conn.request("POST", path, body=body, headers=headers)
    resp = conn.getresponse()
    text = resp.read().decode(errors="replace")
    conn.close()
    return resp.status, text


def tar_header(kind, size):
    """A GNU tar header block of type `kind` announcing `size` bytes."""
    h = bytearray(512)
    h[0:13] = b"././@LongLink"
    h[100:108] = b"0000644\0"
    h[108:116] = b"0000000\0"
    h[116:124] = b"0000000\0"
    h[124:136] = b"%011o\0" % size
    h[136:148] = b"00000000000\0"
    h[148:156] = b" " * 8
    h[156:157] = kind
    h[257:265] = b"ustar  \0"
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def gzip_stream(parts):
    """Gzip of the concatenation of `parts` (bytes, or (byte, count) runs), made as it goes."""
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=1) as gz:
        for p in parts:
            if isinstance(p, tuple):
                chunk = p[0] * MIB
                left = p[1]
                while left > 0:
                    k = min(left, MIB)
                    gz.write(chunk[:k])
                    left -= k
            else:
                gz.write(p)
    return out.getvalue()


def small_workspace(addr):
    manifest = {"entries": [{"path": "f", "size": 1, "hash": hashlib.sha256(b"x").hexdigest()}]}
    status, text = post(addr, "/workspaces", json.dumps(manifest),
                        {"Content-Type": "application/json"})
    assert status == 200, text
    return json.loads(text)["workspace"]


def tar_bomb(kind):
    def send(addr):
        ws = small_workspace(addr)
        body = gzip_stream([tar_header(kind, 96 * MIB), (b"a", 96 * MIB)])
        return [post(addr, f"/workspaces/{ws}/blobs", body,
                     {"Content-Type": "application/x-tar", "Content-Encoding": "gzip"})]
    return send


def wide_manifest(n):
    empty = hashlib.sha256(b"").hexdigest()
    entries = ",".join(f'{{"path":"w/d{i // 100}/f{i}","size":0,"hash":"{empty}"}}'
                       for i in range(n))
    return gzip_stream([b'{"entries":[', entries.encode(), b"]}"])


def manifest(n):
    def send(addr):
        return [post(addr, "/workspaces", wide_manifest(n),
                     {"Content-Type": "application/json", "Content-Encoding": "gzip"})]
    return send


def symlink_targets(addr):
    body = gzip_stream([b'{"entries":[{"path":"l","kind":"symlink","target":"',
                        (b"a", 32 * MIB), b'"}]}'])
    return [post(addr, "/workspaces", body,
                 {"Content-Type": "application/json", "Content-Encoding": "gzip"})
            for _ in range(4)]


UPLOADS = [
    ("GNU long name, 96 MiB announced", tar_bomb(b"L")),
    ("PAX header, 96 MiB announced", tar_bomb(b"x")),
    ("GNU long link, 96 MiB announced", tar_bomb(b"K")),
    ("manifest of 100,000 entries", manifest(100_000)),
    ("manifest of 99,000 files in 990 directories", manifest(99_000)),
    ("4 symlink targets of 32 MiB", symlink_targets),
]


def one(binary, send):
    gw, addr = start(binary)
    try:
        # Idle: what it holds once started and quiet.
        time.sleep(1.0)
        idle = status_mib(gw.pid, "VmRSS")
        answers = send(addr)
        peak = status_mib(gw.pid, "VmHWM")
        after = status_mib(gw.pid, "VmRSS")
        return idle, peak, after, answers
    finally:
        gw.terminate()
        gw.wait(timeout=60)


def summary(xs):
    return f"{statistics.median(xs):6.1f} [{min(xs):.1f}-{max(xs):.1f}]"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/mcp-run")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    worst = 0.0
    print(f"{'upload':46} {'status':>8}  {'idle MiB':>18} {'peak MiB':>18} {'peak-idle MiB':>18} {'after MiB':>18}")
    for name, send in UPLOADS:
        idle, peak, after, delta, statuses = [], [], [], [], set()
        for _ in range(args.rounds):
            i, p, a, answers = one(args.bin, send)
            idle.append(i)
            peak.append(p)
            after.append(a)
            delta.append(p - i)
            for status, text in answers:
                statuses.add(status)
                if status not in (200, 400, 413):
                    print(f"  unexpected answer {status}: {text[:200]}", file=sys.stderr)
        worst = max(worst, max(delta))
        print(f"{name:46} {'/'.join(map(str, sorted(statuses))):>8}  {summary(idle):>18} "
              f"{summary(peak):>18} {summary(delta):>18} {summary(after):>18}")
    print(f"largest peak - idle: {worst:.1f} MiB (target: under 32 MiB)")
    return 0 if worst < 32 else 1


if __name__ == "__main__":
    sys.exit(main())
