"""Process groups and the default-group lifecycle of :mod:`sparsecomm.distributed`.

torch.distributed's names and semantics: :func:`init_process_group`,
:func:`destroy_process_group`, :func:`new_group`, rank queries, ``GroupMember``
and ``group.WORLD``. A :class:`Group` wraps a :class:`bindings.Communicator`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from bindings import CommStats, Communicator, create_communicator
from bindings.torch_backend import as_torch_communicator
from bindings.validate import check_int

__all__ = [
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
    "get_communicator",
    "get_stats",
    "new_group",
    "resolve",
    "warn_not_member",
]

logger = logging.getLogger(__name__)


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

    def __init__(self, comm: Communicator, global_ranks: Sequence[int] | None) -> None:
        self._comm = comm
        self._global_ranks = None if global_ranks is None else list(global_ranks)

    @property
    def communicator(self) -> Communicator:
        """The communicator that carries this group's traffic."""
        return self._comm

    @property
    def global_ranks(self) -> list[int]:
        """Global rank of each group rank (the identity for a world whose size may change)."""
        if self._global_ranks is None:
            return list(range(self._comm.world_size))
        return list(self._global_ranks)

    def rank(self) -> int:
        """This process's rank within the group."""
        return self._comm.rank

    def size(self) -> int:
        """Number of ranks in the group."""
        return self._comm.world_size

    def __repr__(self) -> str:
        return f"Group(backend={self._comm.backend!r}, ranks={self.global_ranks})"


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
    communicator: Communicator | None = None,
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
        communicator: Adopt this communicator (for example a
            ``resilient_comm.FaultAwareCommunicator``) as the default group
            instead of creating one; the other arguments must be left unset.
            Its rank and world size are read at each call, so they may change.

    Raises:
        ProcessGroupStateError: The default group already exists.
        ValueError, TypeError: Bad arguments.
    """
    with _state.lock:
        if _state.world is not None:
            raise ProcessGroupStateError("trying to initialize the default process group twice!")
        if communicator is not None:
            if backend is not None or init_method is not None or store is not None or world_size != -1 or rank != -1:
                raise ValueError("communicator: pass it alone, without backend, init_method, store, rank or world_size")
            if not all(hasattr(communicator, a) for a in ("rank", "world_size", "all_reduce", "abort")):
                raise TypeError(f"communicator: expected a bindings Communicator, got {type(communicator).__name__}")
            world = Group(communicator, None)
            _set_world(world)
            _state.groups = [world]
            return
        if backend is None:
            is_cuda = isinstance(device_id, torch.device) and device_id.type == "cuda"
            backend = "nccl" if is_cuda or isinstance(device_id, int) else "gloo"
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
        world_size = check_int("world_size", world_size)
        rank = check_int("rank", rank)
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
                    "Default process group has not been initialized, please make sure to call init_process_group."
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
            "Default process group has not been initialized, please make sure to call init_process_group."
        )
    return w


def resolve(grp: Any) -> Group | None:
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


def warn_not_member(fn: str) -> None:
    """Log torch's warning for a collective called off-group (it then does nothing)."""
    logger.warning("Running %s on global rank %d which does not belong to the given group.", fn, get_rank())


def get_rank(group: Group | None = None) -> int:
    """Return this process's rank in ``group`` (default group if ``None``); -1 if not a member."""
    g = resolve(group)
    return -1 if g is None else g.rank()


def get_world_size(group: Group | None = None) -> int:
    """Return the number of ranks in ``group``; -1 if this process is not a member."""
    g = resolve(group)
    return -1 if g is None else g.size()


def get_backend(group: Group | None = None) -> str:
    """Return the backend name of ``group``."""
    g = resolve(group)
    if g is None:
        raise ValueError("group: invalid process group specified")
    return g.communicator.backend


def get_process_group_ranks(group: Group | None) -> list[int]:
    """Return the global ranks of ``group``, in group-rank order."""
    g = resolve(group)
    if g is None:
        raise ValueError("group: this rank is not a member of the group")
    return g.global_ranks


def get_global_rank(group: Group | None, group_rank: int) -> int:
    """Translate a rank of ``group`` to a global rank."""
    g = resolve(group)
    if g is None:
        raise ValueError("group: this rank is not a member of the group")
    check_int("group_rank", group_rank)
    if not 0 <= group_rank < g.size():
        raise ValueError(f"group_rank: {group_rank} is out of range for group size {g.size()}")
    return g.global_ranks[group_rank]


def get_group_rank(group: Group | None, global_rank: int) -> int:
    """Translate a global rank to its rank in ``group``."""
    g = resolve(group)
    if g is None:
        raise ValueError("group: this rank is not a member of the group")
    check_int("global_rank", global_rank)
    try:
        return g.global_ranks.index(global_rank)
    except ValueError:
        raise ValueError(f"global_rank: {global_rank} is not part of the group") from None


def get_communicator(group: Group | None = None) -> Communicator:
    """Return the :class:`~bindings.base.Communicator` behind ``group``."""
    g = resolve(group)
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
            f"backend: new_group uses the default group's backend {world.communicator.backend!r}, got {backend!r}"
        )
    sub = world.communicator.split(list(ranks))
    if sub is None:
        return GroupMember.NON_GROUP_MEMBER
    g = Group(sub, sorted(int(r) for r in ranks))
    with _state.lock:
        _state.groups.append(g)
    return g
