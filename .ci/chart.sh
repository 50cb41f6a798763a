#!/usr/bin/env bash
# The chart checks on their own, for local use: makes .venv if needed, then runs them.
# .ci/run does the same through .ci/install.d/chart.sh and .ci/check.d/chart.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash .ci/install.d/chart.sh
bash .ci/check.d/chart.sh
