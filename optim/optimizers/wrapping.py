"""A plain ``torch.optim`` optimizer wrapped so that every rank steps its own replica (:class:`WrappingOptimizer`).

The base of :class:`optim.LocalOptimizer`, :class:`optim.DiLoCo`,
:class:`optim.SparseLoCo`, :class:`optim.MaskedLoCo`, and of those whose replicas
never differ (:class:`optim.CodedGradients`, :class:`optim.TopKGradients`,
:class:`optim.DeMo`): it checks what it wraps (before any communication
but one small agreement, the same on every rank), makes the parameters views
of one flat fp32 buffer (the replica, which the subclass averages or moves in
place), hands ``param_groups``, ``state`` and ``defaults`` through to the
wrapped optimizer (an LR scheduler built over the wrapper drives it), and runs
the inner step: the gradients averaged in the warm-up (one dense all_reduce),
clipped if asked, then the wrapped optimizer's step.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import StateDict

import sparsecomm.distributed as dist
from bindings import ReduceOp
from bindings.validate import check_float
from optim.optimizers.buckets import FlatBucket, OnFlatBucket
from optim.optimizers.capabilities import OptimizerCapabilities, ParamGroup, StateLayout, capabilities
from optim.optimizers.noise import MeanNorm
from optim.optimizers.sharded import agree

__all__ = [
    "ADAM_MOMENTS",
    "SameReplicaWrapper",
    "WrappingOptimizer",
    "adam_moments",
    "average_grads",
    "check_inner",
    "set_grads",
]

ADAM_MOMENTS = (torch.optim.Adam, torch.optim.AdamW)
"""The optimizers whose state a wrapper may read and correct: ``exp_avg``, ``exp_avg_sq`` and ``step`` per parameter."""

logger = logging.getLogger(__name__)

_WRAPPED: weakref.WeakSet[Optimizer] = weakref.WeakSet()
"""The optimizers a :class:`WrappingOptimizer` wraps: a second wrapper of one is refused."""


def adam_moments(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` keeps Adam's moments a wrapper may read and correct (Adam or AdamW, no ``amsgrad``)."""
    return isinstance(optimizer, ADAM_MOMENTS) and not any(g.get("amsgrad") for g in optimizer.param_groups)


def check_inner(optimizer: object, model: object) -> None:
    """Refuse what cannot be wrapped (local checks, the same on every rank).

    Raises:
        TypeError: Not a torch optimizer, one that synchronizes the ranks itself, or not a module.
        ValueError: Wrapped already, or its parameters are not the model's trainable ones.
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if capabilities(optimizer).synchronizes:
        raise TypeError(
            f"optimizer: {type(optimizer).__name__} synchronizes the ranks itself; wrap a plain torch.optim "
            "optimizer (e.g. torch.optim.AdamW) that steps this rank's replica alone"
        )
    if optimizer in _WRAPPED:
        raise ValueError("optimizer: it is already wrapped; wrap each optimizer once")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    mine = [p for g in optimizer.param_groups for p in g["params"]]
    names = {id(p): n for n, p in model.named_parameters()}
    foreign = [i for i, p in enumerate(mine) if id(p) not in names]
    if foreign:
        raise ValueError(
            f"optimizer: {len(foreign)} of its parameters (first: position {foreign[0]}) are not the model's; "
            "build the optimizer over model.parameters()"
        )
    held = {id(p) for p in mine}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if missing:
        raise ValueError(
            f"model: {len(missing)} trainable parameters are not the optimizer's (first: {missing[0]}); "
            "their replicas would drift apart unaveraged: give them to the optimizer or freeze them"
        )


def average_grads(comm: Any, bucket: FlatBucket, buf: Tensor) -> None:
    """Replace every parameter's gradient by the ranks' average (one dense all_reduce of ``buf``, padded flat fp32).

    Collective: every rank must call this. A parameter without a gradient
    counts as zeros and gets the average too, so every replica takes the same step.
    """
    missing = set(bucket.gather_grads(buf))
    comm.all_reduce(buf, ReduceOp.AVG)
    set_grads(bucket, buf, missing)


def set_grads(bucket: FlatBucket, buf: Tensor, missing: set[int]) -> None:
    """Copy the flat gradient ``buf`` into every parameter's ``.grad``; new ones for the ``missing`` indices.

    A parameter this rank had no gradient for gets one too (another rank had one:
    every replica takes the same step).
    """
    for i, (p, off) in enumerate(zip(bucket.params, bucket.offsets, strict=True)):
        avg = buf[off : off + p.numel()].view(p.shape)
        if i in missing:
            p.grad = avg.clone()
        else:
            p.grad.copy_(avg)  # type: ignore[union-attr]


class _Wrapped:
    """An attribute of the wrapped optimizer, read and written through the wrapper.

    ``Optimizer.__init__`` sets it before the wrapped optimizer is attached: kept on the wrapper until then.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        inner = obj.__dict__.get("optimizer")
        return getattr(inner, self.name) if inner is not None else obj.__dict__["_" + self.name]

    def __set__(self, obj: Any, value: Any) -> None:
        inner = obj.__dict__.get("optimizer")
        if inner is None:
            obj.__dict__["_" + self.name] = value
        else:
            setattr(inner, self.name, value)


class WrappingOptimizer(OnFlatBucket, Optimizer):
    """Wrap ``optimizer`` so that every rank steps its own replica of ``model`` (a base class).

    Subclasses check and resolve their own settings in :meth:`_check_settings`
    (called with the bucket made; it returns the settings as the ranks must
    agree on them), make their buffers in :meth:`_make_buffers`, and build
    ``step`` from :meth:`_run_closure`, :meth:`_check_replica` and :meth:`_inner_step`.

    Args:
        optimizer: A ``torch.optim`` optimizer over ``model``'s trainable
            parameters (fp32, one device), not one of ours.
        model: The model it trains, the same on every rank.
        max_grad_norm: Clip the gradient the wrapped optimizer sees (the
            averaged one in the warm-up; after it this rank's own, by its own
            norm, or, where the subclass sets ``_clip_averaged``, by the norm of
            the ranks' average) to this global norm; 0: no clipping.
        group: The process group (``None``: the default group of :mod:`sparsecomm.distributed`).

    Raises:
        TypeError: ``optimizer`` is not a plain torch optimizer, or ``model`` not a module.
        ValueError: A bad setting, an optimizer wrapped twice, parameters that
            are not the model's trainable ones or not fp32, or settings or models
            that differ between ranks (the same on every rank).
    """

    capabilities = OptimizerCapabilities(layout=StateLayout.REPLICATED, replicas_drift=True, own_snapshots=False)
    """Each rank holds its own replica between averagings; snapshots are the ``state_dict()`` and the parameters."""

    _clip_averaged = False
    """Whether a local step clips by the norm of the ranks' average gradient (:class:`MeanNorm`, 65 floats a step)."""

    def __init__(self, optimizer: Optimizer, model: torch.nn.Module, *, max_grad_norm: float, group: Any) -> None:
        self._comm = dist.get_communicator(group)
        name = type(self).__name__
        error: ValueError | TypeError | None = None
        fp = 0
        try:
            check_inner(optimizer, model)
            self.max_grad_norm = check_float("max_grad_norm", max_grad_norm, low=0.0)
            groups = [{"params": g["params"], "wd_min_ndim": 0} for g in optimizer.param_groups]
            self._bucket = FlatBucket(groups, self._comm.rank, self._comm.world_size)
            if self._bucket.dtype != torch.float32:
                raise ValueError(f"params: {name} steps fp32 parameters, got {self._bucket.dtype}")
            settings = self._check_settings(optimizer)
            fp = self._bucket.fingerprint(f"{name}|{type(optimizer).__qualname__}|{self.max_grad_norm}|{settings}")
        except (ValueError, TypeError) as exc:
            error = exc
        agree(self._comm, fp, error)
        super().__init__([{"params": list(g["params"])} for g in optimizer.param_groups], {})
        self.optimizer = optimizer
        """The wrapped optimizer: it steps this rank's replica."""
        _WRAPPED.add(optimizer)
        self.model = model
        self.last_grad_norm: float | None = None
        """The global norm of the gradient the wrapped optimizer saw at the last step (``max_grad_norm`` set)."""
        b = self._bucket
        self._flat = b.new_flat()
        b.bind_params(self._flat)  # the parameters are views of the replica: the subclass writes them in place
        self._grad = b.new_flat()
        self._step = 0
        self.mean_norm = MeanNorm() if self._clip_averaged and self.max_grad_norm > 0 else None
        """Measures the norm a local step clips by (``None``: this rank's own, or no clipping)."""
        self._make_buffers()

    # ------------------------------------------------------------------ for subclasses
    def _check_settings(self, optimizer: Optimizer) -> str:
        """Check and resolve the subclass's settings (raise ``ValueError``); return them as the ranks must agree."""
        return ""

    def _make_buffers(self) -> None:
        """Make the subclass's buffers (the bucket, the replica and the step exist)."""

    def _average_replicas(self) -> None:
        """Write the average of the replicas into the replica buffer (collective)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """Inside the block the parameters hold the average of the replicas; after it, this rank's own again.

        Collective: every rank must enter it (:meth:`_average_replicas`). Do not step inside the block.
        """
        with torch.no_grad():
            own = self._flat.clone()
            self._average_replicas()
        try:
            yield
        finally:
            with torch.no_grad():
                self._flat.copy_(own)

    # ------------------------------------------------------------------ state dict envelope
    _STATE_KEY = ""
    """The key of the wrapper's own entry in its ``state_dict()``, beside the wrapped optimizer's entries."""

    def _state_entry(self) -> StateDict:
        """The start of the wrapper's own entry: the step, this rank and the world size."""
        b = self._bucket
        return {"step": self._step, "rank": b.rank, "world_size": b.world_size}

    def _wrapped_state(self, entry: StateDict) -> StateDict:
        """The state dict: the wrapped optimizer's, plus ``entry`` under :attr:`_STATE_KEY`."""
        return {**self.optimizer.state_dict(), self._STATE_KEY: entry}

    def _read_entry(self, state_dict: StateDict) -> tuple[StateDict, int, int]:
        """The wrapper's own entry of ``state_dict``, its step and the rank that saved it (checked).

        Raises:
            ValueError: No such entry, or a bad step or rank.
        """
        key = self._STATE_KEY
        entry = state_dict.get(key) if isinstance(state_dict, dict) else None
        if not isinstance(entry, dict):
            raise ValueError(f"state_dict: not a {type(self).__name__}'s (no {key!r} entry)")
        step, rank = entry.get("step"), entry.get("rank")
        if type(step) is not int or step < 0 or type(rank) is not int or rank < 0:
            raise ValueError(f"state_dict: bad step {step!r} or rank {rank!r}")
        return entry, step, rank

    def _load_wrapped(self, state_dict: StateDict) -> None:
        """Load the wrapped optimizer's part of ``state_dict`` (all but the wrapper's own entry)."""
        self.optimizer.load_state_dict({k: v for k, v in state_dict.items() if k != self._STATE_KEY})

    # ------------------------------------------------------------------ torch.optim surface
    # param_groups, state and defaults are the wrapped optimizer's, also after its load_state_dict replaced them
    param_groups = _Wrapped("param_groups")  # type: ignore[assignment]
    state = _Wrapped("state")  # type: ignore[assignment]
    defaults = _Wrapped("defaults")  # type: ignore[assignment]

    def add_param_group(self, param_group: ParamGroup) -> None:
        if hasattr(self, "optimizer"):
            raise RuntimeError(f"{type(self).__name__}: param groups cannot be added after construction")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @staticmethod
    def _run_closure(closure: Callable[[], Any] | None) -> Any:
        """Run ``closure`` with grad enabled and return its loss (``None`` without one)."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _check_replica(self) -> None:
        """Check the parameters and re-bind those whose storage was replaced (their values kept)."""
        b = self._bucket
        b.check_params()
        if b.rebind(self._flat):
            logger.info("%s: the storage of parameters was replaced; re-bound with their values", type(self).__name__)

    def _inner_step(self, warm: bool) -> None:
        """The wrapped optimizer's step: on the averaged gradient if ``warm`` (collective then), clipped if asked."""
        b = self._bucket
        if warm and b.world_size > 1:
            average_grads(self._comm, b, self._grad)
        if self.max_grad_norm > 0:
            params = [p for p in b.params if p.grad is not None]
            if self.mean_norm is not None and not warm and b.world_size > 1:
                b.gather_grads(self._grad)
                norm = self.mean_norm.measure(self._comm, self._grad, self._step)
                torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, torch.tensor(norm))
                self.last_grad_norm = norm
            else:
                self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
        self.optimizer.step()


class SameReplicaWrapper(WrappingOptimizer):
    """A wrapper whose ranks step the same replica on the same exchanged gradient: the replicas never differ.

    The base of :class:`optim.CodedGradients`, :class:`optim.TopKGradients` and :class:`optim.DeMo`.
    """

    capabilities = OptimizerCapabilities(layout=StateLayout.REPLICATED, replicas_drift=False, own_snapshots=False)
    """Every rank takes the same step; snapshots: ``state_dict()`` and the parameters."""

    def _average_replicas(self) -> None:
        """The replicas are the same on every rank: nothing to average."""

    def _flat_entry(self, entry: StateDict, name: str, *, model_sized: bool = True) -> Tensor:
        """``entry[name]``, checked: a flat float32 buffer, at least as long as the model if ``model_sized``.

        Raises:
            ValueError: Missing, not a flat float32 buffer, or shorter than the model.
        """
        t = entry.get(name)
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.float32:
            raise ValueError(f"state_dict: {name} missing or not a flat float32 buffer")
        n = self._bucket.numel
        if model_sized and t.numel() < n:
            raise ValueError(f"state_dict: {name} holds {t.numel()} values, the model {n}")
        return t

    @torch.no_grad()
    def _take_model_part(self, into: Tensor, saved: Tensor) -> None:
        """Copy the model's positions of ``saved`` (padded for any world size) into ``into``; zero the rest."""
        n = self._bucket.numel
        into.zero_()
        into[:n].copy_(saved[:n])
