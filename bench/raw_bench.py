#!/usr/bin/env python3
"""Benchmarks of the /raw path on the local backend, each figure against a baseline measured
in the same run (these machines are noisy; absolute numbers mean little).

    cargo build --release --bins && python3 bench/raw_bench.py [--size-mb 300] [--pairs 7]

Measures:
  stdout      run-remote -- cat F > /dev/null        vs  cat F | cat > /dev/null
  stdin       run-remote -i -- wc -c < F > /dev/null vs  the same pipe
              (and ssh localhost cat F when an sshd can be started on loopback)
              Each figure is the median over --pairs pairs (baseline and candidate run back to
              back, in alternating order), with the spread (min-max) of the per-pair ratios,
              and the CPU time the gateway and the client spent per GB of payload.
  latency     run-remote -- true  vs  spawning true directly (p50, p99)
  memory      gateway RSS idle, and with 100 concurrent streaming requests of two output
              sizes (bounded memory means the two peaks are about equal); with stdin, the
              gateway's peak while 300 MB go through `run-remote -i -- wc -c`

Prints the machine's load and a markdown table for docs/performance.md.
"""

import argparse
import concurrent.futures
import os
import re
import resource
import statistics
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


def cpu_secs(pid):
    """utime + stime of a process (not of its children), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def pairs(n, baseline, candidate, gw_pid=None):
    """Runs baseline and candidate back to back n times (alternating which goes first).
    Returns per-pair ratios (baseline time / candidate time), the candidate's times, and the
    gateway's and the client's CPU seconds spent in the candidate runs."""
    ratios, times, gw_cpu, client_cpu = [], [], 0.0, 0.0
    for i in range(n):
        if i % 2:
            b = baseline()
        g0, c0 = (cpu_secs(gw_pid) if gw_pid else 0.0), children_cpu()
        c = candidate()
        gw_cpu += (cpu_secs(gw_pid) - g0) if gw_pid else 0.0
        client_cpu += children_cpu() - c0
        if not i % 2:
            b = baseline()
        ratios.append(b / c)
        times.append(c)
    return ratios, times, gw_cpu, client_cpu


def ratio_cells(ratios):
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


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
    ap.add_argument("--size-mb", type=int, default=300)
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--pairs", type=int, default=7, help="baseline/candidate pairs per throughput figure")
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

        mb = size / 1e6
        gb = size / 1e9
        load_before = os.getloadavg()
        pipe_cmd = f"cat '{big}' | cat > /dev/null"

        def pipe():
            return timed(["sh", "-c", pipe_cmd])

        def stdout_run():
            return timed([CLIENT, "--", "cat", big], stdout=null, env=env)

        def stdin_run():
            with open(big, "rb") as f:
                return timed([CLIENT, "-i", "--", "wc", "-c"], stdin=f, stdout=null, env=env)

        pipe_times = []

        def pipe_timed():
            t = pipe()
            pipe_times.append(t)
            return t

        out_r, out_t, out_gw, out_cl = pairs(args.pairs, pipe_timed, stdout_run, gw.pid)
        in_r, in_t, in_gw, in_cl = pairs(args.pairs, pipe_timed, stdin_run, gw.pid)
        rows.append(("throughput", "`cat F | cat` (baseline)",
                     f"{mb / statistics.median(pipe_times):.0f} MB/s", "1.00", "-", "-"))
        rows.append(("throughput", "`run-remote -- cat F` (stdout)",
                     f"{mb / statistics.median(out_t):.0f} MB/s", ratio_cells(out_r),
                     f"{out_gw / (gb * args.pairs):.2f}", f"{out_cl / (gb * args.pairs):.2f}"))
        rows.append(("throughput", "`run-remote -i -- wc -c < F` (stdin)",
                     f"{mb / statistics.median(in_t):.0f} MB/s", ratio_cells(in_r),
                     f"{in_gw / (gb * args.pairs):.2f}", f"{in_cl / (gb * args.pairs):.2f}"))
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
                red_r, red_t, red_gw, red_cl = pairs(
                    args.pairs, pipe,
                    lambda: timed([CLIENT, "--", "cat", big], stdout=null, env=renv), rgw.pid)
            finally:
                rgw.send_signal(signal.SIGTERM)
                rgw.wait(timeout=30)
            rows.append(("throughput", "`run-remote -- cat F`, redaction on",
                         f"{mb / statistics.median(red_t):.0f} MB/s", ratio_cells(red_r),
                         f"{red_gw / (gb * args.pairs):.2f}", f"{red_cl / (gb * args.pairs):.2f}"))
        sshd = start_sshd(tmp)
        if sshd:
            proc, ssh = sshd
            try:
                s_r, s_t, _, _ = pairs(args.pairs, pipe, lambda: timed(ssh + ["cat", big], stdout=null))
                rows.append(("throughput", "`ssh localhost cat F`",
                             f"{mb / statistics.median(s_t):.0f} MB/s", ratio_cells(s_r), "-", "-"))
            finally:
                proc.kill()
        else:
            rows.append(("throughput", "`ssh localhost cat F`", "no sshd here", "-", "-", "-"))
        load_after = os.getloadavg()

        direct = [timed(["true"]) for _ in range(args.runs)]
        via = [timed([CLIENT, "--", "true"], env=env) for _ in range(args.runs)]
        for p in (50, 99):
            d, v = pct(direct, p) * 1e3, pct(via, p) * 1e3
            rows.append(("latency", f"p{p} `true` direct (baseline)", f"{d:.2f} ms", "1.00", "-", "-"))
            rows.append(("latency", f"p{p} `run-remote -- true`", f"{v:.2f} ms", f"{v / d:.1f}x", "-", "-"))
            rows.append(("latency", f"p{p} gateway + client overhead", f"{v - d:.2f} ms", "-", "-", "-"))

        idle = rss_kib(gw.pid)
        rows.append(("memory", "gateway RSS idle (baseline)", f"{idle / 1024:.1f} MiB", "1.00", "-", "-"))
        # stdin: the gateway's peak while the whole file goes through it.
        peak = rss_kib(gw.pid)
        stop = threading.Event()

        def sample_in():
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, rss_kib(gw.pid))
                time.sleep(0.01)

        t = threading.Thread(target=sample_in)
        t.start()
        with open(big, "rb") as f:
            subprocess.run([CLIENT, "-i", "--", "wc", "-c"], stdin=f, stdout=null, env=env, check=True)
        stop.set()
        t.join()
        rows.append(("memory", f"gateway peak RSS, one run with {size >> 20} MiB of stdin",
                     f"{peak / 1024:.1f} MiB", f"{peak / idle:.1f}x", "-", "-"))
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
                         f"{peak / 1024:.1f} MiB", f"{peak / idle:.1f}x", "-", "-"))
    finally:
        gw.send_signal(signal.SIGTERM)
        gw.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"Command: python3 bench/{os.path.basename(__file__)} " + " ".join(sys.argv[1:]))
    print(f"File size {size >> 20} MiB, {args.pairs} pairs per throughput figure, "
          f"{args.runs} latency runs, {os.cpu_count()} cores, load average "
          f"{load_before[0]:.2f} before and {load_after[0]:.2f} after the throughput runs.\n")
    print("| what | measurement | value (median) | ratio to baseline: median (min-max) "
          "| gateway CPU s/GB | client CPU s/GB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
