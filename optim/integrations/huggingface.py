"""Hugging Face ``Trainer`` (and Accelerate) with sparsecomm: sparse DDP hooks or optimizer-side sync.

``Trainer`` wraps the model in ``DistributedDataParallel`` inside ``train()``,
after the user's script has handed the model over, and Accelerate's DDP
options accept only torch's built-in hooks. :class:`DDPCommCallback` registers
sparsecomm's hook on the wrapped model when training begins::

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      optimizers=(optim.SCAPE(model.parameters(), lr=3e-3, density=0.01), None))
    trainer.add_callback(DDPCommCallback(trainer))        # SCAPE syncs: DDP sends nothing

    trainer = Trainer(model=model, args=args, train_dataset=ds)       # its own AdamW
    trainer.add_callback(DDPCommCallback(trainer, SparseHookState(density=0.01)))

With Accelerate directly, register after ``prepare``:
``model, opt = accelerator.prepare(model, opt)`` then
``sparsecomm.hooks.let_optimizer_sync(model)`` or
``model.register_comm_hook(state, sparse_allreduce_hook)``.

Call ``sparsecomm.distributed.init_process_group`` before building the
``Trainer``: Accelerate then uses the default group it made.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback

from optim.optimizers.capabilities import capabilities
from sparsecomm.hooks import SparseHookState, let_optimizer_sync, sparse_allreduce_hook

__all__ = ["DDPCommCallback", "syncs_gradients_itself"]

logger = logging.getLogger(__name__)


def syncs_gradients_itself(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or the optimizer an Accelerate wrapper holds) synchronizes the ranks itself."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return capabilities(inner).synchronizes


class DDPCommCallback(TrainerCallback):  # type: ignore[misc]
    """Registers a DDP comm hook on ``trainer``'s DDP model when training begins.

    Args:
        trainer: The ``Trainer`` this callback is added to.
        hook_state: A :class:`~sparsecomm.hooks.SparseHookState`: DDP sends the
            sparse all-reduce of every bucket. ``None``: the optimizer must be
            one of sparsecomm's that synchronize the gradients themselves
            (SCAPE, the sharded AdamS/AdamW, LocalAdamS, TopKAdamS), and DDP
            sends nothing.

    Raises:
        TypeError: ``trainer`` is not a ``Trainer`` or ``hook_state`` not a ``SparseHookState``.
        ValueError: At the start of training, without ``hook_state``, the
            optimizer does not synchronize the gradients itself (training
            would run on unsynchronized replicas).
    """

    def __init__(self, trainer: Trainer, hook_state: SparseHookState | None = None) -> None:
        if not isinstance(trainer, Trainer):
            raise TypeError(f"trainer: expected a transformers.Trainer, got {type(trainer).__name__}")
        if hook_state is not None and not isinstance(hook_state, SparseHookState):
            raise TypeError(f"hook_state: expected a SparseHookState or None, got {type(hook_state).__name__}")
        self.trainer = trainer
        self.hook_state = hook_state
        self._registered: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ddp = self.trainer.model_wrapped
        if not isinstance(ddp, DistributedDataParallel):
            logger.info("DDPCommCallback: the model is not wrapped in DDP (one process?): nothing to register")
            return
        if ddp is self._registered:
            return  # a second train() on the same wrapped model: the hook is in place
        if self.hook_state is None:
            if not syncs_gradients_itself(self.trainer.optimizer):
                raise ValueError(
                    "DDPCommCallback: without a hook_state the optimizer must synchronize the gradients itself "
                    f"(a sparsecomm optimizer); {type(self.trainer.optimizer).__name__} does not. Pass "
                    "hook_state=SparseHookState(...) to use the sparse DDP hook instead"
                )
            if getattr(args, "max_grad_norm", 0.0):
                warnings.warn(
                    "DDPCommCallback: Trainer clips each rank's own gradient before the optimizer averages it "
                    f"(max_grad_norm={args.max_grad_norm}); set TrainingArguments(max_grad_norm=0) and clip in "
                    "the optimizer (e.g. SCAPE(max_grad_norm=...)), which clips the averaged gradient",
                    stacklevel=2,
                )
            let_optimizer_sync(ddp)
        else:
            ddp.register_comm_hook(self.hook_state, sparse_allreduce_hook)
        self._registered = ddp

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.hook_state is not None:
            self.hook_state.close()
