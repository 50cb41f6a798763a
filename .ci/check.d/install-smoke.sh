#!/usr/bin/env bash
# README.md's install command, then a smoke test of the installed binaries: `mcp-run serve` on
# a free loopback port, `run-remote` mirroring a command's output and exit code, a client
# failure exiting 125, and the completion scripts.
#
# The command is `cargo install --path . --locked` with `--debug` and a temporary `--root`:
# with `--path`, cargo builds in this checkout's target directory, so the dependencies that
# `cargo test` just built are reused where their features are the same. They are not for the
# crate and its async stack (tokio, hyper, kube, rmcp, ...): the tests' dev-dependencies add
# features (tokio's test-util, axum's ws, ...), which an install leaves out, so the install
# builds those a second time (measured in docs/performance.md, "The test command"). Hence the
# install itself runs in CI (CI=true) or with MCP_RUN_INSTALL_CHECK=1; otherwise it is skipped,
# saying so, and the same smoke test runs on the binaries `cargo test` built.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

root="$(mktemp -d)"
gw=
cleanup() {
  if [ -n "$gw" ]; then kill "$gw" 2>/dev/null || true; wait "$gw" 2>/dev/null || true; fi
  rm -rf "$root"
}
trap cleanup EXIT
fail() { echo "install-smoke: $*" >&2; [ -f "$root/gw.log" ] && cat "$root/gw.log" >&2; exit 1; }

if [ "${CI:-}" = "true" ] || [ "${MCP_RUN_INSTALL_CHECK:-}" = "1" ]; then
  # As a user runs it: with plain rustc, not .ci/test's clippy-driver (.ci/lib/clippy-rustc).
  env -u RUSTC_WORKSPACE_WRAPPER cargo install --path . --locked --debug --root "$root" --quiet
  for b in mcp-run run-remote; do
    [ -x "$root/bin/$b" ] || fail "cargo install did not install $b in $root/bin"
  done
  what="installed mcp-run and run-remote"
else
  echo "install-smoke: cargo install skipped (not CI; MCP_RUN_INSTALL_CHECK=1 runs it); the smoke test runs on the binaries cargo test built"
  mkdir -p "$root/bin"
  cargo test --locked --quiet --test integration --no-run --message-format=json |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["bin"] and not m["profile"]["test"]:
        print(m["executable"])' >"$root/bins"
  for b in mcp-run run-remote; do
    exe="$(grep "/$b\$" "$root/bins" | head -n1)"
    [ -n "$exe" ] || fail "cargo test did not build $b"
    ln -s "$exe" "$root/bin/$b"
  done
  what="built mcp-run and run-remote"
fi

"$root/bin/mcp-run" serve --listen 127.0.0.1:0 >"$root/gw.log" 2>&1 &
gw=$!
addr=
for _ in $(seq 1 150); do
  addr="$(grep -o 'addr=[0-9.:]*' "$root/gw.log" | head -n1 | cut -d= -f2 || true)"
  [ -n "$addr" ] && break
  kill -0 "$gw" 2>/dev/null || fail "mcp-run serve exited"
  sleep 0.2
done
[ -n "$addr" ] || fail "mcp-run serve did not report its address"
export RUN_REMOTE_SERVER="http://$addr/raw"

set +e
out="$("$root/bin/run-remote" -- sh -c 'echo hello; echo oops >&2; exit 3' 2>"$root/err")"
rc=$?
set -e
[ "$rc" = 3 ] || fail "run-remote exited $rc, not the command's 3"
[ "$out" = hello ] || fail "stdout was '$out'"
[ "$(cat "$root/err")" = oops ] || fail "stderr was '$(cat "$root/err")'"

set +e
"$root/bin/run-remote" --server "http://$addr/nope" -- true 2>"$root/err"
rc=$?
set -e
[ "$rc" = 125 ] || fail "a rejected request exited $rc, not 125"
grep -q '^run-remote: .*/raw' "$root/err" || fail "no /raw hint: $(cat "$root/err")"

"$root/bin/run-remote" completions bash | grep -q 'complete -F' || fail "run-remote completions bash"
"$root/bin/mcp-run" completions zsh | grep -q '#compdef mcp-run' || fail "mcp-run completions zsh"
echo "install-smoke: $what; serve, run-remote and completions work"
