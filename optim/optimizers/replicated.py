"""AdamS with a full replicated state on every rank: the base of LocalAdamS and TopKAdamS.

:class:`ReplicatedAdamS` runs AdamS over the whole flat buffer on every rank
(a full fp32 first moment in place of a ``1/world_size`` share); its
subclasses choose the gradient of a step after the warm-up
(:class:`optim.optimizers.topk.TopKAdamS`: the average of every rank's top-k entries)
and what is averaged after it (:class:`optim.optimizers.local.LocalAdamS`: a window of
the parameters). The parameter layout, gradient gathering and parameter
following are those of :class:`optim.optimizers.sharded.ShardedAdamS` (one flat fp32
buffer that the parameters view). Snapshots and state dicts hold this rank's
whole replica; restoring one needs no communication.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT, StateDict

from bindings import ReduceOp
from bindings.validate import check_density, check_int
from optim.optimizers.capabilities import OptimizerCapabilities, StateLayout
from optim.optimizers.sharded import ShardedAdamS, take_written
from sparsecomm.mask import k_for

__all__ = ["ReplicatedAdamS"]

logger = logging.getLogger(__name__)


class ReplicatedAdamS(ShardedAdamS):
    """AdamS over the whole flat buffer on every rank; subclasses choose the gradient and the averaging.

    Not built directly: :class:`LocalAdamS` and :class:`TopKAdamS` are.

    The base's master shard is kept equal to this rank's slice of its replica
    after every step, so the parameter checks of :class:`ShardedAdamS` (values
    written from outside are taken) work unchanged; the sharded state is empty
    and the full first moment lives in ``_m``.
    """

    capabilities = OptimizerCapabilities(layout=StateLayout.REPLICATED, replicas_drift=False, own_snapshots=True)
    """Each rank holds a whole replica, the same on every rank, and snapshots it itself."""
    _state_names = ()
    _master_in_params = True  # the master shard is this rank's slice of its replica, not a copy

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        *,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        density: float,
        warmup_steps: int,
        max_grad_norm: float,
        bias_correction: bool,
        group: Any,
        wd_min_ndim: int,
        config: str,
    ) -> None:
        self.density = check_density(density)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, low=0)
        super().__init__(
            params,
            lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_grad_norm=max_grad_norm,
            group=group,
            wd_min_ndim=wd_min_ndim,
            _config=f"{self.density!r}|{warmup_steps}|{config}",
        )
        b = self._bucket
        self._m = b.new_flat()
        self.k = k_for(b.numel, b.world_size, self.density)
        """Positions per shard averaged (staggered) or sent per rank (top-k) at each step."""

    # ------------------------------------------------------------------ step
    def _run(self, t: int) -> None:
        b, g = self._bucket, self._grad
        if t < self.warmup_steps:
            self._comm.all_reduce(g, ReduceOp.AVG)
        else:
            g = self._sparse_grad(t, g)
        self._clip(g, sharded=False)
        self._local_phase = t >= self.warmup_steps
        state = {"exp_avg": self._m, **self._extra_moments()}
        self._update(self._flat, state, g, t + 1, None, segments=b.full_segments)
        if t >= self.warmup_steps:
            self._average(t)
        b.write_params(self._flat)
        self._master.copy_(b.own_slice(self._flat))

    def _sparse_grad(self, t: int, g: Tensor) -> Tensor:
        """The gradient of a step after the warm-up (``g``: this rank's own)."""
        return g

    def _extra_moments(self) -> dict[str, Tensor]:
        """Full-size state tensors the update needs beyond the first moment."""
        return {}

    def _average(self, t: int) -> None:
        """Average (part of) the replicas after the update of step ``t``."""

    def _take_written(self) -> None:
        """Take values written into the parameters from outside into the replica (local, no communication)."""
        b = self._bucket
        changed = 0
        for p, off in zip(b.params, b.offsets, strict=True):
            mine = self._flat[off : off + p.numel()]
            cur = p.detach().reshape(-1)
            if cur.data_ptr() == mine.data_ptr():
                continue  # the parameter views the replica: nothing to take
            changed += take_written(mine, cur, mine if p.dtype == torch.float32 else mine.to(p.dtype))
        if changed:
            logger.info(
                "%s: %d parameter values were written outside the optimizer; taken", type(self).__name__, changed
            )
        self._master.copy_(b.own_slice(self._flat))

    # ------------------------------------------------------------------ state
    def _full_state(self) -> dict[str, Tensor]:
        """Full-size (padded flat) state tensors: the replica and what is kept beside it, by name."""
        return {"params": self._flat, "exp_avg": self._m}

    def _own_state(self) -> dict[str, Tensor]:
        """State tensors of this rank's shard only (``shard_size`` elements), by name."""
        return {}

    def _saved_state(self) -> dict[str, Tensor]:
        return {**self._full_state(), **self._own_state()}

    @property
    def replica_state(self) -> dict[str, Tensor]:
        """The state this rank keeps beside its replica (first moment, anchor, residuals), by name."""
        return {name: t for name, t in self._saved_state().items() if name != "params"}

    def _check_shard(self, what: str, sh: StateDict) -> None:
        super()._check_shard(what, sh)
        extra = sh.get("extra") or {}
        for name, mine in self._saved_state().items():
            src = extra.get(name)
            if not isinstance(src, Tensor) or src.shape != mine.shape or src.dtype != mine.dtype:
                got = None if not isinstance(src, Tensor) else (tuple(src.shape), src.dtype)
                raise ValueError(f"{what}: {name} should be {tuple(mine.shape)} {mine.dtype}, got {got}")

    def _copy_full(self, extra: StateDict) -> None:
        for name, mine in self._saved_state().items():
            mine.copy_(extra[name])
        self._bucket.write_params(self._flat)
        self._master.copy_(self._bucket.own_slice(self._flat))
        self._master_wins = False  # the replica was loaded into the parameters themselves

    def _extra_state(self, *, live: bool) -> StateDict:
        return {n: t if live else t.clone() for n, t in self._saved_state().items()}

    def _load_extra(self, extra: StateDict, *, what: str, collective: bool) -> None:
        self._copy_full(extra)

    @torch.no_grad()
    def restore_replica(self, snap: StateDict) -> None:
        """Load a :meth:`snapshot_state` taken under any world size (same parameters): this rank's replica.

        The replica (parameters, first moment, residual) does not depend on the
        layout, so a survivor of a shrink goes on from its own; the master
        shard is cut from it in the new layout. Local: no communication. The
        parameters are written.

        Raises:
            ValueError: The snapshot is of other parameters or another optimizer.
        """
        b = self._bucket
        extra = snap.get("extra") or {}
        if int(snap.get("numel", -1)) != b.numel:
            raise ValueError(f"snapshot: {snap.get('numel')} parameters saved, this optimizer has {b.numel}")
        for name, mine in self._full_state().items():
            src = extra.get(name)
            if not isinstance(src, Tensor) or src.dim() != 1 or src.numel() < b.numel or src.dtype != mine.dtype:
                raise ValueError(f"snapshot: {name} missing or not a flat {mine.dtype} replica of {b.numel} elements")
        saved_rank = snap.get("rank")
        old_rank = saved_rank if type(saved_rank) is int else -1
        for name, mine in self._own_state().items():
            src = extra.get(name)
            if not isinstance(src, Tensor) or src.dim() != 1 or src.dtype != mine.dtype or old_rank < 0:
                raise ValueError(f"snapshot: {name} missing or not a flat {mine.dtype} shard of a ranked snapshot")
        for name, mine in self._full_state().items():
            mine.zero_()
            mine[: b.numel].copy_(extra[name][: b.numel])
        for name, mine in self._own_state().items():  # the positions this rank owned then and owns now
            b.take_own(mine, extra[name], old_rank)
        self._step = int(snap["step"])
        b.write_params(self._flat)
        self._master.copy_(b.own_slice(self._flat))
        self._master_wins = False

    @torch.no_grad()
    def resync_params(self) -> None:
        """Write this rank's replica into the parameters (local; kept collective-shaped for callers).

        Collective: every rank must call this (it issues no communication today,
        but callers treat it like the sharded optimizers' resync).
        """
        self._follow_params()
        self._bucket.write_params(self._flat)
        self._master.copy_(self._bucket.own_slice(self._flat))
        self._master_wins = False
