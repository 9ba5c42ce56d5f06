"""Gradient synchronization outside the optimizer, as DDP users run it: torch's DDP with a comm hook.

The train job's ``ddp-powersgd-adamw`` and ``ddp-sparse-adamw`` choices (and
``sparsecomm bench hooks``) wrap the model in
:class:`torch.nn.parallel.DistributedDataParallel` with one of :data:`HOOKS`:

* ``allreduce``: torch's own all-reduce hook (what DDP does without a hook);
* ``powersgd``: torch's PowerSGD hook (error feedback and warm start on, its
  dense iterations first as ``start_powerSGD_iter``);
* ``sparse``: :func:`sparsecomm.hooks.sparse_allreduce_hook`.

torch's hooks call ``torch.distributed`` directly, so their bytes are counted by
:func:`count_torch_collectives`, with the same analytic ring formula
(:func:`bindings.stats.ring_bytes`) that counts sparsecomm's own; the sparse
hook counts its own bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as tdist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from bindings.stats import CommStats, ring_bytes
from sparsecomm.hooks import SparseHookState, sparse_allreduce_hook

__all__ = ["HOOKS", "close_hook", "count_torch_collectives", "register_hook"]

HOOKS = ("allreduce", "powersgd", "sparse")


def register_hook(
    ddp: DistributedDataParallel,
    hook: str,
    *,
    density: float = 0.01,
    powersgd_rank: int = 4,
    start_iter: int = 10,
    seed: int = 0,
) -> tuple[Any, CommStats]:
    """Register ``hook`` (one of :data:`HOOKS`) on ``ddp``; return its state and the stats that count its bytes.

    Args:
        ddp: The wrapped model.
        hook: Which hook.
        density: ``sparse``: fraction of the dense bytes per step.
        powersgd_rank: ``powersgd``: the rank of the low-rank approximation.
        start_iter: Dense (plain all-reduce) iterations before compression starts (PowerSGD: at least 2, it
            needs DDP's rebuilt buckets).
        seed: ``powersgd``: seed of its random initial factors.

    The stats of ``allreduce`` and ``powersgd`` are filled only inside
    :func:`count_torch_collectives`.

    Raises:
        ValueError: An unknown hook, or settings out of range.
    """
    if hook not in HOOKS:
        raise ValueError(f"hook must be one of {HOOKS}, got {hook!r}")
    if powersgd_rank < 1 or start_iter < 0:
        raise ValueError(f"powersgd_rank must be >= 1 and start_iter >= 0, got {powersgd_rank}, {start_iter}")
    if hook == "sparse":
        state = SparseHookState(density=density, start_iter=start_iter)
        ddp.register_comm_hook(state, sparse_allreduce_hook)
        return state, state.stats
    if hook == "powersgd":
        psgd = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=max(2, start_iter),
            use_error_feedback=True,
            warm_start=True,
            random_seed=seed,
        )
        ddp.register_comm_hook(psgd, powerSGD_hook.powerSGD_hook)
        return psgd, CommStats()
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    return None, CommStats()


@contextlib.contextmanager
def count_torch_collectives(stats: CommStats, world_size: int) -> Iterator[None]:
    """Count into ``stats`` the bytes of ``torch.distributed.all_reduce`` / ``all_gather`` calls inside the block."""
    all_reduce, all_gather = tdist.all_reduce, tdist.all_gather

    def counted_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        stats.record("all_reduce", *ring_bytes("all_reduce", tensor.numel() * tensor.element_size(), world_size))
        return all_reduce(tensor, *args, **kwargs)

    def counted_all_gather(out: list[torch.Tensor], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        stats.record("all_gather", *ring_bytes("all_gather", tensor.numel() * tensor.element_size(), world_size))
        return all_gather(out, tensor, *args, **kwargs)

    tdist.all_reduce, tdist.all_gather = counted_all_reduce, counted_all_gather  # type: ignore[assignment]
    try:
        yield
    finally:
        tdist.all_reduce, tdist.all_gather = all_reduce, all_gather  # type: ignore[assignment]


def close_hook(state: Any) -> None:
    """Finish what the hook's state still has in flight (the sparse hook's mask exchange)."""
    if isinstance(state, SparseHookState):
        state.close()
