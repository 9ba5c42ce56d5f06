"""``sparsecomm bench link``: what a shaped link between two hosts delivers (TCP and a gloo all_reduce)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from bindings.json_object import JsonObject
from optim.apps.benchmarks.links import LinkBenchConfig, run_link_bench
from optim.apps.benchmarks.output import Table, text_table
from optim.apps.cli.options import run_bench

__all__ = ["add_link_parser", "format_link_table", "link_table"]


def link_table(bench: JsonObject) -> Table:
    """One row per link rate: set rate, TCP payload rate, and the dense all_reduce's time and bus bandwidth."""
    rows = []
    for row in bench["rows"]:
        set_gbps = row["set_gbps"]
        rows.append(
            (
                row["link_rate"],
                "-" if set_gbps is None else f"{set_gbps:.3f}",
                f"{row['tcp_gbps']:.3f}",
                "-" if set_gbps is None else f"{row['tcp_gbps'] / set_gbps:.2f}",
                f"{row['allreduce_s']:.3f}",
                f"{row['allreduce_busbw_gbps']:.3f}",
            )
        )
    mib = bench["config"]["allreduce_bytes"] >> 20
    cols = ("link rate", "set Gbit/s", "TCP Gbit/s", "TCP / set", f"all_reduce {mib} MiB (s)", "busbw Gbit/s")
    return Table(columns=cols, rows=tuple(rows), left=frozenset({0}))


def format_link_table(bench: JsonObject) -> str:
    """:func:`link_table` as fixed-width text under a line saying what was measured."""
    cfg = bench["config"]
    head = (
        f"# two hosts (network namespaces on one machine, {bench['cpus']} CPUs), a token bucket on both ends of "
        f"each link; TCP: one bulk transfer; all_reduce: gloo, {cfg['allreduce_bytes']} bytes, median of "
        f"{cfg['iters']}"
    )
    return head + "\n" + text_table(link_table(bench), width=13)


def _cmd_link(args: argparse.Namespace) -> int:
    try:
        config = LinkBenchConfig(
            link_rates=tuple(args.link_rate), tcp_seconds=args.tcp_seconds, allreduce_bytes=args.bytes, iters=args.iters
        )
    except (TypeError, ValueError) as exc:
        args.cmd_parser.error(str(exc))

    def progress(row: JsonObject) -> None:
        print(f"  {row['link_rate']}: TCP {row['tcp_gbps']:.3f} Gbit/s, all_reduce {row['allreduce_s']:.3f} s")

    with tempfile.TemporaryDirectory(prefix="sparsecomm-link-") as tmp:
        bench = run_bench(
            "link", lambda: run_link_bench(config, Path(tmp), on_row=progress), format_link_table, args.json
        )
    return 0 if bench is not None else 1


def add_link_parser(inner: Any) -> None:
    """Register ``bench link``."""
    p = inner.add_parser(
        "link",
        help="what a rate-limited link between two hosts delivers (root: network namespaces and tc)",
        description="Two hosts (network namespaces) joined by links shaped to each rate; a bulk TCP transfer "
        "and a dense gloo all_reduce between them.",
    )
    p.add_argument(
        "--link-rate",
        type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
        default=["100mbit", "1gbit", "none"],
        help="comma list of rates (tc spelling: 100mbit, 1gbit, 10gbit; none: unshaped; default 100mbit,1gbit,none)",
    )
    p.add_argument("--tcp-seconds", type=float, default=2.0, help="about how long each TCP transfer lasts")
    p.add_argument("--bytes", type=int, default=64 << 20, help="all_reduce size in bytes (default 64 MiB)")
    p.add_argument("--iters", type=int, default=3, help="timed all_reduces (median reported)")
    p.add_argument("--json", help="write the result here")
    p.set_defaults(func=_cmd_link, cmd_parser=p)
