"""TopKAdamS: AdamS on the average of every rank's top-k gradient entries, with error feedback.

The classic sparsifier the convergence suite compares against (values travel
with their int32 indices); see :mod:`optim.optimizers.replicated` for the replicated layout
it shares with :class:`optim.optimizers.local.LocalAdamS`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from optim.optimizers.replicated import ReplicatedAdamS

__all__ = ["TopKAdamS"]


class TopKAdamS(ReplicatedAdamS):
    """AdamS on the average of every rank's top-k gradient entries, with error feedback (a baseline).

    Arguments as :class:`LocalAdamS` without ``schedule``. ``density`` sets
    ``k = ceil(density * shard_size)`` entries per rank per step, so values and
    indices together put SCAPE's value bytes on the wire at the same density.

    Raises:
        ValueError: Bad arguments (before any communication, the same on every rank).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        *,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        density: float = 0.01,
        warmup_steps: int = 10,
        max_grad_norm: float = 0.0,
        bias_correction: bool = True,
        group: Any = None,
        wd_min_ndim: int = 2,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            density=density,
            warmup_steps=warmup_steps,
            max_grad_norm=max_grad_norm,
            bias_correction=bias_correction,
            group=group,
            wd_min_ndim=wd_min_ndim,
            config="TopKAdamS",
        )
        self._residual = self._bucket.new_flat()
        self._sum = self._bucket.new_flat()

    @property
    def residual(self) -> Tensor:
        """The gradient this rank has not sent yet (padded flat fp32)."""
        return self._residual

    def _sparse_grad(self, t: int, g: Tensor) -> Tensor:
        b, comm, e = self._bucket, self._comm, self._residual
        n, ws, k = b.numel, b.world_size, min(self.k, b.numel)
        e.add_(g)
        idx = torch.topk(e[:n].abs(), k, sorted=False).indices
        vals = e.index_select(0, idx)
        e.index_fill_(0, idx, 0.0)
        all_vals = torch.empty(ws * k, dtype=vals.dtype, device=vals.device)
        all_idx = torch.empty(ws * k, dtype=torch.int32, device=vals.device)
        with comm.stats.scope("topk"):
            comm.all_gather(all_vals, vals)
            comm.all_gather(all_idx, idx.to(torch.int32))
        out = self._sum
        out.zero_()
        out.index_add_(0, all_idx.long(), all_vals)
        out.div_(ws)
        return out

    def _full_state(self) -> dict[str, Tensor]:
        return {**super()._full_state(), "residual": self._residual}
