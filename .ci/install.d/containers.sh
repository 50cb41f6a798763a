#!/usr/bin/env bash
# Real containers for the kube tests: Debian's podman and runc run the API-server double's
# pods as containers (tests/kube_double/podman.rs: a real OOM kill, busybox's applets as the
# image's programs), from an image imported from busybox-static. busybox-static also gives
# the double's `busybox-applets` images their applets. Without them the tests that need
# them fail when CI=true, and say they skipped otherwise.
set -euo pipefail
need=()
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v runc >/dev/null 2>&1 || [ -x /usr/sbin/runc ] || need+=(runc)
if ! [ -x /usr/bin/busybox ] || ! file -L /usr/bin/busybox 2>/dev/null | grep -q 'statically linked'; then
  need+=(busybox-static)
fi
[ ${#need[@]} -eq 0 ] && exit 0
sudo=
[ "$(id -u)" = 0 ] || sudo=sudo
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
