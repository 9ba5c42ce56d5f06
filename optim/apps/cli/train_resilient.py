"""``sparsecomm train --spares S --kill SLOT@STEP ...``: the failure-transparent run, its report and verdict."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from bindings.json_object import JsonObject
from optim.apps.cli.report import run_report
from optim.apps.train_job.job_config import TrainConfig
from optim.apps.train_job.resilient_job import (
    RECOVERY_MODES,
    ResilienceConfig,
    failure_timeline,
    run_resilient_training,
)

__all__ = ["add_resilience_options", "wants_resilience", "run_resilient_cmd"]


def _kill(text: str) -> tuple[int, int]:
    slot, sep, step = text.partition("@")
    if not sep or not slot.isdigit() or not step.isdigit() or int(step) < 1:
        raise argparse.ArgumentTypeError(f"expected SLOT@STEP (e.g. 2@150), got {text!r}")
    return int(slot), int(step)


def add_resilience_options(p: argparse.ArgumentParser) -> None:
    """The fault-tolerance options of ``sparsecomm train``."""
    p.add_argument("--spares", type=int, default=0, help="spare processes (fault-tolerant run when > 0 or --kill)")
    p.add_argument(
        "--kill",
        type=_kill,
        action="append",
        default=[],
        metavar="SLOT@STEP",
        help="the worker holding SLOT SIGKILLs itself inside STEP, once (repeatable)",
    )
    p.add_argument("--snapshot", choices=("on", "off"), default="on", help="in-memory snapshots replicated to a buddy")
    p.add_argument(
        "--recovery", choices=RECOVERY_MODES, default="hotswap", help="fill dead slots with spares, or shrink"
    )
    p.add_argument("--heartbeat-timeout", type=float, default=2.0, help="seconds of silence = hung worker")
    p.add_argument(
        "--no-reference", action="store_true", help="with --kill: skip the failure-free reference run of the verdict"
    )
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="also write persistent checkpoints to DIR")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="committed steps between checkpoints")
    p.add_argument("--keep", type=int, default=2, metavar="K", help="complete checkpoints to keep")
    p.add_argument(
        "--full-every", type=int, default=8, metavar="M", help="a full checkpoint every M, deltas between (1: all full)"
    )
    p.add_argument(
        "--lossy-checkpoints",
        action="store_true",
        help="full checkpoints keep the first moment in bfloat16 (smaller; a resume is close, not bit-identical)",
    )
    p.add_argument("--resume", action="store_true", help="start from the newest complete checkpoint in DIR")


def wants_resilience(args: argparse.Namespace) -> bool:
    """Whether ``sparsecomm train`` takes the fault-tolerant path."""
    return bool(args.spares > 0 or args.kill or args.checkpoint_dir)


def _steps(run: JsonObject) -> list[JsonObject]:
    """A fault-tolerant run's committed losses as ``report.json``'s ``steps``."""
    return [{"step": k, "train_loss": v} for k, v in sorted(run["losses"].items())]


def _verdict(run: JsonObject, reference: JsonObject | None) -> JsonObject:
    if reference is None:
        return {"checked": False}
    shrunk = any(e["event"] == "epoch_proposed" and e.get("mode") == "shrink" for e in run["events"])
    a, b = run["losses"], reference["losses"]
    common = sorted(set(a) & set(b))
    diff = max((abs(a[s] - b[s]) for s in common), default=float("nan"))
    same = set(a) == set(b) and all(a[s] == b[s] for s in common)
    return {
        "checked": True,
        "losses_identical": same,
        "max_abs_loss_diff": diff,
        "params_identical": run["params_digest"] is not None and run["params_digest"] == reference["params_digest"],
        "steps_compared": len(common),
        # A shrink changes the data split and the reductions: the run is not expected to match.
        "expected_identical": not shrunk,
        "final_val_loss": run["evals"][max(run["evals"])] if run["evals"] else None,
        "reference_final_val_loss": reference["evals"][max(reference["evals"])] if reference["evals"] else None,
    }


def _snapshot_overhead(result: JsonObject) -> JsonObject:
    steps = [e["step_s"] for e in result["events"] if e["event"] == "committed" and "step_s" in e]
    snaps = [r["snapshot_ms_median"] for r in result["results"].values()]
    step_ms = 1000 * statistics.median(steps) if steps else float("nan")
    snap_ms = max(snaps) if snaps else float("nan")
    some: JsonObject = next(iter(result["results"].values()), {})
    own, ward = some.get("snapshot_bytes", (0, 0))
    return {
        "snapshot_ms_median": snap_ms,
        "step_ms_median": step_ms,
        "overhead_fraction": snap_ms / step_ms if steps else None,
        "host_bytes_per_rank": {"own_ring": own, "ward_ring": ward},
    }


def _plot(report: JsonObject, run: JsonObject, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 6.0), dpi=110)
    FigureCanvasAgg(fig)
    ax, tl = fig.subplots(2, 1, gridspec_kw={"height_ratios": [3, 2]})
    losses = run["losses"]
    steps = sorted(losses)
    ax.plot(steps, [losses[s] for s in steps], lw=0.9, color="tab:blue", label="train loss (with failures)")
    ref = report.get("reference_steps")
    if ref:
        ax.plot(
            [s["step"] for s in ref],
            [s["train_loss"] for s in ref],
            lw=2.5,
            alpha=0.3,
            color="tab:green",
            label="failure-free reference",
        )
    for f in report["failures"]:
        ax.axvline(f["step"], color="tab:red", lw=0.8, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title(report["title"], fontsize=9)
    t0 = min(e["time"] for e in run["events"])
    commits = [(e["time"] - t0, e["step"]) for e in run["events"] if e["event"] == "committed"]
    if commits:
        tl.plot([c[0] for c in commits], [c[1] for c in commits], ".", ms=1.5, color="tab:blue", label="committed step")
    marks = {
        "kill": "tab:red",
        "failure_detected": "tab:orange",
        "epoch_configured": "tab:purple",
        "restored": "tab:green",
    }
    for kill in run["kills"]:
        tl.axvline(kill["time"] - t0, color=marks["kill"], lw=1.0)
    first_kill = min((k["time"] for k in run["kills"]), default=float("inf"))
    for name in ("failure_detected", "epoch_configured", "restored"):
        for e in run["events"]:
            if e["event"] == name and e["time"] > first_kill:
                tl.axvline(e["time"] - t0, color=marks[name], lw=0.6, ls=":")
    tl.plot([], [], color=marks["kill"], label="SIGKILL")
    tl.plot([], [], color=marks["failure_detected"], ls=":", label="detected")
    tl.plot([], [], color=marks["epoch_configured"], ls=":", label="epoch configured")
    tl.plot([], [], color=marks["restored"], ls=":", label="restored")
    tl.set_xlabel("wall time (s)")
    tl.set_ylabel("step")
    tl.legend(fontsize=7, loc="lower right")
    tl.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def run_resilient_cmd(args: argparse.Namespace, config: TrainConfig) -> int:
    """Run the fault-tolerant train job (and its failure-free reference); write the report; print the verdict."""
    try:
        res = ResilienceConfig(
            spares=args.spares,
            kills=tuple(args.kill),
            snapshot=args.snapshot == "on",
            recovery=args.recovery,
            heartbeat_timeout_s=args.heartbeat_timeout,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            keep_checkpoints=args.keep,
            full_checkpoint_every=args.full_every,
            lossy_checkpoints=args.lossy_checkpoints,
            resume=args.resume,
        )
        res.check_against(config)
    except (ValueError, TypeError) as exc:
        args.cmd_parser.error(str(exc))
    out = Path(config.out)
    reference = None
    if res.kills and not args.no_reference:
        print(f"reference run (no failures): {config.nproc} workers + {res.spares} spare(s) ...", flush=True)
        plain = dataclasses.replace(res, kills=(), checkpoint_dir=None, checkpoint_every=0, resume=False)
        reference = run_resilient_training(config, plain, out / "reference")
        if reference["status"] != 0:
            print(f"sparsecomm train: the reference run failed (status {reference['status']})")
            return 1
    kills = ", ".join(f"slot {s} at step {t}" for s, t in res.kills) or "none"
    print(f"run with failures ({kills}): {config.nproc} workers + {res.spares} spare(s) ...", flush=True)
    run = run_resilient_training(config, res, out / "run")
    failures = failure_timeline(run)
    verdict = _verdict(run, reference)
    report = run_report(
        config,
        world_size=config.nproc,
        launcher="local",
        wall_time_s=run["wall_time_s"],
        steps=_steps(run),
        evals=[{"step": k, "val_loss": v} for k, v in sorted(run["evals"].items())],
    )
    report.update(
        {
            "title": f"{config.optimizer} (density {config.density}) on {config.nproc} workers "
            f"+ {res.spares} spare(s); recovery {res.recovery}; kills: {kills}",
            "resilience": dataclasses.asdict(res),
            "status": run["status"],
            "params_digest": run["params_digest"],
            "final_members_agree": run["digests_agree"],
            "failures": failures,
            "missed_kills": run["missed_kills"],
            "snapshot": _snapshot_overhead(run),
            "verdict": verdict,
            "events": run["events"],
        }
    )
    if reference is not None:
        report["reference_steps"] = _steps(reference)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    _plot(report, run, out / "report.png")
    report.pop("reference_steps", None)
    for f in failures:
        print(
            f"failure: slot {f['slot']} killed at step {f['step']}: detected +{_s(f['detected_s'])}, "
            f"epoch configured +{_s(f['epoch_configured_s'])}, restored step {f['restore_step']} "
            f"+{_s(f['restored_s'])}, first committed step after +{_s(f['resumed_s'])}; "
            f"{f['steps_recomputed']} step(s) recomputed"
        )
    for m in run["missed_kills"]:
        print(f"not killed: slot {m['slot']} at step {m['step']} (no worker held that slot at that step)")
    snap = report["snapshot"]
    if snap["overhead_fraction"] is not None:
        print(
            f"snapshots: {snap['snapshot_ms_median']:.2f} ms per step on the critical path "
            f"({100 * snap['overhead_fraction']:.2f}% of a {snap['step_ms_median']:.0f} ms step)"
        )
    evals = run["evals"]
    if evals:
        print(f"final validation loss {evals[max(evals)]:.4f}; job status {run['status']}")
    if verdict["checked"]:
        same = verdict["losses_identical"] and verdict["params_identical"]
        print(
            f"verdict: losses identical to the failure-free reference: {'yes' if verdict['losses_identical'] else 'no'}"
            f" ({verdict['steps_compared']} steps, max |diff| {verdict['max_abs_loss_diff']:.3g}); final parameters "
            f"identical: {'yes' if verdict['params_identical'] else 'no'}"
        )
        if not verdict["expected_identical"]:
            print(
                "  (the world shrank: fewer ranks change the data split and the reductions, so the run is not "
                f"expected to match; final validation loss {verdict['final_val_loss']:.4f} vs "
                f"{verdict['reference_final_val_loss']:.4f} without failures)"
            )
        elif not same:
            return 2
    print(f"report: {out / 'report.json'}, {out / 'report.png'}")
    return 0 if run["status"] == 0 else 1


def _s(v: float | None) -> str:
    return "?" if v is None else f"{v:.3f} s"
