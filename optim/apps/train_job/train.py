"""A data-parallel training job over :mod:`sparsecomm.distributed`.

Every rank holds the whole model (identical seeded initialisation, checked
with a broadcast) and draws its own batch of ``(seed, step, rank)``. The
optimizer (``TrainConfig.optimizer``) decides how gradients are synchronized:

* ``adamw`` (:class:`optim.ShardedAdamW`), ``adams`` (:class:`optim.ShardedAdamS`)
  and ``scape`` (:class:`optim.SCAPE`) synchronize inside ``step()`` (ZeRO-1
  reduce-scatter / all-gather, sparse for SCAPE) and clip the global norm of
  the synchronized gradient themselves (``max_grad_norm``). The rank-averaged
  training loss then takes its own one-element all-reduce, counted under the
  stats scope ``loss``.
* ``allreduce-adamw`` (the original job): one flat bucket of every gradient
  plus the loss in the last element is all-reduced with ``ReduceOp.AVG``,
  clipped, then a :class:`torch.optim.AdamW` step.
* ``ddp-powersgd-adamw`` / ``ddp-sparse-adamw``: the model runs under torch's
  DDP with PowerSGD's or sparsecomm's sparse comm hook
  (:mod:`optim.apps.train_job.ddp`), which averages the gradients during the
  backward pass; then the loss's one-element all-reduce, the clip and a
  :class:`torch.optim.AdamW` step. Their ``comm_time_s`` is ``None``: the
  hook's communication runs inside the backward pass.

Every step record carries the wire bytes of that step split by operation
(deltas of ``CommStats.as_dict()``); evaluation and the start-up check are
counted under the scopes ``eval`` and ``init``, outside the step window.

Entry points:

* :func:`train_worker` runs the loop in one rank of an initialised group.
* :func:`launch_local` spawns ``nproc`` local processes and returns rank 0's result.
* :func:`run_training` runs as one rank when started by torchrun / mpirun /
  srun, otherwise calls :func:`launch_local`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
from torch.nn.parallel import DistributedDataParallel

import sparsecomm.distributed as dist
from bindings.json_object import JsonObject
from bindings.launch import detect_launch
from bindings.spawn import run_local
from bindings.stats import CommStats, op_delta
from optim.apps.train_job.ddp import close_hook, count_torch_collectives, register_hook
from optim.apps.train_job.job_config import DDP_HOOKS, TORCH_ADAMW, TrainConfig, build_optimizer, lr_at
from optim.apps.train_job.records import EvalRecord, StepRecord, TrainResult
from optim.apps.train_job.tasks import Task, make_task
from optim.optimizers.capabilities import AveragingOptimizer, capabilities

__all__ = [
    "OnStep",
    "Worker",
    "evaluate",
    "train_step",
    "train_worker",
    "joined_group",
    "launch_local",
    "run_training",
]

logger = logging.getLogger(__name__)

OnStep = Callable[[StepRecord, "float | None"], None]
"""Per-step callback: the step's record and its validation loss (``None``: no evaluation after this step)."""
Worker = Callable[["TrainConfig", int, int, "OnStep | None"], TrainResult]
"""Signature of :func:`train_worker` (``config, rank, world_size, on_step``)."""


def _check_identical_init(model: torch.nn.Module) -> None:
    """Raise on every rank unless all ranks hold rank 0's parameters bit for bit."""
    with torch.no_grad():
        mine = torch.nn.utils.parameters_to_vector(model.parameters())
        ref = mine.clone()
        with dist.get_communicator().stats.scope("init"):
            dist.broadcast(ref, src=0)
            differ = torch.tensor([0.0 if torch.equal(ref, mine) else 1.0])
            dist.all_reduce(differ, op=dist.ReduceOp.MAX)
    if differ.item():
        raise RuntimeError("model initialisation differs between ranks")


def evaluate(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, task: Task, config: TrainConfig, rank: int
) -> float:
    """Return the rank-averaged loss on this rank's fixed validation batches.

    Collective. Under an optimizer whose replicas drift (:class:`optim.LocalAdamS`,
    :class:`optim.LocalOptimizer`, the outer loops) the average of the replicas is
    evaluated (``optimizer.averaged()``, counted under ``average``).
    """
    total = 0.0
    averaged: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if capabilities(optimizer).replicas_drift:
        averaged = cast(AveragingOptimizer, optimizer).averaged()
    with averaged, torch.no_grad():
        model.eval()
        for i in range(config.eval_batches):
            x, y = task.val_batch(i, rank)
            _, loss = model(x, y)
            assert loss is not None
            total += loss.item()
        model.train()
    val = torch.tensor([total / config.eval_batches])
    with dist.get_communicator().stats.scope("eval"):
        dist.all_reduce(val, op=dist.ReduceOp.AVG)
    return float(val.item())


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, task: Task, config: TrainConfig, step: int, rank: int
) -> torch.Tensor:
    """Forward and backward of ``step`` on this rank's batch, with the step's learning rate set; return the loss.

    The batch is a function of ``(seed, step, rank)``, so a step run again sees the same data.
    """
    lr = lr_at(config, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    x, y = task.train_batch(step, rank)
    optimizer.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    assert loss is not None
    loss.backward()
    return loss


class _GradSync:
    """How a run's gradients meet: in the optimizer (ours and the wrappers), in DDP's comm hook, or one bucket.

    Args:
        config: The run.
        model: The model (a DDP wrapper goes around it for a hook).
        optimizer: The run's optimizer.
        world_size: Ranks in the group.
    """

    def __init__(
        self, config: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world_size: int
    ) -> None:
        self.config, self.optimizer = config, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.in_optimizer = config.optimizer not in TORCH_ADAMW
        self.hook = DDP_HOOKS.get(config.optimizer)
        self.bucketed = config.optimizer == "allreduce-adamw"
        self.bucket = torch.zeros(self.numel + 1 if self.bucketed else 0, dtype=torch.float32)  # grads, then loss
        self.loss_buf = torch.zeros(1, dtype=torch.float32)
        self.net: torch.nn.Module = model
        self.hook_state: Any = None
        self.hook_stats: CommStats | None = None
        self.start_iter = 0  # dense steps before a DDP hook compresses
        self.counting: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
        if self.hook is not None:
            ddp = DistributedDataParallel(model)
            self.start_iter = config.sparse_kwargs()["start_iter"]
            self.hook_state, self.hook_stats = register_hook(
                ddp,
                self.hook,
                density=config.density,
                powersgd_rank=config.powersgd_rank,
                start_iter=self.start_iter,
                seed=config.seed,
            )
            if self.hook != "sparse":  # torch's hooks call torch.distributed directly: count them in the backward
                hook_stats = self.hook_stats
                self.counting = lambda: count_torch_collectives(hook_stats, world_size)  # noqa: E731
            self.net = ddp

    def step(self, loss: torch.Tensor, step: int) -> tuple[float, float | None, float | None]:
        """Synchronize and step after the backward pass of ``step``: (mean loss, grad norm, communication time)."""
        optimizer = self.optimizer
        if self.in_optimizer:
            train_loss = _average_loss(self.loss_buf, loss, step)
            t_comm = time.perf_counter()
            optimizer.step()
            last = getattr(optimizer, "last_grad_norm", None)
            return train_loss, None if last is None else float(last), time.perf_counter() - t_comm
        if self.hook is not None:  # DDP's hook averaged the gradients during the backward pass
            return _average_loss(self.loss_buf, loss, step), _clip_and_step(self.config, self.params, optimizer), None
        return _allreduce_step(self.config, self.params, self.bucket, loss, optimizer)

    def hook_ops(self) -> JsonObject:
        """The hook's own operation counters so far (``{}`` without one)."""
        return self.hook_stats.as_dict() if self.hook_stats is not None else {}

    def sparse(self, step: int) -> bool | None:
        """Whether ``step`` sent less than the dense gradient (``None``: a dense choice)."""
        sparse = _sparse_step(self.optimizer, step)
        return step > self.start_iter if sparse is None and self.hook is not None else sparse

    def bucket_bytes(self) -> int:
        """Bytes of the flat fp32 buffer the run's gradients travel in (the dense reference of the byte ratios)."""
        if self.in_optimizer:
            return int(self.optimizer.bucket.numel) * 4  # type: ignore[attr-defined]
        if self.bucketed:
            return self.bucket.numel() * self.bucket.element_size()
        return self.numel * 4  # the dense fp32 gradient the hook compresses

    def close(self) -> None:
        """Finish what runs in the background (mask gathers, averaging, the hook's) before the group goes."""
        close = getattr(self.optimizer, "close", None)
        if close is not None:
            close()
        close_hook(self.hook_state)


def train_worker(config: TrainConfig, rank: int, world_size: int, on_step: OnStep | None = None) -> TrainResult:
    """Run the training loop as one rank of an initialised default group.

    Collective: every rank of the group must call this with the same config.

    Args:
        config: The run.
        rank: This rank (must equal ``sparsecomm.distributed.get_rank()``).
        world_size: Ranks in the group.
        on_step: Called after every step with the step record.

    Returns:
        The run's result (``launcher`` ``""`` and ``wall_time_s`` the training
        loop's: :func:`run_training` fills them in).

    Raises:
        RuntimeError: The ranks disagree on the model or the loss is not finite.
    """
    if dist.get_rank() != rank or dist.get_world_size() != world_size:
        raise RuntimeError(
            f"rank/world_size {rank}/{world_size} differ from the process group's "
            f"{dist.get_rank()}/{dist.get_world_size()}"
        )
    torch.set_num_threads(config.threads)
    task = make_task(config.task_spec())
    about = task.describe()
    torch.manual_seed(config.seed)
    model = task.build_model()
    _check_identical_init(model)
    stats = dist.get_communicator().stats
    with stats.scope("init"):
        optimizer = build_optimizer(config, model)
    sync = _GradSync(config, model, optimizer, world_size)
    records: list[StepRecord] = []
    evals = [EvalRecord(step=0, val_loss=evaluate(model, optimizer, task, config, rank))]
    logger.info("rank %d: %d parameters, %s, optimizer %s", rank, sync.numel, about["corpus"]["name"], config.optimizer)
    t_train = time.perf_counter()
    try:
        for step in range(1, config.steps + 1):
            ops0, hook0, t0 = stats.as_dict(), sync.hook_ops(), time.perf_counter()
            with sync.counting():
                loss = train_step(sync.net, optimizer, task, config, step, rank)
            lr = optimizer.param_groups[0]["lr"]
            train_loss, grad_norm, comm_time = sync.step(loss, step)
            ops = op_delta(ops0, stats.as_dict())
            for op, d in op_delta(hook0, sync.hook_ops()).items():
                ops[op] = {k: v + ops.get(op, {}).get(k, 0) for k, v in d.items()}
            record = StepRecord(
                step=step,
                lr=lr,
                train_loss=train_loss,
                grad_norm=grad_norm,
                step_time_s=time.perf_counter() - t0,
                comm_time_s=comm_time,
                bytes_sent=sum(d["bytes_sent"] for d in ops.values()),
                bytes_received=sum(d["bytes_received"] for d in ops.values()),
                bytes_sent_by_op={op: d["bytes_sent"] for op, d in ops.items()},
                sparse=sync.sparse(step),
            )
            records.append(record)
            val_loss = None
            if step == config.steps or (config.eval_interval and step % config.eval_interval == 0):
                val_loss = evaluate(model, optimizer, task, config, rank)
                evals.append(EvalRecord(step=step, val_loss=val_loss))
            if on_step is not None:
                on_step(record, val_loss)
        if capabilities(optimizer).replicas_drift:
            cast(AveragingOptimizer, optimizer).average_params()  # every rank ends with the same model
    finally:
        sync.close()
    train_time = time.perf_counter() - t_train
    return TrainResult(
        steps=tuple(records),
        evals=tuple(evals),
        model=about["model"],
        task={"task": about["task"], "arch": about["arch"]},
        num_parameters=sync.numel,
        optimizer=config.optimizer_config(),
        bucket_bytes=sync.bucket_bytes(),
        corpus=about["corpus"],
        comm_stats=stats.as_dict(),
        train_time_s=train_time,
        world_size=world_size,
        launcher="",
        wall_time_s=train_time,
    )


def _sparse_step(optimizer: torch.optim.Optimizer, step: int) -> bool | None:
    """Whether ``step`` of ``optimizer`` was sparse: SCAPE's mask of the step, or past the dense warm-up
    of an optimizer that has one; ``None`` for one that is always dense."""
    if hasattr(optimizer, "last_mask"):
        return optimizer.last_mask is not None
    warmup = getattr(optimizer, "warmup_steps", None)
    return None if warmup is None else step > warmup


def _allreduce_step(
    config: TrainConfig,
    params: list[torch.nn.Parameter],
    bucket: torch.Tensor,
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
) -> tuple[float, float, float]:
    """The ``allreduce-adamw`` step: all-reduce grads + loss, clip, step; return (loss, norm, comm time)."""
    numel = bucket.numel() - 1
    offset = 0
    for p in params:
        n = p.numel()
        bucket[offset : offset + n].copy_(p.grad.reshape(-1))  # type: ignore[union-attr]
        offset += n
    bucket[numel] = loss.detach()
    t_comm = time.perf_counter()
    dist.all_reduce(bucket, op=dist.ReduceOp.AVG)
    comm_time = time.perf_counter() - t_comm
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(bucket[offset : offset + n].view_as(p))  # type: ignore[union-attr]
        offset += n
    train_loss = float(bucket[numel].item())
    if not math.isfinite(train_loss):
        raise RuntimeError(f"training loss is {train_loss}")
    return train_loss, _clip_and_step(config, params, optimizer), comm_time


def _average_loss(loss_buf: torch.Tensor, loss: torch.Tensor, step: int) -> float:
    """The ranks' mean training loss of ``step`` (its own one-element all-reduce, stats scope ``loss``)."""
    loss_buf[0] = loss.detach()
    with dist.get_communicator().stats.scope("loss"):
        dist.all_reduce(loss_buf, op=dist.ReduceOp.AVG)
    train_loss = float(loss_buf.item())
    if not math.isfinite(train_loss):
        raise RuntimeError(f"step {step}: training loss is {train_loss}")
    return train_loss


def _clip_and_step(config: TrainConfig, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> float:
    """Clip the synchronized gradients' global norm (``grad_clip``; 0: only measure it), step; return the norm."""
    if config.grad_clip > 0:
        norm = float(torch.nn.utils.clip_grad_norm_(params, config.grad_clip))
    else:
        norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])))
    optimizer.step()
    return norm


@contextlib.contextmanager
def joined_group(backend: str, threads: int, comm_timeout_s: float) -> Iterator[None]:
    """In a spawned rank: ``threads`` torch threads, in the default group until the block ends.

    Args:
        backend: Backend of the default group (joined from the launcher's environment).
        threads: ``torch.set_num_threads`` of this rank.
        comm_timeout_s: Deadline of every collective, seconds.
    """
    torch.set_num_threads(threads)
    dist.init_process_group(backend, timeout=timedelta(seconds=comm_timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rank_main(
    rank: int, world_size: int, worker: Worker, config: TrainConfig, on_step: OnStep | None
) -> TrainResult | None:
    """Body of one spawned rank: join the group from the launcher's environment, train."""
    with joined_group(config.backend, config.threads, config.comm_timeout_s):
        out = worker(config, rank, world_size, on_step if rank == 0 else None)
    return out if rank == 0 else None


def launch_local(config: TrainConfig, *, on_step: OnStep | None = None, worker: Worker = train_worker) -> TrainResult:
    """Run ``worker`` in ``config.nproc`` spawned local processes over gloo.

    The whole job has the deadline ``config.job_timeout_s``; when a rank
    fails or dies, the others are killed (:func:`bindings.spawn.run_local`).

    Args:
        config: The run.
        on_step: Passed to rank 0's worker; must be picklable.
        worker: Module-level function with :func:`train_worker`'s signature.

    Returns:
        Rank 0's result.

    Raises:
        LocalRunError: A rank raised (its traceback is in the message), died,
            or the job ran past its deadline.
        ValueError: ``config.backend`` is ``mpi`` (start it with mpirun instead).
    """
    if config.backend == "mpi":
        raise ValueError(
            f"backend 'mpi' cannot be spawned locally; run 'mpirun -n {config.nproc} sparsecomm train --backend mpi'"
        )
    results = run_local(_rank_main, config.nproc, worker, config, on_step, timeout=config.job_timeout_s)
    return results[0]


def run_training(config: TrainConfig, *, on_step: OnStep | None = None) -> TrainResult | None:
    """Train as the launched rank, or spawn ``config.nproc`` local ranks.

    Started by torchrun / mpirun / srun, this process runs as its rank (and
    ``config.nproc`` is ignored); otherwise :func:`launch_local` spawns the ranks.

    Args:
        config: The run.
        on_step: Rank 0's per-step callback (picklable when spawning).

    Returns:
        On rank 0, :func:`train_worker`'s result with ``launcher`` (``local``
        or the launcher's name) and ``wall_time_s`` (start to last result);
        ``None`` on the other ranks.
    """
    t0 = time.perf_counter()
    info = detect_launch()
    if info is None:
        if config.data is not None and not Path(config.data).is_file():
            raise FileNotFoundError(f"data file not found: {config.data}")
        result = launch_local(config, on_step=on_step)
        launcher = "local"
    else:
        if info.world_size != config.nproc:
            logger.info("launched by %s with %d ranks; nproc=%d ignored", info.launcher, info.world_size, config.nproc)
        dist.init_process_group(config.backend, timeout=timedelta(seconds=config.comm_timeout_s))
        try:
            result = train_worker(
                config, dist.get_rank(), dist.get_world_size(), on_step if dist.get_rank() == 0 else None
            )
            rank = dist.get_rank()
        finally:
            dist.destroy_process_group()
        if rank != 0:
            return None
        launcher = info.launcher
    return dataclasses.replace(result, launcher=launcher, wall_time_s=time.perf_counter() - t0)
