"""``sparsecomm bench …``: run a benchmark, print an nccl-tests style table, save JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

from bindings.json_object import JsonObject
from bindings.spawn import LocalRunError
from optim.apps.benchmarks.collective_ops import OPS, CollectivesBenchConfig, run_collectives_bench
from optim.apps.benchmarks.optimizer import OptimizerBenchConfig, run_optimizer_bench
from optim.apps.benchmarks.output import bench_env
from optim.apps.benchmarks.sparse_ops import bench_pack
from optim.apps.cli.bench_checkpoint import add_checkpoint_parser
from optim.apps.cli.bench_convergence import (
    add_convergence_parser,
    fmt_bytes,
    format_convergence_table,
    write_convergence_plot,
)
from optim.apps.cli.bench_hooks import add_hooks_parser
from optim.apps.cli.bench_link import add_link_parser
from optim.apps.cli.bench_recovery import add_recovery_parser
from optim.apps.cli.bench_wallclock import add_wallclock_parser
from optim.apps.cli.options import add_gpt_bench_options, densities_arg, run_bench, with_total
from optim.apps.cli.render import add_render_parser

__all__ = [
    "add_bench_parser",
    "parse_size",
    "format_collectives_table",
    "format_convergence_table",
    "format_optimizer_table",
    "write_convergence_plot",
]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}


def parse_size(text: str) -> int:
    """Parse ``"64M"``, ``"1K"``, ``"4096"`` into bytes (powers of 1024)."""
    t = text.strip().upper()
    num = t.rstrip("KMGB")
    unit = t[len(num) :]
    if unit not in _UNITS or not num.isdigit():
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4096, 1K, 64M)")
    return int(num) * _UNITS[unit]


def _csv(choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices)}; got {text!r}")
        return items

    return parse


def format_sparse_table(rows: list[JsonObject]) -> str:
    """Render the sparse rows: one line per (op, backend, numel, dtype, density)."""
    head = (
        f"{'op':>14} {'backend':>7} {'ws':>3} {'numel':>10} {'dtype':>8} {'density':>7} "
        f"{'time_us':>10} {'pack_us':>9} {'unpack_us':>9} {'wire_bytes':>11} {'mask_bytes':>10} "
        f"{'mask_enc':>12} {'speedup':>8} {'#wrong':>6} {'bound_us':>9} {'pack_bd':>8} {'wire_bd':>9} "
        f"{'vs_bound':>8} {'max_spdup':>9}"
    )
    gbps = min((r["mem_GBps"] for r in rows if "mem_GBps" in r), default=float("nan"))
    lines = [
        "# sparse rows: density 1 = the dense collective of the same op (baseline)",
        f"# bounds: memory streaming {gbps:.1f} GB/s (all ranks at once); pack_bd/unpack = bytes touched at that "
        "rate; wire_bd = the dense row's time scaled to the row's wire bytes; bound = pack + wire + unpack bounds; "
        "max_spdup = dense time / bound",
        head,
    ]
    for r in rows:
        lines.append(
            f"{r['op']:>14} {r['backend']:>7} {r['world_size']:>3} {r['numel']:>10} {r['dtype']:>8} "
            f"{r['density']:>7g} {r['time_us']:>10.1f} {r['pack_us']:>9.1f} {r['unpack_us']:>9.1f} "
            f"{r['wire_bytes']:>11} {r['mask_bytes']:>10} {r['mask_encoding']:>12} "
            f"{r['speedup']:>7.2f}x {r['#wrong']:>6} {r['bound_us']:>9.1f} {r['pack_bound_us']:>8.1f} "
            f"{r['wire_bound_us']:>9.1f} {r['time_us'] / r['bound_us'] if r['bound_us'] else 0.0:>7.2f}x "
            f"{r['speedup_bound']:>8.2f}x"
        )
    return "\n".join(lines)


def format_collectives_table(rows: list[JsonObject]) -> str:
    """Render rows in the nccl-tests layout, with our impl and overhead columns."""
    head = (
        f"{'op':>14} {'backend':>7} {'impl':>17} {'size':>10} {'count':>10} {'type':>8} "
        f"{'redop':>5} {'time(us)':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} {'overhead':>8}"
    )
    lines = [
        f"# nranks {rows[0]['nranks'] if rows else '-'}; time = median of iterations, max over ranks; bw in GB/s",
        head,
    ]
    for r in rows:
        ov = r.get("overhead_pct")
        lines.append(
            f"{r['op']:>14} {r['backend']:>7} {r['impl']:>17} {r['size']:>10} {r['count']:>10} "
            f"{r['type']:>8} {r['redop']:>5} {r['time_us']:>10.1f} {r['algbw']:>7.3f} "
            f"{r['busbw']:>7.3f} {r['#wrong']:>6} {'' if ov is None else f'{ov:+.1f}%':>8}"
        )
    return "\n".join(lines)


def _cmd_collectives(args: argparse.Namespace) -> int:
    try:
        config = CollectivesBenchConfig(
            backends=args.backend,
            nproc=args.nproc,
            ops=args.ops,
            dtypes=args.dtype,
            min_bytes=args.min_bytes,
            max_bytes=args.max_bytes,
            factor=args.factor,
            warmup=args.warmup,
            iters=args.iters,
            check_collectives=args.check_collectives,
            dense=not args.sparse_only,
            sparse=args.sparse or args.sparse_only,
            sparse_numels=tuple(args.numel),
            densities=tuple(args.density),
            sparse_dtypes=args.sparse_dtype,
        )
    except ValueError as exc:
        args.cmd_parser.error(str(exc))
    try:
        rows = run_collectives_bench(config)
    except (LocalRunError, RuntimeError) as exc:
        print(f"sparsecomm bench: error: {exc}", file=sys.stderr)
        return 1
    dense_rows = [r for r in rows if r["kind"] == "dense"]
    sparse_rows = [r for r in rows if r["kind"] == "sparse"]
    if dense_rows:
        print(format_collectives_table(dense_rows))
    if sparse_rows:
        print(format_sparse_table(sparse_rows))
    _write_json(args.json, rows, dataclasses.asdict(config))
    wrong = sum(r["#wrong"] for r in rows)
    if wrong:
        print(f"sparsecomm bench: {wrong} wrong elements", file=sys.stderr)
        return 2
    return 0


def _cmd_pack(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        args.cmd_parser.error("--device cuda: no CUDA device here")
    rows = bench_pack(device=device, numel=args.numel, densities=tuple(args.density), dtypes=args.dtype)
    print(f"# pack/unpack kernels on {device}; best of 10; * = the kernel sparsecomm picks")
    print(
        f"{'kernel':>10} {'dtype':>8} {'numel':>10} {'density':>7} {'k':>9} {'pack_us':>9} {'unpack_us':>9} {'GB/s':>7}"
    )
    for r in rows:
        mark = "*" if r["chosen"] else " "
        print(
            f"{r['kernel']:>9}{mark} {r['dtype']:>8} {r['numel']:>10} {r['density']:>7g} {r['k']:>9} "
            f"{r['pack_us']:>9.1f} {r['unpack_us']:>9.1f} {r['GBps']:>7.2f}"
        )
    config = {"device": str(device), "numel": args.numel, "densities": list(args.density), "dtypes": list(args.dtype)}
    _write_json(args.json, rows, config)
    return 0


def _write_json(path_text: str | None, rows: list[JsonObject], config: JsonObject) -> None:
    """Write ``rows`` as a JSON list, each row with the run's environment (commit included) and resolved config."""
    if not path_text:
        return
    path = Path(path_text)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = bench_env()
    path.write_text(json.dumps([{**r, "env": meta, "config": config} for r in rows], indent=1, default=str))
    print(f"wrote {path}")


def format_optimizer_table(bench: JsonObject) -> str:
    """Render one line per optimizer: params, state/rank, wire bytes/step, step and opt.step times, speedup."""
    c = bench["config"]
    head = (
        f"{'optimizer':>17} {'params':>10} {'state_MB/rank':>13} {'state/master':>12} {'wire_B/step':>12} "
        f"{'wire/step':>9} {'step_ms':>8} {'opt.step_ms':>11} {'fwd+bwd_ms':>10} {'opt/fwdbwd':>10} "
        f"{'speedup':>8} {'opt_speedup':>11}"
    )
    lines = [
        f"# nranks {bench['world_size']} (gloo, local); GPT d_model {c['d_model']} x {c['n_layers']} layers, "
        f"context {c['context']}, batch {c['batch']}/rank; {c['warmup']} warm-up + {c['steps']} timed steps; "
        f"SCAPE warm-up {c['scape_warmup_steps']}, mask delay {c['mask_delay']} (every timed SCAPE step sparse)",
        "# time = median over timed steps, max over ranks; wire = bytes rank 0 sent per timed step; "
        "state = optimizer memory per rank beside the parameters (master shard where it is a copy, m (+ v), "
        "residuals), max over ranks, and its ratio to one fp32 copy of the model; "
        "speedup = ShardedAdamS time / row time",
        "# bound: opt/fwdbwd = opt.step time / the same row's forward + backward (what a step that hides "
        "under compute is measured against); /inline = SCAPE with its next mask piece built inside opt.step(); "
        "local = LocalAdamS with its defaults (state: full-size m, normalizer and anchor, the code residual of its "
        "shard; at 0.1 the first moment's anchor and residual too), /overlap with overlap=True, /lean with the "
        "normalizer in bfloat16; local-adamw / coded-adamw = torch AdamW inside LocalOptimizer / CodedGradients; "
        "demo-sgd = torch SGD inside DeMo (state: its momentum)",
        head,
    ]
    for r in bench["rows"]:
        lines.append(
            f"{r['name']:>17} {r['num_parameters']:>10} {r['state_bytes_max'] / 1e6:>13.2f} "
            f"{r['state_to_full_master']:>12.3f} {r['wire_bytes_per_step']:>12.0f} "
            f"{fmt_bytes(r['wire_bytes_per_step']):>9} {r['step_ms']:>8.1f} {r['opt_step_ms']:>11.1f} "
            f"{r['fwd_bwd_ms']:>10.1f} {r['opt_step_ms'] / r['fwd_bwd_ms']:>9.2f}x "
            f"{r['speedup']:>7.2f}x {r['opt_step_speedup']:>10.2f}x"
        )
    return "\n".join(lines)


def _cmd_optimizer(args: argparse.Namespace) -> int:
    try:
        config = OptimizerBenchConfig(
            nproc=args.nproc,
            d_model=args.d_model,
            n_layers=args.layers,
            n_heads=args.heads,
            batch=args.batch,
            context=args.context,
            steps=args.steps,
            warmup=args.warmup,
            densities=args.densities,
            inline_rows=args.inline_rows,
            local_rows=args.local_rows,
            local_variant_rows=args.local_variant_rows,
            local_adamw_rows=args.local_adamw_rows,
            coded_rows=args.coded_rows,
            demo_rows=args.demo_rows,
            scape_warmup_steps=args.scape_warmup_steps,
            mask_delay=args.mask_delay,
            seed=args.seed,
            threads=args.threads,
            job_timeout_s=args.timeout,
        )
    except ValueError as exc:
        args.cmd_parser.error(str(exc))
    bench = run_bench(
        "optimizer",
        lambda: run_optimizer_bench(config),
        with_total(format_optimizer_table),
        args.json,
        (LocalRunError, RuntimeError),
    )
    return 0 if bench is not None else 1


def _add_optimizer_parser(inner: Any) -> None:
    d = OptimizerBenchConfig()
    p = inner.add_parser(
        "optimizer",
        help="step time, opt.step() time, state memory and wire bytes of ShardedAdamW, ShardedAdamS, SCAPE, LocalAdamS",
        description="Times forward + backward + opt.step() of the training job's GPT with ShardedAdamW, "
        "ShardedAdamS, SCAPE and LocalAdamS at each density on local gloo ranks, in one run; prints a table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_gpt_bench_options(p, d)
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per optimizer")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps per optimizer")
    p.add_argument(
        "--densities",
        type=densities_arg,
        default=d.densities,
        help="comma list of SCAPE densities (default " + ",".join(f"{x:g}" for x in d.densities) + ")",
    )
    p.add_argument(
        "--inline-rows",
        action=argparse.BooleanOptionalAction,
        default=d.inline_rows,
        help="also time each SCAPE density with its next mask piece built inside opt.step()",
    )
    p.add_argument(
        "--local-rows",
        action=argparse.BooleanOptionalAction,
        default=d.local_rows,
        help="also time LocalAdamS (its defaults) at each density",
    )
    p.add_argument(
        "--local-variant-rows",
        action=argparse.BooleanOptionalAction,
        default=d.local_variant_rows,
        help="with --local-rows, also time LocalAdamS with overlap=True and with a bfloat16 normalizer EMA",
    )
    p.add_argument(
        "--local-adamw-rows",
        action=argparse.BooleanOptionalAction,
        default=d.local_adamw_rows,
        help="also time torch.optim.AdamW wrapped by LocalOptimizer (local-adamw) at each density",
    )
    p.add_argument(
        "--coded-rows",
        action=argparse.BooleanOptionalAction,
        default=d.coded_rows,
        help="also time torch.optim.AdamW inside CodedGradients (coded-adamw) at each density its codes fit",
    )
    p.add_argument(
        "--demo-rows",
        action=argparse.BooleanOptionalAction,
        default=d.demo_rows,
        help="also time torch.optim.SGD inside DeMo (demo-sgd) at each density its plan fits",
    )
    p.add_argument("--scape-warmup-steps", type=int, default=d.scape_warmup_steps, help="SCAPE: dense steps first")
    p.add_argument("--mask-delay", type=int, default=d.mask_delay, help="SCAPE: mask delay D")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of init and tokens")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=d.job_timeout_s, help="deadline of the whole job, seconds")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    p.set_defaults(func=_cmd_optimizer, cmd_parser=p)


def add_bench_parser(subparsers: Any) -> None:
    """Register ``bench`` and its sub-subcommands."""
    bench = subparsers.add_parser("bench", help="run a benchmark")
    inner = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    p = inner.add_parser(
        "collectives",
        help="dense all_reduce / reduce_scatter / all_gather, ours vs the raw transport",
        description="nccl-tests style sweep; our layer and the raw transport are timed in the same run.",
    )
    p.add_argument(
        "--backend", type=_csv(("gloo", "mpi")), default=("gloo", "mpi"), help="comma list (default gloo,mpi)"
    )
    p.add_argument("--nproc", type=int, default=4, help="local ranks (default 4)")
    p.add_argument("--ops", type=_csv(OPS), default=OPS, help="comma list of collectives")
    p.add_argument("--dtype", type=_csv(("float32", "bfloat16", "float16", "float64")), default=("float32",))
    p.add_argument("-b", "--min-bytes", type=parse_size, default=parse_size("1K"), help="smallest size (default 1K)")
    p.add_argument("-e", "--max-bytes", type=parse_size, default=parse_size("64M"), help="largest size (default 64M)")
    p.add_argument("-f", "--factor", type=int, default=4, help="size factor (default 4)")
    p.add_argument("-w", "--warmup", type=int, default=3, help="warm-up calls (default 3)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed calls (default 20)")
    p.add_argument("--check-collectives", action="store_true", help="time our layer with the metadata check on")
    p.add_argument("--sparse", action="store_true", help="add the sparse rows (densities x dtypes)")
    p.add_argument("--sparse-only", action="store_true", help="only the sparse rows")
    p.add_argument("--numel", type=int, nargs="+", default=[1 << 24], help="sparse buffer sizes (default 16M)")
    p.add_argument(
        "--density",
        type=float,
        nargs="+",
        default=[1.0, 0.1, 0.01, 0.001],
        help="sparse densities; 1 = the dense baseline (default 1 0.1 0.01 0.001)",
    )
    p.add_argument(
        "--sparse-dtype",
        type=_csv(("float32", "bfloat16", "float16", "float64")),
        default=("float32", "bfloat16"),
        help="sparse value types (default float32,bfloat16)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the rows as a JSON list")
    p.set_defaults(func=_cmd_collectives, cmd_parser=p)

    q = inner.add_parser("pack", help="pack / unpack kernel times on one device (no communication)")
    q.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    q.add_argument("--numel", type=int, default=1 << 24, help="buffer size (default 16M)")
    q.add_argument("--density", type=float, nargs="+", default=[0.1, 0.01, 0.001])
    q.add_argument("--dtype", type=_csv(("float32", "bfloat16", "float16", "float64")), default=("float32", "bfloat16"))
    q.add_argument("--json", metavar="FILE", help="also write the rows as a JSON list")
    q.set_defaults(func=_cmd_pack, cmd_parser=q)

    add_convergence_parser(inner)
    _add_optimizer_parser(inner)
    add_recovery_parser(inner)
    add_checkpoint_parser(inner)
    add_hooks_parser(inner)
    add_link_parser(inner)
    add_wallclock_parser(inner)
    add_render_parser(inner)
