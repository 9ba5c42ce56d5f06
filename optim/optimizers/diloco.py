"""DiLoCo (Douillard et al. 2023): local steps of any optimizer, the averaged pseudo-gradient through Nesterov SGD.

Every rank runs ``period`` (H) steps of the wrapped optimizer (AdamW in the
paper) on its own replica; then the outer step: the pseudo-gradient
``delta = global - replica`` of every rank is averaged (one dense all_reduce,
float32 or bfloat16) and an outer SGD with Nesterov momentum (the published
defaults: learning rate 0.7, momentum 0.9) moves the global parameters, which
every replica then takes (:class:`optim.optimizers.outer.OuterLoop`)::

    m = momentum * m + mean(delta)
    global -= outer_lr * (mean(delta) + momentum * m)      # nesterov=False: global -= outer_lr * m

Wire bytes per step: one dense all_reduce every H steps, so ``dense / H``
(``dense / (2H)`` with bfloat16); at density ``d`` the equal-bytes period is
:func:`diloco_period` (``round(1 / d)`` in float32: 0.1 -> 10, 0.01 -> 100).
Memory beside the inner optimizer: the global parameters, the outer momentum
and the averaged pseudo-gradient (three fp32 copies of the model).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from bindings import ReduceOp
from bindings.validate import check_bool, check_choice, check_density, check_float
from optim.optimizers.averaging import WIRE_DTYPES
from optim.optimizers.outer import OuterLoop

__all__ = ["DiLoCo", "diloco_period"]


def diloco_period(density: float, wire_dtype: torch.dtype = torch.float32) -> int:
    """The period H at which DiLoCo's wire bytes per step are ``density`` times a dense fp32 all_reduce's.

    One all_reduce of the model in ``wire_dtype`` every H steps sends
    ``dense * (wire bytes / 4) / H`` per step, so ``H = round(wire bytes / (4 * density))``, at least 1.
    """
    d = check_density(density)
    check_choice("wire_dtype", wire_dtype, WIRE_DTYPES)
    size = torch.empty((), dtype=wire_dtype).element_size()
    return max(1, round(size / (4.0 * d)))


class DiLoCo(OuterLoop):
    """Wrap ``optimizer`` (the inner one): DiLoCo's outer Nesterov SGD on the averaged pseudo-gradient every H steps.

    See the module docstring.

    Args:
        optimizer, model, warmup_steps, max_grad_norm, group: As :class:`optim.optimizers.outer.OuterLoop`.
        period: Local steps between two outer steps (H, >= 1).
        outer_lr: The outer SGD's learning rate (> 0; 0.7 published).
        outer_momentum: Its momentum, in ``[0, 1)`` (0.9 published).
        nesterov: Nesterov momentum (published) or heavy ball.
        wire_dtype: ``torch.float32`` (default) or ``torch.bfloat16``: the pseudo-gradient on the wire.

    Raises:
        TypeError, ValueError: As :class:`optim.optimizers.outer.OuterLoop` (the same on every rank, before any
            communication but one small agreement).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        model: torch.nn.Module,
        *,
        period: int = 10,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        wire_dtype: torch.dtype = torch.float32,
        warmup_steps: int = 10,
        max_grad_norm: float = 0.0,
        group: Any = None,
    ) -> None:
        self._given = (outer_lr, outer_momentum, nesterov, wire_dtype)
        super().__init__(
            optimizer,
            model,
            period=period,
            warmup_steps=warmup_steps,
            max_grad_norm=max_grad_norm,
            group=group,
            settings=f"{outer_lr}|{outer_momentum}|{nesterov}|{wire_dtype}",
        )

    def _check_outer(self) -> None:
        outer_lr, momentum, nesterov, wire_dtype = self._given
        self.outer_lr = check_float("outer_lr", outer_lr, low=0.0, low_open=True)
        self.outer_momentum = check_float("outer_momentum", momentum, low=0.0, high=1.0, high_open=True)
        self.nesterov = check_bool("nesterov", nesterov)
        check_choice("wire_dtype", wire_dtype, WIRE_DTYPES)
        self.wire_dtype = wire_dtype

    def _make_outer_buffers(self) -> None:
        n = self._bucket.numel
        self._momentum = torch.zeros(n, dtype=torch.float32, device=self._bucket.device)
        self._delta = torch.zeros(n, dtype=self.wire_dtype, device=self._bucket.device)

    @property
    def momentum_buffer(self) -> Tensor:
        """The outer momentum (flat fp32, the same on every rank)."""
        return self._momentum

    def _outer_step(self) -> None:
        n, g, comm = self._bucket.numel, self._global[: self._bucket.numel], self._comm
        delta = self._delta
        if delta.dtype == torch.float32:
            torch.sub(g, self._flat[:n], out=delta)
        else:
            delta.copy_(g - self._flat[:n])
        with comm.stats.scope("diloco"):
            comm.all_reduce(delta, ReduceOp.AVG)
        avg = delta if delta.dtype == torch.float32 else delta.float()
        m, mu = self._momentum, self.outer_momentum
        m.mul_(mu).add_(avg)
        update = avg.add(m, alpha=mu) if self.nesterov else m
        g.sub_(update, alpha=self.outer_lr)

    def _outer_state(self) -> dict[str, Tensor]:
        return {"momentum": self._momentum}
