"""SCAPE: sparse, mask-partitioned AdamS on the ZeRO-1 layout of :mod:`optim.optimizers.sharded`.

SCAPE's warm-up and refresh steps are the dense step of
:class:`optim.optimizers.sharded.ShardedAdamS`.

One sparse SCAPE step t::

    M_t = schedule.mask_for(t)               (built after step t-1-D)
    [error feedback] G += e
    sparse_reduce_scatter(avg) of G at M_t   -> owner gets g_hat (k values)
    [error feedback] e = G with the positions of M_t set to 0
    [clipping] g_hat *= min(1, c / ||g_hat||_global)   (one scalar all_reduce)
    owner: AdamS on its k masked coordinates (nu from local m and g_hat; no
           extra collective); unselected: 'freeze' (w, m untouched) or
           'decay_m' (m *= beta1, w untouched)
    sparse_all_gather of the updated master values at M_t -> every replica
    owner: propose its next piece = top-k |m| of its shard -> M_{t+1+D}
           (CPU: scored, selected and encoded on a worker thread beside the
           caller's next forward and backward; the gather starts at step t+1)

Step indices: ``t`` counts completed steps from 0; the AdamS bias correction uses
``t + 1``. SCAPE step ``t`` is dense when ``t < warmup_steps``, when
``refresh_every > 0 and t % refresh_every == 0``, when ``density == 1`` or when
no mask was made for it; it then behaves exactly like :class:`ShardedAdamS`.
Masks are proposed only for steps that will be sparse.

Wire bytes: dense ops are counted by the communicator's stats under
``reduce_scatter`` / ``all_gather``; sparse ones under ``sparse_reduce_scatter`` /
``sparse_all_gather``; mask pieces under ``mask_sync``; the clipping scalar under
``grad_clip``; the construction check under ``param_check``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT, StateDict

from bindings.validate import check_bool, check_choice, check_density, check_float, check_int
from optim.optimizers.sharded import ShardedAdamS
from sparsecomm.collectives import sparse_all_gather, sparse_reduce_scatter
from sparsecomm.mask import ShardedMask, k_for
from sparsecomm.schedule import MaskSchedule

__all__ = ["SCAPE", "UNSELECTED_POLICIES", "MASK_SCORES"]

UNSELECTED_POLICIES = ("freeze", "decay_m")
MASK_SCORES = ("abs_m", "abs_m_theta", "abs_m_residual")


class SCAPE(ShardedAdamS):
    """SCAPE: AdamS with sparse, owner-partitioned, delayed masks (the step is in the module docstring).

    The defaults (10 dense warm-up steps, ``decay_m``, score |m|·|w|, 10%
    exploration, no error feedback, no refresh) are the best of the ablation in
    ``benchmarks/README.md`` at density 0.01.

    Args:
        params: Parameters or param-group dicts (one dtype and device in all).
        lr, betas, eps, weight_decay, bias_correction: AdamS hyperparameters.
        density: Fraction of each shard synchronized per sparse step, in (0, 1].
        mask_delay: D >= 0: the mask made after step t is used at step t + 1 + D.
        warmup_steps: Dense steps before sparsity starts.
        unselected: ``"decay_m"`` (unselected m *= beta1, w unchanged; default)
            or ``"freeze"`` (unselected w and m bitwise unchanged).
        error_feedback: Keep a local residual e (padded flat, fp32): each sparse
            step sends G + e at the mask and keeps the rest in e; a dense step
            sends G + e entirely and clears e.
        refresh_every: If > 0, steps with ``t % refresh_every == 0`` are dense.
        score: Mask statistic on the owner's shard: ``"abs_m"`` (|m|),
            ``"abs_m_theta"`` (|m|·|w|) or ``"abs_m_residual"`` (|m + (1-beta1)·e|
            with the owner's own residual e, so unsent gradient can enter the
            mask; needs ``error_feedback``).
        explore: Fraction in [0, 1) of each shard's k taken round-robin (a window
            that moves by its own length every step) instead of by score, so
            every coordinate is visited.
        max_grad_norm: Clip the global norm of the synchronized values (0 = off).
        group: ``sparsecomm.distributed`` group (default: the default group).
        background_proposal: On CPU, build the next mask piece (score, top-k,
            encoding) on a worker thread that runs beside the caller's next
            forward and backward instead of inside ``step()``; its gather is
            posted at the start of the next ``step()``. The selection is the
            same bit for bit either way. (On CUDA the piece is built in line.)

    Attributes:
        last_mask: The mask used by the last step (``None`` if it was dense).
    """

    # A sparse step writes the master at k positions and the parameters there: with the master kept
    # in the parameters, no step reads the whole shard to find what was written from outside.
    _master_in_params = True

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        *,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        density: float = 0.01,
        mask_delay: int = 1,
        warmup_steps: int = 10,
        unselected: str = "decay_m",
        error_feedback: bool = False,
        refresh_every: int = 0,
        max_grad_norm: float = 0.0,
        bias_correction: bool = True,
        score: str = "abs_m_theta",
        explore: float = 0.1,
        group: Any = None,
        wd_min_ndim: int = 2,
        background_proposal: bool = True,
    ) -> None:
        check_density(density)
        for name, v in (("mask_delay", mask_delay), ("warmup_steps", warmup_steps), ("refresh_every", refresh_every)):
            check_int(name, v, low=0)
        check_choice("unselected", unselected, UNSELECTED_POLICIES)
        check_choice("score", score, MASK_SCORES)
        if score == "abs_m_residual" and not error_feedback:
            raise ValueError("score='abs_m_residual' needs error_feedback=True")
        check_float("explore", explore, low=0.0, high=1.0, high_open=True)
        check_bool("background_proposal", background_proposal)
        self.density = float(density)
        self.mask_delay = mask_delay
        self.warmup_steps = warmup_steps
        self.unselected = unselected
        self.error_feedback = bool(error_feedback)
        self.refresh_every = refresh_every
        self.score = score
        self.explore = float(explore)
        config = (
            f"{self.density!r}|{mask_delay}|{warmup_steps}|{unselected}|"
            f"{self.error_feedback}|{refresh_every}|{float(max_grad_norm)!r}|{score}|{self.explore!r}"
        )
        super().__init__(
            params,
            lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_grad_norm=max_grad_norm,
            group=group,
            wd_min_ndim=wd_min_ndim,
            _config=config,
        )
        b = self._bucket
        self.last_mask: ShardedMask | None = None
        self._residual = b.new_flat() if self.error_feedback else None
        self._score_buf: Tensor | None = None  # the mask statistic's scratch (real shard positions)
        self._grad_pieces: list[Tensor] | None = None  # this step's gradients, when read at the mask only
        self._sched: MaskSchedule | None = None
        self._background = background_proposal and self._master.device.type == "cpu"
        if self.density < 1.0:
            self._sched = MaskSchedule(self._comm, numel=b.numel, density=self.density, delay=mask_delay)

    @property
    def residual(self) -> Tensor | None:
        """The error-feedback residual (padded flat fp32), or ``None`` without error feedback."""
        return self._residual

    def is_sparse_step(self, t: int) -> bool:
        """Whether step ``t`` is planned sparse (it still falls back to dense without a mask)."""
        if self._sched is None or t < self.warmup_steps:
            return False
        return not (self.refresh_every > 0 and t % self.refresh_every == 0)

    def next_mask(self) -> ShardedMask | None:
        """The mask the next ``step()`` will use (waits for its gather), or ``None`` if dense."""
        if not self.is_sparse_step(self._step):
            return None
        assert self._sched is not None
        return self._sched.mask_for(self._step)

    def _take_grads(self) -> None:
        # A sparse step without a residual reads each gradient at the mask only: no full-size copy.
        self._grad_pieces = None
        if self._residual is None and self._bucket.dtype == torch.float32 and self.next_mask() is not None:
            pieces, missing = self._bucket.grads()
            self._check_grads(missing)
            self._grad_pieces = pieces
        else:
            super()._take_grads()

    def _run(self, t: int) -> None:
        mask = self.next_mask()
        self.last_mask = mask
        if mask is None:
            if self._residual is not None:
                self._grad.add_(self._residual)
                self._residual.zero_()
            self._dense_step(t)
        else:
            self._sparse_step(t, mask)

    def _sparse_step(self, t: int, mask: ShardedMask) -> None:
        b, comm = self._bucket, self._comm
        n = b.numel
        if self._residual is not None:
            self._grad.add_(self._residual)
        src, self._grad_pieces = self._grad[:n] if self._grad_pieces is None else self._grad_pieces, None
        g = sparse_reduce_scatter(comm, src, mask, "avg", verify_mask=False)
        del src  # holds no gradient past the step
        assert isinstance(g, Tensor)
        if self._residual is not None:
            self._residual.copy_(self._grad)
            self._residual.index_fill_(0, mask.global_indices(self._grad.device), 0.0)
        self._clip(g)
        idx = mask.piece(b.rank).to(self._master.device)
        w = self._master.index_select(0, idx)  # index_select / index_copy_: 2-4x faster than [idx] on CPU
        state = {name: s.index_select(0, idx) for name, s in self._shard.items()}
        if self.unselected == "decay_m":
            self._decay_first_moment()  # the k selected values are overwritten with their update below
        self._update(w, state, g, t + 1, idx)
        self._master.index_copy_(0, idx, w)
        for name, s in self._shard.items():
            s.index_copy_(0, idx, state[name])
        flat = b.gather_params(self._flat)
        sparse_all_gather(comm, w, mask, flat[:n], verify_mask=False)
        b.write_params(flat)

    def _decay_first_moment(self) -> None:
        """m *= beta1 over the whole shard, in place (one pass; the caller then writes the selected values)."""
        m = self._shard["exp_avg"]
        for seg in self._bucket.segments:
            m[seg.lo : seg.hi].mul_(self.param_groups[seg.group]["betas"][0])

    def _after(self, t: int) -> None:
        """Propose this rank's piece of the mask of step t + 1 + D from |m| of its shard."""
        if self._sched is None:
            return
        if self._background:
            self._sched.prefetch()  # a mask whose gather finished decodes beside the next forward/backward
        if not self.is_sparse_step(self._sched.target_step(t)):
            return
        # The worker reads m, the master shard and the residual, which nothing writes before the next
        # step() (it settles first) or a restore (it quiesces first).
        self._sched.propose(t, (lambda: self._scores(t)) if self._background else self._scores(t))

    def _settle(self) -> None:
        if self._sched is not None:
            self._sched.settle()

    def _quiesce(self) -> None:
        if self._sched is not None:
            self._sched.discard_unsent()

    def _scores(self, t: int) -> Tensor:
        """The mask statistic of this rank's shard (real positions only) after step ``t``."""
        b = self._bucket
        m = self._shard["exp_avg"][: b.real]
        if self._score_buf is None:  # one scratch buffer for every step: no fresh pages to fault in each time
            self._score_buf = torch.empty_like(m)
        scores = self._score_buf
        if self.score == "abs_m_theta":  # |m * w| is |m| * |w| bit for bit: one product, abs in place
            torch.mul(m, self._master[: b.real], out=scores).abs_()
        elif self.score == "abs_m_residual":
            assert self._residual is not None
            e = b.own_slice(self._residual)[: b.real]
            scores.copy_(m)
            for seg in b.segments:
                beta1 = self.param_groups[seg.group]["betas"][0]
                scores[seg.lo : seg.hi].add_(e[seg.lo : seg.hi], alpha=1.0 - beta1)
            scores.abs_()
        else:
            torch.abs(m, out=scores)
        assert self._sched is not None
        n_explore = min(b.real, math.ceil(self.explore * self._sched.k))
        if n_explore > 0:
            lo = (t * n_explore) % b.real
            window = torch.arange(lo, lo + n_explore, device=scores.device) % b.real
            scores[window] = math.inf
        return scores

    def close(self) -> None:
        """Finish the mask gathers still in flight (call before tearing the group down)."""
        if self._sched is not None:
            self._sched.close()

    def abandon(self) -> None:
        """Drop the mask gathers in flight without waiting (their transport failed)."""
        if self._sched is not None:
            self._sched.abandon()

    def checkpoint_decay(self) -> dict[str, float]:
        """With ``unselected="decay_m"``, every unselected first moment is multiplied by beta1 in a sparse step."""
        betas = {g["betas"][0] for g in self.param_groups}
        if self.unselected != "decay_m" or self.density >= 1.0 or len(betas) != 1:
            return {}
        return {"shard/exp_avg": float(betas.pop())}

    def snapshot_growth(self) -> int:
        """Snapshots hold no masks during the dense warm-up, ``mask_delay`` masks of ``world_size x k``
        int64 indices once sparse: room for them."""
        if self.density >= 1.0:
            return 0
        b = self.bucket
        return self.mask_delay * b.world_size * k_for(b.numel, b.world_size, self.density) * 8

    # ------------------------------------------------------------------ state
    def _extra_state(self, *, live: bool) -> StateDict:
        # A state dict holds every mask of steps step .. step + D, waiting for the newest gather. A snapshot
        # (live tensors) holds the masks of the next D steps, proposed before the last step (their gathers
        # had a step to finish); the newest one (step + D) is re-made on restore from the restored first
        # moment, bit for bit.
        count = self.mask_delay if live else self.mask_delay + 1
        masks = {} if self._sched is None else self._sched.masks_from(self._step, count)
        residual = self._residual if live or self._residual is None else self._residual.clone()
        return {"masks": {s: m.indices if live else m.indices.clone() for s, m in masks.items()}, "residual": residual}

    def _load_extra(self, extra: StateDict, *, what: str, collective: bool) -> None:
        b = self._bucket
        if (extra.get("residual") is None) != (self._residual is None):
            raise ValueError(f"{what}: error_feedback setting differs from the saved state")
        if self._residual is not None:
            self._residual.copy_(extra["residual"])
        if self._sched is None:
            if extra["masks"]:
                raise ValueError(f"{what}: holds masks but this optimizer is dense (density 1)")
            return
        if collective:
            self._sched.abandon()  # a restore after a failure: what was in flight is gone
        else:
            self._sched.close()
        for s, idx in sorted(extra["masks"].items()):
            self._sched.install(
                int(s), ShardedMask(numel=b.numel, world_size=b.world_size, k=idx.shape[1], indices=idx)
            )
        if not collective:
            return
        # Re-make every mask of steps step .. step + D the snapshot does not hold (the newest one,
        # step + D; all of them after a re-shard) from the restored state, exactly as it was made.
        held = {int(s) for s in extra["masks"]}
        for target in range(self._step, self._step + self.mask_delay + 1):
            if target not in held and self.is_sparse_step(target):
                made = target - 1 - self.mask_delay
                self._sched.propose(made, self._scores(made))
