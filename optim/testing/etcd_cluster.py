"""A local etcd v3 cluster for tests and ``sparsecomm bench recovery``: N members on loopback, torn down always.

Each member is an ``etcd`` process (Debian's ``etcd-server`` package) with
its own client and peer port and a data directory on ``/dev/shm`` where there
is one (the cluster's fsyncs then cost memory speed, not disk speed).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

__all__ = ["EtcdCluster", "etcd_unavailable"]


def etcd_unavailable() -> str | None:
    """Why no local etcd cluster can be started here (``None``: it can)."""
    if shutil.which("etcd") is None:
        return "no etcd binary (apt-get install etcd-server)"
    try:
        import etcd3gw  # noqa: F401
    except ImportError:
        return "no etcd3gw package (pip install 'sparsecomm[etcd]')"
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class EtcdCluster:
    """``members`` etcd processes forming one cluster on 127.0.0.1.

    Args:
        members: Cluster size (3 survives the loss of one).
        workdir: Where the logs go (the data directories go to ``/dev/shm`` when it exists).
        timeout: How long to wait for the cluster to be healthy.
    """

    def __init__(self, members: int = 3, workdir: Path | None = None, timeout: float = 30.0) -> None:
        why = etcd_unavailable()
        if why is not None:
            raise RuntimeError(why)
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="etcd-"))
        shm = Path("/dev/shm")
        self._data = Path(tempfile.mkdtemp(prefix="sparsecomm-etcd-", dir=shm if shm.is_dir() else None))
        ports = _free_ports(2 * members)
        self.client_ports, peer_ports = ports[:members], ports[members:]
        names = [f"m{i}" for i in range(members)]
        initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(names, peer_ports, strict=True))
        token = f"sparsecomm-{time.monotonic_ns()}"
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            for name, cport, pport in zip(names, self.client_ports, peer_ports, strict=True):
                argv = ["etcd", "--name", name, "--data-dir", str(self._data / name)]
                argv += ["--listen-client-urls", f"http://127.0.0.1:{cport}"]
                argv += ["--advertise-client-urls", f"http://127.0.0.1:{cport}"]
                argv += ["--listen-peer-urls", f"http://127.0.0.1:{pport}"]
                argv += ["--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}"]
                argv += ["--initial-cluster", initial, "--initial-cluster-token", token]
                argv += ["--auto-compaction-mode", "revision", "--auto-compaction-retention", "10000"]
                log = open(self.workdir / f"etcd-{name}.log", "wb")  # noqa: SIM115 - the process owns it
                self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
                log.close()
            self.wait_healthy(timeout)
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        """``etcd://`` address of every member."""
        return "etcd://" + ",".join(f"127.0.0.1:{p}" for p in self.client_ports)

    def healthy(self, i: int) -> bool:
        """Whether member ``i`` answers that the cluster is healthy."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.client_ports[i]}/health", timeout=1) as resp:
                return b'"true"' in resp.read()
        except OSError:
            return False

    def wait_healthy(self, timeout: float) -> None:
        """Wait until every live member reports a healthy cluster (``TimeoutError`` after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        live = [i for i, p in enumerate(self.procs) if p.poll() is None]
        while not all(self.healthy(i) for i in live):
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd cluster not healthy within {timeout:g} s (logs in {self.workdir})")
            time.sleep(0.1)

    def kill(self, i: int) -> None:
        """SIGKILL member ``i``."""
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()

    def close(self) -> None:
        """Kill every member and remove the data directories."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()
        shutil.rmtree(self._data, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
