#!/usr/bin/env python3
"""Soak test of a local gateway under mixed, partly hostile load (issue 15). Loopback only,
bounded in time.

It starts `mcp-run serve` on 127.0.0.1 with a small config, then runs for --duration seconds:
  - good clients: `/raw` runs of `seq`, read to the end, output checked byte for byte;
  - stalled clients: start `yes` with a 2 s timeout, read the first event, then stop reading
    and hold the socket a while;
  - vanishing clients: start `sleep 30`, then reset the connection;
  - malicious clients: foreign Host, huge Content-Length, half-sent headers, array bodies,
    bad JSON, LD_PRELOAD under an allow list, control bytes in headers.
It samples the gateway's RSS and open fds, then stops it with SIGTERM and reports:
bytes lost (good runs), requests refused wrongly (a good run refused with anything but 429,
or a malicious one answered without the expected JSON error), peak RSS and fds, processes
left (anything still tagged with the gateway's MCP_RUN_RUN prefix, and whether it exited).

    python3 bench/soak.py --bin target/debug/mcp-run --duration 30
"""

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

CONFIG = """
limits:
  max_concurrent_executions: 24
server:
  header_timeout_secs: 2
  body_timeout_secs: 2
  shutdown_grace_secs: 3
  max_connections: 256
  max_unauthenticated_connections: 128
policy:
  executables:
    allow: [seq, yes, sleep, echo, cat]
"""


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.c = {}

    def add(self, key, n=1):
        with self.lock:
            self.c[key] = self.c.get(key, 0) + n


def request(host, path, body, headers=()):
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    for h in headers:
        head += h + "\r\n"
    return head.encode() + b"\r\n" + body


def read_all(s, limit=30):
    s.settimeout(limit)
    out = b""
    while True:
        d = s.recv(65536)
        if not d:
            return out
        out += d


def dechunk(body):
    out, rest = b"", body
    while rest:
        line, _, rest = rest.partition(b"\r\n")
        size = int(line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2:]
    return out


def parse(raw):
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split()[1]) if head else 0
    if b"chunked" in head.lower():
        body = dechunk(body)
    return status, body


def good(addr, stats, stop):
    import base64
    while not stop.is_set():
        n = random.randint(1, 20000)
        expected = "".join(f"{i}\n" for i in range(1, n + 1)).encode()
        try:
            s = socket.create_connection(addr, timeout=30)
            s.sendall(request("localhost", "/raw", json.dumps({"executable": "seq", "args": [str(n)]}).encode()))
            status, body = parse(read_all(s))
            s.close()
        except OSError:
            stats.add("good_io_errors")
            continue
        if status == 429:
            stats.add("good_refused_over_limit")
            time.sleep(0.05)
            continue
        if status != 200:
            stats.add("refused_wrongly")
            continue
        got, exited = b"", False
        for line in body.splitlines():
            ev = json.loads(line)
            if ev["type"] == "stdout":
                got += base64.b64decode(ev["data"])
            exited |= ev["type"] == "exit" and ev.get("code") == 0
        stats.add("good_runs")
        stats.add("bytes_expected", len(expected))
        if got != expected or not exited:
            stats.add("bytes_lost", max(len(expected) - len(got), 1))


def stalled(addr, stats, stop):
    while not stop.is_set():
        try:
            s = socket.create_connection(addr, timeout=10)
            s.sendall(request("localhost", "/raw", b'{"executable":"yes","timeout_secs":2}'))
            s.recv(256)
            stats.add("stalled")
            time.sleep(random.uniform(1, 5))  # the client holds the socket without reading
            s.close()
        except OSError:
            stats.add("stalled_io_errors")


def vanishing(addr, stats, stop):
    while not stop.is_set():
        try:
            s = socket.create_connection(addr, timeout=10)
            s.sendall(request("localhost", "/raw", b'{"executable":"sleep","args":["30"]}'))
            s.recv(256)
            time.sleep(random.uniform(0, 0.3))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()  # a reset, not a goodbye
            stats.add("vanished")
        except OSError:
            stats.add("vanishing_io_errors")


MALICIOUS = [
    # (what, raw request, expected status, expected code or None for "closed is fine")
    ("foreign host", request("rebind.example", "/raw", b'{"executable":"echo"}'), 403, "forbidden_host"),
    ("array body", request("localhost", "/raw", b'["echo",["x"]]'), 400, "invalid_request"),
    ("bad json", request("localhost", "/raw", b'{"executable":'), 400, "invalid_request"),
    ("ld_preload", request("localhost", "/raw", b'{"executable":"echo","env":{"LD_PRELOAD":"/x.so"}}'), 403, "policy_violation"),
    ("huge length", b"POST /raw HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n", 413, "payload_too_large"),
    ("control byte", b"GET /capabilities HTTP/1.1\r\nHost: localhost\r\nX: a\x01b\r\nConnection: close\r\n\r\n", 400, "invalid_request"),
    ("half headers", b"POST /raw HTTP/1.1\r\nHost: localhost\r\n", None, None),
]


def malicious(addr, stats, stop):
    while not stop.is_set():
        what, raw, status, code = random.choice(MALICIOUS)
        try:
            s = socket.create_connection(addr, timeout=15)
            s.sendall(raw)
            got_status, body = parse(read_all(s, 15))
            s.close()
        except OSError:
            stats.add("malicious_io_errors")
            continue
        stats.add("malicious")
        if status is None:
            continue  # closed by the header timeout: right
        try:
            ok = got_status == status and json.loads(body)["error"]["code"] == code
        except (ValueError, KeyError, TypeError):
            ok = False
        if got_status == 503:
            stats.add("malicious_over_connection_cap")
        elif not ok:
            stats.add("refused_wrongly")
            stats.add(f"wrong: {what} -> {got_status}")


def tagged(prefix):
    pids = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            env = open(f"/proc/{p}/environ", "rb").read()
        except OSError:
            continue
        if f"MCP_RUN_RUN={prefix}".encode() in env:
            pids.append(int(p))
    return pids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/debug/mcp-run")
    ap.add_argument("--duration", type=float, default=30)
    ap.add_argument("--good", type=int, default=8)
    ap.add_argument("--stalled", type=int, default=20)
    ap.add_argument("--vanishing", type=int, default=4)
    ap.add_argument("--malicious", type=int, default=8)
    a = ap.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(CONFIG)
    gw = subprocess.Popen([a.bin, "serve", "--listen", "127.0.0.1:0", "--config", f.name],
                          stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    addr = None
    for line in gw.stderr:
        m = re.search(r"addr=(\S+)", line)
        if m and "listening" in line:
            host, port = m.group(1).rsplit(":", 1)
            addr = (host, int(port))
            break
    if addr is None:
        sys.exit("the gateway did not start")
    threading.Thread(target=lambda: [None for _ in gw.stderr], daemon=True).start()
    stats, stop = Stats(), threading.Event()
    peak = {"rss_kib": 0, "fds": 0}

    def sample():
        while not stop.is_set():
            try:
                for l in open(f"/proc/{gw.pid}/status"):
                    if l.startswith("VmRSS:"):
                        peak["rss_kib"] = max(peak["rss_kib"], int(l.split()[1]))
                peak["fds"] = max(peak["fds"], len(os.listdir(f"/proc/{gw.pid}/fd")))
            except OSError:
                pass
            time.sleep(0.2)

    threads = [threading.Thread(target=sample, daemon=True)]
    for kind, n in ((good, a.good), (stalled, a.stalled), (vanishing, a.vanishing), (malicious, a.malicious)):
        threads += [threading.Thread(target=kind, args=(addr, stats, stop), daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    time.sleep(a.duration)
    stop.set()
    time.sleep(0.5)
    gw.send_signal(signal.SIGTERM)
    try:
        gw.wait(timeout=60)
        exited = True
    except subprocess.TimeoutExpired:
        exited = False
        gw.kill()
    time.sleep(1)
    left = tagged(f"{gw.pid}.")
    report = {
        "duration_s": a.duration,
        "counts": dict(sorted(stats.c.items())),
        "bytes_lost": stats.c.get("bytes_lost", 0),
        "refused_wrongly": stats.c.get("refused_wrongly", 0),
        "peak_rss_mib": round(peak["rss_kib"] / 1024, 1),
        "peak_fds": peak["fds"],
        "gateway_exited_on_sigterm": exited,
        "processes_left": left,
    }
    print(json.dumps(report, indent=2))
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    os.unlink(f.name)
    bad = report["bytes_lost"] or report["refused_wrongly"] or left or not exited
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
