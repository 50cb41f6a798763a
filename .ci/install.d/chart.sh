#!/usr/bin/env bash
# The virtualenv .venv of the chart checks (.ci/check.d/chart.sh), made ahead of the tests;
# the check makes it itself too when it is missing (see .ci/lib/venv.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source .ci/lib/venv.sh
ensure_chart_venv
