"""Several "hosts" on one machine: network namespaces joined by a Linux bridge.

:class:`Hosts` makes one namespace per host, each with its own address on a
private /24 and its own loopback (so nothing reaches another host through
127.0.0.1), joined by a bridge in the root namespace that has no address of
its own. :meth:`Hosts.run` starts a command inside a host (``ip netns exec``;
only the network is separate: pids and files are shared with the test), and
:meth:`Hosts.cut` takes a host's link down, which silences its TCP
connections without resetting them, as a dead switch port does.
:meth:`Hosts.close` (also the context manager's exit) kills what was started
and removes every namespace and link, even when the test failed.

Needs root and ``ip``; :func:`unavailable` says why not where they are missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from tests.resilient.harness import kill_all

__all__ = ["Hosts", "unavailable"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (``None``: they can)."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"scprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Hosts:
    """``n`` hosts on one bridge: host ``i`` is namespace :meth:`ns` with address :meth:`address`.

    Args:
        n: Number of hosts (at most 250).
    """

    def __init__(self, n: int) -> None:
        if not 1 <= n <= 250:
            raise ValueError(f"n: expected 1..250 hosts, got {n}")
        tag = os.getpid() % 100_000
        self._tag = tag
        self._subnet = f"10.{200 + tag % 50}.{tag % 250}"
        self.n = n
        self._bridge = f"scb{tag}"
        self._procs: list[subprocess.Popen[bytes]] = []
        self._made: list[str] = []
        try:
            _ip("link", "add", self._bridge, "type", "bridge")
            _ip("link", "set", self._bridge, "up")
            for i in range(n):
                self._add(i)
        except BaseException:
            self.close()
            raise

    def ns(self, i: int) -> str:
        """Namespace name of host ``i``."""
        return f"sc{self._tag}h{i}"

    def address(self, i: int) -> str:
        """IPv4 address of host ``i``."""
        return f"{self._subnet}.{i + 1}"

    def interface(self, i: int) -> str:
        """Host ``i``'s interface name inside its namespace (for ``GLOO_SOCKET_IFNAME``)."""
        return "eth0"

    def _outer(self, i: int) -> str:
        return f"scv{self._tag}x{i}"

    def _add(self, i: int) -> None:
        ns, outer = self.ns(i), self._outer(i)
        _ip("netns", "add", ns)
        self._made.append(ns)
        inner = f"scp{self._tag}x{i}"  # renamed once inside the namespace
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", ns)
        _ip("-n", ns, "link", "set", inner, "name", self.interface(i))
        _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", self.interface(i))
        _ip("-n", ns, "link", "set", self.interface(i), "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "set", outer, "master", self._bridge)
        _ip("link", "set", outer, "up")

    def run(
        self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw: object
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside host ``i`` (``env`` added to this process's environment)."""
        full = {**os.environ, **(env or {})}
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv], env=full, **kw)  # type: ignore[call-overload]
        self._procs.append(proc)
        return proc

    def cut(self, i: int) -> None:
        """Take host ``i``'s link down: its peers' connections go silent (no reset)."""
        _ip("link", "set", self._outer(i), "down")

    def restore(self, i: int) -> None:
        """Bring host ``i``'s link back up."""
        _ip("link", "set", self._outer(i), "up")

    def close(self) -> None:
        """Kill every process started here, then remove the namespaces and the bridge."""
        kill_all(self._procs)
        for i in range(len(self._made)):  # deleting one end removes the pair at once (sockets left on a cut
            _ip("link", "del", self._outer(i), check=False)  # link would keep the namespace and its link)
        for ns in self._made:
            _ip("netns", "del", ns, check=False)
        self._made = []
        _ip("link", "del", self._bridge, check=False)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
