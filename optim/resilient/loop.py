"""Failure-transparent training for any training loop (the DeadPool client).

A user keeps their model, data and loop, and writes the loop around
:class:`ResilientTraining`::

    import optim
    from optim.resilient.loop import ResilientTraining

    model = build_model()                      # same seed on every process, spares included
    ft = ResilientTraining(model, lambda m: optim.SCAPE(m.parameters(), lr=1e-3, density=0.01))
    for step in ft.steps(1000):                # a spare blocks here until it is promoted
        with ft.step(step):                    # everything of the step, collectives included
            x, y = batch(step, ft.rank, ft.world_size)   # data: a function of (step, slot)
            loss = loss_fn(model(x), y)
            loss.backward()
            ft.optimizer_step(loss)
    ft.finish()                                # collective: every member ends with the same model

and runs it under ``sparsecomm launch --nproc 4 --spares 1 -- python train.py``.

**What a step is, and the commit order.** The body of ``with ft.step(step)``
runs the step; on leaving it the members vote (:meth:`FaultAwareCommunicator.commit`)
and only then is the step *committed*: its loss is recorded and the state
after it is snapshotted. The optimizer step runs before the vote; its
changes, like every other change of the step, count only if the vote
commits. When a peer fails anywhere in the body (or the vote fails), the
members move to the next epoch (a spare takes the dead slot, or the world
shrinks), restore the newest step that every slot still holds, replicate
it to the buddies again (so a second failure right after finds every slot
protected), and :meth:`steps` goes on from the step after it: at most the
failed step is run again. An error that is not a peer failure leaves the
``with`` unchanged.

**State.** Every snapshot holds, per slot, the optimizer's state, the
hyperparameters, buffers, RNG, scheduler, every object in ``state`` and the
loop's history (:mod:`optim.state.training_state`); snapshots stay in memory,
double-buffered and replicated to the next slot on a background thread.

**Data contract.** A step's batches must be a function of ``(step, rank,
world_size)`` (plus what ``state`` restores), so a step run again sees the
same data. Under hot-swap ranks and world size never change, and a run with
failures follows the failure-free one bit for bit on CPU; a shrink re-shards
the optimizer over fewer ranks and changes the data split from then on.

**Bad steps and stragglers** (:mod:`optim.resilient.step_health`: one all-reduce in
:meth:`optimizer_step` carries every rank's verdict with the loss). A step
whose loss or gradient is not finite on any rank is skipped everywhere: no
optimizer steps, the buffers go back to the step's start, the step commits
as *skipped* (:attr:`skipped`; no loss) and :meth:`steps` goes on, so its
batch is skipped deterministically; ``max_bad_steps`` in a row are
absorbed, one more raises :class:`BadStepsError` on every rank (an LR
scheduler still advances, as with ``torch.amp.GradScaler``). A rank whose
compute time stays far above the others' is reported to the coordinator,
which replaces it when a spare is free (``ResilientConfig.straggler_factor``).

The optimizer is rebuilt by ``optimizer(model)`` after every failure: reach
it through :attr:`ResilientTraining.optimizer`, never through a reference
kept across steps.

This module holds the step: its context, the optimizer step with its checks,
the vote and what a committed step leaves behind. Building the optimizer,
snapshots, the start of the run and the recovery after a failure come from
:class:`~optim.resilient.loop_recovery.RecoverableRun`, the base of
:class:`ResilientTraining`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import Any

import torch

from bindings.errors import PeerFailureError
from bindings.validate import check_int
from optim.optimizers.capabilities import capabilities
from optim.resilient.loop_config import BadStepsError, EventHook, ResilientConfig, Stateful
from optim.resilient.loop_recovery import RecoverableRun
from optim.resilient.step_health import exchange_step_reports
from optim.state import training_state as ts
from optim.state.checkpoint import CheckpointError
from optim.state.run_stats import StateStats
from optim.state.snapshot import UnrecoverableStateError
from resilient_comm import FaultAwareCommunicator

__all__ = ["BadStepsError", "ResilientConfig", "ResilientTraining", "Stateful", "UnrecoverableStateError"]

logger = logging.getLogger(__name__)


class _Step:
    """The context of one step (see :meth:`ResilientTraining.step`)."""

    def __init__(self, owner: ResilientTraining, index: int) -> None:
        self._owner, self.index = owner, index

    def __enter__(self) -> _Step:
        self._owner._enter(self.index)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        return self._owner._exit(self.index, exc)


class ResilientTraining(RecoverableRun):
    """Failure-transparent training around a user's own loop (see the module docstring).

    Args:
        model: Any module, built identically (same seed) on every process, spares included.
        optimizer: Builds the optimizer over ``model``: one of ours (``SCAPE``,
            ``ShardedAdamS``, ``ShardedAdamW``, ``LocalAdamS``, ``TopKAdamS``, a
            ``LocalOptimizer`` wrapping a plain one), or a plain ``torch.optim``
            optimizer, whose gradients :meth:`optimizer_step` averages over the
            ranks first. Called again after every failure.
        scheduler: Builds an LR scheduler over the optimizer (optional; rebuilt with it).
        state: More state to snapshot, by name.
        config: Timeouts and snapshot policy.
        communicator: A connected fault-aware communicator (default: one is
            connected from the environment ``sparsecomm launch`` sets, and made
            the default group of :mod:`sparsecomm.distributed`).
        on_event: Called with ``(name, fields)`` at ``joined``, ``promoted``,
            ``committed``, ``bad_step``, ``straggler``, ``failed`` and ``restored``.

    Raises:
        TypeError: A bad argument.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
        *,
        scheduler: Callable[[torch.optim.Optimizer], Stateful] | None = None,
        state: Mapping[str, Stateful] | None = None,
        config: ResilientConfig | None = None,
        communicator: FaultAwareCommunicator | None = None,
        on_event: EventHook | None = None,
    ) -> None:
        super().__init__(
            model,
            optimizer,
            scheduler=scheduler,
            state=state,
            config=config,
            communicator=communicator,
            on_event=on_event,
        )
        self._started, self._finished = False, False
        self._in_step: int | None = None
        self._entered = 0  # steps entered so far (a yielded step that is never entered is a bug of the loop)
        self._stepped = False
        self._loss: float | None = None
        self._bad: list[int] | None = None  # the ranks whose loss or gradient was not finite in this step
        self._entry_buffers: dict[str, torch.Tensor] = {}
        self._t0 = 0.0
        self.stats: StateStats | None = None
        """What the state machinery did (set by :meth:`finish` on a member)."""

    # ------------------------------------------------------------------ public surface
    @property
    def optimizer(self) -> Any:
        """The current optimizer (rebuilt after every failure)."""
        if self._opt is None:
            raise RuntimeError("optimizer: not built yet (iterate over steps() first)")
        return self._opt

    @property
    def scheduler(self) -> Stateful | None:
        """The current LR scheduler (rebuilt with the optimizer), if one was asked for."""
        return self._sched

    @property
    def is_member(self) -> bool:
        """Whether this process holds a slot (``False`` for a spare never promoted)."""
        return self.comm.view is not None

    @property
    def rank(self) -> int:
        """This process's rank (= slot) in the current epoch."""
        return self.comm.rank

    @property
    def world_size(self) -> int:
        """Members of the current epoch."""
        return self.comm.world_size

    def steps(self, total: int) -> Iterator[int]:
        """Yield the step numbers to run, from 1 to ``total``, going back after a failure.

        A spare blocks here until it is promoted (and yields nothing if the job
        ends without it). Run each yielded step inside ``with self.step(step)``.

        Raises:
            ValueError: ``total`` is not an int >= 1.
            RuntimeError: A step was skipped (not run in ``with self.step(...)``).
        """
        check_int("total", total, low=1)
        if not self._started:
            self._started, self._total = True, total
            self._start()
        while self.is_member and self._next <= total:
            step, entered = self._next, self._entered
            yield step
            if self._entered == entered:
                raise RuntimeError(f"step {step} was yielded but not run: wrap the step in `with ft.step({step}):`")

    def step(self, index: int) -> _Step:
        """The context of step ``index``: the vote, snapshot and recovery happen when it is left."""
        return _Step(self, index)

    def optimizer_step(self, loss: torch.Tensor | float | None = None) -> float | None:
        """Average ``loss`` over the ranks, then step the optimizer. Collective.

        A plain torch optimizer first gets its gradients averaged over the
        ranks (one all-reduce); ours synchronize gradients themselves.

        Every rank's verdict on its loss and gradients (finite or not) travels
        with the loss: where any rank has a NaN or Inf, no rank steps the
        optimizer and the step is skipped (module docstring, "Bad steps").

        Returns:
            The rank-averaged loss (``None`` when no loss was given, or when the
            step is skipped); it becomes :attr:`losses`\\ ``[step]`` once the
            step commits.

        Raises:
            BadStepsError: On every rank, when this would be skipped step number
                ``max_bad_steps + 1`` in a row.
        """
        if self._in_step is None:
            raise RuntimeError("optimizer_step: call it inside `with ft.step(step):`")
        if self._stepped:
            raise RuntimeError(f"optimizer_step: already called in step {self._in_step}")
        compute_s = time.perf_counter() - self._t0
        value = 0.0
        if loss is not None:
            value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        bad = (loss is not None and not math.isfinite(value)) or not ts.gradients_finite(self.model)
        write_error = self._snaps.persist_error or (self._store.error if self._store is not None else None)
        rep = exchange_step_reports(value, bad, write_error is not None, compute_s)
        if rep.failed_writes:
            raise CheckpointError(
                f"step {self._in_step}: a persistent checkpoint could not be written on ranks {rep.failed_writes}"
                + (f" (here: {write_error})" if write_error is not None else "")
            )
        if (slow := self._stragglers.observe(rep.compute_s)) is not None:
            self._event("straggler", step=self._in_step, rank=slow, compute_s=rep.compute_s)
            if self.comm.rank == 0:  # one request is enough; the coordinator replaces it if a spare is free
                self.comm.report_straggler(slow, f"step {self._in_step}: compute times {rep.compute_s}")
        if rep.bad_ranks:
            if self._bad_run >= self.config.max_bad_steps:
                raise BadStepsError(
                    f"step {self._in_step}: loss or gradient not finite on ranks {rep.bad_ranks}, after "
                    f"{self._bad_run} skipped steps in a row (max_bad_steps={self.config.max_bad_steps})"
                )
            self._opt.zero_grad(set_to_none=True)
            self._stepped, self._loss, self._bad = True, None, rep.bad_ranks
            return None
        mean = rep.mean_loss if loss is not None else None
        if not capabilities(self._opt).synchronizes:
            ts.average_gradients(self.model)
        self._snaps.settle()
        self._opt.step()
        self._stepped, self._loss = True, mean
        return mean

    def finish(self) -> None:
        """End the run. Collective: every member must call this once after the last step.

        Waits for the last replication, averages the replicas of an optimizer whose replicas drift
        (:class:`optim.LocalAdamS`, :class:`optim.LocalOptimizer`: every member ends with one model), stops the
        background work and closes the communicator. A spare that was never
        promoted only closes.
        """
        if self._finished:
            return
        self._finished = True
        if self.is_member and self._opt is not None:
            self._snaps.drain()
            if capabilities(self._opt).replicas_drift:
                self._opt.average_params()
            if self._store is not None:
                self._store.drain()
            written = tuple(self._store.written) if self._store else ()
            self.stats = StateStats(snapshots=self._snaps.stats(), checkpoints=written)
        self.close()

    def close(self, *, ok: bool = True) -> None:
        """Stop the replication, the optimizer's background work and the communicator (local, idempotent).

        After :meth:`finish` the optimizer's collectives in flight are finished;
        on any other way out (an error) they are dropped, never waited for.
        With ``ok=False`` (left by an exception) this member leaves as failed:
        the job does not count its work as done.
        """
        self._snaps.stop()
        if self._store is not None:
            self._store.close()  # the queued checkpoint writes finish
        opt, self._opt = self._opt, None
        if opt is not None:
            if self._finished and hasattr(opt, "close"):
                opt.close()
            elif hasattr(opt, "abandon"):
                opt.abandon()
        self.comm.close(ok=ok)

    def __enter__(self) -> ResilientTraining:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(ok=kind is None)

    # ------------------------------------------------------------------ the step
    def _enter(self, index: int) -> None:
        if self._in_step is not None:
            raise RuntimeError(f"step {index}: step {self._in_step} is still open")
        if index != self._next:
            raise ValueError(f"step: expected step {self._next} (from steps()), got {index!r}")
        self._in_step, self._stepped, self._loss, self._bad = index, False, None, None
        self._entry_buffers = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        self._entered += 1
        self._t0 = time.perf_counter()

    def _exit(self, index: int, exc: BaseException | None) -> bool:
        self._in_step = None
        if exc is None:
            if not self._stepped:
                raise RuntimeError(f"step {index}: optimizer_step() was not called")
            try:
                if not self.comm.commit(index):
                    raise PeerFailureError(f"step {index} was not committed everywhere")
            except PeerFailureError as failure:
                exc = failure
            else:
                self._committed(index)
                return False
        if not isinstance(exc, PeerFailureError):
            return False
        self._event("failed", step=index, epoch=self.comm.epoch, error=str(exc)[:200])
        self._next = self._recover_until_ok(self._reconfigure())
        return True

    def _committed(self, step: int) -> None:
        if self._bad is not None:  # a skipped step: nothing of it stays but its index
            with torch.no_grad():
                for name, b in self.model.named_buffers():
                    b.copy_(self._entry_buffers[name])
            self.skipped.append(step)
            self._bad_run += 1
            self._event("bad_step", step=step, ranks=self._bad, in_a_row=self._bad_run)
        else:
            self._bad_run = 0
        if self._loss is not None:
            self.losses[step] = self._loss
        snap = self.config.snapshots_at(step)
        if snap:
            self._snaps.put(step, self._tree(step), self._persist_for(step))
        self._next = step + 1
        step_s = time.perf_counter() - self._t0
        self._event("committed", step=step, epoch=self.comm.epoch, loss=self._loss, step_s=step_s, snapshot=snap)

    def _persist_for(self, step: int) -> Callable[[torch.Tensor], None] | None:
        """What writes the snapshot of ``step`` to disk (``None``: not a checkpoint step)."""
        store, every = self._store, self.config.checkpoint_every
        if store is None or not every or step % every:
            return None
        decay, moment = ts.checkpoint_hints(self._opt)
        return store.persister(step, self.comm.rank, self.comm.world_size, self._fingerprint, decay, moment)
