"""``sparsecomm bench convergence``: one setting with every optimizer, or the convergence suite (``--suite``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bindings.json_object import JsonObject
from bindings.spawn import LocalRunError
from optim.apps.benchmarks.convergence import DEFAULT_DENSITIES, METHODS, REUSE, run_convergence
from optim.apps.benchmarks.output import write_bench_json
from optim.apps.benchmarks.suite import HELDOUT_SEEDS, HORIZONS, SETTINGS, SPLITS
from optim.apps.cli.options import add_model_options, add_scape_options, densities_arg, model_settings, scape_settings
from optim.apps.train_job.job_config import TrainConfig

__all__ = ["add_convergence_parser", "fmt_bytes", "format_convergence_table", "write_convergence_plot"]


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def format_convergence_table(bench: JsonObject) -> str:
    """Render one line per run: final val loss, ratio to AdamS, wire bytes/step, step time, loss rise.

    ``wire/step`` is rank 0's mean sent bytes over all steps (dense warm-up included, plus the
    loss all-reduce), ``opt_wire/step`` the same without the loss all-reduce, ``sparse/step``
    the mean over SCAPE's sparse steps only.
    """
    head = (
        f"{'run':>12} {'final_val':>9} {'vs_adams':>8} {'wire/step':>10} {'opt_wire/step':>13} "
        f"{'sparse/step':>11} {'step_ms':>8} {'max_rise':>8} {'@step':>6} {'target':>8}"
    )
    lines = [head]
    for r in bench["runs"]:
        t = bench["targets"].get(r["name"])
        mark = "" if t is None else f"{'ok' if t['met'] else 'MISS'}<={t['max_ratio']:g}"
        at = "-" if r["largest_loss_rise_step"] is None else str(r["largest_loss_rise_step"])
        sp = "-" if r["sparse_step_wire_bytes"] is None else fmt_bytes(r["sparse_step_wire_bytes"])
        lines.append(
            f"{r['name']:>12} {r['final_val_loss']:>9.4f} {r['ratio_to_adams']:>8.4f} "
            f"{fmt_bytes(r['wire_bytes_per_step']):>10} {fmt_bytes(r['optimizer_wire_bytes_per_step']):>13} "
            f"{sp:>11} {r['mean_step_time_s'] * 1e3:>8.1f} {r['largest_loss_rise']:>8.3f} {at:>6} {mark:>8}"
        )
    return "\n".join(lines)


def write_convergence_plot(bench: JsonObject, path: str | Path) -> Path:
    """Draw every run's validation loss against step into a PNG (matplotlib, Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.8), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r in bench["runs"]:
        evals = r["evals"]
        label = f"{r['name']} (final {r['final_val_loss']:.3f}, x{r['ratio_to_adams']:.3f} AdamS)"
        ax.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o-", ms=3, lw=1.4, label=label)
    base = bench["base_config"]
    ax.set_title(
        f"validation loss, {base['nproc']} ranks, {base['steps']} steps, seed {base['seed']}, "
        f"d_model {base['d_model']} x {base['n_layers']} layers",
        fontsize=10,
    )
    finals = [r["final_val_loss"] for r in bench["runs"]]
    lo, hi = min(finals), max(max(finals), min(r["initial_val_loss"] for r in bench["runs"]))
    ax.set_ylim(lo - 0.1 * (hi - lo) - 0.05, hi + 0.05 * (hi - lo) + 0.05)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    return out


def _cmd_suite(args: argparse.Namespace) -> int:
    from optim.apps.benchmarks.suite import run_suite
    from optim.apps.benchmarks.suite_report import format_suite_table, format_worst_table, write_suite_plot

    def progress(setting: str, steps: int, r: JsonObject) -> None:
        print(
            f"{setting} ({steps} steps) {r['name']}: final validation loss {r['final_val_loss']:.4f}, "
            f"{r['wall_time_s']:.0f} s",
            flush=True,
        )

    overrides: JsonObject = {"nproc": args.nproc, "job_timeout_s": args.timeout}
    out = Path(args.out)
    try:
        suite = run_suite(
            args.settings,
            split=args.split,
            horizons=args.horizons,
            densities=args.densities,
            methods=args.methods,
            seeds=args.seeds if args.seeds is not None or args.split != "tuning" else (args.seed,),
            overrides=overrides,
            on_run=progress,
            runs_dir=out / "runs",
            reuse=args.reuse_runs,
        )
    except ValueError as exc:
        args.cmd_parser.error(str(exc))
    except LocalRunError as exc:
        print(f"sparsecomm bench convergence: error: {exc}", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    json_path = write_bench_json(out / "suite.json", suite)
    png_path = write_suite_plot(suite, out / "suite.png")
    seeds = "; ".join(f"{sp} seeds {','.join(map(str, xs))}" for sp, xs in suite["split_seeds"].items())
    text = "\n".join(
        [
            f"# {args.nproc} ranks, {suite['split']} split; validation loss / dense ShardedAdamS, same seeds and "
            f"data order per setting; {seeds} (cells: ratio of the mean over the seeds)",
            format_suite_table(suite),
            "# validation loss / the better of dense AdamS and dense AdamW (column best)",
            format_suite_table(suite, against="best"),
            "# worst case over the suite",
            format_worst_table(suite),
        ]
    )
    (out / "suite.txt").write_text(text + "\n")
    print(text)
    print(f"total {suite['wall_time_s']:.0f} s; wrote {json_path}, {png_path}, {out / 'suite.txt'}, {out / 'runs'}/")
    return 0


def _cmd_convergence(args: argparse.Namespace) -> int:
    if args.suite:
        return _cmd_suite(args)
    try:
        base = TrainConfig(
            steps=args.steps,
            nproc=args.nproc,
            seed=args.seed,
            **model_settings(args),
            **scape_settings(args),
            max_corpus_bytes=args.max_corpus_bytes,
            data=args.data,
            job_timeout_s=args.timeout,
            out=args.out,
        )
    except ValueError as exc:
        args.cmd_parser.error(str(exc))
    if args.data is not None and not Path(args.data).is_file():
        args.cmd_parser.error(f"--data: file not found: {args.data}")

    def progress(r: JsonObject) -> None:
        print(
            f"{r['name']}: final validation loss {r['final_val_loss']:.4f}, "
            f"{r['mean_step_time_s'] * 1e3:.0f} ms/step, {r['wall_time_s']:.0f} s",
            flush=True,
        )

    try:
        bench = run_convergence(base, args.densities, methods=args.methods, on_run=progress)
    except LocalRunError as exc:
        print(f"sparsecomm bench convergence: error: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = write_bench_json(out / "convergence.json", bench)
    png_path = write_convergence_plot(bench, out / "convergence.png")
    print(f"# {base.nproc} ranks, {base.steps} steps, same seed and data order; ratios to dense ShardedAdamS")
    print(format_convergence_table(bench))
    print(f"total {bench['wall_time_s']:.0f} s; wrote {json_path}, {png_path}")
    return 0


def add_convergence_parser(inner: Any) -> None:
    d = TrainConfig()
    p = inner.add_parser(
        "convergence",
        help="train with ShardedAdamW, ShardedAdamS and SCAPE at several densities; compare losses",
        description="Runs the training job (same seed and data order) with ShardedAdamW, ShardedAdamS and "
        "SCAPE at each density; writes OUT/convergence.json and OUT/convergence.png and prints a table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps per run")
    p.add_argument("--out", metavar="DIR", default="runs/convergence", help="output directory")
    p.add_argument(
        "--densities",
        type=densities_arg,
        default=DEFAULT_DENSITIES,
        help="comma list of SCAPE densities (default " + ",".join(f"{x:g}" for x in DEFAULT_DENSITIES) + ")",
    )
    p.add_argument("--nproc", type=int, default=d.nproc, help="local ranks")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of init and data order")
    add_model_options(p, d)
    add_scape_options(p, d)
    p.add_argument("--max-corpus-bytes", type=int, default=d.max_corpus_bytes, help="size cap of the corpus")
    p.add_argument("--data", metavar="FILE", default=None, help="text file to train on")
    p.add_argument("--timeout", type=float, default=d.job_timeout_s, help="deadline of each run, seconds")
    p.add_argument(
        "--methods",
        type=_names(METHODS),
        default=("scape",),
        help="comma list of sparse methods, each run at every density: " + ", ".join(METHODS),
    )
    p.add_argument(
        "--suite",
        action="store_true",
        help="run the convergence suite (every setting of a split of optim.apps.benchmarks.suite_settings at every "
        "horizon) instead of one setting; model, schedule and corpus options are then the settings' own. Writes "
        "OUT/suite.json, OUT/suite.txt and OUT/suite.png",
    )
    p.add_argument(
        "--reuse-runs",
        choices=REUSE,
        default="commit",
        help="suite: take a run from OUT/runs/ when its file was written at this commit (commit), at any commit "
        "(any: runs whose code did not change, e.g. the dense references), or train every run again (none)",
    )
    p.add_argument(
        "--split",
        choices=tuple(SPLITS),
        default="tuning",
        help="suite: the settings every default was tuned on (tuning), the ones held out from tuning (heldout), "
        "or both (all); defaults are chosen on the tuning split only",
    )
    p.add_argument(
        "--settings",
        type=_names(tuple(SETTINGS)),
        default=None,
        help="suite: comma list of settings of the split (default: all of it)",
    )
    p.add_argument(
        "--horizons",
        type=_ints,
        default=None,
        help="suite: comma list of step counts to judge every setting at (default: "
        + ",".join(map(str, HORIZONS))
        + ", or a setting's own)",
    )
    p.add_argument(
        "--seeds",
        type=_seeds,
        default=None,
        help="suite: comma list of seeds; each setting runs once per seed and is judged on the mean (default: "
        "--seed on the tuning split; " + ",".join(map(str, HELDOUT_SEEDS)) + " on held-out settings; with all, "
        "each split's own: 0 and the held-out seeds)",
    )
    p.set_defaults(func=_cmd_convergence, cmd_parser=p)


def _names(known: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in known]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(known)}; got {text!r}")
        return items

    return parse


def _ints(text: str, least: int = 1) -> tuple[int, ...]:
    try:
        items = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    if not items or any(x < least for x in items):
        raise argparse.ArgumentTypeError(f"expected integers >= {least}, got {text!r}")
    return items


def _seeds(text: str) -> tuple[int, ...]:
    return _ints(text, least=0)  # distinct: run_suite says so
