"""``sparsecomm bench checkpoint --persistent``: the persistent checkpoint benchmark's options, table and JSON."""

from __future__ import annotations

import argparse

from bindings.json_object import JsonObject
from bindings.spawn import LocalRunError
from optim.apps.benchmarks.persist import PersistBenchConfig, run_persist_bench
from optim.apps.cli.options import densities_arg, or_dash, run_bench

__all__ = ["add_persist_arguments", "format_persist_table", "run_persist_command"]


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:+.2f}%"


def format_persist_table(bench: JsonObject) -> str:
    """One row per optimizer: bytes per file (full, delta), per checkpoint, write / restore times, overhead."""
    c = bench["config"]
    lines = [
        f"# persistent checkpoints: {c['nproc']} ranks (gloo, local), model d{c['d_model']} x {c['n_layers']} "
        f"layers, {c['steps']} steps, a checkpoint every {c['every']} steps, a full file at least every "
        f"{c['full_every']} checkpoints of a slot, deltas between (lossless)",
        "# full_KB / delta_KB: median bytes of one slot's file; ratio = full / delta; per_ckpt_KB: bytes written "
        "per checkpoint (all slots) / the same if every file were full",
        "# write_ms: one slot file encoded + written + fsync-ed on a worker's writer thread (nice 19: wall time "
        "while the ranks keep the cores; median); "
        "restore_ms: the "
        "newest step read back, its chain of deltas applied and decoded (worst slot; chain = files read)",
        f"# overhead: mean step time with checkpoints / without - 1 (two runs, steps > {c['skip_steps']}); "
        "in-run: steps that overlap a write vs the others, spread over the period; same_losses: the two runs' "
        "losses bit-identical",
        f"{'optimizer':>11} {'full_KB':>9} {'delta_KB':>9} {'ratio':>6} {'per_ckpt_KB':>19} {'write_full':>10} "
        f"{'write_delta':>11} {'restore':>8} {'chain':>5} {'restore_full':>12} {'step_ms':>8} {'overhead':>9} "
        f"{'in-run':>8} {'same_losses':>11}",
    ]
    for r in bench["rows"]:
        bf, bd = r["bytes_full"], r["bytes_delta"]
        per = f"{r['bytes_per_checkpoint'] / 1e3:.0f} / {r['bytes_per_checkpoint_all_full'] / 1e3:.0f}"
        lines.append(
            f"{r['name']:>11} {or_dash(None if bf is None else bf / 1e3, '.0f'):>9} "
            f"{or_dash(None if bd is None else bd / 1e3, '.1f'):>9} {or_dash(r['delta_ratio'], '.1f'):>6} {per:>19} "
            f"{or_dash(r['write_ms_full'], '.1f'):>10} {or_dash(r['write_ms_delta'], '.1f'):>11} "
            f"{r['restore_ms']:>8.1f} "
            f"{r['chain_files']:>5} {r['restore_ms_full']:>12.1f} {r['step_ms_without']:>8.1f} "
            f"{_pct(r['overhead_fraction']):>9} {_pct(r['overhead_in_run']):>8} {str(r['losses_agree']):>11}"
        )
    lossy = [r for r in bench["rows"] if "bytes_lossy" in r]
    if lossy:
        lines += [
            "",
            "# lossy checkpoints (--lossy-checkpoints): full files keep the first moment in bfloat16, deltas stay "
            "lossless; lossy_KB: median lossy full file (vs full_KB above); per_ckpt_KB: bytes per checkpoint",
            f"# val_loss after resuming from the newest checkpoint (step {c['steps'] - c['steps'] % c['every']}) "
            f"and training {c['resume_steps']} more steps, {c['eval_batches']} validation batches: from the lossless "
            "checkpoint (= the uninterrupted run) and from the lossy one",
            f"{'optimizer':>11} {'full_KB':>9} {'lossy_KB':>9} {'saved%':>6} {'per_ckpt_KB':>11} "
            f"{'val_lossless':>12} {'val_lossy':>10} {'ratio':>8}",
        ]
        for r in lossy:
            bf, bl = r["bytes_full"], r["bytes_lossy"]
            saved = None if bf is None or bl is None else 100 * (1 - bl / bf)
            lines.append(
                f"{r['name']:>11} {or_dash(None if bf is None else bf / 1e3, '.0f'):>9} "
                f"{or_dash(None if bl is None else bl / 1e3, '.0f'):>9} {or_dash(saved, '.1f'):>6} "
                f"{r['bytes_per_checkpoint_lossy'] / 1e3:>11.0f} {r['val_loss_lossless']:>12.4f} "
                f"{r['val_loss_lossy']:>10.4f} {r['val_loss_ratio']:>8.5f}"
            )
    return "\n".join(lines)


def add_persist_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the persistent part (only read with ``--persistent``)."""
    d = PersistBenchConfig()
    g = p.add_argument_group("persistent checkpoints (--persistent)")
    g.add_argument(
        "--persistent",
        action="store_true",
        help="measure persistent checkpoints (bytes full / delta, write, restore, overhead) instead",
    )
    g.add_argument("--densities", type=densities_arg, default=",".join(f"{x:g}" for x in d.densities))
    g.add_argument("--no-dense", action="store_true", help="leave out the dense ShardedAdamS row")
    g.add_argument("--d-model", type=int, default=d.d_model)
    g.add_argument("--layers", type=int, default=d.n_layers)
    g.add_argument("--steps", type=int, default=d.steps)
    g.add_argument("--every", type=int, default=d.every, help="steps between checkpoints")
    g.add_argument("--full-every", type=int, default=d.full_every, help="a full file at least every M checkpoints")
    g.add_argument("--no-lossy", action="store_true", help="leave out the lossy checkpoints and their resumes")
    g.add_argument("--resume-steps", type=int, default=d.resume_steps, help="steps the resumed runs train on")


def run_persist_command(args: argparse.Namespace) -> int:
    """``bench checkpoint --persistent``."""
    try:
        config = PersistBenchConfig(
            densities=tuple(args.densities),
            dense=not args.no_dense,
            d_model=args.d_model,
            n_layers=args.layers,
            steps=args.steps,
            every=args.every,
            full_every=args.full_every,
            lossy=not args.no_lossy,
            resume_steps=args.resume_steps,
            nproc=args.nproc,
            threads=args.threads,
            timeout_s=args.timeout,
            out=args.out + "_persist",
        )
    except ValueError as exc:
        args.cmd_parser.error(str(exc))

    def progress(row: JsonObject) -> None:
        print(
            f"  {row['name']}: full {or_dash(row['bytes_full'], '.0f')} B, "
            f"delta {or_dash(row['bytes_delta'], '.0f')} B, "
            f"overhead {_pct(row['overhead_fraction'])}",
            flush=True,
        )

    bench = run_bench(
        "checkpoint",
        lambda: run_persist_bench(config, on_row=progress),
        format_persist_table,
        args.json,
        (RuntimeError, LocalRunError),
    )
    return 0 if bench is not None else 1
