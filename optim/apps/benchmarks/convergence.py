"""Convergence benchmark: the training job with each optimizer, same seed and data order.

:func:`run_convergence` trains the model of a base :class:`~optim.apps.train_job.train.TrainConfig`
once per variant, on ``nproc`` spawned local ranks, one run after the other:

* ``adamw``: :class:`optim.ShardedAdamW` (dense),
* ``adams``: :class:`optim.ShardedAdamS` (dense; the reference of the ratios),
* per density ``D``, each chosen method (:data:`METHODS`): ``scape@D``
  (:class:`optim.SCAPE`), ``local@D`` (:class:`optim.LocalAdamS`, staggered
  window), ``periodic@D`` (LocalAdamS, a dense average every ``1/D`` steps) and
  ``topk@D`` (:class:`optim.TopKAdamS`) -- the last three put the same value
  bytes on the wire as SCAPE at ``D``.

:mod:`optim.apps.benchmarks.suite` runs this over many settings.

Every run uses the same initialisation and the same batches (both depend on
the seed only). The result holds, per run, the config, per-step training loss,
validation losses, the final validation loss and its ratio to dense AdamS, wire
bytes per step (split by stats op), mean step time and the largest
step-to-step training-loss rise after warm-up. Nothing here prints or plots
(``optim.apps.cli.bench`` does).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bindings.json_object import JsonObject
from bindings.validate import check_density
from optim.apps.benchmarks.output import git_commit
from optim.apps.train_job.job_config import SPARSE_OPTIMIZERS, TrainConfig
from optim.apps.train_job.records import TrainResult, wire_bytes_summary
from optim.apps.train_job.train import launch_local

__all__ = [
    "DEFAULT_DENSITIES",
    "METHODS",
    "TARGETS",
    "convergence_variants",
    "largest_loss_rise",
    "summarize_run",
    "run_convergence",
]

DEFAULT_DENSITIES = (0.1, 0.01, 0.001)
"""SCAPE densities of the default sweep (0.001 is a stress point)."""

TARGETS = {0.1: 1.02, 0.01: 1.05}
"""Largest acceptable ratio of SCAPE's final validation loss to dense AdamS's, per density."""

ADAMW_BASED = (
    "local-adamw",
    "diloco-adamw",
    "periodic-adamw",
    "sparseloco-adamw",
    "maskedloco-adamw",
    "coded-adamw",
    "topk-adamw",
    "demo-sgd",
)
"""Optimizer choices whose dense reference is AdamW (averaged gradients, same schedule), not AdamS."""

ADAMW_TARGETS = {0.1: 1.03, 0.01: 1.06}
"""Largest acceptable ratio of an AdamW-based method's validation loss to dense AdamW's, per density."""

logger = logging.getLogger(__name__)

OnRun = Callable[[JsonObject], None]


METHODS = (
    "scape",
    "local",
    "local-overlap",
    "local-lean",
    "local-adamw",
    "local-adamw-debias",
    "local-adamw-keep",
    "local-adamw-moment",
    "local-adamw-f32-measured",
    "local-adamw-f32-debias",
    "local-adamw-f32-keep",
    "local-bf16",
    "local-int8",
    "local-int4",
    "local-int2",
    "local-int1",
    "local-contiguous",
    "local-spread",
    "local-moment",
    "local-nomoment",
    "local-debiased",
    "local-measured",
    "local-plain",
    "local-codes-plain",
    "local-f32",
    "periodic",
    "topk",
    "diloco",
    "sparseloco",
    "maskedloco",
    "coded",
    "coded-adams",
    "topk-adamw",
    "periodic-adamw",
    "demo",
)
"""Sparse methods a convergence run can compare, each at every density: SCAPE; LocalAdamS with its defaults (``local``:
staggered window of changes in the codes of :func:`optim.optimizers.local.auto_wire_bits`, ``window_order="auto"``,
``normalizer="auto"``, ``average_moment="auto"``); the defaults with each averaging landing a step late, its
exchange beside the next step's compute (``local-overlap``); the defaults with the normalizer's second-moment EMA in
bfloat16 (``local-lean``); :class:`torch.optim.AdamW` wrapped by :class:`optim.LocalOptimizer` with its defaults
(``local-adamw``, judged against dense AdamW), its second moment debiased by the whole estimate (``local-adamw-
debias``) or not at all (``local-adamw-keep``), and each of the three with float32 values in the window (``local-
adamw-f32-NOISE``: at density 1 the replicas are averaged in full after every step), its first moment averaged too
(``local-adamw-moment``); the defaults with the first
moments averaged at every density or at none (``local-moment``, ``local-nomoment``: the defaults before
``average_moment``); the rest without them: the defaults with the debiased or the measured normalizer at every
density (``local-debiased``, ``local-measured``); with the debiased normalizer and in the window's own order
(contiguous) unless the name says otherwise: with ``B``-bit codes at every density (``local- intB``), with bfloat16
changes (``local-bf16``, the defaults before the codes), either order at every density (``local-contiguous``,
``local-spread``); bfloat16 changes with plain per-rank AdamS (``local-plain``), the defaults' codes and order with
plain per-rank AdamS (``local-codes-plain``); float32 values and plain AdamS (``local-f32``); a periodic dense
float32 average and plain AdamS (``periodic``); TopKAdamS (top-k + error feedback); and two published baselines around
:class:`torch.optim.AdamW`, judged against dense AdamW at the same wire bytes per step: :class:`optim.DiLoCo`
(``diloco``: a dense fp32 average of the pseudo-gradients every ``round(1/D)`` steps, Nesterov outer SGD 0.7 / 0.9)
and :class:`optim.SparseLoCo` (``sparseloco``: period and chunk-wise top-k of
:func:`optim.optimizers.sparseloco.sparseloco_plan`, 2-bit codes, error feedback as outer momentum); and a
candidate of this library's own, :class:`optim.MaskedLoCo` (``maskedloco``: SparseLoCo over a mask of each
rank's shard agreed one outer step ahead, only values in codes through a reduce-scatter and an all-gather);
:class:`optim.CodedGradients` around AdamW (``coded``) and around :class:`optim.AdamS` (``coded-adams``, judged against
dense AdamS); and two classic baselines around :class:`torch.optim.AdamW`:
:class:`optim.TopKGradients` (``topk-adamw``: every step the average of every rank's top-k gradient entries, error
feedback) and periodic averaging (``periodic-adamw``: DiLoCo's period, the replicas' plain average as the outer
step); and :class:`optim.DeMo` around :class:`torch.optim.SGD` at AdamW's learning rate and weight decay (``demo``:
the sign of the ranks' averaged fast DCT components of their own momenta), judged against dense AdamW."""

_METHOD_OVERRIDES: dict[str, JsonObject] = {
    "scape": {"optimizer": "scape"},
    "local": {
        "optimizer": "local-adams",
        "local_schedule": "staggered",
        "local_wire": "auto",
        "local_normalizer": "auto",
    },
    "local-overlap": {
        "optimizer": "local-adams",
        "local_schedule": "staggered",
        "local_wire": "auto",
        "local_normalizer": "auto",
        "local_overlap": True,
    },
    "local-adamw": {
        "optimizer": "local-adamw",
        "local_schedule": "staggered",
        "local_wire": "auto",
        "local_window_order": "auto",
    },
    **{
        f"local-adamw-{noise}": {
            "optimizer": "local-adamw",
            "local_schedule": "staggered",
            "local_wire": "auto",
            "local_window_order": "auto",
            "local_noise": noise,
        }
        for noise in ("debias", "keep")
    },
    **{
        f"local-adamw-{name}": {
            "optimizer": "local-adamw",
            "local_schedule": "staggered",
            "local_wire": "auto",
            "local_window_order": "auto",
            "local_moment": moment,
        }
        for name, moment in (("moment", "on"),)
    },
    **{
        f"local-adamw-f32-{noise}": {
            "optimizer": "local-adamw",
            "local_schedule": "staggered",
            "local_wire": "float32",
            "local_noise": noise,
        }
        for noise in ("measured", "debias", "keep")
    },
    "local-lean": {
        "optimizer": "local-adams",
        "local_schedule": "staggered",
        "local_wire": "auto",
        "local_normalizer": "auto",
        "local_normalizer_dtype": "bfloat16",
    },
    "local-bf16": {
        "optimizer": "local-adams",
        "local_schedule": "staggered",
        "local_wire": "bfloat16",
        "local_normalizer": "debiased",
        "local_window_order": "contiguous",
    },
    **{
        f"local-int{bits}": {
            "optimizer": "local-adams",
            "local_schedule": "staggered",
            "local_wire": f"int{bits}",
            "local_normalizer": "debiased",
            "local_window_order": "contiguous",
        }
        for bits in (8, 4, 2, 1)
    },
    "local-contiguous": {
        "optimizer": "local-adams",
        "local_schedule": "staggered",
        "local_wire": "auto",
        "local_normalizer": "debiased",
        "local_window_order": "contiguous",
    },
    "local-spread": {
        "optimizer": "local-adams",
        "local_schedule": "staggered",
        "local_wire": "auto",
        "local_normalizer": "debiased",
        "local_window_order": "spread",
    },
    "local-moment": {
        "optimizer": "local-adams",
        "local_schedule": "staggered",
        "local_wire": "auto",
        "local_moment": "on",
    },
    "local-nomoment": {
        "optimizer": "local-adams",
        "local_schedule": "staggered",
        "local_wire": "auto",
        "local_moment": "off",
    },
    "local-debiased": {
        "optimizer": "local-adams",
        "local_schedule": "staggered",
        "local_wire": "auto",
        "local_normalizer": "debiased",
    },
    "local-measured": {
        "optimizer": "local-adams",
        "local_schedule": "staggered",
        "local_wire": "auto",
        "local_normalizer": "measured",
    },
    "local-plain": {
        "optimizer": "local-adams",
        "local_schedule": "staggered",
        "local_wire": "bfloat16",
        "local_normalizer": "local",
        "local_window_order": "contiguous",
    },
    "local-codes-plain": {
        "optimizer": "local-adams",
        "local_schedule": "staggered",
        "local_wire": "auto",
        "local_normalizer": "local",
    },
    "local-f32": {
        "optimizer": "local-adams",
        "local_schedule": "staggered",
        "local_wire": "float32",
        "local_normalizer": "local",
        "local_window_order": "contiguous",
    },
    "periodic": {
        "optimizer": "local-adams",
        "local_schedule": "periodic",
        "local_wire": "float32",
        "local_normalizer": "local",
    },
    "topk": {"optimizer": "topk-adams"},
    "diloco": {"optimizer": "diloco-adamw"},
    "sparseloco": {"optimizer": "sparseloco-adamw"},
    "maskedloco": {"optimizer": "maskedloco-adamw"},
    "coded": {"optimizer": "coded-adamw"},
    "coded-adams": {"optimizer": "coded-adams"},
    "topk-adamw": {"optimizer": "topk-adamw"},
    "periodic-adamw": {"optimizer": "periodic-adamw"},
    "demo": {"optimizer": "demo-sgd"},
}


for _name, _ov in _METHOD_OVERRIDES.items():  # the variants measured before average_moment: as they ran
    if _ov["optimizer"] == "local-adams" and _name not in ("local", "local-overlap", "local-lean", "local-moment"):
        _ov.setdefault("local_moment", "off")


def convergence_variants(
    densities: Sequence[float], methods: Sequence[str] = ("scape",)
) -> list[tuple[str, JsonObject]]:
    """Return ``(name, TrainConfig overrides)`` of every run: AdamW, AdamS, then each method per density."""
    out: list[tuple[str, JsonObject]] = [("adamw", {"optimizer": "adamw"}), ("adams", {"optimizer": "adams"})]
    for m in methods:
        if m not in _METHOD_OVERRIDES:
            raise ValueError(f"method must be one of {METHODS}, got {m!r}")
    for d in densities:
        check_density(d)
        for m in methods:
            out.append((f"{m}@{d:g}", {**_METHOD_OVERRIDES[m], "density": float(d)}))
    return out


def largest_loss_rise(losses: Sequence[float], first_step: int) -> tuple[float, int | None]:
    """Return the largest ``loss[s] - loss[s-1]`` over 1-based steps ``s > first_step`` and its step.

    Args:
        losses: Training loss of steps 1, 2, ...
        first_step: Last warm-up step; rises into later steps count.

    Returns:
        ``(rise, step)``; ``(0.0, None)`` when the loss never rose there (or too few steps).
    """
    best, at = 0.0, None
    for s in range(max(2, first_step + 1), len(losses) + 1):
        rise = losses[s - 1] - losses[s - 2]
        if rise > best:
            best, at = rise, s
    return best, at


def summarize_run(name: str, config: TrainConfig, result: TrainResult) -> JsonObject:
    """Reduce rank 0's :func:`~optim.apps.train_job.train.train_worker` result to the benchmark's record."""
    steps = result.steps
    warm = config.warmup_steps
    if config.optimizer in SPARSE_OPTIMIZERS:
        warm = max(warm, config.sparse_warmup_steps)
    rise, rise_step = largest_loss_rise([s.train_loss for s in steps], warm)
    wire = wire_bytes_summary(steps, result.bucket_bytes)
    sparse = [s.bytes_sent for s in steps if s.sparse]
    return {
        "name": name,
        "optimizer": result.optimizer,
        "density": config.density if config.optimizer in SPARSE_OPTIMIZERS else 1.0,
        "config": dataclasses.asdict(config),
        "num_parameters": result.num_parameters,
        "train_loss": [s.train_loss for s in steps],
        "evals": [dataclasses.asdict(e) for e in result.evals],
        "final_val_loss": result.evals[-1].val_loss,
        "initial_val_loss": result.evals[0].val_loss,
        "wire_bytes_per_step": wire["per_step"],
        "optimizer_wire_bytes_per_step": wire["optimizer_per_step"],
        "wire_bytes_by_op": {op: v["per_step"] for op, v in wire["by_op"].items()},
        "wire_bytes_total": wire["total"],
        "sparse_step_wire_bytes": sum(sparse) / len(sparse) if sparse else None,
        "mean_step_time_s": sum(s.step_time_s for s in steps) / len(steps),
        "train_time_s": result.train_time_s,
        "sparse_steps": sum(1 for s in steps if s.sparse),
        "warmup_steps": warm,
        "largest_loss_rise": rise,
        "largest_loss_rise_step": rise_step,
    }


def run_file_name(name: str, config: TrainConfig) -> str:
    """The file of run ``name`` of ``config``: the name and a digest of every configuration field."""
    text = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    return f"{name}-{hashlib.blake2b(text.encode(), digest_size=6).hexdigest()}.json"


REUSE = ("commit", "any", "none")
"""Which stored run files :func:`run_convergence` takes: written at this commit, at any commit, or none."""


def _stored_run(path: Path | None, commit: str, reuse: str) -> JsonObject | None:
    """The record in ``path`` if ``reuse`` allows its commit (``"commit"``: this one, a known one), else ``None``."""
    if path is None or reuse == "none" or not path.is_file() or (reuse == "commit" and commit == "unknown"):
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("convergence: ignoring the unreadable run file %s: %s", path, exc)
        return None
    if not isinstance(record, dict) or (reuse == "commit" and record.get("commit") != commit):
        return None
    logger.info("convergence: %s taken from %s (commit %s)", record.get("name"), path, record.get("commit"))
    return record


def run_convergence(
    base: TrainConfig,
    densities: Sequence[float] = DEFAULT_DENSITIES,
    *,
    methods: Sequence[str] = ("scape",),
    on_run: OnRun | None = None,
    runs_dir: str | Path | None = None,
    reuse: str = "commit",
) -> JsonObject:
    """Train ``base`` with every variant of :func:`convergence_variants`; return the benchmark record.

    Args:
        base: The run (its ``optimizer`` and ``density`` are overridden per variant).
        densities: Densities of the sparse methods.
        methods: Sparse methods (:data:`METHODS`), each run at every density.
        on_run: Called with each run's record when it finishes.
        runs_dir: Write each run's record to its own file here as it finishes
            (:func:`run_file_name`) and take a run from its file instead of
            training it when the file holds the same configuration and was
            written at the same commit: an interrupted suite goes on where it stopped.
        reuse: Which run files to take (:data:`REUSE`): ``"commit"`` (default)
            those written at this commit, ``"any"`` those of any commit (each
            record keeps its own: the caller vouches that the code of those
            runs did not change), ``"none"``: train every run again.

    Returns:
        ``runs`` (one :func:`summarize_run` record each, plus ``ratio_to_adams``
        and ``wall_time_s``), ``reference`` (``adams``), ``targets``
        (``{"scape@D": {"max_ratio", "ratio", "met"}}`` for the densities of
        :data:`TARGETS` that ran) and ``wall_time_s``.

    Raises:
        LocalRunError: A rank of a run failed.
    """
    if reuse not in REUSE:
        raise ValueError(f"Invalid reuse: {reuse!r} (must be one of {REUSE})")
    t_all = time.perf_counter()
    runs: list[JsonObject] = []
    commit = git_commit()
    for name, overrides in convergence_variants(densities, methods):
        config = dataclasses.replace(base, **overrides)
        path = None if runs_dir is None else Path(runs_dir) / run_file_name(name, config)
        record = _stored_run(path, commit, reuse)
        if record is None:
            t0 = time.perf_counter()
            result = launch_local(config)
            record = summarize_run(name, config, result)
            record["wall_time_s"] = time.perf_counter() - t0
            record["commit"] = commit
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(record, default=str))
                tmp.replace(path)  # whole or absent: an interrupted run is run again
        runs.append(record)
        if on_run is not None:
            on_run(record)
    ref = next(r for r in runs if r["name"] == "adams")["final_val_loss"]
    for r in runs:
        r["ratio_to_adams"] = r["final_val_loss"] / ref
    targets = {}
    for r in runs:
        if r["optimizer"]["name"] in SPARSE_OPTIMIZERS and r["density"] in TARGETS:
            limit = TARGETS[r["density"]]
            targets[r["name"]] = {"max_ratio": limit, "ratio": r["ratio_to_adams"], "met": r["ratio_to_adams"] <= limit}
    return {
        "base_config": dataclasses.asdict(base),
        "reference": "adams",
        "runs": runs,
        "targets": targets,
        "wall_time_s": time.perf_counter() - t_all,
    }
