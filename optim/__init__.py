"""Optimizers, checkpointing and the training job built on sparsecomm."""

from __future__ import annotations

from optim.adams import AdamS, adams_step_, adams_step_foreach_, bias_correction_factor, step_bound
from optim.scape import SCAPE
from optim.sharded import ShardedAdamS, ShardedAdamW

__all__ = [
    "AdamS",
    "SCAPE",
    "ShardedAdamS",
    "ShardedAdamW",
    "adams_step_",
    "adams_step_foreach_",
    "bias_correction_factor",
    "step_bound",
]
