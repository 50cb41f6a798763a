#!/usr/bin/env python3
"""Benchmarks of the Kubernetes backend against a real cluster, each figure against kubectl
baselines measured in the same run (clusters are noisy; ratios travel, absolute numbers do not).

    cargo build --release --bins
    python3 bench/kube_bench.py [--image busybox:1.36] [--namespace NS] [--runs 20]
                                [--gateway http://HOST:PORT/raw] [--size-mb 256]
                                [--warm-pool 10 [--rate 20 --duration 60]]

Needs kubectl and a cluster from KUBECONFIG (kind is fine). Without --gateway it starts
`mcp-run serve --backend kube` out of cluster on a loopback port.

Measures (p50 and p90 over --runs runs, sequential):
  latency     run-remote -- true             (a fresh pod per request, through the gateway)
              kubectl run --rm -i --restart=Never --image=IMG -- true
              kubectl exec POD -- true       (into an already-running pod)
  throughput  run-remote -- head -c N /dev/zero   vs  kubectl exec POD -- head -c N /dev/zero
              (the gateway has no stdin, so both stream N bytes the pod writes)

With --warm-pool N the gateway it starts keeps N warm pods for the default profile; the
latency table then shows the pooled requests, and a load phase sends --rate requests/s for
--duration s (`run-remote -- true`, each in its own thread) and reports p50/p99, hits and
misses (from /metrics) and errors.

Per-phase timings of each request (created, scheduled, running, exec started, first byte,
exit, deleted) are in the gateway's debug log: RUST_LOG=mcp_run::exec::kube=debug.

Prints a markdown table for docs/performance.md.
"""

import argparse
import os
import re
import subprocess
import sys
import threading
import time
import tempfile
import urllib.request
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REL = os.path.join(ROOT, "target", "release")
GATEWAY = os.path.join(REL, "mcp-run")
CLIENT = os.path.join(REL, "run-remote")


def start_gateway(image, namespace, pool, tmp):
    cfg = os.path.join(tmp, "config.yaml")
    with open(cfg, "w") as f:
        f.write("kubernetes:\n  max_concurrent_pods: 256\n")
        f.write(f"profiles:\n  default:\n    image: {image}\n    warm_pool:\n      size: {pool}\n")
    cmd = [GATEWAY, "serve", "--listen", "127.0.0.1:0", "--backend", "kube", "--config", cfg]
    if namespace:
        cmd += ["--namespace", namespace]
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")},
    )
    for line in p.stderr:
        sys.stderr.write(line)
        m = re.search(r"addr=(\S+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
            return p, f"http://{m.group(1)}/raw"
    raise SystemExit("gateway did not start")


def timed(cmd, **kw):
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, **kw)
    return time.perf_counter() - t


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def kubectl(ns, *args):
    return ["kubectl"] + (["-n", ns] if ns else []) + list(args)


def pool_counts(url):
    base = url.rsplit("/raw", 1)[0]
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    counts = {"hit": 0, "miss": 0}
    for line in text.splitlines():
        if line.startswith("mcp_run_warm_pool_claims_total{"):
            for k in counts:
                if f'result="{k}"' in line:
                    counts[k] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def load_phase(env, rate, duration, url):
    """Sends `rate` requests per second for `duration` seconds, each in its own thread."""
    before = pool_counts(url)
    times, errors, threads = [], [], []
    lock = threading.Lock()

    def one():
        try:
            t = timed([CLIENT, "--", "true"], env=env, cwd="/")
            with lock:
                times.append(t)
        except subprocess.CalledProcessError as e:
            with lock:
                errors.append(e.returncode)

    start = time.perf_counter()
    n = int(rate * duration)
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    after = pool_counts(url)
    return {
        "p50": pct(times, 0.5) if times else float("nan"),
        "p99": pct(times, 0.99) if times else float("nan"),
        "hits": after["hit"] - before["hit"],
        "misses": after["miss"] - before["miss"],
        "errors": len(errors),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--image", default="busybox:1.36")
    ap.add_argument("--namespace", default="")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--gateway", default="")
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--warm-pool", type=int, default=0)
    ap.add_argument("--rate", type=float, default=20)
    ap.add_argument("--duration", type=float, default=60)
    a = ap.parse_args()
    ns = a.namespace
    gw = None
    url = a.gateway
    tmp = tempfile.mkdtemp()
    if not url:
        gw, url = start_gateway(a.image, ns, a.warm_pool, tmp)
        if a.warm_pool:
            time.sleep(30)  # let the pool fill
    env = {**os.environ, "RUN_REMOTE_SERVER": url}
    sleeper = f"mcp-run-bench-{uuid.uuid4().hex[:6]}"
    try:
        subprocess.run(
            kubectl(ns, "run", sleeper, f"--image={a.image}", "--restart=Never", "--", "sleep", "3600"),
            check=True,
        )
        subprocess.run(kubectl(ns, "wait", "--for=condition=Ready", f"pod/{sleeper}", "--timeout=300s"), check=True)
        # Warm the image on the nodes and the gateway's connections.
        timed([CLIENT, "--", "true"], env=env)
        lat = {"run-remote -- true": [], "kubectl run --rm -i": [], "kubectl exec (running pod)": []}
        for i in range(a.runs):
            lat["run-remote -- true"].append(timed([CLIENT, "--", "true"], env=env, cwd="/"))
            lat["kubectl run --rm -i"].append(
                timed(kubectl(ns, "run", f"{sleeper}-{i}", "--rm", "-i", "--restart=Never", f"--image={a.image}", "--quiet", "--", "true"))
            )
            lat["kubectl exec (running pod)"].append(timed(kubectl(ns, "exec", sleeper, "--", "true")))
        size = a.size_mb * 1024 * 1024
        thr = {
            "run-remote -- head -c N /dev/zero": timed([CLIENT, "--", "head", "-c", str(size), "/dev/zero"], env=env, cwd="/"),
            "kubectl exec POD -- head -c N /dev/zero": timed(kubectl(ns, "exec", sleeper, "--", "head", "-c", str(size), "/dev/zero")),
        }
        load = None
        if a.warm_pool:
            load = load_phase(env, a.rate, a.duration, url)
    finally:
        subprocess.run(kubectl(ns, "delete", "pod", sleeper, "--grace-period=0", "--wait=false"), check=False)
        if gw:
            gw.terminate()
            gw.wait(timeout=60)

    base = pct(lat["kubectl run --rm -i"], 0.5)
    print(f"\n| latency ({a.runs} runs, image {a.image}) | p50 | p90 | p50 vs `kubectl run --rm -i` |")
    print("|---|---|---|---|")
    for k, xs in lat.items():
        print(f"| {k} | {pct(xs, .5) * 1000:.0f} ms | {pct(xs, .9) * 1000:.0f} ms | {pct(xs, .5) / base:.2f}x |")
    if load:
        print(f"\n| load: {a.rate}/s for {a.duration:.0f} s, pool {a.warm_pool} | p50 | p99 | hits | misses | errors |")
        print("|---|---|---|---|---|---|")
        print(f"| run-remote -- true | {load['p50'] * 1000:.0f} ms | {load['p99'] * 1000:.0f} ms | {load['hits']} | {load['misses']} | {load['errors']} |")
    kb = thr["kubectl exec POD -- head -c N /dev/zero"]
    print(f"\n| throughput ({a.size_mb} MiB) | MB/s | vs kubectl exec |")
    print("|---|---|---|")
    for k, t in thr.items():
        print(f"| {k} | {size / t / 1e6:.0f} | {kb / t:.2f}x |")


if __name__ == "__main__":
    main()
