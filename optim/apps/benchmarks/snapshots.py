"""Checkpoint benchmark: the cost of in-memory snapshots (DeadPool-style checkpointing) and of restoring one.

For each optimizer (SCAPE at ``density``, dense ShardedAdamS) and model size it
runs the resilient train job (:func:`optim.apps.train_job.resilient_job.run_resilient_training`,
``nproc`` local gloo ranks) twice:

1. **Overhead run** (no failure): snapshots alternate in blocks of ``block``
   steps with a snapshot and ``block`` steps without
   (``ResilienceConfig.snapshot_block``); every ``committed`` event carries the
   step time and whether the step took a snapshot. A step's time includes the
   wait for the previous snapshot's copy (``_settle``) and the submission of
   its own, while the *replication* of step ``t`` (send to the buddy, receive
   the ward's) runs on a background thread during step ``t + 1``. So the first
   step of a block is a transition (an "off" step still carries the last
   snapshot's replication; an "on" step has none to overlap) and is left out:
   ``on`` = steps 2..block of the snapshot blocks (the steady state of a
   snapshot after every step), ``off`` = steps 2..block of the blocks without.
   Per step the time is the max over ranks; the medians of both sets give
   ``overhead = (on - off) / off``. The run also reports the host bytes of the
   own and ward rings per rank and the replication rate ``replicated_bytes /
   replication_busy_s`` (busy time = encode + copies + exchange + ack).
2. **Recovery run**: snapshots after every step, slot 1 is SIGKILLed while
   ``kill_step`` runs and a spare takes its place (hot-swap). The phases come
   from the coordinator's and the workers' events
   (:func:`optim.apps.train_job.resilient_job.failure_timeline` and the ``restored`` events'
   ``phases``: :class:`optim.resilient.RecoveryPhases`).

Separately, :func:`run_loopback` times a large snapshot (``loopback_bytes``)
between 2 local ranks over the same side channel the replicator uses (a
:class:`~resilient_comm.FaultAwareCommunicator` with ``side_channel=True``):
a one-way send (acknowledged by 8 bytes) and the
:class:`~optim.state.snapshot.Replicator`'s exchange (both ranks send and receive at
once, plus its copies into the wire buffer and the ward ring).

Times are wall-clock on a shared machine: medians, but noisy. Nothing prints
here; :mod:`optim.apps.cli.bench_checkpoint` does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from bindings.json_object import JsonObject
from bindings.validate import check_density, check_int
from optim.apps.paths import pythonpath_env
from optim.apps.train_job.resilient_job import ResilienceConfig, failure_timeline, run_resilient_training
from optim.apps.train_job.train import TrainConfig
from resilient_comm.launcher import LaunchConfig, Launcher

__all__ = [
    "CheckpointBenchConfig",
    "RECOVERY_PHASES",
    "overhead_from_events",
    "recovery_split",
    "run_loopback",
    "run_checkpoint_bench",
]

#: Columns of the recovery split, in order (seconds; ``total_s`` is kill to resumed).
RECOVERY_PHASES = (
    "detect_s",
    "reconfigure_s",
    "agree_s",
    "transfer_s",
    "restore_s",
    "resnapshot_s",
    "resume_s",
    "total_s",
)
_OPTIMIZERS = ("scape", "adams")


@dataclass(frozen=True, kw_only=True)
class CheckpointBenchConfig:
    """What to measure.

    Attributes:
        optimizers: ``scape`` and/or ``adams`` (dense ShardedAdamS).
        density: SCAPE's density.
        models: ``(d_model, n_layers, steps)`` per model size: the overhead run's steps.
        nproc: Workers.
        spares: Spares (the recovery run needs >= 1: hot-swap).
        block: Steps per snapshot / no-snapshot block of the overhead run (>= 2).
        skip_steps: First steps left out of the overhead medians (start-up, SCAPE's dense warm-up).
        sparse_warmup_steps: SCAPE's dense steps before sparsity starts.
        kill_step: The recovery run kills slot 1 while this step runs.
        steps_after_kill: Steps the recovery run goes on after ``kill_step``.
        batch: Sequences per rank per step.
        context: Tokens per sequence.
        threads: torch threads per rank.
        heartbeat_timeout_s: Silence after which a worker counts as hung (a SIGKILL is detected by
            the process exit, not by this; generous so that slow start-ups on a loaded machine
            are not taken for hangs).
        loopback_bytes: Size of the loopback snapshot (0: skip the loopback).
        loopback_iters: Timed loopback transfers (one more is a warm-up).
        seed: Seed of the initialisation and data order.
        timeout_s: Deadline of each job.
        out: Directory of the jobs' event files.
    """

    optimizers: tuple[str, ...] = _OPTIMIZERS
    density: float = 0.01
    models: tuple[tuple[int, int, int], ...] = ((128, 2, 60), (384, 4, 42))
    nproc: int = 3
    spares: int = 1
    block: int = 3
    skip_steps: int = 5
    sparse_warmup_steps: int = 4
    kill_step: int = 8
    steps_after_kill: int = 4
    batch: int = 16
    context: int = 64
    threads: int = 1
    heartbeat_timeout_s: float = 5.0
    loopback_bytes: int = 256 << 20
    loopback_iters: int = 3
    seed: int = 0
    timeout_s: float = 900.0
    out: str = "runs/bench_checkpoint"

    def __post_init__(self) -> None:
        if not self.optimizers or any(o not in _OPTIMIZERS for o in self.optimizers):
            raise ValueError(f"optimizers: choose from {_OPTIMIZERS}, got {self.optimizers!r}")
        if not self.models or any(len(m) != 3 for m in self.models):
            raise ValueError(f"models: expected (d_model, n_layers, steps) positive int triples, got {self.models!r}")
        for m in self.models:
            for v in m:
                check_int("models entry", v, low=1)
        for name, low in (
            ("nproc", 3),
            ("spares", 1),
            ("block", 2),
            ("skip_steps", 0),
            ("sparse_warmup_steps", 0),
            ("kill_step", 2),
            ("steps_after_kill", 1),
            ("batch", 1),
            ("context", 1),
            ("threads", 1),
            ("loopback_bytes", 0),
            ("loopback_iters", 1),
            ("seed", 0),
        ):
            check_int(name, getattr(self, name), low=low)
        for d, _, steps in self.models:
            if steps < self.skip_steps + 2 * self.block + 1:
                raise ValueError(
                    f"models: {steps} steps of d_model {d} leave no full on/off block pair after "
                    f"skip_steps={self.skip_steps} (need >= {self.skip_steps + 2 * self.block + 1})"
                )
        check_density(self.density)
        if not self.heartbeat_timeout_s > 0 or not self.timeout_s > 0:
            raise ValueError("heartbeat_timeout_s and timeout_s must be > 0")
        for d, layers, _ in self.models:
            self.train_config("adams", d, layers, 2)  # validates the model shape

    def train_config(self, optimizer: str, d_model: int, n_layers: int, steps: int, out: str = "") -> TrainConfig:
        """The train job of one run (validation only at the last step, which is not timed)."""
        return TrainConfig(
            steps=steps,
            nproc=self.nproc,
            optimizer=optimizer,
            density=self.density,
            sparse_warmup_steps=self.sparse_warmup_steps,
            batch=self.batch,
            context=self.context,
            d_model=d_model,
            n_layers=n_layers,
            eval_interval=0,
            eval_batches=1,
            threads=self.threads,
            seed=self.seed,
            job_timeout_s=self.timeout_s,
            out=out or self.out,
        )


# ---------------------------------------------------------------------------------------------- analysis
def overhead_from_events(events: list[JsonObject], *, block: int, skip_steps: int, last_step: int) -> JsonObject:
    """Median step time with and without a snapshot from the ``committed`` events of an alternating run.

    Each step's time is the max over ranks. ``on``: steps of a snapshot block
    after its first; ``off``: the same of a block without. Steps up to
    ``skip_steps`` and ``last_step`` (validation) are left out.
    ``overhead_paired_median``: the median over (snapshot block, next block
    without) pairs of their median step times' ratio minus 1, less sensitive
    to the load of a shared machine drifting during the run.
    """
    per_step: dict[int, float] = {}
    snap: dict[int, bool] = {}
    for e in events:
        if e.get("event") != "committed" or "snapshot" not in e:
            continue
        s = int(e["step"])
        per_step[s] = max(per_step.get(s, 0.0), float(e["step_s"]))
        snap[s] = bool(e["snapshot"])
    on: list[float] = []
    off: list[float] = []
    by_block: dict[int, list[float]] = {}
    for s, t in sorted(per_step.items()):
        if s <= skip_steps or s >= last_step or (s - 1) % block == 0 or s - 1 not in snap:
            continue
        if snap[s] != snap[s - 1]:  # not a block position this bench expects
            continue
        (on if snap[s] else off).append(t)
        by_block.setdefault((s - 1) // block, []).append(t)
    # paired: each snapshot block against the block without that follows it (cancels slow load drifts)
    paired = [
        statistics.median(by_block[b]) / statistics.median(by_block[b + 1]) - 1.0
        for b in sorted(by_block)
        if b % 2 == 0 and b + 1 in by_block
    ]
    on_ms = 1e3 * statistics.median(on) if on else None
    off_ms = 1e3 * statistics.median(off) if off else None
    all_on = [t for s, t in per_step.items() if skip_steps < s < last_step and snap[s]]
    all_off = [t for s, t in per_step.items() if skip_steps < s < last_step and not snap[s]]
    return {
        "step_ms_on": on_ms,
        "step_ms_off": off_ms,
        "steps_on": len(on),
        "steps_off": len(off),
        "overhead_fraction": (on_ms - off_ms) / off_ms if on_ms is not None and off_ms else None,
        "overhead_paired_median": statistics.median(paired) if paired else None,
        "block_pairs": len(paired),
        "iqr_ms_on": _iqr_ms(on),
        "iqr_ms_off": _iqr_ms(off),
        # every snapshot step against every other step (first steps of blocks included)
        "step_ms_on_all": 1e3 * statistics.median(all_on) if all_on else None,
        "step_ms_off_all": 1e3 * statistics.median(all_off) if all_off else None,
    }


def _iqr_ms(xs: list[float]) -> list[float] | None:
    if len(xs) < 4:
        return None
    q = statistics.quantiles(xs, n=4)
    return [1e3 * q[0], 1e3 * q[2]]


def recovery_split(result: JsonObject) -> JsonObject:
    """Split the first injected failure of a run into detect / reconfigure / agree / transfer / restore / resume.

    From the kill: ``detect_s`` until the coordinator declared the failure,
    ``reconfigure_s`` from then until the new epoch was configured (spare
    promoted, transports built); then the members' ``_recover`` phases (max
    over members): ``agree_s`` (stop replication + agree on the restore step),
    ``transfer_s`` (the lost slot's snapshot from its buddy to the spare),
    ``restore_s`` (rebuild the optimizer, load the snapshot, all-gather the
    parameters), ``resnapshot_s`` (snapshot the restored state, restart the
    replication); ``resume_s`` from the last member restored until every member
    committed its first step after the restore (one step of compute);
    ``total_s`` from the kill until then. ``gap_s`` is what ``total_s`` holds
    beyond the listed phases (members leaving the failed epoch, the spare's
    start-up, recoveries that overlap).
    """
    timeline = failure_timeline(result)
    if not timeline:
        return {"ok": False}
    f = timeline[0]
    kill_t = result["kills"][0]["time"]
    restored = [e for e in result["events"] if e["event"] == "restored" and e["time"] >= kill_t]

    def phase(*names: str) -> float | None:
        """The longest over the restored ranks of the named phases' summed durations."""
        vals = [sum(e["phases"][n] for n in names) for e in restored if "phases" in e]
        return max(vals) if vals else None

    out: JsonObject = {
        "ok": f["resumed_s"] is not None,
        "slot": f["slot"],
        "kill_step": f["step"],
        "restore_step": f["restore_step"],
        "steps_recomputed": f["steps_recomputed"],
        "detect_s": f["detected_s"],
        "reconfigure_s": None
        if f["epoch_configured_s"] is None or f["detected_s"] is None
        else f["epoch_configured_s"] - f["detected_s"],
        "agree_s": phase("stop_replication_s", "agree_s"),
        "transfer_s": phase("transfer_s"),
        "restore_s": phase("restore_s"),
        "resnapshot_s": phase("replication_s"),
        "resume_s": None if f["resumed_s"] is None or f["restored_s"] is None else f["resumed_s"] - f["restored_s"],
        "total_s": f["resumed_s"],
        "timeline": f,
    }
    listed = [out[p] for p in RECOVERY_PHASES[:-1]]
    out["gap_s"] = None if out["total_s"] is None or None in listed else out["total_s"] - sum(listed)
    return out


# ---------------------------------------------------------------------------------------------- runs
def _model_label(d_model: int, n_layers: int) -> str:
    return f"{d_model}x{n_layers}"


def _num_parameters(config: TrainConfig) -> int:
    from optim.apps.train_job.model import GPT

    return GPT(config.model_config()).num_parameters()


def _overhead_run(config: CheckpointBenchConfig, optimizer: str, d: int, layers: int, steps: int) -> JsonObject:
    out = Path(config.out) / f"{optimizer}-{_model_label(d, layers)}" / "overhead"
    train = config.train_config(optimizer, d, layers, steps, str(out))
    res = ResilienceConfig(spares=0, heartbeat_timeout_s=config.heartbeat_timeout_s, snapshot_block=config.block)
    run = run_resilient_training(train, res, out)
    if run["status"] != 0:
        raise RuntimeError(f"checkpoint bench: overhead run {optimizer} {d}x{layers} exited with {run['status']}")
    row = overhead_from_events(run["events"], block=config.block, skip_steps=config.skip_steps, last_step=steps)
    results = list(run["results"].values())
    own = max(int(r["snapshot_bytes"][0]) for r in results)
    ward = max(int(r["snapshot_bytes"][1]) for r in results)
    sent = sum(int(r["replicated_bytes"]) for r in results)
    busy = sum(float(r["replication_busy_s"]) for r in results)
    row.update(
        {
            "snapshot_ms_median": max(float(r["snapshot_ms_median"]) for r in results),
            "own_ring_bytes": own,
            "ward_ring_bytes": ward,
            "ring_bytes_per_rank": own + ward,
            "replicated_bytes_per_rank": sent / len(results),
            "replication_busy_s_per_rank": busy / len(results),
            "replication_GBps": sent / busy / 1e9 if busy > 0 else None,
            "wall_time_s": run["wall_time_s"],
        }
    )
    return row


def _recovery_run(config: CheckpointBenchConfig, optimizer: str, d: int, layers: int) -> JsonObject:
    out = Path(config.out) / f"{optimizer}-{_model_label(d, layers)}" / "recovery"
    steps = config.kill_step + config.steps_after_kill
    train = config.train_config(optimizer, d, layers, steps, str(out))
    res = ResilienceConfig(
        spares=config.spares, kills=((1, config.kill_step),), heartbeat_timeout_s=config.heartbeat_timeout_s
    )
    run = run_resilient_training(train, res, out)
    split = recovery_split(run)
    errors = sorted(
        {str(e["error"])[:160] for e in run["events"] if e["event"] == "error" and e.get("source") == "worker"}
    )
    split.update(
        {
            "status": run["status"],
            "wall_time_s": run["wall_time_s"],
            "digests_agree": run["digests_agree"],
            "errors": errors,
        }
    )
    return split


def run_checkpoint_bench(
    config: CheckpointBenchConfig, *, on_row: Callable[[JsonObject], None] | None = None
) -> JsonObject:
    """Run every (optimizer, model) pair and the loopback; return ``config``, ``rows``, ``loopback``."""
    t0 = time.time()
    rows = []
    for d, layers, steps in config.models:
        for optimizer in config.optimizers:
            train = config.train_config(optimizer, d, layers, steps)
            row: JsonObject = {
                "name": optimizer if optimizer != "scape" else f"scape-{config.density:g}",
                "optimizer": optimizer,
                "density": config.density if optimizer == "scape" else 1.0,
                "model": _model_label(d, layers),
                "d_model": d,
                "n_layers": layers,
                "num_parameters": _num_parameters(train),
                "steps": steps,
            }
            row.update(_overhead_run(config, optimizer, d, layers, steps))
            row["recovery"] = _recovery_run(config, optimizer, d, layers)
            rows.append(row)
            if on_row is not None:
                on_row(row)
    loopback = run_loopback(config.loopback_bytes, config.loopback_iters, timeout_s=config.timeout_s, out=config.out)
    return {
        "config": dataclasses.asdict(config),
        "rows": rows,
        "loopback": loopback,
        "target_GBps": 1.0,
        "cpu_count": os.cpu_count(),
        "wall_time_s": time.time() - t0,
    }


# ---------------------------------------------------------------------------------------------- loopback
def run_loopback(nbytes: int, iters: int, *, timeout_s: float = 300.0, out: str | Path | None = None) -> JsonObject:
    """Time ``nbytes`` between 2 local ranks over the side channel (see the module docstring).

    Returns ``{}`` for ``nbytes == 0``; else the per-rank timings and
    ``one_way_GBps`` (rank 0 to rank 1, median) and ``exchange_GBps`` (bytes
    one rank sent per second of a Replicator exchange, median, min over ranks).
    """
    if nbytes <= 0:
        return {}
    root = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="sparsecomm-ckpt-"))
    logdir = root / "loopback"
    logdir.mkdir(parents=True, exist_ok=True)
    for old in logdir.glob("result-*.json"):
        old.unlink()
    launcher = Launcher(
        [sys.executable, "-m", "optim.apps.benchmarks.snapshots", str(logdir), str(nbytes), str(iters)],
        LaunchConfig(
            nproc=2,
            spares=0,
            mode="shrink",
            min_world_size=2,
            job_timeout=timedelta(seconds=timeout_s),
            events=str(logdir / "coordinator.events"),
            env=pythonpath_env(),
        ),
    )
    status: list[int] = []
    launcher.start()
    waiter = threading.Thread(target=lambda: status.append(launcher.wait()), daemon=True)
    waiter.start()
    waiter.join()
    ranks = {}
    for path in logdir.glob("result-*.json"):
        r = json.loads(path.read_text())
        ranks[int(r["rank"])] = r
    if not status or status[0] != 0 or len(ranks) != 2:
        raise RuntimeError(f"checkpoint bench: loopback job exited with {status or 'nothing'} ({logdir})")
    one_way = statistics.median(ranks[0]["one_way_s"])
    exchange = max(statistics.median(r["exchange_s"]) for r in ranks.values())
    return {
        "nbytes": nbytes,
        "iters": iters,
        "one_way_s_median": one_way,
        "one_way_GBps": nbytes / one_way / 1e9,
        "exchange_s_median": exchange,
        "exchange_GBps": nbytes / exchange / 1e9,
        "exchange_correct": all(r["exchange_correct"] for r in ranks.values()),
        "ranks": ranks,
    }


def _loopback_main(out: str, nbytes: int, iters: int) -> int:
    """One rank of the loopback job (``python -m optim.apps.benchmarks.snapshots OUT NBYTES ITERS``)."""
    import torch

    from optim.state.snapshot import Replicator, SnapshotRing
    from resilient_comm import FaultAwareCommunicator

    timeout = timedelta(seconds=120)
    comm = FaultAwareCommunicator.connect(timeout=timeout, side_channel=True)
    side = comm.side_channel
    assert side is not None and comm.world_size == 2
    rank, peer = comm.rank, 1 - comm.rank
    buf = torch.full((nbytes,), rank + 1, dtype=torch.uint8)
    ack = torch.zeros(1, dtype=torch.int64)
    one_way: list[float] = []
    for i in range(iters + 1):  # the first one warms up the connection
        comm.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            side.send(buf, peer, tag=3)
            side.recv(ack, peer, tag=4)
        else:
            side.recv(buf, peer, tag=3)
            side.send(ack, peer, tag=4)
        if i:
            one_way.append(time.perf_counter() - t0)
    buf.fill_(rank + 1)
    ward = SnapshotRing()
    replicator = Replicator(side, nbytes, ward, timeout)
    exchange: list[float] = []
    for v in range(iters + 1):
        comm.barrier()
        t0 = time.perf_counter()
        replicator.submit(v, buf)
        if not replicator.drain(timeout.total_seconds()):
            raise RuntimeError(f"replication failed: {replicator.failed}")
        if v:
            exchange.append(time.perf_counter() - t0)
    got = ward.get(iters)
    correct = got is not None and got.numel() == nbytes and bool((got[:: 1 << 12] == peer + 1).all())
    replicator.stop()
    result = {
        "rank": rank,
        "one_way_s": one_way,
        "exchange_s": exchange,
        "exchange_correct": correct,
        "busy_s": replicator.busy_s,
        "bytes_sent": replicator.bytes_sent,
    }
    (Path(out) / f"result-{rank}.json").write_text(json.dumps(result) + "\n")
    comm.barrier()
    comm.close()
    return 0


if __name__ == "__main__":
    code = _loopback_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown with transports of the job around (as optim.apps.train_job.resilient_job)
