"""Persistent checkpoint benchmark: bytes per checkpoint (full and delta), write and restore time, overhead.

For each optimizer (SCAPE at each density, dense ShardedAdamS) it runs the
resilient train job (:func:`optim.apps.train_job.resilient_job.run_resilient_training`,
``nproc`` local gloo ranks, no failure) twice with the same seed:

1. **with checkpoints** every ``every`` committed steps into a fresh
   directory (``full_every``: a full file at least every that many, deltas
   between; every file kept), and
2. **without** persistent checkpoints (the in-memory snapshots stay on in both),
3. with ``lossy``, once more **with lossy checkpoints** (full files keep the
   first moment in bfloat16, :mod:`optim.state.lossy`) into another directory;
   then two runs resume, one from each directory's newest checkpoint, and
   train ``resume_steps`` more steps: the validation loss at their end
   (``val_loss_lossless``, ``val_loss_lossy``, over ``eval_batches``
   batches) is what the rounding costs the model; the lossless resume is
   the uninterrupted run, bit for bit.

From the first run's files it reports, per slot file, the bytes of full and
of delta files (``delta_ratio`` = median full / median delta, what a delta
saves losslessly) and the bytes written per checkpoint on average; from its
workers, the median wall time of one write on the writer thread
(``write_ms_full`` / ``write_ms_delta``: encode, write, ``fsync``, rename,
retention; the thread runs at nice 19, so this is mostly time it waited for
a core); and, in this process, the time to restore the newest step of
every slot, chain of deltas included (``restore_ms``; ``restore_ms_full``:
one full file).

Critical-path overhead: the write runs on the replication thread while the
next step runs, so the step time is what it costs. ``overhead_fraction`` is
the mean step time of run 1 over that of run 2, minus 1 (steps after
``skip_steps``, the last one left out; each step's time is the max over
ranks). Two runs on a shared 2-core machine differ by a few percent on
their own, so ``overhead_in_run`` also compares, within run 1, the steps
that overlap a write (the one after each checkpoint) with the others,
spread over the ``every`` steps of a period. Nothing prints here;
:mod:`optim.apps.cli.bench_checkpoint` does.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bindings.json_object import JsonObject
from bindings.validate import check_int
from optim.apps.train_job.job_config import TrainConfig
from optim.apps.train_job.resilient_job import ResilienceConfig, run_resilient_training
from optim.state.checkpoint import CheckpointStore
from optim.state.run_stats import SlotFileInfo
from optim.state.snapshot import decode_tree

__all__ = ["PersistBenchConfig", "checkpoint_files", "run_persist_bench", "step_times"]


@dataclass(frozen=True, kw_only=True)
class PersistBenchConfig:
    """What to measure.

    Attributes:
        densities: SCAPE densities (one row each).
        dense: Also a row for dense ShardedAdamS.
        lossy: Also measure lossy checkpoints (bytes, and the validation loss after a resume).
        resume_steps: Steps the resumed runs train after the newest checkpoint.
        eval_batches: Validation batches of the resumed runs' final evaluation.
        d_model, n_layers: The model.
        steps: Steps of each run.
        every: Committed steps between checkpoints.
        full_every: A full file at least every this many checkpoints of a slot.
        nproc: Workers.
        skip_steps: First steps left out of the step times (start-up, SCAPE's dense warm-up).
        sparse_warmup_steps: SCAPE's dense steps before sparsity starts.
        batch, context, threads, seed: The train job's.
        timeout_s: Deadline of each job.
        out: Directory of the jobs' files.
    """

    densities: tuple[float, ...] = (0.01, 0.1)
    dense: bool = True
    lossy: bool = True
    resume_steps: int = 40
    eval_batches: int = 8
    d_model: int = 256
    n_layers: int = 4
    steps: int = 81
    every: int = 10
    full_every: int = 8
    nproc: int = 2
    skip_steps: int = 10
    sparse_warmup_steps: int = 4
    batch: int = 16
    context: int = 64
    threads: int = 1
    seed: int = 0
    timeout_s: float = 900.0
    out: str = "runs/bench_checkpoint_persist"

    def __post_init__(self) -> None:
        if not self.densities and not self.dense:
            raise ValueError("densities: give at least one, or dense=True")
        if any(not 0.0 < d < 1.0 for d in self.densities):
            raise ValueError(f"densities: each must be in (0, 1), got {self.densities!r}")
        for name, low in (
            ("d_model", 8),
            ("n_layers", 1),
            ("every", 1),
            ("full_every", 1),
            ("nproc", 1),
            ("skip_steps", 0),
            ("sparse_warmup_steps", 0),
            ("batch", 1),
            ("context", 1),
            ("threads", 1),
            ("seed", 0),
            ("resume_steps", 1),
            ("eval_batches", 1),
        ):
            check_int(name, getattr(self, name), low=low)
        if check_int("steps", self.steps) < self.skip_steps + 3 * self.every:
            raise ValueError(
                f"steps: need >= skip_steps + 3 * every = {self.skip_steps + 3 * self.every}, got {self.steps!r}"
            )
        if not self.timeout_s > 0:
            raise ValueError("timeout_s must be > 0")

    def train_config(self, optimizer: str, density: float, out: str, steps: int = 0) -> TrainConfig:
        """The train job of one run (validation only at the last step, which is not timed)."""
        return TrainConfig(
            steps=steps or self.steps,
            nproc=self.nproc,
            optimizer=optimizer,
            density=density,
            sparse_warmup_steps=self.sparse_warmup_steps,
            batch=self.batch,
            context=self.context,
            d_model=self.d_model,
            n_layers=self.n_layers,
            eval_interval=0,
            eval_batches=self.eval_batches if steps else 1,
            threads=self.threads,
            seed=self.seed,
            job_timeout_s=self.timeout_s,
            out=out,
        )


def step_times(events: list[JsonObject]) -> dict[int, float]:
    """Seconds of each committed step, the max over ranks (the step's critical path)."""
    out: dict[int, float] = {}
    for e in events:
        if e.get("event") == "committed" and e.get("source", "worker") == "worker" and "step_s" in e:
            s = int(e["step"])
            out[s] = max(out.get(s, 0.0), float(e["step_s"]))
    return out


def checkpoint_files(store: CheckpointStore) -> list[SlotFileInfo]:
    """The header of every file in ``store`` (:meth:`CheckpointStore.file_info`), oldest step first."""
    rows = []
    for step in store.steps():
        for path in sorted(store.step_dir(step).glob("slot-*.ckpt")):
            rows.append(store.file_info(step, int(path.stem.split("-")[1])))
    return rows


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _restore_times(store: CheckpointStore, world: int, fingerprint: str) -> JsonObject:
    """Milliseconds to read and decode the newest step (its chain of deltas) and one full file, worst slot."""
    newest = store.complete_steps(world)[-1]

    def best_ms(step: int, slot: int) -> float:  # best of 3: the first read of a process pays torch's warm-up
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            decode_tree(store.read(step, slot, world, fingerprint))
            times.append(time.perf_counter() - t0)
        return 1e3 * min(times)

    restore = [best_ms(newest, slot) for slot in range(world)]
    restore_full = [best_ms(store.chain(newest, slot)[-1], slot) for slot in range(world)]
    return {
        "restore_ms": max(restore),
        "restore_ms_full": max(restore_full),
        "chain_files": max(len(store.chain(newest, s)) for s in range(world)),
    }


def _run(config: PersistBenchConfig, name: str, label: str, train: TrainConfig, res: ResilienceConfig) -> Any:
    run = run_resilient_training(train, res, Path(train.out))
    if run["status"] != 0:
        raise RuntimeError(f"persist bench: {name} run {label} exited with {run['status']}")
    return run


def _lossy(config: PersistBenchConfig, name: str, optimizer: str, density: float, ckpt: Path) -> JsonObject:
    """The lossy run's files, and the validation loss of a resume from its checkpoint and from ``ckpt``'s."""
    base = Path(config.out) / name
    lossy_ckpt = base / "checkpoints-lossy"
    shutil.rmtree(lossy_ckpt, ignore_errors=True)
    res = ResilienceConfig(
        spares=0,
        checkpoint_dir=str(lossy_ckpt),
        checkpoint_every=config.every,
        keep_checkpoints=config.steps,
        full_checkpoint_every=config.full_every,
        lossy_checkpoints=True,
    )
    _run(config, name, "lossy", config.train_config(optimizer, density, str(base / "lossy")), res)
    files = checkpoint_files(CheckpointStore(lossy_ckpt, keep=config.steps))
    packed = [f.disk_bytes for f in files if f.kind == "lossy"]
    out: JsonObject = {
        "bytes_lossy": _median([float(b) for b in packed]),
        "bytes_per_checkpoint_lossy": sum(f.disk_bytes for f in files) / max(1, len({f.step for f in files})),
    }
    total = config.steps + config.resume_steps
    for label, directory in (("lossless", ckpt), ("lossy", lossy_ckpt)):
        train = config.train_config(optimizer, density, str(base / f"resume-{label}"), steps=total)
        res = ResilienceConfig(spares=0, checkpoint_dir=str(directory), checkpoint_every=10 * total, resume=True)
        run = _run(config, name, f"resumed from the {label} checkpoint", train, res)
        out[f"val_loss_{label}"] = float(run["evals"][max(run["evals"])])
    out["val_loss_ratio"] = out["val_loss_lossy"] / out["val_loss_lossless"]
    return out


def _row(config: PersistBenchConfig, optimizer: str, density: float) -> JsonObject:
    name = optimizer if optimizer != "scape" else f"scape-{density:g}"
    base = Path(config.out) / name
    ckpt = base / "checkpoints"
    shutil.rmtree(ckpt, ignore_errors=True)
    runs = {}
    for label, res in (
        (
            "with",
            ResilienceConfig(
                spares=0,
                checkpoint_dir=str(ckpt),
                checkpoint_every=config.every,
                keep_checkpoints=config.steps,
                full_checkpoint_every=config.full_every,
            ),
        ),
        ("without", ResilienceConfig(spares=0)),
    ):
        runs[label] = _run(config, name, label, config.train_config(optimizer, density, str(base / label)), res)
    store = CheckpointStore(ckpt, keep=config.steps, full_every=config.full_every)
    files = checkpoint_files(store)
    full = [f.disk_bytes for f in files if f.kind == "full"]
    delta = [f.disk_bytes for f in files if f.kind == "delta"]
    n_ckpt = len({f.step for f in files})
    fingerprint = files[0].fingerprint
    lo, hi = config.skip_steps, config.steps
    with_t = {s: t for s, t in step_times(runs["with"]["events"]).items() if lo < s < hi}
    without_t = {s: t for s, t in step_times(runs["without"]["events"]).items() if lo < s < hi}
    common = sorted(set(with_t) & set(without_t))
    mean_with = statistics.fmean(with_t[s] for s in common)
    mean_without = statistics.fmean(without_t[s] for s in common)
    overlapping = [t for s, t in with_t.items() if (s - 1) % config.every == 0]
    others = [t for s, t in with_t.items() if (s - 1) % config.every != 0]
    extra = (statistics.median(overlapping) - statistics.median(others)) if overlapping and others else None
    row: JsonObject = {
        "name": name,
        "optimizer": optimizer,
        "density": density,
        "checkpoints": n_ckpt,
        "files_full": len(full),
        "files_delta": len(delta),
        "bytes_full": _median([float(b) for b in full]),
        "bytes_delta": _median([float(b) for b in delta]),
        "delta_ratio": statistics.median(full) / statistics.median(delta) if full and delta else None,
        "bytes_per_checkpoint": sum(full + delta) / max(1, n_ckpt),
        "bytes_per_checkpoint_all_full": sum(f.full_bytes for f in files) / max(1, n_ckpt),
        "step_ms_with": 1e3 * mean_with,
        "step_ms_without": 1e3 * mean_without,
        "overhead_fraction": mean_with / mean_without - 1.0,
        "overhead_in_run": None if extra is None else extra / config.every / statistics.median(others),
        "losses_agree": runs["with"]["losses"] == runs["without"]["losses"],
    }
    writes = [w for r in runs["with"]["results"].values() for w in r.get("checkpoints", [])]
    for kind in ("full", "delta"):
        secs = [float(w["seconds"]) for w in writes if w["kind"] == kind]
        row[f"write_ms_{kind}"] = 1e3 * statistics.median(secs) if secs else None
    row.update(_restore_times(store, config.nproc, fingerprint))
    if config.lossy:
        row.update(_lossy(config, name, optimizer, density, ckpt))
    return row


def run_persist_bench(config: PersistBenchConfig, *, on_row: Callable[[JsonObject], None] | None = None) -> JsonObject:
    """Run every optimizer's pair of runs; return ``config`` and ``rows``."""
    t0 = time.time()
    specs = [("scape", d) for d in config.densities] + ([("adams", 1.0)] if config.dense else [])
    rows = []
    for optimizer, density in specs:
        row = _row(config, optimizer, density)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return {"config": dataclasses.asdict(config), "rows": rows, "wall_time_s": time.time() - t0}
