"""AdamS with a full replicated state on every rank: local steps (LocalAdamS) and the base of top-k (TopKAdamS).

SCAPE (:mod:`optim.scape`) moves a coordinate only at the steps whose mask
selects it; at density d a coordinate moves about d times as far as under
dense AdamS, and the loss gap grows with training (``benchmarks/README.md``,
"Convergence suite"). The optimizers here keep every coordinate moving:

:class:`LocalAdamS` (the method to pick under a byte budget)
    Every rank runs AdamS on its own gradient over the whole model, with its
    own full first moment. After each step the ranks average part of the
    parameters:

    * ``schedule="staggered"`` (default): a window of ``k = ceil(d * shard_size)``
      positions of every shard, moving by ``k`` every step, is averaged with one
      :func:`sparsecomm.collectives.sparse_all_reduce` (a sparse reduce-scatter
      plus a sparse all-gather: SCAPE's value bytes, and no mask bytes at all,
      because the window is a pure function of the step). Every coordinate is
      averaged once every ``ceil(shard_size / k)`` steps, and the traffic is the
      same at every step;
    * ``schedule="periodic"``: every ``round(1 / d)`` steps, one dense all-reduce
      of the parameters (local SGD / DiLoCo-style averaging, outer step 1).

    The first ``warmup_steps`` steps average the gradients instead (one dense
    all-reduce each), so every rank starts the local phase from the same,
    well-conditioned state. By default the window carries each rank's change
    since the last average in low-bit codes (:mod:`sparsecomm.quantized`:
    :func:`auto_wire_bits` picks 4 bits at density 0.1 and 1 bit at 0.01 for
    the parameters alone, so the window covers 7.5x and 25.6x the positions of
    float32 values for the same bytes; what the codes drop is fed back, on each rank and at each
    owner), and each rank's AdamS normalizer is *debiased*: a rank's gradient carries
    ``world_size`` times the noise of the averaged gradient dense AdamS
    normalizes by, which shrinks the steps of low-signal coordinates by up to
    ``sqrt(world_size)`` (slow escapes from loss plateaus); the excess noise,
    estimated per coordinate from the rank's own gradient history, is taken
    out of the normalizer (at density 0.01 by default only as far as one tiny
    all_reduce per step measures that estimate to be noise across the ranks,
    ``normalizer="measured"``, :mod:`optim.noise`). Where the window covers
    half of every shard per step or more (4-bit codes at 0.1), it carries each
    rank's first moment's change since its last average too, in codes of the
    same width (``average_moment``; :func:`auto_wire_bits` then picks 2 bits
    at 0.1, so the same bytes average 95% of the positions of the parameters
    alone): a rank whose gradient holds a rare large entry normalizes it by its
    own first moment and moves that coordinate about ``1/world_size`` as far as
    dense AdamS would; with the first moments shared every rank carries it on.
    A shared first moment holds no more noise than dense AdamS's, so the
    debiased normalizer then takes the excess noise out of the gradient's term
    only (taken out of the first moment's square too, it made the steps too
    large: 1.086x dense AdamS on stdlib-gpt-cosine at 1,000 steps, against
    0.994x without). Between averages the
    replicas differ: evaluate or save the model inside :meth:`LocalAdamS.averaged`, or call
    :meth:`LocalAdamS.average_params` once training is over.

:class:`optim.topk.TopKAdamS` (the suite's classic baseline, on :class:`optim.replicated.ReplicatedAdamS`)
    Every rank adds its gradient to a local residual, sends its ``k`` largest
    entries with their int32 indices (one all-gather of values, one of
    indices), keeps the rest, and all ranks apply the same AdamS step to the
    average of everyone's entries. The replicas stay identical.

Memory: a full fp32 first moment on every rank (LocalAdamS's defaults add
a second-moment EMA and the anchor, full size, and the owner's residual of the
codes, the size of one shard; with ``average_moment`` the first moment's anchor,
full size, and its owner's residual, one shard, too; or a bfloat16 buffer in
place of the residual with bfloat16 changes; TopKAdamS a residual), instead of
SCAPE's ``1/world_size`` share. The master shard is this rank's slice of its
replica, not a copy. The parameter
layout, gradient gathering and parameter following are those of
:class:`optim.sharded.ShardedAdamS` (one flat fp32 buffer that the parameters
view). Snapshots and state dicts hold this rank's whole replica (parameters,
first moment, residual); restoring one needs no communication.

Wire bytes (stats scopes): ``all_reduce`` (warm-up gradients, periodic
averages), ``quantized_all_reduce`` (the window in codes, the default) or
``sparse_all_reduce`` (bfloat16 or float32 values) of the staggered window, ``topk`` (values
and indices), ``noise`` (the measured normalizer's sketch), and ``average`` for
:meth:`LocalAdamS.averaged` / :meth:`LocalAdamS.average_params`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from bindings import ReduceOp
from optim.adams import debiased_adams_step_
from optim.averaging import CodeAverager, WindowSlots
from optim.noise import NoiseScale, check_noise_state, effective_world_size
from optim.replicated import ReplicatedAdamS, check_density
from optim.window_order import WINDOW_ORDERS, window_positions
from sparsecomm.collectives import sparse_all_reduce
from sparsecomm.mask import ShardedMask, k_for
from sparsecomm.quantized import QUANT_BITS, Quantizer

__all__ = [
    "LOCAL_SCHEDULES",
    "NORMALIZERS",
    "NORMALIZER_DTYPES",
    "WINDOW_ORDERS",
    "WIRE_DTYPES",
    "LocalAdamS",
    "auto_wire_bits",
]

LOCAL_SCHEDULES = ("staggered", "periodic")
WIRE_DTYPES = (torch.float32, torch.bfloat16)
NORMALIZERS = ("auto", "debiased", "measured", "local")
NORMALIZER_DTYPES = (torch.float32, torch.bfloat16)


def auto_wire_bits(density: float, buffers: int = 1) -> int:
    """LocalAdamS's code width at ``density``: the widest code whose window covers half of every shard per step.

    The staggered window of ``b``-bit codes covers ``32 * density / (buffers * (b + 0.25))``
    of the positions per step, where ``buffers`` is 2 when the window carries the
    first moment's changes too (``average_moment``). Where no code reaches half of
    them (density below 0.035 with one buffer), 1 bit, the code that covers the most. In the convergence
    suite the replicas' drift between two averages of a position cost more
    than the codes' coarseness until positions were averaged about every
    other step (``benchmarks/README.md``).
    """
    if buffers not in (1, 2):
        raise ValueError(f"Invalid buffers: {buffers!r} (must be 1 or 2)")
    for bits in sorted(QUANT_BITS, reverse=True):
        if 32.0 * density / (buffers * Quantizer(bits=bits).bits_per_value()) >= 0.5:
            return bits
    return min(QUANT_BITS)


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
            (:class:`optim.noise.NoiseScale`: one all_reduce of 66 float32
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
            the gradient's term alone (:func:`optim.adams.debiased_adams_step_`,
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

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        density: float = 0.1,
        schedule: str = "staggered",
        warmup_steps: int = 10,
        max_grad_norm: float = 0.0,
        bias_correction: bool = True,
        group: Any = None,
        *,
        wire_dtype: torch.dtype = torch.bfloat16,
        wire_bits: int | str | None = "auto",
        normalizer: str = "auto",
        normalizer_dtype: torch.dtype = torch.float32,
        window_order: str = "auto",
        average_moment: bool | str = "auto",
        overlap: bool = False,
        wd_min_ndim: int = 2,
    ) -> None:
        if schedule not in LOCAL_SCHEDULES:
            raise ValueError(f"Invalid schedule: {schedule!r} (must be one of {LOCAL_SCHEDULES})")
        if normalizer not in NORMALIZERS:
            raise ValueError(f"Invalid normalizer: {normalizer!r} (must be one of {NORMALIZERS})")
        if window_order not in WINDOW_ORDERS:
            raise ValueError(f"Invalid window_order: {window_order!r} (must be one of {WINDOW_ORDERS})")
        if normalizer_dtype not in NORMALIZER_DTYPES:
            raise ValueError(f"Invalid normalizer_dtype: {normalizer_dtype!r} (must be one of {NORMALIZER_DTYPES})")
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"Invalid wire_dtype: {wire_dtype!r} (must be one of {WIRE_DTYPES})")
        if average_moment not in ("auto", True, False):
            raise ValueError(f"Invalid average_moment: {average_moment!r} (must be 'auto', True or False)")
        if not isinstance(overlap, bool):
            raise ValueError(f"Invalid overlap: {overlap!r} (must be True or False)")
        self.schedule = schedule
        self.wire_dtype = wire_dtype
        self.quantizer: Quantizer | None = None
        """The encoding of the changes when ``wire_bits`` is set."""
        scale = float(torch.finfo(torch.float32).bits // torch.finfo(wire_dtype).bits)
        auto_bits = wire_bits == "auto"
        if auto_bits:
            wire_bits = None if wire_dtype == torch.float32 else auto_wire_bits(check_density(density))
        if isinstance(wire_bits, str):
            raise ValueError(f"Invalid wire_bits: {wire_bits!r} (must be 'auto', None or one of {QUANT_BITS})")
        if wire_bits is not None:
            if wire_dtype == torch.float32:
                raise ValueError("wire_bits encodes the changes since the last average: use wire_dtype=torch.bfloat16")
            scale = torch.finfo(torch.float32).bits / Quantizer(bits=wire_bits).bits_per_value()
        # the window of the parameters' changes alone covers under half of each shard per step: the autos' switch
        narrow = check_density(density) * scale < 0.5
        if average_moment == "auto":
            average_moment = wire_bits is not None and not narrow
        if average_moment and wire_bits is None:
            raise ValueError("average_moment sends the first moment's changes in codes: set wire_bits")
        self.average_moment = bool(average_moment)
        """Whether the window carries the first moment's changes beside the parameters' (``"auto"`` resolved)."""
        buffers = 2 if self.average_moment else 1
        if self.average_moment and auto_bits:
            wire_bits = auto_wire_bits(density, buffers)
        self.wire_bits = wire_bits
        """The code width of the changes (``None``: ``wire_dtype`` values)."""
        if overlap and wire_bits is None:
            raise ValueError("overlap runs the averaging of the changes in codes beside the next step: set wire_bits")
        self.overlap = overlap
        """Whether each averaging lands one step late, its exchange running beside the next forward and backward."""
        if wire_bits is not None:
            self.quantizer = Quantizer(bits=wire_bits)
            scale = torch.finfo(torch.float32).bits / (buffers * self.quantizer.bits_per_value())
        self.wire_density = min(1.0, density * scale)
        """Fraction of the positions averaged per step (staggered) at the wire's size per position."""
        self.period = max(1, round(1.0 / self.wire_density))
        """Steps between two dense averages (``periodic``)."""
        if window_order == "auto":
            window_order = "spread" if narrow else "contiguous"
        self.window_order = window_order
        """The staggered window's order, ``"contiguous"`` or ``"spread"`` (``"auto"`` resolved)."""
        if normalizer == "auto":
            normalizer = "measured" if narrow else "debiased"
        self.normalizer = normalizer
        """``"debiased"``, ``"measured"`` or ``"local"`` (``"auto"`` resolved)."""
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            density,
            warmup_steps,
            max_grad_norm,
            bias_correction,
            group,
            wd_min_ndim=wd_min_ndim,
            config=f"LocalAdamS|{schedule}|{wire_dtype}|{normalizer}"
            + ("|spread" if window_order == "spread" else "")
            + ("" if wire_bits is None else f"|int{wire_bits}")
            + ("|moment" if self.average_moment else "")
            + ("|overlap" if overlap else "")
            + ("|s-bf16" if normalizer_dtype == torch.bfloat16 else ""),
        )
        b = self._bucket
        self.k = k_for(b.numel, b.world_size, self.wire_density)
        self._residual = b.new_shard() if self.quantizer is not None else None
        self._s = None if normalizer == "local" else b.new_flat().to(normalizer_dtype)
        self.noise: NoiseScale | None = NoiseScale() if normalizer == "measured" else None
        """The measured share of the debiased normalizer's noise estimate (``normalizer="measured"``)."""
        self._var_sum = torch.zeros((), dtype=torch.float64, device=self._flat.device)
        self._anchor: Tensor | None = None
        self._delta: Tensor | None = None
        if wire_dtype != torch.float32:
            self._anchor = self._flat.clone()
            if self.quantizer is None:
                self._delta = torch.zeros(b.padded_numel, dtype=wire_dtype, device=self._flat.device)
        self._moment_anchor = self._m.clone() if self.average_moment else None
        self._moment_residual = b.new_shard() if self.average_moment else None
        self._codes = None if self.quantizer is None else CodeAverager(self._comm, self.quantizer, overlap=overlap)
        self._repost = False  # restored with the last step's averaging unsent: send it at the next step

    def _extra_moments(self) -> dict[str, Tensor]:
        return {} if self._s is None else {"exp_avg_sq": self._s}

    def _segment_update(
        self, w: Tensor, state: dict[str, Tensor], g: Tensor, grp: dict[str, Any], wd: float, step: int
    ) -> None:
        """AdamS; with the debiased normalizer the local phase takes the noise of one rank's gradient out.

        See :func:`optim.adams.debiased_adams_step_`.
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
            world_size=p if self.noise is None else effective_world_size(self.noise.rho, p),
            var_sum=None if self.noise is None else self._var_sum,
            shared_moment=self.average_moment,
        )

    def window(self, t: int) -> ShardedMask:
        """The positions averaged after step ``t`` (staggered): the same window in every shard.

        Window ``j = t - warmup_steps`` is positions ``[j * k, (j + 1) * k)`` (mod the
        shard size), in the shard's own order or, with ``window_order="spread"``,
        in the order of :func:`spread_positions`.
        """
        b = self._bucket
        pos = window_positions(t - self.warmup_steps, self.k, b.shard_size, self.window_order)
        return ShardedMask(numel=b.numel, world_size=b.world_size, k=self.k, indices=pos.expand(b.world_size, self.k))

    def is_average_step(self, t: int) -> bool:
        """Whether (part of) the parameters are averaged after step ``t``."""
        if t < self.warmup_steps:
            return False
        return self.schedule == "staggered" or (t + 1 - self.warmup_steps) % self.period == 0

    def _run(self, t: int) -> None:
        super()._run(t)
        if t < self.warmup_steps:  # the replicas and first moments are identical during the warm-up
            for buf, anchor, _ in self._anchored():
                anchor.copy_(buf)

    def _anchored(self) -> list[tuple[Tensor, Tensor, Tensor | None]]:
        """``(buffer, its last average, the owner's residual of its codes)`` for what the window averages as changes."""
        out: list[tuple[Tensor, Tensor, Tensor | None]] = []
        if self._anchor is not None:
            out.append((self._flat, self._anchor, self._residual))
        if self._moment_anchor is not None:
            out.append((self._m, self._moment_anchor, self._moment_residual))
        return out

    def _average(self, t: int) -> None:
        p = self._bucket.world_size
        if self.noise is not None and p > 1:  # the step's clipped gradient and estimate, for the next step
            self.noise.measure(self._comm, self._grad, (1.0 - 1.0 / p) * float(self._var_sum), t)
            self._var_sum.zero_()
        if not self.is_average_step(t) or p == 1:
            return  # one rank: nothing to average (and no bfloat16 rounding of its own changes)
        n, flat, anchor = self._bucket.numel, self._flat, self._anchor
        if self.quantizer is not None:
            assert self._codes is not None
            self._codes.land()  # overlap: the averaging started after the last step
            self._start(t)
            return
        if anchor is None or self._delta is None:
            if self.schedule == "periodic":
                self._comm.all_reduce(flat, ReduceOp.AVG)
            else:
                sparse_all_reduce(self._comm, flat[:n], self.window(t), "avg", verify_mask=False)
            return
        delta = self._delta
        if self.schedule == "periodic":
            torch.sub(flat, anchor, out=delta)
            self._comm.all_reduce(delta, ReduceOp.AVG)
            anchor.add_(delta)
            flat.copy_(anchor)
            return
        mask = self.window(t)
        pos = mask.global_indices(flat.device)
        averaged = anchor.index_select(0, pos)
        delta.index_copy_(0, pos, flat.index_select(0, pos).sub_(averaged).to(delta.dtype))
        sparse_all_reduce(self._comm, delta[:n], mask, "avg", verify_mask=False)
        averaged.add_(delta.index_select(0, pos))
        anchor.index_copy_(0, pos, averaged)
        flat.index_copy_(0, pos, averaged)

    def _slots(self, t: int) -> WindowSlots:
        b = self._bucket
        if self.schedule == "periodic":
            return WindowSlots(0, b.shard_size, b.shard_size, b.world_size, "contiguous")
        return WindowSlots(t - self.warmup_steps, self.k, b.shard_size, b.world_size, self.window_order)

    def _start(self, t: int) -> None:
        """Average the changes since the anchors at the positions of step ``t`` in codes (:mod:`optim.averaging`)."""
        assert self._codes is not None
        anchored = [(buf, anchor, residual) for buf, anchor, residual in self._anchored() if residual is not None]
        self._codes.start(t, self._slots(t), anchored)

    def wait_in_flight(self) -> None:
        """Wait until the averaging in flight (``overlap``) has moved its bytes; it still lands at the next step.

        For exact byte counts over a window of steps; a no-op without ``overlap``.
        """
        if self._codes is not None:
            self._codes.wait()

    def _settle(self) -> None:
        """After a restore, send the averaging the last step started (the same bytes as the first time)."""
        if not self._repost:
            return
        self._repost = False
        t = self._step - 1
        if self._bucket.world_size > 1 and t >= self.warmup_steps and self.is_average_step(t):
            self._start(t)

    def _quiesce(self) -> None:
        """Drop the averaging in flight unwaited before a restore; the restored state sends it again."""
        if self._codes is not None:
            self._codes.drop()
        self._repost = self.overlap

    def abandon(self) -> None:
        """Drop the averaging in flight without waiting for it (its transport failed). Local."""
        self._repost = False
        if self._codes is not None:
            self._codes.abandon()

    def close(self) -> None:
        """Land the averaging still in flight and stop its thread (call before tearing the group down)."""
        if self._codes is not None:
            self._codes.close()

    def _full_state(self) -> dict[str, Tensor]:
        out = {**super()._full_state(), **self._extra_moments()}
        if self._anchor is not None:
            out["anchor"] = self._anchor
        if self._moment_anchor is not None:
            out["exp_avg_anchor"] = self._moment_anchor
        return out

    def _own_state(self) -> dict[str, Tensor]:
        out = {}
        if self._residual is not None:
            out["wire_residual"] = self._residual
        if self._moment_residual is not None:
            out["exp_avg_wire_residual"] = self._moment_residual
        return out

    def _check_shard(self, what: str, sh: dict[str, Any]) -> None:
        super()._check_shard(what, sh)
        if self.noise is not None:
            check_noise_state(sh.get("extra") or {})

    def _copy_full(self, extra: dict[str, Any]) -> None:
        super()._copy_full(extra)
        if self.noise is not None:
            self.noise.load_state_dict(extra)

    def _snapshot_extra(self) -> dict[str, Any]:
        return {**super()._snapshot_extra(), **({} if self.noise is None else {"noise_ema": self.noise.ema})}

    def _extra_state(self) -> dict[str, Any]:
        return {**super()._extra_state(), **({} if self.noise is None else self.noise.state_dict())}

    @torch.no_grad()
    def restore_replica(self, snap: dict[str, Any]) -> None:
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
        return self._anchor

    @torch.no_grad()
    def average_params(self) -> None:
        """Average every rank's replica into the parameters, for good (one dense all_reduce).

        Collective: every rank must call this. Use it once training is over (or
        before saving a model that must be the same on every rank); the local
        first moments are kept. With ``overlap``, the averaging in flight lands first.
        """
        self._settle()
        if self._codes is not None:
            self._codes.land()
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
        if self._codes is not None:  # the replicas as they will be once the averaging in flight lands
            self._codes.landed_into(self._flat)
        self._average_replicas()
        try:
            yield
        finally:
            self._flat.copy_(own)
            self._bucket.write_params(self._flat)
            self._master.copy_(self._bucket.own_slice(self._flat))
