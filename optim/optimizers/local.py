"""AdamS with a full replicated state on every rank: local steps (:class:`LocalAdamS`).

SCAPE (:mod:`optim.optimizers.scape`) moves a coordinate only at the steps whose mask
selects it, so under a byte budget its coordinates fall behind dense AdamS's.
:class:`LocalAdamS` keeps every coordinate moving: every rank runs AdamS on
its own gradient over the whole model with its own full first moment, and
after each step the ranks average part of the replicas
(:class:`optim.optimizers.averaging.ReplicaAverager`):

* ``schedule="staggered"`` (default): a window of every shard, moving by its
  own length every step, a pure function of the step (no mask travels); every
  coordinate is averaged once every ``shard_size / k`` steps;
* ``schedule="periodic"``: a dense average of the parameters every ``1/d`` steps.

By default the window carries each rank's change since the last average in
low-bit codes with error feedback (:func:`optim.optimizers.averaging.auto_wire_bits`),
which buys several times the positions of float32 values for the same bytes.
Where the window covers at least half of every shard per step it carries
each rank's first-moment change too (``average_moment``): a rank normalizes a
rare large gradient entry by its own first moment and would move that
coordinate ``1/world_size`` as far as dense AdamS; with the first moments
shared every rank carries it on.

A rank's gradient carries ``world_size`` times the noise of the averaged
gradient dense AdamS normalizes by, which would shrink the steps of
low-signal coordinates by up to ``sqrt(world_size)``. The *debiased*
normalizer takes the excess out, estimated per coordinate from the rank's
own history (:func:`optim.optimizers.adams.debiased_adams_step_`); ``"measured"`` only as
far as one tiny all_reduce per step measures it to be noise across the ranks
(:mod:`optim.optimizers.noise`); either grows in after the warm-up as local gradients
fill the statistic (:func:`optim.optimizers.noise.local_share`). The first
``warmup_steps`` steps average the gradients (dense), so the replicas start
the local phase identical. Between averages the replicas differ: evaluate or
save inside :meth:`LocalAdamS.averaged`, or call
:meth:`LocalAdamS.average_params` once training is over.

Memory: a full fp32 first moment, the normalizer's statistic and the anchor
per rank, and the owner's residual of the codes (one shard), twice the last
two with ``average_moment``. The master shard is this rank's slice of its
replica. Snapshots and state dicts hold this rank's whole replica; restoring
one needs no communication. Wire bytes by stats scope: ``all_reduce``
(warm-up, periodic), ``quantized_all_reduce`` (codes) or ``sparse_all_reduce``
(values) of the window, ``noise`` (the measured normalizer's sketch) and
``average`` (:meth:`LocalAdamS.averaged`, :meth:`LocalAdamS.average_params`).
Measurements: ``benchmarks/README.md``, "Convergence suite".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT, StateDict

from bindings import ReduceOp
from optim.optimizers.adams import debiased_adams_step_
from optim.optimizers.averaging import LOCAL_SCHEDULES, WIRE_DTYPES, Averaging, ReplicaAverager, auto_wire_bits
from optim.optimizers.capabilities import OptimizerCapabilities, ParamGroup, StateLayout
from optim.optimizers.noise import NoiseScale, check_noise_state, effective_world_size, local_share
from optim.optimizers.replicated import ReplicatedAdamS
from optim.optimizers.window_order import WINDOW_ORDERS
from sparsecomm.mask import ShardedMask

__all__ = [
    "LOCAL_SCHEDULES",
    "NORMALIZERS",
    "NORMALIZER_DTYPES",
    "WINDOW_ORDERS",
    "WIRE_DTYPES",
    "LocalAdamS",
    "auto_wire_bits",
]

NORMALIZERS = ("auto", "debiased", "measured", "local")
NORMALIZER_DTYPES = (torch.float32, torch.bfloat16)


class LocalAdamS(ReplicatedAdamS):
    """Local AdamS steps on every rank; the parameters are averaged a window at a time.

    See the module docstring for the algorithm. Arguments as
    :class:`optim.ShardedAdamS`, plus:

    Args:
        density: Fraction of each shard averaged per step (``staggered``), or
            one dense average every ``round(1 / density)`` steps (``periodic``).
            Either way the wire carries about ``density`` times the value bytes
            of dense ShardedAdamS.
        schedule: ``"staggered"`` (default) or ``"periodic"``.
        warmup_steps: Steps that average the gradients (dense) before the local
            phase starts.
        wire_dtype: ``torch.bfloat16`` (default) averages each replica's change
            since the last average of that position (all ranks hold the same
            last average, the *anchor*: one more fp32 copy of the model),
            rounded to bfloat16, so twice as many positions per step (or
            averages twice as often) for the same bytes. The rounding touches
            only the change since the last average, and the new anchor is the
            same on every rank. ``torch.float32`` averages the parameter values
            themselves (no anchor). The default is the better of the two in
            the worst case of the convergence suite (``benchmarks/README.md``).
        wire_bits: ``"auto"`` (default): :func:`auto_wire_bits` of the density
            and of ``average_moment`` (2 bits at 0.1, where the first moment
            travels too; 1 bit at 0.01), or float32 values when
            ``wire_dtype`` is float32. 1, 2, 4 or 8: the changes since the last average travel as
            ``wire_bits``-bit codes with a bfloat16 scale per 64 values
            (:class:`sparsecomm.quantized.Quantizer`), averaged by each shard's
            owner (:func:`sparsecomm.quantized.quantized_all_reduce`), so a step
            averages ``32 / (wire_bits + 0.25)`` times the positions of a float32
            window for the same bytes. Nothing is lost to the codes: each rank
            keeps what its encoding dropped in its own replica (it goes out with
            the position's next average), and each owner what the encoding of
            the average dropped (one fp32 shard, ``wire_residual`` in
            snapshots). ``None``: ``wire_dtype`` values (bfloat16 changes).
        normalizer: ``"debiased"``: in the local phase, AdamS's normalizer is
            built as dense AdamS's would be from the averaged gradient -- the
            noise of this rank's gradient above ``1/world_size`` of it,
            estimated per coordinate from the rank's own history, is taken out
            (one more full fp32 state vector). ``"measured"``: debiased, but
            only the share of that estimate that is noise across ranks is
            taken out, measured every local step
            (:class:`optim.optimizers.noise.NoiseScale`: one all_reduce of 66 float32
            values, stats scope ``noise``); the estimate from one rank's history
            also holds how its gradient moves over the steps, which dense AdamS
            keeps. ``"local"``: plain AdamS on this rank's gradient, whose
            normalizer carries ``world_size`` times the noise, so low-signal
            coordinates move up to ``sqrt(world_size)`` times less than under
            dense AdamS (slower off loss plateaus). ``"auto"`` (default):
            measured where the window covers less than half of the shard per
            step (1-bit codes at density 0.01), debiased otherwise (4-bit codes
            at 0.1): the worst case over the convergence suite at each density
            (``benchmarks/README.md``).
        normalizer_dtype: The dtype of the debiased normalizer's second-moment
            EMA (``exp_avg_sq``, one full-size vector): ``torch.float32``
            (default) or ``torch.bfloat16`` (half its bytes; each update is
            rounded to 8 significant bits, small beside the ``1 - beta2`` it
            moves by).
        window_order: ``"contiguous"``: the staggered window moves through
            the shard in its own order, so it averages whole tensors in turn.
            ``"spread"``: through the order of :func:`spread_positions`, so
            every tensor has a share of its positions averaged at every step
            (blocks of 16 positions; the same bytes). ``"auto"`` (default):
            spread where the window covers less than half of the shard per step
            (1-bit codes at density 0.01), contiguous otherwise (4-bit codes at
            0.1): in the convergence suite spread was better in the worst case
            at 0.01 and worse at 0.1 (``benchmarks/README.md``).
        average_moment: ``True``: the window (or the periodic average) carries
            each rank's first moment's change since its last average beside
            the parameters', in the same codes (one more
            :func:`sparsecomm.quantized.quantized_all_reduce` per step), so the
            ranks share their first moments at the positions they average;
            for the same bytes a step averages half the positions of the
            parameters alone at a given code width. Needs ``wire_bits`` codes;
            one more full fp32 vector and one fp32 shard (the first moment's
            anchor and the owner's residual, ``exp_avg_anchor`` and
            ``exp_avg_wire_residual`` in snapshots). ``"auto"`` (default): on where the window of the
            parameters' codes alone covers half of every shard per step or more
            (density 0.1: 2-bit codes of both, 71% of the positions per step,
            against 75% with 4-bit codes of the parameters alone), off
            elsewhere (1-bit codes at 0.01): the worst case over the
            convergence suite at each density (``benchmarks/README.md``).
            With the first moments shared, the debiased normalizer debiases
            the gradient's term alone (:func:`optim.optimizers.adams.debiased_adams_step_`,
            ``shared_moment``).
        overlap: ``True``: the averaging of the positions of step ``t`` (in codes)
            runs on a background thread, in point-to-point messages only, while
            the caller computes step ``t + 1``'s forward and backward, and lands
            after step ``t + 1``'s update: each replica adds the average minus
            the change it sent, keeping what it did meanwhile. The same bytes;
            the wire time and the wait for slower ranks hide under compute, for
            a one-step-older average. Snapshots and state dicts hold the state
            before it lands; a restore sends it again at the next step (bit for
            bit). One such optimizer per communicator at a time; call
            :meth:`close` (or :meth:`average_params`) before building another on
            it. Needs ``wire_bits`` codes. ``False`` (default): it lands in
            the step that started it.

    Raises:
        ValueError: Bad arguments (before any communication, the same on every rank).
    """

    capabilities = OptimizerCapabilities(layout=StateLayout.REPLICATED, replicas_drift=True, own_snapshots=True)
    """Each rank holds its own replica between averagings, and snapshots it itself."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        *,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        density: float = 0.1,
        schedule: str = "staggered",
        warmup_steps: int = 10,
        max_grad_norm: float = 0.0,
        bias_correction: bool = True,
        group: Any = None,
        wire_dtype: torch.dtype = torch.bfloat16,
        wire_bits: int | str | None = "auto",
        normalizer: str = "auto",
        normalizer_dtype: torch.dtype = torch.float32,
        window_order: str = "auto",
        average_moment: bool | str = "auto",
        overlap: bool = False,
        wd_min_ndim: int = 2,
    ) -> None:
        if normalizer not in NORMALIZERS:
            raise ValueError(f"Invalid normalizer: {normalizer!r} (must be one of {NORMALIZERS})")
        if normalizer_dtype not in NORMALIZER_DTYPES:
            raise ValueError(f"Invalid normalizer_dtype: {normalizer_dtype!r} (must be one of {NORMALIZER_DTYPES})")
        a = Averaging.resolve(
            density=density,
            schedule=schedule,
            warmup_steps=warmup_steps,
            wire_dtype=wire_dtype,
            wire_bits=wire_bits,
            window_order=window_order,
            average_moment=average_moment,
            overlap=overlap,
        )
        self.averaging = a
        """The averaging's settings, every ``"auto"`` resolved."""
        self.schedule, self.wire_dtype, self.wire_bits = a.schedule, a.wire_dtype, a.wire_bits
        self.average_moment, self.overlap, self.window_order = a.average_moment, a.overlap, a.window_order
        self.wire_density, self.period = a.wire_density, a.period
        if normalizer == "auto":
            normalizer = "measured" if a.narrow else "debiased"
        self.normalizer = normalizer
        """``"debiased"``, ``"measured"`` or ``"local"`` (``"auto"`` resolved)."""
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
            config=f"LocalAdamS|{a.schedule}|{a.wire_dtype}|{normalizer}"
            + a.tag().removeprefix(f"{a.schedule}|{a.wire_dtype}")
            + ("|s-bf16" if normalizer_dtype == torch.bfloat16 else ""),
        )
        b = self._bucket
        self._s = None if normalizer == "local" else b.new_flat().to(normalizer_dtype)
        self.noise: NoiseScale | None = NoiseScale() if normalizer == "measured" else None
        """The measured share of the debiased normalizer's noise estimate (``normalizer="measured"``)."""
        self._var_sum = torch.zeros((), dtype=torch.float64, device=self._flat.device)
        buffers = {"params": self._flat, **({"exp_avg": self._m} if a.average_moment else {})}
        self._avg = ReplicaAverager(self._comm, b, a, buffers)
        self.k = self._avg.k
        self.quantizer = self._avg.quantizer
        """The encoding of the changes when ``wire_bits`` is set."""

    def _extra_moments(self) -> dict[str, Tensor]:
        return {} if self._s is None else {"exp_avg_sq": self._s}

    def _segment_update(
        self, w: Tensor, state: dict[str, Tensor], g: Tensor, grp: ParamGroup, wd: float, step: int
    ) -> None:
        """AdamS; with the debiased normalizer the local phase takes the noise of one rank's gradient out.

        See :func:`optim.optimizers.adams.debiased_adams_step_`.
        """
        s = state.get("exp_avg_sq")
        if s is None:
            super()._segment_update(w, state, g, grp, wd, step)
            return
        beta1, beta2 = grp["betas"]
        s.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        p = self._bucket.world_size
        if not self._local_phase or p == 1:  # averaged gradients (or one rank): plain AdamS
            super()._segment_update(w, state, g, grp, wd, step)
            return
        share = local_share(step, self.warmup_steps, beta2)  # of the statistic that local gradients filled
        debiased_adams_step_(
            w,
            state["exp_avg"],
            s,
            g,
            lr=float(grp["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=grp["eps"],
            weight_decay=wd,
            step=step,
            world_size=effective_world_size(share * (1.0 if self.noise is None else self.noise.rho), p),
            var_sum=None if self.noise is None else self._var_sum,
            shared_moment=self.average_moment,
        )

    def window(self, t: int) -> ShardedMask:
        """The positions averaged after step ``t`` (staggered): the same window in every shard.

        Window ``j = t - warmup_steps`` is positions ``[j * k, (j + 1) * k)`` (mod the
        shard size), in the shard's own order or, with ``window_order="spread"``,
        in the order of :func:`spread_positions`.
        """
        mask = self._avg.schedule.mask(t)
        if mask is None:
            raise ValueError("window: the periodic schedule averages every position")
        return mask

    def is_average_step(self, t: int) -> bool:
        """Whether (part of) the parameters are averaged after step ``t``."""
        return self._avg.schedule.due(t)

    def _run(self, t: int) -> None:
        super()._run(t)
        if t < self.warmup_steps:  # the replicas and first moments are identical during the warm-up: anchors follow
            self._avg.after_step(t)

    def _average(self, t: int) -> None:
        p = self._bucket.world_size
        if self.noise is not None and p > 1:  # the step's clipped gradient and estimate, for the next step
            self.noise.measure(self._comm, self._grad, (1.0 - 1.0 / p) * float(self._var_sum), t)
            self._var_sum.zero_()
        self._avg.after_step(t)

    def wait_in_flight(self) -> None:
        """Wait until the averaging in flight (``overlap``) has moved its bytes; it still lands at the next step.

        For exact byte counts over a window of steps; a no-op without ``overlap``.
        """
        self._avg.wait()

    def _settle(self) -> None:
        """After a restore, send the averaging the last step started (the same bytes as the first time)."""
        self._avg.settle(self._step)

    def _quiesce(self) -> None:
        """Drop the averaging in flight unwaited before a restore; the restored state sends it again."""
        self._avg.quiesce()

    def abandon(self) -> None:
        """Drop the averaging in flight without waiting for it (its transport failed). Local."""
        self._avg.abandon()

    def close(self) -> None:
        """Land the averaging still in flight and stop its thread (call before tearing the group down)."""
        self._avg.close()

    def _full_state(self) -> dict[str, Tensor]:
        return {**super()._full_state(), **self._extra_moments(), **self._avg.full_state()}

    def _own_state(self) -> dict[str, Tensor]:
        return self._avg.own_state()

    def _check_shard(self, what: str, sh: StateDict) -> None:
        super()._check_shard(what, sh)
        if self.noise is not None:
            check_noise_state(sh.get("extra") or {})

    def _copy_full(self, extra: StateDict) -> None:
        super()._copy_full(extra)
        if self.noise is not None:
            self.noise.load_state_dict(extra)

    def _extra_state(self, *, live: bool) -> StateDict:
        extra = super()._extra_state(live=live)
        if self.noise is not None:
            extra["noise_ema"] = self.noise.ema if live else self.noise.ema.clone()
        return extra

    @torch.no_grad()
    def restore_replica(self, snap: StateDict) -> None:
        """As :meth:`ReplicatedAdamS.restore_replica`, with the measured noise's EMAs (``normalizer="measured"``)."""
        if self.noise is not None:
            check_noise_state(snap.get("extra") or {})  # checked before anything is written
        self._quiesce()
        super().restore_replica(snap)
        if self.noise is not None:
            self.noise.load_state_dict(snap["extra"])

    @property
    def anchor(self) -> Tensor | None:
        """The last average of every position, the same on every rank (padded flat fp32); ``None``: float32 values."""
        return self._avg.anchor()

    @torch.no_grad()
    def average_params(self) -> None:
        """Average every rank's replica into the parameters, for good (one dense all_reduce).

        Collective: every rank must call this. Use it once training is over (or
        before saving a model that must be the same on every rank); the local
        first moments are kept. With ``overlap``, the averaging in flight lands first.
        """
        self._settle()
        self._avg.land()
        self._average_replicas()

    def _average_replicas(self) -> None:
        self._follow_params()
        with self._comm.stats.scope("average"):
            self._comm.all_reduce(self._flat, ReduceOp.AVG)
        self._bucket.write_params(self._flat)
        self._master.copy_(self._bucket.own_slice(self._flat))

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """Inside the block the parameters hold the average of the replicas; after it, this rank's own again.

        Collective: every rank must enter it (one dense all_reduce). For
        evaluation and checkpoints of the model the ranks train together.
        Do not step the optimizer inside the block. With ``overlap``, the
        average includes the averaging in flight, which still lands at the
        next step: evaluating does not change the run.
        """
        self._settle()
        own = self._flat.clone()
        self._avg.landed_into(self._flat)  # the replicas as they will be once the averaging in flight lands
        self._average_replicas()
        try:
            yield
        finally:
            self._flat.copy_(own)
            self._bucket.write_params(self._flat)
            self._master.copy_(self._bucket.own_slice(self._flat))
