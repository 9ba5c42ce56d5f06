"""``sparsecomm bench wallclock``: time to a target loss per method over rate-limited links (cells, resumable)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bindings.json_object import JsonObject
from optim.apps.benchmarks.output import Table, text_table
from optim.apps.benchmarks.wallclock import METHODS, WallclockConfig, run_wallclock_bench
from optim.apps.cli.options import run_bench

__all__ = ["add_wallclock_parser", "format_wallclock_table", "wallclock_table", "write_wallclock_plots"]


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _rate(rate: str) -> str:
    return "unshaped" if rate == "none" else rate


def wallclock_table(bench: JsonObject, *, rate: str | None = None) -> Table:
    """One row per cell, or per cell over link ``rate`` (no link column then): times, bytes, loss, ratios to dense."""
    cols = ("method", "seed", "step (ms)", "wait (ms)", "MB/step", "final val loss", "to target (s)", "x dense")
    rows = []
    for r in bench["rows"]:
        if rate is not None and r["link_rate"] != rate:
            continue
        cells = (
            r["method"],
            str(r["seed"]),
            f"{r['step_s'] * 1e3:.0f}",
            _f(None if r["wait_s"] is None else r["wait_s"] * 1e3, ".0f"),
            f"{r['bytes_per_step'] / 1e6:.3f}",
            f"{r['final_val_loss']:.4f}" if rate is None else f"{r['final_val_loss']:.3f}",
            _f(r["time_to_target_s"], ".1f"),
            _f(r["speedup_vs_dense"], ".2f"),
            _f(r["step_speedup_vs_dense"], ".2f"),
        )
        rows.append(cells if rate is not None else (r["link_rate"], *cells))
    columns = (*cols, "step x") if rate is not None else ("link", *cols, "step x")
    return Table(columns=columns, rows=tuple(rows), left=frozenset({0} if rate is not None else {0, 1}))


def format_wallclock_table(bench: JsonObject) -> str:
    """One row per cell: step time, network wait, bytes, final loss, time to the target and the ratios to dense."""
    cfg = bench["config"]
    rows = bench["rows"]
    params = rows[0]["num_parameters"] if rows else "?"
    head = (
        f"# {cfg['hosts']} hosts, one rank each ({bench['cpus']} CPUs in all), GPT {params} parameters "
        f"(d_model {cfg['d_model']} x {cfg['n_layers']}), batch {cfg['batch']} x {cfg['context']} per rank, "
        f"{cfg['steps']} steps; target: dense AdamS's validation loss at step {cfg['target_step']}; "
        "times are training seconds (evaluations left out)"
    )
    lines = [head]
    for rate, link in sorted(bench["links"].items()):
        lines.append(
            f"# link {rate}: TCP {link['tcp_gbps']:.3f} Gbit/s measured, dense all_reduce of "
            f"{link['allreduce_bytes'] >> 20} MiB {link['allreduce_s']:.3f} s "
            f"(busbw {link['allreduce_busbw_gbps']:.3f} Gbit/s)"
        )
    lines.append(text_table(wallclock_table(bench), width=16))
    lines.append("# wins from which link rate: the fastest link at which a method reached the target sooner than dense")
    for method, win in bench.get("wins", {}).items():
        ratios = ", ".join(f"{_rate(rate)} {_f(x, '.2f')}x" for rate, x in win["speedup_by_rate"].items())
        fastest = win["wins_up_to"]
        lines.append(f"#   {method}: {'at no rate measured' if fastest is None else _rate(fastest)} ({ratios})")
    return "\n".join(lines)


def write_wallclock_plots(bench: JsonObject, path: str | Path) -> Path:
    """Validation loss against training time, one panel per link rate, into a PNG (matplotlib, Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rates = sorted({r["link_rate"] for r in bench["rows"]})
    fig = Figure(figsize=(5.2 * max(1, len(rates)), 4.4), dpi=110)
    FigureCanvasAgg(fig)
    for i, rate in enumerate(rates):
        ax = fig.add_subplot(1, len(rates), i + 1)
        for r in (r for r in bench["rows"] if r["link_rate"] == rate):
            times, losses = [c[1] for c in r["curve"]], [c[2] for c in r["curve"]]
            ax.plot(times, losses, "o-", ms=2, lw=1.2, label=f"{r['method']} s{r['seed']}")
            if r["target_loss"] is not None and r["method"] == "adams":
                ax.axhline(r["target_loss"], color="grey", lw=0.8, ls="--")
        link = bench["links"].get(rate)
        measured = f" ({link['tcp_gbps']:.2f} Gbit/s measured)" if link else ""
        ax.set_title(f"link {_rate(rate)}{measured}", fontsize=10)
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _cmd_wallclock(args: argparse.Namespace) -> int:
    try:
        config = WallclockConfig(
            methods=args.methods,
            link_rates=args.link_rate,
            seeds=tuple(int(s) for s in args.seeds),
            hosts=args.hosts,
            steps=args.steps,
            target_step=args.target_step if args.target_step is not None else args.steps,
            eval_interval=args.eval_interval,
            d_model=args.d_model,
            n_layers=args.layers,
            batch=args.batch,
            context=args.context,
        )
    except (TypeError, ValueError) as exc:
        args.cmd_parser.error(str(exc))

    def progress(name: str, cell: JsonObject | None) -> None:
        if cell is None:
            print(f"  {name}: already done", flush=True)
        else:
            print(f"  {name}: {cell['wall_s']:.0f} s", flush=True)

    bench = run_bench(
        "wallclock",
        lambda: run_wallclock_bench(config, Path(args.out), on_cell=progress),
        format_wallclock_table,
        args.json,
    )
    if bench is not None and args.plot:
        print(f"wrote {write_wallclock_plots(bench, args.plot)}")
    return 0 if bench is not None else 1


def add_wallclock_parser(inner: Any) -> None:
    """Register ``bench wallclock``."""
    d = WallclockConfig()
    p = inner.add_parser(
        "wallclock",
        help="time to a target loss per method over rate-limited links (root: network namespaces and tc)",
        description="The train job with one rank per host (network namespaces on this machine) over links shaped "
        "to each rate. Each cell (rate, method, seed) writes OUT/CELL.json; a rerun skips finished cells.",
    )
    p.add_argument("--out", required=True, help="directory of the cell files (a rerun resumes there)")
    p.add_argument("--methods", type=_csv, default=d.methods, help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--link-rate", type=_csv, default=d.link_rates, help="comma list of tc rates or none")
    p.add_argument("--seeds", type=_csv, default=tuple(str(s) for s in d.seeds), help="comma list of seeds")
    p.add_argument("--hosts", type=int, default=d.hosts, help="hosts, one rank each (default 2)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--target-step", type=int, help="the target is dense AdamS's loss here (default: --steps)")
    p.add_argument("--eval-interval", type=int, default=d.eval_interval)
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--layers", type=int, default=d.n_layers)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--context", type=int, default=d.context)
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--plot", help="write validation loss against time (one panel per link rate) to this PNG")
    p.set_defaults(func=_cmd_wallclock, cmd_parser=p)
