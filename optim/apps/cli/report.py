"""What ``sparsecomm train`` writes: ``report.json`` (one schema for the plain and the fault-tolerant run) and
``report.png``.

Every report has the run's ``config``, ``optimizer``, ``world_size``, ``backend``, ``launcher``, ``versions``,
``wall_time_s``, ``steps`` (``step``, ``train_loss`` and, for the plain run, the step's times and bytes),
``evals`` (``step``, ``val_loss``) and ``final`` (:func:`run_report`). The plain run adds its timing, model,
corpus and wire bytes (:func:`build_report`); the fault-tolerant run adds ``resilience``, ``status``,
``failures``, ``snapshot``, ``verdict`` and the job's ``events``
(:mod:`optim.apps.cli.train_resilient`).
"""

from __future__ import annotations

import dataclasses
import json
import platform
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

import sparsecomm
from bindings.json_object import JsonObject
from optim.apps.train_job.job_config import TrainConfig
from optim.apps.train_job.records import TrainResult, wire_bytes_summary

__all__ = ["build_report", "run_report", "write_loss_plot", "write_report"]


def run_report(
    config: TrainConfig,
    *,
    world_size: int,
    launcher: str,
    wall_time_s: float,
    steps: Sequence[JsonObject],
    evals: Sequence[JsonObject],
) -> JsonObject:
    """The part of ``report.json`` every ``sparsecomm train`` run writes.

    Args:
        config: The run.
        world_size: Ranks that trained.
        launcher: ``local`` or the launcher that started the ranks.
        wall_time_s: The whole run.
        steps: One entry per committed step, in step order, each with ``step`` and ``train_loss``.
        evals: One entry per evaluation, in step order, each with ``step`` and ``val_loss``.
    """
    last = [s["train_loss"] for s in steps[-10:]]
    return {
        "config": dataclasses.asdict(config),
        "optimizer": config.optimizer_config(),
        "world_size": world_size,
        "backend": config.backend,
        "launcher": launcher,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "sparsecomm": sparsecomm.__version__,
            "platform": platform.platform(),
        },
        "wall_time_s": wall_time_s,
        "final": {
            "train_loss": steps[-1]["train_loss"] if steps else None,
            "train_loss_last10_mean": sum(last) / len(last) if last else None,
            "initial_val_loss": evals[0]["val_loss"] if evals else None,
            "val_loss": evals[-1]["val_loss"] if evals else None,
        },
        "steps": list(steps),
        "evals": list(evals),
    }


def build_report(config: TrainConfig, result: TrainResult) -> JsonObject:
    """Assemble the ``report.json`` content from rank 0's :func:`~optim.apps.train_job.train.run_training` result.

    Args:
        config: The run.
        result: Rank 0's result.

    Returns:
        The report (JSON-serialisable).
    """
    steps = result.steps
    report = run_report(
        config,
        world_size=result.world_size,
        launcher=result.launcher,
        wall_time_s=result.wall_time_s,
        steps=[s.to_json() for s in steps],
        evals=[dataclasses.asdict(e) for e in result.evals],
    )
    report["optimizer"] = result.optimizer
    report.update(
        train_time_s=result.train_time_s,
        mean_step_time_s=sum(s.step_time_s for s in steps) / len(steps),
        model={**result.model, "num_parameters": result.num_parameters},
        corpus=result.corpus,
        wire_bytes=wire_bytes_summary(steps, result.bucket_bytes),
        comm_stats=result.comm_stats,
    )
    return report


def write_loss_plot(report: JsonObject, path: str | Path) -> Path:
    """Draw train and validation loss against step into a PNG.

    Args:
        report: A :func:`build_report` result.
        path: Output file.

    Returns:
        The path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = [s["step"] for s in report["steps"]]
    train = [s["train_loss"] for s in report["steps"]]
    window = max(1, min(10, len(train) // 5))
    chunks = [train[max(0, i - window + 1) : i + 1] for i in range(len(train))]
    smooth = [sum(c) / len(c) for c in chunks]
    fig = Figure(figsize=(7.0, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, train, lw=0.7, alpha=0.35, color="tab:blue", label="train (per step)")
    ax.plot(steps, smooth, lw=1.6, color="tab:blue", label=f"train ({window}-step mean)")
    ax.plot(
        [e["step"] for e in report["evals"]],
        [e["val_loss"] for e in report["evals"]],
        "o-",
        color="tab:orange",
        label="validation",
    )
    model = report["model"]
    ax.set_title(
        f"{report['optimizer']['name']}, {report['world_size']} ranks ({report['backend']}), "
        f"{model['num_parameters']:,} params, "
        f"batch {report['config']['batch']}x{report['config']['context']} per rank",
        fontsize=10,
    )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    return out


def write_report(report: JsonObject, out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.png`` into ``out_dir`` (created if missing).

    Args:
        report: A :func:`build_report` result.
        out_dir: Output directory.

    Returns:
        The paths of the JSON and PNG files.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "report.json"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    return json_path, write_loss_plot(report, out / "report.png")
