"""FSDP2 (``fully_shard``) over sparsecomm's transports: its all-gather and reduce-scatter through our communicator.

One call per model::

    model = fully_shard(model)                  # after every sub-module's fully_shard
    sparsecomm.fsdp.use_sparsecomm(model)       # collective: FSDP2's gathers and reductions now run here

Every ``FSDPModule`` under ``model`` gets an :class:`AllGather` and a
:class:`ReduceScatter` that run the dense collective on a sparsecomm group
(default: the default group), so its bytes are in that group's stats (scopes
``fsdp_all_gather`` / ``fsdp_reduce_scatter``) and, with a
``resilient_comm.FaultAwareCommunicator`` adopted as the default group, its
faults are the communicator's. Results are FSDP2's own, bit for bit, where the
transport reduces in the same order as torch's (gloo at 2 ranks; tested at 2
and 4). FSDP2 shards every parameter across the ranks, so its reduce-scatter
has no shared sparsity to exploit: these collectives are dense.

The collectives are synchronous: FSDP2 waits only on ``torch.distributed``
work handles, so each call finishes before it returns (on CPU, FSDP2's
gathers are not overlapped anyway).

FSDP2's protocols live in a private torch module (torch >= 2.8);
:func:`use_sparsecomm` raises ``RuntimeError`` where this torch has none.
"""

import logging
from collections.abc import Sequence
from typing import Any

import torch

from bindings import Communicator
from bindings.torch_backend import fsdp_protocols
from sparsecomm.groups import Group, get_communicator

__all__ = ["AllGather", "ReduceScatter", "use_sparsecomm"]

logger = logging.getLogger(__name__)

_PROTOCOLS = fsdp_protocols()
_AllGatherBase: Any = _PROTOCOLS[0] if _PROTOCOLS else object  # pragma: no branch - older torch: object
_ReduceScatterBase: Any = _PROTOCOLS[1] if _PROTOCOLS else object


def _check_group(comm: Communicator, group: Any, what: str) -> None:
    size = getattr(group, "size", None)
    if callable(size) and size() != comm.world_size:
        raise ValueError(
            f"{what}: FSDP2's group has {size()} ranks but the sparsecomm group has {comm.world_size}; "
            "shard over the whole job (a 1-D mesh of every rank)"
        )


class _Comm:
    def __init__(self, group: Group | None = None) -> None:
        self.comm = get_communicator(group)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A fresh buffer (FSDP2's default allocation)."""
        return torch.empty(size, dtype=dtype, device=device)


class AllGather(_Comm, _AllGatherBase):  # type: ignore[misc]
    """FSDP2's all-gather over a sparsecomm group (``None``: the default group).

    Collective: every rank's FSDP2 calls it in the same order.
    """

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> None:
        _check_group(self.comm, group, "AllGather")
        with self.comm.stats.scope("fsdp_all_gather"):
            self.comm.all_gather(output_tensor, input_tensor)


class ReduceScatter(_Comm, _ReduceScatterBase):  # type: ignore[misc]
    """FSDP2's reduce-scatter over a sparsecomm group (``None``: the default group).

    Collective: every rank's FSDP2 calls it in the same order.
    """

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any = "sum",
        async_op: bool = False,
    ) -> None:
        _check_group(self.comm, group, "ReduceScatter")
        with self.comm.stats.scope("fsdp_reduce_scatter"):
            self.comm.reduce_scatter(output_tensor, input_tensor, op)


def use_sparsecomm(model: torch.nn.Module, group: Group | None = None) -> int:
    """Route the all-gathers and reduce-scatters of every ``fully_shard`` module under ``model`` through ``group``.

    Local (no communication); every rank must call it alike before the first forward.

    Args:
        model: A module on which (or under which) ``fully_shard`` was called.
        group: The sparsecomm group FSDP2 shards over (``None``: the default group).

    Returns:
        How many FSDP modules were set.

    Raises:
        RuntimeError: This torch has no FSDP2 custom-collective API.
        ValueError: No module under ``model`` is an FSDP2 module, or one has
            several parameter groups (FSDP2 refuses custom collectives there).
    """
    if _PROTOCOLS is None:
        raise RuntimeError(
            f"sparsecomm.fsdp: torch {torch.__version__} has no FSDP2 custom collectives "
            "(FSDPModule.set_custom_all_gather, torch >= 2.8)"
        )
    all_gather, reduce_scatter = AllGather(group), ReduceScatter(group)
    n = 0
    for m in model.modules():
        set_gather = getattr(m, "set_custom_all_gather", None)
        set_reduce = getattr(m, "set_custom_reduce_scatter", None)
        if callable(set_gather) and callable(set_reduce):
            set_gather(all_gather)
            set_reduce(reduce_scatter)
            n += 1
    if n == 0:
        raise ValueError(f"use_sparsecomm: no fully_shard module in {type(model).__name__}; call fully_shard first")
    logger.debug("FSDP2 collectives of %d modules routed through sparsecomm", n)
    return n
