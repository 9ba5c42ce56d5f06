"""Local steps of any ``torch.optim`` optimizer, the replicas averaged a window at a time (:class:`LocalOptimizer`).

Every rank steps its own replica of the model with its own optimizer (say
:class:`torch.optim.AdamW`), on its own gradient; after
each step :class:`LocalOptimizer` averages a window of the parameters over
the ranks with the engine of :class:`optim.LocalAdamS`
(:class:`optim.optimizers.averaging.ReplicaAverager`: the staggered window of the
changes since the last average in low-bit codes with error feedback by
default, or a periodic dense average; ``overlap`` lands each averaging one
step late, its exchange beside the next forward and backward). The first
``warmup_steps`` steps average the gradients instead (one dense all-reduce
each), so the replicas start the local phase identical. Like PyTorch's
``PostLocalSGDOptimizer`` and torchft's ``LocalSGD``, it wraps the optimizer
the user already has; unlike them, a step sends about ``density`` times the
bytes of a dense gradient all-reduce, every step.

A rank's gradient carries ``world_size`` (P) times the noise variance of the
averaged gradient a dense optimizer steps on. Adam's second moment holds that
noise, so on its own gradient each replica would move its low-signal
coordinates up to ``sqrt(P)`` times less than dense Adam, even with the
replicas averaged in full after every step. For :class:`torch.optim.Adam` and
:class:`torch.optim.AdamW` (without ``amsgrad``), ``noise="measured"`` (the
default for them) takes out of the wrapped optimizer's second moment the
share of that excess measured to be noise across the ranks
(:meth:`LocalOptimizer._debias`), and ``average_moment`` lets the window carry
their first moment (``exp_avg``) beside the parameters, so each replica steps
on nearly the averaged gradient's moment; other optimizers step on their
rank's gradient as it is. LocalAdamS's own normalizer stays with it (AdamS's
normalizer is built from the first moment).

Memory beside the inner optimizer's own state: the anchor (one fp32 copy of
the model) and the owner's residual of the codes (one fp32 shard), twice with
``average_moment``; the parameters (and the averaged ``exp_avg``) become views
of one flat fp32 buffer.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import StateDict

from bindings import ReduceOp
from optim.optimizers.averaging import Averaging, ReplicaAverager
from optim.optimizers.noise import NoiseScale, check_noise_state, effective_world_size, local_share
from optim.optimizers.wrapping import WrappingOptimizer, adam_moments

__all__ = ["NOISE", "LocalOptimizer"]

NOISE = ("auto", "measured", "debias", "keep")
"""Choices of ``LocalOptimizer(noise=...)``."""


logger = logging.getLogger(__name__)


class LocalOptimizer(WrappingOptimizer):
    """Wrap ``optimizer``: every rank steps its own replica; a window of the parameters is averaged after each step.

    See the module docstring. ``param_groups`` and ``state`` are the wrapped
    optimizer's (an LR scheduler built over the wrapper drives it).

    Args:
        optimizer: A ``torch.optim`` optimizer over ``model``'s trainable
            parameters (fp32, one device), not one of ours.
        model: The model it trains, the same on every rank.
        density: Value bytes per step as a fraction of a dense fp32 exchange of the model.
        schedule: ``"staggered"`` (default) or ``"periodic"``.
        warmup_steps: Steps that average the gradients (dense) before the local phase.
        wire_dtype: ``torch.bfloat16`` (default): the changes since the last
            average travel; ``torch.float32``: the values (no anchor, no codes).
        wire_bits: ``"auto"`` (default), 1, 2, 4 or 8: the changes in codes
            (:func:`optim.optimizers.averaging.auto_wire_bits`); ``None``: bfloat16 changes.
        window_order: ``"auto"`` (default), ``"contiguous"`` or ``"spread"``.
        overlap: Land each averaging one step late, its exchange beside the next step (needs codes).
        noise: ``"debias"``: after each local step, take the excess noise of
            this rank's gradient out of the wrapped Adam's or AdamW's second
            moment (``exp_avg_sq``, in its own state); ``"measured"``: only the
            share of it measured to be noise across the ranks (one small
            all_reduce per step); ``"keep"``: leave it; ``"auto"`` (default):
            measured for Adam and AdamW (without ``amsgrad``), keep for others.
        average_moment: ``True``: the window carries the wrapped Adam's or
            AdamW's first moment (``exp_avg``) too, in the same codes (two
            buffers per byte budget: narrower codes or a narrower window);
            ``"auto"`` (default) or ``False``: only the parameters. Unlike
            LocalAdamS, whose normalizer is built from the first moment, the
            wrapped AdamW gained nothing from it in the convergence suite
            (``benchmarks/README.md``), so it is off unless asked for.
        max_grad_norm: Clip the gradient to this global norm as dense training
            clips the ranks' average (0, default: no clipping): in the warm-up
            the averaged gradient itself; after it every rank's own gradient is
            scaled by the factor the average's norm calls for
            (:class:`optim.optimizers.noise.MeanNorm`: one all_reduce of 65
            floats per step). Clipped by its own norm, a rank's gradient, which
            carries ``P`` times the noise, would be cut more the more ranks
            there are.
        group: The process group (default: the default group of :mod:`sparsecomm.distributed`).

    Raises:
        TypeError: ``optimizer`` is not a plain torch optimizer, or ``model`` not a module.
        ValueError: A bad setting, an optimizer wrapped twice, parameters that
            are not the model's trainable ones or not fp32, or models that differ
            between ranks (before any communication but one small agreement,
            the same on every rank).
    """

    _clip_averaged = True
    _STATE_KEY = "local"

    def __init__(
        self,
        optimizer: Optimizer,
        model: torch.nn.Module,
        *,
        density: float = 0.1,
        schedule: str = "staggered",
        warmup_steps: int = 10,
        wire_dtype: torch.dtype = torch.bfloat16,
        wire_bits: int | str | None = "auto",
        window_order: str = "auto",
        overlap: bool = False,
        noise: str = "auto",
        average_moment: bool | str = "auto",
        max_grad_norm: float = 0.0,
        group: Any = None,
    ) -> None:
        # checked in _check_settings, before the base class touches the model or the group
        self._noise_given, self._moment_given = noise, average_moment
        self._resolve = functools.partial(
            Averaging.resolve,
            density=density,
            schedule=schedule,
            warmup_steps=warmup_steps,
            wire_dtype=wire_dtype,
            wire_bits=wire_bits,
            window_order=window_order,
            overlap=overlap,
        )
        super().__init__(optimizer, model, max_grad_norm=max_grad_norm, group=group)

    def _check_settings(self, optimizer: Optimizer) -> str:
        noise, average_moment = self._noise_given, self._moment_given
        if noise not in NOISE:
            raise ValueError(f"Invalid noise: {noise!r} (must be one of {NOISE})")
        if noise in ("debias", "measured") and not adam_moments(optimizer):
            raise ValueError(
                f"noise={noise!r} corrects the second moment of torch.optim.Adam / AdamW without amsgrad, "
                f"not of {type(optimizer).__name__}: use noise='keep'"
            )
        if average_moment not in ("auto", True, False):
            raise ValueError(f"Invalid average_moment: {average_moment!r} (must be 'auto', True or False)")
        if average_moment is True and not adam_moments(optimizer):
            raise ValueError(
                "average_moment averages the first moment (exp_avg) of torch.optim.Adam / AdamW without "
                f"amsgrad, not of {type(optimizer).__name__}"
            )
        if average_moment == "auto" or not adam_moments(optimizer):
            average_moment = False  # auto: off (see the argument's documentation)
        self.averaging = self._resolve(average_moment=average_moment)
        """The averaging's settings, every ``"auto"`` resolved."""
        self.noise = noise if noise != "auto" else "measured" if adam_moments(optimizer) else "keep"
        """``"measured"``, ``"debias"`` or ``"keep"`` (``"auto"`` resolved)."""
        return f"{self.averaging}|{self.noise}"

    def _make_buffers(self) -> None:
        b = self._bucket
        buffers = {"params": self._flat}
        self._m: Tensor | None = None
        if self.averaging.average_moment:
            self._m = b.new_flat()  # the wrapped optimizer's exp_avg become views of it (_bind_moments)
            buffers["exp_avg"] = self._m
        self._avg = ReplicaAverager(self._comm, b, self.averaging, buffers)
        self.noise_scale: NoiseScale | None = NoiseScale() if self.noise == "measured" else None
        """The measured share of the noise estimate that is noise across ranks (``noise="measured"``)."""

    @property
    def density(self) -> float:
        return self.averaging.density

    @property
    def warmup_steps(self) -> int:
        return self.averaging.warmup_steps

    @property
    def k(self) -> int:
        """Positions of every shard averaged per step (staggered)."""
        return self._avg.k

    @property
    def anchor(self) -> Tensor | None:
        """The last average of every position, the same on every rank (padded flat fp32); ``None``: float32 values."""
        return self._avg.anchor()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the wrapped optimizer on this rank's gradient, then average what the schedule says.

        Collective: every rank must call this. In the warm-up the gradients
        are averaged first (one dense all_reduce).
        """
        loss = self._run_closure(closure)
        self._avg.settle(self._step)
        self._check_replica()
        t, b = self._step, self._bucket
        self._bind_moments()  # a loaded state's exp_avg: into the averaged buffer before the step
        self._inner_step(t < self.warmup_steps)
        self._bind_moments()  # state made by this step
        if self.noise != "keep" and t >= self.warmup_steps and b.world_size > 1:
            self._debias(t)
        self._avg.after_step(t)
        self._step = t + 1
        return loss

    def _bind_moments(self) -> None:
        """Make the wrapped optimizer's ``exp_avg`` views of the averaged first moment, values kept.

        Adam and AdamW make their state at a parameter's first step and
        ``load_state_dict`` replaces it; both are rebound here, one pointer
        comparison per parameter otherwise.
        """
        m = self._m
        if m is None:
            return
        state = self.optimizer.state
        for p, off in zip(self._bucket.params, self._bucket.offsets, strict=True):
            st = state.get(p)
            if not st or "exp_avg" not in st:
                continue
            view = m[off : off + p.numel()].view(p.shape)
            cur = st["exp_avg"]
            if cur.data_ptr() != view.data_ptr():
                view.copy_(cur)
                st["exp_avg"] = view

    def _debias(self, t: int) -> None:
        """Take this step's excess noise out of Adam's second moment ``v`` (the wrapped optimizer's ``exp_avg_sq``).

        A rank's gradient carries ``P`` times the noise variance of the averaged
        gradient a dense Adam sees. Kept debiased, ``v_hat - m_hat**2`` holds
        ``1/P`` of this rank's variance, so ``var = P * (v_hat - m_hat**2)``
        estimates it, and ``v -= (1 - beta2) * (1 - 1/P) * var`` after every
        step keeps ``v`` the EMA of ``g**2 - (1 - 1/P) * var``: what the
        averaged gradient gives (the step itself normalized by ``1 - beta2``
        of one term not yet debiased). Never below ``m_hat**2``. With
        ``average_moment`` the first moment is the averaged one, which holds
        little noise: ``m_hat**2`` no longer keeps ``v`` up, and a term that
        takes out more than ``g**2`` brought in lets ``v`` collapse and the step
        blow up; there each step's term, ``g**2 - (1 - 1/P) * var``, is kept at
        or above zero (``v`` decays at most as a dense EMA does). With
        ``noise="measured"`` ``P`` is the effective one of the share of the
        estimate measured to be noise across the ranks
        (:class:`optim.optimizers.noise.NoiseScale`, one small all_reduce per step); the
        rest is how the gradient moves over the steps, which dense Adam keeps.
        Right after the warm-up ``v`` holds the averaged gradients' history:
        the correction grows in with the share of ``v`` local steps have
        filled (:func:`optim.optimizers.noise.local_share`). The gradient is
        ``p.grad`` (after clipping): Adam's own L2 term
        (``torch.optim.Adam`` with ``weight_decay``) is not in it.
        """
        world = self._bucket.world_size
        scale = self.noise_scale
        rho = 1.0 if scale is None else scale.rho
        work: list[tuple[Tensor, Tensor, Tensor, float, Tensor, float]] = []  # v, g, var, 1 - beta2, floor, share
        var_sum = torch.zeros((), dtype=torch.float64)
        for group in self.optimizer.param_groups:
            beta1, beta2 = group["betas"]
            share = local_share(t + 1, self.warmup_steps, beta2)  # of v that this rank's own gradients filled
            p_ = effective_world_size(rho * share, world)
            for p in group["params"]:
                st = self.optimizer.state.get(p)
                if not st or "exp_avg_sq" not in st or p.grad is None:
                    continue
                k = float(st["step"])
                c1, c2 = 1.0 - beta1**k, 1.0 - beta2**k
                v = st["exp_avg_sq"]
                m2 = (st["exp_avg"] / c1).square_()
                var = (v / c2).sub_(m2).clamp_(min=0.0).mul_(p_)
                var_sum += var.sum(dtype=torch.float64)
                work.append((v, p.grad, var, 1.0 - beta2, m2.mul_(c2), share))
        if scale is not None:
            self._bucket.gather_grads(self._grad)
            rho = scale.measure(self._comm, self._grad, (1.0 - 1.0 / world) * float(var_sum), t)
        for v, g, var, one_minus_beta2, floor, share in work:
            excess = 1.0 - 1.0 / effective_world_size(rho * share, world)
            if self._m is None:
                v.sub_(var, alpha=one_minus_beta2 * excess)
            else:
                g2 = g.square()
                v.add_((g2 - var * excess).clamp_(min=0.0).sub_(g2), alpha=one_minus_beta2)
            torch.maximum(v, floor, out=v)

    def wait_in_flight(self) -> None:
        """Wait until the averaging in flight (``overlap``) has moved its bytes; it still lands at the next step."""
        self._avg.wait()

    # ------------------------------------------------------------------ the replicas' average
    def _average_replicas(self) -> None:
        """The averaging in flight (``overlap``) added to the replica, then one dense all_reduce of the replicas."""
        self._avg.landed_into(self._flat)
        with self._comm.stats.scope("average"):
            self._comm.all_reduce(self._flat, ReduceOp.AVG)

    @torch.no_grad()
    def average_params(self) -> None:
        """Average every rank's replica into the parameters, for good (one dense all_reduce).

        Collective: every rank must call this. Once training is over, or before
        saving a model that must be the same on every rank; the wrapped
        optimizer's state is kept. With ``overlap``, the averaging in flight lands first.
        """
        self._avg.settle(self._step)
        self._avg.land()
        self._average_replicas()

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """Inside the block the parameters hold the average of the replicas; after it, this rank's own again.

        Collective: every rank must enter it (one dense all_reduce). Do not
        step inside the block. With ``overlap`` the average includes the
        averaging in flight, which still lands at the next step.
        """
        with torch.no_grad():
            self._avg.settle(self._step)
        with super().averaged():
            yield

    def abandon(self) -> None:
        """Drop the averaging in flight without waiting for it (its transport failed). Local."""
        self._avg.abandon()

    def close(self) -> None:
        """Land the averaging still in flight and stop its thread (call before tearing the group down)."""
        self._avg.close()

    # ------------------------------------------------------------------ state
    def _full_state(self) -> dict[str, Tensor]:
        return self._avg.full_state()

    @property
    def local_state(self) -> dict[str, Tensor]:
        """What the averaging keeps beside the wrapped optimizer's state, by name (anchor, residual)."""
        return {**self._full_state(), **self._avg.own_state()}

    def state_dict(self) -> StateDict:
        """The wrapped optimizer's state dict, plus ``"local"``: the step, this rank, the anchor and residual.

        Holds live tensors (copy or save it before the next step). With
        ``overlap``, the state before the averaging in flight lands.
        """
        local = self._state_entry()
        local.update(self.local_state)
        if self.noise_scale is not None:
            local.update(self.noise_scale.state_dict())
        if self.mean_norm is not None:
            local.update(self.mean_norm.state_dict())
        return self._wrapped_state(local)

    @torch.no_grad()
    def load_state_dict(self, state_dict: StateDict) -> None:
        """Load a :meth:`state_dict` saved under any world size (same model); the parameters are not touched.

        Local: no communication. The residual of the codes is kept where this
        rank owned positions then and owns now. With ``overlap`` the averaging
        the saved step started is sent again at the next step.

        Raises:
            ValueError: Not a LocalOptimizer's state dict of this model and settings.
        """
        local, step, rank = self._read_entry(state_dict)
        b = self._bucket
        for name, mine in self._full_state().items():
            src = local.get(name)
            if not isinstance(src, Tensor) or src.dim() != 1 or src.numel() < b.numel or src.dtype != mine.dtype:
                raise ValueError(f"state_dict: {name} missing or not a flat {mine.dtype} buffer of {b.numel} elements")
        for name, mine in self._avg.own_state().items():
            src = local.get(name)
            if not isinstance(src, Tensor) or src.dim() != 1 or src.dtype != mine.dtype:
                raise ValueError(f"state_dict: {name} missing or not a flat {mine.dtype} shard")
        if self.noise_scale is not None:
            check_noise_state(local)
        if self.mean_norm is not None:
            check_noise_state(local, "clip_noise_ema")
        self._avg.quiesce()
        self._load_wrapped(state_dict)
        self._bind_moments()
        for name, mine in self._full_state().items():
            mine.zero_()
            mine[: b.numel].copy_(local[name][: b.numel])
        for name, mine in self._avg.own_state().items():
            b.take_own(mine, local[name], rank)
        if self.noise_scale is not None:
            self.noise_scale.load_state_dict(local)
        if self.mean_norm is not None:
            self.mean_norm.load_state_dict(local)
        self._step = step
