"""The convergence suite: every optimizer on settings that differ in data, model family and schedule.

One setting alone can be fooled (defaults tuned on it, a schedule that hides a
slow method); the suite runs :func:`optim.benchmarks.convergence.run_convergence` on each
of :data:`SETTINGS` at each horizon (300 and 1,000 steps by default), with
the same seeds and data order for every optimizer, and reduces the result to:

* per setting and horizon, each run's validation loss, its ratio to dense
  ShardedAdamS and to ShardedAdamW, its optimizer wire bytes per step (and
  their ratio to dense AdamS's), and its largest training-loss rise after the
  warm-up next to the largest rise of the dense runs;
* per method and density, the worst ratio over the whole suite at each
  horizon, and whether it meets :data:`optim.benchmarks.convergence.TARGETS`.

With several seeds (initialisation and data order), every setting is run
once per seed and each cell holds the mean validation loss over the seeds;
ratios are ratios of those means, and each cell also keeps every seed's own
ratio (``seed_ratios``) and the spread of dense AdamS itself over the seeds
(``dense_seed_spread``: its largest over its smallest validation loss). On a
setting whose loss drops at a phase change (the synthetic language leaves a
plateau at a step that depends on the seed) one seed's ratio says little.

A setting with a constant learning rate (no warm-up, ``min_lr_ratio`` 1) is
trained once, to the longest horizon, and read at every horizon: its first
300 steps are those of a 300-step run, bit for bit (same batches, same
learning rate). A setting with a schedule is trained once per horizon.

All data is offline and deterministic: three text corpora (the standard
library's source, the interpreter's bundled documentation text, a synthetic
language), scikit-learn's digits; two transformer families and an MLP.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from optim.benchmarks.convergence import ADAMW_BASED, ADAMW_TARGETS, METHODS, TARGETS, run_convergence
from optim.train_job.config import TrainConfig

__all__ = ["HORIZONS", "SETTINGS", "SUITE_BASE", "mean_over_seeds", "run_suite", "worst_case"]

HORIZONS = (300, 1000)
"""Steps at which every setting is judged."""

SUITE_BASE: dict[str, Any] = {
    "nproc": 4,
    "batch": 8,
    "context": 64,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "eval_interval": 100,
    "eval_batches": 8,
    "max_corpus_bytes": 2_000_000,
    "betas": (0.9, 0.95),
}
"""What every setting shares unless it says otherwise: 4 ranks, small models, batch 8 per rank."""

_CONSTANT = {"warmup_steps": 0, "min_lr_ratio": 1.0}
_COSINE = {"warmup_steps": 30, "min_lr_ratio": 0.1}

SETTINGS: dict[str, dict[str, Any]] = {
    "stdlib-encoder-const": {
        "task": "text",
        "corpus": "stdlib",
        "arch": "encoder",
        "d_model": 96,
        "lr": 2e-3,
        "weight_decay": 0.0,
        "grad_clip": 0.0,
        **_CONSTANT,
    },
    "pydoc-gpt-cosine": {
        "task": "text",
        "corpus": "pydoc",
        "arch": "gpt",
        "lr": 3e-3,
        "weight_decay": 0.1,
        "grad_clip": 1.0,
        **_COSINE,
    },
    "synthetic-gpt-const-clip": {
        "task": "text",
        "corpus": "synthetic",
        "arch": "gpt",
        "lr": 2e-3,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        **_CONSTANT,
    },
    "stdlib-gpt-cosine": {
        "task": "text",
        "corpus": "stdlib",
        "arch": "gpt",
        "lr": 3e-3,
        "weight_decay": 0.1,
        "grad_clip": 1.0,
        **_COSINE,
    },
    "digits-mlp-const": {
        "task": "digits",
        "d_model": 128,
        "n_layers": 2,
        "batch": 16,
        "lr": 1e-3,
        "weight_decay": 0.0,
        "grad_clip": 0.0,
        **_CONSTANT,
    },
    "digits-mlp-cosine": {
        "task": "digits",
        "d_model": 128,
        "n_layers": 2,
        "batch": 16,
        "lr": 3e-3,
        "weight_decay": 0.1,
        "grad_clip": 1.0,
        **_COSINE,
    },
}
"""The suite: name -> :class:`TrainConfig` fields over :data:`SUITE_BASE`."""

OnRun = Callable[[str, int, dict[str, Any]], None]


def _is_constant(config: TrainConfig) -> bool:
    return config.warmup_steps == 0 and config.min_lr_ratio == 1.0


def _val_at(run: dict[str, Any], step: int) -> float:
    for e in run["evals"]:
        if e["step"] == step:
            return float(e["val_loss"])
    raise ValueError(f"run {run['name']} has no evaluation at step {step}")


def run_suite(
    settings: Sequence[str] | None = None,
    *,
    horizons: Sequence[int] = HORIZONS,
    densities: Sequence[float] = (0.1, 0.01),
    methods: Sequence[str] = METHODS,
    seeds: Sequence[int] = (0,),
    overrides: dict[str, Any] | None = None,
    on_run: OnRun | None = None,
    runs_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Run the suite; return its record (see the module docstring).

    Args:
        settings: Names from :data:`SETTINGS` (default: all).
        horizons: Steps at which to judge; each must be a multiple of the
            evaluation interval (100).
        densities: Densities of every sparse method.
        methods: Sparse methods (:data:`optim.benchmarks.convergence.METHODS`).
        seeds: Seeds of initialisation and data order; every setting runs once
            per seed and the cells are the means over them (:func:`mean_over_seeds`).
        overrides: TrainConfig fields applied on top of every setting (e.g.
            ``nproc``; not ``seed``, which ``seeds`` sets).
        on_run: Called with ``(setting, steps, run record)`` when a run finishes.
        runs_dir: Each run's record in a file of its own here, taken from it
            when run again at the same commit (see :func:`optim.benchmarks.convergence.run_convergence`).

    Returns:
        ``rows`` (one per setting, horizon and run, over the seeds), ``seed_rows``
        (the same per seed), ``worst`` (:func:`worst_case`), ``settings`` (the
        configs), ``horizons``, ``densities``, ``methods``, ``seeds`` and ``wall_time_s``.

    Raises:
        ValueError: Unknown setting, a horizon the evaluations do not hit, or bad seeds.
        LocalRunError: A rank of a run failed.
    """
    names = list(SETTINGS) if settings is None else list(settings)
    seed_list = [int(x) for x in seeds]
    if not seed_list or len(set(seed_list)) != len(seed_list) or any(x < 0 for x in seed_list):
        raise ValueError(f"seeds must be distinct ints >= 0, got {list(seeds)}")
    if overrides and "seed" in overrides:
        raise ValueError("set the seeds with seeds=, not overrides")
    for n in names:
        if n not in SETTINGS:
            raise ValueError(f"unknown setting {n!r}; known: {', '.join(SETTINGS)}")
    hs = sorted({int(h) for h in horizons})
    if not hs or any(h < 1 for h in hs):
        raise ValueError(f"horizons must be positive, got {list(horizons)}")
    t_all = time.perf_counter()
    rows: list[dict[str, Any]] = []
    configs: dict[str, dict[str, Any]] = {}
    for name in names:
        fields = {**SUITE_BASE, **SETTINGS[name], **(overrides or {})}
        probe = TrainConfig(**fields, steps=hs[-1])
        if any(h % probe.eval_interval for h in hs):
            raise ValueError(f"every horizon must be a multiple of eval_interval={probe.eval_interval}")
        configs[name] = dataclasses.asdict(probe)
        trained = [hs[-1]] if _is_constant(probe) else hs
        for seed in seed_list:
            for steps in trained:
                base = dataclasses.replace(probe, steps=steps, seed=seed)
                bench = run_convergence(
                    base, densities, methods=methods, on_run=_tagged(on_run, name, steps), runs_dir=runs_dir
                )
                judged = [h for h in hs if h <= steps] if steps == hs[-1] and _is_constant(probe) else [steps]
                for h in judged:
                    rows.extend({**r, "seed": seed} for r in _rows_at(name, h, steps, bench["runs"]))
    means = mean_over_seeds(rows)
    return {
        "rows": means,
        "seed_rows": rows,
        "seeds": seed_list,
        "worst": worst_case(means),
        "settings": configs,
        "horizons": hs,
        "densities": list(densities),
        "methods": list(methods),
        "targets": {str(d): r for d, r in TARGETS.items()},
        "wall_time_s": time.perf_counter() - t_all,
    }


def _tagged(on_run: OnRun | None, setting: str, steps: int) -> Callable[[dict[str, Any]], None] | None:
    if on_run is None:
        return None
    return lambda record: on_run(setting, steps, record)


def _rows_at(setting: str, horizon: int, trained: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {r["name"]: r for r in runs}
    ref_s, ref_w = _val_at(by["adams"], horizon), _val_at(by["adamw"], horizon)
    wire_ref = by["adams"]["optimizer_wire_bytes_per_step"]
    dense_rise = max(by["adams"]["largest_loss_rise"], by["adamw"]["largest_loss_rise"])
    out = []
    for r in runs:
        v = _val_at(r, horizon)
        out.append(
            {
                "setting": setting,
                "horizon": horizon,
                "trained_steps": trained,
                "name": r["name"],
                "optimizer": r["optimizer"]["name"],
                "density": r["density"],
                "val_loss": v,
                "ratio_to_adams": v / ref_s,
                "ratio_to_adamw": v / ref_w,
                "optimizer_wire_bytes_per_step": r["optimizer_wire_bytes_per_step"],
                "wire_ratio_to_adams": r["optimizer_wire_bytes_per_step"] / wire_ref if wire_ref else None,
                "largest_loss_rise": r["largest_loss_rise"],
                "dense_largest_loss_rise": dense_rise,
                "evals": r["evals"],
            }
        )
    return out


def mean_over_seeds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per setting, horizon and run from per-seed rows (each with ``seed``): means over the seeds.

    ``val_loss`` is the mean over the seeds, the ratios are ratios of those
    means (to dense AdamS's and AdamW's of the same seeds), wire bytes are the
    mean, a loss rise the largest of any seed; ``seed_ratios`` keeps each
    seed's own ratio to dense AdamS, ``dense_seed_spread`` dense AdamS's largest
    over its smallest validation loss, and ``evals`` maps each seed to its
    evaluations.
    """
    cells: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["setting"], r["horizon"], r["name"]), []).append(r)

    def mean(key: tuple[str, int, str], field: str) -> float:
        rs = cells[key]
        return sum(float(r[field]) for r in rs) / len(rs)

    out = []
    for (setting, horizon, name), rs in cells.items():
        seeds = sorted(r["seed"] for r in rs)
        ref_s, ref_w = (setting, horizon, "adams"), (setting, horizon, "adamw")
        if sorted(r["seed"] for r in cells[ref_s]) != seeds:
            raise ValueError(f"{setting}@{horizon} {name}: seeds {seeds} differ from dense AdamS's")
        dense = [float(r["val_loss"]) for r in cells[ref_s]]
        val = mean((setting, horizon, name), "val_loss")
        wires = [r["wire_ratio_to_adams"] for r in rs]
        out.append(
            {
                "setting": setting,
                "horizon": horizon,
                "trained_steps": rs[0]["trained_steps"],
                "name": name,
                "optimizer": rs[0]["optimizer"],
                "density": rs[0]["density"],
                "seeds": seeds,
                "val_loss": val,
                "ratio_to_adams": val / mean(ref_s, "val_loss"),
                "ratio_to_adamw": val / mean(ref_w, "val_loss"),
                "reference": reference(rs[0]["optimizer"]),
                "seed_ratios": [r[ratio_key(r)] for r in sorted(rs, key=lambda r: r["seed"])],
                "dense_seed_spread": max(dense) / min(dense),
                "optimizer_wire_bytes_per_step": mean((setting, horizon, name), "optimizer_wire_bytes_per_step"),
                "wire_ratio_to_adams": None if None in wires else sum(wires) / len(wires),
                "largest_loss_rise": max(r["largest_loss_rise"] for r in rs),
                "dense_largest_loss_rise": max(r["dense_largest_loss_rise"] for r in rs),
                "evals": {str(r["seed"]): r["evals"] for r in rs},
            }
        )
    return out


def reference(optimizer: str) -> str:
    """The dense run a method is judged against: ``"adamw"`` for the AdamW-based ones, else ``"adams"``."""
    return "adamw" if optimizer in ADAMW_BASED else "adams"


def ratio_key(row: dict[str, Any]) -> str:
    """The field of ``row`` holding its ratio to its own dense reference (:func:`reference`)."""
    return f"ratio_to_{reference(row.get('optimizer', ''))}"


def worst_case(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per run name: the worst ratio to its dense reference at each horizon, where it happened, and the verdict.

    The reference is dense AdamS, or dense AdamW for the AdamW-based methods
    (:func:`reference`); the target (:data:`TARGETS`, or :data:`ADAMW_TARGETS`,
    at the run's density) applies to every sparse method; it is met when the
    worst ratio at every horizon is within it.
    """
    out: dict[str, Any] = {}
    for r in rows:
        blank = {"density": r["density"], "by_horizon": {}, "reference": reference(r.get("optimizer", ""))}
        w = out.setdefault(r["name"], blank)
        h = w["by_horizon"].setdefault(str(r["horizon"]), {"ratio": 0.0, "setting": None})
        if r[ratio_key(r)] > h["ratio"]:
            h["ratio"], h["setting"] = r[ratio_key(r)], r["setting"]
            if "seed_ratios" in r:
                h["seed_ratios"] = r["seed_ratios"]
    for name, w in out.items():
        targets = ADAMW_TARGETS if w["reference"] == "adamw" else TARGETS
        limit = targets.get(w["density"]) if "@" in name else None
        w["max_ratio"] = limit
        w["met"] = None if limit is None else all(h["ratio"] <= limit for h in w["by_horizon"].values())
    return out
