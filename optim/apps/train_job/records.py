"""What the train job hands back: a record per step and per evaluation, and the run's result.

They cross from the ranks to the parent process (pickled) and from there into ``report.json``
(:meth:`TrainResult.to_json`); everything in between reads fields, not keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from bindings.json_object import JsonObject

__all__ = ["EvalRecord", "StepRecord", "TrainResult", "wire_bytes_summary"]


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One training step as rank 0 saw it.

    Attributes:
        step: The step (from 1).
        lr: Its learning rate.
        train_loss: The loss averaged over the ranks.
        grad_norm: The synchronized gradient's global norm before clipping (``None``: a sharded
            optimizer that does not clip).
        step_time_s: The whole step.
        comm_time_s: The gradient all-reduce, or a sharded optimizer's whole ``step()`` (its
            collectives plus the shard update); ``None`` where DDP's hook communicated in the backward pass.
        bytes_sent: Bytes this rank sent in the step (ring convention, :mod:`bindings.stats`).
        bytes_received: Bytes it received.
        bytes_sent_by_op: ``bytes_sent`` by stats op name (the ``loss`` all-reduce included).
        sparse: Whether the step communicated sparsely (``None``: the optimizer has no such notion).
    """

    step: int
    lr: float
    train_loss: float
    grad_norm: float | None
    step_time_s: float
    comm_time_s: float | None
    bytes_sent: int
    bytes_received: int
    bytes_sent_by_op: dict[str, int]
    sparse: bool | None = None

    def to_json(self) -> JsonObject:
        """The record's fields (``sparse`` left out where ``None``)."""
        out = dataclasses.asdict(self)
        if self.sparse is None:
            del out["sparse"]
        return out


@dataclass(frozen=True, kw_only=True)
class EvalRecord:
    """The validation loss after ``step`` (``0``: before training)."""

    step: int
    val_loss: float


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """Rank 0's result of a training run.

    Attributes:
        steps: One record per step.
        evals: The evaluations, the one before training first.
        model: The model's description (its task's ``describe()``: sizes, architecture).
        task: The task and architecture names.
        num_parameters: Trainable parameters.
        optimizer: The optimizer's resolved configuration (``TrainConfig.optimizer_config``).
        bucket_bytes: The dense fp32 gradient buffer's bytes (what a dense all-reduce moves).
        corpus: The data's description.
        comm_stats: The communicator's byte and call counts by op, the whole run.
        train_time_s: The training loop.
        world_size: Ranks of the run.
        launcher: ``local`` (spawned here) or the launcher that started the ranks.
        wall_time_s: Start to last result, the ranks' start-up included.
    """

    steps: tuple[StepRecord, ...]
    evals: tuple[EvalRecord, ...]
    model: JsonObject
    task: JsonObject
    num_parameters: int
    optimizer: JsonObject
    bucket_bytes: int
    corpus: JsonObject
    comm_stats: JsonObject
    train_time_s: float
    world_size: int
    launcher: str
    wall_time_s: float

    def to_json(self) -> JsonObject:
        """The result as JSON-ready fields (steps and evals as lists of their fields)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["steps"] = [s.to_json() for s in self.steps]
        out["evals"] = [dataclasses.asdict(e) for e in self.evals]
        return out


def wire_bytes_summary(steps: Sequence[StepRecord], bucket_bytes: int) -> JsonObject:
    """Summarise the per-step wire bytes of rank 0: total, per step, and split by stats op.

    Args:
        steps: The run's step records.
        bucket_bytes: Size of the flat fp32 gradient buffer.

    Returns:
        ``per_step`` / ``total`` (every op of the step), ``optimizer_per_step``
        (without the ``loss`` all-reduce), ``by_op`` (``{op: {"per_step",
        "total"}}``), ``total_received``, ``bucket_bytes`` and a note (the
        ``wire_bytes`` section of ``report.json``).
    """
    n = max(1, len(steps))
    sent = [s.bytes_sent for s in steps]
    totals: dict[str, int] = {}
    for s in steps:
        for op, b in s.bytes_sent_by_op.items():
            totals[op] = totals.get(op, 0) + b
    loss_total = totals.get("loss", 0)
    return {
        "per_step": sum(sent) / n,
        "optimizer_per_step": (sum(sent) - loss_total) / n,
        "total": sum(sent),
        "total_received": sum(s.bytes_received for s in steps),
        "by_op": {op: {"per_step": t / n, "total": t} for op, t in sorted(totals.items())},
        "bucket_bytes": bucket_bytes,
        "note": "bytes rank 0 sent in training steps (ring convention, bindings.stats); "
        "optimizer_per_step leaves out the 'loss' all-reduce",
    }
