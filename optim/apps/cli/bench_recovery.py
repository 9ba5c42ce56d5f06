"""``sparsecomm bench recovery``: the recovery benchmark's options, table and JSON."""

from __future__ import annotations

import argparse
from typing import Any

from bindings.json_object import JsonObject
from optim.apps.benchmarks.output import Table, text_table
from optim.apps.benchmarks.recovery import FAULTS, PHASES, RecoveryBenchConfig, run_recovery_bench
from optim.apps.cli.options import run_bench

__all__ = ["add_recovery_parser", "format_recovery_table", "recovery_table"]

_LABELS = {
    "raised_first_s": "first raised",
    "raised_s": "all raised",
    "detected_s": "detected",
    "configured_s": "epoch configured",
    "first_commit_s": "first commit",
    "ended_s": "all gave up",
    "failover_s": "standby active",
}


def recovery_table(bench: JsonObject, *, fault: str | None = None) -> Table:
    """One row per (system, nproc, fault), or only ``fault``'s rows: median seconds from the signal to each phase.

    A phase no row of the table reached is left out.
    """
    rows = [r for r in bench["rows"] if fault is None or r["fault"] == fault]
    phases = [p for p in PHASES if any(r.get(p) is not None for r in rows)]
    cols = ("system", "N", "fault", "runs", *(_LABELS[p] for p in phases))
    cells = tuple(
        (
            row["system"],
            str(row["nproc"]),
            row["fault"],
            str(len(row["runs"])),
            *("-" if row.get(p) is None else f"{row[p]:.3f}" for p in phases),
        )
        for row in rows
    )
    return Table(columns=cols, rows=cells, left=frozenset({0, 2}))


def format_recovery_table(bench: JsonObject) -> str:
    """:func:`recovery_table` as fixed-width text under a line saying what was measured."""
    cfg = bench["config"]
    head = (
        f"# recovery after one fault in slot 1 (or the coordinator); {cfg['spares']} spare(s); heartbeat timeout "
        f"{cfg['heartbeat_timeout_s']} s; all_reduce of {cfg['numel']} floats + commit vote per step; "
        f"median of {cfg['repeats']} runs; seconds from the signal"
    )
    return head + "\n" + text_table(recovery_table(bench), width=16)


def _cmd_recovery(args: argparse.Namespace) -> int:
    try:
        config = RecoveryBenchConfig(
            nprocs=tuple(args.nproc),
            spares=args.spares,
            faults=tuple(args.fault),
            repeats=args.repeats,
            numel=args.numel,
            heartbeat_timeout_s=args.heartbeat_timeout,
        )
    except ValueError as exc:
        args.cmd_parser.error(str(exc))

    def progress(run: JsonObject) -> None:
        phases = ", ".join(f"{p}={run[p]:.3f}" for p in PHASES if run.get(p) is not None)
        if "steps_during_failover" in run:
            phases += f", steps committed meanwhile={run['steps_during_failover']}"
        print(f"  {run.get('system', 'sparsecomm')} n={run['nproc']} {run['fault']}: {phases}", flush=True)

    bench = run_bench(
        "recovery",
        lambda: run_recovery_bench(config, torchft=args.torchft, on_run=progress),
        format_recovery_table,
        args.json,
        (RuntimeError, TimeoutError),
    )
    return 0 if bench is not None else 1


def add_recovery_parser(inner: Any) -> None:
    """Register ``bench recovery``."""
    p = inner.add_parser(
        "recovery",
        help="time from a fault (SIGKILL, SIGSTOP, link cut, dead coordinator) to the new epoch and first commit",
        description="Fault-aware all_reduce jobs on local gloo ranks (optim.testing.drill under our launcher).",
    )
    p.add_argument("--nproc", type=int, nargs="+", default=[4, 8], help="worker counts (default 4 8)")
    p.add_argument("--spares", type=int, default=1, help="spares (0: shrink; default 1: hot-swap)")
    p.add_argument(
        "--fault",
        nargs="+",
        choices=FAULTS,
        default=["sigkill", "sigstop"],
        help="faults to inject: a process killed or stopped, slot 1's host cut off the network (partition; "
        "needs root), the coordinator killed (coordinator)",
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per scenario (median reported)")
    p.add_argument("--numel", type=int, default=1 << 16, help="float32 elements per all_reduce")
    p.add_argument("--heartbeat-timeout", type=float, default=1.0, help="seconds (default 1)")
    p.add_argument("--torchft", action="store_true", help="also run torchft's recovery (needs the torchft extra)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.set_defaults(func=_cmd_recovery, cmd_parser=p)
