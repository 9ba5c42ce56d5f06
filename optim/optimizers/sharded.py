"""Dense ZeRO-1 sharded optimizers: the shared machinery, ShardedAdamS and ShardedAdamW.

Every parameter is part of one flat fp32 buffer of N elements
(:class:`optim.optimizers.buckets.FlatBucket`), padded to P * shard_size; rank r keeps fp32
master weights and the optimizer state of its shard only. The user calls
``loss.backward(); opt.step()``: the optimizer does the gradient
synchronization itself (no DDP wrapper). A dense step::

    reduce_scatter(avg) of the flat grad -> own shard grad
    per-shard update of master weights and state
    all_gather of the master shards -> written into every replica's params

Weight decay: a group's ``weight_decay`` applies to parameters with
``p.dim() >= wd_min_ndim`` (default 2). The update is run once per *segment* of
the shard (a run of elements of one group and one decay rule, see
``optim.optimizers.buckets``) with scalar hyperparameters, which is bitwise the same as the
per-parameter update. Param groups may differ in lr, betas, eps and weight decay.

Wire bytes: dense ops are counted by the communicator's stats under
``reduce_scatter`` / ``all_gather``; the clipping scalar under ``grad_clip``;
the construction check under ``param_check``. :mod:`optim.optimizers.scape` builds the
sparse optimizer on this base.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT, StateDict

import sparsecomm.distributed as dist
from bindings import ReduceOp
from bindings.validate import check_float
from optim.optimizers.adams import adams_step_, validate_group
from optim.optimizers.buckets import FlatBucket, OnFlatBucket, Segment
from optim.optimizers.capabilities import OptimizerCapabilities, ParamGroup, StateLayout
from optim.optimizers.param_watch import ParamWatch

__all__ = ["ShardedAdamS", "ShardedAdamW"]

logger = logging.getLogger(__name__)


class _ShardedOptimizer(OnFlatBucket, Optimizer):
    """Shared ZeRO-1 machinery; subclasses define the per-segment update.

    fp32 parameters become views of one flat buffer at construction (values
    unchanged; :meth:`optim.optimizers.buckets.FlatBucket.bind_params`), so the parameter
    all-gather writes the parameters directly. Build the optimizer after moving
    the model to its device and dtype.

    Each step first takes in what happened to the parameters since the last
    one (:meth:`_sync_params`): storage replaced (a trainer re-materializing
    the model, ``p.data = ...``) is re-bound with the values kept; values
    written in place (``model.load_state_dict(sd)``, ``nn.init``) become the
    master weights of this rank's shard; a parameter object that a module
    replaced (``load_state_dict(assign=True)``, ``module.weight =
    nn.Parameter(...)``) is followed; a changed shape, dtype or device, and a
    step without a single gradient, raise before any communication.
    """

    capabilities = OptimizerCapabilities(layout=StateLayout.SHARDED, replicas_drift=False, own_snapshots=True)
    """Each rank holds its shard of the state and snapshots it itself (:mod:`optim.optimizers.capabilities`)."""
    _state_names: tuple[str, ...] = ("exp_avg",)
    _master_in_params = False
    """Keep the master of fp32 parameters in the parameters themselves (this rank's slice of the flat
    buffer they view): a write into them is a write into the master, with nothing to compare per step."""

    def __init__(
        self,
        params: ParamsT,
        defaults: ParamGroup,
        *,
        group: Any = None,
        max_grad_norm: float = 0.0,
        config: str = "",
    ) -> None:
        check_float("max_grad_norm", max_grad_norm, low=0.0, finite=False)
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
        bound = b.bind_params(self._flat)  # fp32 params become views of the flat buffer: no copies per step
        own = b.own_slice(b.gather_params(self._flat))
        self._master_is_params = bound and self._master_in_params
        self._master = own if self._master_is_params else own.clone()
        self._shard = {n: torch.zeros_like(self._master) for n in self._state_names}
        self._step = 0
        self._watch = ParamWatch(b.params)
        self._master_wins = False  # set by loads: the next step keeps the loaded master over the params

    def _agree(self, fp: int, error: ValueError | None) -> None:
        agree(self._comm, fp, error)

    def add_param_group(self, param_group: ParamGroup) -> None:
        if not getattr(self, "_building", False):
            raise RuntimeError(f"{type(self).__name__}: param groups cannot be added after construction")
        super().add_param_group(param_group)
        validate_group(self.param_groups[-1])

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronize the gradients, update the owned shard and refresh every replica."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._settle()
        t = self._step
        self._sync_params()
        self._take_grads()
        self._run(t)
        self._step = t + 1
        self._after(t)
        return loss

    @torch.no_grad()
    def _follow_params(self) -> None:
        """Follow replaced parameter objects and re-bind replaced storage; refuse changed shapes/dtypes."""
        b = self._bucket
        for rep in self._watch.take():
            old = b.params[rep.index]
            if any(rep.param is p for p in b.params):
                logger.info(
                    "%s: %s now shares %s, which this optimizer trains",
                    type(self).__name__,
                    rep.where,
                    b.names[rep.index],
                )
                continue
            if rep.dropped:
                logger.warning(
                    "%s: %s was replaced by two different parameters (%s, then %s), as when a load with "
                    "assign=True unties tied weights; following %s only: tie them again or rebuild the optimizer",
                    type(self).__name__,
                    b.names[rep.index],
                    rep.dropped[0],
                    rep.where,
                    rep.where,
                )
            b.replace_param(rep.index, rep.param)
            for grp in self.param_groups:
                grp["params"] = [rep.param if p is old else p for p in grp["params"]]
            self._watch.forget(old)
            logger.info(
                "%s: following the new parameter object of %s (%s)", type(self).__name__, rep.where, b.names[rep.index]
            )
        b.check_params()
        rebound = b.rebind(self._flat)
        if rebound:
            logger.info(
                "%s: the storage of %d parameter(s) was replaced (first: %s); re-bound with their values",
                type(self).__name__,
                len(rebound),
                b.names[rebound[0]],
            )

    @torch.no_grad()
    def _sync_params(self) -> None:
        """Take in what happened to the parameters since the last step (local, no communication)."""
        self._follow_params()
        if self._master_wins:
            self._master_wins = False
            return
        self._take_written()

    def _take_written(self) -> None:
        """Make values written into the parameters from outside this rank's master."""
        if self._master_is_params:
            return  # they were written into it
        b = self._bucket
        own, master = b.own_values(self._flat)[: b.real], self._master[: b.real]
        ref = master if b.dtype == torch.float32 else master.to(b.dtype).float()
        changed = take_written(master, own, ref)
        if changed:
            logger.info(
                "%s: %d parameter values were written outside the optimizer; taken as master",
                type(self).__name__,
                changed,
            )

    def _take_grads(self) -> None:
        """Bring this step's gradients in: copied into the flat buffer ``self._grad`` (padding zero)."""
        self._check_grads(self._bucket.gather_grads(self._grad))

    def _check_grads(self, missing: list[int]) -> None:
        b = self._bucket
        if len(missing) == len(b.params):
            raise RuntimeError(
                f"{type(self).__name__}.step(): none of its {len(b.params)} parameters has a gradient. If the model's "
                "parameters were replaced by new objects that no module registered (e.g. a copy of the model), "
                "build the optimizer over the parameters the model uses"
            )

    def _settle(self) -> None:
        """Finish the work a step left running beside the caller's compute (start of every step)."""

    def _quiesce(self) -> None:
        """Stop that work without communicating, before this rank's state is overwritten."""

    def _run(self, t: int) -> None:
        self._dense_step(t)

    def _after(self, t: int) -> None:
        pass

    def _dense_step(self, t: int) -> None:
        g = torch.empty_like(self._master)
        self._comm.reduce_scatter(g, self._grad, ReduceOp.AVG)
        self._clip(g)
        self._update(self._master, self._shard, g, t + 1, None)
        self._all_gather_params()

    def _all_gather_params(self) -> None:
        """Every rank's parameters from the owners' master shards (one all_gather)."""
        src = self._master.clone() if self._master_is_params else self._master  # the input never aliases flat
        self._comm.all_gather(self._flat, src)
        self._bucket.write_params(self._flat)

    def _clip(self, g: Tensor, *, sharded: bool = True) -> None:
        """Scale the grad values by min(1, c / norm).

        ``sharded``: ``g`` is this rank's shard of the synchronized gradient and
        the global norm takes one scalar all_reduce; otherwise ``g`` is a whole
        gradient and its own norm is used (no communication).
        """
        if self.max_grad_norm <= 0.0:
            return
        sq = squared_norm(g).reshape(1)
        if sharded:
            with self._comm.stats.scope("grad_clip"):
                self._comm.all_reduce(sq, ReduceOp.SUM)
        norm = math.sqrt(float(sq))
        self.last_grad_norm = norm
        coef = self.max_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            g.mul_(coef)

    def _update(
        self,
        w: Tensor,
        state: dict[str, Tensor],
        g: Tensor,
        step: int,
        idx: Tensor | None,
        segments: list[Segment] | None = None,
    ) -> None:
        """Run the update on every segment; ``idx`` (sorted shard positions) for gathered vectors.

        ``segments`` defaults to this rank's shard; replicated-state optimizers
        pass the bucket's ``full_segments`` with whole flat buffers.
        """
        segs = self._bucket.segments if segments is None else segments
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
        self, w: Tensor, state: dict[str, Tensor], g: Tensor, grp: ParamGroup, wd: float, step: int
    ) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ state
    @property
    def master_shard(self) -> Tensor:
        """This rank's fp32 master weights (``shard_size`` elements, padding last).

        For SCAPE over fp32 parameters this is this rank's slice of the flat
        buffer the parameters view: the parameters' own values themselves.
        """
        return self._master

    @property
    def shard_state(self) -> dict[str, Tensor]:
        """This rank's optimizer state tensors (same layout as :attr:`master_shard`)."""
        return self._shard

    def _check_shard(self, what: str, sh: StateDict) -> None:
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

    def _copy_shard(self, sh: StateDict) -> None:
        self._master_wins = True
        self._master.copy_(sh["master"])
        for n, t in self._shard.items():
            t.copy_(sh["shard"][n])
        self._step = int(sh["step"])

    def _extra_state(self, *, live: bool) -> StateDict:
        """What the subclass saves beside the shard: its live tensors (a snapshot) or copies (a state dict)."""
        return {}

    def _load_extra(self, extra: StateDict, *, what: str, collective: bool) -> None:
        """Load :meth:`_extra_state`'s ``extra`` (``collective``: from a snapshot, every rank at once)."""

    # ------------------------------------------------------------------ snapshots
    def checkpoint_decay(self) -> dict[str, float]:
        """Paths in :meth:`snapshot_state` of float32 tensors multiplied by a factor in every step
        wherever nothing else happens to them (a delta checkpoint predicts them so); none here."""
        return {}

    def checkpoint_first_moment(self) -> list[str]:
        """Paths in :meth:`snapshot_state` of the first moment, which a lossy checkpoint keeps in bfloat16."""
        return ["shard/exp_avg"] if "exp_avg" in self._shard else []

    def snapshot_growth(self) -> int:
        """Bytes a later :meth:`snapshot_state` may hold beyond the current one (its tensors keep their size)."""
        return 0

    def snapshot_state(self) -> StateDict:
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
            "extra": self._extra_state(live=True),
        }

    def restore_snapshot(self, snap: StateDict) -> None:
        """Load a :meth:`snapshot_state` of this rank's layout.

        Collective: every rank must call this with snapshots of the same step
        (SCAPE re-makes its in-flight mask). Parameters are not touched (but
        for this rank's own values where the master lives in them): call
        :meth:`resync_params` afterwards.
        """
        self._check_shard("snapshot", snap)
        self._quiesce()
        self._copy_shard(snap)
        self._load_extra(snap["extra"], what="snapshot", collective=True)

    @torch.no_grad()
    def resync_params(self) -> None:
        """Rebuild every replica's parameters from the owners' master shards (one all_gather).

        Collective: every rank must call this.
        """
        self._follow_params()
        self._all_gather_params()
        self._master_wins = False

    def abandon(self) -> None:
        """Forget collectives in flight on a failed transport (call before dropping the optimizer)."""

    def state_dict(self) -> StateDict:
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
            "extra": self._extra_state(live=False),
        }
        return sd

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Load a state saved by the same rank of the same layout."""
        sh = state_dict.get("sharded")
        if sh is None:
            raise ValueError("state_dict: not a sharded optimizer state (no 'sharded' entry)")
        self._check_shard("state_dict", sh)
        self._quiesce()
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self._copy_shard(sh)
        self._load_extra(sh["extra"], what="state_dict", collective=False)


_NORM_ROW = 1 << 16


def agree(comm: Any, fp: int, error: Exception | None) -> None:
    """One small all_reduce: every rank raises if any rank failed its local checks or the params differ.

    Collective: every rank must call this, with its fingerprint of the
    parameters and settings (``fp``) and the error its checks raised, if any.
    """
    both = torch.tensor([fp, -fp, int(error is not None)], dtype=torch.int64)
    with comm.stats.scope("param_check"):
        comm.all_reduce(both, ReduceOp.MAX)
    if error is not None:
        raise error
    if int(both[2]):
        raise ValueError("params: another rank rejected its parameters")
    if int(both[0]) != fp or int(-both[1]) != fp:
        raise ValueError("params: the parameters (count, shapes, dtype) or the optimizer settings differ between ranks")


def squared_norm(g: Tensor) -> Tensor:
    """The sum of squares of ``g``'s values as a float64 scalar tensor.

    The float32 norms of rows of 65,536 values (torch's cascaded float32 sum),
    squared and summed in float64: relative error about 1e-7, and 25x faster
    on CPU than a float64 norm of the whole tensor (92 vs 3.8 ms for 22M values
    on one core). Where a row's float32 norm overflows, the whole sum is
    taken in float64 instead.
    """
    flat = g.reshape(-1)
    full = flat.numel() // _NORM_ROW * _NORM_ROW
    sq = torch.zeros((), dtype=torch.float64, device=g.device)
    if full:
        sq += torch.linalg.vector_norm(flat[:full].view(-1, _NORM_ROW), dim=1).double().square().sum()
    if flat.numel() > full:
        sq += torch.linalg.vector_norm(flat[full:]).double().square()
    if not bool(torch.isfinite(sq)):
        sq = torch.linalg.vector_norm(flat, dtype=torch.float64).square()
    return sq


def take_written(dst: Tensor, cur: Tensor, ref: Tensor) -> int:
    """Copy into ``dst`` the positions where ``cur`` differs from ``ref`` (NaN equals NaN); return how many.

    ``cur`` and ``ref`` are compared in ``cur``'s dtype; ``dst`` takes ``cur``'s
    values cast to its own. One read of ``cur`` and ``ref`` when nothing changed.
    """
    if torch.equal(cur, ref):
        return 0
    diff = (cur != ref) & ~(cur.isnan() & ref.isnan())
    dst.copy_(torch.where(diff, cur.to(dst.dtype), dst))
    return int(diff.sum())


def _adams_defaults(
    lr: float, betas: Any, eps: float, weight_decay: float, bias_correction: bool, wd_min_ndim: int
) -> StateDict:
    d = dict(
        lr=lr,
        betas=tuple(betas),
        eps=eps,
        weight_decay=weight_decay,
        bias_correction=bias_correction,
        wd_min_ndim=wd_min_ndim,
    )
    validate_group(d)
    return d


class ShardedAdamS(_ShardedOptimizer):
    """Dense ZeRO-1 AdamS: reduce_scatter(avg) + AdamS on the shard + all_gather.

    Args:
        params: Parameters or param-group dicts (one dtype and device in all).
        lr, betas, eps, weight_decay, bias_correction: As :class:`optim.optimizers.adams.AdamS`.
        max_grad_norm: Clip the global grad norm to this value (0 = off).
        group: ``sparsecomm.distributed`` group (default: the default group).
        wd_min_ndim: Weight decay applies to params with ``p.dim() >= wd_min_ndim``.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        *,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        max_grad_norm: float = 0.0,
        group: Any = None,
        wd_min_ndim: int = 2,
        _config: str = "",
    ) -> None:
        defaults = _adams_defaults(lr, betas, eps, weight_decay, bias_correction, wd_min_ndim)
        super().__init__(
            params, defaults, group=group, max_grad_norm=max_grad_norm, config=f"{type(self).__name__}|{_config}"
        )

    def _segment_update(
        self, w: Tensor, state: dict[str, Tensor], g: Tensor, grp: ParamGroup, wd: float, step: int
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
        params: ParamsT,
        lr: float = 1e-3,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        max_grad_norm: float = 0.0,
        group: Any = None,
        wd_min_ndim: int = 2,
    ) -> None:
        defaults = _adams_defaults(lr, betas, eps, weight_decay, True, wd_min_ndim)
        super().__init__(params, defaults, group=group, max_grad_norm=max_grad_norm, config="ShardedAdamW")

    def _segment_update(
        self, w: Tensor, state: dict[str, Tensor], g: Tensor, grp: ParamGroup, wd: float, step: int
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
