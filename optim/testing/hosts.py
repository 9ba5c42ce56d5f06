"""Several "hosts" on one machine, and a drill job spread over them (for the recovery benchmark and the tests).

:class:`Hosts` makes one network namespace per host, each with its own
address on a private /24 and its own loopback (so nothing reaches another
host through 127.0.0.1), joined by a bridge in the root namespace that has no
address of its own. :meth:`Hosts.run` starts a command inside a host (``ip
netns exec``; only the network is separate: pids and files are shared), and
:meth:`Hosts.cut` takes a host's link down, which silences its TCP connections
without resetting them, as a dead switch port does. :meth:`Hosts.close` (also
the context manager's exit) kills what was started and removes every
namespace and link, even after an error. Needs root and ``ip``;
:func:`unavailable` says why not where they are missing. :class:`Loopback`
offers the same calls on this machine's loopback, without cuts.

:class:`HostsJob` runs ``sparsecomm coordinator`` in host 0 and one
:mod:`optim.testing.drill` worker per further host (spares after them).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from bindings.json_object import JsonObject
from bindings.spawn import ForkedPython
from bindings.validate import check_int
from optim.apps.paths import pythonpath_env
from optim.testing.drill import command as drill_command
from resilient_comm.events import read_event_dir, read_events

__all__ = [
    "DEFAULT_PORT",
    "HostProcess",
    "Hosts",
    "HostsJob",
    "Loopback",
    "kill_all",
    "parse_rate",
    "unavailable",
    "wait_for",
]

#: The coordinator's port in :class:`HostsJob` (each namespace has its own ports).
DEFAULT_PORT = 29400

T = TypeVar("T")

#: A process a host runs: forked from the warm fork server, or a fresh one.
HostProcess = subprocess.Popen[bytes] | ForkedPython


def wait_for(pred: Callable[[], T], timeout: float, what: str, interval: float = 0.005) -> T:
    """Poll ``pred`` until it returns something truthy; ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def kill_all(procs: Sequence[HostProcess]) -> None:
    """Resume (SIGCONT) and kill (SIGKILL) every process still running, then reap them (10 s each at most)."""
    for p in procs:
        if p.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable(shaped: bool = False) -> str | None:
    """Why namespaces (with ``shaped``: and links with a rate) cannot be made here (``None``: they can)."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    if shaped and shutil.which("tc") is None:
        return "the tc command (iproute2) is missing: links cannot be shaped"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"scprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _start(
    argv: Sequence[str], env: Mapping[str, str], netns: str | None, output: str | None, **kw: Any
) -> HostProcess:
    """``argv`` with ``env`` (in ``netns``): forked from the warm fork server where it is this Python on a
    module or script and nothing else is asked of it (``kw``), else a fresh process."""
    if not kw and ForkedPython.supports(argv):
        return ForkedPython(argv, env, output=output, netns=netns)
    if output is not None:
        kw = {**kw, "stdout": open(output, "ab"), "stderr": subprocess.STDOUT}  # noqa: SIM115 - the child owns it
    prefix = [] if netns is None else ["ip", "netns", "exec", netns]
    proc: subprocess.Popen[bytes] = subprocess.Popen([*prefix, *argv], env=dict(env), **kw)
    if output is not None:
        kw["stdout"].close()
    return proc


class _Hosts(Protocol):
    def run(
        self,
        i: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        output: str | None = None,
        **kw: Any,
    ) -> HostProcess: ...

    def address(self, i: int) -> str: ...

    def interface(self, i: int) -> str: ...


_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_RATE_UNITS = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


def parse_rate(text: str | None) -> int | None:
    """A link rate as ``tc`` spells it (``"100mbit"``, ``"1gbit"``, ``"2.5gbit"``) in bit/s; ``"none"``/``None``:
    ``None`` (unshaped).

    Raises:
        ValueError: Not a rate, or below 1 Mbit/s or above 100 Gbit/s.
    """
    if text is None or text == "none":
        return None
    m = _RATE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"link rate: expected e.g. 100mbit, 1gbit, 10gbit or none, got {text!r}")
    rate = int(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    if not 10**6 <= rate <= 10**11:
        raise ValueError(f"link rate: expected 1mbit..100gbit, got {text!r}")
    return rate


class Hosts:
    """``n`` hosts on one bridge: host ``i`` is namespace :meth:`ns` with address :meth:`address`.

    Args:
        n: Number of hosts (at most 250).
        link_rate: Each host's link rate, both directions (``"100mbit"``, ``"1gbit"``, ...; ``None`` or
            ``"none"``: unshaped): a token bucket (``tc`` ``tbf``, 10 ms of burst) on the host's end of its
            link and on the bridge's. What it delivers is measured by :func:`optim.apps.benchmarks.links.measure_link`.
    """

    def __init__(self, n: int, link_rate: str | None = None) -> None:
        check_int("n", n, low=1, high=250)
        self.link_rate = parse_rate(link_rate)
        """The rate set on every link in bit/s (``None``: unshaped)."""
        tag = os.getpid() % 100_000
        self._tag = tag
        self._subnet = f"10.{200 + tag % 50}.{tag % 250}"
        self.n = n
        self._bridge = f"scb{tag}"
        self._procs: list[HostProcess] = []
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
        if self.link_rate is not None:
            self._shape(i)

    def _shape(self, i: int) -> None:
        """A token bucket at :attr:`link_rate` on both ends of host ``i``'s link (each shapes what it sends)."""
        rate = self.link_rate
        assert rate is not None
        burst = max(128 * 1024, rate // 8 // 100)  # 10 ms at the rate, and at least two 64 KiB GSO segments
        tbf = ["root", "tbf", "rate", f"{rate}bit", "burst", str(burst), "latency", "50ms"]
        for prefix, dev in (([], self._outer(i)), (["-n", self.ns(i)], self.interface(i))):
            made = subprocess.run(["tc", *prefix, "qdisc", "add", "dev", dev, *tbf], capture_output=True, text=True)
            if made.returncode != 0:
                raise RuntimeError(f"tc qdisc add dev {dev} {' '.join(tbf)}: {made.stderr.strip()}")

    def run(
        self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None, output: str | None = None, **kw: Any
    ) -> HostProcess:
        """Start ``argv`` inside host ``i`` (``env`` added to this process's environment).

        This Python on a module or a script is forked from the warm fork
        server and moved into the host's namespace (see
        :class:`~bindings.spawn.ForkedPython`); anything else, or a call with
        :class:`subprocess.Popen` keywords ``kw``, runs under ``ip netns exec``.

        Args:
            i: The host.
            argv: The command.
            env: Variables added to this process's environment.
            output: A file the process's standard output and error are appended to (``None``: this process's).
            **kw: :class:`subprocess.Popen` keywords (``stdout=subprocess.PIPE``, ...).
        """
        proc = _start(argv, {**os.environ, **(env or {})}, self.ns(i), output, **kw)
        self._procs.append(proc)
        return proc

    def cut(self, i: int) -> None:
        """Take host ``i``'s link down: its peers' connections go silent (no reset).

        The host's own interface loses its carrier, and the kernel takes the
        carrier back up to a second after :meth:`restore` (link state changes
        are handled at most about once a second): a cut of 0.3 s silences the
        host for about 1 s, and cuts repeated every second keep it silent
        throughout. For short outages see :meth:`detach`.
        """
        _ip("link", "set", self._outer(i), "down")

    def restore(self, i: int) -> None:
        """Bring host ``i``'s link back up."""
        _ip("link", "set", self._outer(i), "up")

    def detach(self, i: int) -> None:
        """Take host ``i``'s cable out of the switch (the bridge), its link staying up: silent, no reset.

        Unlike :meth:`cut`, no carrier changes: traffic flows again the moment
        :meth:`attach` puts it back (a 0.3 s outage is 0.3 s of silence).
        """
        _ip("link", "set", self._outer(i), "nomaster")

    def attach(self, i: int) -> None:
        """Plug host ``i`` back into the switch."""
        _ip("link", "set", self._outer(i), "master", self._bridge)

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


class Loopback:
    """Every "host" is this machine's loopback: processes start here; :meth:`close` kills what is left."""

    def __init__(self) -> None:
        self._procs: list[HostProcess] = []

    def run(
        self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None, output: str | None = None, **kw: Any
    ) -> HostProcess:
        """Start ``argv`` here (``env`` added to this process's environment); as :meth:`Hosts.run`."""
        proc = _start(argv, {**os.environ, **(env or {})}, None, output, **kw)
        self._procs.append(proc)
        return proc

    def address(self, i: int) -> str:
        """Every host is 127.0.0.1."""
        return "127.0.0.1"

    def interface(self, i: int) -> str:
        """The loopback interface."""
        return "lo"

    def close(self) -> None:
        """Kill every process started here."""
        kill_all(self._procs)

    def __enter__(self) -> Loopback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HostsJob:
    """A coordinator in host 0 (``sparsecomm coordinator``), one drill worker per further host, then spares.

    Args:
        hosts: Where to run (:class:`Hosts` with at least ``1 + workers + spares`` hosts, or :class:`Loopback`).
        workdir: Directory for the job secret, the coordinator's events and the drill logs.
        workers: Workers of the first epoch (hosts ``1..workers``).
        spares: Spares (the hosts after the workers).
        steps, numel, sleep: Drill arguments.
        hb: The coordinator's heartbeat timeout (seconds).
        grace: Its stall grace (seconds).
        mode: ``hotswap`` or ``shrink``.
        port: The coordinator's port.
        timeout: The workers' communicator timeout (every wait, a silent link included).
    """

    def __init__(
        self,
        hosts: _Hosts,
        workdir: Path,
        *,
        workers: int,
        steps: int,
        hb: float,
        spares: int = 0,
        numel: int = 1024,
        sleep: float = 0.03,
        grace: float = 20.0,
        mode: str = "shrink",
        port: int = DEFAULT_PORT,
        timeout: float = 20.0,
    ) -> None:
        self.hosts, self.tmp, self.steps = hosts, Path(workdir), steps
        self.events_path = self.tmp / "coordinator.jsonl"
        self.log_dir = self.tmp / "drill"
        self.log_dir.mkdir(parents=True)
        secret = self.tmp / "job.secret"
        job = f"hostsjob{time.monotonic_ns() % 10**9}"
        argv = [sys.executable, "-m", "optim", "coordinator", "--world-size", str(workers), "--mode", mode]
        argv += ["--heartbeat-timeout", str(hb), "--stall-grace", str(grace), "--host", hosts.address(0)]
        argv += ["--port", str(port), "--events", str(self.events_path), "--job", job, "--secret-file", str(secret)]
        out = self.tmp / "coordinator.out"
        self.coordinator = hosts.run(0, argv, env=pythonpath_env(), output=str(out))
        want = f"SPARSECOMM_COORDINATOR={hosts.address(0)}:{port}"

        def banner() -> bool:
            text = out.read_text() if out.exists() else ""
            if want in text:
                return True
            if self.coordinator.poll() is not None:
                raise RuntimeError(f"the coordinator did not start (exit {self.coordinator.returncode}): {text!r}")
            return False

        wait_for(banner, 60, "the coordinator's banner", 0.01)
        env = {
            **pythonpath_env(),
            "SPARSECOMM_COORDINATOR": f"{hosts.address(0)}:{port}",
            "SPARSECOMM_JOB_ID": job,
            "SPARSECOMM_JOB_SECRET_FILE": str(secret),
            "SPARSECOMM_BACKEND": "gloo",
        }
        drill = drill_command(steps=steps, numel=numel, sleep=sleep, log=self.log_dir, timeout=timeout)

        def start(host: int, role: str, slot: int) -> HostProcess:
            more = {"SPARSECOMM_ROLE": role, "SPARSECOMM_SLOT": str(slot), "GLOO_SOCKET_IFNAME": hosts.interface(host)}
            return hosts.run(host, drill, env={**env, **more})

        self.workers = [start(1 + s, "active", s) for s in range(workers)]
        self.spares = [start(1 + workers + k, "spare", -1) for k in range(spares)]

    def events(self, name: str, **match: Any) -> list[JsonObject]:
        """The coordinator's events of kind ``name`` with the given field values."""
        recs = read_events(self.events_path, missing_ok=True)
        return [e for e in recs if e["event"] == name and all(e.get(k) == v for k, v in match.items())]

    def wait_event(self, name: str, timeout: float, **match: Any) -> JsonObject:
        """The first such event, once there is one (``TimeoutError`` after ``timeout`` s)."""
        return wait_for(lambda: self.events(name, **match), timeout, f"coordinator event {name} {match}", 0.01)[0]

    def log(self, pid: int) -> list[JsonObject]:
        """Drill log of process ``pid``."""
        return read_events(self.log_dir / f"{pid}.jsonl", missing_ok=True)

    def committed(self, pid: int) -> list[int]:
        """Steps process ``pid`` committed, in order."""
        return [r["step"] for r in self.log(pid) if r["event"] == "committed"]

    def wait_progress(self, pid: int, step: int, timeout: float = 60.0) -> None:
        """Wait until process ``pid`` committed ``step``."""
        wait_for(lambda: max(self.committed(pid), default=-1) >= step, timeout, f"pid {pid} to commit {step}")

    def committed_after(self, pid: int, t: float) -> list[int]:
        """Steps process ``pid`` committed after the time ``t`` (``time.time()``), in order."""
        return [r["step"] for r in self.log(pid) if r["event"] == "committed" and r["time"] > t]

    def wait_training(self, pid: int, step: int = 5) -> None:
        """Wait until epoch 0 formed and process ``pid`` committed ``step``."""
        self.wait_event("epoch_configured", 60, epoch=0)
        self.wait_progress(pid, step)

    def describe(self) -> str:
        """The coordinator's events and each process's last few records, for an error message."""
        recs = read_events(self.events_path, missing_ok=True)
        lines = [f"{e['time']:.3f} {e['event']} {e.get('reason', '')}" for e in recs]
        for path, recs in read_event_dir(self.log_dir).items():
            tail = [r for r in recs if r["event"] != "committed"][-3:]
            lines.append(f"{path.stem}: {tail}"[:500])
        return "\n".join(lines)
