"""The state of a :class:`optim.resilient.ResilientTraining` run and its recovery after a failure.

:class:`RecoverableRun` is the half of the loop that is not the step: it builds
the optimizer (and scheduler) over the model, says what a snapshot of the run
holds (:mod:`optim.state.training_state`), starts the run (a first epoch, a
promotion, or a resume from persistent checkpoints) and, after a peer failure,
moves the survivors to the next epoch and restores the newest step every slot
still holds: from the in-memory snapshots of the slot and its buddy
(:class:`~optim.state.restore.SlotSnapshots`), re-sharded when the world shrank,
or from the newest complete checkpoint when no copy of some slot is left.
The step itself, its vote and its bad-step and straggler checks are
:mod:`optim.resilient.loop`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.optim.optimizer import StateDict

import sparsecomm.distributed as dist
from bindings.errors import PeerFailureError
from bindings.json_object import JsonObject
from optim.optimizers.capabilities import StateLayout, capabilities
from optim.resilient.loop_config import EventHook, ResilientConfig, Stateful
from optim.resilient.step_health import StragglerDetector
from optim.state import training_state as ts
from optim.state.checkpoint import CheckpointError, CheckpointStore, model_fingerprint, read_newest
from optim.state.reshard import gather_full_state, restore_resharded
from optim.state.restore import SlotSnapshots
from optim.state.snapshot import UnrecoverableStateError
from resilient_comm import FaultAwareCommunicator, Reconfiguration, StaleEpochError

__all__ = ["RecoverableRun", "RecoveryPhases", "RecoveryRecord"]

logger = logging.getLogger(__name__)


class _Laps:
    """A stopwatch: :meth:`lap` is the time since the previous lap (or the start), :meth:`total` since the start."""

    def __init__(self) -> None:
        self._start = self._last = time.monotonic()

    def lap(self) -> float:
        now = time.monotonic()
        took, self._last = now - self._last, now
        return took

    def total(self) -> float:
        return time.monotonic() - self._start


@dataclass(frozen=True, kw_only=True)
class RecoveryPhases:
    """How long each phase of one recovery took, in seconds; each is its own duration, in this order.

    Attributes:
        stop_replication_s: Stopping the replication of the failed epoch.
        agree_s: Agreeing on the step to restore (or finding the newest complete checkpoint).
        transfer_s: Moving the lost slots' copies to their new holders (zero where nothing moves).
        restore_s: Loading the state into the model and optimizer.
        replication_s: Snapshotting the restored state and replicating it to the buddies.
    """

    stop_replication_s: float
    agree_s: float
    transfer_s: float
    restore_s: float
    replication_s: float


@dataclass(frozen=True, kw_only=True)
class RecoveryRecord:
    """One recovery of a :class:`~optim.resilient.ResilientTraining` process.

    Attributes:
        restore_step: The step restored (``0``: the initial state; ``-1``: none, snapshots off).
        recover_s: The whole recovery, the sum of :attr:`phases`.
        steps_recomputed: Committed steps after ``restore_step`` that run again.
        from_disk: Whether the state came from a persistent checkpoint.
        epoch: The epoch the recovery ran in.
        world_size: That epoch's world size.
        rank: This process's rank in it.
        phases: The phases' durations.
    """

    restore_step: int
    recover_s: float
    steps_recomputed: int
    from_disk: bool
    epoch: int
    world_size: int
    rank: int
    phases: RecoveryPhases

    def to_json(self) -> JsonObject:
        """The record as JSON-ready fields (the ``restored`` event's, a result file's)."""
        return asdict(self)


class RecoverableRun:
    """A run's model, optimizer and history, how they are snapshotted, and how they come back after a failure.

    The base of :class:`optim.resilient.ResilientTraining`, which documents the
    arguments. Every method that restores state is collective over the members
    of the current epoch.

    Raises:
        TypeError: A bad argument.
        CheckpointError: ``resume`` without a checkpoint directory, or one that cannot be written.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
        *,
        scheduler: Callable[[torch.optim.Optimizer], Stateful] | None,
        state: Mapping[str, Stateful] | None,
        config: ResilientConfig | None,
        communicator: FaultAwareCommunicator | None,
        on_event: EventHook | None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if not callable(optimizer):
            raise TypeError("optimizer: expected a callable that builds the optimizer from the model")
        if scheduler is not None and not callable(scheduler):
            raise TypeError("scheduler: expected a callable that builds the scheduler from the optimizer")
        state = dict(state or {})
        for name, obj in state.items():
            if not isinstance(name, str) or not isinstance(obj, Stateful):
                raise TypeError(f"state[{name!r}]: expected a str name and an object with state_dict/load_state_dict")
        self.config = config if config is not None else ResilientConfig()
        if not isinstance(self.config, ResilientConfig):
            raise TypeError(f"config: expected a ResilientConfig, got {type(self.config).__name__}")
        self.model, self._factory, self._sched_factory, self._state = model, optimizer, scheduler, state
        self._on_event = on_event
        # torch imports its compiler stack lazily on the first optimizer built (about 1 s): pay it now,
        # not while every member waits for a promoted spare to rebuild its optimizer.
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        # the initial state (step 0) is rebuilt from these on every slot: no snapshot of it is needed
        self._init_model = {k: v.clone() for k, v in model.state_dict().items()}
        self._init_rng = torch.get_rng_state()
        self._init_state = {name: ts.copy_tensors(obj.state_dict()) for name, obj in state.items()}
        if communicator is None:
            cfg = self.config
            communicator = FaultAwareCommunicator.connect(
                timeout=cfg.timeout, side_channel=cfg.snapshots, max_rejoins=cfg.max_rejoins
            )
            dist.init_process_group(communicator=communicator)
        self.comm = communicator
        self._store: CheckpointStore | None = None
        if (cfg := self.config).checkpoint_dir is not None:
            self._store = CheckpointStore(
                cfg.checkpoint_dir, cfg.keep_checkpoints, cfg.full_checkpoint_every, lossy=cfg.lossy_checkpoints
            )
            if cfg.resume and not self._store.path.is_dir():
                raise CheckpointError(f"resume: no checkpoint directory {self._store.path}")
            if cfg.checkpoint_every:
                self._store.check_writable()
        self._fingerprint = ""
        self._opt: Any = None
        self._sched: Stateful | None = None
        self._snaps = SlotSnapshots(self.comm, self.config.timeout)
        self._stragglers = StragglerDetector(factor=cfg.straggler_factor, window=cfg.straggler_window)
        self._next, self._total = 1, 0  # the next step to run, and the run's length (set by steps())
        self.losses: dict[int, float] = {}
        self.skipped: list[int] = []
        """Steps skipped because a loss or gradient was not finite (committed, with no optimizer step)."""
        self._bad_run = 0  # skipped steps in a row, up to the newest committed one
        self.recoveries: list[RecoveryRecord] = []
        """One record per recovery of this process, oldest first."""

    def _event(self, name: str, **fields: Any) -> None:
        logger.debug("%s %s", name, fields)
        if self._on_event is not None:
            self._on_event(name, fields)

    # ------------------------------------------------------------------ checkpoints
    def _resume(self) -> int:
        """Start from the newest complete checkpoint (``resume=True``); return its step. Collective."""
        step = self._load_checkpoint()
        self._event("resumed", step=step, path=str(self._store.path if self._store else ""))
        return step

    def _load_checkpoint(self) -> int:
        """Load the newest complete checkpoint on every member; return its step. Collective.

        A checkpoint of another world size is re-sharded (a resume on another
        number of workers, or a shrink that lost every in-memory copy of a
        slot): the sharded optimizers' state is assembled from every old
        slot's file and cut for the new layout
        (SCAPE makes its masks again from it, as a shrink does); a replica
        (LocalAdamS, TopKAdamS, plain torch optimizers) and the model's
        buffers, RNG and history come from old slot ``rank % old world``.

        Raises:
            CheckpointError: On every member: no complete checkpoint, members that see different
                ones, or a slot file that cannot be loaded (missing, truncated, corrupted, foreign).
        """
        store = self._store
        assert store is not None
        self._build()  # on every member (collective for the sharded optimizers): the fingerprint names it
        ws, rank = self.comm.world_size, self.comm.rank
        opt = self._opt
        sharded = capabilities(opt).layout is StateLayout.SHARDED
        newest, old_ws, trees = read_newest(store, rank, ws, self._fingerprint, shares=sharded)
        reshard = old_ws != ws
        own_old = rank % old_ws
        wanted = [s for s in range(old_ws) if s % ws == rank] if reshard and sharded else []
        if not reshard:
            self._restore(trees[own_old])
            return newest
        logger.info("re-sharding the checkpoint of step %d from %d slots onto %d", newest, old_ws, ws)
        if not sharded:
            self._restore_replica(trees[own_old])
            return newest
        restore_resharded(opt, newest, gather_full_state(opt, [(s, trees[s]) for s in wanted], old_ws))
        self._load_common(trees[own_old])
        return newest

    # ------------------------------------------------------------------ start
    def _start(self) -> None:
        comm = self.comm
        if comm.view is None:
            change = comm.wait_for_promotion()
            if change is None:
                return
            self._event("promoted", epoch=change.epoch, rank=change.rank)
            self._next = self._recover_until_ok(change)
            return
        self._event("joined", epoch=comm.epoch, rank=comm.rank, world_size=comm.world_size)
        try:
            if self.config.resume:
                start = self._resume()  # builds the optimizer too
            else:
                self._build()
                start = 0
            self._snaps.put(start, self._tree(start))
            self._snaps.start_replication(start, ts.snapshot_headroom(self._opt, self._total))
            self._next = start + 1
        except PeerFailureError as exc:  # a member died before step 1: recover like at any step
            self._event("failed", step=0, epoch=comm.epoch, error=str(exc)[:200])
            self._next = self._recover_until_ok(self._reconfigure())

    # ------------------------------------------------------------------ state
    def _tree(self, step: int) -> StateDict:
        history = (self.losses, self.skipped, self._bad_run)
        return ts.snapshot_tree(step, self.model, self._opt, self._sched, self._state, history)

    def _load_common(self, tree: StateDict) -> None:
        self.losses, self.skipped, self._bad_run = ts.load_common(tree, self.model, self._opt, self._sched, self._state)

    def _build(self) -> None:
        """(Re)build the optimizer and the scheduler over the model."""
        if self._opt is not None and hasattr(self._opt, "abandon"):
            self._opt.abandon()
        self._opt = self._factory(self.model)
        if not isinstance(self._opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer factory: expected a torch.optim.Optimizer, got {type(self._opt).__name__}")
        self._fingerprint = model_fingerprint(self.model, self._opt)
        self._sched = self._sched_factory(self._opt) if self._sched_factory is not None else None

    def _restore_replica(self, tree: StateDict) -> None:
        """Load a whole replica (a replicated or plain optimizer's) into the optimizer just built."""
        ts.load_replica(self.model, self._opt, tree["optim"])
        self._load_common(tree)

    def _restore(self, tree: StateDict | None) -> None:
        """Rebuild the optimizer and load ``tree`` (``None``: the initial state). Collective."""
        if tree is None:
            self.skipped, self._bad_run = [], 0
            self.model.load_state_dict(self._init_model)
            torch.set_rng_state(self._init_rng)  # as after the model's initialisation in the first epoch
            for name, obj in self._state.items():
                obj.load_state_dict(self._init_state[name])
            self._build()
            return
        self._build()
        ts.load_snapshot(self.model, self._opt, tree["optim"])
        self._load_common(tree)

    # ------------------------------------------------------------------ recovery
    def _reconfigure(self) -> Reconfiguration | None:
        """The next epoch; for a member evicted while alive, the epoch that promotes it again (``None``: the job
        ended without needing it). Collective over the survivors."""
        try:
            return self.comm.reconfigure()
        except StaleEpochError as exc:
            if not exc.rejoined:
                raise
            self._event("rejoined", member=self.comm.member, error=str(exc)[:200])
        self._snaps.stop()
        self._snaps.clear()  # a spare again: what it held belongs to an epoch that is gone
        self._stragglers.reset()
        if self._opt is not None and hasattr(self._opt, "abandon"):
            self._opt.abandon()
        change = self.comm.wait_for_promotion()
        if change is not None:
            self._event("promoted", epoch=change.epoch, rank=change.rank)
        return change

    def _recover_until_ok(self, change: Reconfiguration | None) -> int:
        while change is not None:
            try:
                return self._recover(change)
            except PeerFailureError as exc:  # another failure during recovery: next epoch
                self._event("failed", step=-1, epoch=self.comm.epoch, error=str(exc)[:200])
                change = self._reconfigure()
        return self._next  # a spare again when the job ended: steps() yields no more

    def _recover(self, change: Reconfiguration | None) -> int:
        """Agree on the restore step, move lost snapshots, restore. Returns the next step. Collective."""
        laps = _Laps()
        self._snaps.stop()
        self._stragglers.reset()
        if self._store is not None:
            self._store.forget()  # the first checkpoint after a recovery is full: it builds on no older file
        stop_replication_s = laps.lap()
        last = max(self.losses) if self.losses else 0
        shrunk = change is not None and len(change.lost_slots) > len(change.promoted)
        try:
            plan, old_slot = self._snaps.agree(change, self.config.snapshots)
        except UnrecoverableStateError as exc:
            # no copy of some slot is left in memory: the newest persistent checkpoint every slot has
            if self._store is None:
                raise
            logger.warning("%s: restoring the newest complete checkpoint in %s", exc, self._store.path)
            restore_step = self._load_checkpoint()
            disk = True
        else:
            restore_step, disk = plan.step, False
            if restore_step == 0 and self.config.resume:  # a failure before the resumed run's first snapshot:
                restore_step, disk = self._load_checkpoint(), True  # its initial state is the checkpoint
        agree_s = laps.lap()
        transfer_s = 0.0
        recomputed = max(0, last - restore_step) if restore_step >= 0 else last
        if disk:
            transfer_s = laps.lap()
        elif shrunk and restore_step > 0:
            self._build()  # every member, a promoted spare too: the kind of optimizer picks the way
            opt = self._opt
            if capabilities(opt).layout is not StateLayout.SHARDED:
                # every survivor holds a whole replica: it goes on from its own (the lost ones' drift is dropped)
                own = self._snaps.own_tree(restore_step)
                transfer_s = laps.lap()
                self._restore_replica(own)
            else:
                held = self._snaps.held_trees(restore_step, old_slot, plan)
                full = gather_full_state(opt, held, plan.old_world)
                transfer_s = laps.lap()
                restore_resharded(opt, restore_step, full)
                if old_slot >= 0:
                    self._load_common(held[0][1])
        else:
            tree: StateDict | None = None
            if restore_step > 0:  # 0: the initial state, rebuilt from the seed (no snapshot needed)
                tree = self._snaps.fetch(restore_step, old_slot, plan)
            transfer_s = laps.lap()
            self._restore(tree)
        for p in self.model.parameters():
            p.grad = None  # a failed step's gradients must not reach the step run again
        restore_s = laps.lap()
        self._snaps.clear()
        self._snaps.put(max(restore_step, 0), self._tree(max(restore_step, 0)))
        self._snaps.start_replication(max(restore_step, 0), ts.snapshot_headroom(self._opt, self._total))
        # every slot is protected again before the next step: the restored state is on its buddy
        self._snaps.drain()
        replication_s = laps.lap()
        for s in [s for s in self.losses if s > restore_step]:
            del self.losses[s]
        rec = RecoveryRecord(
            restore_step=restore_step,
            recover_s=laps.total(),
            steps_recomputed=recomputed,
            from_disk=disk,
            epoch=self.comm.epoch,
            world_size=self.comm.world_size,
            rank=self.comm.rank,
            phases=RecoveryPhases(
                stop_replication_s=stop_replication_s,
                agree_s=agree_s,
                transfer_s=transfer_s,
                restore_s=restore_s,
                replication_s=replication_s,
            ),
        )
        self.recoveries.append(rec)
        self._event("restored", **rec.to_json())
        return max(restore_step, 0) + 1  # no snapshot (-1): start again at step 1, as the first epoch did
