#!/usr/bin/env bash
# strace slows the gateway's file removal down (syscall delay injection) for the test of the
# bounded clean-up at SIGTERM (tests/hardening_exec.rs). Without it that test fails when
# CI=true and says it skipped otherwise; where ptrace is refused it says it skipped.
set -euo pipefail
command -v strace >/dev/null 2>&1 && exit 0
sudo=
[ "$(id -u)" = 0 ] || sudo=sudo
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq strace >/dev/null
