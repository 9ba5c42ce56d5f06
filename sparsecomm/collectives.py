"""Sparse collectives over a mask that every rank shares.

If every rank packs the same positions, the packed vectors line up element
by element, so a plain dense collective on the packed buffers is exact and no
index travels with the data. For a flat buffer of N elements in P
shards and a :class:`~sparsecomm.mask.ShardedMask` with k positions per shard:

* :func:`sparse_reduce_scatter` packs ``input`` at the mask into P·k values
  (segment r = shard r's positions), reduce-scatters them, and leaves this
  rank's k reduced values;
* :func:`sparse_all_gather` gathers every shard's k values and writes them
  into ``output`` at the mask (other positions untouched);
* :func:`sparse_all_reduce` reduces ``tensor`` in place at the mask (one
  all-reduce of the P·k packed values: the same wire bytes as
  reduce-scatter + all-gather, one collective fewer).

Every call validates its arguments before any communication. With
``verify_mask=True`` (the default) the ranks first compare the mask's digest
with one 16-byte all-reduce, and every rank raises ``ValueError`` if the
masks differ — nothing is sent and nothing is written. Masks from
:class:`~sparsecomm.schedule.MaskSchedule` are identical by construction, so
its users pass ``verify_mask=False``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bindings import ChainedWork, Communicator, ReduceOp, Work, parse_reduce_op
from sparsecomm.mask import ShardedMask
from sparsecomm.pack import kernel_for, pack_plan, pieces_plan

__all__ = [
    "SPARSE_DTYPES",
    "sparse_reduce_scatter",
    "sparse_all_gather",
    "sparse_all_reduce",
    "verify_same_mask",
    "pack",
    "unpack",
]

logger = logging.getLogger(__name__)

#: Value dtypes of the sparse collectives.
SPARSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_mask(comm: Communicator, mask: Any) -> ShardedMask:
    if not isinstance(mask, ShardedMask):
        raise TypeError(f"mask: expected a ShardedMask, got {type(mask).__name__}")
    if mask.world_size != comm.world_size:
        raise ValueError(f"mask: built for world_size {mask.world_size}, the group has {comm.world_size} ranks")
    return mask


def _check_values(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SPARSE_DTYPES:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; use one of {SPARSE_DTYPES}")
    return t


def _check_op(op: Any) -> ReduceOp:
    rop = parse_reduce_op(op)
    if rop not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"op: sparse collectives support SUM and AVG, got {rop.name}")
    return rop


def _check_numel(name: str, t: torch.Tensor, mask: ShardedMask) -> None:
    if t.numel() != mask.numel:
        raise ValueError(f"{name}: numel {t.numel()} does not match the mask's numel {mask.numel}")


def verify_same_mask(comm: Communicator, mask: ShardedMask, op_name: str) -> None:
    """Raise ``ValueError`` on every rank unless all ranks hold the same mask.

    Collective: every rank of ``comm`` must call this.
    """
    d = mask.digest()
    both = torch.tensor([d, -d], dtype=torch.int64)
    with comm.stats.scope("mask_check"):
        comm.all_reduce(both, ReduceOp.MAX)
    if int(both[0]) != d or int(-both[1]) != d:
        raise ValueError(f"mask: {op_name} was called with masks that differ between ranks")


def _check_input(input: Any, mask: ShardedMask) -> torch.Tensor | list[torch.Tensor]:
    """``input`` as one flat tensor, or as its pieces (tensors of one dtype and device laid end to end)."""
    if isinstance(input, torch.Tensor):
        _check_values("input", input)
        _check_numel("input", input, mask)
        return input.reshape(-1)
    if not isinstance(input, Sequence) or not input:
        raise TypeError(f"input: expected a torch.Tensor or a non-empty sequence of them, got {type(input).__name__}")
    pieces = [_check_values(f"input[{i}]", t) for i, t in enumerate(input)]
    kinds = {(t.dtype, t.device) for t in pieces}
    if len(kinds) != 1:
        raise TypeError(f"input: the pieces must share one dtype and device, got {sorted(map(str, kinds))}")
    total = sum(t.numel() for t in pieces)
    if total != mask.numel:
        raise ValueError(f"input: the pieces hold {total} elements, the mask's numel is {mask.numel}")
    return [t.reshape(-1) for t in pieces]


def pack(
    flat: torch.Tensor | Sequence[torch.Tensor], mask: ShardedMask, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gather ``flat[mask]`` into a contiguous ``P*k`` buffer (padding positions read as 0).

    ``flat`` may also be a sequence of 1-D tensors whose values laid end to end
    are the flat buffer (a model's gradients): each is read at its own
    positions only, nothing is concatenated.
    """
    if not isinstance(flat, torch.Tensor):
        return _pack_pieces(flat, mask, out)
    plan = pack_plan(mask, flat.device)
    if out is None:
        out = torch.empty(plan.gather_idx.numel(), dtype=flat.dtype, device=flat.device)
    kernel_for(flat.device, flat.dtype).pack(flat, plan.gather_idx, out)
    if plan.pad_slots is not None:
        out.index_fill_(0, plan.pad_slots, 0)
    return out


def _pack_pieces(pieces: Sequence[torch.Tensor], mask: ShardedMask, out: torch.Tensor | None) -> torch.Tensor:
    first = pieces[0]
    plan = pieces_plan(mask, tuple(t.numel() for t in pieces), first.device)
    if out is None:
        out = torch.empty(mask.k * mask.world_size, dtype=first.dtype, device=first.device)
    kernel = kernel_for(first.device, first.dtype)
    for i, lo, hi, idx in plan.runs:
        kernel.pack(pieces[i], idx, out[lo:hi])
    out[plan.pad_lo :].zero_()
    return out


def unpack(packed: torch.Tensor, mask: ShardedMask, flat: torch.Tensor) -> None:
    """Write ``packed`` (``P*k`` values) into ``flat`` at the mask (padding dropped)."""
    plan = pack_plan(mask, flat.device)
    src = packed if plan.scatter_slots is None else packed.index_select(0, plan.scatter_slots)
    kernel_for(flat.device, flat.dtype).unpack(src, plan.scatter_idx, flat)


def _flat_view(name: str, t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], object] | None]:
    """A contiguous flat buffer for ``t`` and the copy-back step if ``t`` was strided."""
    if t.is_contiguous():
        return t.view(-1), None
    buf = t.contiguous().view(-1)
    return buf, lambda: t.copy_(buf.view(t.shape))


def _finish(work: Work | None, finish: Callable[[], object], async_op: bool) -> ChainedWork | None:
    if work is None:
        finish()
        return None
    chained = ChainedWork(work, finish)
    if async_op:
        return chained
    chained.wait()
    return None


def sparse_reduce_scatter(
    comm: Communicator,
    input: torch.Tensor | Sequence[torch.Tensor],
    mask: ShardedMask,
    op: Any = "sum",
    *,
    output: torch.Tensor | None = None,
    async_op: bool = False,
    verify_mask: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, Work]:
    """Reduce ``input`` at the mask; return this rank's ``k`` reduced values.

    Collective: every rank of ``comm`` must call this with the same mask.

    Args:
        comm: The communicator.
        input: N values (any shape), or a sequence of tensors of one dtype
            and device whose values laid end to end are the N values (a
            model's gradients: each is read at its masked positions only,
            nothing is concatenated); not modified.
        mask: The shared mask (``mask.numel == input.numel()``).
        op: ``"sum"`` or ``"avg"`` (or the ``ReduceOp`` spellings).
        output: Optional buffer of ``k`` elements (same dtype and device).
        async_op: Return ``(output, work)``; ``output`` is valid after ``work.wait()``.
        verify_mask: Check first that every rank holds the same mask.

    Returns:
        The ``k`` values of shard ``comm.rank``, in mask order; with
        ``async_op``, the pair ``(output, work)``.

    Raises:
        TypeError, ValueError: Bad arguments or masks that differ between ranks.
        CommError: Transport failure or timeout.
    """
    mask = _check_mask(comm, mask)
    flat = _check_input(input, mask)
    rop = _check_op(op)
    first = flat if isinstance(flat, torch.Tensor) else flat[0]
    dtype, device = first.dtype, first.device
    if output is None:
        output = torch.empty(mask.k, dtype=dtype, device=device)
    else:
        _check_values("output", output)
        if output.numel() != mask.k or output.dtype != dtype or output.device != device:
            raise ValueError(
                f"output: expected {mask.k} elements of {dtype} on {device}, got "
                f"{output.numel()} of {output.dtype} on {output.device}"
            )
    if verify_mask:
        verify_same_mask(comm, mask, "sparse_reduce_scatter")
    with comm.stats.scope("sparse_reduce_scatter"):
        packed = pack(flat, mask)
        work = comm.reduce_scatter(output, packed, rop, async_op=async_op)
    if async_op:
        assert work is not None
        return output, work
    return output


def sparse_all_gather(
    comm: Communicator,
    shard_values: torch.Tensor,
    mask: ShardedMask,
    output: torch.Tensor,
    *,
    async_op: bool = False,
    verify_mask: bool = True,
) -> Work | None:
    """Gather every shard's ``k`` values and write them into ``output`` at the mask.

    Collective: every rank of ``comm`` must call this with the same mask.
    Positions of ``output`` outside the mask are not touched.

    Args:
        comm: The communicator.
        shard_values: This rank's ``k`` values (shard ``comm.rank``), in mask order.
        mask: The shared mask.
        output: N elements (``mask.numel``), same dtype and device.
        async_op: Return a work handle; ``output`` is written by ``wait()``.
        verify_mask: Check first that every rank holds the same mask.
    """
    _check_values("shard_values", shard_values)
    _check_values("output", output)
    mask = _check_mask(comm, mask)
    _check_numel("output", output, mask)
    if shard_values.numel() != mask.k:
        raise ValueError(f"shard_values: expected k={mask.k} elements, got {shard_values.numel()}")
    if shard_values.dtype != output.dtype:
        raise TypeError(f"output: dtype {output.dtype} does not match shard_values dtype {shard_values.dtype}")
    if shard_values.device != output.device:
        raise ValueError(f"output: device {output.device} does not match shard_values device {shard_values.device}")
    if verify_mask:
        verify_same_mask(comm, mask, "sparse_all_gather")
    packed = torch.empty(mask.k * mask.world_size, dtype=output.dtype, device=output.device)
    with comm.stats.scope("sparse_all_gather"):
        work = comm.all_gather(packed, shard_values.reshape(-1), async_op=async_op)
    flat, copy_back = _flat_view("output", output)

    def finish() -> None:
        unpack(packed, mask, flat)
        if copy_back is not None:
            copy_back()

    return _finish(work, finish, async_op)


def sparse_all_reduce(
    comm: Communicator,
    tensor: torch.Tensor,
    mask: ShardedMask,
    op: Any = "sum",
    *,
    async_op: bool = False,
    verify_mask: bool = True,
) -> Work | None:
    """Reduce ``tensor`` across ranks at the mask, in place; other positions untouched.

    Collective: every rank of ``comm`` must call this with the same mask.

    Args:
        comm: The communicator.
        tensor: N values (``mask.numel``), reduced in place at the mask.
        mask: The shared mask.
        op: ``"sum"`` or ``"avg"``.
        async_op: Return a work handle; ``tensor`` is written by ``wait()``.
        verify_mask: Check first that every rank holds the same mask.
    """
    _check_values("tensor", tensor)
    mask = _check_mask(comm, mask)
    _check_numel("tensor", tensor, mask)
    rop = _check_op(op)
    if verify_mask:
        verify_same_mask(comm, mask, "sparse_all_reduce")
    flat, copy_back = _flat_view("tensor", tensor)
    with comm.stats.scope("sparse_all_reduce"):
        packed = pack(flat, mask)
        work = comm.all_reduce(packed, rop, async_op=async_op)

    def finish() -> None:
        unpack(packed, mask, flat)
        if copy_back is not None:
            copy_back()

    return _finish(work, finish, async_op)
