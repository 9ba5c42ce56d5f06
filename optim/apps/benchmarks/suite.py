"""The convergence suite: every optimizer on settings that differ in data, model family and schedule.

One setting alone can be fooled (defaults tuned on it, a schedule that hides a
slow method); the suite runs :func:`optim.apps.benchmarks.convergence.run_convergence` on each
setting of a split (:mod:`optim.apps.benchmarks.suite_settings`: the tuning split
every default was chosen on, the held-out split that judges them, or both) at
each horizon (300 and 1,000 steps unless a setting has its own), with the
same seeds and data order for every optimizer, and reduces the result to:

* per setting and horizon, each run's validation loss, its ratio to dense
  ShardedAdamS, to ShardedAdamW and to the better of the two
  (``ratio_to_best_dense``), its optimizer wire bytes per step (and
  their ratio to dense AdamS's), and its largest training-loss rise after the
  warm-up next to the largest rise of the dense runs;
* per method and density, the worst ratio over the whole suite at each
  horizon, and whether it meets :data:`optim.apps.benchmarks.convergence.TARGETS`.

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

All data is offline and deterministic: four text corpora (the standard
library's source, the interpreter's bundled documentation text, a synthetic
language, torch's docstrings), scikit-learn's digits; two transformer
families, a GRU, an MLP and a CNN.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bindings.json_object import JsonObject
from optim.apps.benchmarks.convergence import ADAMW_BASED, ADAMW_TARGETS, METHODS, TARGETS, run_convergence
from optim.apps.benchmarks.suite_settings import (
    DEFAULT_SEEDS,
    FIRST_HELDOUT_SEED,
    HELDOUT_SEEDS,
    HELDOUT_SETTINGS,
    HORIZONS,
    SETTING_HORIZONS,
    SETTINGS,
    SPLITS,
    SUITE_BASE,
    TUNING_SETTINGS,
    split_of,
)
from optim.apps.train_job.job_config import TrainConfig

__all__ = [
    "HELDOUT_SEEDS",
    "best_dense",
    "HELDOUT_SETTINGS",
    "HORIZONS",
    "SETTINGS",
    "SPLITS",
    "SUITE_BASE",
    "TUNING_SETTINGS",
    "mean_over_seeds",
    "run_suite",
    "worst_case",
]

logger = logging.getLogger(__name__)


OnRun = Callable[[str, int, JsonObject], None]


def _is_constant(config: TrainConfig) -> bool:
    return config.warmup_steps == 0 and config.min_lr_ratio == 1.0


def _val_at(run: JsonObject, step: int) -> float:
    for e in run["evals"]:
        if e["step"] == step:
            return float(e["val_loss"])
    raise ValueError(f"run {run['name']} has no evaluation at step {step}")


def run_suite(
    settings: Sequence[str] | None = None,
    *,
    split: str = "tuning",
    horizons: Sequence[int] | None = None,
    densities: Sequence[float] = (0.1, 0.01),
    methods: Sequence[str] = METHODS,
    seeds: Sequence[int] | None = None,
    overrides: JsonObject | None = None,
    on_run: OnRun | None = None,
    runs_dir: str | Path | None = None,
    reuse: str = "commit",
) -> JsonObject:
    """Run the suite; return its record (see the module docstring).

    Args:
        settings: Names of settings of ``split`` (default: every setting of it).
        split: ``"tuning"``, ``"heldout"`` or ``"all"`` (:data:`SPLITS`): the
            settings run by default and the only ones admitted.
        horizons: Steps at which to judge every setting; each must be a
            multiple of the evaluation interval (100). Default: each setting's
            own (:data:`SETTING_HORIZONS`, else :data:`HORIZONS`).
        densities: Densities of every sparse method.
        methods: Sparse methods (:data:`optim.apps.benchmarks.convergence.METHODS`).
        seeds: Seeds of initialisation and data order; every setting runs once
            per seed and the cells are the means over them (:func:`mean_over_seeds`).
            Default: each setting's split's own (:data:`DEFAULT_SEEDS`: 0 for
            the tuning split, :data:`HELDOUT_SEEDS` for the held-out one).
        overrides: TrainConfig fields applied on top of every setting (e.g.
            ``nproc``; not ``seed``, which ``seeds`` sets).
        on_run: Called with ``(setting, steps, run record)`` when a run finishes.
        runs_dir: Each run's record in a file of its own here, taken from it
            when run again at the same commit (see :func:`optim.apps.benchmarks.convergence.run_convergence`).
        reuse: Which run files to take: ``"commit"``, ``"any"`` or ``"none"`` (as ``run_convergence``).

    Returns:
        ``rows`` (one per setting, horizon and run, over the seeds), ``seed_rows``
        (the same per seed), ``worst`` (:func:`worst_case`), ``settings`` (the
        configs), ``split``, ``split_seeds`` (the seeds of each split that ran),
        ``seeds`` (all of them), ``setting_horizons``, ``horizons`` (all of
        them), ``densities``, ``methods`` and ``wall_time_s``.

    Raises:
        ValueError: Unknown split or setting, a setting outside the split, a
            horizon the evaluations do not hit, or bad seeds.
        LocalRunError: A rank of a run failed.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    names = list(SPLITS[split]) if settings is None else list(settings)
    if not names:
        raise ValueError("no settings to run")
    for n in names:
        if split_of(n) != split and split != "all":
            raise ValueError(f"setting {n!r} is in the {split_of(n)} split, not the {split} split")
    seeds_of = {sp: _check_seeds(DEFAULT_SEEDS[sp] if seeds is None else seeds) for sp in {split_of(n) for n in names}}
    if overrides and "seed" in overrides:
        raise ValueError("set the seeds with seeds=, not overrides")
    if any(x < FIRST_HELDOUT_SEED for x in seeds_of.get("heldout", ())):
        logger.warning("suite: held-out settings on seeds below %d, the tuning seeds", FIRST_HELDOUT_SEED)
    own = {n: _check_horizons(SETTING_HORIZONS.get(n, HORIZONS) if horizons is None else horizons) for n in names}
    t_all = time.perf_counter()
    rows: list[JsonObject] = []
    configs: dict[str, JsonObject] = {}
    for name in names:
        hs = own[name]
        fields = {**SUITE_BASE, **SETTINGS[name], **(overrides or {})}
        probe = TrainConfig(**fields, steps=hs[-1])
        if any(h % probe.eval_interval for h in hs):
            raise ValueError(f"every horizon must be a multiple of eval_interval={probe.eval_interval}")
        configs[name] = dataclasses.asdict(probe)
        trained = [hs[-1]] if _is_constant(probe) else hs
        for seed in seeds_of[split_of(name)]:
            for steps in trained:
                base = dataclasses.replace(probe, steps=steps, seed=seed)
                tagged = _tagged(on_run, name, steps)
                bench = run_convergence(base, densities, methods=methods, on_run=tagged, runs_dir=runs_dir, reuse=reuse)
                judged = [h for h in hs if h <= steps] if steps == hs[-1] and _is_constant(probe) else [steps]
                for h in judged:
                    rows.extend({**r, "seed": seed} for r in _rows_at(name, h, steps, bench["runs"]))
    means = mean_over_seeds(rows)
    return {
        "rows": means,
        "seed_rows": rows,
        "split": split,
        "split_seeds": {sp: list(x) for sp, x in sorted(seeds_of.items())},
        "seeds": sorted({x for ss in seeds_of.values() for x in ss}),
        "worst": worst_case(means),
        "settings": configs,
        "setting_horizons": {n: list(hs) for n, hs in own.items()},
        "horizons": sorted({h for hs in own.values() for h in hs}),
        "densities": list(densities),
        "methods": list(methods),
        "targets": {str(d): r for d, r in TARGETS.items()},
        "wall_time_s": time.perf_counter() - t_all,
    }


def _check_seeds(seeds: Sequence[int]) -> list[int]:
    out = [int(x) for x in seeds]
    if not out or len(set(out)) != len(out) or any(x < 0 for x in out):
        raise ValueError(f"seeds must be distinct ints >= 0, got {list(seeds)}")
    return out


def _check_horizons(horizons: Sequence[int]) -> list[int]:
    hs = sorted({int(h) for h in horizons})
    if not hs or any(h < 1 for h in hs):
        raise ValueError(f"horizons must be positive, got {list(horizons)}")
    return hs


def _tagged(on_run: OnRun | None, setting: str, steps: int) -> Callable[[JsonObject], None] | None:
    if on_run is None:
        return None
    return lambda record: on_run(setting, steps, record)


def _rows_at(setting: str, horizon: int, trained: int, runs: list[JsonObject]) -> list[JsonObject]:
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
                "ratio_to_best_dense": v / min(ref_s, ref_w),
                "best_dense": best_dense(ref_s, ref_w),
                "optimizer_wire_bytes_per_step": r["optimizer_wire_bytes_per_step"],
                "wire_ratio_to_adams": r["optimizer_wire_bytes_per_step"] / wire_ref if wire_ref else None,
                "largest_loss_rise": r["largest_loss_rise"],
                "dense_largest_loss_rise": dense_rise,
                "evals": r["evals"],
            }
        )
    return out


def mean_over_seeds(rows: list[JsonObject]) -> list[JsonObject]:
    """One row per setting, horizon and run from per-seed rows (each with ``seed``): means over the seeds.

    ``val_loss`` is the mean over the seeds, the ratios are ratios of those
    means (to dense AdamS's, AdamW's and the smaller of the two, of the same
    seeds; ``best_dense`` names that one), wire bytes are the
    mean, a loss rise the largest of any seed; ``seed_ratios`` keeps each
    seed's own ratio to dense AdamS, ``dense_seed_spread`` dense AdamS's largest
    over its smallest validation loss, and ``evals`` maps each seed to its
    evaluations.
    """
    cells: dict[tuple[str, int, str], list[JsonObject]] = {}
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
        mean_s, mean_w = mean(ref_s, "val_loss"), mean(ref_w, "val_loss")
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
                "ratio_to_adams": val / mean_s,
                "ratio_to_adamw": val / mean_w,
                "ratio_to_best_dense": val / min(mean_s, mean_w),
                "best_dense": best_dense(mean_s, mean_w),
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


def best_dense(adams: float, adamw: float) -> str:
    """The better dense run of a cell from its validation losses: ``"adams"`` unless AdamW's is lower."""
    return "adamw" if adamw < adams else "adams"


def reference(optimizer: str) -> str:
    """The dense run a method is judged against: ``"adamw"`` for the AdamW-based ones, else ``"adams"``."""
    return "adamw" if optimizer in ADAMW_BASED else "adams"


def ratio_key(row: JsonObject) -> str:
    """The field of ``row`` holding its ratio to its own dense reference (:func:`reference`)."""
    return f"ratio_to_{reference(row.get('optimizer', ''))}"


def worst_case(rows: list[JsonObject]) -> JsonObject:
    """Per run name: the worst ratio to its dense reference at each horizon, where it happened, and the verdict.

    The reference is dense AdamS, or dense AdamW for the AdamW-based methods
    (:func:`reference`); the target (:data:`TARGETS`, or :data:`ADAMW_TARGETS`,
    at the run's density) applies to every sparse method; it is met when the
    worst ratio at every horizon is within it.
    """
    out: JsonObject = {}
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
