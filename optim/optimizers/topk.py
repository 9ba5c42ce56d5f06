"""Top-k gradient sparsification with error feedback: :class:`TopKAdamS` and :class:`TopKGradients`.

The classic sparsifier the convergence suite compares against: every step
each rank adds its gradient to its residual, sends the ``k`` entries of the
largest magnitude (fp32 values with their int32 positions, all-gathered) and
keeps the rest for the next steps; every rank steps on the same average of
what the ranks sent (:func:`topk_average`). :class:`TopKAdamS` runs AdamS on it
(the replicated layout of :mod:`optim.optimizers.replicated`, shared with
:class:`optim.optimizers.local.LocalAdamS`); :class:`TopKGradients` wraps any
plain ``torch.optim`` optimizer (:class:`optim.optimizers.wrapping.WrappingOptimizer`).

Wire bytes per step: ``k = ceil(density * numel / world_size)`` values and
positions from every rank (8 bytes each), the same bytes as a dense fp32
all_reduce's times ``density``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT, StateDict

from bindings.validate import check_density, check_int
from optim.optimizers.replicated import ReplicatedAdamS
from optim.optimizers.wrapping import SameReplicaWrapper, set_grads
from sparsecomm.mask import k_for

__all__ = ["TopKAdamS", "TopKGradients", "topk_average"]


def topk_average(comm: Any, residual: Tensor, numel: int, k: int, out: Tensor) -> None:
    """Send this rank's ``k`` largest entries of ``residual[:numel]``; ``out`` gets the ranks' average of them.

    Collective: every rank must call this (the same ``numel`` and ``k``). The
    sent entries are zeroed in ``residual`` (error feedback: the rest waits for
    later steps); ``out`` (the residual's size) is zero where no rank sent.

    Args:
        comm: The communicator.
        residual: This rank's gradient plus what it has not sent yet (flat fp32).
        numel: The positions that may be sent (the rest of ``residual`` is padding).
        k: Entries every rank sends.
        out: Receives the average.
    """
    ws = comm.world_size
    idx = torch.topk(residual[:numel].abs(), k, sorted=False).indices
    vals = residual.index_select(0, idx)
    residual.index_fill_(0, idx, 0.0)
    all_vals = torch.empty(ws * k, dtype=vals.dtype, device=vals.device)
    all_idx = torch.empty(ws * k, dtype=torch.int32, device=vals.device)
    with comm.stats.scope("topk"):
        comm.all_gather(all_vals, vals)
        comm.all_gather(all_idx, idx.to(torch.int32))
    out.zero_()
    out.index_add_(0, all_idx.long(), all_vals)
    out.div_(ws)


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
        b = self._bucket
        self._residual.add_(g)
        topk_average(self._comm, self._residual, b.numel, min(self.k, b.numel), self._sum)
        return self._sum

    def _full_state(self) -> dict[str, Tensor]:
        return {**super()._full_state(), "residual": self._residual}


class TopKGradients(SameReplicaWrapper):
    """Wrap ``optimizer``: every step it steps on the average of every rank's top-k gradient entries (a baseline).

    See the module docstring. Every rank steps the wrapped optimizer on the
    same sparse average (zero where no rank sent), clipped by its norm; the
    replicas never drift apart.

    Args:
        optimizer: A ``torch.optim`` optimizer over ``model``'s trainable
            parameters (fp32, one device), not one of ours.
        model: The model it trains, the same on every rank.
        density: Wire bytes per step as a fraction of a dense fp32 all_reduce's:
            every rank sends ``k = ceil(density * numel / world_size)`` values and positions.
        warmup_steps: Steps whose gradients are averaged dense (fp32) first.
        max_grad_norm: Clip the averaged gradient to this global norm (0: no clipping).
        group: The process group (default: the default group of :mod:`sparsecomm.distributed`).

    Raises:
        TypeError: ``optimizer`` is not a plain torch optimizer, or ``model`` not a module.
        ValueError: A bad setting, an optimizer wrapped twice, parameters that
            are not the model's trainable ones or not fp32, or models that differ
            between ranks (the same on every rank, before any communication but
            one small agreement).
    """

    _STATE_KEY = "topk"

    def __init__(
        self,
        optimizer: Optimizer,
        model: torch.nn.Module,
        *,
        density: float = 0.01,
        warmup_steps: int = 10,
        max_grad_norm: float = 0.0,
        group: Any = None,
    ) -> None:
        self._given = (density, warmup_steps)
        super().__init__(optimizer, model, max_grad_norm=max_grad_norm, group=group)

    def _check_settings(self, optimizer: Optimizer) -> str:
        density, warmup_steps = self._given
        self.density = check_density(density)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, low=0)
        b = self._bucket
        self.k = min(k_for(b.numel, b.world_size, self.density), b.numel)
        """Entries every rank sends per step."""
        return f"{self.density}|{self.warmup_steps}"

    def _make_buffers(self) -> None:
        self._residual = self._bucket.new_flat()  # what this rank has not sent yet

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Average the gradients (dense in the warm-up, the ranks' top-k after it), then step the wrapped optimizer.

        Collective: every rank must call this.
        """
        loss = self._run_closure(closure)
        self._check_replica()
        warm = self._step < self.warmup_steps
        b = self._bucket
        if not warm and b.world_size > 1:
            missing = set(b.gather_grads(self._grad))
            self._residual.add_(self._grad)
            topk_average(self._comm, self._residual, b.numel, self.k, self._grad)
            set_grads(b, self._grad, missing)
        self._inner_step(warm)
        self._step += 1
        return loss

    @property
    def residual(self) -> Tensor:
        """The gradient this rank has not sent yet (padded flat fp32)."""
        return self._residual

    def state_dict(self) -> StateDict:
        """The wrapped optimizer's state dict, plus ``"topk"``: the step, this rank and its residual.

        Holds live tensors (copy or save it before the next step).
        """
        return self._wrapped_state({**self._state_entry(), "residual": self._residual})

    @torch.no_grad()
    def load_state_dict(self, state_dict: StateDict) -> None:
        """Load a :meth:`state_dict` saved under any world size (same model and settings); local.

        Raises:
            ValueError: Not a TopKGradients' state dict of this model.
        """
        entry, step, _ = self._read_entry(state_dict)
        residual = self._flat_entry(entry, "residual")
        self._load_wrapped(state_dict)
        self._take_model_part(self._residual, residual)
        self._step = step
