"""Run a module-level function on N local OS processes with real gloo.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes through
:func:`bindings.spawn.run_local`, initializes ``sparsecomm.distributed`` in
each over a fresh FileStore, calls ``fn(rank, world_size, *args)`` and
returns the results in rank order. A hard wall-clock deadline bounds the
whole run; on failure the message carries every failing rank's traceback,
the ranks that never reported, and the exit codes of ranks that died.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from bindings.spawn import LocalRunError, run_local

if TYPE_CHECKING:
    import pytest

__all__ = ["run_ranks", "RanksFailed", "PRELOAD", "case_on_rank", "build_outcome", "clear_launcher_env"]

#: Imported once by the fork server the test processes start from (bindings.spawn), not by every process:
#: the ranks of run_ranks, and the workers of every launcher the tests start (tests/conftest.py).
PRELOAD = (
    "sparsecomm.distributed",
    "resilient_comm",
    "optim",
    "optim.resilient.loop",
    "optim.apps.train_job.train",
    "optim.testing.hosts",
    "pytest",
    "hypothesis",
    "tests.dist.harness",
)


class RanksFailed(AssertionError):
    """One or more ranks failed, hung or died."""


def _init_then_call(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    init_method: str | None,
    backend: str,
    op_timeout_s: float,
    init_kwargs: dict[str, Any],
    args: tuple[Any, ...],
) -> Any:
    import torch

    torch.set_num_threads(1)
    import sparsecomm.distributed as dist

    if init_method is not None:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=op_timeout_s),
            **init_kwargs,
        )
    try:
        return fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    backend: str = "gloo",
    init: bool = True,
    op_timeout: float | None = None,
    init_kwargs: dict[str, Any] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes.

    Args:
        fn: A module-level (picklable) function.
        world_size: Number of processes.
        *args: Extra picklable arguments.
        timeout: Hard deadline in seconds for the whole run.
        backend: Backend of the default group.
        init: Initialize the default group before calling ``fn``.
        op_timeout: Timeout of the group's collectives (default: ``timeout``).
        init_kwargs: Extra keyword arguments of ``init_process_group``.

    Returns:
        ``fn``'s return values, by rank.

    Raises:
        RanksFailed: A rank raised, died, or the deadline passed.
    """
    with tempfile.TemporaryDirectory(prefix="sc-ranks-") as tmp:
        init_method = f"file://{os.path.join(tmp, 'store')}" if init else None
        try:
            return run_local(
                _init_then_call,
                world_size,
                fn,
                init_method,
                backend,
                op_timeout or timeout,
                dict(init_kwargs or {}),
                args,
                timeout=timeout,
                preload=PRELOAD,
            )
        except LocalRunError as exc:
            raise RanksFailed(str(exc)) from None


def case_on_rank(case: str, rank: int) -> str:
    """The bad-input case ``rank`` builds: ``one-rank-CASE`` is ``CASE`` on rank 1 and no case (``""``) elsewhere."""
    mine = case if rank == 1 or not case.startswith("one-rank-") else ""
    return mine.removeprefix("one-rank-")


def build_outcome(build: Callable[[], object]) -> str:
    """Call ``build``: ``"built"``, or the ``TypeError`` / ``ValueError`` it raised as ``"Kind: message"``."""
    try:
        build()
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "built"


#: The variables by which a launcher (torchrun, mpirun, Slurm) tells a process its rank.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def clear_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset the launcher's rank variables: a job then spawns its own ranks, even when pytest runs under a launcher."""
    for var in _LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
