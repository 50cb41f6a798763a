#!/usr/bin/env python3
"""The build-loop benchmark of sessions (issue 23): an agent's edit-build-test loop, locally
and through mcp-run on the local backend, each figure against a baseline of the same run.

    cargo build --release --bin mcp-run --bin run-remote
    python3 bench/build_loop.py [--pairs 3] [--true-pairs 40] [--bin-dir target/release]

Makes a small crate that depends on regex, serde (derive) and serde_json, with a test, in a
git-like tree (`target/` ignored), starts the gateway on a loopback port, and measures
`cargo test --offline` (the registry must hold the crates; `cargo fetch` once otherwise):

  local cold      in the checkout, after `rm -rf target`
  local edit      in the checkout, after a one-line edit of src/lib.rs (incremental)
  session cold    `run-remote --session S --workspace -- cargo test --offline`, the call that
                  opens a new session S
  session edit    the same session after a one-line edit (the rerun the target is about:
                  within 1.5x `local edit` + 0.3 s)
  one-shot edit   `run-remote --workspace -- cargo test --offline` after an edit: what every
                  call cost before sessions (a cold build each time), --oneshot-pairs times
  true            `run-remote --session T -- true` against `run-remote -- true`, alternating
                  (--true-pairs pairs): the time a session call adds (target: at most 5 ms)

Each `edit` figure is one pair: the local edit and the session edit of the same change, in
alternating order. Prints a markdown table for docs/performance.md: medians with min-max,
and the per-pair ratio, plus the machine's load average.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CARGO_TOML = """[package]
name = "loop-crate"
version = "0.1.0"
edition = "2021"

[dependencies]
regex = "1"
serde = { version = "1", features = ["derive"] }
serde_json = "1"
"""

LIB_RS = """use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct Finding {
    pub line: usize,
    pub word: String,
}

/// Every word of `text` that matches `pattern`, with its line.
pub fn find(text: &str, pattern: &str) -> Vec<Finding> {
    let re = regex::Regex::new(pattern).expect("pattern");
    text.lines()
        .enumerate()
        .flat_map(|(i, l)| {
            re.find_iter(l).map(move |m| Finding { line: i + 1, word: m.as_str().to_owned() })
        })
        .collect()
}

pub fn to_json(f: &[Finding]) -> String {
    serde_json::to_string(f).expect("json")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_and_serialises() {
        let f = find("a cat\\nthe cow", r"c\\w+");
        assert_eq!(f.len(), 2);
        assert!(to_json(&f).contains("cow"));
    }
}
// edit 0
"""


def make_crate(root):
    os.makedirs(os.path.join(root, ".git"))
    with open(os.path.join(root, ".git", "HEAD"), "w") as f:
        f.write("ref: refs/heads/main\n")
    with open(os.path.join(root, ".gitignore"), "w") as f:
        f.write("/target\n")
    with open(os.path.join(root, "Cargo.toml"), "w") as f:
        f.write(CARGO_TOML)
    os.makedirs(os.path.join(root, "src"))
    with open(os.path.join(root, "src", "lib.rs"), "w") as f:
        f.write(LIB_RS)
    subprocess.run(["cargo", "generate-lockfile", "--offline"], cwd=root, check=True,
                   capture_output=True)


def edit(root, n):
    """A one-line change that changes the code (a new constant), as an agent's fix would."""
    with open(os.path.join(root, "src", "lib.rs"), "a") as f:
        f.write(f"pub const EDIT_{n}: usize = {n};\n")


def timed(cmd, cwd, env):
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True)
    d = time.perf_counter() - t
    if p.returncode != 0:
        sys.exit(f"{cmd} failed ({p.returncode}):\n{p.stderr.decode(errors='replace')[-3000:]}")
    return d


def start_gateway(bin_dir, tmp):
    env = dict(os.environ, TMPDIR=tmp, RUST_LOG="info")
    cfg = os.path.join(tmp, "gw.yaml")
    with open(cfg, "w") as f:
        f.write(f"workspaces:\n  local_dir: {tmp}/runs\n  cache_dir: {tmp}/cache\n"
                "limits:\n  default_timeout_secs: 1800\n")
    p = subprocess.Popen([os.path.join(bin_dir, "mcp-run"), "serve", "--listen", "127.0.0.1:0",
                          "--config", cfg], env=env, stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        if "listening" in line and "addr=" in line:
            addr = line.split("addr=")[1].split()[0]
            # The log goes on: read it, so that a full pipe never blocks the gateway.
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
            return p, f"http://{addr}/raw"
    sys.exit("the gateway did not start")


def med(xs):
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--oneshot-pairs", type=int, default=1)
    ap.add_argument("--true-pairs", type=int, default=40)
    ap.add_argument("--bin-dir", default=os.path.join(ROOT, "target", "release"))
    ap.add_argument("--only-true", action="store_true", help="measure the `true` pairs only")
    a = ap.parse_args()
    a.bin_dir = os.path.abspath(a.bin_dir)
    tmp = tempfile.mkdtemp(prefix="build-loop-")
    crate = os.path.join(tmp, "crate")
    os.makedirs(crate)
    make_crate(crate)
    gw, url = start_gateway(a.bin_dir, tmp)
    client = os.path.join(a.bin_dir, "run-remote")
    env = dict(os.environ, RUN_REMOTE_SERVER=url, XDG_CACHE_HOME=os.path.join(tmp, "xdg"))
    test = ["cargo", "test", "--offline", "-q"]
    in_session = [client, "--session", "loop", "--workspace", "--"] + test
    try:
        n = 0
        local_edit, session_edit, ratios, oneshot = [], [], [], []
        local_cold = session_cold = None
        if not a.only_true:
            # Cold: in the checkout and in a new session.
            local_cold = timed(test, crate, env)
            session_cold = timed(in_session, crate, env)
        for i in range(0 if a.only_true else a.pairs):
            n += 1
            edit(crate, n)
            order = [("local", test), ("session", in_session)]
            if i % 2:
                order.reverse()
            got = {}
            for name, cmd in order:
                got[name] = timed(cmd, crate, env)
            local_edit.append(got["local"])
            session_edit.append(got["session"])
            ratios.append(got["session"] / got["local"])
        for _ in range(0 if a.only_true else a.oneshot_pairs):
            n += 1
            edit(crate, n)
            oneshot.append(timed([client, "--workspace", "--"] + test, crate, env))
        # `true`: a session call against a one-shot call, alternating.
        timed([client, "--session", "t", "--no-cwd", "--", "true"], crate, env)
        one, ses, deltas = [], [], []
        for i in range(a.true_pairs):
            pair = [("one", [client, "--no-cwd", "--", "true"]),
                    ("ses", [client, "--session", "t", "--no-cwd", "--", "true"])]
            if i % 2:
                pair.reverse()
            got = {k: timed(c, crate, env) for k, c in pair}
            one.append(got["one"] * 1000)
            ses.append(got["ses"] * 1000)
            deltas.append((got["ses"] - got["one"]) * 1000)
    finally:
        gw.terminate()
        gw.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; binaries {a.bin_dir}\n")
    print("| what | time |")
    print("|---|---|")
    if local_edit:
        target = 1.5 * statistics.median(local_edit) + 0.3
        print(f"| `cargo test` in the checkout, cold | {local_cold:.2f} s |")
        print(f"| the same through a new session (opens it) | {session_cold:.2f} s |")
        print(f"| `cargo test` in the checkout after a one-line edit ({a.pairs} pairs) | {med(local_edit)} |")
        print(f"| the same through the session after the same edit | {med(session_edit)} |")
        print(f"| ratio session/local per pair | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}); target {target:.2f} s |")
    if oneshot:
        print(f"| one-shot `run-remote --workspace` after an edit (before sessions) | {med(oneshot)} |")
    print(f"| `run-remote -- true`, one-shot ({a.true_pairs} pairs) | {statistics.median(one):.1f} ms ({min(one):.1f}-{max(one):.1f}) |")
    print(f"| `run-remote --session t -- true` | {statistics.median(ses):.1f} ms ({min(ses):.1f}-{max(ses):.1f}) |")
    print(f"| added by the session, per pair | {statistics.median(deltas):+.1f} ms ({min(deltas):+.1f} to {max(deltas):+.1f}) |")


if __name__ == "__main__":
    main()
