#!/usr/bin/env python3
"""Prints the template benchmark's figures (docs/performance.md) from criterion's estimates.

One run:

    cargo bench --bench templates -- --warm-up-time 1 --measurement-time 5
    python3 bench/templates_report.py

reads $CARGO_TARGET_DIR/criterion (default target/criterion): for each benchmark of
benches/templates.rs, the median time per iteration, its median absolute deviation (the
spread across criterion's samples) and the ratio to the same log's baseline measured in the
same run (the include pattern alone, line by line).

Several runs (on a loaded machine, compare ratios within a run, and alternate the order):

    for i in 1 2 3 4; do
      TEMPLATES_BENCH_REVERSE=$((i % 2)) cargo bench --bench templates -- --warm-up-time 1 --measurement-time 5
      python3 bench/templates_report.py --save /tmp/templates-run-$i.json
    done
    python3 bench/templates_report.py --combine /tmp/templates-run-*.json

`--save` also writes the run's figures and the load average when it ends; `--combine` prints,
per log and filter, the median over the runs of the time and of the ratio to the same run's
baseline, the MAD of that ratio over the runs, and each run's ratio.
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

CASES = {
    "baseline grep": "baseline: include_regex per line",
    "failed": "template, exit as logged" ,
    "passed": "template, exit 0",
    "auto failed": "auto (picks by the output), exit 1",
}


def read_run() -> dict:
    target = Path(os.environ.get("CARGO_TARGET_DIR", "target"))
    root = target / "criterion"
    results = {}
    for bench in sorted(root.glob("*/new/benchmark.json")):
        info = json.loads(bench.read_text())
        estimates = json.loads((bench.parent / "estimates.json").read_text())
        title = info.get("title") or info.get("full_id")
        if " 100k lines, " not in title:
            continue
        log, case = title.split(" 100k lines, ", 1)
        results[f"{log}|{case}"] = (
            estimates["median"]["point_estimate"] / 1e6,
            estimates["median_abs_dev"]["point_estimate"] / 1e6,
        )
    return results


def case_name(log: str, case: str) -> str:
    if case == "failed" and not log.startswith("fixture:"):
        return "template, exit 1"
    return CASES[case]


def ordered(keys):
    logs = sorted({k.split("|")[0] for k in keys}, key=lambda l: (l.startswith("fixture:"), l))
    for log in logs:
        for case in CASES:
            if f"{log}|{case}" in keys:
                yield log, case


def one(results: dict) -> None:
    print("| log (100,000 lines) | filter | median | MAD | / baseline |")
    print("|---|---|---:|---:|---:|")
    for log, case in ordered(results):
        median, mad = results[f"{log}|{case}"]
        base = results.get(f"{log}|baseline grep")
        ratio = f"{median / base[0]:.1f}x" if base else "n/a"
        print(f"| {log} | {case_name(log, case)} | {median:.1f} ms | {mad:.2f} ms | {ratio} |")


def combine(paths) -> None:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    loads = ", ".join(r.get("load", "?") for r in runs)
    print(f"{len(runs)} runs; load average (1 min) at the end of each: {loads}\n")
    print("| log (100,000 lines) | filter | median time | ratio to baseline: median | MAD | each run |")
    print("|---|---|---:|---:|---:|---|")
    keys = set().union(*(r["results"].keys() for r in runs))
    for log, case in ordered(keys):
        times, ratios = [], []
        for r in runs:
            res = r["results"]
            if f"{log}|{case}" not in res:
                continue
            times.append(res[f"{log}|{case}"][0])
            base = res.get(f"{log}|baseline grep")
            if base:
                ratios.append(res[f"{log}|{case}"][0] / base[0])
        med = statistics.median(ratios)
        mad = statistics.median(abs(x - med) for x in ratios)
        each = ", ".join(f"{x:.2f}" for x in ratios)
        print(
            f"| {log} | {case_name(log, case)} | {statistics.median(times):.1f} ms "
            f"| {med:.2f}x | {mad:.2f} | {each} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", help="also write this run's figures to this JSON file")
    parser.add_argument("--combine", nargs="+", help="JSON files of --save to combine")
    args = parser.parse_args()
    if args.combine:
        combine(args.combine)
        return 0
    results = read_run()
    if not results:
        print("no template benchmark results under target/criterion", file=sys.stderr)
        return 1
    one(results)
    if args.save:
        load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
        Path(args.save).write_text(json.dumps({"load": load, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
