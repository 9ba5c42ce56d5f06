"""Drop-in replacement for ``torch.distributed``.

``import sparsecomm.distributed as dist`` in place of ``import
torch.distributed as dist`` is the only change an existing script needs: the
functions below have torch's names, signatures, defaults and results, on
every backend of :mod:`bindings` — including ``mpi``, which needs no torch
MPI build (``init_process_group("mpi")`` under ``mpirun``).

Ranks passed as ``src`` / ``dst`` are global ranks; ``group_src`` /
``group_dst`` are ranks within ``group``, exactly as in torch.distributed.

Differences from torch.distributed, all deliberate:

* ``ReduceOp.AVG`` works on every backend; on integer tensors it raises
  ``TypeError`` (torch's gloo fails with a cast error).
* Every argument problem raises ``ValueError`` / ``TypeError`` before any
  communication. Ranks that disagree on sizes are caught by the metadata
  check when ``check_collectives=True`` (or ``SPARSECOMM_CHECK_COLLECTIVES=1``),
  and otherwise end at the timeout with a ``CommError`` naming the collective.
* Transport faults raise the :mod:`bindings.errors` ``CommError`` family
  (a ``RuntimeError``, as torch's ``DistBackendError`` is).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from bindings import ChainedWork, Work
from bindings.torch_backend import TorchReduceOp
from bindings.validate import check_int
from sparsecomm import collectives as _sparse
from sparsecomm.groups import (
    Group,
    GroupMember,
    ProcessGroupStateError,
    destroy_process_group,
    get_backend,
    get_communicator,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    get_rank,
    get_stats,
    get_world_size,
    group,
    init_process_group,
    is_available,
    is_initialized,
    new_group,
)
from sparsecomm.groups import resolve as _resolve
from sparsecomm.groups import warn_not_member as _not_member
from sparsecomm.mask import ShardedMask

__all__ = [
    "ReduceOp",
    "Group",
    "GroupMember",
    "group",
    "ProcessGroupStateError",
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "is_available",
    "get_rank",
    "get_world_size",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "new_group",
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "reduce_scatter",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "get_communicator",
    "get_stats",
    "ShardedMask",
    "sparse_reduce_scatter",
    "sparse_all_gather",
    "sparse_all_reduce",
]

logger = logging.getLogger(__name__)

#: torch's own ``ReduceOp``, so ``dist.ReduceOp.SUM`` means the same in both modules.
ReduceOp = TorchReduceOp


# ---------------------------------------------------------------------------- helpers
def _group_peer(
    g: Group, name: str, rank: int | None, group_name: str, group_rank: int | None, *, required: bool = True
) -> int | None:
    """Return the group rank given either a global rank or a group rank."""
    if rank is not None and group_rank is not None:
        raise ValueError(f"{name}: pass either {name} or {group_name}, not both")
    if group_rank is not None:
        check_int(group_name, group_rank)
        if not 0 <= group_rank < g.size():
            raise ValueError(f"{group_name}: {group_rank} is out of range for group size {g.size()}")
        return group_rank
    if rank is None:
        if required:
            raise ValueError(f"{name}: either {name} or {group_name} must be specified")
        return None
    check_int(name, rank)
    try:
        return g.global_ranks.index(rank)
    except ValueError:
        raise ValueError(f"{name}: global rank {rank} is not part of the group") from None


def _finish_or_wait(work: Work | None, finish: Callable[[], object], async_op: bool) -> Any:
    if work is None:  # the communicator already waited
        finish()
        return None
    post = ChainedWork(work, finish)
    if async_op:
        return post
    post.wait()
    return None


def _check_list(name: str, tensors: Any, n: int) -> list[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name}: expected a list of tensors, got {type(tensors).__name__}")
    if len(tensors) != n:
        raise ValueError(f"{name}: expected {n} tensors (the group size), got {len(tensors)}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}]: expected a torch.Tensor, got {type(t).__name__}")
    return list(tensors)


def _check_like(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name}: dtype {t.dtype} does not match {ref_name} dtype {ref.dtype}")
    if t.numel() != ref.numel():
        raise ValueError(f"{name}: numel {t.numel()} does not match {ref_name} numel {ref.numel()}")
    if t.device != ref.device:
        raise ValueError(f"{name}: device {t.device} does not match {ref_name} device {ref.device}")


def _check_list_like(name: str, tensors: Any, ref_name: str, ref: Any, n: int) -> list[torch.Tensor]:
    """Check ``ref`` is a tensor and ``tensors`` is a list of ``n`` tensors like it.

    Args:
        name: Argument name of the list, for messages.
        tensors: The list (or tuple) of tensors.
        ref_name: Argument name of the reference tensor, for messages.
        ref: The tensor every item must match in dtype, numel and device.
        n: Required length of the list (the group size).

    Returns:
        The tensors, as a list.

    Raises:
        TypeError: ``ref`` or an item is not a tensor, ``tensors`` is not a list, or a dtype differs.
        ValueError: The length, an item's numel or its device differs.
    """
    if not isinstance(ref, torch.Tensor):
        raise TypeError(f"{ref_name}: expected a torch.Tensor, got {type(ref).__name__}")
    items = _check_list(name, tensors, n)
    for i, t in enumerate(items):
        _check_like(f"{name}[{i}]", t, ref_name, ref)
    return items


def _check_gathered_shape(big_name: str, big: torch.Tensor, small: torch.Tensor, n: int) -> None:
    """torch's rule: ``big`` is ``small`` concatenated (dim 0) or stacked n times, or flat."""
    s = tuple(small.shape)
    b = tuple(big.shape)
    ok = b == (n, *s) or (len(s) > 0 and b == (n * s[0], *s[1:])) or b == (n * small.numel(),)
    if not ok and big.numel() == n * small.numel():
        ok = len(s) == 0 and b == (n,)
    if not ok:
        raise ValueError(
            f"{big_name}: shape {list(b)} must be the other tensor's shape {list(s)} concatenated or stacked {n} times"
        )


# ---------------------------------------------------------------------------- collectives
def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Group | None = None, async_op: bool = False) -> Any:
    """Reduce ``tensor`` across the group, in place.

    Collective: every rank of ``group`` must call this.

    Returns:
        A work handle if ``async_op``, else ``None``.
    """
    g = _resolve(group)
    if g is None:
        return _not_member("all_reduce")
    return g.communicator.all_reduce(tensor, op, async_op=async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Group | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Any:
    """Broadcast ``tensor`` from global rank ``src`` (or group rank ``group_src``).

    Collective: every rank of ``group`` must call this.
    """
    g = _resolve(group)
    if g is None:
        return _not_member("broadcast")
    root = _group_peer(g, "src", src, "group_src", group_src)
    assert root is not None
    return g.communicator.broadcast(tensor, root, async_op=async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Group | None = None, async_op: bool = False
) -> Any:
    """Gather every rank's ``input_tensor`` into ``output_tensor`` (concatenated or stacked).

    Collective: every rank of ``group`` must call this.
    """
    g = _resolve(group)
    if g is None:
        return _not_member("all_gather_into_tensor")
    if isinstance(output_tensor, torch.Tensor) and isinstance(input_tensor, torch.Tensor):
        _check_gathered_shape("output_tensor", output_tensor, input_tensor, g.size())
    return g.communicator.all_gather(output_tensor, input_tensor, async_op=async_op)


#: The newer torch name of :func:`all_gather_into_tensor` (no deprecation warning either way).
all_gather_single = all_gather_into_tensor


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Group | None = None,
    async_op: bool = False,
) -> Any:
    """Reduce ``input`` across the group and scatter: rank r gets block r in ``output``.

    Collective: every rank of ``group`` must call this.
    """
    g = _resolve(group)
    if g is None:
        return _not_member("reduce_scatter_tensor")
    if isinstance(output, torch.Tensor) and isinstance(input, torch.Tensor):
        _check_gathered_shape("input", input, output, g.size())
    return g.communicator.reduce_scatter(output, input, op, async_op=async_op)


#: The newer torch name of :func:`reduce_scatter_tensor` (no deprecation warning either way).
reduce_scatter_single = reduce_scatter_tensor


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Group | None = None, async_op: bool = False
) -> Any:
    """Gather every rank's ``tensor`` into ``tensor_list[rank]``.

    Collective: every rank of ``group`` must call this.
    """
    g = _resolve(group)
    if g is None:
        return _not_member("all_gather")
    outs = _check_list_like("tensor_list", tensor_list, "tensor", tensor, g.size())
    flat = torch.empty((g.size() * tensor.numel(),), dtype=tensor.dtype, device=tensor.device)

    def finish() -> None:
        for i, t in enumerate(outs):
            t.copy_(flat[i * tensor.numel() : (i + 1) * tensor.numel()].view(t.shape))

    work = g.communicator.all_gather(flat, tensor, async_op=async_op)
    return _finish_or_wait(work, finish, async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Group | None = None,
    async_op: bool = False,
) -> Any:
    """Reduce ``input_list`` element-wise across the group; rank r gets item r in ``output``.

    Collective: every rank of ``group`` must call this.
    """
    g = _resolve(group)
    if g is None:
        return _not_member("reduce_scatter")
    ins = _check_list_like("input_list", input_list, "output", output, g.size())
    flat = torch.cat([t.reshape(-1) for t in ins]) if ins else output.new_empty((0,))
    return g.communicator.reduce_scatter(output, flat, op, async_op=async_op)


def barrier(
    group: Group | None = None, async_op: bool = False, device_ids: Any = None, timeout: timedelta | None = None
) -> Any:
    """Block until every rank of ``group`` reached the barrier.

    Collective: every rank of ``group`` must call this.

    Args:
        group: The group (default group if ``None``).
        async_op: Return a work handle instead of blocking.
        device_ids: Accepted for compatibility; unused.
        timeout: Deadline of this barrier (default: the group's timeout).
    """
    g = _resolve(group)
    if g is None:
        return _not_member("barrier")
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"timeout: expected a datetime.timedelta, got {type(timeout).__name__}")
    work = g.communicator.barrier(async_op=True)
    assert work is not None
    if async_op:
        return work
    work.wait(timeout)
    return None


def isend(
    tensor: torch.Tensor, dst: int | None = None, group: Group | None = None, tag: int = 0, group_dst: int | None = None
) -> Any:
    """Send ``tensor`` to global rank ``dst`` (or group rank ``group_dst``) asynchronously."""
    g = _resolve(group)
    if g is None:
        return _not_member("isend")
    peer = _group_peer(g, "dst", dst, "group_dst", group_dst)
    assert peer is not None
    return g.communicator.send(tensor, peer, tag=tag, async_op=True)


def irecv(
    tensor: torch.Tensor, src: int | None = None, group: Group | None = None, tag: int = 0, group_src: int | None = None
) -> Any:
    """Receive into ``tensor`` from ``src`` (``None``: any rank) asynchronously."""
    g = _resolve(group)
    if g is None:
        return _not_member("irecv")
    peer = _group_peer(g, "src", src, "group_src", group_src, required=False)
    return g.communicator.recv(tensor, peer, tag=tag, async_op=True)


def send(
    tensor: torch.Tensor, dst: int | None = None, group: Group | None = None, tag: int = 0, group_dst: int | None = None
) -> None:
    """Send ``tensor`` to global rank ``dst`` (or group rank ``group_dst``); blocks until sent."""
    work = isend(tensor, dst, group, tag, group_dst)
    if work is not None:
        work.wait()


def recv(
    tensor: torch.Tensor, src: int | None = None, group: Group | None = None, tag: int = 0, group_src: int | None = None
) -> int:
    """Receive into ``tensor`` from ``src`` (``None``: any rank).

    Returns:
        The sender's global rank (-1 if this rank is not in ``group``).
    """
    g = _resolve(group)
    if g is None:
        _not_member("recv")
        return -1
    peer = _group_peer(g, "src", src, "group_src", group_src, required=False)
    source = g.communicator.recv(tensor, peer, tag=tag, async_op=False)
    assert isinstance(source, int)
    return g.global_ranks[source]


# ---------------------------------------------------------------------------- sparse collectives
def sparse_reduce_scatter(
    input: torch.Tensor | Sequence[torch.Tensor],
    mask: ShardedMask,
    op: Any = "sum",
    group: Group | None = None,
    async_op: bool = False,
    *,
    output: torch.Tensor | None = None,
    verify_mask: bool = True,
) -> Any:
    """Reduce ``input`` at ``mask``; return this rank's ``k`` values (``(values, work)`` if async).

    Collective: every rank of ``group`` must call this with the same mask.
    See :func:`sparsecomm.collectives.sparse_reduce_scatter`.
    """
    g = _resolve(group)
    if g is None:
        return _not_member("sparse_reduce_scatter")
    return _sparse.sparse_reduce_scatter(
        g.communicator, input, mask, op, output=output, async_op=async_op, verify_mask=verify_mask
    )


def sparse_all_gather(
    shard_values: torch.Tensor,
    mask: ShardedMask,
    output: torch.Tensor,
    group: Group | None = None,
    async_op: bool = False,
    *,
    verify_mask: bool = True,
) -> Any:
    """Gather every shard's ``k`` values into ``output`` at ``mask``.

    Collective: every rank of ``group`` must call this with the same mask.
    See :func:`sparsecomm.collectives.sparse_all_gather`.
    """
    g = _resolve(group)
    if g is None:
        return _not_member("sparse_all_gather")
    return _sparse.sparse_all_gather(
        g.communicator, shard_values, mask, output, async_op=async_op, verify_mask=verify_mask
    )


def sparse_all_reduce(
    tensor: torch.Tensor,
    mask: ShardedMask,
    op: Any = "sum",
    group: Group | None = None,
    async_op: bool = False,
    *,
    verify_mask: bool = True,
) -> Any:
    """Reduce ``tensor`` in place at ``mask``; other positions untouched.

    Collective: every rank of ``group`` must call this with the same mask.
    See :func:`sparsecomm.collectives.sparse_all_reduce`.
    """
    g = _resolve(group)
    if g is None:
        return _not_member("sparse_all_reduce")
    return _sparse.sparse_all_reduce(g.communicator, tensor, mask, op, async_op=async_op, verify_mask=verify_mask)
