#!/usr/bin/env bash
# Chart lint and renders, strict object validation, values schema, manifests in sync,
# hadolint (see .ci/chart-check.py). Needs the virtualenv of .ci/install.d/chart.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
.venv/bin/python .ci/chart-check.py
