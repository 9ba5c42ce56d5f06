"""Command-line options shared by ``sparsecomm train`` and ``sparsecomm bench convergence``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from bindings.json_object import JsonObject
from optim.apps.benchmarks.output import write_bench_json
from optim.apps.train_job.job_config import LOCAL_MOMENTS, LOCAL_WIRES, TrainConfig
from optim.apps.train_job.tasks import ARCHS, CORPORA, TASKS
from optim.optimizers.local import LOCAL_SCHEDULES, NORMALIZERS, WINDOW_ORDERS
from optim.optimizers.local_optimizer import NOISE
from optim.optimizers.scape import MASK_SCORES, UNSELECTED_POLICIES

__all__ = [
    "add_gpt_bench_options",
    "add_model_options",
    "add_scape_options",
    "densities_arg",
    "model_settings",
    "scape_settings",
]


def add_model_options(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """Learning rate, model shape, evaluation and threads (defaults from ``d``)."""
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=d.warmup_steps, help="learning-rate warm-up steps")
    p.add_argument(
        "--min-lr-ratio",
        type=float,
        default=d.min_lr_ratio,
        help="final learning rate of the cosine decay, relative to --lr (1: constant after warm-up)",
    )
    p.add_argument(
        "--weight-decay", type=float, default=d.weight_decay, help="decoupled weight decay of matrices (0: off)"
    )
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per rank per step")
    p.add_argument("--context", type=int, default=d.context, help="tokens per sequence")
    p.add_argument("--d-model", type=int, default=d.d_model, help="model width")
    p.add_argument("--layers", type=int, default=d.n_layers, help="transformer blocks")
    p.add_argument("--heads", type=int, default=d.n_heads, help="attention heads")
    p.add_argument("--eval-interval", type=int, default=d.eval_interval, help="steps between validation passes")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches, help="validation batches per rank per pass")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank")
    p.add_argument("--task", choices=TASKS, default=d.task, help="byte-level LM (text) or MLP on sklearn digits")
    p.add_argument("--corpus", choices=CORPORA, default=d.corpus, help="text task: corpus when no --data is given")
    p.add_argument("--arch", choices=ARCHS, default=d.arch, help="text task: transformer family")


def add_gpt_bench_options(p: argparse.ArgumentParser, d: Any, *, heads: bool = True, context: bool = True) -> None:
    """Local ranks and the GPT's shape of a benchmark (defaults from its config ``d``).

    Args:
        p: The benchmark's parser.
        d: The benchmark's default config (``nproc``, ``d_model``, ``n_layers``, ``batch`` and, as asked,
            ``n_heads`` and ``context``).
        heads: Add ``--heads``.
        context: Add ``--context``.
    """
    p.add_argument("--nproc", type=int, default=d.nproc, help="local ranks")
    p.add_argument("--d-model", type=int, default=d.d_model, help="model width")
    p.add_argument("--layers", type=int, default=d.n_layers, help="transformer blocks")
    if heads:
        p.add_argument("--heads", type=int, default=d.n_heads, help="attention heads")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per rank per step")
    if context:
        p.add_argument("--context", type=int, default=d.context, help="tokens per sequence")


def densities_arg(text: str) -> tuple[float, ...]:
    """argparse type: a comma list of densities in (0, 1]."""
    try:
        items = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of densities, got {text!r}") from None
    if not items or any(not 0.0 < d <= 1.0 for d in items):
        raise argparse.ArgumentTypeError(f"densities must be in (0, 1], got {text!r}")
    return items


def add_scape_options(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The sparse optimizers' knobs (defaults from ``d``)."""
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=d.sparse_warmup_steps,
        help="SCAPE, LocalAdamS, TopKAdamS, the DDP hooks: dense steps first",
    )
    p.add_argument(
        "--powersgd-rank", type=int, default=d.powersgd_rank, help="ddp-powersgd-adamw: PowerSGD's approximation rank"
    )
    p.add_argument(
        "--local-schedule", choices=LOCAL_SCHEDULES, default=d.local_schedule, help="LocalAdamS: how to average"
    )
    p.add_argument(
        "--local-wire",
        choices=LOCAL_WIRES,
        default=d.local_wire,
        help="LocalAdamS: average the changes since the last average in the codes "
        "optim.optimizers.local.auto_wire_bits picks for the density (auto), float32 values, "
        "bfloat16 changes (twice the positions), or intB codes with error feedback (32/(B+0.25) times the positions)",
    )
    p.add_argument(
        "--local-normalizer",
        choices=NORMALIZERS,
        default=d.local_normalizer,
        help="LocalAdamS: AdamS normalizer of the averaged gradient (debiased), the same with only the measured "
        "noise across ranks taken out (measured), of this rank's own (local), or measured where the window "
        "covers less than half of the shard per step and debiased otherwise (auto)",
    )
    p.add_argument(
        "--local-window-order",
        choices=WINDOW_ORDERS,
        default=d.local_window_order,
        help="LocalAdamS: the staggered window through the shard in order (contiguous), spread over every tensor, "
        "or spread where it covers less than half of the shard per step (auto)",
    )
    p.add_argument(
        "--local-moment",
        choices=tuple(LOCAL_MOMENTS),
        default=d.local_moment,
        help="LocalAdamS: the window averages the first moment's changes beside the parameters' (on), in the "
        "same bytes (half the positions per step), or not (off); auto: on where the parameters' codes alone "
        "cover at least half of the shard per step",
    )
    p.add_argument(
        "--local-normalizer-dtype",
        choices=("float32", "bfloat16"),
        default=d.local_normalizer_dtype,
        help="LocalAdamS: dtype of the debiased normalizer's second-moment EMA (bfloat16: half its bytes)",
    )
    p.add_argument(
        "--local-overlap",
        action="store_true",
        help="LocalAdamS: each averaging (in codes) runs beside the next forward and backward and lands one step late",
    )
    p.add_argument(
        "--local-noise",
        choices=NOISE,
        default=d.local_noise,
        help="local-adamw: take the excess noise of this rank's gradient out of AdamW's second moment "
        "(auto: debias), or keep it",
    )
    p.add_argument("--mask-delay", type=int, default=d.mask_delay, help="SCAPE: mask delay D")
    p.add_argument("--unselected", choices=UNSELECTED_POLICIES, default=d.unselected, help="SCAPE: unselected policy")
    p.add_argument("--error-feedback", action="store_true", help="SCAPE: keep the unsent gradient as a residual")
    p.add_argument("--refresh-every", type=int, default=d.refresh_every, help="SCAPE: dense step every N (0: never)")
    p.add_argument("--mask-score", choices=MASK_SCORES, default=d.mask_score, help="SCAPE: mask statistic")
    p.add_argument("--explore", type=float, default=d.explore, help="SCAPE: fraction of k chosen round-robin")


def model_settings(args: argparse.Namespace) -> JsonObject:
    """The :class:`TrainConfig` fields set by :func:`add_model_options`."""
    return {
        "lr": args.lr,
        "warmup_steps": args.warmup,
        "min_lr_ratio": args.min_lr_ratio,
        "weight_decay": args.weight_decay,
        "batch": args.batch,
        "context": args.context,
        "d_model": args.d_model,
        "n_layers": args.layers,
        "n_heads": args.heads,
        "eval_interval": args.eval_interval,
        "eval_batches": args.eval_batches,
        "threads": args.threads,
        "task": args.task,
        "corpus": args.corpus,
        "arch": args.arch,
    }


def scape_settings(args: argparse.Namespace) -> JsonObject:
    """The :class:`TrainConfig` fields set by :func:`add_scape_options`."""
    return {
        "sparse_warmup_steps": args.warmup_steps,
        "powersgd_rank": args.powersgd_rank,
        "local_schedule": args.local_schedule,
        "local_wire": args.local_wire,
        "local_normalizer": args.local_normalizer,
        "local_window_order": args.local_window_order,
        "local_moment": args.local_moment,
        "local_overlap": args.local_overlap,
        "local_noise": args.local_noise,
        "local_normalizer_dtype": args.local_normalizer_dtype,
        "mask_delay": args.mask_delay,
        "unselected": args.unselected,
        "error_feedback": args.error_feedback,
        "refresh_every": args.refresh_every,
        "mask_score": args.mask_score,
        "explore": args.explore,
    }


def or_dash(v: float | None, fmt: str) -> str:
    """``v`` formatted with ``fmt``, or ``-`` for a missing value (table cells)."""
    return "-" if v is None else format(v, fmt)


def run_bench(
    command: str,
    run: Callable[[], JsonObject],
    table: Callable[[JsonObject], str],
    json_path: str | None,
    errors: tuple[type[BaseException], ...] = (RuntimeError,),
) -> JsonObject | None:
    """Run a benchmark, print its table and write its JSON; ``None`` (after printing why) when it fails."""
    try:
        bench = run()
    except errors as exc:
        print(f"sparsecomm bench {command}: error: {exc}", file=sys.stderr)
        return None
    print(table(bench))
    if json_path:
        print(f"wrote {write_bench_json(json_path, bench)}")
    return bench


def with_total(table: Callable[[JsonObject], str]) -> Callable[[JsonObject], str]:
    """``table`` with a last line giving the benchmark's total wall time (its ``wall_time_s``)."""

    def text(bench: JsonObject) -> str:
        return f"{table(bench)}\ntotal {bench['wall_time_s']:.0f} s"

    return text
