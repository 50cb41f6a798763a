#!/usr/bin/env python3
"""Benchmark of cache volumes (docs/caches.md) on the local backend: a one-shot
`run-remote --workspace -- cargo build` with a warm cache (the cargo target directory kept
from the previous run of its key) against the same build with a cold one, in one run of this
script (these machines are noisy), pair by pair.

    cargo build --release --bin mcp-run --bin run-remote
    python3 bench/cache_bench.py [--pairs 3] [--bin-dir target/release]

Makes a small crate that depends on regex, serde (derive) and serde_json (the crate of
issue 23), resolved offline from ~/.cargo (the registry this repository's build filled), and
starts the gateway on a loopback port with a profile `rust` whose cache `target` holds
`CARGO_TARGET_DIR` (`scope: workspace`, so each `--cache-scope` is its own key). Then, after
one priming build of the warm key, per pair (a one-line edit to src/main.rs before each
build, so the crate itself is rebuilt every time):

  cold   `run-remote --workspace --profile rust --cache-scope cold-N -- cargo build --offline`
         (a new key: an empty target directory, every dependency compiled)
  warm   the same with `--cache-scope warm` (the target directory of the earlier builds)
  local  `cargo build --offline` in the checkout itself, incremental: the floor

Prints medians with min-max over the pairs, the warm/cold ratio per pair, and the load
average before and after.
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CARGO_TOML = """[package]
name = "warm-cache-bench"
version = "0.1.0"
edition = "2021"

[dependencies]
regex = "1"
serde = { version = "1", features = ["derive"] }
serde_json = "1"
"""

MAIN_RS = """use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug)]
struct Hit {
    line: usize,
    text: String,
}

fn main() {
    let re = regex::Regex::new(r"(?i)error").unwrap();
    let hits: Vec<Hit> = ["ok", "Error: x", "fine"]
        .iter()
        .enumerate()
        .filter(|(_, t)| re.is_match(t))
        .map(|(line, t)| Hit { line, text: t.to_string() })
        .collect();
    println!("{}", serde_json::to_string(&hits).unwrap());
}
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(cmd, **kw):
    t = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    dt = time.monotonic() - t
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return dt, r


def edit(crate, n):
    with open(os.path.join(crate, "src", "main.rs"), "a") as f:
        f.write(f"// edit {n}\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--bin-dir", default=os.path.join(ROOT, "target", "release"))
    args = ap.parse_args()
    gateway = os.path.join(args.bin_dir, "mcp-run")
    client = os.path.join(args.bin_dir, "run-remote")
    work = tempfile.mkdtemp(prefix="cache-bench-")
    try:
        crate = os.path.join(work, "crate")
        os.makedirs(os.path.join(crate, "src"))
        with open(os.path.join(crate, "Cargo.toml"), "w") as f:
            f.write(CARGO_TOML)
        with open(os.path.join(crate, "src", "main.rs"), "w") as f:
            f.write(MAIN_RS)
        with open(os.path.join(crate, ".gitignore"), "w") as f:
            f.write("/target\n")
        subprocess.run(["git", "init", "-q", crate], check=True)
        timed(["cargo", "generate-lockfile", "--offline"], cwd=crate)
        port = free_port()
        config = os.path.join(work, "config.yaml")
        with open(config, "w") as f:
            f.write(
                f"server: {{listen: '127.0.0.1:{port}'}}\n"
                "local:\n  inherit_env: [PATH, HOME, USER, LANG, CARGO_HOME, RUSTUP_HOME, RUSTUP_TOOLCHAIN]\n"
                f"caches:\n  local_dir: {os.path.join(work, 'caches')}\n  max_size: 20Gi\n"
                "profiles:\n  default: {}\n  rust:\n    caches:\n"
                "      - {name: target, path: /cache, env: {CARGO_TARGET_DIR: target}, size: 20Gi, scope: workspace}\n"
            )
        gw = subprocess.Popen(
            [gateway, "serve", "--config", config],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.1)
            env = dict(os.environ, RUN_REMOTE_SERVER=f"http://127.0.0.1:{port}/raw")
            build = ["cargo", "build", "--offline", "-q"]

            def remote(scope):
                return [client, "--workspace", "--profile", "rust", "--cache-scope", scope,
                        "--", *build]

            load_before = os.getloadavg()
            n = 0
            # Priming: the warm key's first build, and the local one.
            edit(crate, n)
            timed(remote("warm"), cwd=crate, env=env)
            timed(build, cwd=crate)
            cold, warm, local = [], [], []
            for i in range(args.pairs):
                n += 1
                edit(crate, n)
                dt, _ = timed(remote(f"cold-{i}"), cwd=crate, env=env)
                cold.append(dt)
                n += 1
                edit(crate, n)
                dt, _ = timed(remote("warm"), cwd=crate, env=env)
                warm.append(dt)
                n += 1
                edit(crate, n)
                dt, _ = timed(build, cwd=crate)
                local.append(dt)
                print(f"pair {i + 1}: cold {cold[-1]:.2f} s, warm {warm[-1]:.2f} s, "
                      f"local {local[-1]:.2f} s", file=sys.stderr)
            load_after = os.getloadavg()
        finally:
            gw.terminate()
            gw.wait(timeout=30)

        def fmt(xs):
            return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"

        ratios = [c / w for c, w in zip(cold, warm)]
        print(f"| build after a one-line edit ({args.pairs} pairs) | median (min-max) |")
        print("|---|---|")
        print(f"| one-shot, cold cache (new key) | {fmt(cold)} |")
        print(f"| one-shot, warm cache (same key) | {fmt(warm)} |")
        print(f"| `cargo build` in the checkout | {fmt(local)} |")
        print(f"| cold / warm, per pair | {statistics.median(ratios):.1f}x "
              f"({min(ratios):.1f}-{max(ratios):.1f}) |")
        print(f"\nload average (1, 5, 15 min) before {load_before}, after {load_after}; "
              f"{os.cpu_count()} CPUs")
        print(json.dumps({"cold": cold, "warm": warm, "local": local}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
