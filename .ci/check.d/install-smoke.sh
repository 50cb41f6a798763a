#!/usr/bin/env bash
# README.md's install command, then a smoke test of the installed binaries: `mcp-run serve` on
# a free loopback port, `run-remote` mirroring a command's output and exit code, a client
# failure exiting 125, and the completion scripts.
#
# The command is `cargo install --path . --locked` with `--debug` and a temporary `--root`:
# with `--path`, cargo builds in this checkout's target directory, so the dev-profile build
# that `cargo test` just made is reused; a release build of every dependency would take
# most of CI's time on two cores. What is tested is the install itself: the lock file holds,
# both binaries are installed under ROOT/bin, and they work from there.
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

cargo install --path . --locked --debug --root "$root" --quiet
for b in mcp-run run-remote; do
  [ -x "$root/bin/$b" ] || fail "cargo install did not install $b in $root/bin"
done

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
echo "install-smoke: installed mcp-run and run-remote; serve, run-remote and completions work"
