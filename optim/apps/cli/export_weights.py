"""``sparsecomm export``: the weights of a ``sparsecomm train`` checkpoint as a plain ``model.state_dict()`` file."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from optim.apps.train_job.job_config import build_optimizer
from optim.apps.train_job.resilient_job import train_config_from
from optim.apps.train_job.tasks import make_task
from optim.state.checkpoint import CheckpointError
from optim.state.export import export_checkpoint

__all__ = ["add_export_parser"]


def _cmd_export(args: argparse.Namespace) -> int:
    try:
        config = train_config_from(args.checkpoint_dir)
    except ValueError as exc:
        print(f"sparsecomm export: error: {exc}", file=sys.stderr)
        return 2
    torch.manual_seed(config.seed)
    model = make_task(config.task_spec()).build_model()
    try:
        step = export_checkpoint(args.checkpoint_dir, model, lambda m: build_optimizer(config, m), args.out)
    except CheckpointError as exc:
        print(f"sparsecomm export: error: {exc}", file=sys.stderr)
        return 1
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: model.state_dict() of step {step} ({n} parameters); load it with torch.load")
    return 0


def add_export_parser(subparsers: Any) -> None:
    """Register ``export``."""
    p = subparsers.add_parser(
        "export",
        help="write the weights of a sparsecomm train checkpoint as a plain state_dict file",
        description="Assembles the newest complete checkpoint in CHECKPOINT_DIR (written by sparsecomm train "
        "--checkpoint-dir, any world size) in this one process and writes model.state_dict() to OUT with "
        "torch.save. For your own training loop, call optim.state.export.export_checkpoint with your model.",
    )
    p.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR")
    p.add_argument("out", metavar="OUT", help="the .pt file to write")
    p.set_defaults(func=_cmd_export, cmd_parser=p)
