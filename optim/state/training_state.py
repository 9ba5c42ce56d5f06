"""What a snapshot of :class:`optim.resilient.ResilientTraining` holds, and how it is loaded back.

A snapshot tree (one per slot and committed step) holds the optimizer's state
(our sharded optimizers: their shard and master weights; a plain
``torch.optim`` optimizer: its ``state_dict()`` and the parameters, a
replicated copy), the hyperparameters of every parameter group, the model's
buffers, the torch CPU RNG, the LR scheduler, the user's extra state and the
loop's history (committed losses, skipped steps). The functions here build
such a tree and load its parts; which parts a recovery loads, and from
where, is :mod:`optim.resilient.loop`'s business.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.optim.optimizer import StateDict

import sparsecomm.distributed as dist
from optim.optimizers.capabilities import ReplicaSnapshotOptimizer, SnapshotOptimizer, StateLayout, capabilities

__all__ = [
    "History",
    "average_gradients",
    "checkpoint_hints",
    "copy_tensors",
    "gradients_finite",
    "load_common",
    "load_plain",
    "load_replica",
    "load_snapshot",
    "snapshot_headroom",
    "snapshot_tree",
    "Stateful",
]

#: The loop's history in a snapshot: committed losses by step, skipped steps, skips in a row.
History = tuple[dict[int, float], list[int], int]


@runtime_checkable
class Stateful(Protocol):
    """Anything whose state a snapshot can hold: an LR scheduler, a ``GradScaler``, a data-loader position."""

    def state_dict(self) -> StateDict:
        """The state (tensors, numbers, strings, lists and dicts of them)."""
        ...

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Load what :meth:`state_dict` returned."""
        ...


def copy_tensors(tree: Any) -> Any:
    """``tree`` with every tensor cloned (user state may change in place before the snapshot is copied)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: copy_tensors(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [copy_tensors(v) for v in tree]
    return tree


def snapshot_tree(
    step: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: Stateful | None,
    state: Mapping[str, Stateful],
    history: History,
) -> StateDict:
    """The snapshot tree of ``step`` (live optimizer tensors: encode it before the next step)."""
    if capabilities(opt).own_snapshots:
        optim_state: Any = cast(SnapshotOptimizer, opt).snapshot_state()
    else:  # a plain optimizer: a replicated copy of its state and of the parameters
        params = {n: p.detach() for n, p in model.named_parameters()}
        optim_state = {"params": params, "state_dict": opt.state_dict()}
    losses, skipped, bad_run = history
    return {
        "step": step,
        "optim": optim_state,
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "rng": torch.get_rng_state(),
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "scheduler": None if sched is None else copy_tensors(sched.state_dict()),
        "state": {name: copy_tensors(obj.state_dict()) for name, obj in state.items()},
        # the loss history travels too: a promoted spare knows every committed step's loss
        "losses": torch.tensor(sorted(losses.items()), dtype=torch.float64).reshape(-1, 2),
        "skipped": torch.tensor(skipped + [bad_run], dtype=torch.int64),
    }


def checkpoint_hints(opt: torch.optim.Optimizer) -> tuple[dict[str, float], list[str]]:
    """Paths in :func:`snapshot_tree` that a checkpoint treats apart: the tensors that decay by a factor
    in every step (a delta predicts them) and the first moment (a lossy checkpoint rounds it)."""
    if not capabilities(opt).own_snapshots:
        return {}, []
    own = cast(SnapshotOptimizer, opt)
    decay = {f"optim/{k}": f for k, f in own.checkpoint_decay().items()}
    return decay, [f"optim/{k}" for k in own.checkpoint_first_moment()]


PLAIN_STATE_TENSORS = 3
"""Parameter-sized state tensors a plain torch optimizer may make per parameter (Adam with ``amsgrad``)."""


def snapshot_headroom(opt: torch.optim.Optimizer, total_steps: int) -> int:
    """Bytes a later snapshot may add to the largest one held now (the replication capacity's slack).

    A plain torch optimizer's state of a parameter appears at its first step:
    room for :data:`PLAIN_STATE_TENSORS` tensors of the parameter's size is
    kept for every parameter without state yet.

    Headers grow a little with the step number, the loss history by one pair per step; an optimizer that
    snapshots itself says what its snapshots may add
    (:meth:`~optim.optimizers.capabilities.SnapshotOptimizer.snapshot_growth`: SCAPE's masks once it is sparse).
    """
    # the loss history, (step, loss) float64 pairs, and the skipped steps, int64
    headroom = (64 << 10) + 24 * (total_steps + 1)
    if capabilities(opt).own_snapshots:
        return headroom + cast(SnapshotOptimizer, opt).snapshot_growth()
    for group in opt.param_groups:  # a torch optimizer makes its state at its first step of a parameter
        for p in group["params"]:
            if not opt.state.get(p):
                headroom += PLAIN_STATE_TENSORS * p.numel() * p.element_size() + 1024
    return headroom


def load_common(
    tree: StateDict,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: Stateful | None,
    state: Mapping[str, Stateful],
) -> History:
    """Load what every kind of optimizer shares: hyperparameters, buffers, scheduler, user state, RNG.

    Returns:
        The loop's history the tree holds.
    """
    if sched is not None and tree.get("scheduler") is not None:
        sched.load_state_dict(tree["scheduler"])
    for group, saved in zip(opt.param_groups, tree["groups"], strict=True):
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in tree["buffers"].items():
            buffers[name].copy_(value)
    for name, obj in state.items():
        obj.load_state_dict(tree["state"][name])
    torch.set_rng_state(tree["rng"])
    *skipped, bad_run = tree["skipped"].tolist()
    return {int(k): float(v) for k, v in tree["losses"].tolist()}, [int(s) for s in skipped], int(bad_run)


def load_plain(model: torch.nn.Module, opt: torch.optim.Optimizer, saved: StateDict) -> None:
    """Load a plain optimizer's snapshot: the replicated parameters and its ``state_dict()``."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in saved["params"].items():
            params[name].copy_(value)
    opt.load_state_dict(saved["state_dict"])


def load_snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer, saved: StateDict) -> None:
    """Load the optimizer part of a snapshot of this rank's slot, taken under the current layout. Collective.

    An optimizer that snapshots itself restores its state and rebuilds the
    parameters from it; a plain one is loaded by :func:`load_plain`.
    """
    if capabilities(opt).own_snapshots:
        own = cast(SnapshotOptimizer, opt)
        own.restore_snapshot(saved)
        own.resync_params()
    else:
        load_plain(model, opt, saved)


def load_replica(model: torch.nn.Module, opt: torch.optim.Optimizer, saved: StateDict) -> None:
    """Load the optimizer part of a snapshot taken under any world size into a replicated or plain ``opt``. Local.

    Raises:
        ValueError: ``opt`` shards its state (its shards are cut again instead: :mod:`optim.state.reshard`).
    """
    caps = capabilities(opt)
    if caps.layout is StateLayout.SHARDED:
        raise ValueError(f"load_replica: {type(opt).__name__} shards its state; re-shard it (optim.state.reshard)")
    if caps.own_snapshots:
        cast(ReplicaSnapshotOptimizer, opt).restore_replica(saved)
    else:
        load_plain(model, opt, saved)


def gradients_finite(model: torch.nn.Module) -> bool:
    """Whether every gradient of ``model`` is finite (one float64 sum per tensor: no overflow)."""
    sums = [p.grad.sum(dtype=torch.float64) for p in model.parameters() if p.grad is not None]
    return not sums or bool(torch.stack(sums).isfinite().all())


def average_gradients(model: torch.nn.Module) -> None:
    """Average the gradients of ``model`` over the ranks (one all-reduce). Collective: every rank must call this."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(synced)
