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
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from bindings import ChainedWork, CommStats, Communicator, Handle, create_communicator
from bindings.torch_backend import TorchReduceOp, as_torch_communicator
from sparsecomm import collectives as _sparse
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


class ProcessGroupStateError(RuntimeError, ValueError):
    """The default group is missing (call ``init_process_group``) or already exists.

    A ``RuntimeError`` and, as torch raises, a ``ValueError``.
    """


class Group:
    """A process group of ``sparsecomm.distributed``, over a :class:`~bindings.base.Communicator`.

    Args:
        comm: The communicator of this group's ranks.
        global_ranks: Global rank of each group rank, in group-rank order.
    """

    def __init__(self, comm: Communicator, global_ranks: Sequence[int]) -> None:
        self._comm = comm
        self._global_ranks = list(global_ranks)

    @property
    def communicator(self) -> Communicator:
        """The communicator that carries this group's traffic."""
        return self._comm

    @property
    def global_ranks(self) -> list[int]:
        """Global rank of each group rank."""
        return list(self._global_ranks)

    def rank(self) -> int:
        """This process's rank within the group."""
        return self._comm.rank

    def size(self) -> int:
        """Number of ranks in the group."""
        return self._comm.world_size

    def __repr__(self) -> str:
        return f"Group(backend={self._comm.backend!r}, ranks={self._global_ranks})"


class _NonMember:
    """Marker returned by :func:`new_group` on ranks outside the new group."""

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


class GroupMember:
    """Torch-compatible namespace: ``WORLD`` and ``NON_GROUP_MEMBER``."""

    WORLD: Group | None = None
    NON_GROUP_MEMBER: Any = _NonMember()


class group:  # noqa: N801 - torch spells it in lower case
    """Torch-compatible alias: ``dist.group.WORLD``."""

    WORLD: Group | None = None


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.world: Group | None = None
        self.groups: list[Group] = []
        self.wrapped: dict[int, Group] = {}


_state = _State()


def _set_world(g: Group | None) -> None:
    _state.world = g
    GroupMember.WORLD = g
    group.WORLD = g


# ---------------------------------------------------------------------------- lifecycle
def is_available() -> bool:
    """Return ``True``: sparsecomm always has at least the gloo backend."""
    return True


def is_initialized() -> bool:
    """Return whether the default group exists."""
    return _state.world is not None


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: torch.device | int | None = None,
    *,
    check_collectives: bool | None = None,
) -> None:
    """Create the default group (torch.distributed's signature).

    Collective: every process of the job must call this.

    Args:
        backend: ``gloo``, ``nccl``, ``mpi``, ``cupy-nccl`` or torch's
            device-map form. ``None``: ``nccl`` when ``device_id`` is a CUDA
            device, else ``gloo``.
        init_method: Rendezvous URL (``tcp://host:port``, ``env://``, ``file://``).
        timeout: Deadline of every blocking call (default 30 minutes).
        world_size: Number of processes (``-1``: from the launcher).
        rank: This process's rank (``-1``: from the launcher).
        store: A ``torch.distributed.Store`` for rendezvous.
        group_name: Accepted for compatibility; unused.
        pg_options: Accepted for compatibility; passed to no backend.
        device_id: Accepted for compatibility; selects ``nccl`` when CUDA.
        check_collectives: Compare collective arguments across ranks before
            each call (default ``$SPARSECOMM_CHECK_COLLECTIVES`` or off).

    Raises:
        ProcessGroupStateError: The default group already exists.
        ValueError, TypeError: Bad arguments.
    """
    with _state.lock:
        if _state.world is not None:
            raise ProcessGroupStateError("trying to initialize the default process group twice!")
        if backend is None:
            is_cuda = isinstance(device_id, torch.device) and device_id.type == "cuda"
            backend = "nccl" if is_cuda or isinstance(device_id, int) else "gloo"
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
        for arg, value in (("world_size", world_size), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{arg}: expected an int, got {type(value).__name__}")
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(f"timeout: expected a datetime.timedelta, got {type(timeout).__name__}")
        if init_method == "env://":
            init_method = None  # our environment detection covers env:// and more
        comm = create_communicator(
            backend,
            rank=None if rank == -1 else rank,
            world_size=None if world_size == -1 else world_size,
            store=store,
            init_method=init_method,
            timeout=timeout,
            check_collectives=check_collectives,
        )
        world = Group(comm, range(comm.world_size))
        _set_world(world)
        _state.groups = [world]
        logger.debug("initialized %s world: rank %d of %d", comm.backend, comm.rank, comm.world_size)


def destroy_process_group(group: Group | None = None) -> None:
    """Destroy ``group``, or every group and the default group when ``None``."""
    with _state.lock:
        if group is None:
            if _state.world is None:
                raise ProcessGroupStateError(
                    "Default process group has not been initialized, "
                    "please make sure to call init_process_group."
                )
            for g in reversed(_state.groups):
                g.communicator.close()
            _state.groups = []
            _state.wrapped.clear()
            _set_world(None)
            return
        if group is GroupMember.NON_GROUP_MEMBER:
            return
        if not isinstance(group, Group):
            raise TypeError(f"group: expected a sparsecomm Group, got {type(group).__name__}")
        if group is _state.world:
            raise ValueError("group: destroy the default group with destroy_process_group()")
        group.communicator.close()
        if group in _state.groups:
            _state.groups.remove(group)


def _world() -> Group:
    w = _state.world
    if w is None:
        raise ProcessGroupStateError(
            "Default process group has not been initialized, "
            "please make sure to call init_process_group."
        )
    return w


def _resolve(grp: Any) -> Group | None:
    """Return the group to use, or ``None`` when this rank is not a member."""
    world = _world()
    if grp is None:
        return world
    if grp is GroupMember.NON_GROUP_MEMBER:
        return None
    if isinstance(grp, Group):
        return grp
    key = id(grp)
    if key in _state.wrapped:
        return _state.wrapped[key]
    # A group made with torch.distributed directly: wrap it once.
    comm = as_torch_communicator(
        grp,
        timeout=world.communicator.timeout,
        check_collectives=getattr(world.communicator, "check_collectives", False),
    )
    if comm is not None:
        _state.wrapped[key] = Group(comm, comm.global_ranks)
        return _state.wrapped[key]
    raise TypeError(f"group: expected a Group from new_group() or None, got {type(grp).__name__}")


def _not_member(fn: str) -> None:
    logger.warning("Running %s on global rank %d which does not belong to the given group.", fn, get_rank())


def get_rank(group: Group | None = None) -> int:
    """Return this process's rank in ``group`` (default group if ``None``); -1 if not a member."""
    g = _resolve(group)
    return -1 if g is None else g.rank()


def get_world_size(group: Group | None = None) -> int:
    """Return the number of ranks in ``group``; -1 if this process is not a member."""
    g = _resolve(group)
    return -1 if g is None else g.size()


def get_backend(group: Group | None = None) -> str:
    """Return the backend name of ``group``."""
    g = _resolve(group)
    if g is None:
        raise ValueError("group: invalid process group specified")
    return g.communicator.backend


def get_process_group_ranks(group: Group | None) -> list[int]:
    """Return the global ranks of ``group``, in group-rank order."""
    g = _resolve(group)
    if g is None:
        raise ValueError("group: this rank is not a member of the group")
    return g.global_ranks


def get_global_rank(group: Group | None, group_rank: int) -> int:
    """Translate a rank of ``group`` to a global rank."""
    g = _resolve(group)
    if g is None:
        raise ValueError("group: this rank is not a member of the group")
    _int_rank("group_rank", group_rank)
    if not 0 <= group_rank < g.size():
        raise ValueError(f"group_rank: {group_rank} is out of range for group size {g.size()}")
    return g.global_ranks[group_rank]


def get_group_rank(group: Group | None, global_rank: int) -> int:
    """Translate a global rank to its rank in ``group``."""
    g = _resolve(group)
    if g is None:
        raise ValueError("group: this rank is not a member of the group")
    _int_rank("global_rank", global_rank)
    try:
        return g.global_ranks.index(global_rank)
    except ValueError:
        raise ValueError(f"global_rank: {global_rank} is not part of the group") from None


def get_communicator(group: Group | None = None) -> Communicator:
    """Return the :class:`~bindings.base.Communicator` behind ``group``."""
    g = _resolve(group)
    if g is None:
        raise ValueError("group: this rank is not a member of the group")
    return g.communicator


def get_stats(group: Group | None = None) -> CommStats:
    """Return the byte and call counters of ``group``'s communicator."""
    return get_communicator(group).stats


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: torch.device | None = None,
    sort_ranks: bool = True,
) -> Group | Any:
    """Create a group of the given global ranks.

    Collective: every rank of the default group must call this with the same ``ranks``.

    Args:
        ranks: Global ranks of the new group (``None``: all).
        timeout: Accepted for compatibility; the group inherits the default timeout.
        backend: ``None`` or the default group's backend.
        pg_options: Accepted for compatibility; unused.
        use_local_synchronization: Accepted for compatibility; every rank
            of the default group synchronizes.
        group_desc: Accepted for compatibility; unused.
        device_id: Accepted for compatibility; unused.
        sort_ranks: Accepted for compatibility; group ranks follow sorted global ranks.

    Returns:
        The new :class:`Group` on members, ``GroupMember.NON_GROUP_MEMBER`` elsewhere.
    """
    world = _world()
    if ranks is None:
        ranks = list(range(world.size()))
    if backend is not None and str(backend).lower() != world.communicator.backend:
        raise ValueError(
            f"backend: new_group uses the default group's backend "
            f"{world.communicator.backend!r}, got {backend!r}"
        )
    sub = world.communicator.split(list(ranks))
    if sub is None:
        return GroupMember.NON_GROUP_MEMBER
    g = Group(sub, sorted(int(r) for r in ranks))
    with _state.lock:
        _state.groups.append(g)
    return g


# ---------------------------------------------------------------------------- helpers
def _int_rank(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int rank, got {type(value).__name__}")


def _group_peer(g: Group, name: str, rank: int | None, group_name: str, group_rank: int | None, *, required: bool = True) -> int | None:
    """Return the group rank given either a global rank or a group rank."""
    if rank is not None and group_rank is not None:
        raise ValueError(f"{name}: pass either {name} or {group_name}, not both")
    if group_rank is not None:
        _int_rank(group_name, group_rank)
        if not 0 <= group_rank < g.size():
            raise ValueError(f"{group_name}: {group_rank} is out of range for group size {g.size()}")
        return group_rank
    if rank is None:
        if required:
            raise ValueError(f"{name}: either {name} or {group_name} must be specified")
        return None
    _int_rank(name, rank)
    try:
        return g.global_ranks.index(rank)
    except ValueError:
        raise ValueError(f"{name}: global rank {rank} is not part of the group") from None


def _finish_or_wait(work: Handle | None, finish: Callable[[], None], async_op: bool) -> Any:
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


def _check_gathered_shape(big_name: str, big: torch.Tensor, small: torch.Tensor, n: int) -> None:
    """torch's rule: ``big`` is ``small`` concatenated (dim 0) or stacked n times, or flat."""
    s = tuple(small.shape)
    b = tuple(big.shape)
    ok = b == (n, *s) or (len(s) > 0 and b == (n * s[0], *s[1:])) or b == (n * small.numel(),)
    if not ok and big.numel() == n * small.numel():
        ok = len(s) == 0 and b == (n,)
    if not ok:
        raise ValueError(
            f"{big_name}: shape {list(b)} must be the other tensor's shape {list(s)} "
            f"concatenated or stacked {n} times"
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


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Group | None = None, async_op: bool = False) -> Any:
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


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM, group: Group | None = None, async_op: bool = False) -> Any:
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


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Group | None = None, async_op: bool = False) -> Any:
    """Gather every rank's ``tensor`` into ``tensor_list[rank]``.

    Collective: every rank of ``group`` must call this.
    """
    g = _resolve(group)
    if g is None:
        return _not_member("all_gather")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
    outs = _check_list("tensor_list", tensor_list, g.size())
    for i, t in enumerate(outs):
        _check_like(f"tensor_list[{i}]", t, "tensor", tensor)
    flat = torch.empty((g.size() * tensor.numel(),), dtype=tensor.dtype, device=tensor.device)

    def finish() -> None:
        for i, t in enumerate(outs):
            t.copy_(flat[i * tensor.numel() : (i + 1) * tensor.numel()].view(t.shape))

    work = g.communicator.all_gather(flat, tensor, async_op=async_op)
    return _finish_or_wait(work, finish, async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM, group: Group | None = None, async_op: bool = False) -> Any:
    """Reduce ``input_list`` element-wise across the group; rank r gets item r in ``output``.

    Collective: every rank of ``group`` must call this.
    """
    g = _resolve(group)
    if g is None:
        return _not_member("reduce_scatter")
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"output: expected a torch.Tensor, got {type(output).__name__}")
    ins = _check_list("input_list", input_list, g.size())
    for i, t in enumerate(ins):
        _check_like(f"input_list[{i}]", t, "output", output)
    flat = torch.cat([t.reshape(-1) for t in ins]) if ins else output.new_empty((0,))
    return g.communicator.reduce_scatter(output, flat, op, async_op=async_op)


def barrier(group: Group | None = None, async_op: bool = False, device_ids: Any = None, timeout: timedelta | None = None) -> Any:
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


def isend(tensor: torch.Tensor, dst: int | None = None, group: Group | None = None, tag: int = 0, group_dst: int | None = None) -> Any:
    """Send ``tensor`` to global rank ``dst`` (or group rank ``group_dst``) asynchronously."""
    g = _resolve(group)
    if g is None:
        return _not_member("isend")
    peer = _group_peer(g, "dst", dst, "group_dst", group_dst)
    assert peer is not None
    return g.communicator.send(tensor, peer, tag=tag, async_op=True)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Group | None = None, tag: int = 0, group_src: int | None = None) -> Any:
    """Receive into ``tensor`` from ``src`` (``None``: any rank) asynchronously."""
    g = _resolve(group)
    if g is None:
        return _not_member("irecv")
    peer = _group_peer(g, "src", src, "group_src", group_src, required=False)
    return g.communicator.recv(tensor, peer, tag=tag, async_op=True)


def send(tensor: torch.Tensor, dst: int | None = None, group: Group | None = None, tag: int = 0, group_dst: int | None = None) -> None:
    """Send ``tensor`` to global rank ``dst`` (or group rank ``group_dst``); blocks until sent."""
    work = isend(tensor, dst, group, tag, group_dst)
    if work is not None:
        work.wait()


def recv(tensor: torch.Tensor, src: int | None = None, group: Group | None = None, tag: int = 0, group_src: int | None = None) -> int:
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
    input: torch.Tensor,
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
    return _sparse.sparse_all_reduce(
        g.communicator, tensor, mask, op, async_op=async_op, verify_mask=verify_mask
    )
