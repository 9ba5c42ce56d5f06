#!/usr/bin/env sh
# Debian packages some test modules start for real (Slurm's daemons and munge for tests/slurm,
# etcd for tests/resilient/test_etcd.py). Usage: install_debian.sh WHAT BINARY PACKAGE...
# Where they cannot be installed (not root, no apt-get) nothing fails: those tests then skip and say why.
set -u
WHAT=$1
BINARY=$2
shift 2
if command -v "$BINARY" >/dev/null 2>&1 || [ -x "/usr/sbin/$BINARY" ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "$WHAT: not root or no apt-get; $* not installed, its tests will skip"
  exit 0
fi
install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1; }
install "$@" || { apt-get update -q >/dev/null 2>&1 && install "$@"; } || echo "$WHAT: apt-get could not install $*; its tests will skip"
exit 0
