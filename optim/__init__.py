"""Optimizers, checkpointing and the training job built on sparsecomm."""

from __future__ import annotations
