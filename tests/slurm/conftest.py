"""A one-node Slurm cluster on this machine (munged, slurmctld, slurmd from Debian's packages), for the srun tests.

The cluster lives in a temporary directory with its own munge socket and key
copy and its own ports, so nothing of a system Slurm is touched; the daemons
are stopped when the module's tests end, whatever happened. The tests skip,
saying why, where the binaries are missing or this is not root (slurmd
launches tasks as their submitting user; the daemons run as root here).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sinfo")
MUNGE_KEY = Path("/etc/munge/munge.key")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}",) if os.access(p, os.X_OK)), None)


def _config(root: Path, host: str) -> str:
    ports = _free_port(), _free_port()
    return "\n".join(
        [
            "ClusterName=sparsecomm-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ports[0]}",
            f"SlurmdPort={ports[1]}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root}/munge/munge.socket",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool",
            f"SlurmctldPidFile={root}/run/slurmctld.pid",
            f"SlurmdPidFile={root}/run/slurmd.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log",
            f"SlurmdLogFile={root}/log/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "KillOnBadExit=0",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE",
            "",
        ]
    )


class SlurmCluster:
    """The running cluster: ``env`` has ``SLURM_CONF``; :meth:`srun` runs a job step with a hard deadline."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        self.env = env

    def srun(
        self, *args: str, timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        cmd = ["srun", "--overcommit", "--kill-on-bad-exit=0", *args]
        try:
            return subprocess.run(
                cmd, env={**self.env, **(env or {})}, cwd=cwd, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as exc:
            subprocess.run(["scancel", "--full", "--signal=KILL", "--user=root"], env=self.env, check=False)
            pytest.fail(f"srun did not finish in {timeout:.0f} s: {cmd}\n{exc.stdout}\n{exc.stderr}")

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log"):
            p = self.root / "log" / name
            if p.exists():
                out.append(f"--- {name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(out)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    missing = [b for b in BINARIES if _which(b) is None]
    if missing:
        pytest.skip(f"Slurm is not installed (missing {', '.join(missing)}; apt-get install slurmctld slurmd munge)")
    if os.geteuid() != 0:
        pytest.skip("the one-node Slurm cluster runs its daemons as root")
    if not MUNGE_KEY.exists():
        pytest.skip(f"no munge key at {MUNGE_KEY} (the munge package makes it)")
    root = tmp_path_factory.mktemp("slurm")
    for d in ("munge", "state", "spool", "run", "log"):
        (root / d).mkdir()
    (root / "munge").chmod(0o700)
    shutil.copy(MUNGE_KEY, root / "munge" / "key")
    (root / "munge" / "key").chmod(0o600)
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(_config(root, host))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs: list[subprocess.Popen[bytes]] = []
    munge = root / "munge"
    subprocess.run(
        [
            _which("munged") or "munged",
            "--force",
            f"--socket={munge}/munge.socket",
            f"--key-file={munge}/key",
            f"--pid-file={munge}/munged.pid",
            f"--log-file={munge}/munged.log",
            f"--seed-file={munge}/seed",
        ],
        check=True,
        timeout=30,
    )
    try:
        for daemon in ("slurmctld", "slurmd"):
            log = open(root / "log" / f"{daemon}.out", "wb")  # noqa: SIM115 - closed with the process
            procs.append(
                subprocess.Popen([_which(daemon) or daemon, "-D", "-f", str(conf)], env=env, stdout=log, stderr=log)
            )
        cluster = SlurmCluster(root, env)
        deadline = time.monotonic() + 60
        state = ""
        while time.monotonic() < deadline:
            r = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=10)
            state = r.stdout.strip()
            if state in ("idle", "mix", "alloc"):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the Slurm node did not come up in 60 s (state {state!r})\n{cluster.logs()}")
        yield cluster
    finally:
        subprocess.run(["scancel", "--full", "--signal=KILL", "--user=root"], env=env, check=False, capture_output=True)
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=15)
        subprocess.run(
            [_which("munged") or "munged", "--stop", f"--socket={munge}/munge.socket"], check=False, capture_output=True
        )
