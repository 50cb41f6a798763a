#!/usr/bin/env python3
"""Prints the template benchmark's figures (docs/performance.md) from criterion's estimates.

Run the benchmark first, then this script:

    cargo bench --bench templates -- --warm-up-time 1 --measurement-time 5
    python3 bench/templates_report.py

Reads $CARGO_TARGET_DIR/criterion (default target/criterion): for each benchmark of
benches/templates.rs, the median time per iteration, its median absolute deviation (the
spread across criterion's samples) and the ratio to the same log's baseline measured in the
same run (the include pattern alone, line by line).
"""

import json
import os
import sys
from pathlib import Path


def main() -> int:
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
        results[(log, case)] = (
            estimates["median"]["point_estimate"] / 1e6,
            estimates["median_abs_dev"]["point_estimate"] / 1e6,
        )
    if not results:
        print(f"no template benchmark results under {root}", file=sys.stderr)
        return 1
    print("| log (100,000 lines) | filter | median | MAD | / baseline |")
    print("|---|---|---:|---:|---:|")
    for log in sorted({log for log, _ in results}):
        base = results.get((log, "baseline grep"))
        for case in ("baseline grep", "failed", "passed", "auto failed"):
            if (log, case) not in results:
                continue
            median, mad = results[(log, case)]
            ratio = f"{median / base[0]:.1f}x" if base else "n/a"
            name = {
                "baseline grep": "baseline: include_regex per line",
                "failed": "template, exit 1",
                "passed": "template, exit 0",
                "auto failed": "auto (picks by the output), exit 1",
            }[case]
            print(f"| {log} | {name} | {median:.1f} ms | {mad:.2f} ms | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
