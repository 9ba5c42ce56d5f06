"""The ``sparsecomm`` command line (also ``python -m optim``).

Each subcommand registers itself in :func:`build_parser` through its own
``_add_<name>_parser(subparsers)`` function, which adds its options and sets
the defaults ``func`` (the handler: parsed namespace in, exit status out) and
``cmd_parser`` (its own parser, for ``args.cmd_parser.error(...)``); a
subcommand with sub-subcommands adds its own subparsers the same way.
This module is the only place of the package that prints, draws progress
bars (tqdm) or plots (matplotlib, Agg canvas).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bindings.spawn import LocalRunError
from optim.apps.cli.bench import add_bench_parser
from optim.apps.cli.control_plane import add_launch_parsers
from optim.apps.cli.export_weights import add_export_parser
from optim.apps.cli.options import add_model_options, add_scape_options, model_settings, scape_settings
from optim.apps.cli.report import build_report, write_report
from optim.apps.cli.train_resilient import add_resilience_options, run_resilient_cmd, wants_resilience
from optim.apps.train_job.job_config import OPTIMIZERS, TrainConfig
from optim.apps.train_job.records import StepRecord
from optim.apps.train_job.train import run_training

__all__ = ["main", "build_parser", "TqdmProgress"]

_DEFAULTS = TrainConfig()


class TqdmProgress:
    """Picklable per-step callback that draws a tqdm bar (created on first use, in rank 0)."""

    def __init__(self, total: int) -> None:
        """Prepare a bar of ``total`` steps.

        Args:
            total: Number of steps.
        """
        self.total = total
        self._bar: Any = None
        self._val: float | None = None

    def __getstate__(self) -> dict[str, object]:
        return {"total": self.total, "_bar": None, "_val": None}

    def __call__(self, record: StepRecord, val_loss: float | None) -> None:
        """Advance the bar by one step and show the latest losses.

        Args:
            record: The step's record.
            val_loss: Its validation loss (``None``: not evaluated after this step).
        """
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc="train", unit="step", dynamic_ncols=True)
        if val_loss is not None:
            self._val = val_loss
        postfix = {"loss": f"{record.train_loss:.3f}"}
        if self._val is not None:
            postfix["val"] = f"{self._val:.3f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)
        if record.step >= self.total:
            self._bar.close()


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _add_train_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``train``: data-parallel training of a tiny byte-level GPT."""
    d = _DEFAULTS
    p = subparsers.add_parser(
        "train",
        help="train a small GPT on local CPU ranks",
        description="Data-parallel training of a small byte-level GPT over sparsecomm.distributed "
        "(the optimizer synchronizes the gradients: ZeRO-1 AdamW / AdamS, or sparse SCAPE). "
        "Spawns --nproc local ranks, or runs as one rank when "
        "started by torchrun / mpirun / srun. Writes OUT/report.json and OUT/report.png.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=d.nproc, help="local ranks to spawn")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    p.add_argument("--backend", choices=("gloo", "mpi"), default=d.backend, help="transport (mpi: start under mpirun)")
    p.add_argument(
        "--data",
        metavar="FILE",
        default=d.data,
        help="text file to train on (default: the Python standard library's source)",
    )
    p.add_argument("--out", metavar="DIR", default=d.out, help="output directory")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of init and data order")
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=d.optimizer,
        help="adamw: ShardedAdamW, adams: ShardedAdamS, scape: SCAPE (sparse), local-adams: LocalAdamS (local "
        "steps, parameters averaged a window at a time), topk-adams: TopKAdamS (top-k + error feedback), "
        "allreduce-adamw: bucket all-reduce + torch AdamW, ddp-powersgd-adamw / ddp-sparse-adamw: torch DDP with "
        "the PowerSGD hook (--powersgd-rank) or sparsecomm's sparse hook (--density) + torch AdamW; torch AdamW "
        "wrapped at --density's bytes: local-adamw (LocalOptimizer), coded-adamw (CodedGradients), topk-adamw "
        "(TopKGradients), diloco-adamw / periodic-adamw (DiLoCo, Nesterov or plain averaging), sparseloco-adamw, "
        "maskedloco-adamw; coded-adams: AdamS inside CodedGradients; demo-sgd: torch SGD inside DeMo (signum on "
        "the ranks' fast momentum components)",
    )
    p.add_argument(
        "--density", type=float, default=d.density, help="sparse optimizers: fraction of the dense bytes per step"
    )
    add_scape_options(p, d)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="global gradient-norm clip (0: off)")
    add_model_options(p, d)
    p.add_argument("--timeout", type=float, default=d.job_timeout_s, help="deadline of the whole local job, seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_resilience_options(p)
    p.set_defaults(func=_cmd_train, cmd_parser=p)


def _cmd_train(args: argparse.Namespace) -> int:
    """Run ``sparsecomm train``; return the exit status."""
    parser: argparse.ArgumentParser = args.cmd_parser
    try:
        config = TrainConfig(
            steps=args.steps,
            nproc=args.nproc,
            backend=args.backend,
            **model_settings(args),
            **scape_settings(args),
            grad_clip=args.grad_clip,
            optimizer=args.optimizer,
            density=args.density,
            seed=args.seed,
            out=args.out,
            data=args.data,
            job_timeout_s=args.timeout,
        )
    except ValueError as exc:
        parser.error(str(exc))
    if args.data is not None and not Path(args.data).is_file():
        parser.error(f"--data: file not found: {args.data}")
    if wants_resilience(args):
        return run_resilient_cmd(args, config)
    progress = None if args.no_progress else TqdmProgress(config.steps)
    try:
        result = run_training(config, on_step=progress)
    except LocalRunError as exc:
        print(f"sparsecomm train: error: {exc}", file=sys.stderr)
        return 1
    if result is None:  # a non-zero rank of a torchrun / mpirun job
        return 0
    report = build_report(config, result)
    json_path, png_path = write_report(report, config.out)
    final, wire = report["final"], report["wire_bytes"]
    print(
        f"final train loss {final['train_loss_last10_mean']:.3f} (mean of last 10 steps), "
        f"validation loss {final['val_loss']:.3f} (from {final['initial_val_loss']:.3f})\n"
        f"wall time {report['wall_time_s']:.1f} s (training {report['train_time_s']:.1f} s, "
        f"{report['mean_step_time_s'] * 1e3:.0f} ms/step), "
        f"{report['world_size']} ranks over {report['backend']}\n"
        f"optimizer {report['optimizer']['name']} ({report['optimizer']['class']}); wire bytes per step "
        f"{_fmt_bytes(wire['per_step'])} sent per rank ("
        + ", ".join(f"{op} {_fmt_bytes(v['per_step'])}" for op, v in wire["by_op"].items())
        + f"), total {_fmt_bytes(wire['total'])}\n"
        f"report: {json_path}, {png_path}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Return the ``sparsecomm`` parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="sparsecomm", description="sparsecomm: communication for distributed training."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-v: info, -vv: debug)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train_parser(subparsers)
    add_bench_parser(subparsers)
    add_launch_parsers(subparsers)
    add_export_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("sparsecomm: interrupted", file=sys.stderr)
        return 130
