#!/usr/bin/env python3
"""Sessions on the Kubernetes backend against the API-server double (issue 23): what a
session call costs against a one-shot call, in API calls and in time.

    cargo build --bin mcp-run --bin run-remote        # or --release, then pass --release
    python3 bench/kube_session_bench.py [--calls 20] [--step-ms 100] [--release]

Starts the double (tests/kube_double_serve.rs) and a gateway on the kube backend. Opens a
session `b`, then makes --calls session calls of `true` and --calls one-shot calls of `true`,
alternating; reads the double's request log (pod creates, exec upgrades, pod watches, pod
deletes) around a block of --calls session calls and a block of --calls one-shot calls, and
prints per-call counts and the medians (min-max) of the alternating timings, with the load.
The target: N calls of one session create one pod, and each call after the first costs one
exec (no create, watch or delete).
"""
import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--step-ms", type=int, default=100)
    ap.add_argument("--release", action="store_true", help="use target/release binaries")
    a = ap.parse_args()
    bins = os.path.join(ROOT, "target", "release" if a.release else "debug")
    serve = subprocess.Popen(
        ["cargo", "test", "-q", "--test", "integration", "--", "--ignored", "--nocapture",
         "--exact", "kube_double_serve::serve"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, KUBE_DOUBLE_STEP_MS=str(a.step_ms)),
    )
    info = {}
    while len(info) < 4:
        line = serve.stdout.readline()
        if not line:
            sys.exit("the double did not start")
        m = re.match(r"^(KUBECONFIG|TOKEN|URL|CA)=(.*)$", line.strip())
        if m:
            info[m.group(1)] = m.group(2)

    def stats():
        serve.stdin.write("stats\n")
        serve.stdin.flush()
        while True:
            line = serve.stdout.readline()
            if not line:
                sys.exit("the double went away")
            if line.startswith("STATS "):
                return json.loads(line[6:])

    port = free_port()
    gw = subprocess.Popen(
        [os.path.join(bins, "mcp-run"), "serve", "--backend", "kube", "--kubeconfig",
         info["KUBECONFIG"], "--listen", f"127.0.0.1:{port}"],
        stderr=subprocess.DEVNULL)
    env = dict(os.environ, RUN_REMOTE_SERVER=f"http://127.0.0.1:{port}/raw")
    client = os.path.join(bins, "run-remote")

    def run(args):
        t = time.perf_counter()
        subprocess.run([client] + args + ["--", "true"], env=env, check=True,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        return (time.perf_counter() - t) * 1000

    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz").read()
                break
            except Exception:
                time.sleep(0.1)
        run([])  # warm-up
        s0 = stats()
        run(["--session", "b"])  # opens the session: its pod
        s1 = stats()
        for _ in range(a.calls):
            run(["--session", "b"])
        s2 = stats()
        for _ in range(a.calls):
            run([])
        s3 = stats()
        one, ses = [], []
        for i in range(a.calls):
            pair = [("one", []), ("ses", ["--session", "b"])]
            if i % 2:
                pair.reverse()
            for k, args in pair:
                (one if k == "one" else ses).append(run(args))
    finally:
        gw.terminate()
        gw.wait(timeout=60)
        serve.stdin.close()
        serve.wait(timeout=60)

    def per(x, y):
        d = {k: y[k] - x[k] for k in ("pods_created", "creates", "execs", "watches", "deletes", "requests")}
        return d

    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; binaries {bins}; "
          f"double step {a.step_ms} ms\n")
    print("| what | pods created | creates | execs | watches | deletes | all API calls |")
    print("|---|---|---|---|---|---|---|")
    for label, d in [("the session's first call", per(s0, s1)),
                     (f"{a.calls} later calls of the session", per(s1, s2)),
                     (f"{a.calls} one-shot calls", per(s2, s3))]:
        print(f"| {label} | {d['pods_created']} | {d['creates']} | {d['execs']} | {d['watches']} "
              f"| {d['deletes']} | {d['requests']} |")
    print()
    print("| `run-remote -- true` | median (min-max) |")
    print("|---|---|")
    print(f"| one-shot ({a.calls}, alternating) | {statistics.median(one):.1f} ms ({min(one):.1f}-{max(one):.1f}) |")
    print(f"| in session `b` | {statistics.median(ses):.1f} ms ({min(ses):.1f}-{max(ses):.1f}) |")


if __name__ == "__main__":
    main()
