#!/usr/bin/env bash
# Debian's busybox: the API-server double's `busybox-applets` images run its applets, so that
# workspace placement and sync-back are tested against busybox's tar, find and sh
# (tests/workspace_kube.rs; without it that test fails when CI=true, else says it skipped).
set -euo pipefail
[ -x /usr/bin/busybox ] && exit 0
sudo=
[ "$(id -u)" = 0 ] || sudo=sudo
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq busybox >/dev/null
