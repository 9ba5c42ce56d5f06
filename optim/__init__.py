"""Optimizers, checkpointing and the training job built on sparsecomm."""

from __future__ import annotations

from optim.optimizers.adams import AdamS, adams_step_, adams_step_foreach_, bias_correction_factor, step_bound
from optim.optimizers.coded_gradients import CodedGradients
from optim.optimizers.demo import DeMo
from optim.optimizers.diloco import DiLoCo
from optim.optimizers.local import LocalAdamS
from optim.optimizers.local_optimizer import LocalOptimizer
from optim.optimizers.masked_loco import MaskedLoCo
from optim.optimizers.scape import SCAPE
from optim.optimizers.sharded import ShardedAdamS, ShardedAdamW
from optim.optimizers.sparseloco import SparseLoCo
from optim.optimizers.topk import TopKAdamS, TopKGradients

__all__ = [
    "AdamS",
    "CodedGradients",
    "DeMo",
    "DiLoCo",
    "LocalAdamS",
    "LocalOptimizer",
    "MaskedLoCo",
    "SCAPE",
    "ShardedAdamS",
    "ShardedAdamW",
    "SparseLoCo",
    "TopKAdamS",
    "TopKGradients",
    "adams_step_",
    "adams_step_foreach_",
    "bias_correction_factor",
    "step_bound",
]
