#!/usr/bin/env bash
# Real MCP clients against a gateway (docs/mcp.md): the official Python and TypeScript SDKs
# over streamable HTTP and stdio (small, failing, 10 MB, binary and, once, a 62 s command with
# progress), and `inspector --cli --strict` on the tool schemas of both transports.
# Needs .ci/install.d/mcp-sdks.sh. Without its packages the check is skipped, unless CI=true:
# then it fails. MCP_SDKS_QUICK=1 leaves out the slow command.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
root="$PWD"

missing=()
.venv/bin/python -c "import mcp" 2>/dev/null || missing+=("python package mcp (.venv)")
[ -d .ci/mcp-sdks/node_modules/@modelcontextprotocol/sdk ] || missing+=("npm package @modelcontextprotocol/sdk")
[ -d .ci/mcp-sdks/node_modules/@modelcontextprotocol/inspector ] || missing+=("npm package @modelcontextprotocol/inspector")
if [ ${#missing[@]} -gt 0 ]; then
  echo "mcp-sdks: missing ${missing[*]}; run .ci/install.d/mcp-sdks.sh" >&2
  if [ "${CI:-}" = "true" ]; then exit 1; fi
  echo "mcp-sdks: skipped (not CI)"
  exit 0
fi

# The gateway `cargo test` built (as kubectl-conformance.sh takes the double): nothing is
# compiled again after .ci/test's test step. `cargo build --bin mcp-run` would build the
# crate and its async stack a second time, without the dev-dependencies' features.
bin="$(cargo test --locked --quiet --test integration --no-run --message-format=json |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "mcp-run" and m["target"]["kind"] == ["bin"] and not m["profile"]["test"]:
        print(m["executable"])')" || bin=""
if [ -z "$bin" ]; then
  echo "mcp-sdks: cannot build mcp-run" >&2
  exit 1
fi
work="$(mktemp -d)"
port="$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# A declared CLI tool too, so that its schema meets the strict check.
cat >"$work/config.yaml" <<YAML
tools:
  - name: list_dir
    description: List a directory
    executable: ls
    flags:
      all: {type: bool}
      sort: {type: string}
      width: {type: number}
      hide: {type: array}
    args: {description: directories, max: 3}
YAML
"$bin" serve --listen "127.0.0.1:$port" --config "$work/config.yaml" >"$work/gateway.log" 2>&1 &
gw=$!
trap 'kill $gw 2>/dev/null; wait $gw 2>/dev/null; rm -rf "$work"' EXIT
url="http://127.0.0.1:$port/mcp"
.venv/bin/python - "$port" <<'PY'
import sys, time, urllib.request
for _ in range(200):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/healthz", timeout=1)
        break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit("mcp-sdks: the gateway did not start")
PY

inspector() {
  (cd .ci/mcp-sdks && MCP_CATALOG_PATH="$work/catalog.json" node_modules/.bin/mcp-inspector --cli "$@" --method tools/list --strict >"$work/tools.json" 2>"$work/strict.txt") || {
    echo "mcp-sdks: inspector --strict failed on $*:" >&2
    cat "$work/strict.txt" >&2
    exit 1
  }
  if grep -qE '^(Warning|Error)' "$work/strict.txt"; then
    echo "mcp-sdks: inspector --strict reports problems on $*:" >&2
    cat "$work/strict.txt" >&2
    exit 1
  fi
}
inspector "$url"
inspector "$bin" stdio
echo "mcp-sdks: inspector --strict: nothing to report (HTTP, stdio)"

slow=--slow
[ "${MCP_SDKS_QUICK:-}" = "1" ] && slow=
.venv/bin/python .ci/mcp-sdks/check.py "$bin" "$url" $slow
(cd .ci/mcp-sdks && node check.mjs "$bin" "$url")
