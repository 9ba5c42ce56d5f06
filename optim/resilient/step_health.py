"""What every rank reports about its step, and what the members decide from it: bad steps and stragglers.

:func:`exchange_step_reports` is the one all-reduce of
:meth:`optim.resilient.ResilientTraining.optimizer_step`: it carries the
loss and, per rank, whether its loss or gradients were finite, whether its
last checkpoint write failed, and its *compute time* (from entering the
step to calling ``optimizer_step``: data, forward, backward; the time a rank
spends before it first waits on the others). Every member gets the same
numbers, so every decision taken on them is the same everywhere.

A *straggler* is a rank whose compute time is persistently far above the
others' (:class:`StragglerDetector`): a process that loses the CPU for a
large share of each step, a slow host. In synchronous data parallelism the
whole job runs at its pace, so it is worth a replacement when a spare is
free (:meth:`resilient_comm.FaultAwareCommunicator.report_straggler`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch

import sparsecomm.distributed as dist
from bindings.validate import check_float, check_int

__all__ = ["StepReports", "StragglerDetector", "exchange_step_reports"]


@dataclass(frozen=True, kw_only=True)
class StepReports:
    """Every rank's report on one step (the same on every member).

    Attributes:
        mean_loss: The rank-averaged loss (non-finite losses count as 0).
        bad_ranks: Ranks whose loss or gradients were not finite.
        failed_writes: Ranks whose last persistent checkpoint write failed.
        compute_s: Each rank's compute time of the step, seconds.
    """

    mean_loss: float
    bad_ranks: list[int]
    failed_writes: list[int]
    compute_s: list[float]


def exchange_step_reports(loss: float, bad: bool, write_failed: bool, compute_s: float) -> StepReports:
    """Share this rank's report with every rank (one all-reduce). Collective: every rank must call this."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    # [loss, per rank: a NaN or Inf, a failed write, compute seconds]; averaged, a rank's own entry * ws
    buf = torch.zeros(1 + 3 * ws, dtype=torch.float64)
    buf[0] = loss if math.isfinite(loss) else 0.0
    buf[1 + rank] = 1.0 if bad else 0.0
    buf[1 + ws + rank] = 1.0 if write_failed else 0.0
    buf[1 + 2 * ws + rank] = compute_s
    dist.all_reduce(buf, op=dist.ReduceOp.AVG)
    flags = buf.tolist()
    return StepReports(
        mean_loss=flags[0],
        bad_ranks=[r for r in range(ws) if flags[1 + r] > 0.0],
        failed_writes=[r for r in range(ws) if flags[1 + ws + r] > 0.0],
        compute_s=[flags[1 + 2 * ws + r] * ws for r in range(ws)],
    )


class StragglerDetector:
    """Finds a rank whose compute time stays far above the others' (pure logic: feed it every step).

    A rank is a straggler when, over the last ``window`` steps, the median of
    its compute times is more than ``factor`` times the median of the other
    ranks' medians and more than ``min_excess`` above it. After a verdict
    the history starts again (a replacement needs ``window`` new steps to
    be judged); :meth:`reset` after a change of members.

    Args:
        factor: How many times slower than the others (> 1; 0 turns detection off).
        window: Steps judged together (>= 3).
        min_excess: Absolute slack: a rank this little slower is never a straggler.

    Raises:
        ValueError: A bad setting.
    """

    def __init__(self, *, factor: float, window: int, min_excess: timedelta = timedelta(milliseconds=20)) -> None:
        if 0 < check_float("factor", factor, low=0.0, finite=False) <= 1:
            raise ValueError(f"Invalid factor: {factor!r} (must be 0 (off) or > 1)")
        check_int("window", window, low=3)
        if not isinstance(min_excess, timedelta) or min_excess.total_seconds() < 0:
            raise ValueError(f"min_excess: must be a non-negative timedelta, got {min_excess!r}")
        self.factor, self.window, self.min_excess = float(factor), window, min_excess.total_seconds()
        self._history: deque[list[float]] = deque(maxlen=window)

    def reset(self) -> None:
        """Forget the history (the members changed)."""
        self._history.clear()

    def observe(self, compute_s: list[float]) -> int | None:
        """Add one step's compute times (one per rank); return the straggler's rank, or ``None``."""
        if self.factor == 0 or len(compute_s) < 2:
            return None
        if self._history and len(self._history[0]) != len(compute_s):
            self._history.clear()
        self._history.append(list(compute_s))
        if len(self._history) < self.window:
            return None
        medians = [statistics.median(step[r] for step in self._history) for r in range(len(compute_s))]
        slow = max(range(len(medians)), key=medians.__getitem__)
        others = statistics.median(m for r, m in enumerate(medians) if r != slow)
        if medians[slow] > self.factor * others and medians[slow] - others > self.min_excess:
            self._history.clear()
            return slow
        return None
