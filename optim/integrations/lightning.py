"""PyTorch Lightning with sparsecomm: a ``DDPStrategy`` that runs the sparse DDP hook or lets the optimizer sync.

::

    import sparsecomm.distributed as dist
    from optim.integrations.lightning import SparseDDPStrategy

    dist.init_process_group("gloo")        # under torchrun: Lightning then uses this default group
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=SparseDDPStrategy())        # SCAPE syncs
    trainer = L.Trainer(..., strategy=SparseDDPStrategy(SparseHookState(density=0.01)))   # AdamW, sparse hook

Lightning's own ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``
registers a hook only on CUDA devices; this strategy registers it on every
device, once the model is wrapped.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from sparsecomm.hooks import SparseHookState, let_optimizer_sync, sparse_allreduce_hook

__all__ = ["SparseDDPStrategy"]


class SparseDDPStrategy(DDPStrategy):  # type: ignore[misc]
    """Lightning's ``DDPStrategy`` with sparsecomm's comm hook, on CPU and CUDA.

    Args:
        hook_state: A :class:`~sparsecomm.hooks.SparseHookState`: DDP sends the
            sparse all-reduce of each bucket. ``None``: DDP sends nothing (for
            sparsecomm's optimizers, which synchronize the gradients
            themselves; leave Lightning's ``gradient_clip_val`` unset and clip
            in the optimizer, which clips the averaged gradient).
        **kwargs: Passed to ``DDPStrategy`` (not its ``ddp_comm_*`` arguments).

    Raises:
        TypeError: ``hook_state`` is not a ``SparseHookState``.
        ValueError: ``kwargs`` set a comm hook of their own.
    """

    def __init__(self, hook_state: SparseHookState | None = None, **kwargs: Any) -> None:
        if hook_state is not None and not isinstance(hook_state, SparseHookState):
            raise TypeError(f"hook_state: expected a SparseHookState or None, got {type(hook_state).__name__}")
        clash = sorted(k for k in kwargs if k.startswith("ddp_comm_"))
        if clash:
            raise ValueError(f"SparseDDPStrategy sets the comm hook itself; do not pass {', '.join(clash)}")
        super().__init__(**kwargs)
        self.hook_state = hook_state

    def configure_ddp(self) -> None:
        """Wrap the model in DDP (Lightning's way), then register sparsecomm's hook on it."""
        super().configure_ddp()
        assert isinstance(self.model, DistributedDataParallel)
        if self.hook_state is None:
            let_optimizer_sync(self.model)
        else:
            self.model.register_comm_hook(self.hook_state, sparse_allreduce_hook)

    def teardown(self) -> None:
        """Finish the hook's mask gathers, then Lightning's teardown."""
        if self.hook_state is not None:
            self.hook_state.close()
        super().teardown()
