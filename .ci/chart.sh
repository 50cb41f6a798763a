#!/usr/bin/env bash
# The chart checks on their own, for local use (the check makes .venv if needed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash .ci/check.d/chart.sh
