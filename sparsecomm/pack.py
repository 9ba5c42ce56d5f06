"""Pack values at a mask into a contiguous buffer, and scatter them back.

A :class:`PackPlan` is built once per (mask, device) and cached on the mask:
it holds the int64 positions to gather (padding positions clamped to 0 and
zeroed after the gather) and to scatter (padding dropped). Kernels plug in
through :class:`PackKernel`:

* ``torch``: ``index_select`` / ``index_copy_`` — every device, the baseline;
* ``numba``: a ``parallel=True`` CPU loop (values moved as same-width
  integers, so bfloat16 and float16 work too).

:func:`kernel_for` picks, per device type and element width, the faster of
the available kernels by timing both once on a representative size — except
on CPU with one torch thread per rank, where it is torch
(``$SPARSECOMM_PACK_KERNEL=torch|numba|numba-cuda`` forces one).
"""

from __future__ import annotations

import itertools
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
    "NumbaCudaKernel",
    "candidates",
    "time_kernel",
    "KERNEL_ENV",
    "kernel_for",
    "pack_plan",
    "PiecesPlan",
    "pieces_plan",
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


_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class TorchKernel:
    """``index_select`` / ``index_copy_``: works on every device and dtype.

    On CPU the scatter is numpy's fancy assignment on same-width integer
    views (2x faster than one-thread ``index_copy_`` at 1% of 16M float32
    here, 1.25x at 10%; the values move bit for bit).
    """

    name = "torch"

    def pack(self, src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
        torch.index_select(src, 0, idx, out=out)

    def unpack(self, packed: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor) -> None:
        if dst.device.type == "cpu" and dst.is_contiguous() and packed.is_contiguous():
            width = _INT_OF_WIDTH[dst.element_size()]
            dst.detach().view(width).numpy()[idx.numpy()] = packed.detach().view(width).numpy()
            return
        dst.index_copy_(0, idx, packed)


class NumbaKernel:
    """numba gather/scatter loops for CPU tensors.

    With one torch thread (the usual setting for several ranks per machine)
    it runs a serial loop: waking a thread pool per call costs a scheduler
    round trip on a busy machine. With more threads it runs a
    ``parallel=True`` loop on at most ``torch.get_num_threads()`` threads.
    """

    name = "numba"

    def __init__(self) -> None:
        import numba

        def gather(src: Any, idx: Any, out: Any) -> None:  # pragma: no cover - compiled
            for j in numba.prange(idx.shape[0]):
                out[j] = src[idx[j]]

        def scatter(packed: Any, idx: Any, dst: Any) -> None:  # pragma: no cover - compiled
            for j in numba.prange(idx.shape[0]):
                dst[idx[j]] = packed[j]

        serial = numba.njit(nogil=True, cache=True)
        parallel = numba.njit(parallel=True, nogil=True, cache=True)
        self._serial = (serial(gather), serial(scatter))
        self._parallel = (parallel(gather), parallel(scatter))
        self._numba = numba

    def _pick(self) -> tuple[Any, Any]:
        threads = min(torch.get_num_threads(), self._numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
        if threads <= 1:
            return self._serial
        self._numba.set_num_threads(threads)
        return self._parallel

    @staticmethod
    def _np(t: torch.Tensor) -> Any:
        return t.view(_INT_OF_WIDTH[t.element_size()]).numpy()

    def pack(self, src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
        self._pick()[0](self._np(src), idx.numpy(), self._np(out))

    def unpack(self, packed: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor) -> None:
        self._pick()[1](self._np(packed), idx.numpy(), self._np(dst))


class NumbaCudaKernel:
    """A numba-cuda gather/scatter on torch's current CUDA stream."""

    name = "numba-cuda"

    def __init__(self) -> None:
        from numba import cuda

        if not cuda.is_available():
            raise ImportError("numba-cuda: no CUDA device")

        @cuda.jit
        def gather(src: Any, idx: Any, out: Any) -> None:  # pragma: no cover - GPU
            j: int = cuda.grid(1)  # type: ignore[call-arg]
            if j < idx.shape[0]:
                out[j] = src[idx[j]]

        @cuda.jit
        def scatter(packed: Any, idx: Any, dst: Any) -> None:  # pragma: no cover - GPU
            j: int = cuda.grid(1)  # type: ignore[call-arg]
            if j < idx.shape[0]:
                dst[idx[j]] = packed[j]

        self._cuda = cuda
        self._gather = gather
        self._scatter = scatter

    def _launch(self, kernel: Any, a: torch.Tensor, idx: torch.Tensor, b: torch.Tensor) -> None:
        n = idx.numel()
        if n == 0:
            return
        cuda = self._cuda
        stream = cuda.external_stream(torch.cuda.current_stream(a.device).cuda_stream)
        threads = 256
        width = _INT_OF_WIDTH[a.element_size()]
        kernel[(n + threads - 1) // threads, threads, stream](
            cuda.as_cuda_array(a.view(width)), cuda.as_cuda_array(idx), cuda.as_cuda_array(b.view(width))
        )

    def pack(self, src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
        self._launch(self._gather, src, idx, out)

    def unpack(self, packed: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor) -> None:
        self._launch(self._scatter, packed, idx, dst)


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


@dataclass(frozen=True, kw_only=True, slots=True)
class PiecesPlan:
    """Where a mask falls in tensors laid end to end, built once per mask and layout."""

    runs: tuple[tuple[int, int, int, torch.Tensor], ...]
    """``(piece, lo, hi, idx)``: packed slots ``[lo, hi)`` are ``piece``'s values at ``idx``."""
    pad_lo: int
    """Packed slots from here on are padding (zeroed)."""


def pieces_plan(mask: ShardedMask, numels: tuple[int, ...], device: torch.device) -> PiecesPlan:
    """Return the cached :class:`PiecesPlan` of ``mask`` over pieces of ``numels`` elements on ``device``.

    The mask's global positions are sorted (shard-major, each shard's sorted),
    so each piece's positions are one run of packed slots.
    """
    key = ("pieces_plan", numels, str(device))
    cache: dict[object, Any] = mask._cache  # noqa: SLF001 - the mask's own derived-data cache
    plan = cache.get(key)
    if plan is None:
        g = mask.global_indices()
        starts = list(itertools.accumulate(numels, initial=0))
        cuts = [0, *torch.searchsorted(g, torch.tensor(starts[1:], dtype=torch.int64)).tolist()]
        spans = [(i, lo, hi) for i, (lo, hi) in enumerate(itertools.pairwise(cuts)) if hi > lo]
        local = g[: cuts[-1]].clone()
        for i, lo, hi in spans:
            local[lo:hi].sub_(starts[i])
        local = local.to(device)
        runs = tuple((i, lo, hi, local[lo:hi]) for i, lo, hi in spans)
        plan = cache.setdefault(key, PiecesPlan(runs=runs, pad_lo=cuts[-1]))
    return plan


_lock = threading.Lock()
_chosen: dict[tuple[str, int], PackKernel] = {}


def candidates(device: torch.device) -> list[PackKernel]:
    """Return the pack kernels that can run on ``device`` (torch first)."""
    kernels: list[PackKernel] = [TorchKernel()]
    extra: type[Any] = NumbaKernel if device.type == "cpu" else NumbaCudaKernel
    if device.type in ("cpu", "cuda"):
        try:
            kernels.append(extra())
        except ImportError as exc:
            logger.debug("%s unavailable (%s): pack kernel is torch", extra.name, exc)
    return kernels


def time_kernel(
    kernel: PackKernel, device: torch.device, dtype: torch.dtype, *, n: int = 1 << 22, k: int = 1 << 16, reps: int = 5
) -> tuple[float, float]:
    """Best-of-``reps`` (pack, unpack) seconds of ``kernel`` on ``k`` of ``n`` elements."""
    src = torch.zeros(n, dtype=dtype, device=device)
    idx = torch.randperm(n, device=device)[:k].sort().values
    out = torch.empty(k, dtype=dtype, device=device)
    kernel.pack(src, idx, out)  # compile / warm up
    kernel.unpack(out, idx, src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    sync(device)
    best_p = best_u = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        kernel.pack(src, idx, out)
        sync(device)
        t1 = time.perf_counter()
        kernel.unpack(out, idx, src)
        sync(device)
        t2 = time.perf_counter()
        best_p, best_u = min(best_p, t1 - t0), min(best_u, t2 - t1)
    return best_p, best_u


def _time(kernel: PackKernel, device: torch.device, dtype: torch.dtype) -> float:
    return sum(time_kernel(kernel, device, dtype))


def kernel_for(device: torch.device, dtype: torch.dtype) -> PackKernel:
    """Return the pack kernel for ``device`` and ``dtype``'s width, measured once per process."""
    forced = os.environ.get(KERNEL_ENV)
    key = (device.type, torch.empty((), dtype=dtype).element_size())
    with _lock:
        if key in _chosen:
            return _chosen[key]
        kernels = candidates(device)
        if forced:
            named = [k for k in kernels if k.name == forced]
            if not named:
                raise ValueError(f"{KERNEL_ENV}={forced!r}: not available on {device.type}")
            choice = named[0]
        elif len(kernels) == 1 or (device.type == "cpu" and torch.get_num_threads() <= 1):
            # One thread per rank: torch's index ops beat the serial numba loop
            # (0.32 vs 0.47 ms for 1% of 16M fp32 here) and many ranks per
            # machine make single-process timings of thread pools misleading.
            choice = kernels[0]
        else:
            times = {k.name: _time(k, device, dtype) for k in kernels}
            choice = min(kernels, key=lambda k: times[k.name])
            logger.info("pack kernel for %s/%d-byte values: %s (%s)", *key, choice.name, times)
        _chosen[key] = choice
        return choice
