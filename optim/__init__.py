"""Optimizers, checkpointing and the training job built on sparsecomm."""

from __future__ import annotations

from optim.adams import AdamS, adams_step_, adams_step_foreach_, bias_correction_factor, step_bound

__all__ = ["AdamS", "adams_step_", "adams_step_foreach_", "bias_correction_factor", "step_bound"]
