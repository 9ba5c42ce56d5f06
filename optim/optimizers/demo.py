"""DeMo (Peng, Quesnelle and Kingma 2024): decoupled momentum, only its fast DCT components averaged (:class:`DeMo`).

Every rank keeps its own momentum and, every step, sends only its fastest-moving part::

    m_r = beta * m_r + g_r                           # this rank's momentum, its own gradient
    X_r = DCT(m_r), per chunk of c positions         # orthonormal DCT-II of every chunk
    q_r = the k largest |X_r| of every chunk          # the fast components: values and positions in the chunk
    m_r -= iDCT(q_r)                                  # what was sent leaves the momentum
    Q = iDCT(sum_r(q_r) / world_size)                 # every rank decodes the same bytes: the same Q
    step the wrapped optimizer on sign(Q)             # DeMo's signum step

With ``torch.optim.SGD(lr=lr, weight_decay=wd)`` (no momentum) as the wrapped
optimizer the step is DeMo's ``theta -= lr * (sign(Q) + wd * theta)``; the
replicas take the same step and never drift apart. The chunks cut the flat
model (in the parameters' order) where the paper cuts each tensor; the
first ``warmup_steps`` steps average the gradients dense and send every
component. ``max_grad_norm`` clips each rank's own gradient before it enters
the momentum (sign steps are not clipped).

Wire bytes: one all_gather per step of each rank's ``m * k`` fp32 values and
their positions in ``w = log2(c)`` bits (``m`` chunks), against a dense fp32
all_reduce's ``2 (P - 1) / P * 4N`` per rank: a fraction
``k * (4 + w / 8) * P / (8 c)`` (:func:`demo_plan`: at 4 ranks, chunks of 1,024 with k = 39 at
density 0.1, of 256 with k = 1 at 0.01, of 4,096 with k = 1 at 0.001). Compute: three
real FFTs of the model's length a step (:func:`dct`, :func:`idct`: the transform, the sent
part taken out, the average decoded), ``O(N log c)``. Memory beside the
wrapped optimizer's state: the momentum (one fp32 copy of the model) and a
work buffer of the same size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import StateDict

from bindings import ReduceOp
from bindings.validate import check_density, check_float, check_int
from optim.optimizers.sparseloco import pack_indices, unpack_indices
from optim.optimizers.wrapping import SameReplicaWrapper, set_grads

__all__ = ["MAX_CHUNK", "MIN_CHUNK", "DeMo", "DeMoPlan", "dct", "demo_plan", "idct"]

MIN_CHUNK = 64
"""The shortest chunk: the paper's chunk side."""

MAX_CHUNK = 4096
"""The longest chunk: as many positions as the paper's 64 x 64 chunks of a matrix."""


@dataclass(frozen=True, kw_only=True)
class DeMoPlan:
    """What every step sends: ``k`` components of every chunk of ``chunk`` positions."""

    chunk: int
    k: int

    @property
    def width(self) -> int:
        """Bits of one position inside its chunk."""
        return max(1, (self.chunk - 1).bit_length())

    def cost(self, world_size: int) -> float:
        """Wire bytes per step as a fraction of a dense fp32 all_reduce's (ring convention)."""
        return self.k * (4.0 + self.width / 8.0) * world_size / (8.0 * self.chunk)


def demo_plan(density: float, world_size: int) -> DeMoPlan:
    """The plan for ``density``: of the chunks of 64 to 4,096 positions (powers of two), the one whose most
    components that fit come closest to ``density`` (the shortest on a tie).

    Raises:
        ValueError: ``density`` too small for one component of a chunk of 4,096 positions.
    """
    d = check_density(density) + 1e-12
    best: DeMoPlan | None = None
    chunk = MIN_CHUNK
    while chunk <= MAX_CHUNK:
        k = min(chunk, int(d // DeMoPlan(chunk=chunk, k=1).cost(world_size)))
        if k >= 1:
            plan = DeMoPlan(chunk=chunk, k=k)
            if best is None or plan.cost(world_size) > best.cost(world_size):
                best = plan
        chunk *= 2
    if best is None:
        raise ValueError(f"Invalid density: {density!r} (too small for DeMo at {world_size} ranks)")
    return best


def _twiddles(n: int, device: torch.device) -> Tensor:
    """``sqrt(2 / n) * exp(-i pi k / (2 n))`` for ``k = 0 .. n/2``, ``k = 0`` also over ``sqrt(2)``.

    The orthonormal scale folded into the DFT's phase shift.
    """
    k = torch.arange(n // 2 + 1, dtype=torch.float64)
    scale = torch.full_like(k, math.sqrt(2.0 / n))
    scale[0] = math.sqrt(1.0 / n)
    return torch.polar(scale, -math.pi * k / (2 * n)).to(torch.complex64).to(device)


def dct(x: Tensor) -> Tensor:
    """The orthonormal DCT-II along the last dimension (an even length ``n``), through one real FFT of length ``n``.

    ``X[k] = s_k * sum_j x[j] cos(pi k (2 j + 1) / (2 n))`` with ``s_0 = sqrt(1 / n)``, ``s_k = sqrt(2 / n)``
    (Makhoul 1980: the even positions, then the odd ones reversed, make a sequence whose DFT gives the DCT).
    :func:`idct` inverts it.
    """
    n = x.shape[-1]
    v = torch.cat([x[..., 0::2], x[..., 1::2].flip(-1)], dim=-1)
    z = torch.fft.rfft(v, dim=-1) * _twiddles(n, x.device)
    return torch.cat([z.real, -z.imag[..., 1 : n // 2].flip(-1)], dim=-1)


def idct(y: Tensor) -> Tensor:
    """The inverse of :func:`dct` (the orthonormal DCT-III) along the last dimension, through one inverse real FFT."""
    n = y.shape[-1]
    w = 1.0 / _twiddles(n, y.device)  # undoes the scale and the phase
    upper = torch.cat([torch.zeros_like(y[..., :1]), y.flip(-1)[..., : n // 2]], dim=-1)  # y[n - k], y[n] = 0
    v = torch.fft.irfft(torch.complex(y[..., : n // 2 + 1], -upper) * w, n=n, dim=-1)
    x = torch.empty_like(y)
    x[..., 0::2] = v[..., : n // 2]
    x[..., 1::2] = v[..., n // 2 :].flip(-1)
    return x


class DeMo(SameReplicaWrapper):
    """Wrap ``optimizer`` (SGD in the paper): every step it steps on the sign of the ranks' fast momentum components.

    See the module docstring.

    Args:
        optimizer: A ``torch.optim`` optimizer over ``model``'s trainable parameters
            (fp32, one device), not one of ours; ``torch.optim.SGD`` without momentum is DeMo's step.
        model: The model it trains, the same on every rank.
        density: Wire bytes per step as a fraction of a dense fp32 all_reduce's: sets the chunk and ``k``
            (:func:`demo_plan`).
        beta: The momentum's decay (the paper's 0.999).
        sign: Step on ``sign(Q)`` (default, DeMo's signum) or on ``Q`` itself.
        warmup_steps: Steps whose gradients are averaged dense (fp32) first.
        max_grad_norm: Clip each rank's own gradient to this global norm before the momentum (0: no clipping).
        group: The process group (default: the default group of :mod:`sparsecomm.distributed`).

    Raises:
        TypeError: ``optimizer`` is not a plain torch optimizer, or ``model`` not a module.
        ValueError: A bad setting, an optimizer wrapped twice, parameters that are not the model's trainable
            ones or not fp32, or models that differ between ranks (the same on every rank, before any
            communication but one small agreement).
    """

    _STATE_KEY = "demo"

    def __init__(
        self,
        optimizer: Optimizer,
        model: torch.nn.Module,
        *,
        density: float = 0.1,
        beta: float = 0.999,
        sign: bool = True,
        warmup_steps: int = 10,
        max_grad_norm: float = 0.0,
        group: Any = None,
    ) -> None:
        self._given = (density, beta, sign, warmup_steps)
        super().__init__(optimizer, model, max_grad_norm=max_grad_norm, group=group)

    def _check_settings(self, optimizer: Optimizer) -> str:
        density, beta, sign, warmup_steps = self._given
        self.density = check_density(density)
        self.beta = check_float("beta", beta, low=0.0, high=1.0, high_open=True)
        if not isinstance(sign, bool):
            raise ValueError(f"Invalid sign: {sign!r} (must be a bool)")
        self.sign = sign
        self.warmup_steps = check_int("warmup_steps", warmup_steps, low=0)
        self.plan = demo_plan(self.density, self._bucket.world_size)
        """The chunk and the components of each sent per step."""
        return f"{self.density}|{self.beta}|{self.sign}|{self.warmup_steps}"

    def _make_buffers(self) -> None:
        b, c = self._bucket, self.plan.chunk
        self._chunks = -(-b.numel // c)
        self._momentum = torch.zeros(self._chunks * c, dtype=torch.float32, device=b.device)
        self._work = torch.zeros_like(self._momentum)

    @property
    def momentum(self) -> Tensor:
        """This rank's momentum (flat fp32, the model's positions, then the last chunk's padding)."""
        return self._momentum

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Add the gradient to the momentum, average its fast components, step the wrapped optimizer on their sign.

        Collective: every rank must call this.
        """
        loss = self._run_closure(closure)
        self._check_replica()
        b, g, n = self._bucket, self._grad, self._bucket.numel
        missing = set(b.gather_grads(g))
        if self.max_grad_norm > 0:  # this rank's own gradient, before the momentum
            norm = float(g[:n].norm())
            self.last_grad_norm = norm
            if norm > self.max_grad_norm:
                g.mul_(self.max_grad_norm / (norm + 1e-6))
        m = self._momentum
        warm = self._step < self.warmup_steps
        if warm and b.world_size > 1:
            with self._comm.stats.scope("demo"):
                self._comm.all_reduce(g, ReduceOp.AVG)
        m.mul_(self.beta)[:n].add_(g[:n])
        if warm:
            q = self._work.copy_(m)  # every component (dense)
            m.zero_()
        else:
            q = self._fast_average()
        g.zero_()
        g[:n].copy_(torch.sign(q[:n]) if self.sign else q[:n])
        set_grads(b, g, missing)
        self.optimizer.step()
        self._step += 1
        return loss

    def _fast_average(self) -> Tensor:
        """Send this rank's fast components, take them out of the momentum; the ranks' average in the work buffer."""
        c, k, ws, chunks = self.plan.chunk, self.plan.k, self._bucket.world_size, self._chunks
        m = self._momentum.view(chunks, c)
        spectrum = dct(m)
        idx = torch.topk(spectrum.abs(), k, dim=1, sorted=False).indices
        vals = spectrum.gather(1, idx)
        sent = torch.zeros_like(spectrum).scatter_(1, idx, vals)
        m.sub_(idct(sent))
        positions = pack_indices(idx.reshape(-1), self.plan.width)
        all_vals = torch.empty(ws * vals.numel(), dtype=torch.float32, device=m.device)
        all_pos = torch.empty(ws * positions.numel(), dtype=torch.uint8, device=m.device)
        with self._comm.stats.scope("demo"):
            self._comm.all_gather(all_vals, vals.reshape(-1).contiguous())
            self._comm.all_gather(all_pos, positions)
        total = torch.zeros_like(spectrum)
        rows = torch.arange(chunks, device=m.device).repeat_interleave(k)
        for r in range(ws):  # in rank order: every rank sums the same values in the same order
            pos = unpack_indices(all_pos.view(ws, -1)[r], chunks * k, self.plan.width)
            total.index_put_((rows, pos), all_vals.view(ws, -1)[r], accumulate=True)
        total.div_(ws)
        return self._work.view(chunks, c).copy_(idct(total)).view(-1)

    # ------------------------------------------------------------------ state
    @property
    def local_state(self) -> dict[str, Tensor]:
        """What the wrapper keeps beside the wrapped optimizer's state, by name (this rank's momentum)."""
        return {"momentum": self._momentum}

    def state_dict(self) -> StateDict:
        """The wrapped optimizer's state dict, plus ``"demo"``: the step, this rank and its momentum.

        Holds live tensors (copy or save it before the next step).
        """
        return self._wrapped_state({**self._state_entry(), "momentum": self._momentum})

    @torch.no_grad()
    def load_state_dict(self, state_dict: StateDict) -> None:
        """Load a :meth:`state_dict` saved under any world size with the same chunk; local.

        Raises:
            ValueError: Not a DeMo state dict of this model and chunk.
        """
        entry, step, _ = self._read_entry(state_dict)
        mom = self._flat_entry(entry, "momentum")
        if mom.shape != self._momentum.shape:  # the chunks' padding too: the same chunk
            raise ValueError(f"state_dict: momentum holds {mom.numel()} values, this chunking {self._momentum.numel()}")
        self._load_wrapped(state_dict)
        self._momentum.copy_(mom)
        self._step = step
