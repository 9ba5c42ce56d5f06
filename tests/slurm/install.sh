#!/usr/bin/env sh
# Slurm's daemons and munge for tests/slurm, from Debian's packages. Where they cannot be installed
# (not root, no apt-get) nothing fails: the Slurm tests then skip and say why.
set -u
PKGS="slurmctld slurmd slurm-client munge"
if command -v slurmd >/dev/null 2>&1 || [ -x /usr/sbin/slurmd ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "tests/slurm: not root or no apt-get; Slurm is not installed and its tests will skip"
  exit 0
fi
install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $PKGS >/dev/null 2>&1; }
install || { apt-get update -q >/dev/null 2>&1 && install; } || echo "tests/slurm: apt-get could not install $PKGS; its tests will skip"
exit 0
