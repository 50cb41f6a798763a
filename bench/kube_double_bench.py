#!/usr/bin/env python3
"""Cold-run latency of the kube backend through the API-server test double, against the
double's own start delay measured in the same run (docs/performance.md, "Kubernetes backend
through the double").

    cargo build --bins && cargo test --no-run --test integration
    python3 bench/kube_double_bench.py [--runs 30] [--step-ms 100] [--release] [--compare DIR]

Starts the double (tests/kube_double_serve.rs) with each simulated lifecycle step taking
--step-ms, and a gateway on it (`mcp-run serve --backend kube`, no warm pool). Then, in
alternating order per pair:
  baseline   the double's own delay: create a pod over HTTPS, watch it until Running, delete
             it (what any client waits for, without mcp-run)
  cold run   `run-remote -- true`: create, watch, exec, stream, delete, through the gateway
Prints p50 and the spread (p10-p90) of each, and of the per-pair difference (the gateway's
own cost beyond the pod start), as a markdown table.

--compare DIR adds a second gateway on the same double from the binaries in DIR (`mcp-run`
and `run-remote`, e.g. built from main): each pair then also has its cold run, in rotating
order, so that a change's cost is measured against a same-run baseline.
"""
import argparse
import json
import os
import re
import socket
import ssl
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quantiles(xs):
    xs = sorted(xs)
    def q(p):
        return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]
    return statistics.median(xs), q(0.1), q(0.9)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def baseline_once(url, token, name, ctx):
    """Create a pod, watch it to Running, delete it: the double's own start delay."""
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"containers": [{"name": "runner", "image": "busybox:1.36"}]},
    }
    base = f"{url}/api/v1/namespaces/default/pods"
    t = time.perf_counter()
    req = urllib.request.Request(base, data=json.dumps(pod).encode(), headers=headers, method="POST")
    created = json.load(urllib.request.urlopen(req, context=ctx))
    rv = created["metadata"]["resourceVersion"]
    watch = f"{base}?watch=true&fieldSelector=metadata.name%3D{name}&resourceVersion={rv}"
    with urllib.request.urlopen(urllib.request.Request(watch, headers=headers), context=ctx) as r:
        for line in r:
            ev = json.loads(line)
            if ev["object"].get("status", {}).get("phase") == "Running":
                break
    req = urllib.request.Request(f"{base}/{name}?gracePeriodSeconds=0", headers=headers, method="DELETE")
    urllib.request.urlopen(req, context=ctx).read()
    return time.perf_counter() - t


def cold_once(run_remote, server):
    env = dict(os.environ, RUN_REMOTE_SERVER=server)
    t = time.perf_counter()
    subprocess.run([run_remote, "--", "true"], env=env, check=True, stdin=subprocess.DEVNULL)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--step-ms", type=int, default=100)
    ap.add_argument("--release", action="store_true", help="use target/release binaries")
    ap.add_argument("--compare", metavar="DIR", help="also measure the binaries in DIR (same run)")
    a = ap.parse_args()
    profile = "release" if a.release else "debug"
    bins = os.path.join(ROOT, "target", profile)
    serve = subprocess.Popen(
        ["cargo", "test", "-q", "--test", "integration", "--", "--ignored", "--nocapture", "--exact", "kube_double_serve::serve"],
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
    kinds = [("this build", bins)]
    if a.compare:
        kinds.append((f"compared ({a.compare})", a.compare))
    gateways = []
    for label, d in kinds:
        port = free_port()
        gw = subprocess.Popen(
            [os.path.join(d, "mcp-run"), "serve", "--backend", "kube", "--kubeconfig", info["KUBECONFIG"],
             "--listen", f"127.0.0.1:{port}"],
            stderr=subprocess.DEVNULL,
            # Each gateway its own identity: the reaper leaves the other's pods alone.
            env=dict(os.environ, MCP_RUN_POD_NAME=f"bench-gateway-{len(gateways)}"),
        )
        gateways.append((label, os.path.join(d, "run-remote"), f"http://127.0.0.1:{port}/raw", port, gw))
    ctx = ssl.create_default_context(cafile=info["CA"])
    try:
        for _, run_remote, server, port, _ in gateways:
            for _ in range(100):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz").read()
                    break
                except Exception:
                    time.sleep(0.1)
            cold_once(run_remote, server)  # warm-up: connections, first pod
        base = []
        cold = [[] for _ in gateways]
        diff = [[] for _ in gateways]
        for i in range(a.runs):
            # Rotate the order within each pair: baseline, then each gateway's cold run.
            steps = ["base"] + list(range(len(gateways)))
            k = i % len(steps)
            steps = steps[k:] + steps[:k]
            got = {}
            for step in steps:
                if step == "base":
                    got["base"] = baseline_once(info["URL"], info["TOKEN"], f"bench-{i}", ctx)
                else:
                    _, run_remote, server, _, _ = gateways[step]
                    got[step] = cold_once(run_remote, server)
            base.append(got["base"] * 1000)
            for g in range(len(gateways)):
                cold[g].append(got[g] * 1000)
                diff[g].append((got[g] - got["base"]) * 1000)
        rows = [("double's own start delay: create, watch to Running, delete (baseline)", base, True)]
        for g, (label, *_rest) in enumerate(gateways):
            rows.append((f"`run-remote -- true`, cold (a new pod), {label}", cold[g], True))
            rows.append((f"difference per pair: the gateway and client beyond the pod start, {label}", diff[g], False))
        if len(gateways) == 2:
            rows.append(("this build minus compared, per pair", [x - y for x, y in zip(cold[0], cold[1])], False))
        load = os.getloadavg()
        print(f"\n{a.runs} pairs, step delay {a.step_ms} ms, {profile} build, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
        print("| what | p50 | p10-p90 | ratio to baseline p50 |")
        print("|---|---|---|---|")
        b50 = quantiles(base)[0]
        for what, xs, ratio in rows:
            p50, p10, p90 = quantiles(xs)
            r = f"{p50 / b50:.2f}" if ratio else "-"
            print(f"| {what} | {p50:.0f} ms | {p10:.0f}-{p90:.0f} ms | {r} |")
    finally:
        for *_rest, gw in gateways:
            gw.terminate()
            gw.wait()
        serve.stdin.close()
        serve.wait()

if __name__ == "__main__":
    main()
