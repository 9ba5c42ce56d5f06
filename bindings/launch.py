"""Launch-environment detection: torchrun, Open MPI, MPICH / Hydra, Slurm.

Each launcher is a small plug-in class (a :class:`LaunchDetector`) that says
whether its environment variables are present and, if so, reads rank,
world size and the rendezvous address. :func:`detect_launch` returns the
first match. Explicit arguments always win over what is detected.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "LaunchInfo",
    "LaunchDetector",
    "TorchrunDetector",
    "OpenMPIDetector",
    "MPICHDetector",
    "SlurmDetector",
    "DETECTORS",
    "detect_launch",
    "first_slurm_host",
    "DEFAULT_MASTER_PORT",
]

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchInfo:
    """What a launcher told this process."""

    launcher: str
    """Name of the launcher that was detected."""
    rank: int
    """Global rank of this process."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank of this process on its node."""
    master_addr: str | None
    """Rendezvous host (``MASTER_ADDR`` or derived), if known."""
    master_port: int
    """Rendezvous port (``MASTER_PORT`` or :data:`DEFAULT_MASTER_PORT`)."""


class LaunchDetector(Protocol):
    """A plug-in that recognises one launcher from the environment."""

    name: str

    def is_present(self, env: Mapping[str, str]) -> bool:
        """Return whether this launcher started the process."""
        ...

    def read(self, env: Mapping[str, str]) -> LaunchInfo:
        """Read the launch facts (only called when :meth:`is_present`)."""
        ...


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None:
        if default is None:
            raise ValueError(f"environment variable {key} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None


def _port(env: Mapping[str, str]) -> int:
    return _int(env, "MASTER_PORT", DEFAULT_MASTER_PORT)


class _RankVarsDetector:
    """A launcher that sets rank and world size in two variables of its own (local rank in a third).

    The rendezvous address is ``MASTER_ADDR``, if set. Subclasses name the variables.
    """

    name: str
    rank_var: str
    size_var: str
    local_var: str

    def is_present(self, env: Mapping[str, str]) -> bool:
        return self.rank_var in env and self.size_var in env

    def _local_rank(self, env: Mapping[str, str]) -> int:
        return _int(env, self.local_var, 0)

    def read(self, env: Mapping[str, str]) -> LaunchInfo:
        return LaunchInfo(
            launcher=self.name,
            rank=_int(env, self.rank_var),
            world_size=_int(env, self.size_var),
            local_rank=self._local_rank(env),
            master_addr=env.get("MASTER_ADDR"),
            master_port=_port(env),
        )


class TorchrunDetector(_RankVarsDetector):
    """torchrun / torch.distributed.run (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``)."""

    name = "torchrun"
    rank_var, size_var, local_var = "RANK", "WORLD_SIZE", "LOCAL_RANK"


class OpenMPIDetector(_RankVarsDetector):
    """Open MPI's mpirun / prterun (``OMPI_COMM_WORLD_*``)."""

    name = "openmpi"
    rank_var, size_var, local_var = "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"


class MPICHDetector(_RankVarsDetector):
    """MPICH / Intel MPI Hydra (``PMI_RANK``, ``PMI_SIZE``)."""

    name = "mpich"
    rank_var, size_var, local_var = "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"

    def _local_rank(self, env: Mapping[str, str]) -> int:
        local = env.get("MPI_LOCALRANKID", env.get("PMI_LOCAL_RANK", "0"))
        return _int({"x": local}, "x")


_BRACKET = re.compile(r"^([^\[,]+)\[([^\]]+)\]")


def first_slurm_host(nodelist: str) -> str:
    """Return the first host of a Slurm node list such as ``gpu[003-007,010],cpu1``."""
    nodelist = nodelist.strip()
    if not nodelist:
        raise ValueError("empty Slurm node list")
    m = _BRACKET.match(nodelist)
    if m:
        prefix, ranges = m.groups()
        first = ranges.split(",")[0].split("-")[0]
        return prefix + first
    return nodelist.split(",")[0]


class SlurmDetector:
    """Slurm's srun (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_STEP_NODELIST``)."""

    name = "slurm"

    def is_present(self, env: Mapping[str, str]) -> bool:
        return "SLURM_PROCID" in env and ("SLURM_NTASKS" in env or "SLURM_STEP_NUM_TASKS" in env)

    def read(self, env: Mapping[str, str]) -> LaunchInfo:
        size_key = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        addr = env.get("MASTER_ADDR")
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if addr is None and nodes:
            addr = first_slurm_host(nodes)
        return LaunchInfo(
            launcher=self.name,
            rank=_int(env, "SLURM_PROCID"),
            world_size=_int(env, size_key),
            local_rank=_int(env, "SLURM_LOCALID", 0),
            master_addr=addr,
            master_port=_port(env),
        )


#: Detectors in the order they are tried. torchrun comes first: its variables
#: are the most specific (torchrun under srun sets both).
DETECTORS: tuple[LaunchDetector, ...] = (
    TorchrunDetector(),
    OpenMPIDetector(),
    MPICHDetector(),
    SlurmDetector(),
)


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo | None:
    """Return the launch facts of the first detector that recognises ``env``.

    Args:
        env: Environment to inspect; defaults to ``os.environ``.

    Returns:
        The facts, or ``None`` when no known launcher started this process.

    Raises:
        ValueError: A launcher's variables are present but malformed.
    """
    env = os.environ if env is None else env
    for det in DETECTORS:
        if det.is_present(env):
            info = det.read(env)
            if info.world_size < 1 or not 0 <= info.rank < info.world_size:
                raise ValueError(f"{det.name}: rank {info.rank} / world size {info.world_size} are inconsistent")
            return info
    return None
