"""``sparsecomm bench checkpoint``: the checkpoint (in-memory snapshot) benchmark's options, table and JSON."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bindings.json_object import JsonObject
from bindings.spawn import LocalRunError
from optim.apps.benchmarks.output import Table, text_table
from optim.apps.benchmarks.snapshots import RECOVERY_PHASES, CheckpointBenchConfig, run_checkpoint_bench
from optim.apps.cli.bench_persist import add_persist_arguments, run_persist_command
from optim.apps.cli.options import or_dash, run_bench

__all__ = [
    "add_checkpoint_parser",
    "format_checkpoint_table",
    "loopback_table",
    "recovery_split_table",
    "snapshot_table",
]

_RECOVERY_LABELS = {
    "detect_s": "detect",
    "reconfigure_s": "reconfig",
    "agree_s": "agree",
    "transfer_s": "transfer",
    "restore_s": "restore",
    "resnapshot_s": "resnap",
    "resume_s": "resume",
    "total_s": "total",
}


def snapshot_table(bench: JsonObject) -> Table:
    """One row per run: step time with and without snapshots, the overhead, the snapshot's time and ring bytes."""
    rows = []
    for r in bench["rows"]:
        ov = r["overhead_fraction"]
        pv = r.get("overhead_paired_median")
        gbps = r["replication_GBps"]
        rows.append(
            (
                r["name"],
                r["model"],
                str(r["num_parameters"]),
                str(r["steps_on"]),
                str(r["steps_off"]),
                or_dash(r["step_ms_off"], ".1f"),
                or_dash(r["step_ms_on"], ".1f"),
                "-" if ov is None else f"{100 * ov:+.1f}%",
                "-" if pv is None else f"{100 * pv:+.1f}%",
                f"{r['snapshot_ms_median']:.2f}",
                f"{r['own_ring_bytes'] / 1e6:.2f}",
                f"{r['ward_ring_bytes'] / 1e6:.2f}",
                f"{r['ring_bytes_per_rank'] / 1e6:.2f}",
                "-" if gbps is None else f"{gbps * 1e3:.0f}",
            )
        )
    cols = (
        "optimizer",
        "model",
        "params",
        "n_on",
        "n_off",
        "step off (ms)",
        "step on (ms)",
        "overhead",
        "paired",
        "snapshot (ms)",
        "own MB",
        "ward MB",
        "rings MB",
        "repl MB/s",
    )
    return Table(columns=cols, rows=tuple(rows), left=frozenset({0, 1}))


def recovery_split_table(bench: JsonObject) -> Table:
    """One row per run: seconds of each phase of the hot-swap recovery, the restored step and the steps recomputed."""
    cols = ("optimizer", "model", *(_RECOVERY_LABELS[p] for p in RECOVERY_PHASES), "gap", "restored", "recomp")
    rows = []
    for r in bench["rows"]:
        rec = r["recovery"]
        cells = [
            r["name"],
            r["model"],
            *(or_dash(rec.get(p), ".3f") for p in RECOVERY_PHASES),
            or_dash(rec.get("gap_s"), ".3f"),
        ]
        cells += [str(rec.get("restore_step", "-")), str(rec.get("steps_recomputed", "-"))]
        rows.append(tuple(cells))
    return Table(columns=cols, rows=tuple(rows), left=frozenset({0, 1}))


def loopback_table(bench: JsonObject) -> Table:
    """The snapshot transfer over the side channel: one way, and the replicator's exchange, each against the target."""
    lb = bench["loopback"]
    target = bench["target_GBps"]
    rows = []
    for what, gbps, secs in (
        ("one-way send", lb["one_way_GBps"], lb["one_way_s_median"]),
        (
            "replicator exchange (both directions at once + copies), per direction",
            lb["exchange_GBps"],
            lb["exchange_s_median"],
        ),
    ):
        rows.append((what, f"{gbps:.2f}", f"{secs * 1e3:.0f}", f">= {target:g}", "met" if gbps >= target else "MISS"))
    cols = ("transfer", "GB/s", "ms", "target GB/s", "met?")
    return Table(columns=cols, rows=tuple(rows), left=frozenset({0, 3, 4}))


def format_checkpoint_table(bench: JsonObject) -> str:
    """Three parts: snapshot overhead and bytes per run, the recovery split per run, the loopback transfer."""
    c = bench["config"]
    lines = [
        f"# in-memory snapshots: {c['nproc']} ranks (gloo, local, {bench.get('cpu_count')} CPU cores, shared: "
        f"timings are noisy); batch {c['batch']} x context {c['context']}; SCAPE density {c['density']:g}",
        f"# step: median over steps (max over ranks) of snapshot blocks (on) / blocks without (off) of "
        f"{c['block']} steps, first step of each block and steps <= {c['skip_steps']} left out; "
        "overhead = (on - off) / off; paired = median over (on block, next off block) pairs of on/off - 1",
        "# snapshot: time on the critical path (collect + submit + wait for the copy), median, max over "
        "ranks; rings: host bytes of own + ward snapshot rings per rank; repl: replicated bytes per second of "
        "replicator busy time",
        text_table(snapshot_table(bench), sep=" "),
        f"# recovery: SIGKILL of slot 1 while step {c['kill_step']} runs, a spare takes its place (hot-swap), "
        f"heartbeat timeout {c['heartbeat_timeout_s']} s; seconds; one run each; reconfig = detected to new epoch "
        "configured; agree/transfer/restore/resnap = the members' restore phases (max over members); resume = "
        "last restored to every member's first commit; gap = total minus the listed phases",
        text_table(recovery_split_table(bench), width=9, sep=" "),
    ]
    for r in bench["rows"]:
        rec = r["recovery"]
        if not rec.get("ok"):
            errors = "; ".join(rec.get("errors") or ["?"])
            lines.append(f"# {r['name']} {r['model']}: recovery FAILED (job status {rec.get('status')}): {errors}")
    lb = bench.get("loopback") or {}
    if lb:
        lines.append(
            f"# loopback: {lb['nbytes'] / (1 << 20):.0f} MiB snapshot between 2 local ranks over the side channel "
            f"(FaultAwareCommunicator side_channel=True, gloo TCP), median of {lb['iters']}; contents "
            f"{'ok' if lb['exchange_correct'] else 'WRONG'}"
        )
        lines.append(text_table(loopback_table(bench), sep=" "))
    return "\n".join(lines)


def _models(text: str) -> tuple[tuple[int, int, int], ...]:
    """Parse ``128x2:60,384x4:24`` (d_model x layers : steps)."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        shape, sep, steps = item.partition(":")
        d, x, layers = shape.partition("x")
        if not (sep and x and d.isdigit() and layers.isdigit() and steps.isdigit()):
            raise argparse.ArgumentTypeError(f"expected DxL:STEPS items (e.g. 128x2:60), got {item!r}")
        out.append((int(d), int(layers), int(steps)))
    if not out:
        raise argparse.ArgumentTypeError("no model given")
    return tuple(out)


def _optimizers(text: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items or any(x not in ("scape", "adams") for x in items):
        raise argparse.ArgumentTypeError(f"expected a comma list of scape, adams; got {text!r}")
    return items


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    if args.persistent:
        return run_persist_command(args)
    try:
        config = CheckpointBenchConfig(
            optimizers=args.optimizers,
            density=args.density,
            models=args.models,
            nproc=args.nproc,
            spares=args.spares,
            block=args.block,
            skip_steps=args.skip_steps,
            kill_step=args.kill_step,
            loopback_bytes=args.loopback_bytes,
            loopback_iters=args.loopback_iters,
            heartbeat_timeout_s=args.heartbeat_timeout,
            threads=args.threads,
            timeout_s=args.timeout,
            out=args.out,
        )
    except ValueError as exc:
        args.cmd_parser.error(str(exc))

    def progress(row: JsonObject) -> None:
        ov = row["overhead_fraction"]
        rec = row["recovery"]
        print(
            f"  {row['name']} {row['model']}: step {or_dash(row['step_ms_off'], '.1f')} ms off / "
            f"{or_dash(row['step_ms_on'], '.1f')} ms on ({'-' if ov is None else f'{100 * ov:+.1f}%'}); "
            f"recovery {or_dash(rec.get('total_s'), '.2f')} s",
            flush=True,
        )

    bench = run_bench(
        "checkpoint",
        lambda: run_checkpoint_bench(config, on_row=progress),
        format_checkpoint_table,
        args.json,
        (RuntimeError, LocalRunError),
    )
    if bench is None:
        return 1
    bad = [r["name"] + " " + r["model"] for r in bench["rows"] if not r["recovery"].get("ok")]
    if bad:
        print(f"sparsecomm bench checkpoint: no recovery measured for {', '.join(bad)}", file=sys.stderr)
        return 2
    return 0


def add_checkpoint_parser(inner: Any) -> None:
    """Register ``bench checkpoint``."""
    d = CheckpointBenchConfig()
    p = inner.add_parser(
        "checkpoint",
        help="in-memory snapshots: step-time overhead, bytes, replication bandwidth, recovery split; "
        "--persistent: persistent checkpoints (bytes full / delta, write, restore, overhead)",
        description="Runs the resilient train job with SCAPE and dense ShardedAdamS at each model size: once "
        "with snapshots alternating in blocks (overhead, bytes, replication rate) and once with a worker "
        "SIGKILLed and replaced by a spare (recovery split); then times a large snapshot between 2 local "
        "ranks over the side channel.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--optimizers", type=_optimizers, default=",".join(d.optimizers), help="comma list of scape, adams (dense)"
    )
    p.add_argument("--density", type=float, default=d.density, help="SCAPE density")
    p.add_argument(
        "--models",
        type=_models,
        default=",".join(f"{a}x{b}:{n}" for a, b, n in d.models),  # a string default goes through type
        metavar="DxL:STEPS,...",
        help="model sizes (d_model x layers) and the overhead run's steps",
    )
    p.add_argument("--nproc", type=int, default=d.nproc, help="workers (>= 3: the kill leaves a majority)")
    p.add_argument("--spares", type=int, default=d.spares, help="spares of the recovery run")
    p.add_argument("--block", type=int, default=d.block, help="steps per snapshot / no-snapshot block")
    p.add_argument("--skip-steps", type=int, default=d.skip_steps, help="first steps left out of the medians")
    p.add_argument("--kill-step", type=int, default=d.kill_step, help="the recovery run kills slot 1 at this step")
    p.add_argument(
        "--loopback-bytes", type=int, default=d.loopback_bytes, help="loopback snapshot size in bytes (0: skip)"
    )
    p.add_argument("--loopback-iters", type=int, default=d.loopback_iters, help="timed loopback transfers")
    p.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout_s, help="seconds")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="deadline of each job, seconds")
    p.add_argument("--out", metavar="DIR", default=d.out, help="directory of the jobs' event files")
    p.add_argument("--json", metavar="FILE", help="write the result as JSON")
    add_persist_arguments(p)
    p.set_defaults(func=_cmd_checkpoint, cmd_parser=p)
