"""``sparsecomm bench hooks``: plain DDP, PowerSGD and the sparse DDP hook, same model, data and steps."""

from __future__ import annotations

import argparse
from typing import Any

from bindings.json_object import JsonObject
from bindings.spawn import LocalRunError
from optim.apps.benchmarks.ddp_hooks import HookBenchConfig, run_hook_bench
from optim.apps.benchmarks.output import Table, markdown_table
from optim.apps.cli.options import add_gpt_bench_options, densities_arg, run_bench, with_total

__all__ = ["add_hooks_parser", "format_hook_table", "hook_table"]


def hook_table(bench: JsonObject) -> Table:
    """One row per hook: validation loss, training loss, wire bytes per step and step time, each vs plain DDP."""
    rows = tuple(
        (
            r["name"],
            f"{r['val_loss']:.3f}",
            f"{r['val_ratio_to_ddp']:.3f}",
            f"{r['train_loss']:.3f}",
            f"{r['wire_bytes_per_step'] / 1e3:.1f} KB",
            f"{r['wire_ratio_to_ddp']:.4f}",
            f"{r['step_s_median'] * 1e3:.1f}",
            f"{r['step_ratio_to_ddp']:.2f}",
        )
        for r in bench["rows"]
    )
    cols = ("hook", "val loss", "vs DDP", "train loss", "wire / step", "vs DDP", "step ms", "vs DDP")
    return Table(columns=cols, rows=rows, left=frozenset({0}))


def format_hook_table(bench: JsonObject) -> str:
    """:func:`hook_table` in Markdown under two lines saying what was measured."""
    c = bench["config"]
    head = (
        f"# {c['nproc']} gloo ranks, GPT d_model {c['d_model']} x {c['n_layers']} layers, batch {c['batch']} x "
        f"{c['context']} per rank, {c['steps']} steps of AdamW (lr {c['lr']:g}), {c['start_iter']} dense first\n"
        "# wire: bytes one rank sends per compressed step (ring formula); step: median, slowest rank"
    )
    return head + "\n" + markdown_table(hook_table(bench))


def _ranks(text: str) -> tuple[int, ...]:
    try:
        items = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of ranks, got {text!r}") from None
    if any(r < 1 for r in items):
        raise argparse.ArgumentTypeError(f"ranks must be >= 1, got {text!r}")
    return items


def _cmd_hooks(args: argparse.Namespace) -> int:
    try:
        config = HookBenchConfig(
            nproc=args.nproc,
            d_model=args.d_model,
            n_layers=args.layers,
            steps=args.steps,
            start_iter=args.start_iter,
            densities=args.densities,
            powersgd_ranks=args.powersgd_ranks,
            batch=args.batch,
            lr=args.lr,
            seed=args.seed,
            job_timeout_s=args.timeout,
        )
    except ValueError as exc:
        args.cmd_parser.error(str(exc))
    bench = run_bench(
        "hooks", lambda: run_hook_bench(config), with_total(format_hook_table), args.json, (LocalRunError,)
    )
    return 0 if bench is not None else 1


def add_hooks_parser(inner: Any) -> None:
    """Register ``bench hooks``."""
    d = HookBenchConfig()
    p = inner.add_parser(
        "hooks",
        help="DDP comm hooks: plain all-reduce, PowerSGD and sparsecomm's sparse hook (loss, bytes, step time)",
        description="Trains the same GPT under DistributedDataParallel + AdamW with each hook (same init and "
        "batches) and prints validation loss, wire bytes per step and step time, each relative to plain DDP.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_gpt_bench_options(p, d, heads=False, context=False)
    p.add_argument("--steps", type=int, default=d.steps, help="training steps per hook")
    p.add_argument("--start-iter", type=int, default=d.start_iter, help="dense first iterations of every hook")
    p.add_argument("--densities", type=densities_arg, default=d.densities, help="comma list of sparse hook densities")
    p.add_argument("--powersgd-ranks", type=_ranks, default=d.powersgd_ranks, help="comma list of PowerSGD ranks")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of init and batches")
    p.add_argument("--timeout", type=float, default=d.job_timeout_s, help="deadline of the whole job, seconds")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    p.set_defaults(func=_cmd_hooks, cmd_parser=p)
