"""Pack values at a mask into a contiguous buffer, and scatter them back.

A :class:`PackPlan` is built once per (mask, device) and cached on the mask:
it holds the int64 positions to gather (padding positions clamped to 0 and
zeroed after the gather) and to scatter (padding dropped). Kernels plug in
through :class:`PackKernel`:

* ``torch``: ``index_select`` / ``index_copy_`` — every device, the baseline;
* ``numba``: a ``parallel=True`` CPU loop (values moved as same-width
  integers, so bfloat16 and float16 work too).

:func:`kernel_for` picks, per device type and element width, the faster of
the available kernels by timing both once on a representative size
(``$SPARSECOMM_PACK_KERNEL=torch|numba`` forces one).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sparsecomm.mask import ShardedMask

__all__ = [
    "PackKernel",
    "PackPlan",
    "TorchKernel",
    "NumbaKernel",
    "KERNEL_ENV",
    "kernel_for",
    "pack_plan",
]

logger = logging.getLogger(__name__)

#: Forces a pack kernel: ``torch`` or ``numba``.
KERNEL_ENV = "SPARSECOMM_PACK_KERNEL"


class PackKernel(Protocol):
    """Moves values between a flat buffer and a packed buffer."""

    name: str

    def pack(self, src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
        """``out[j] = src[idx[j]]`` for every j."""
        ...

    def unpack(self, packed: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst[idx[j]] = packed[j]`` for every j."""
        ...


class TorchKernel:
    """``index_select`` / ``index_copy_``: works on every device and dtype."""

    name = "torch"

    def pack(self, src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
        torch.index_select(src, 0, idx, out=out)

    def unpack(self, packed: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor) -> None:
        dst.index_copy_(0, idx, packed)


_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class NumbaKernel:
    """A ``numba.njit(parallel=True)`` gather/scatter for CPU tensors."""

    name = "numba"

    def __init__(self) -> None:
        import numba

        @numba.njit(parallel=True, nogil=True, cache=True)
        def gather(src: Any, idx: Any, out: Any) -> None:  # pragma: no cover - compiled
            for j in numba.prange(idx.shape[0]):
                out[j] = src[idx[j]]

        @numba.njit(parallel=True, nogil=True, cache=True)
        def scatter(packed: Any, idx: Any, dst: Any) -> None:  # pragma: no cover - compiled
            for j in numba.prange(idx.shape[0]):
                dst[idx[j]] = packed[j]

        self._gather = gather
        self._scatter = scatter

    @staticmethod
    def _np(t: torch.Tensor) -> Any:
        return t.view(_INT_OF_WIDTH[t.element_size()]).numpy()

    def pack(self, src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
        self._gather(self._np(src), idx.numpy(), self._np(out))

    def unpack(self, packed: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor) -> None:
        self._scatter(self._np(packed), idx.numpy(), self._np(dst))


@dataclass(frozen=True, kw_only=True, slots=True)
class PackPlan:
    """Index tensors of one mask on one device, built once."""

    gather_idx: torch.Tensor
    """``P*k`` positions to read (padding positions read element 0)."""
    pad_slots: torch.Tensor | None
    """Packed slots that are padding (zeroed after the gather), or ``None``."""
    scatter_idx: torch.Tensor
    """Positions to write, padding dropped."""
    scatter_slots: torch.Tensor | None
    """Packed slots matching ``scatter_idx`` (``None``: all slots, in order)."""


def pack_plan(mask: ShardedMask, device: torch.device) -> PackPlan:
    """Return the cached :class:`PackPlan` of ``mask`` on ``device``."""
    key = ("pack_plan", str(device))
    cache: dict[object, Any] = mask._cache  # noqa: SLF001 - the mask's own derived-data cache
    plan = cache.get(key)
    if plan is None:
        g = mask.global_indices()
        valid = g < mask.numel
        if bool(valid.all()):
            gi = g.to(device)
            plan = PackPlan(gather_idx=gi, pad_slots=None, scatter_idx=gi, scatter_slots=None)
        else:
            slots = torch.arange(g.numel())
            plan = PackPlan(
                gather_idx=torch.where(valid, g, torch.zeros_like(g)).to(device),
                pad_slots=slots[~valid].to(device),
                scatter_idx=g[valid].to(device),
                scatter_slots=slots[valid].to(device),
            )
        plan = cache.setdefault(key, plan)
    return plan


_lock = threading.Lock()
_chosen: dict[tuple[str, int], PackKernel] = {}


def _candidates(device: torch.device) -> list[PackKernel]:
    kernels: list[PackKernel] = [TorchKernel()]
    if device.type == "cpu":
        try:
            kernels.append(NumbaKernel())
        except ImportError:
            logger.debug("numba not installed: pack kernel is torch")
    return kernels


def _time(kernel: PackKernel, device: torch.device, dtype: torch.dtype) -> float:
    n, k = 1 << 22, 1 << 16  # a 16 MB fp32 bucket at density ~1.5%
    src = torch.zeros(n, dtype=dtype, device=device)
    idx = torch.randperm(n, device=device)[:k].sort().values
    out = torch.empty(k, dtype=dtype, device=device)
    kernel.pack(src, idx, out)  # compile / warm up
    kernel.unpack(out, idx, src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        kernel.pack(src, idx, out)
        kernel.unpack(out, idx, src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def kernel_for(device: torch.device, dtype: torch.dtype) -> PackKernel:
    """Return the pack kernel for ``device`` and ``dtype``'s width, measured once per process."""
    forced = os.environ.get(KERNEL_ENV)
    key = (device.type, torch.empty((), dtype=dtype).element_size())
    with _lock:
        if key in _chosen:
            return _chosen[key]
        kernels = _candidates(device)
        if forced:
            named = [k for k in kernels if k.name == forced]
            if not named:
                raise ValueError(f"{KERNEL_ENV}={forced!r}: not available on {device.type}")
            choice = named[0]
        elif len(kernels) == 1:
            choice = kernels[0]
        else:
            times = {k.name: _time(k, device, dtype) for k in kernels}
            choice = min(kernels, key=lambda k: times[k.name])
            logger.info("pack kernel for %s/%d-byte values: %s (%s)", *key, choice.name, times)
        _chosen[key] = choice
        return choice
