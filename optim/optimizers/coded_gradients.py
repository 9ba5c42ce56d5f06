"""Any ``torch.optim`` optimizer on the ranks' averaged gradient, averaged in low-bit codes (:class:`CodedGradients`).

Every step the ranks average their gradients through
:func:`sparsecomm.quantized.quantized_all_reduce` (a reduce-scatter and an
all-gather of blockwise codes, error feedback on both sides: each rank keeps
what its codes dropped and adds it to its next gradient, each owner what the
codes of its average dropped), then every rank steps the wrapped optimizer on
the same decoded average. The replicas never drift apart: unlike the local
methods (:class:`optim.LocalOptimizer`, :class:`optim.DiLoCo`), the wrapped
optimizer sees the averaged gradient, as in dense data-parallel training, so
Adam's second moment holds the averaged gradient's noise and clipping clips the
average. What differs from dense training is only the codes' error, which
error feedback carries into the next steps.

Blockwise codes err in proportion to each block's largest or typical value, so
a coordinate whose gradient is small beside its block's neighbours gets a
large relative error, while Adam steps every coordinate by its gradient over
its own ``sqrt(v_hat) + eps``. For Adam and AdamW (``precondition="adam"``,
the default for them) the codes carry the gradient divided by that
denominator, which every rank holds alike, so their error is even over the
coordinates as the step sees them; the residuals stay in the gradient's units.

Wire bytes per step: the mean of the two directions' bits per value over 32
of a dense fp32 all_reduce (:func:`wire_cost`; at density 0.1, 2-bit codes
from the ranks and 4-bit codes of the averages, 0.0996): this method needs a
density of at least 0.037 (:func:`coded_bits`). Memory beside the
wrapped optimizer's state: the gradient's residual (one fp32 copy of the
model), the owner's residual (one fp32 shard), one flat fp32 gradient and,
when preconditioning, one flat fp32 copy of the denominator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import StateDict

from bindings.validate import check_choice, check_density, check_int
from optim.optimizers.wrapping import SameReplicaWrapper, adam_moments, set_grads
from sparsecomm.quantized import QUANT_BITS, Quantizer, quantized_all_reduce

__all__ = [
    "CODED_MIN_DENSITY",
    "GATHER_BLOCK",
    "PRECONDITIONS",
    "SCALE_FLOOR",
    "SEND_BLOCK",
    "CodedGradients",
    "coded_bits",
    "wire_cost",
]


SEND_BLOCK = 64
"""Values per scale of the codes every rank sends to the owners."""

GATHER_BLOCK = 128
"""Values per scale of the codes of the averages the owners send to every rank."""


PRECONDITIONS = ("auto", "adam", "none")
"""Choices of ``CodedGradients(precondition=...)``."""

SCALE_FLOOR = 0.01
"""The preconditioning scale's floor, as a fraction of its mean over each tensor."""


def wire_cost(send_bits: int, gather_bits: int) -> float:
    """Wire bytes of a step as a fraction of a dense fp32 all_reduce's (a reduce-scatter and an all-gather each way)."""
    send = Quantizer(bits=send_bits, block=SEND_BLOCK).bits_per_value()
    gather = Quantizer(bits=gather_bits, block=GATHER_BLOCK).bits_per_value()
    return (send + gather) / 2.0 / 32.0


CODED_MIN_DENSITY = wire_cost(min(QUANT_BITS), min(QUANT_BITS))
"""The lowest density coded gradients fit: 1-bit codes both ways (0.0371)."""


def coded_bits(density: float) -> tuple[int, int]:
    """The codes ``(send_bits, gather_bits)`` that fit ``density``: the widest gathered code, then the widest sent.

    The averages' codes count more than the ranks' (every rank steps on the
    decoded average, while the ranks' errors shrink in the average): on the
    convergence suite's worst cell 2-bit ranks and a 4-bit average came within
    1.05x of dense AdamW where the reverse came to 1.20x (``benchmarks/README.md``).
    At 0.1: ``(2, 4)``; from 0.131: ``(4, 4)``.

    Raises:
        ValueError: ``density`` is below the cheapest pair's cost (1-bit codes both ways, 0.037).
    """
    d = check_density(density)
    for gather in sorted(QUANT_BITS, reverse=True):
        for send in sorted((b for b in QUANT_BITS if b <= gather), reverse=True):
            if wire_cost(send, gather) <= d + 1e-12:
                return send, gather
    raise ValueError(
        f"Invalid density: {density!r} (coded gradients send at least {CODED_MIN_DENSITY:.4f} of the dense bytes)"
    )


class CodedGradients(SameReplicaWrapper):
    """Wrap ``optimizer``: every step it steps on the ranks' average gradient, averaged in low-bit codes.

    See the module docstring.

    Args:
        optimizer: A ``torch.optim`` optimizer over ``model``'s trainable
            parameters (fp32, one device), not one of ours.
        model: The model it trains, the same on every rank.
        density: Wire bytes per step as a fraction of a dense fp32
            all_reduce: picks the codes (:func:`coded_bits`) that ``bits`` leaves ``"auto"``.
        bits: ``"auto"`` (default) or ``(send_bits, gather_bits)``, each one of 1, 2, 4, 8: the codes
            every rank sends to the owners and the codes of the averages; they set the bytes, not ``density``.
        warmup_steps: Steps whose gradients are averaged dense (fp32) first.
        precondition: ``"adam"``: the codes carry every gradient divided by the wrapped Adam's or AdamW's
            denominator ``sqrt(v_hat) + eps`` (the same on every rank: the replicas are one model), so their
            error is even over the coordinates as Adam's step sees them, not over their raw magnitudes;
            ``"none"``: the raw gradient; ``"auto"`` (default): ``"adam"`` for Adam and AdamW without
            ``amsgrad``, ``"none"`` for others.
        max_grad_norm: Clip the averaged gradient to this global norm (0: no clipping).
        group: The process group (default: the default group of :mod:`sparsecomm.distributed`).

    Raises:
        TypeError: ``optimizer`` is not a plain torch optimizer, or ``model`` not a module.
        ValueError: A bad setting, an optimizer wrapped twice, parameters that
            are not the model's trainable ones or not fp32, or models that differ
            between ranks (the same on every rank, before any communication but
            one small agreement).
    """

    _STATE_KEY = "coded"

    def __init__(
        self,
        optimizer: Optimizer,
        model: torch.nn.Module,
        *,
        density: float = 0.1,
        bits: tuple[int, int] | str = "auto",
        warmup_steps: int = 10,
        precondition: str = "auto",
        max_grad_norm: float = 0.0,
        group: Any = None,
    ) -> None:
        self._given = (density, bits, warmup_steps, precondition)
        super().__init__(optimizer, model, max_grad_norm=max_grad_norm, group=group)

    def _check_settings(self, optimizer: Optimizer) -> str:
        density, bits, warmup_steps, precondition = self._given
        self.density = check_density(density)
        if bits == "auto":
            bits = coded_bits(self.density)
        elif not (isinstance(bits, tuple | list) and len(bits) == 2 and all(b in QUANT_BITS for b in bits)):
            raise ValueError(f"Invalid bits: {bits!r} (must be 'auto' or (send_bits, gather_bits) of {QUANT_BITS})")
        self.quantizer = Quantizer(bits=int(bits[0]), block=SEND_BLOCK)
        """The codes every rank sends to the owners."""
        self.gather_quantizer = Quantizer(bits=int(bits[1]), block=GATHER_BLOCK)
        """The codes of the averages the owners send to every rank."""
        self.warmup_steps = check_int("warmup_steps", warmup_steps, low=0)
        check_choice("precondition", precondition, PRECONDITIONS)
        if precondition == "adam" and not adam_moments(optimizer):
            raise ValueError(
                f"precondition='adam' divides by the second moment of torch.optim.Adam / AdamW without amsgrad, "
                f"not of {type(optimizer).__name__}: use precondition='none'"
            )
        if precondition == "auto":
            precondition = "adam" if adam_moments(optimizer) else "none"
        self.precondition = precondition
        """``"adam"`` or ``"none"`` (``"auto"`` resolved)."""
        codes = f"{self.quantizer.bits}|{self.gather_quantizer.bits}"
        return f"{self.density}|{codes}|{self.warmup_steps}|{self.precondition}"

    def _make_buffers(self) -> None:
        b = self._bucket
        self._residual = b.new_flat()  # what this rank's codes dropped, added to its next gradient
        self._own_residual = b.new_shard()  # what the codes of this rank's chunk of the average dropped
        self._scale = b.new_flat() if self.precondition == "adam" else None  # Adam's denominator, per position

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Average the gradients (dense in the warm-up, in codes after it), then step the wrapped optimizer.

        Collective: every rank must call this.
        """
        loss = self._run_closure(closure)
        self._check_replica()
        warm = self._step < self.warmup_steps
        if not warm and self._bucket.world_size > 1:
            self._average_coded()
        self._inner_step(warm)  # the warm-up's dense average, the clip by the (averaged) gradient's norm, the step
        self._step += 1
        return loss

    def _average_coded(self) -> None:
        """Average the gradients in codes; the residuals are kept in the gradient's own units."""
        b, g = self._bucket, self._grad
        missing = set(b.gather_grads(g))
        g.add_(self._residual)
        scale = self._adam_scale()
        own = self._own_residual
        if scale is not None:  # the codes see the gradient as Adam's step will
            own_scale = b.own_slice(scale)
            g.div_(scale)
            own.div_(own_scale)
        try:
            with self._comm.stats.scope("coded_gradients"):
                error = quantized_all_reduce(
                    self._comm, g, self.quantizer, residual=own, gather_quantizer=self.gather_quantizer
                )
        finally:
            if scale is not None:
                own.mul_(own_scale)
        if scale is not None:
            error.mul_(scale)
            g.mul_(scale)
        self._residual.copy_(error)
        # the padding is no position of the model: what the codes made of its zeros is dropped, not carried
        self._residual[b.numel :].zero_()
        own[max(0, b.numel - b.shard_lo) :].zero_()
        set_grads(b, g, missing)

    def _adam_scale(self) -> Tensor | None:
        """Fill the scale buffer with Adam's denominator ``sqrt(v_hat) + eps`` per position (``precondition="adam"``).

        The same on every rank (the wrapped optimizers' states are). Floored at 1% of its mean over the tensor, so
        a coordinate whose ``v`` is still 0 does not blow its block up; 1 where a parameter has no state yet and in
        the padding. ``None`` without preconditioning.
        """
        scale = self._scale
        if scale is None:
            return None
        scale.fill_(1.0)
        b = self._bucket
        offsets = {id(p): off for p, off in zip(b.params, b.offsets, strict=True)}
        for group in self.optimizer.param_groups:
            beta2, eps = group["betas"][1], group["eps"]
            for p in group["params"]:
                st = self.optimizer.state.get(p)
                if not st or "exp_avg_sq" not in st:
                    continue
                off = offsets[id(p)]
                view = scale[off : off + p.numel()].view(p.shape)
                torch.div(st["exp_avg_sq"], 1.0 - beta2 ** float(st["step"]), out=view)
                view.sqrt_().add_(eps)
                view.clamp_(min=float(view.mean()) * SCALE_FLOOR)
        return scale

    # ------------------------------------------------------------------ state
    @property
    def local_state(self) -> dict[str, Tensor]:
        """What the wrapper keeps beside the wrapped optimizer's state, by name (both residuals)."""
        return {"residual": self._residual, "own_residual": self._own_residual}

    def state_dict(self) -> StateDict:
        """The wrapped optimizer's state dict, plus ``"coded"``: the step, this rank and both residuals.

        Holds live tensors (copy or save it before the next step).
        """
        return self._wrapped_state({**self._state_entry(), **self.local_state})

    @torch.no_grad()
    def load_state_dict(self, state_dict: StateDict) -> None:
        """Load a :meth:`state_dict` saved under any world size (same model and settings).

        Local: no communication. This rank's residual is the saved rank's; the
        owner's residual is kept where this rank owned positions then and owns
        now (zero elsewhere: under a new layout what the codes dropped there is lost).

        Raises:
            ValueError: Not a CodedGradients' state dict of this model.
        """
        coded, step, rank = self._read_entry(state_dict)
        residual = self._flat_entry(coded, "residual")
        own = self._flat_entry(coded, "own_residual", model_sized=False)
        self._load_wrapped(state_dict)
        self._take_model_part(self._residual, residual)
        self._bucket.take_own(self._own_residual, own, rank)
        self._step = step
