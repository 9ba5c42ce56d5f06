"""How much of a rank's estimated gradient noise is noise across ranks: a measurement with one tiny all_reduce.

LocalAdamS's debiased normalizer (:func:`optim.optimizers.adams.debiased_adams_step_`)
estimates the variance of a rank's gradient per coordinate from the rank's
own history, ``E[g**2] - E[g]**2``, and takes ``(1 - 1/P)`` of it out of the
normalizer, as if all of it were the batch noise that averaging over ``P``
ranks would remove. The history also holds how the gradient moves over the
steps (the loss landscape changes under the parameters; oscillating
coordinates flip sign), which the averaged gradient of dense AdamS keeps.
Over-estimated noise makes the local steps larger than dense AdamS's.

:class:`NoiseScale` measures the noise across ranks directly: for the
ranks' gradients ``g_r`` and their average ``g``,
``mean_r |g_r|**2 - |g|**2`` is ``(1 - 1/P)`` times the batch noise, summed
over the coordinates. ``|g|**2`` comes from a sketch: with random signs
``s_i`` shared by every rank (drawn again at every step), the ``k`` sums
``sum_{i = j mod k} s_i g_i`` have ``E[sum_j (.)**2] = |g|**2``, and the
sketch of the average is the average of the ranks' sketches. One all_reduce
of ``k + 2`` float32 values (the sketch, ``|g_r|**2`` and the rank's
estimate) gives every rank the same ratio

    ``rho = EMA(measured noise) / EMA(estimated noise)``, clamped to [0, 1],

the share of the estimate to take out (the EMAs over steps make the
sketch's variance, ``2 |g|**4 / k`` per step, small).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import StateDict

from bindings import ReduceOp
from bindings.validate import check_int
from optim.optimizers.sharded import squared_norm

__all__ = [
    "MeanNorm",
    "NoiseScale",
    "averaged_sketch",
    "check_noise_state",
    "effective_world_size",
    "local_share",
    "sign_sketch",
]


def _check_columns(columns: object) -> None:
    check_int("columns", columns, low=1)


def check_noise_state(state: StateDict, key: str = "noise_ema") -> Tensor:
    """Return ``state[key]``: :meth:`NoiseScale.state_dict`'s ``noise_ema`` or :meth:`MeanNorm.state_dict`'s.

    Raises:
        ValueError: Missing or not two float64 values.
    """
    src = state.get(key)
    if not isinstance(src, Tensor) or tuple(src.shape) != (2,) or src.dtype != torch.float64:
        got = None if not isinstance(src, Tensor) else (tuple(src.shape), src.dtype)
        raise ValueError(f"{key} should be a (2,) float64 tensor, got {got}")
    return src


def sign_sketch(g: Tensor, columns: int, generator: torch.Generator) -> Tensor:
    """The ``columns`` random-sign column sums of ``g`` (1-D): their squares sum to ``|g|**2`` in expectation.

    Position ``i`` goes to column ``i mod columns`` with the sign of its row
    ``i // columns``; the signs are drawn from ``generator`` (one per row).
    Linear in ``g``: the sketch of an average is the average of the sketches.
    """
    if g.dim() != 1:
        raise ValueError(f"g must be 1-D, got shape {tuple(g.shape)}")
    _check_columns(columns)
    n = g.numel()
    rows, tail = divmod(n, columns)
    signs = torch.randint(0, 2, (rows + 1,), generator=generator).to(device=g.device, dtype=g.dtype)
    signs.mul_(2.0).sub_(1.0)
    out = torch.zeros(columns, dtype=g.dtype, device=g.device)
    if rows:
        out.add_(signs[:rows] @ g[: rows * columns].view(rows, columns))
    if tail:
        out[:tail].add_(g[rows * columns :], alpha=float(signs[rows]))
    return out


def averaged_sketch(
    comm: Any, g: Tensor, columns: int, seed: int, step: int, scope: str, extra: tuple[float, ...] = ()
) -> Tensor:
    """The ranks' average of ``[sign_sketch(g), |g|**2, *extra]`` (float64, on the CPU).

    Collective: every rank must call this with the same ``seed``, ``step``
    and sizes (one all_reduce of ``columns + 1 + len(extra)`` float32 values,
    stats scope ``scope``). The signs are drawn from ``seed`` and ``step``:
    the same on every rank, new at every step.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + int(step))
    vec = torch.empty(columns + 1 + len(extra), dtype=torch.float32, device=g.device)
    vec[:columns] = sign_sketch(g, columns, gen)
    vec[columns] = float(squared_norm(g))
    for i, x in enumerate(extra):
        vec[columns + 1 + i] = x
    with comm.stats.scope(scope):
        comm.all_reduce(vec, ReduceOp.AVG)
    return vec.double().cpu()


def local_share(steps: int, warmup_steps: int, beta2: float) -> float:
    """The share of a bias-corrected second-moment EMA over ``steps`` steps that the steps past the warm-up filled.

    ``(1 - beta2**(steps - warmup_steps)) / (1 - beta2**steps)``: 1 without a
    warm-up. After the warm-up's averaged gradients the statistic holds their
    history, not a rank's own, and what it shows of the gradient's variance
    is mostly how fast the gradient moved early in training: a noise estimate
    drawn from it takes out as much of it as local gradients have filled in
    (without that, the first local steps are up to ``sqrt(P)`` times larger
    where the gradient moved fast, and the loss jumps at the switch).
    """
    if steps <= 0:
        return 0.0
    return (1.0 - beta2 ** max(0, steps - warmup_steps)) / (1.0 - beta2**steps)


def effective_world_size(rho: float, world_size: int) -> float:
    """The ``P'`` with ``1 - 1/P' = rho * (1 - 1/P)``: the debiased step with ``rho`` of the estimate out."""
    return 1.0 / (1.0 - rho * (1.0 - 1.0 / world_size))


class _SketchEma:
    """The settings of a sign-sketch measurement and its EMA of two float64 values.

    Args:
        columns: Sketch size ``k``.
        beta: EMA coefficient, in ``[0, 1)``.
        seed: Seed of the sketch's signs.

    Raises:
        ValueError: Bad arguments.
    """

    def __init__(self, columns: int, beta: float, seed: int) -> None:
        _check_columns(columns)
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta: {beta!r} (must be in [0, 1))")
        self.columns, self.beta, self.seed = columns, beta, seed
        self.ema = torch.zeros(2, dtype=torch.float64)


class NoiseScale(_SketchEma):
    """The measured share ``rho`` of the estimated noise that is noise across ranks (module docstring).

    Args:
        columns: Sketch size ``k`` (the all_reduce carries ``k + 2`` float32 values).
        beta: EMA coefficient of the measured and the estimated noise.
        seed: Seed of the sketch's signs (combined with the step; the same on every rank).

    Attributes:
        ema: EMA of the measured and of the estimated noise (state: snapshots and state dicts hold it).

    Raises:
        ValueError: Bad arguments.
    """

    def __init__(self, *, columns: int = 64, beta: float = 0.9, seed: int = 0x5CA1E) -> None:
        super().__init__(columns, beta, seed)
        self.last_measured: float | None = None
        self.last_estimated: float | None = None

    @property
    def rho(self) -> float:
        """The share of the estimate to take out; 1 (all of it) before the first measurement."""
        measured, estimated = (float(x) for x in self.ema)
        if estimated <= 0.0 or not math.isfinite(measured / estimated):
            return 1.0
        return min(1.0, max(0.0, measured / estimated))

    def measure(self, comm: Any, g: Tensor, estimated: float, step: int) -> float:
        """Fold one step's gradient into the EMAs; return the new :attr:`rho`.

        Collective: every rank must call this with the same ``step`` (one
        all_reduce of ``columns + 2`` float32 values, stats scope ``noise``).

        Args:
            comm: The communicator (``all_reduce`` and ``world_size``).
            g: This rank's gradient of the step (1-D, as it entered the update).
            estimated: This rank's estimated noise over all coordinates, times
                ``1 - 1/world_size`` (what the debiased step takes out).
            step: The step number (seeds the signs).
        """
        k = self.columns
        v = averaged_sketch(comm, g, k, self.seed, step, "noise", extra=(estimated,))
        measured = float(v[k]) - float(v[:k].square().sum())  # unclamped: the sketch's error averages out
        self.last_measured, self.last_estimated = measured, float(v[k + 1])
        now = torch.tensor([measured, self.last_estimated], dtype=torch.float64)
        self.ema.mul_(self.beta).add_(now, alpha=1.0 - self.beta)
        return self.rho

    def state_dict(self) -> dict[str, Tensor]:
        """The EMAs (a copy)."""
        return {"noise_ema": self.ema.clone()}

    def load_state_dict(self, state: StateDict) -> None:
        """Load :meth:`state_dict`'s ``noise_ema``.

        Raises:
            ValueError: Missing or not two float64 values.
        """
        self.ema.copy_(check_noise_state(state))


class MeanNorm(_SketchEma):
    """The global norm of the ranks' average gradient at every step, without sending it: what dense clipping measures.

    For the ranks' gradients ``g_r`` and their average ``g``,
    ``|g|**2 = mean_r |g_r|**2 - N`` with ``N`` the noise across ranks
    (module docstring). The first term is exact at every step; ``N`` is the
    bias-corrected EMA of its sign-sketch measurements. A single step's
    sketch is wrong by as much as the whole norm where two of the few
    coordinates that carry it meet in one column; over the EMA's steps that
    averages out, while a jump of the gradient shows in the exact term at
    once. Where the difference is not positive (``N`` over-estimated) the
    step's sketch is the estimate.

    Args:
        columns: Sketch size ``k`` (the all_reduce carries ``k + 1`` float32 values).
        beta: EMA coefficient of the noise.
        seed: Seed of the sketch's signs (combined with the step; the same on every rank).

    Attributes:
        ema: The noise's EMA (not bias-corrected) and the number of steps in it (state: state dicts hold it).

    Raises:
        ValueError: Bad arguments.
    """

    def __init__(self, *, columns: int = 64, beta: float = 0.9, seed: int = 0xC1) -> None:
        super().__init__(columns, beta, seed)

    def measure(self, comm: Any, g: Tensor, step: int) -> float:
        """Fold one step's gradient in; return the norm of the ranks' average gradient.

        Collective: every rank must call this with the same ``step`` and size
        of ``g`` (one all_reduce of ``columns + 1`` float32 values, stats
        scope ``grad_clip``); every rank gets the same norm.

        Args:
            comm: The communicator (``all_reduce``, ``stats``).
            g: This rank's gradient (1-D).
            step: The step number (seeds the signs).
        """
        k = self.columns
        v = averaged_sketch(comm, g, k, self.seed, step, "grad_clip")
        mean_sq, sketched = float(v[k]), float(v[:k].square().sum())
        self.ema[0] = self.beta * self.ema[0] + (1.0 - self.beta) * (mean_sq - sketched)
        self.ema[1] += 1.0
        noise = float(self.ema[0]) / (1.0 - self.beta ** float(self.ema[1]))
        est = mean_sq - noise
        return math.sqrt(est if est > 0.0 else sketched)

    def state_dict(self) -> dict[str, Tensor]:
        """The EMA and its step count (a copy)."""
        return {"clip_noise_ema": self.ema.clone()}

    def load_state_dict(self, state: StateDict) -> None:
        """Load :meth:`state_dict`'s ``clip_noise_ema``.

        Raises:
            ValueError: Missing or not two float64 values.
        """
        self.ema.copy_(check_noise_state(state, "clip_noise_ema"))
