"""Failure-transparent training of the GPT train job: ``sparsecomm train --kill`` / ``--spares``.

The parent (:func:`run_resilient_training`) starts a coordinator, ``nproc``
workers and ``spares`` spares with :class:`resilient_comm.launcher.Launcher`
and collects the result. A failure named in ``kills`` (``(slot, step)``) is a
real SIGKILL at an exact moment: the worker holding that slot sends it to
itself inside that step, after its forward and backward, while the others
enter the optimizer's collectives; once only (a marker file in the output
folder records it, so the spare that recomputes the step does not die
again). Every worker
(``python -m optim.apps.train_job.resilient_job SPEC``) runs the train job's step
(:func:`optim.apps.train_job.train.train_step`: same model, data from
``(seed, step, slot)``, learning-rate schedule, optimizer) as a client of the
public API, :class:`optim.resilient.ResilientTraining`: the commit vote,
the replicated in-memory snapshots, the spare's promotion, the agreement on
the restore step and the rebuild of the optimizer all happen there.

Hot-swap keeps slots, world size and reductions, so the run with failures
follows the failure-free run bit for bit on CPU. Shrink re-shards the
optimizer over fewer ranks (same total state, different reductions and data
split from then on).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from bindings.errors import CommError
from bindings.json_object import JsonObject
from bindings.validate import check_choice, check_int
from optim.apps.paths import pythonpath_env
from optim.apps.train_job.job_config import OUTER_LOOPS, TORCH_ADAMW, TrainConfig, build_optimizer
from optim.apps.train_job.tasks import make_task
from optim.apps.train_job.train import evaluate, train_step
from optim.resilient import ResilientConfig, ResilientTraining
from optim.state.snapshot import UnrecoverableStateError
from resilient_comm.events import ProcessEvents, read_event_dir
from resilient_comm.launcher import ENV_PRELOAD, LaunchConfig, Launcher

__all__ = ["ResilienceConfig", "run_resilient_training", "worker_main", "failure_timeline", "RECOVERY_MODES"]

logger = logging.getLogger(__name__)

RECOVERY_MODES = ("hotswap", "shrink")

_KILL_PREFIX = "kill-"
"""Name prefix of the marker files of the kills done (``kill-SLOT-STEP.json`` in the output folder)."""


@dataclass(frozen=True, kw_only=True)
class ResilienceConfig:
    """The fault-tolerance side of a training run.

    Attributes:
        spares: Spare processes in standby.
        kills: ``(slot, step)`` pairs: the worker holding ``slot`` SIGKILLs itself inside ``step``
            (after its backward, before the optimizer step), the first time it runs that step.
        snapshot: Keep in-memory snapshots replicated to a buddy (off: a
            failure restarts the run from step 0, which is still exact).
        recovery: ``hotswap`` (spares fill dead slots; shrink once none is left) or ``shrink``.
        heartbeat_timeout_s: Silence after which a worker counts as hung.
        snapshot_block: Benchmarks only (``sparsecomm bench checkpoint``): when > 0,
            snapshots alternate in blocks of this many steps with a snapshot,
            then as many without, starting with snapshots at step 1; every
            ``committed`` event says whether its step took one. A failure
            restores the newest snapshot every slot holds, which may be older.
            0 (default): a snapshot after every step.
        checkpoint_dir, checkpoint_every, keep_checkpoints, full_checkpoint_every, lossy_checkpoints,
            resume: persistent checkpoints, as :class:`optim.resilient.ResilientConfig`'s.
    """

    spares: int = 1
    kills: tuple[tuple[int, int], ...] = ()
    snapshot: bool = True
    recovery: str = "hotswap"
    heartbeat_timeout_s: float = 2.0
    snapshot_block: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    full_checkpoint_every: int = 8
    lossy_checkpoints: bool = False
    resume: bool = False

    def resilient_config(self, timeout_s: float) -> ResilientConfig:
        """The :class:`ResilientConfig` of the workers."""
        return ResilientConfig(
            timeout=timedelta(seconds=timeout_s),
            snapshots=self.snapshot,
            snapshot_block=self.snapshot_block,
            checkpoint_dir=self.checkpoint_dir,
            checkpoint_every=self.checkpoint_every,
            keep_checkpoints=self.keep_checkpoints,
            full_checkpoint_every=self.full_checkpoint_every,
            lossy_checkpoints=self.lossy_checkpoints,
            resume=self.resume,
        )

    def __post_init__(self) -> None:
        check_int("spares", self.spares, low=0)
        check_choice("recovery", self.recovery, RECOVERY_MODES)
        if not self.heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s: must be > 0, got {self.heartbeat_timeout_s!r}")
        check_int("snapshot_block", self.snapshot_block, low=0)
        self.resilient_config(60.0)  # checks the snapshot and checkpoint settings together
        for kill in self.kills:
            if len(kill) != 2:
                raise ValueError(f"kills: expected (slot, step) int pairs, got {kill!r}")
            check_int("kills slot", kill[0], low=0)
            check_int("kills step", kill[1], low=1)

    def check_against(self, config: TrainConfig) -> None:
        """Raise ``ValueError`` for kills outside the run or a non-sharded optimizer."""
        if config.optimizer in TORCH_ADAMW or config.optimizer in OUTER_LOOPS:
            raise ValueError(
                "resilient training needs one of our optimizers (adams, adamw, scape, local-adams, local-adamw, "
                "coded-adamw, coded-adams, topk-adamw, demo-sgd, topk-adams), "
                f"not {config.optimizer}"
            )
        for slot, step in self.kills:
            if slot >= config.nproc or step > config.steps:
                raise ValueError(f"kill {slot}@{step}: outside {config.nproc} slots x {config.steps} steps")


#: The train job's settings in its checkpoint directory (``sparsecomm export`` reads them).
TRAIN_SPEC = "train.json"


def _train_config(fields: JsonObject) -> TrainConfig:
    return TrainConfig(**{**fields, "betas": tuple(fields["betas"])})


def train_config_from(checkpoint_dir: str | os.PathLike[str]) -> TrainConfig:
    """The :class:`TrainConfig` of the train job that wrote ``checkpoint_dir``.

    Raises:
        ValueError: The directory holds no readable ``train.json``.
    """
    path = Path(checkpoint_dir) / TRAIN_SPEC
    try:
        return _train_config(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not the settings of a sparsecomm train job ({exc})") from exc


# ---------------------------------------------------------------------------------------------- worker
def _params_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _run_worker(config: TrainConfig, res: ResilienceConfig, out: Path, log: ProcessEvents) -> int:
    """The train job's loop on :class:`optim.resilient.ResilientTraining` (a client of the public API)."""
    torch.set_num_threads(config.threads)
    task = make_task(config.task_spec())
    torch.manual_seed(config.seed)
    model = task.build_model()
    ft = ResilientTraining(
        model,
        lambda m: build_optimizer(config, m),
        config=res.resilient_config(config.comm_timeout_s),
        on_event=log,
    )
    evals: dict[int, float] = {}
    kills = set(res.kills)
    try:
        for step in ft.steps(config.steps):
            with ft.step(step):
                loss = train_step(model, ft.optimizer, task, config, step, ft.rank)
                if (ft.rank, step) in kills:
                    _kill_once(out, ft.rank, step)
                ft.optimizer_step(loss)  # a step with a NaN or Inf anywhere is skipped (ft.skipped)
                if step == config.steps or (config.eval_interval and step % config.eval_interval == 0):
                    evals[step] = evaluate(model, ft.optimizer, task, config, ft.rank)
        member = ft.is_member
        rank, world_size, epoch = (ft.rank, ft.world_size, ft.comm.epoch) if member else (-1, 0, -1)
        ft.finish()
    except BaseException:
        ft.close(ok=False)  # leaves as failed: the job does not count this member's work as done
        raise
    if not member:
        return 0  # a spare the job never needed
    result = {
        "rank": rank,
        "world_size": world_size,
        "epoch": epoch,
        "losses": {str(k): v for k, v in sorted(ft.losses.items())},
        "skipped": ft.skipped,
        "evals": {str(k): v for k, v in sorted(evals.items())},
        "params_digest": _params_digest(model),
        "recoveries": [r.to_json() for r in ft.recoveries],
        **(ft.stats.to_json() if ft.stats else {}),
    }
    (out / f"result-{rank}.json").write_text(json.dumps(result) + "\n")
    return 0


def _kill_once(out: Path, slot: int, step: int) -> None:
    """SIGKILL this process unless the kill ``slot@step`` already happened (its marker file exists)."""
    try:
        fd = os.open(out / f"{_KILL_PREFIX}{slot}-{step}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return  # this step is being recomputed after that kill
    record = {"slot": slot, "step": step, "pid": os.getpid(), "time": time.time()}
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    logger.info("killing slot %d (pid %d) at step %d", slot, os.getpid(), step)
    os.kill(os.getpid(), signal.SIGKILL)


def worker_main(spec_path: str) -> int:
    """Entry point of one worker (``python -m optim.apps.train_job.resilient_job SPEC``)."""
    spec = json.loads(Path(spec_path).read_text())
    config = _train_config(spec["train"])
    res = ResilienceConfig(**{**spec["resilience"], "kills": tuple(tuple(k) for k in spec["resilience"]["kills"])})
    logging.basicConfig(level=logging.WARNING)
    log = ProcessEvents(spec["out"])
    try:
        return _run_worker(config, res, Path(spec["out"]), log)
    except (UnrecoverableStateError, CommError) as exc:
        log("error", {"error": f"{type(exc).__name__}: {exc}"})
        print(f"worker {os.getpid()}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3


# ---------------------------------------------------------------------------------------------- parent
def run_resilient_training(config: TrainConfig, res: ResilienceConfig, out: str | Path) -> JsonObject:
    """Run the job with the failures of ``res.kills``; return what the workers and the coordinator saw.

    Returns:
        ``status`` (the job's exit status), ``losses`` (per step, from its
        last commit), ``evals`` (per step, from the final members), ``params_digest`` (every final member
        must agree), ``results`` (per final rank), ``events`` (coordinator and
        worker events, ``time`` in unix seconds), ``kills`` (slot, step, pid,
        time: those done), ``missed_kills`` (slot, step: those that no worker
        reached, e.g. a slot beyond the world after a shrink), ``wall_time_s``.
    """
    res.check_against(config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.jsonl")) + list(out.glob("result-*.json")) + list(out.glob(f"{_KILL_PREFIX}*.json")):
        old.unlink()
    spec = {"train": dataclasses.asdict(config), "resilience": dataclasses.asdict(res), "out": str(out)}
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    if res.checkpoint_dir is not None:  # what `sparsecomm export` rebuilds the model and optimizer from
        ckpt = Path(res.checkpoint_dir)
        ckpt.mkdir(parents=True, exist_ok=True)
        tmp = ckpt / f".{TRAIN_SPEC}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(dataclasses.asdict(config)) + "\n")
        os.replace(tmp, ckpt / TRAIN_SPEC)
    launcher = Launcher(
        [sys.executable, "-m", "optim.apps.train_job.resilient_job", str(spec_path)],
        LaunchConfig(
            nproc=config.nproc,
            spares=res.spares,
            mode=res.recovery,
            min_world_size=1,
            heartbeat_timeout=timedelta(seconds=res.heartbeat_timeout_s),
            events=str(out / "coordinator.events"),
            job_timeout=timedelta(seconds=config.job_timeout_s),
            env=pythonpath_env(),
            # workers and spares fork from a server that imported the train job once (seconds each otherwise)
            preload=None if os.environ.get(ENV_PRELOAD) else ("optim.apps.train_job.train",),
        ),
    )
    t0 = time.time()
    launcher.start()
    status = launcher.wait()
    kills = sorted((json.loads(p.read_text()) for p in out.glob(f"{_KILL_PREFIX}*.json")), key=lambda k: k["time"])
    done = {(k["slot"], k["step"]) for k in kills}
    missed = [{"slot": slot, "step": step} for slot, step in res.kills if (slot, step) not in done]
    if missed:
        # a slot beyond the world after a shrink, or a job that ended before that step
        logger.warning("kills not done (no worker held the slot at that step): %s", missed)
    results = {}
    for path in out.glob("result-*.json"):
        r = json.loads(path.read_text())
        results[int(r["rank"])] = r
    events = [dict(e, source="coordinator") for e in launcher.coordinator.log.events]
    events += [dict(e, source="worker") for records in read_event_dir(out).values() for e in records]
    events.sort(key=lambda e: e["time"])
    first = results.get(0, {})
    # A final rank that was promoted from a spare only knows the steps since its restore: take each
    # step's loss from its last commit (a recomputed step's commit supersedes the earlier one), and
    # each evaluation from the final ranks that ran it (slot 0 first).
    losses: dict[int, float] = {}
    for e in events:
        if e["source"] == "worker" and e["event"] == "committed" and e.get("loss") is not None:
            losses[int(e["step"])] = e["loss"]
    losses.update({int(k): v for k, v in first.get("losses", {}).items()})
    evals: dict[int, float] = {}
    for r in sorted(results.values(), key=lambda r: -int(r["rank"])):
        evals.update({int(k): v for k, v in r.get("evals", {}).items()})
    return {
        "status": status,
        "losses": dict(sorted(losses.items())) if results else {},
        "evals": dict(sorted(evals.items())),
        "params_digest": first.get("params_digest"),
        "digests_agree": len({r["params_digest"] for r in results.values()}) == 1 if results else False,
        "results": results,
        "events": events,
        "kills": kills,
        "missed_kills": missed,
        "wall_time_s": time.time() - t0,
    }


def failure_timeline(result: JsonObject) -> list[JsonObject]:
    """One record per injected failure: times from the kill to detection, new epoch, restore, first commit."""
    events = result["events"]
    out = []

    def first(name: str, t: float) -> float | None:
        times = [e["time"] for e in events if e["time"] >= t and e["event"] == name]
        return min(times) - t if times else None

    for kill in result["kills"]:
        t = kill["time"]

        restored = [e for e in events if e["event"] == "restored" and e["time"] >= t]
        restore_time = min((e["time"] for e in restored), default=None)
        first_commits: dict[int, float] = {}
        if restore_time is not None:
            for e in events:
                if e["event"] == "committed" and e["time"] >= restore_time:
                    first_commits.setdefault(e["pid"], e["time"])
        rec = restored[0] if restored else {}
        out.append(
            {
                "slot": kill["slot"],
                "step": kill["step"],
                "pid": kill["pid"],
                "detected_s": first("failure_detected", t),
                "epoch_configured_s": first("epoch_configured", t),
                "restored_s": (max(e["time"] for e in restored) - t) if restored else None,
                "resumed_s": (max(first_commits.values()) - t) if first_commits else None,
                "restore_step": rec.get("restore_step"),
                "steps_recomputed": max((e.get("steps_recomputed", 0) for e in restored), default=None),
                "restore_phases_s": rec.get("phases"),
            }
        )
    return out


if __name__ == "__main__":
    # A transport of a failed epoch may still have a native wait pending until its own
    # timeout; interpreter teardown would then abort the process. Everything is closed
    # and flushed by now, so leave without the teardown.
    code = worker_main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
