"""Run a module-level function on N spawned OS processes with real gloo.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes (spawn
context), initializes ``sparsecomm.distributed`` with gloo in each over a
fresh FileStore, calls ``fn(rank, world_size, *args)`` and returns the
results in rank order. A hard wall-clock deadline bounds the whole run; on
failure the message carries every failing rank's traceback, the ranks that
never reported, and the exit codes of ranks that died.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["run_ranks", "RanksFailed"]


class RanksFailed(AssertionError):
    """One or more ranks failed, hung or died."""


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_method: str | None,
    backend: str,
    timeout_s: float,
    args: tuple[Any, ...],
    results: Any,
    init_kwargs: dict[str, Any],
) -> None:
    import torch

    torch.set_num_threads(1)
    import sparsecomm.distributed as dist

    try:
        if init_method is not None:
            dist.init_process_group(
                backend,
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
                **init_kwargs,
            )
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        results.put((rank, "err", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


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
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

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
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="sc-ranks-") as tmp:
        init_method = f"file://{os.path.join(tmp, 'store')}" if init else None
        procs = [
            ctx.Process(
                target=_child,
                args=(
                    fn, r, world_size, init_method, backend, op_timeout or timeout, args, results,
                    dict(init_kwargs or {}),
                ),
                name=f"rank{r}",
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        outcome: dict[int, tuple[str, Any]] = {}
        first_error_at: float | None = None
        try:
            while len(outcome) < world_size:
                now = time.monotonic()
                if now > deadline:
                    break
                # After one rank failed, give the others a moment to report, then stop.
                if first_error_at is not None and now > first_error_at + 5.0:
                    break
                try:
                    rank, status, value = results.get(timeout=0.2)
                    outcome[rank] = (status, value)
                    if status == "err" and first_error_at is None:
                        first_error_at = time.monotonic()
                except queue.Empty:
                    dead = [
                        r for r, p in enumerate(procs)
                        if r not in outcome and p.exitcode is not None
                    ]
                    if dead and first_error_at is None:
                        first_error_at = time.monotonic()
        finally:
            killed = set()
            for r, p in enumerate(procs):
                if p.is_alive():
                    killed.add(r)
                    p.kill()
            for p in procs:
                p.join(timeout=10)
            results.close()

    problems = []
    for r in range(world_size):
        if r in outcome:
            status, value = outcome[r]
            if status == "err":
                problems.append(f"--- rank {r} raised:\n{value}")
        else:
            if r in killed:
                why = (
                    f"hung: still running after the {timeout:g} s deadline"
                    if first_error_at is None
                    else "was still running when another rank failed (killed)"
                )
            else:
                why = f"exited with code {procs[r].exitcode} without reporting"

            problems.append(f"--- rank {r} {why}")
    if problems:
        raise RanksFailed(
            f"{getattr(fn, '__name__', fn)} on {world_size} ranks failed:\n" + "\n".join(problems)
        )
    return [outcome[r][1] for r in range(world_size)]
