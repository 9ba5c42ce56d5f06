"""Flat-buffer and shard bookkeeping for the sharded optimizers (ZeRO-1 layout).

All parameters of an optimizer (every param group, in order) are viewed as one
flat buffer of N elements, padded to P * shard_size (``shard_size = ceil(N/P)``).
Rank r owns the contiguous shard ``[r * shard_size, (r + 1) * shard_size)``; its
real elements are those below N, the rest is padding that is never updated.

The bucket also follows what happens to the parameters after it was built:
:meth:`FlatBucket.check_params` refuses a parameter whose shape, dtype or
device changed, :meth:`FlatBucket.rebind` re-attaches fp32 parameters whose
storage was replaced (``p.data = ...``, trainers that re-materialize the
model), and :meth:`FlatBucket.replace_param` swaps in a new parameter object
for one a module replaced.

A shard is cut into *segments*: maximal runs of consecutive real elements that
belong to the same param group and the same weight-decay rule (decay applies to
parameters with ``p.dim() >= wd_min_ndim``). The optimizers call the per-element
update once per segment with scalar hyperparameters, which is bitwise the same as
running the update per parameter (all the update's ops are elementwise).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from optim.optimizers.capabilities import ParamGroup

__all__ = ["FlatBucket", "OnFlatBucket", "Segment"]


@dataclass(frozen=True)
class Segment:
    """A run ``[lo, hi)`` of shard-local (or, in ``full_segments``, flat) positions sharing a group and a decay rule."""

    lo: int
    hi: int
    group: int
    decay: bool


class FlatBucket:
    """One flat fp32 view of the parameters of ``param_groups``, sharded over ``world_size``.

    Args:
        param_groups: The optimizer's param groups (dicts with ``"params"`` and
            ``"wd_min_ndim"``).
        rank: This rank.
        world_size: Number of shards P.

    Raises:
        ValueError: No parameters, a parameter listed twice, or parameters of
            different dtypes or devices (raised before any communication).
    """

    def __init__(self, param_groups: Sequence[ParamGroup], rank: int, world_size: int) -> None:
        params: list[Tensor] = []
        groups: list[int] = []
        names: list[str] = []
        for gi, group in enumerate(param_groups):
            given = group.get("param_names")
            for j, p in enumerate(group["params"]):
                names.append(str(given[j]) if given else f"params[{len(params)}]")
                params.append(p)
                groups.append(gi)
        if not params:
            raise ValueError("params: the optimizer got no parameters")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("params: a parameter appears more than once")
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(
                "params: all parameters must share one dtype and device, got "
                + ", ".join(sorted(f"{d}/{v}" for d, v in kinds))
            )
        for p in params:
            if not p.is_floating_point():
                raise ValueError(f"params: floating-point parameters required, got {p.dtype}")
        self.params = params
        self.names = names
        self.shapes = [p.shape for p in params]
        self.dtype, self.device = params[0].dtype, params[0].device
        self.rank, self.world_size = rank, world_size
        self.offsets: list[int] = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        if n == 0:
            raise ValueError("params: the parameters hold no elements")
        self.numel = n
        self.shard_size = -(-n // world_size)
        self.padded_numel = self.shard_size * world_size
        self.shard_lo = rank * self.shard_size
        self.real = max(0, min(self.shard_size, n - self.shard_lo))
        self.segments = self._segments(param_groups, groups, self.shard_lo, self.shard_lo + self.real)
        self.full_segments = self._segments(param_groups, groups, 0, n)
        """Segments of the whole flat buffer (positions ``[0, numel)``), for replicated-state optimizers."""

    def _segments(self, param_groups: Sequence[ParamGroup], groups: list[int], lo_g: int, hi_g: int) -> list[Segment]:
        """The segments of flat positions ``[lo_g, hi_g)``, relative to ``lo_g``."""
        out: list[Segment] = []
        for p, off, gi in zip(self.params, self.offsets, groups, strict=True):
            a, b = max(off, lo_g), min(off + p.numel(), hi_g)
            if a >= b:
                continue
            decay = p.dim() >= param_groups[gi]["wd_min_ndim"]
            seg = Segment(a - lo_g, b - lo_g, gi, decay)
            if out and out[-1].hi == seg.lo and (out[-1].group, out[-1].decay) == (gi, decay):
                seg = Segment(out[-1].lo, seg.hi, gi, decay)
                out[-1] = seg
            else:
                out.append(seg)
        return out

    # ------------------------------------------------------------------ flat buffers
    def new_flat(self) -> Tensor:
        """A zeroed fp32 buffer of ``padded_numel`` elements on the params' device."""
        return torch.zeros(self.padded_numel, dtype=torch.float32, device=self.device)

    def new_shard(self) -> Tensor:
        """A zeroed fp32 buffer of ``shard_size`` elements (this rank's shard) on the params' device."""
        return torch.zeros(self.shard_size, dtype=torch.float32, device=self.device)

    def gather_grads(self, out: Tensor) -> list[int]:
        """Fill ``out`` (padded flat fp32) with the params' grads; ``None`` grads give 0.

        Returns:
            The indices of the parameters without a gradient.
        """
        missing: list[int] = []
        for i, (p, off) in enumerate(zip(self.params, self.offsets, strict=True)):
            dst = out[off : off + p.numel()]
            if p.grad is None:
                dst.zero_()
                missing.append(i)
            else:
                if p.grad.is_sparse:
                    raise RuntimeError("sparse gradients are not supported; use dense ones")
                dst.copy_(p.grad.detach().reshape(-1))
        out[self.numel :].zero_()
        return missing

    def grads(self) -> tuple[list[Tensor], list[int]]:
        """The params' grads as flat tensors in buffer order, nothing copied; zeros for a ``None`` grad.

        Returns:
            The grads, and the indices of the parameters without one.
        """
        out: list[Tensor] = []
        missing: list[int] = []
        for i, p in enumerate(self.params):
            if p.grad is None:
                out.append(torch.zeros(p.numel(), dtype=self.dtype, device=self.device))
                missing.append(i)
            elif p.grad.is_sparse:
                raise RuntimeError("sparse gradients are not supported; use dense ones")
            else:
                out.append(p.grad.detach().reshape(-1))
        return out, missing

    @torch.no_grad()
    def bind_params(self, flat: Tensor) -> bool:
        """Make every fp32 parameter a view of ``flat`` (padded flat fp32), values kept.

        Afterwards :meth:`gather_params` and :meth:`write_params` on ``flat``
        copy nothing: a collective that writes ``flat`` writes the parameters
        (a sparse step then touches only the masked coordinates instead of
        copying the whole model twice). Parameters of another dtype stay as
        they are and keep the copying path.

        Returns:
            Whether the parameters are now views of ``flat``.
        """
        if self.dtype != torch.float32 or flat.dtype != torch.float32:
            return False
        self.gather_params(flat)
        for p, off in zip(self.params, self.offsets, strict=True):
            p.data = flat[off : off + p.numel()].view(p.shape)
        self._bound = flat
        return True

    def _is_bound(self, flat: Tensor) -> bool:
        bound = getattr(self, "_bound", None)
        return bound is not None and bound.data_ptr() == flat.data_ptr()

    def _misfit(self, index: int, t: Tensor, what: str, advice: str) -> ValueError | None:
        """The error for tensor ``t`` in slot ``index`` if its shape, dtype or device differ from the slot's."""
        shape = self.shapes[index]
        if t.shape == shape and t.dtype == self.dtype and t.device == self.device:
            return None
        return ValueError(
            f"parameter {self.names[index]}: {what} {tuple(t.shape)} {t.dtype} on {t.device}, but the optimizer "
            f"was built for {tuple(shape)} {self.dtype} on {self.device}; {advice}"
        )

    def check_params(self) -> None:
        """Raise ``ValueError`` naming the first parameter whose shape, dtype or device changed."""
        for i, p in enumerate(self.params):
            error = self._misfit(i, p, "now", "build the optimizer after moving or casting the model")
            if error is not None:
                raise error

    @torch.no_grad()
    def rebind(self, flat: Tensor) -> list[int]:
        """Make parameters that stopped being views of ``flat`` views again, keeping their values.

        Something replaced their storage (``p.data = ...``, ``swap_tensors``, a
        trainer that re-materializes the model): their current values are
        copied into ``flat`` and the parameters view ``flat`` again. A no-op
        when :meth:`bind_params` did not bind (non-fp32 parameters).

        Returns:
            The indices of the parameters re-bound.
        """
        if not self._is_bound(flat):
            return []
        base, size = flat.data_ptr(), flat.element_size()
        out: list[int] = []
        for i, (p, off) in enumerate(zip(self.params, self.offsets, strict=True)):
            n = p.numel()
            if n == 0 or (p.data_ptr() == base + off * size and p.is_contiguous()):
                continue
            view = flat[off : off + n]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view(p.shape)
            out.append(i)
        return out

    def replace_param(self, index: int, new: Tensor) -> None:
        """Put ``new`` in place of parameter ``index`` (same shape, dtype and device), unbound.

        Raises:
            ValueError: ``new`` does not fit the slot, or is already held.
        """
        error = self._misfit(index, new, "replaced by a tensor of", "build a new optimizer for the new parameters")
        if error is not None:
            raise error
        if any(new is p for p in self.params):
            raise ValueError(f"parameter {self.names[index]}: replaced by a parameter this optimizer already holds")
        self.params[index] = new

    def own_values(self, flat: Tensor) -> Tensor:
        """The current values of this rank's shard of the parameters, in ``own_slice(flat)`` (fp32).

        When the parameters view ``flat`` this is the slice itself; otherwise the
        owned ranges of the parameters are copied (cast to fp32) into it.
        """
        own = self.own_slice(flat)
        if self._is_bound(flat):
            return own
        lo_g, hi_g = self.shard_lo, self.shard_lo + self.real
        for p, off in zip(self.params, self.offsets, strict=True):
            a, b = max(off, lo_g), min(off + p.numel(), hi_g)
            if a < b:
                own[a - lo_g : b - lo_g].copy_(p.detach().reshape(-1)[a - off : b - off])
        return own

    def gather_params(self, out: Tensor) -> Tensor:
        """Fill ``out`` (padded flat fp32) with the current parameter values."""
        if self._is_bound(out):
            return out
        for p, off in zip(self.params, self.offsets, strict=True):
            out[off : off + p.numel()].copy_(p.detach().reshape(-1))
        out[self.numel :].zero_()
        return out

    @torch.no_grad()
    def write_params(self, flat: Tensor) -> None:
        """Copy ``flat`` (at least N elements) into the parameters (cast to their dtype)."""
        if self._is_bound(flat):
            return
        for p, off in zip(self.params, self.offsets, strict=True):
            p.copy_(flat[off : off + p.numel()].view(p.shape))

    def take_own(self, mine: Tensor, src: Tensor, old_rank: int) -> None:
        """Set ``mine`` (this rank's shard) to ``src``, old rank ``old_rank``'s shard of another layout, where both
        hold the same positions; zero elsewhere."""
        old_lo = old_rank * src.numel()
        lo = max(self.shard_lo, old_lo)
        hi = min(self.shard_lo + self.shard_size, old_lo + src.numel(), self.numel)
        mine.zero_()
        if lo < hi:
            mine[lo - self.shard_lo : hi - self.shard_lo].copy_(src[lo - old_lo : hi - old_lo])

    def own_slice(self, flat: Tensor) -> Tensor:
        """This rank's shard (``shard_size`` elements) of a padded flat buffer."""
        return flat[self.shard_lo : self.shard_lo + self.shard_size]

    # ------------------------------------------------------------------ identity
    def fingerprint(self, extra: str = "") -> int:
        """A 62-bit digest of the parameter count, shapes and dtype (plus ``extra``)."""
        h = hashlib.blake2b(digest_size=8, person=b"optim.buckets.fp")
        h.update(struct.pack("<q", len(self.params)))
        for p in self.params:
            h.update(struct.pack("<q", p.dim()))
            h.update(struct.pack(f"<{p.dim()}q", *p.shape))
        h.update(str(self.dtype).encode())
        h.update(extra.encode())
        return int.from_bytes(h.digest(), "little") >> 2


class OnFlatBucket:
    """The :attr:`bucket` and :attr:`communicator` of an optimizer that keeps its parameters in a flat bucket."""

    _bucket: FlatBucket
    _comm: Any

    @property
    def bucket(self) -> FlatBucket:
        """The flat layout of the parameters."""
        return self._bucket

    @property
    def communicator(self) -> Any:
        """The communicator the optimizer synchronizes over."""
        return self._comm
