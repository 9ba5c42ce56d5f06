"""Export the weights of a persistent checkpoint as a plain ``model.state_dict()`` file.

A checkpoint directory (:mod:`optim.state.checkpoint`) holds one file per slot of
the job that wrote it: for our sharded optimizers, each slot's shard of the
master weights. :func:`export_checkpoint` assembles the newest complete step
in this one process (a one-rank group of :mod:`sparsecomm.distributed`, the
same re-sharding a resume onto another world size does), loads it into the
user's model and writes ``model.state_dict()`` with ``torch.save``: a file
that plain ``torch.load`` reads, with no sparsecomm needed to use it.

Replicas that differ per slot (an optimizer whose replicas drift,
:attr:`~optim.optimizers.capabilities.OptimizerCapabilities.replicas_drift`:
:class:`~optim.optimizers.local.LocalAdamS`, :class:`~optim.optimizers.local_optimizer.LocalOptimizer`,
local steps between averaging) are averaged, as
:meth:`~optim.optimizers.local.LocalAdamS.average_params` does at the end of a run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import cast

import torch

import sparsecomm.distributed as dist
from bindings.store import open_store
from optim.optimizers.capabilities import SnapshotOptimizer, StateLayout, capabilities
from optim.state.checkpoint import CheckpointError, CheckpointStore, export_state_dict, model_fingerprint, read_newest
from optim.state.reshard import gather_full_state, restore_resharded
from optim.state.training_state import load_replica

__all__ = ["export_checkpoint"]


def export_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    out: str | os.PathLike[str],
) -> int:
    """Write the model weights of the newest complete checkpoint in ``checkpoint_dir`` to ``out``.

    Not collective: one process, with no default group of its own yet
    (this makes a one-rank group and destroys it again).

    Args:
        checkpoint_dir: The job's checkpoint directory.
        model: The model the job trained, built the same way (its initial values do not matter).
        optimizer: Builds the job's optimizer over ``model`` (as given to the training loop).
        out: The file to write (atomically).

    Returns:
        The step of the exported checkpoint.

    Raises:
        CheckpointError: No complete checkpoint, or one of another model or optimizer.
        RuntimeError: A default group of :mod:`sparsecomm.distributed` already exists.
    """
    store = CheckpointStore(checkpoint_dir)
    if not store.path.is_dir():
        raise CheckpointError(f"export: no checkpoint directory {store.path}")
    if dist.is_initialized():
        raise RuntimeError("export_checkpoint: run it in a process without a default group")
    rendezvous = open_store("127.0.0.1", 0, server=True, timeout=timedelta(minutes=5))  # this process alone
    dist.init_process_group("gloo", store=rendezvous, world_size=1, rank=0, timeout=timedelta(minutes=5))
    opt: torch.optim.Optimizer | None = None
    try:
        opt = optimizer(model)
        caps = capabilities(opt)
        sharded = caps.layout is StateLayout.SHARDED
        local = caps.replicas_drift
        step, old_ws, trees = read_newest(store, 0, 1, model_fingerprint(model, opt), shares=sharded or local)
        if sharded:
            own = cast(SnapshotOptimizer, opt)
            restore_resharded(own, step, gather_full_state(own, sorted(trees.items()), old_ws))
        elif local:  # the replicas differ: their average, as at the end of a run
            total = [torch.zeros_like(p) for p in model.parameters()]
            for tree in trees.values():
                load_replica(model, opt, tree["optim"])
                for acc, p in zip(total, model.parameters(), strict=True):
                    acc.add_(p.detach())
            with torch.no_grad():
                for acc, p in zip(total, model.parameters(), strict=True):
                    p.copy_(acc / len(trees))
        else:
            load_replica(model, opt, trees[0]["optim"])
        buffers = dict(model.named_buffers())
        with torch.no_grad():
            for name, value in trees[0]["buffers"].items():
                buffers[name].copy_(value)
        export_state_dict(model, Path(out))
        return step
    finally:
        if opt is not None and hasattr(opt, "close"):
            opt.close()
        dist.destroy_process_group()
