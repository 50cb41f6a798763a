#!/usr/bin/env bash
# The official MCP SDKs that drive a gateway in .ci/check.d/mcp-sdks.sh: the Python SDK in the
# project's virtualenv (.venv, shared with the chart checks), the TypeScript SDK and the
# inspector from .ci/mcp-sdks/package-lock.json. Pinned, so that a check never changes under us.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check "mcp==2.3.0"
if ! command -v npm >/dev/null 2>&1; then
  echo "mcp-sdks: npm is missing (Node.js 20 or later is needed for the TypeScript SDK)" >&2
  exit 1
fi
# npm keeps its own copy of the lock file in node_modules: install only when ours is newer.
if [ ! .ci/mcp-sdks/node_modules/.package-lock.json -nt .ci/mcp-sdks/package-lock.json ]; then
  (cd .ci/mcp-sdks && npm ci --no-audit --no-fund --loglevel=error)
fi
