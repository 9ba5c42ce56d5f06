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

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import StateDict

from bindings import ReduceOp
from bindings.validate import check_int
from optim.optimizers.wrapping import WrappingOptimizer

__all__ = ["OuterLoop"]

logger = logging.getLogger(__name__)


class OuterLoop(WrappingOptimizer):
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

    _STATE_KEY = "outer"

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
        self._period_given, self._warmup_given, self._settings = period, warmup_steps, settings
        super().__init__(optimizer, model, max_grad_norm=max_grad_norm, group=group)

    def _check_settings(self, optimizer: Optimizer) -> str:
        self._period = check_int("period", self._period_given, low=1)
        self._warmup = check_int("warmup_steps", self._warmup_given, low=0)
        self._check_outer()
        return f"{self._period}|{self._warmup}|{self._settings}"

    def _make_buffers(self) -> None:
        self._global = self._flat.clone()
        self._make_outer_buffers()

    # ------------------------------------------------------------------ for subclasses
    def _check_outer(self) -> None:
        """Raise ``ValueError`` for a bad setting of the subclass (local, the same on every rank)."""

    def _make_outer_buffers(self) -> None:
        """Make the subclass's buffers (after the bucket and the global parameters exist)."""

    def _outer_step(self) -> None:
        """Move :attr:`global_params` by what the ranks send of their pseudo-gradients. Collective."""
        raise NotImplementedError

    def _outer_state(self) -> dict[str, Tensor]:
        """The subclass's buffers to save beside the global parameters, by name (live tensors)."""
        return {}

    # ------------------------------------------------------------------ torch.optim surface
    @property
    def period(self) -> int:
        """Steps between two outer steps (H)."""
        return self._period

    @property
    def warmup_steps(self) -> int:
        return self._warmup

    @property
    def global_params(self) -> Tensor:
        """The global parameters after the last outer (or warm-up) step, the same on every rank (padded flat fp32)."""
        return self._global

    def in_sync(self) -> bool:
        """Whether the replicas equal the global parameters now: in the warm-up and right after an outer step."""
        t = self._step
        return t <= self._warmup or (t - self._warmup) % self._period == 0

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the wrapped optimizer on this rank's gradient; every ``period`` local steps, an outer step.

        Collective: every rank must call this. In the warm-up the gradients
        are averaged first (one dense all_reduce).
        """
        loss = self._run_closure(closure)
        self._check_replica()
        t = self._step
        warm = t < self._warmup
        self._inner_step(warm)
        self._step = t + 1
        if warm:
            self._global.copy_(self._flat)
        elif self.in_sync():
            self._outer_step()
            self._flat.copy_(self._global)
        return loss

    # ------------------------------------------------------------------ the replicas' average
    def _average_replicas(self) -> None:
        """One dense all_reduce of the replicas; none right after an outer step (they are the global parameters)."""
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

    def close(self) -> None:
        """Nothing runs in the background: a no-op, for the callers of :meth:`optim.LocalOptimizer.close`."""

    # ------------------------------------------------------------------ state
    def state_dict(self) -> StateDict:
        """The wrapped optimizer's state dict, plus ``"outer"``: the step, this rank, the global parameters and more.

        Holds live tensors (copy or save it before the next step).
        """
        outer = self._state_entry()
        outer["global_params"] = self._global
        outer.update(self._outer_state())
        return self._wrapped_state(outer)

    @torch.no_grad()
    def load_state_dict(self, state_dict: StateDict) -> None:
        """Load a :meth:`state_dict` of this model and settings; the parameters are not touched.

        Local: no communication.

        Raises:
            ValueError: Not a state dict of this class, model and settings.
        """
        outer, step, _ = self._read_entry(state_dict)
        mine = {"global_params": self._global, **self._outer_state()}
        for key, buf in mine.items():
            src = outer.get(key)
            if not isinstance(src, Tensor) or src.shape != buf.shape or src.dtype != buf.dtype:
                raise ValueError(f"state_dict: {key} missing or not a {buf.dtype} buffer of {buf.numel()} elements")
        self._load_wrapped(state_dict)
        for key, buf in mine.items():
            buf.copy_(outer[key])
        self._step = step
