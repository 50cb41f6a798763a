#!/usr/bin/env python3
"""Benchmarks of the /raw path on the local backend, each figure against a baseline measured
in the same run (these machines are noisy; absolute numbers mean little).

    cargo build --release --bins && python3 bench/raw_bench.py [--size-mb 512] [--runs 300]

Measures:
  throughput  run-remote -- cat BIGFILE > /dev/null   vs  cat BIGFILE | cat > /dev/null
              (and ssh localhost cat BIGFILE when an sshd can be started on loopback)
  latency     run-remote -- true  vs  spawning true directly (p50, p99)
  memory      gateway RSS idle, and with 100 concurrent streaming requests of two output
              sizes (bounded memory means the two peaks are about equal)

Prints a markdown table for docs/performance.md.
"""

import argparse
import concurrent.futures
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REL = os.path.join(ROOT, "target", "release")
GATEWAY = os.path.join(REL, "mcp-run")
CLIENT = os.path.join(REL, "run-remote")


def start_gateway(config=None):
    extra = ["--config", config] if config else []
    p = subprocess.Popen(
        [GATEWAY, "serve", "--listen", "127.0.0.1:0", *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RUST_LOG": "warn,mcp_run::cli=info"},
    )
    for line in p.stderr:
        m = re.search(r"addr=(\S+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
            return p, m.group(1)
    raise SystemExit("gateway did not start")


def timed(cmd, **kw):
    t = time.perf_counter()
    subprocess.run(cmd, check=True, **kw)
    return time.perf_counter() - t


def best_of(n, fn):
    return min(fn() for _ in range(n))


def pct(values, p):
    values = sorted(values)
    k = max(0, min(len(values) - 1, int(round(p / 100 * (len(values) - 1)))))
    return values[k]


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def start_sshd(tmp):
    """An sshd on a loopback port with a throwaway key, or None when none is installed."""
    sshd = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
    if not sshd or not shutil.which("ssh"):
        return None
    key = os.path.join(tmp, "id")
    host = os.path.join(tmp, "host")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", host], check=True)
    auth = os.path.join(tmp, "authorized_keys")
    shutil.copy(key + ".pub", auth)
    os.chmod(auth, 0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs("/run/sshd", exist_ok=True)
    p = subprocess.Popen(
        [sshd, "-D", "-e", "-p", str(port), "-o", "ListenAddress=127.0.0.1", "-h", host,
         "-o", f"AuthorizedKeysFile={auth}", "-o", "StrictModes=no", "-o", "UsePAM=no",
         "-o", "PidFile=none"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    ssh = ["ssh", "-q", "-p", str(port), "-i", key, "-o", "StrictHostKeyChecking=no",
           "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "127.0.0.1"]
    for _ in range(50):
        if subprocess.run(ssh + ["true"], capture_output=True).returncode == 0:
            return p, ssh
        time.sleep(0.1)
    p.kill()
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3, help="best of N for throughput")
    ap.add_argument("--redaction", action="store_true",
                    help="also measure throughput through a gateway with redaction configured")
    args = ap.parse_args()
    for b in (GATEWAY, CLIENT):
        if not os.path.exists(b):
            raise SystemExit(f"{b} missing: cargo build --release --bins")

    gw, addr = start_gateway()
    env = {**os.environ, "RUN_REMOTE_SERVER": f"http://{addr}/raw"}
    rows = []
    tmp = tempfile.mkdtemp()
    try:
        big = os.path.join(tmp, "big")
        with open(big, "wb") as f:
            chunk = os.urandom(1 << 20)
            for _ in range(args.size_mb):
                f.write(chunk)
        size = os.path.getsize(big)
        null = subprocess.DEVNULL
        # Warm the page cache and the binaries.
        subprocess.run(["cat", big], stdout=null, check=True)
        subprocess.run([CLIENT, "--", "true"], env=env, check=True)

        pipe = best_of(args.repeat, lambda: timed(["sh", "-c", f"cat '{big}' | cat > /dev/null"]))
        remote = best_of(args.repeat, lambda: timed([CLIENT, "--", "cat", big], stdout=null, env=env))
        if args.redaction:
            # A literal and a 40-byte token pattern: the stream redactor copies and scans
            # every chunk and holds back 39 bytes per stream (docs/policy.md).
            conf = os.path.join(tmp, "redaction.yaml")
            with open(conf, "w") as f:
                f.write("redaction:\n  secrets: [not-in-the-data-0123456789]\n"
                        "  patterns: [{regex: 'ghp_[A-Za-z0-9]{36}', max_len: 40}]\n")
            rgw, raddr = start_gateway(conf)
            renv = {**os.environ, "RUN_REMOTE_SERVER": f"http://{raddr}/raw"}
            try:
                red = best_of(args.repeat, lambda: timed([CLIENT, "--", "cat", big], stdout=null, env=renv))
            finally:
                rgw.send_signal(signal.SIGTERM)
                rgw.wait(timeout=30)
        mb = size / 1e6
        rows.append(("throughput", "`cat F | cat` (baseline)", f"{mb / pipe:.0f} MB/s", "1.00"))
        rows.append(("throughput", "`run-remote -- cat F`", f"{mb / remote:.0f} MB/s", f"{pipe / remote:.2f}"))
        if args.redaction:
            rows.append(("throughput", "`run-remote -- cat F`, redaction on", f"{mb / red:.0f} MB/s",
                         f"{pipe / red:.2f}"))
        sshd = start_sshd(tmp)
        if sshd:
            proc, ssh = sshd
            try:
                s = best_of(args.repeat, lambda: timed(ssh + ["cat", big], stdout=null))
                rows.append(("throughput", "`ssh localhost cat F`", f"{mb / s:.0f} MB/s", f"{pipe / s:.2f}"))
            finally:
                proc.kill()
        else:
            rows.append(("throughput", "`ssh localhost cat F`", "no sshd here", "-"))

        direct = [timed(["true"]) for _ in range(args.runs)]
        via = [timed([CLIENT, "--", "true"], env=env) for _ in range(args.runs)]
        for p in (50, 99):
            d, v = pct(direct, p) * 1e3, pct(via, p) * 1e3
            rows.append(("latency", f"p{p} `true` direct (baseline)", f"{d:.2f} ms", "1.00"))
            rows.append(("latency", f"p{p} `run-remote -- true`", f"{v:.2f} ms", f"{v / d:.1f}x"))
            rows.append(("latency", f"p{p} gateway + client overhead", f"{v - d:.2f} ms", "-"))

        idle = rss_kib(gw.pid)
        rows.append(("memory", "gateway RSS idle (baseline)", f"{idle / 1024:.1f} MiB", "1.00"))
        for out_mb in (8, 64):
            peak = idle
            stop = threading.Event()

            def sample():
                nonlocal peak
                while not stop.is_set():
                    peak = max(peak, rss_kib(gw.pid))
                    time.sleep(0.01)

            t = threading.Thread(target=sample)
            t.start()
            cmd = [CLIENT, "--", "head", "-c", str(out_mb << 20), "/dev/zero"]
            with concurrent.futures.ThreadPoolExecutor(100) as ex:
                list(ex.map(lambda _: subprocess.run(cmd, stdout=null, env=env, check=True), range(100)))
            stop.set()
            t.join()
            rows.append(("memory", f"gateway peak RSS, 100 concurrent x {out_mb} MiB",
                         f"{peak / 1024:.1f} MiB", f"{peak / idle:.1f}x"))
    finally:
        gw.send_signal(signal.SIGTERM)
        gw.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"File size {size >> 20} MiB, {args.runs} latency runs, {os.cpu_count()} cores.\n")
    print("| what | measurement | value | ratio to baseline |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
