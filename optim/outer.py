"""Inner and outer steps: the loop :class:`optim.DiLoCo` and :class:`optim.SparseLoCo` share (:class:`OuterLoop`).

Every rank steps its own replica of the model with a wrapped ``torch.optim``
optimizer (the *inner* optimizer, say :class:`torch.optim.AdamW`) for
``period`` (H) steps; then an *outer step*, which a subclass defines
(:meth:`OuterLoop._outer_step`), moves the *global parameters* (the same on
every rank) by what the ranks send of their *pseudo-gradients*
``global - replica``, and every replica takes the new global parameters. The
first ``warmup_steps`` steps average the gradients instead (one dense
all_reduce each, like :class:`optim.LocalOptimizer`), so the replicas start the
local phase identical; the outer steps fall after local steps ``H, 2H, ...``
of the local phase.

The replicas must start identical (the same seed) when ``warmup_steps`` is 0.
Memory beside the inner optimizer's own state: the global parameters (one fp32
copy of the model) and the gradient buffer of the warm-up; the parameters
become views of one flat fp32 buffer.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

import sparsecomm.distributed as dist
from bindings import ReduceOp
from optim.buckets import FlatBucket
from optim.local_optimizer import _WRAPPED, _check_inner, _Wrapped, average_grads
from optim.sharded import agree

__all__ = ["OuterLoop", "check_period", "check_rate"]

logger = logging.getLogger(__name__)


def check_period(value: object) -> int:
    """``value`` if it is an int >= 1 (steps between two outer steps), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Invalid period: {value!r} (must be an int >= 1)")
    return value


def check_rate(
    name: str, value: object, *, low: float, high: float, low_open: bool = False, high_open: bool = False
) -> float:
    """``value`` as a float if it is a finite number between ``low`` and ``high`` (each end excluded if ``*_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"Invalid {name}: {value!r} (must be a finite number)")
    v = float(value)
    if v < low or v > high or (low_open and v == low) or (high_open and v == high):
        where = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"Invalid {name}: {value!r} (must be in {where})")
    return v


class OuterLoop(Optimizer):
    """Wrap ``optimizer``: local steps of every rank's replica, an outer step every ``period`` steps (a base class).

    See the module docstring. ``param_groups`` and ``state`` are the wrapped
    optimizer's (an LR scheduler built over the wrapper drives it).
    Subclasses check their settings in :meth:`_check_settings`, make their
    buffers in :meth:`_make_buffers` and define :meth:`_outer_step`.

    Args:
        optimizer: A ``torch.optim`` optimizer over ``model``'s trainable
            parameters (fp32, one device), not one of ours.
        model: The model it trains, the same on every rank.
        period: Steps between two outer steps (H).
        warmup_steps: Steps that average the gradients (dense) before the local phase.
        max_grad_norm: Clip the gradient the wrapped optimizer sees (the
            averaged one in the warm-up, this rank's own after it) to this
            global norm; 0 (default): no clipping.
        group: The process group (default: the default group of :mod:`sparsecomm.distributed`).
        settings: The subclass's settings, as they enter the agreement of the ranks.

    Raises:
        TypeError: ``optimizer`` is not a plain torch optimizer, or ``model`` not a module.
        ValueError: A bad setting, an optimizer wrapped twice, parameters that
            are not the model's trainable ones or not fp32, or settings or
            models that differ between ranks (before any communication but one
            small agreement, the same on every rank).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        model: torch.nn.Module,
        *,
        period: int,
        warmup_steps: int,
        max_grad_norm: float,
        group: Any,
        settings: str,
    ) -> None:
        self._comm = dist.get_communicator(group)
        name = type(self).__name__
        error: ValueError | TypeError | None = None
        fp = 0
        try:
            if isinstance(optimizer, OuterLoop):
                raise TypeError(
                    f"optimizer: {type(optimizer).__name__} synchronizes the ranks itself; wrap a plain torch.optim "
                    "optimizer (e.g. torch.optim.AdamW) that steps this rank's replica alone"
                )
            _check_inner(optimizer, model)
            self._period = check_period(period)
            if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
                raise ValueError(f"Invalid warmup_steps: {warmup_steps!r} (must be an int >= 0)")
            self.max_grad_norm = check_rate("max_grad_norm", max_grad_norm, low=0.0, high=math.inf, high_open=True)
            groups = [{"params": g["params"], "wd_min_ndim": 0} for g in optimizer.param_groups]
            self._bucket = FlatBucket(groups, self._comm.rank, self._comm.world_size)
            if self._bucket.dtype != torch.float32:
                raise ValueError(f"params: {name} steps fp32 parameters, got {self._bucket.dtype}")
            self._check_settings()
            fp = self._bucket.fingerprint(
                f"{name}|{type(optimizer).__qualname__}|{period}|{warmup_steps}|{max_grad_norm}|{settings}"
            )
        except (ValueError, TypeError) as exc:
            error = exc
        agree(self._comm, fp, error)
        super().__init__([{"params": list(g["params"])} for g in optimizer.param_groups], {})
        self.optimizer = optimizer
        """The wrapped (inner) optimizer: it steps this rank's replica."""
        _WRAPPED.add(optimizer)
        self.model = model
        self._warmup = warmup_steps
        self.last_grad_norm: float | None = None
        """The global norm of the gradient the wrapped optimizer saw at the last step (``max_grad_norm`` set)."""
        b = self._bucket
        self._flat = b.new_flat()
        b.bind_params(self._flat)  # the parameters are views of the replica: the outer step writes them in place
        self._global = self._flat.clone()
        self._grad = b.new_flat()
        self._step = 0
        self._make_buffers()

    # ------------------------------------------------------------------ for subclasses
    def _check_settings(self) -> None:
        """Raise ``ValueError`` for a bad setting of the subclass (local, the same on every rank)."""

    def _make_buffers(self) -> None:
        """Make the subclass's buffers (after the bucket and the global parameters exist)."""

    def _outer_step(self) -> None:
        """Move :attr:`global_params` by what the ranks send of their pseudo-gradients. Collective."""
        raise NotImplementedError

    def _outer_state(self) -> dict[str, Tensor]:
        """The subclass's buffers to save beside the global parameters, by name (live tensors)."""
        return {}

    # ------------------------------------------------------------------ torch.optim surface
    param_groups = _Wrapped("param_groups")  # type: ignore[assignment]
    state = _Wrapped("state")  # type: ignore[assignment]
    defaults = _Wrapped("defaults")  # type: ignore[assignment]

    @property
    def period(self) -> int:
        """Steps between two outer steps (H)."""
        return self._period

    @property
    def warmup_steps(self) -> int:
        return self._warmup

    @property
    def bucket(self) -> FlatBucket:
        """The flat layout of the parameters."""
        return self._bucket

    @property
    def communicator(self) -> Any:
        return self._comm

    @property
    def global_params(self) -> Tensor:
        """The global parameters after the last outer (or warm-up) step, the same on every rank (padded flat fp32)."""
        return self._global

    def in_sync(self) -> bool:
        """Whether the replicas equal the global parameters now: in the warm-up and right after an outer step."""
        t = self._step
        return t <= self._warmup or (t - self._warmup) % self._period == 0

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "optimizer"):
            raise RuntimeError(f"{type(self).__name__}: param groups cannot be added after construction")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the wrapped optimizer on this rank's gradient; every ``period`` local steps, an outer step.

        Collective: every rank must call this. In the warm-up the gradients
        are averaged first (one dense all_reduce).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t, b = self._step, self._bucket
        b.check_params()
        if b.rebind(self._flat):
            logger.info("%s: the storage of parameters was replaced; re-bound with their values", type(self).__name__)
        warm = t < self._warmup
        if warm and b.world_size > 1:
            average_grads(self._comm, b, self._grad)
        if self.max_grad_norm > 0:
            params = [p for p in b.params if p.grad is not None]
            self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
        self.optimizer.step()
        self._step = t + 1
        if warm:
            self._global.copy_(self._flat)
        elif self.in_sync():
            self._outer_step()
            self._flat.copy_(self._global)
        return loss

    # ------------------------------------------------------------------ the replicas' average
    def _average_replicas(self) -> None:
        if self.in_sync():
            return  # every replica holds the global parameters
        with self._comm.stats.scope("average"):
            self._comm.all_reduce(self._flat, ReduceOp.AVG)

    @torch.no_grad()
    def average_params(self) -> None:
        """Average every rank's replica into the parameters and the global parameters, for good.

        Collective: every rank must call this (one dense all_reduce, none
        right after an outer step). Once training is over, or before saving a
        model that must be the same on every rank; the wrapped optimizer's
        state and the outer state are kept.
        """
        self._average_replicas()
        self._global.copy_(self._flat)

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """Inside the block the parameters hold the average of the replicas; after it, this rank's own again.

        Collective: every rank must enter it (one dense all_reduce, none right
        after an outer step, when the replicas are the global parameters). Do
        not step inside the block.
        """
        with torch.no_grad():
            own = self._flat.clone()
            self._average_replicas()
        try:
            yield
        finally:
            with torch.no_grad():
                self._flat.copy_(own)

    def close(self) -> None:
        """Nothing runs in the background: a no-op, for the callers of :meth:`optim.LocalOptimizer.close`."""

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, plus ``"outer"``: the step, this rank, the global parameters and more.

        Holds live tensors (copy or save it before the next step).
        """
        b = self._bucket
        outer: dict[str, Any] = {"step": self._step, "rank": b.rank, "world_size": b.world_size}
        outer["global_params"] = self._global
        outer.update(self._outer_state())
        return {**self.optimizer.state_dict(), "outer": outer}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` of this model and settings; the parameters are not touched.

        Local: no communication.

        Raises:
            ValueError: Not a state dict of this class, model and settings.
        """
        name = type(self).__name__
        outer = state_dict.get("outer") if isinstance(state_dict, dict) else None
        if not isinstance(outer, dict):
            raise ValueError(f"state_dict: not a {name}'s (no 'outer' entry)")
        step = outer.get("step")
        if type(step) is not int or step < 0:
            raise ValueError(f"state_dict: bad step {step!r}")
        mine = {"global_params": self._global, **self._outer_state()}
        for key, buf in mine.items():
            src = outer.get(key)
            if not isinstance(src, Tensor) or src.shape != buf.shape or src.dtype != buf.dtype:
                raise ValueError(f"state_dict: {key} missing or not a {buf.dtype} buffer of {buf.numel()} elements")
        self.optimizer.load_state_dict({k: v for k, v in state_dict.items() if k != "outer"})
        for key, buf in mine.items():
            buf.copy_(outer[key])
        self._step = step
