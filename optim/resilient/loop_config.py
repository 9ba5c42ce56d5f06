"""The settings and plug-in types of :class:`optim.resilient.ResilientTraining`: its config, the event hook and
the error of too many bad steps (the state protocol, :class:`Stateful`, is :mod:`optim.state.training_state`'s)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from bindings.json_object import JsonObject
from bindings.validate import check_bool, check_float, check_int
from optim.state.training_state import Stateful

__all__ = ["BadStepsError", "EventHook", "ResilientConfig", "Stateful"]


class BadStepsError(RuntimeError):
    """More consecutive steps had a non-finite loss or gradient than ``ResilientConfig.max_bad_steps`` allows."""


#: ``on_event(name, fields)``: a hook for the job's own event log.
EventHook = Callable[[str, JsonObject], None]


@dataclass(frozen=True, kw_only=True)
class ResilientConfig:
    """How :class:`ResilientTraining` protects the run.

    Attributes:
        timeout: Deadline of every collective and of the snapshot copy.
        snapshots: Keep in-memory snapshots replicated to a buddy (off: a
            failure restarts the run from step 1, which is still exact).
        snapshot_block: Benchmarks only: when > 0, snapshots alternate in blocks
            of this many steps with a snapshot, then as many without, starting
            with snapshots at step 1. 0: a snapshot after every committed step.
        max_bad_steps: Consecutive steps with a non-finite loss or gradient
            that are skipped (rolled back, their batch skipped); the next one
            raises :class:`BadStepsError`. 0: the first one raises.
        checkpoint_dir: Also write persistent checkpoints there
            (:mod:`optim.state.checkpoint`): every ``checkpoint_every`` committed
            steps, each slot writes the snapshot it already took, on a
            background writer thread, atomically; the newest ``keep_checkpoints``
            complete steps are kept. Needs ``snapshots``.
        checkpoint_every: Committed steps between persistent checkpoints (> 0
            with ``checkpoint_dir``).
        keep_checkpoints: Complete checkpoint steps to keep (>= 1).
        full_checkpoint_every: Each slot writes a full checkpoint at least every
            this many checkpoints and, between them, only what changed since its
            previous one (lossless; 1: every checkpoint full).
        lossy_checkpoints: Full checkpoints keep the sharded optimizers' first
            moment in bfloat16 (:mod:`optim.state.lossy`; deltas stay lossless): smaller
            files, and a resume from them is close to the run, not bit-identical.
        straggler_factor: A rank whose compute time (step entry to
            ``optimizer_step``) stays more than this many times the others'
            over ``straggler_window`` steps is a straggler (:mod:`optim.resilient.step_health`):
            rank 0 asks the coordinator to replace it by a spare, which happens
            when a spare is free (hot-swap; a straggler event either way). 0: off.
        straggler_window: Steps a straggler verdict is judged over (>= 3).
        max_rejoins: Times this process, declared failed while alive (cut off
            past the heartbeat timeout, hung, or replaced as a straggler),
            registers again as a spare and waits to be given a slot; past
            that it leaves the job with :class:`~resilient_comm.StaleEpochError`.
        resume: Start from the newest complete checkpoint in ``checkpoint_dir``
            (the same world size; every member checks every field and digest
            first, and all raise :class:`~optim.state.checkpoint.CheckpointError` when
            one cannot load its slot).
    """

    timeout: timedelta = timedelta(seconds=60)
    snapshots: bool = True
    snapshot_block: int = 0
    max_bad_steps: int = 3
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    full_checkpoint_every: int = 8
    lossy_checkpoints: bool = False
    straggler_factor: float = 3.0
    straggler_window: int = 20
    max_rejoins: int = 3
    resume: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.timeout, timedelta) or self.timeout.total_seconds() <= 0:
            raise ValueError(f"timeout: must be a positive datetime.timedelta, got {self.timeout!r}")
        check_bool("snapshots", self.snapshots)
        check_int("snapshot_block", self.snapshot_block, low=0)
        check_int("max_bad_steps", self.max_bad_steps, low=0)
        every = check_int("checkpoint_every", self.checkpoint_every, low=0)
        check_int("keep_checkpoints", self.keep_checkpoints, low=1)
        check_int("full_checkpoint_every", self.full_checkpoint_every, low=1)
        check_bool("lossy_checkpoints", self.lossy_checkpoints)
        if 0 < check_float("straggler_factor", self.straggler_factor, low=0.0, finite=False) <= 1:
            raise ValueError(f"Invalid straggler_factor: {self.straggler_factor!r} (must be 0 (off) or > 1)")
        check_int("straggler_window", self.straggler_window, low=3)
        check_int("max_rejoins", self.max_rejoins, low=0)
        check_bool("resume", self.resume)
        if self.checkpoint_dir is None:
            if every or self.resume:
                raise ValueError("checkpoint_every and resume need a checkpoint_dir")
        else:
            if not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir:
                raise TypeError(f"checkpoint_dir: must be a non-empty str path, got {self.checkpoint_dir!r}")
            if every == 0 and not self.resume:
                raise ValueError("checkpoint_dir: set checkpoint_every > 0 (or resume=True)")
            if not self.snapshots:
                raise ValueError(
                    "checkpoint_dir: persistent checkpoints are written from the snapshots (snapshots=True)"
                )
            if self.snapshot_block:
                raise ValueError("checkpoint_dir: not with snapshot_block (a benchmark setting)")

    def snapshots_at(self, step: int) -> bool:
        """Whether the state after ``step`` is snapshotted."""
        block = self.snapshot_block
        return self.snapshots and (block == 0 or ((step - 1) // block) % 2 == 0)
