#!/usr/bin/env python3
"""Benchmark of workspaces (`run-remote --workspace`) on the local backend, each figure
against a baseline measured in the same run (these machines are noisy).

    cargo build --release --bin mcp-run --bin run-remote
    python3 bench/workspace_bench.py [--files 10000] [--size-mb 100] [--runs 5]

Generates a tree of --files files totalling --size-mb MB (half random bytes, half text, in
100 directories, with a .gitignore'd directory the client must skip), starts the gateway
(release build) on a loopback port, and measures:

  first run    `run-remote --workspace -- true` with an empty gateway cache and an empty
               client hash cache, against `tar -c -C TREE . | ssh localhost tar -x -C DEST`
               (sshd is started on 127.0.0.1:2222 with throwaway keys when /usr/sbin/sshd
               exists; without it the baseline is `tar -c | tar -x` through a local pipe).
               Pairs alternate; the ratio is taken per pair.
  rerun        `run-remote --workspace -- true` with nothing changed, against
               `run-remote -- true` from the same directory: the added time. The gateway
               keeps the materialised tree between runs (workspaces.local_idle_trees).
  rerun, edit  the same after appending a line to one file (another file each time).
  fresh tree   the unchanged rerun's added time on a gateway that copies a fresh tree for
               every run (local_idle_trees: 0): the reference for keeping trees.
  one edit     after rewriting one file: bytes uploaded (files, content bytes), and the bytes
               run-remote sent to the gateway in total (measured by a counting TCP proxy:
               HTTP headers, the gzip manifest, the tar upload and the /raw request).

Prints a markdown table for docs/performance.md (medians, with min-max over the runs).
"""

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REL = os.path.join(ROOT, "target", "release")
GATEWAY = os.path.join(REL, "mcp-run")
CLIENT = os.path.join(REL, "run-remote")


def make_tree(root, files, size_mb):
    rnd = random.Random(17)
    avg = size_mb * 1024 * 1024 // files
    words = b"fn main let mut self impl struct return match Some None Ok Err use pub mod ".split()
    os.makedirs(os.path.join(root, ".git"))
    with open(os.path.join(root, ".gitignore"), "w") as f:
        f.write("/target\n")
    os.makedirs(os.path.join(root, "target"))
    for i in range(200):
        with open(os.path.join(root, "target", f"ignored{i}.o"), "wb") as f:
            f.write(rnd.randbytes(4096))
    for i in range(files):
        d = os.path.join(root, f"dir{i % 100:03d}")
        os.makedirs(d, exist_ok=True)
        n = max(1, int(rnd.expovariate(1 / avg))) if i % 2 else avg
        if i % 2:
            data = rnd.randbytes(n)
        else:
            data = b" ".join(rnd.choice(words) for _ in range(n // 5 + 1))[:n]
        with open(os.path.join(d, f"file{i:05d}.dat"), "wb") as f:
            f.write(data)
    return sum(
        os.path.getsize(os.path.join(dp, f))
        for dp, _, fs in os.walk(root)
        if "/target" not in dp and "/.git" not in dp
        for f in fs
    )


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    def __init__(self, tmp, idle_trees=None):
        self.tmp = tmp
        self.proc = None
        self.idle_trees = idle_trees

    def start(self):
        self.port = free_port()
        cache = tempfile.mkdtemp(dir=self.tmp, prefix="cache")
        cfg = os.path.join(self.tmp, "config.yaml")
        extra = "" if self.idle_trees is None else f"  local_idle_trees: {self.idle_trees}\n"
        with open(cfg, "w") as f:
            f.write(
                f"workspaces:\n  cache_dir: {cache}\n  local_dir: {self.tmp}\n{extra}"
                f"server:\n  listen: 127.0.0.1:{self.port}\n"
            )
        self.proc = subprocess.Popen(
            [GATEWAY, "serve", "--config", cfg],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.1).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise SystemExit("the gateway did not start")

    def stop(self):
        if self.proc:
            self.proc.terminate()
            self.proc.wait()
            self.proc = None


class CountingProxy:
    """Forwards 127.0.0.1:port to the gateway and counts the bytes clients send."""

    def __init__(self, target_port):
        self.target = target_port
        self.sent = 0
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            c, _ = self.sock.accept()
            u = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self.pipe, args=(c, u, True), daemon=True).start()
            threading.Thread(target=self.pipe, args=(u, c, False), daemon=True).start()

    def pipe(self, a, b, count):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                if count:
                    with self.lock:
                        self.sent += len(data)
                b.sendall(data)
        except OSError:
            pass
        finally:
            try:
                b.shutdown(socket.SHUT_WR)
            except OSError:
                pass


def run_remote(port, cwd, args, home):
    env = {
        "PATH": os.environ["PATH"],
        "RUN_REMOTE_SERVER": f"http://127.0.0.1:{port}/raw",
        "XDG_CACHE_HOME": home,
        "HOME": home,
    }
    t = time.perf_counter()
    p = subprocess.run([CLIENT, *args], cwd=cwd, env=env, capture_output=True)
    dt = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"run-remote {args} failed: {p.stderr.decode()}")
    return dt, p.stdout


def start_sshd(tmp):
    """sshd on 127.0.0.1:2222 with throwaway keys; returns the ssh command prefix or None."""
    if not os.path.exists("/usr/sbin/sshd"):
        return None, None
    d = os.path.join(tmp, "ssh")
    os.makedirs(d)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{d}/host"], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{d}/client"], check=True)
    shutil.copy(f"{d}/client.pub", f"{d}/authorized_keys")
    os.makedirs("/run/sshd", exist_ok=True)
    with open(f"{d}/sshd_config", "w") as f:
        f.write(
            f"Port 2222\nListenAddress 127.0.0.1\nHostKey {d}/host\n"
            f"AuthorizedKeysFile {d}/authorized_keys\nStrictModes no\nPasswordAuthentication no\n"
            f"PidFile {d}/sshd.pid\nUsePAM no\nPermitRootLogin yes\n"
        )
    proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-f", f"{d}/sshd_config"])
    ssh = [
        "ssh", "-p", "2222", "-i", f"{d}/client", "-o", "StrictHostKeyChecking=no",
        "-o", f"UserKnownHostsFile={d}/known_hosts", "-o", "BatchMode=yes", "127.0.0.1",
    ]
    for _ in range(50):
        if subprocess.run([*ssh, "true"], capture_output=True).returncode == 0:
            return ssh, proc
        time.sleep(0.1)
    proc.terminate()
    return None, None


def tar_baseline(tree, tmp, ssh):
    dest = tempfile.mkdtemp(dir=tmp, prefix="dest")
    reader = f"tar -x -C {dest}"
    t = time.perf_counter()
    src = subprocess.Popen(["tar", "-c", "-C", tree, "--exclude=./.git", "--exclude=./target", "."],
                           stdout=subprocess.PIPE)
    dst = subprocess.Popen([*ssh, reader] if ssh else ["sh", "-c", reader], stdin=src.stdout)
    src.stdout.close()
    dst.wait()
    src.wait()
    dt = time.perf_counter() - t
    shutil.rmtree(dest)
    return dt


def med(xs):
    return statistics.median(xs)


def spread(xs, fmt):
    return f"{fmt(med(xs))} ({fmt(min(xs))}–{fmt(max(xs))})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=10000)
    ap.add_argument("--size-mb", type=int, default=100)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rerun-runs", type=int, default=20)
    ap.add_argument("--fresh-runs", type=int, default=5,
                    help="unchanged reruns on a gateway with local_idle_trees: 0")
    a = ap.parse_args()
    for b in (GATEWAY, CLIENT):
        if not os.path.exists(b):
            raise SystemExit(f"{b} is missing: cargo build --release --bin mcp-run --bin run-remote")
    tmp = tempfile.mkdtemp(prefix="wsbench")
    tree = os.path.join(tmp, "tree")
    size = make_tree(tree, a.files, a.size_mb)
    print(f"tree: {a.files} files, {size / 1e6:.1f} MB (plus 200 ignored files)", file=sys.stderr)
    ssh, sshd = start_sshd(tmp)
    baseline_name = "tar -c \\| ssh localhost tar -x" if ssh else "tar -c \\| tar -x (no sshd)"
    gw = Gateway(tmp)
    fresh_gw = Gateway(tmp, idle_trees=0)
    try:
        # First run: fresh gateway cache and client hash cache each time.
        firsts, tars = [], []
        for _ in range(a.runs):
            gw.start()
            home = tempfile.mkdtemp(dir=tmp, prefix="home")
            dt, _ = run_remote(gw.port, tree, ["--workspace", "--", "true"], home)
            firsts.append(dt)
            tars.append(tar_baseline(tree, tmp, ssh))
            gw.stop()
        ratios = [f / t for f, t in zip(firsts, tars)]

        # Rerun with no change: pairs of (with workspace, without).
        gw.start()
        home = tempfile.mkdtemp(dir=tmp, prefix="home")
        run_remote(gw.port, tree, ["--workspace", "--", "true"], home)
        withs, withouts = [], []
        for _ in range(a.rerun_runs):
            withs.append(run_remote(gw.port, tree, ["--workspace", "--", "true"], home)[0])
            withouts.append(run_remote(gw.port, tree, ["--", "true"], home)[0])
        added = [w - o for w, o in zip(withs, withouts)]

        # Rerun after editing one file (another one each time): pairs again.
        edit_withs, edit_withouts = [], []
        for i in range(a.rerun_runs):
            with open(os.path.join(tree, f"dir{i % 100:03d}", f"file{i:05d}.dat"), "ab") as f:
                f.write(b"edited\n")
            edit_withs.append(run_remote(gw.port, tree, ["--workspace", "--", "true"], home)[0])
            edit_withouts.append(run_remote(gw.port, tree, ["--", "true"], home)[0])
        edit_added = [w - o for w, o in zip(edit_withs, edit_withouts)]

        # The same unchanged rerun on a gateway that copies a fresh tree for every run
        # (local_idle_trees: 0, the behaviour before trees were kept): the reference.
        gw.stop()
        fresh_gw.start()
        run_remote(fresh_gw.port, tree, ["--workspace", "--", "true"], home)
        fresh_added = []
        for _ in range(a.fresh_runs):
            w = run_remote(fresh_gw.port, tree, ["--workspace", "--", "true"], home)[0]
            o = run_remote(fresh_gw.port, tree, ["--", "true"], home)[0]
            fresh_added.append(w - o)
        fresh_gw.stop()
        gw.start()
        run_remote(gw.port, tree, ["--workspace", "--", "true"], home)

        # Bytes on the wire: unchanged, then one edited file.
        proxy = CountingProxy(gw.port)
        args = ["--workspace", "--output-format", "json", "--", "true"]
        _, out = run_remote(proxy.port, tree, args, home)
        unchanged_wire = proxy.sent
        unchanged = json.loads(out)["workspace"]
        edited = os.path.join(tree, "dir007", "file00007.dat")
        with open(edited, "ab") as f:
            f.write(b"one more line\n")
        proxy.sent = 0
        _, out = run_remote(proxy.port, tree, args, home)
        edit_wire = proxy.sent
        edit = json.loads(out)["workspace"]
        gw.stop()
    finally:
        gw.stop()
        fresh_gw.stop()
        if sshd:
            sshd.terminate()
        shutil.rmtree(tmp, ignore_errors=True)

    ms = lambda s: f"{s * 1000:.0f} ms"
    print(f"\n{a.files} files, {size / 1e6:.0f} MB, {a.runs} first runs, {a.rerun_runs} rerun pairs "
          f"(median, min–max):\n")
    print("| measure | workspace | baseline | figure |")
    print("|---|---|---|---|")
    print(f"| first run (empty caches) | {spread(firsts, ms)} | {baseline_name}: {spread(tars, ms)} "
          f"| ratio {med(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}) |")
    print(f"| rerun, nothing changed | {spread(withs, ms)} | same command without --workspace: "
          f"{spread(withouts, ms)} | added {spread(added, ms)} |")
    print(f"| rerun, nothing changed, fresh tree per run (`local_idle_trees: 0`) | | | "
          f"added {spread(fresh_added, ms)} |")
    print(f"| rerun after editing one file | {spread(edit_withs, ms)} | same command without "
          f"--workspace: {spread(edit_withouts, ms)} | added {spread(edit_added, ms)} |")
    print(f"| rerun, nothing changed: upload | {unchanged['uploaded_files']} files, "
          f"{unchanged['uploaded_bytes']} B | | {unchanged_wire} B sent in total |")
    print(f"| after editing one file ({edit['uploaded_bytes']} B) | {edit['uploaded_files']} file, "
          f"{edit['uploaded_bytes']} B | | {edit_wire} B sent in total |")


if __name__ == "__main__":
    main()
