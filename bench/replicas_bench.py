#!/usr/bin/env python3
"""The cost of reading a kept MCP output through another replica (forwarded over the peer
channel) against reading it on the replica that keeps it, measured in the same run.

    cargo build --release --bins && python3 bench/replicas_bench.py [--pairs 300] [--bin PATH]

Starts two replicas (`--peer` each other), runs one command on A over MCP (stateless: plain
JSON-RPC POSTs), then reads one small page of its output `--pairs` times from A (local) and
from B (forwarded to A), back to back in alternating order, each over its own kept-alive
connection. Prints p50 and p90 of both, the median of the per-pair differences (the
forwarding overhead) with its spread (p10-p90), and the machine's load.
"""

import argparse
import http.client
import json
import os
import re
import socket
import statistics
import subprocess
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "bench-peer-secret-0123456789abcdef"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start(binary, port, peer):
    p = subprocess.Popen(
        [binary, "serve", "--listen", f"127.0.0.1:{port}", "--peer", f"http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RUST_LOG": "warn,mcp_run::cli=info", "MCP_RUN_PEER_SECRET": SECRET},
    )
    for line in p.stderr:
        if re.search(r"addr=(\S+)", line) and "listening" in line:
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
            return p
    raise SystemExit("a replica did not start")


def rpc(conn, method, params, rid=1):
    body = json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
    conn.request(
        "POST",
        "/mcp",
        body,
        {
            "content-type": "application/json",
            "accept": "application/json, text/event-stream",
            "mcp-protocol-version": "2025-11-25",
        },
    )
    resp = conn.getresponse()
    text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith("data:"):
            v = json.loads(line[5:])
            if "id" in v:
                return v
    return json.loads(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=300)
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "mcp-run"))
    a = ap.parse_args()
    pa, pb = free_port(), free_port()
    ra, rb = start(a.bin, pa, pb), start(a.bin, pb, pa)
    try:
        ca = http.client.HTTPConnection("127.0.0.1", pa)
        cb = http.client.HTTPConnection("127.0.0.1", pb)
        r = rpc(ca, "tools/call", {"name": "run_network_tool",
                                   "arguments": {"executable": "seq", "args": ["1", "100000"]}})
        uri = r["result"]["structuredContent"]["outputs"][0]["full_output"]["stdout_uri"]
        uri += "?lines=500-520"
        for c in (ca, cb):  # warm both paths (the peer lookup is cached after the first)
            for _ in range(5):
                assert "result" in rpc(c, "resources/read", {"uri": uri}), "read failed"
        local, forwarded, diffs = [], [], []
        for i in range(a.pairs):
            order = [(ca, local), (cb, forwarded)]
            if i % 2:
                order.reverse()
            got = {}
            for c, into in order:
                t = time.perf_counter()
                v = rpc(c, "resources/read", {"uri": uri}, rid=i + 2)
                dt = (time.perf_counter() - t) * 1000
                assert "result" in v, v
                into.append(dt)
                got[id(into)] = dt
            diffs.append(got[id(forwarded)] - got[id(local)])
        q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1]
        print(f"load average: {os.getloadavg()}, cores: {os.cpu_count()}, binary: {a.bin}")
        print(f"pairs: {a.pairs}")
        print(f"read on the owner:    p50 {statistics.median(local):.3f} ms, p90 {q(local, 90):.3f} ms")
        print(f"read via a peer:      p50 {statistics.median(forwarded):.3f} ms, p90 {q(forwarded, 90):.3f} ms")
        print(f"forwarding overhead:  median {statistics.median(diffs):.3f} ms "
              f"(p10 {q(diffs, 10):.3f}, p90 {q(diffs, 90):.3f})")
    finally:
        for p in (ra, rb):
            p.terminate()
            p.wait()


if __name__ == "__main__":
    main()
