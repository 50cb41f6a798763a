#!/usr/bin/env bash
# Chart lint and renders, strict object validation, values schema, manifests in sync,
# hadolint (see .ci/chart-check.py), in the virtualenv of .ci/lib/venv.sh (made here when
# missing, so that `bash .ci/test` passes on a fresh clone).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source .ci/lib/venv.sh
ensure_chart_venv
.venv/bin/python .ci/chart-check.py
