#!/usr/bin/env python3
"""Runs through replicas of one gateway (local backend), measured in the same run.

    cargo build --bins && python3 bench/replicas_runs_bench.py [--bin PATH] overhead [--pairs 300]
    python3 bench/replicas_runs_bench.py [--bin PATH] throughput [--clients 8] [--seconds 10]

`overhead`: three replicas (`--peer` each other). A caller's sessions live on its home replica
(docs/deployment.md "Scaling"); one `/raw` call of session `bench` (`true`) is sent to the home
(served there) and one to another replica (forwarded to the home over the peer channel),
back to back in alternating order, `--pairs` times, each over its own kept-alive connection.
Prints p50 and p90 of both and the median of the per-pair differences (the forwarding
overhead per request) with its spread (p10-p90).

`throughput`: stateless `/raw` runs of `true` (served where they land, never forwarded) from
`--clients` threads for `--seconds`, each thread sending its requests to the replicas in
turn (as a round-robin load balancer does), first against one gateway, then against three
replicas. Prints runs/s of each.

Both print the machine's load average and the binary used.
"""

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import threading
import time

# The peer secret, ports and paths of the kept-output bench (same directory).
from replicas_bench import ROOT, SECRET, free_port


def start(binary, port, peers):
    args = [binary, "serve", "--listen", f"127.0.0.1:{port}"]
    for p in peers:
        args += ["--peer", f"http://127.0.0.1:{p}"]
    p = subprocess.Popen(
        args,
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


def replicas(binary, n):
    ports = [free_port() for _ in range(n)]
    procs = [start(binary, p, [q for q in ports if q != p]) for p in ports]
    return ports, procs


def raw(conn, body):
    """One /raw run; its stdout (events decoded) and the exit code."""
    conn.request("POST", "/raw", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    text = resp.read().decode()
    if resp.status != 200:
        raise SystemExit(f"/raw answered {resp.status}: {text}")
    out, code = b"", None
    import base64

    for line in text.splitlines():
        e = json.loads(line)
        if e["type"] == "stdout":
            out += base64.b64decode(e["data"])
        elif e["type"] == "exit":
            code = e["code"]
        elif e["type"] == "error":
            raise SystemExit(f"run failed: {e}")
    return out.decode(), code


def q(xs, p):
    return statistics.quantiles(xs, n=100)[p - 1]


def overhead(a):
    ports, procs = replicas(a.bin, 3)
    try:
        conns = [http.client.HTTPConnection("127.0.0.1", p) for p in ports]
        out, _ = raw(conns[0], {"executable": "sh", "args": ["-c", "echo $PPID"], "session": "bench"})
        pid = int(out.strip())
        home = [p.pid for p in procs].index(pid)
        other = (home + 1) % 3
        call = {"executable": "true", "session": "bench"}
        for c in (conns[home], conns[other]):  # warm both paths
            for _ in range(10):
                raw(c, call)
        here, forwarded, diffs = [], [], []
        for i in range(a.pairs):
            order = [(conns[home], here), (conns[other], forwarded)]
            if i % 2:
                order.reverse()
            got = {}
            for c, into in order:
                t = time.perf_counter()
                _, code = raw(c, call)
                dt = (time.perf_counter() - t) * 1000
                assert code == 0
                into.append(dt)
                got[id(into)] = dt
            diffs.append(got[id(forwarded)] - got[id(here)])
        print(f"load average: {os.getloadavg()}, cores: {os.cpu_count()}, binary: {a.bin}")
        print(f"pairs: {a.pairs} (session call `true`, three replicas)")
        print(f"served by the home:   p50 {statistics.median(here):.3f} ms, p90 {q(here, 90):.3f} ms")
        print(f"forwarded to it:      p50 {statistics.median(forwarded):.3f} ms, p90 {q(forwarded, 90):.3f} ms")
        print(f"forwarding overhead:  median {statistics.median(diffs):.3f} ms "
              f"(p10 {q(diffs, 10):.3f}, p90 {q(diffs, 90):.3f})")
    finally:
        for p in procs:
            p.terminate()
            p.wait()


def load(ports, clients, seconds):
    done = [0] * clients
    stop = time.monotonic() + seconds

    def client(k):
        conns = [http.client.HTTPConnection("127.0.0.1", p) for p in ports]
        i = k
        while time.monotonic() < stop:
            _, code = raw(conns[i % len(conns)], {"executable": "true"})
            assert code == 0
            done[k] += 1
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sum(done) / (time.monotonic() - t)


def throughput(a):
    print(f"load average before: {os.getloadavg()}, cores: {os.cpu_count()}, binary: {a.bin}")
    print(f"{a.clients} clients, {a.seconds} s each, /raw `true` (stateless)")
    for n in (1, 3):
        ports, procs = replicas(a.bin, n) if n > 1 else ([free_port()], None)
        if procs is None:
            procs = [start(a.bin, ports[0], [])]
        try:
            load(ports, a.clients, 1)  # warm
            rate = load(ports, a.clients, a.seconds)
            print(f"{n} replica(s): {rate:.1f} runs/s (load average {os.getloadavg()[0]:.2f})")
        finally:
            for p in procs:
                p.terminate()
                p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "mcp-run"))
    sub = ap.add_subparsers(dest="mode", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--pairs", type=int, default=300)
    t = sub.add_parser("throughput")
    t.add_argument("--clients", type=int, default=8)
    t.add_argument("--seconds", type=float, default=10)
    a = ap.parse_args()
    overhead(a) if a.mode == "overhead" else throughput(a)


if __name__ == "__main__":
    main()
