"""Sharded AdamS / AdamW baselines and SCAPE (sparse, mask-partitioned AdamS).

All three optimizers use one ZeRO-1 layout (:class:`optim.buckets.FlatBucket`):
every parameter is part of one flat fp32 buffer of N elements, padded to
P * shard_size; rank r keeps fp32 master weights and the optimizer state of its
shard only. The user calls ``loss.backward(); opt.step()``: the optimizer does
the gradient synchronization itself (no DDP wrapper).

Dense step (:class:`ShardedAdamS`, :class:`ShardedAdamW`, and SCAPE's warm-up /
refresh steps)::

    reduce_scatter(avg) of the flat grad -> own shard grad
    per-shard update of master weights and state
    all_gather of the master shards -> written into every replica's params

SCAPE sparse step t (DESIGN §4, reference ``scape_adams.md`` §2.3, reading R1)::

    M_t = schedule.mask_for(t)               (built after step t-1-D)
    [error feedback] G += e
    sparse_reduce_scatter(avg) of G at M_t   -> owner gets g_hat (k values)
    [error feedback] e = G with the positions of M_t set to 0
    [clipping] g_hat *= min(1, c / ||g_hat||_global)   (one scalar all_reduce)
    owner: AdamS on its k masked coordinates (nu from local m and g_hat; no
           extra collective); unselected: 'freeze' (w, m untouched) or
           'decay_m' (m *= beta1, w untouched)
    sparse_all_gather of the updated master values at M_t -> every replica
    owner: propose its next piece = top-k |m| of its shard -> M_{t+1+D}

Weight decay: a group's ``weight_decay`` applies to parameters with
``p.dim() >= wd_min_ndim`` (default 2). The update is run once per *segment* of
the shard (a run of elements of one group and one decay rule, see
``optim.buckets``) with scalar hyperparameters, which is bitwise the same as the
per-parameter update. Param groups may differ in lr, betas, eps and weight decay.

Step indices: ``t`` counts completed steps from 0; the AdamS bias correction uses
``t + 1``. SCAPE step ``t`` is dense when ``t < warmup_steps``, when
``refresh_every > 0 and t % refresh_every == 0``, when ``density == 1`` or when
no mask was made for it; it then behaves exactly like :class:`ShardedAdamS`.
Masks are proposed only for steps that will be sparse.

Wire bytes: dense ops are counted by the communicator's stats under
``reduce_scatter`` / ``all_gather``; sparse ones under ``sparse_reduce_scatter`` /
``sparse_all_gather``; mask pieces under ``mask_sync``; the clipping scalar under
``grad_clip``; the construction check under ``param_check``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

import sparsecomm.distributed as dist
from bindings import ReduceOp
from optim.adams import _validate_group, adams_step_
from optim.buckets import FlatBucket
from sparsecomm.collectives import sparse_all_gather, sparse_reduce_scatter
from sparsecomm.mask import ShardedMask
from sparsecomm.schedule import MaskSchedule

__all__ = ["ShardedAdamS", "ShardedAdamW", "SCAPE", "UNSELECTED_POLICIES", "MASK_SCORES"]

UNSELECTED_POLICIES = ("freeze", "decay_m")
MASK_SCORES = ("abs_m", "abs_m_theta", "abs_m_residual")


class _ShardedOptimizer(Optimizer):
    """Shared ZeRO-1 machinery; subclasses define the per-segment update.

    fp32 parameters become views of one flat buffer at construction (values
    unchanged; :meth:`optim.buckets.FlatBucket.bind_params`), so the parameter
    all-gather writes the parameters directly. Build the optimizer after moving
    the model to its device and dtype.
    """

    _state_names: tuple[str, ...] = ("exp_avg",)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        group: Any = None,
        max_grad_norm: float = 0.0,
        config: str = "",
    ) -> None:
        if not (isinstance(max_grad_norm, (int, float)) and max_grad_norm >= 0.0):
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm!r} (must be >= 0)")
        self._building = True
        super().__init__(params, defaults)
        self._building = False
        self.max_grad_norm = float(max_grad_norm)
        self.last_grad_norm: float | None = None
        self._comm = dist.get_communicator(group)
        error: ValueError | None = None
        try:
            self._bucket = FlatBucket(self.param_groups, self._comm.rank, self._comm.world_size)
            fp = self._bucket.fingerprint(config)
        except ValueError as exc:
            error, fp = exc, 0
        self._agree(fp, error)
        b = self._bucket
        self._grad = b.new_flat()
        self._flat = b.new_flat()
        b.bind_params(self._flat)  # fp32 params become views of the flat buffer: no copies per step
        self._master = b.own_slice(b.gather_params(self._flat)).clone()
        self._shard = {n: torch.zeros_like(self._master) for n in self._state_names}
        self._step = 0

    def _agree(self, fp: int, error: ValueError | None) -> None:
        """One small all_reduce: every rank raises if any rank failed or the params differ."""
        both = torch.tensor([fp, -fp, int(error is not None)], dtype=torch.int64)
        with self._comm.stats.scope("param_check"):
            self._comm.all_reduce(both, ReduceOp.MAX)
        if error is not None:
            raise error
        if int(both[2]):
            raise ValueError("params: another rank rejected its parameters")
        if int(both[0]) != fp or int(-both[1]) != fp:
            raise ValueError(
                "params: the parameters (count, shapes, dtype) or the optimizer settings differ between ranks"
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_building", False):
            raise RuntimeError(f"{type(self).__name__}: param groups cannot be added after construction")
        super().add_param_group(param_group)
        _validate_group(self.param_groups[-1])

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronize the gradients, update the owned shard and refresh every replica."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = self._step
        self._bucket.gather_grads(self._grad)
        self._run(t)
        self._step = t + 1
        self._after(t)
        return loss

    def _run(self, t: int) -> None:
        self._dense_step(t)

    def _after(self, t: int) -> None:
        pass

    def _dense_step(self, t: int) -> None:
        b, comm = self._bucket, self._comm
        g = torch.empty_like(self._master)
        comm.reduce_scatter(g, self._grad, ReduceOp.AVG)
        self._clip(g)
        self._update(self._master, self._shard, g, t + 1, None)
        comm.all_gather(self._flat, self._master)
        b.write_params(self._flat)

    def _clip(self, g: Tensor) -> None:
        """Scale the synchronized grad values by min(1, c / global norm) (one scalar all_reduce)."""
        if self.max_grad_norm <= 0.0:
            return
        # float64 accumulation without a float64 copy of g (7x faster than g.double().square().sum())
        sq = torch.linalg.vector_norm(g, dtype=torch.float64).square().reshape(1)
        with self._comm.stats.scope("grad_clip"):
            self._comm.all_reduce(sq, ReduceOp.SUM)
        norm = math.sqrt(float(sq))
        self.last_grad_norm = norm
        coef = self.max_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            g.mul_(coef)

    def _update(self, w: Tensor, state: dict[str, Tensor], g: Tensor, step: int, idx: Tensor | None) -> None:
        """Run the update on every segment; ``idx`` (sorted shard positions) for gathered vectors."""
        segs = self._bucket.segments
        if idx is None:
            ranges = [(s.lo, s.hi) for s in segs]
        else:
            bounds = torch.tensor([[s.lo, s.hi] for s in segs], dtype=idx.dtype, device=idx.device)
            ranges = torch.searchsorted(idx, bounds.reshape(-1)).view(-1, 2).tolist()
        for seg, (a, z) in zip(segs, ranges, strict=True):
            if a >= z:
                continue
            grp = self.param_groups[seg.group]
            wd = float(grp["weight_decay"]) if seg.decay else 0.0
            part = {n: s[a:z] for n, s in state.items()}
            self._segment_update(w[a:z], part, g[a:z], grp, wd, step)

    def _segment_update(
        self, w: Tensor, state: dict[str, Tensor], g: Tensor, grp: dict[str, Any], wd: float, step: int
    ) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ state
    @property
    def master_shard(self) -> Tensor:
        """This rank's fp32 master weights (``shard_size`` elements, padding last)."""
        return self._master

    @property
    def shard_state(self) -> dict[str, Tensor]:
        """This rank's optimizer state tensors (same layout as :attr:`master_shard`)."""
        return self._shard

    @property
    def bucket(self) -> FlatBucket:
        """The flat-buffer layout."""
        return self._bucket

    @property
    def communicator(self) -> Any:
        """The communicator the optimizer synchronizes over."""
        return self._comm

    def _check_shard(self, what: str, sh: dict[str, Any]) -> None:
        """Raise ``ValueError`` unless ``sh`` (a sharded state) fits this rank's layout, before anything changes."""
        b = self._bucket
        got = (sh.get("rank"), sh.get("world_size"), sh.get("numel"))
        if got != (b.rank, b.world_size, b.numel):
            raise ValueError(
                f"{what}: saved for (rank, world_size, numel) {got}, "
                f"this optimizer is {(b.rank, b.world_size, b.numel)}"
            )
        if set(sh["shard"]) != set(self._shard):
            raise ValueError(f"{what}: state tensors {sorted(sh['shard'])} != {sorted(self._shard)}")
        pairs = [("master", sh["master"], self._master), *((n, sh["shard"][n], t) for n, t in self._shard.items())]
        for name, src, dst in pairs:
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise ValueError(
                    f"{what}: {name} has shape {tuple(src.shape)} {src.dtype}, expected {tuple(dst.shape)} {dst.dtype}"
                )

    def _copy_shard(self, sh: dict[str, Any]) -> None:
        self._master.copy_(sh["master"])
        for n, t in self._shard.items():
            t.copy_(sh["shard"][n])
        self._step = int(sh["step"])

    def _extra_state(self) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------------ snapshots
    def snapshot_state(self) -> dict[str, Any]:
        """This rank's state after the last step, for an in-memory snapshot.

        The tensors are the live ones: encode (copy) the tree before the next
        step. Unlike :meth:`state_dict` this never waits for the newest mask
        gather (it is re-made on restore from the restored first moment).
        """
        return {
            "step": self._step,
            "rank": self._bucket.rank,
            "world_size": self._bucket.world_size,
            "numel": self._bucket.numel,
            "master": self._master,
            "shard": dict(self._shard),
            "extra": self._snapshot_extra(),
        }

    def restore_snapshot(self, snap: dict[str, Any]) -> None:
        """Load a :meth:`snapshot_state` of this rank's layout.

        Collective: every rank must call this with snapshots of the same step
        (SCAPE re-makes its in-flight mask). Parameters are not touched: call
        :meth:`resync_params` afterwards.
        """
        self._check_shard("snapshot", snap)
        self._copy_shard(snap)
        self._restore_extra(snap["extra"])

    @torch.no_grad()
    def resync_params(self) -> None:
        """Rebuild every replica's parameters from the owners' master shards (one all_gather).

        Collective: every rank must call this.
        """
        self._comm.all_gather(self._flat, self._master)
        self._bucket.write_params(self._flat)

    def abandon(self) -> None:
        """Forget collectives in flight on a failed transport (call before dropping the optimizer)."""

    def _snapshot_extra(self) -> dict[str, Any]:
        return {}

    def _restore_extra(self, extra: dict[str, Any]) -> None:
        pass

    def _load_extra(self, extra: dict[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        """Per-rank sharded state: master shard, state shards, step (and SCAPE extras)."""
        sd = super().state_dict()
        b = self._bucket
        sd["sharded"] = {
            "rank": b.rank,
            "world_size": b.world_size,
            "numel": b.numel,
            "step": self._step,
            "master": self._master.clone(),
            "shard": {n: s.clone() for n, s in self._shard.items()},
            "extra": self._extra_state(),
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by the same rank of the same layout."""
        sh = state_dict.get("sharded")
        if sh is None:
            raise ValueError("state_dict: not a sharded optimizer state (no 'sharded' entry)")
        self._check_shard("state_dict", sh)
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self._copy_shard(sh)
        self._load_extra(sh["extra"])


def _adams_defaults(
    lr: float, betas: Any, eps: float, weight_decay: float, bias_correction: bool, wd_min_ndim: int
) -> dict[str, Any]:
    d = dict(
        lr=lr,
        betas=tuple(betas),
        eps=eps,
        weight_decay=weight_decay,
        bias_correction=bias_correction,
        wd_min_ndim=wd_min_ndim,
    )
    _validate_group(d)
    return d


class ShardedAdamS(_ShardedOptimizer):
    """Dense ZeRO-1 AdamS: reduce_scatter(avg) + AdamS on the shard + all_gather.

    Args:
        params: Parameters or param-group dicts (one dtype and device in all).
        lr, betas, eps, weight_decay, bias_correction: As :class:`optim.adams.AdamS`.
        max_grad_norm: Clip the global grad norm to this value (0 = off).
        group: ``sparsecomm.distributed`` group (default: the default group).
        wd_min_ndim: Weight decay applies to params with ``p.dim() >= wd_min_ndim``.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        max_grad_norm: float = 0.0,
        group: Any = None,
        *,
        wd_min_ndim: int = 2,
        _config: str = "",
    ) -> None:
        defaults = _adams_defaults(lr, betas, eps, weight_decay, bias_correction, wd_min_ndim)
        super().__init__(
            params, defaults, group=group, max_grad_norm=max_grad_norm, config=f"{type(self).__name__}|{_config}"
        )

    def _segment_update(
        self, w: Tensor, state: dict[str, Tensor], g: Tensor, grp: dict[str, Any], wd: float, step: int
    ) -> None:
        beta1, beta2 = grp["betas"]
        adams_step_(
            w,
            state["exp_avg"],
            g,
            lr=float(grp["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=grp["eps"],
            weight_decay=wd,
            step=step,
            bias_correction=grp["bias_correction"],
        )


class ShardedAdamW(_ShardedOptimizer):
    """Dense ZeRO-1 AdamW (torch's formula: bias-corrected, decoupled weight decay).

    Same layout, collectives and weight-decay rule (``p.dim() >= wd_min_ndim``) as
    :class:`ShardedAdamS`; only the per-shard update differs. State: ``exp_avg``
    and ``exp_avg_sq``.
    """

    _state_names = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        max_grad_norm: float = 0.0,
        group: Any = None,
        *,
        wd_min_ndim: int = 2,
    ) -> None:
        defaults = _adams_defaults(lr, betas, eps, weight_decay, True, wd_min_ndim)
        super().__init__(params, defaults, group=group, max_grad_norm=max_grad_norm, config="ShardedAdamW")

    def _segment_update(
        self, w: Tensor, state: dict[str, Tensor], g: Tensor, grp: dict[str, Any], wd: float, step: int
    ) -> None:
        beta1, beta2 = grp["betas"]
        lr = float(grp["lr"])
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if wd != 0.0:
            w.mul_(1.0 - lr * wd)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        bc1 = 1.0 - beta1**step
        bc2_sqrt = (1.0 - beta2**step) ** 0.5
        denom = (v.sqrt() / bc2_sqrt).add_(grp["eps"])
        w.addcdiv_(m, denom, value=-lr / bc1)


class SCAPE(ShardedAdamS):
    """SCAPE: AdamS with sparse, owner-partitioned, delayed masks (DESIGN §4).

    The defaults (10 dense warm-up steps, ``decay_m``, score |m|·|w|, 10%
    exploration, no error feedback, no refresh) are the best of the ablation in
    ``benchmarks/README.md`` at density 0.01.

    Args:
        params: Parameters or param-group dicts (one dtype and device in all).
        lr, betas, eps, weight_decay, bias_correction: AdamS hyperparameters.
        density: Fraction of each shard synchronized per sparse step, in (0, 1].
        mask_delay: D >= 0: the mask made after step t is used at step t + 1 + D.
        warmup_steps: Dense steps before sparsity starts.
        unselected: ``"decay_m"`` (unselected m *= beta1, w unchanged; default)
            or ``"freeze"`` (unselected w and m bitwise unchanged).
        error_feedback: Keep a local residual e (padded flat, fp32): each sparse
            step sends G + e at the mask and keeps the rest in e; a dense step
            sends G + e entirely and clears e.
        refresh_every: If > 0, steps with ``t % refresh_every == 0`` are dense.
        score: Mask statistic on the owner's shard: ``"abs_m"`` (|m|),
            ``"abs_m_theta"`` (|m|·|w|) or ``"abs_m_residual"`` (|m + (1-beta1)·e|
            with the owner's own residual e, so unsent gradient can enter the
            mask; needs ``error_feedback``).
        explore: Fraction in [0, 1) of each shard's k taken round-robin (a window
            that moves by its own length every step) instead of by score, so
            every coordinate is visited.
        max_grad_norm: Clip the global norm of the synchronized values (0 = off).
        group: ``sparsecomm.distributed`` group (default: the default group).

    Attributes:
        last_mask: The mask used by the last step (``None`` if it was dense).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        density: float = 0.01,
        mask_delay: int = 1,
        warmup_steps: int = 10,
        unselected: str = "decay_m",
        error_feedback: bool = False,
        refresh_every: int = 0,
        max_grad_norm: float = 0.0,
        bias_correction: bool = True,
        score: str = "abs_m_theta",
        explore: float = 0.1,
        group: Any = None,
        *,
        wd_min_ndim: int = 2,
    ) -> None:
        if isinstance(density, bool) or not isinstance(density, (int, float)):
            raise ValueError(f"Invalid density: {density!r} (must be a float in (0, 1])")
        if not 0.0 < float(density) <= 1.0:
            raise ValueError(f"Invalid density: {density!r} (must be in (0, 1])")
        for name, v in (("mask_delay", mask_delay), ("warmup_steps", warmup_steps), ("refresh_every", refresh_every)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Invalid {name}: {v!r} (must be an int >= 0)")
        if unselected not in UNSELECTED_POLICIES:
            raise ValueError(f"Invalid unselected: {unselected!r} (must be one of {UNSELECTED_POLICIES})")
        if score not in MASK_SCORES:
            raise ValueError(f"Invalid score: {score!r} (must be one of {MASK_SCORES})")
        if score == "abs_m_residual" and not error_feedback:
            raise ValueError("score='abs_m_residual' needs error_feedback=True")
        if isinstance(explore, bool) or not isinstance(explore, (int, float)) or not 0.0 <= explore < 1.0:
            raise ValueError(f"Invalid explore: {explore!r} (must be a float in [0, 1))")
        self.density = float(density)
        self.mask_delay = mask_delay
        self.warmup_steps = warmup_steps
        self.unselected = unselected
        self.error_feedback = bool(error_feedback)
        self.refresh_every = refresh_every
        self.score = score
        self.explore = float(explore)
        config = (
            f"{self.density!r}|{mask_delay}|{warmup_steps}|{unselected}|"
            f"{self.error_feedback}|{refresh_every}|{float(max_grad_norm)!r}|{score}|{self.explore!r}"
        )
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            bias_correction,
            max_grad_norm,
            group,
            wd_min_ndim=wd_min_ndim,
            _config=config,
        )
        b = self._bucket
        self.last_mask: ShardedMask | None = None
        self._residual = b.new_flat() if self.error_feedback else None
        self._sched: MaskSchedule | None = None
        if self.density < 1.0:
            self._sched = MaskSchedule(self._comm, numel=b.numel, density=self.density, delay=mask_delay)

    @property
    def residual(self) -> Tensor | None:
        """The error-feedback residual (padded flat fp32), or ``None`` without error feedback."""
        return self._residual

    def is_sparse_step(self, t: int) -> bool:
        """Whether step ``t`` is planned sparse (it still falls back to dense without a mask)."""
        if self._sched is None or t < self.warmup_steps:
            return False
        return not (self.refresh_every > 0 and t % self.refresh_every == 0)

    def next_mask(self) -> ShardedMask | None:
        """The mask the next ``step()`` will use (waits for its gather), or ``None`` if dense."""
        if not self.is_sparse_step(self._step):
            return None
        assert self._sched is not None
        return self._sched.mask_for(self._step)

    def _run(self, t: int) -> None:
        mask = self.next_mask()
        self.last_mask = mask
        if mask is None:
            if self._residual is not None:
                self._grad.add_(self._residual)
                self._residual.zero_()
            self._dense_step(t)
        else:
            self._sparse_step(t, mask)

    def _sparse_step(self, t: int, mask: ShardedMask) -> None:
        b, comm = self._bucket, self._comm
        n = b.numel
        if self._residual is not None:
            self._grad.add_(self._residual)
        g = sparse_reduce_scatter(comm, self._grad[:n], mask, "avg", verify_mask=False)
        assert isinstance(g, Tensor)
        if self._residual is not None:
            self._residual.copy_(self._grad)
            self._residual.index_fill_(0, mask.global_indices(self._grad.device), 0.0)
        self._clip(g)
        idx = mask.piece(b.rank).to(self._master.device)
        if self.unselected == "decay_m":
            self._decay_unselected(idx)
        w = self._master[idx]
        state = {name: s[idx] for name, s in self._shard.items()}
        self._update(w, state, g, t + 1, idx)
        self._master[idx] = w
        for name, s in self._shard.items():
            s[idx] = state[name]
        flat = b.gather_params(self._flat)
        sparse_all_gather(comm, w, mask, flat[:n], verify_mask=False)
        b.write_params(flat)

    def _decay_unselected(self, idx: Tensor) -> None:
        unsel = torch.ones(self._master.numel(), dtype=torch.bool, device=idx.device)
        unsel[idx] = False
        m = self._shard["exp_avg"]
        for seg in self._bucket.segments:
            beta1 = self.param_groups[seg.group]["betas"][0]
            part = m[seg.lo : seg.hi]
            part.copy_(torch.where(unsel[seg.lo : seg.hi], part * beta1, part))

    def _after(self, t: int) -> None:
        """Propose this rank's piece of the mask of step t + 1 + D from |m| of its shard."""
        if self._sched is None or not self.is_sparse_step(self._sched.target_step(t)):
            return
        self._sched.propose(t, self._scores(t))

    def _scores(self, t: int) -> Tensor:
        """The mask statistic of this rank's shard (real positions only) after step ``t``."""
        b = self._bucket
        m = self._shard["exp_avg"][: b.real]
        if self.score == "abs_m_theta":
            scores = m.abs() * self._master[: b.real].abs()
        elif self.score == "abs_m_residual":
            assert self._residual is not None
            e = b.own_slice(self._residual)[: b.real]
            scores = m.clone()
            for seg in b.segments:
                beta1 = self.param_groups[seg.group]["betas"][0]
                scores[seg.lo : seg.hi].add_(e[seg.lo : seg.hi], alpha=1.0 - beta1)
            scores.abs_()
        else:
            scores = m.abs()
        assert self._sched is not None
        n_explore = min(b.real, math.ceil(self.explore * self._sched.k))
        if n_explore > 0:
            lo = (t * n_explore) % b.real
            window = torch.arange(lo, lo + n_explore, device=scores.device) % b.real
            scores[window] = math.inf
        return scores

    def close(self) -> None:
        """Finish the mask gathers still in flight (call before tearing the group down)."""
        if self._sched is not None:
            self._sched.close()

    def abandon(self) -> None:
        """Drop the mask gathers in flight without waiting (their transport failed)."""
        if self._sched is not None:
            self._sched.abandon()

    def _snapshot_extra(self) -> dict[str, Any]:
        # Masks of the next D steps were proposed before the last step: their
        # gathers had a step to finish. The newest one (step + D) is re-made on
        # restore from the restored first moment, bit for bit.
        masks: dict[int, Tensor] = {}
        if self._sched is not None:
            for s in range(self._step, self._step + self.mask_delay):
                m = self._sched.mask_for(s)
                if m is not None:
                    masks[s] = m.indices
        return {"masks": masks, "residual": self._residual}

    def _restore_extra(self, extra: dict[str, Any]) -> None:
        b = self._bucket
        if (extra.get("residual") is None) != (self._residual is None):
            raise ValueError("snapshot: error_feedback setting differs from the saved state")
        if self._residual is not None:
            self._residual.copy_(extra["residual"])
        if self._sched is None:
            if extra["masks"]:
                raise ValueError("snapshot: holds masks but this optimizer is dense (density 1)")
            return
        self._sched.abandon()
        for s, idx in sorted(extra["masks"].items()):
            self._sched.install(
                int(s), ShardedMask(numel=b.numel, world_size=b.world_size, k=idx.shape[1], indices=idx)
            )
        # Re-make every mask of steps step .. step + D the snapshot does not hold (the newest one,
        # step + D; all of them after a re-shard) from the restored state, exactly as it was made.
        held = {int(s) for s in extra["masks"]}
        for target in range(self._step, self._step + self.mask_delay + 1):
            if target not in held and self.is_sparse_step(target):
                made = target - 1 - self.mask_delay
                self._sched.propose(made, self._scores(made))

    # ------------------------------------------------------------------ state
    def _extra_state(self) -> dict[str, Any]:
        masks: dict[int, ShardedMask] = {}
        if self._sched is not None:
            for s in range(self._step, self._step + self.mask_delay + 1):
                m = self._sched.mask_for(s)
                if m is not None:
                    masks[s] = m
            for s, m in masks.items():  # mask_for dropped the earlier ones: put them back
                self._sched.install(s, m)
        return {
            "masks": {s: m.indices.clone() for s, m in masks.items()},
            "residual": None if self._residual is None else self._residual.clone(),
        }

    def _load_extra(self, extra: dict[str, Any]) -> None:
        b = self._bucket
        if (extra.get("residual") is None) != (self._residual is None):
            raise ValueError("state_dict: error_feedback setting differs from the saved state")
        if self._residual is not None:
            self._residual.copy_(extra["residual"])
        if self._sched is not None:
            self._sched.close()
            for s, idx in sorted(extra["masks"].items()):
                mask = ShardedMask(numel=b.numel, world_size=b.world_size, k=idx.shape[1], indices=idx)
                self._sched.install(int(s), mask)
        elif extra["masks"]:
            raise ValueError("state_dict: holds masks but this optimizer is dense (density 1)")
