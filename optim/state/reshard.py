"""Shrink for the sharded optimizers: the whole flat state of a step, cut again for fewer ranks.

When the world shrinks, the old layout's shards are spread over the
survivors' own snapshots and the buddies' copies of the lost slots. Every
member puts what it holds into zeroed full-size vectors and one SUM
all-reduce assembles the whole state (adding zeros is exact); each member
then takes its shard of the new layout.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import StateDict

import sparsecomm.distributed as dist
from optim.optimizers.capabilities import SnapshotOptimizer

__all__ = ["gather_full_state", "restore_resharded"]


def gather_full_state(
    optimizer: SnapshotOptimizer, held: list[tuple[int, StateDict]], old_world: int
) -> dict[str, torch.Tensor]:
    """The whole flat optimizer state of one step, on every member. Collective.

    Args:
        optimizer: The optimizer of the new layout (names its state tensors).
        held: ``(old slot, snapshot tree)`` of every old slot this member holds;
            each old slot is held by exactly one member.
        old_world: World size of the old layout.

    Returns:
        ``master`` and each state tensor, full length (the real parameters only).
    """
    names = ["master", *sorted(optimizer.shard_state)]
    meta = torch.zeros(2, dtype=torch.int64)  # (shard size of the old layout, numel)
    if held:
        snap = held[0][1]["optim"]
        meta[0], meta[1] = snap["master"].numel(), int(snap["numel"])
    dist.all_reduce(meta, op=dist.ReduceOp.MAX)
    shard, numel = int(meta[0]), int(meta[1])
    flat = torch.zeros(len(names), shard * old_world, dtype=torch.float32)
    for slot, tree in held:
        snap = tree["optim"]
        for i, name in enumerate(names):
            src = snap["master"] if name == "master" else snap["shard"][name]
            flat[i, slot * shard : (slot + 1) * shard] = src
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return {name: flat[i, :numel] for i, name in enumerate(names)}


def restore_resharded(optimizer: SnapshotOptimizer, step: int, full: dict[str, torch.Tensor]) -> None:
    """Load this rank's shard of ``full`` into a freshly built ``optimizer`` and its parameters. Collective.

    Masks in flight belonged to the old layout: SCAPE makes the masks of the
    next steps again from the restored state, in the new layout (the next step
    stays sparse: a dense step on SCAPE's state would apply its stale first
    moments everywhere at once). An error-feedback residual is per rank and
    starts again from zero.
    """
    b = optimizer.bucket
    lo, hi = b.shard_lo, b.shard_lo + b.shard_size

    def piece(v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(b.shard_size, dtype=torch.float32)
        real = v[lo:hi]
        out[: real.numel()] = real
        return out

    residual = getattr(optimizer, "residual", None)
    tree = {
        "step": step,
        "rank": b.rank,
        "world_size": b.world_size,
        "numel": b.numel,
        "master": piece(full["master"]),
        "shard": {name: piece(full[name]) for name in optimizer.shard_state},
        "extra": {"masks": {}, "residual": None if residual is None else torch.zeros_like(residual)}
        if hasattr(optimizer, "density")
        else {},
    }
    optimizer.restore_snapshot(tree)
    optimizer.resync_params()
