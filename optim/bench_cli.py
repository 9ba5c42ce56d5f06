"""``sparsecomm bench …``: run a benchmark, print an nccl-tests style table, save JSON."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from bindings.spawn import LocalRunError
from sparsecomm.bench import OPS, CollectivesBenchConfig, run_collectives_bench
from sparsecomm.bench_sparse import bench_pack

__all__ = ["add_bench_parser", "parse_size", "format_collectives_table"]

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


def format_sparse_table(rows: list[dict[str, Any]]) -> str:
    """Render the sparse rows: one line per (op, backend, numel, dtype, density)."""
    head = (
        f"{'op':>14} {'backend':>7} {'ws':>3} {'numel':>10} {'dtype':>8} {'density':>7} "
        f"{'time_us':>10} {'pack_us':>9} {'unpack_us':>9} {'wire_bytes':>11} {'mask_bytes':>10} "
        f"{'mask_enc':>12} {'speedup':>8} {'#wrong':>6}"
    )
    lines = ["# sparse rows: density 1 = the dense collective of the same op (baseline)", head]
    for r in rows:
        lines.append(
            f"{r['op']:>14} {r['backend']:>7} {r['world_size']:>3} {r['numel']:>10} {r['dtype']:>8} "
            f"{r['density']:>7g} {r['time_us']:>10.1f} {r['pack_us']:>9.1f} {r['unpack_us']:>9.1f} "
            f"{r['wire_bytes']:>11} {r['mask_bytes']:>10} {r['mask_encoding']:>12} "
            f"{r['speedup']:>7.2f}x {r['#wrong']:>6}"
        )
    return "\n".join(lines)


def format_collectives_table(rows: list[dict[str, Any]]) -> str:
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
    _write_json(args.json, rows)
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
    _write_json(args.json, rows)
    return 0


def _write_json(path_text: str | None, rows: list[dict[str, Any]]) -> None:
    if not path_text:
        return
    path = Path(path_text)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()}
    path.write_text(json.dumps([{**r, "env": meta} for r in rows], indent=1))
    print(f"wrote {path}")


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
