"""Optimizers, checkpointing and the training job built on sparsecomm."""

from __future__ import annotations

from optim.adams import AdamS, adams_step_, adams_step_foreach_, bias_correction_factor, step_bound
from optim.diloco import DiLoCo
from optim.local import LocalAdamS
from optim.local_optimizer import LocalOptimizer
from optim.scape import SCAPE
from optim.sharded import ShardedAdamS, ShardedAdamW
from optim.sparseloco import SparseLoCo
from optim.topk import TopKAdamS

__all__ = [
    "AdamS",
    "DiLoCo",
    "LocalAdamS",
    "LocalOptimizer",
    "SCAPE",
    "ShardedAdamS",
    "ShardedAdamW",
    "SparseLoCo",
    "TopKAdamS",
    "adams_step_",
    "adams_step_foreach_",
    "bias_correction_factor",
    "step_bound",
]
