"""Failure-transparent training under real process deaths (``optim.apps.train_job.resilient_job``).

Every test runs the real job (coordinator in this process, workers and spares
as OS processes), SIGKILLs workers while steps run, and compares the result
with the failure-free run of the same configuration: with hot-swap recovery on
CPU the losses of every step, the evaluations and the final parameters must be
*bitwise* identical, no committed step may be lost, and a recovery recomputes
at most the one step whose snapshot replication may have been in flight.

Most kills come from :class:`ResilienceConfig.kills` (the trainer SIGKILLs the
worker holding ``slot`` once ``step - 1`` is committed). Kills the trainer
cannot express (a promoted spare that dies while restoring, two slots at the
very same moment) are driven from here: :class:`_Job` runs the job on a
thread and watches the workers' event files.

``SPARSECOMM_DEADPOOL_FAILURES`` sets the number of consecutive failures of
:func:`test_many_consecutive_failures` (default 10).
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from optim.apps.train_job.job_config import TrainConfig
from optim.apps.train_job.resilient_job import ResilienceConfig, run_resilient_training
from optim.state.checkpoint import CheckpointStore
from resilient_comm.events import read_event_dir
from tests.resilient.harness import wait_until

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 24


def _config(optimizer: str = "scape", **overrides: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        optimizer=optimizer,
        density=0.05,
        steps=STEPS,
        nproc=4,
        eval_interval=8,
        d_model=32,
        n_layers=1,
        n_heads=2,
        context=32,
        batch=4,
        warmup_steps=4,
        sparse_warmup_steps=4,
        comm_timeout_s=60.0,
        job_timeout_s=240.0,
    )
    base.update(overrides)
    return TrainConfig(**base)


def _res(**kw: Any) -> ResilienceConfig:
    """Kills are SIGKILLs, seen at once as exits: a long heartbeat timeout only keeps a busy machine (the
    coordinator runs in this process, next to tens of workers starting on few cores) from declaring
    members silent that are merely slow."""
    return ResilienceConfig(**{"heartbeat_timeout_s": 10.0, **kw})


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """The failure-free run of a configuration, computed once per module and configuration."""
    cache: dict[tuple, dict[str, Any]] = {}

    def get(config: TrainConfig) -> dict[str, Any]:
        key = tuple(sorted((k, str(v)) for k, v in config.__dict__.items()))
        if key not in cache:
            out = tmp_path_factory.mktemp("reference")
            run = run_resilient_training(config, _res(spares=0), out)
            assert run["status"] == 0, _tail(run)
            assert sorted(run["losses"]) == list(range(1, config.steps + 1))
            assert run["digests_agree"]
            cache[key] = run
        return cache[key]

    return get


def _tail(run: dict[str, Any], n: int = 25) -> list[str]:
    keep = ("event", "source", "pid", "step", "epoch", "slot", "error", "reason", "restore_step")
    return [json.dumps({k: e[k] for k in keep if k in e}) for e in run["events"][-n:]]


def _recoveries(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [rec for r in run["results"].values() for rec in r["recoveries"]]


def _report(name: str, run: dict[str, Any]) -> None:
    recs = _recoveries(run)
    by_epoch: dict[int, list[dict[str, Any]]] = {}
    for rec in recs:
        by_epoch.setdefault(rec["epoch"], []).append(rec)
    parts = []
    for epoch, rs in sorted(by_epoch.items()):
        parts.append(
            f"epoch {epoch}: restore {rs[0]['restore_step']}, recomputed "
            f"{max(r['steps_recomputed'] for r in rs)}, recover {max(r['recover_s'] for r in rs):.3f} s"
        )
    print(f"\n{name}: wall {run['wall_time_s']:.1f} s, kills {len(run['kills'])}; " + "; ".join(parts))


def _assert_transparent(
    run: dict[str, Any],
    ref: dict[str, Any],
    steps: int,
    failures: int,
    max_recomputed: int = 1,
    all_evals: bool = True,
    snapshots: bool = True,
) -> None:
    """The run with failures is the failure-free run, bit for bit."""
    assert run["status"] == 0, _tail(run)
    assert sorted(run["losses"]) == list(range(1, steps + 1)), "a committed step is missing"
    assert run["losses"] == ref["losses"]  # exact float equality, every step
    if all_evals:
        assert run["evals"] == ref["evals"]
    else:  # an evaluation is known only to the members that ran it: those may all have been replaced since
        assert steps in run["evals"] and run["evals"] == {k: ref["evals"][k] for k in run["evals"]}
    assert run["params_digest"] == ref["params_digest"]
    assert run["digests_agree"]
    for rank, r in run["results"].items():  # every final rank saw the same losses (a spare: since its restore)
        losses = {int(k): v for k, v in r["losses"].items()}
        assert losses and losses == {k: ref["losses"][k] for k in losses}, rank
        assert max(losses) == steps, rank
    promoted = [e for e in run["events"] if e["event"] == "spare_promoted"]
    assert len(promoted) == failures, _tail(run)  # every failure was taken by a spare (hot-swap, no shrink)
    sizes = {r["world_size"] for r in run["results"].values()}
    assert sizes == {len(run["results"])} and len(run["results"]) == ref["results"][0]["world_size"]
    recs = _recoveries(run)
    assert recs, "no recovery was recorded"
    for rec in recs:
        assert rec["restore_step"] >= 0 if snapshots else rec["restore_step"] == -1, rec
        assert rec["steps_recomputed"] <= max_recomputed, rec


def _killed_run(
    config: TrainConfig,
    reference: Callable[[TrainConfig], dict[str, Any]],
    tmp_path: Path,
    *,
    spares: int,
    kills: tuple[tuple[int, int], ...],
    name: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``config`` with ``spares`` spares and ``kills``; assert it matches the reference bit for bit; both runs.

    Reported as ``name``; one failure per kill.
    """
    ref = reference(config)
    run = run_resilient_training(config, _res(spares=spares, kills=kills), tmp_path)
    _report(name, run)
    _assert_transparent(run, ref, STEPS, failures=len(kills))
    return run, ref


# ------------------------------------------------------------------------------- trainer-injected kills
@pytest.mark.timeout(240)
def test_hotswap_mid_run_is_bitwise_transparent(tmp_path: Path, reference) -> None:
    config = _config("scape")
    run, _ = _killed_run(config, reference, tmp_path, spares=1, kills=((2, 12),), name="scape kill 2@12")
    assert [k["slot"] for k in run["kills"]] == [2]
    assert {rec["restore_step"] for rec in _recoveries(run)} <= {10, 11}
    promoted = [e for e in run["events"] if e["event"] == "spare_promoted"]
    assert [e["slot"] for e in promoted] == [2]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "optimizer", ["adams", "adamw", "local-adams", "local-adamw", "topk-adams", "coded-adamw", "topk-adamw", "demo-sgd"]
)
def test_hotswap_dense_baselines_are_bitwise_transparent(tmp_path: Path, reference, optimizer: str) -> None:
    config = _config(optimizer)
    _killed_run(config, reference, tmp_path, spares=1, kills=((1, 9),), name=f"{optimizer} kill 1@9")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer", ["local-adams", "local-adamw"])
def test_hotswap_local_averaging_with_overlap_is_bitwise_transparent(tmp_path: Path, reference, optimizer: str) -> None:
    """The averaging in flight when a worker dies is sent again from the restored replicas, bit for bit."""
    config = _config(optimizer, density=0.1, local_overlap=True)
    _killed_run(config, reference, tmp_path, spares=1, kills=((1, 9),), name=f"{optimizer} overlap kill 1@9")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer", ["local-adams", "local-adamw"])
def test_local_shrink_goes_on_from_each_survivors_replica(tmp_path: Path, optimizer: str) -> None:
    """No spare: the survivors shrink, each restores its own replica in the new layout, and they finish.

    A second kill names slot 3, which the shrink to three ranks removed: it is reported as not done.
    """
    config = _config(optimizer, density=0.1)
    run = run_resilient_training(config, _res(spares=0, kills=((1, 13), (3, 18))), tmp_path)
    _report(f"{optimizer} kill 1@13, shrink", run)
    assert run["status"] == 0, _tail(run)
    assert [(k["slot"], k["step"]) for k in run["kills"]] == [(1, 13)]
    assert run["missed_kills"] == [{"slot": 3, "step": 18}]
    assert sorted(run["losses"]) == list(range(1, STEPS + 1))
    assert len(run["results"]) == 3 and {r["world_size"] for r in run["results"].values()} == {3}
    assert run["digests_agree"]  # the final average leaves one model on every member
    recs = _recoveries(run)
    assert recs and all(rec["steps_recomputed"] <= 1 for rec in recs), recs
    assert all(math.isfinite(v) for v in run["losses"].values())


@pytest.mark.timeout(300)
def test_kills_at_random_steps(tmp_path: Path, reference) -> None:
    config = _config("scape")
    rng = random.Random(20261129)
    steps = sorted(rng.sample(range(2, STEPS + 1), 3))
    kills = tuple((rng.randrange(config.nproc), s) for s in steps)
    _killed_run(config, reference, tmp_path, spares=3, kills=kills, name=f"scape kills {kills}")


@pytest.mark.timeout(240)
def test_kill_at_step_one(tmp_path: Path, reference) -> None:
    """Right after the start: the first snapshot (step 0) may still be replicating."""
    config = _config("scape")
    run, _ = _killed_run(config, reference, tmp_path, spares=1, kills=((1, 1),), name="scape kill 1@1")
    # the worker dies inside step 1, before it commits: every slot restores step 0
    restored = {rec["restore_step"] for rec in _recoveries(run)}
    assert restored == {0}, restored


@pytest.mark.timeout(240)
def test_kill_at_last_step(tmp_path: Path, reference) -> None:
    config = _config("scape")
    run, ref = _killed_run(config, reference, tmp_path, spares=1, kills=((3, STEPS),), name=f"scape kill 3@{STEPS}")
    assert run["evals"][STEPS] == ref["evals"][STEPS]


@pytest.mark.timeout(240)
def test_second_failure_right_after_the_first(tmp_path: Path, reference) -> None:
    """Consecutive steps: the second kill lands as soon as the first epoch was replaced."""
    config = _config("scape")
    _killed_run(config, reference, tmp_path, spares=2, kills=((1, 10), (2, 11)), name="scape kills 1@10, 2@11")


@pytest.mark.timeout(600)
def test_many_consecutive_failures(tmp_path: Path, reference) -> None:
    """A kill at every step of a stretch, each taken by a fresh spare."""
    failures = int(os.environ.get("SPARSECOMM_DEADPOOL_FAILURES", "10"))
    config = _config("scape", nproc=3, steps=failures + 10, eval_interval=10, job_timeout_s=540.0)
    ref = reference(config)
    # slots 0 and 1 in turn: a kill of the last slot costs a 30 s stall of its buddy (see
    # test_kill_at_last_step), which would make this test take minutes without testing more
    kills = tuple((s % (config.nproc - 1), s) for s in range(5, 5 + failures))
    run = run_resilient_training(config, _res(spares=failures, kills=kills), tmp_path)
    _report(f"scape {failures} consecutive kills", run)
    _assert_transparent(run, ref, config.steps, failures=failures, all_evals=False)
    assert len(run["kills"]) == failures


@pytest.mark.timeout(240)
def test_snapshot_off_restarts_from_step_zero(tmp_path: Path, reference) -> None:
    """Without snapshots a failure restarts the run at step 1: still exact, every step before it recomputed."""
    config = _config("adamw")
    ref = reference(config)
    kill_step = 10
    res = _res(spares=1, kills=((1, kill_step),), snapshot=False)
    run = run_resilient_training(config, res, tmp_path)
    _report("adamw snapshot off, kill 1@10", run)
    _assert_transparent(run, ref, STEPS, failures=1, max_recomputed=kill_step - 1, snapshots=False)
    recs = _recoveries(run)
    survivors = [rec for rec in recs if rec["steps_recomputed"] > 0]
    assert len(survivors) == config.nproc - 1
    assert {rec["steps_recomputed"] for rec in survivors} == {kill_step - 1}


# ------------------------------------------------------------------------------------- test-driven kills
class _Job:
    """``run_resilient_training`` on a thread, with the workers' event files readable meanwhile."""

    def __init__(self, out: Path, config: TrainConfig, res: ResilienceConfig) -> None:
        self.out = out
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(config, res), daemon=True)
        self._thread.start()

    def _run(self, config: TrainConfig, res: ResilienceConfig) -> None:
        try:
            self.result = run_resilient_training(config, res, self.out)
        except BaseException as exc:  # noqa: BLE001 - re-raised by join()
            self.error = exc

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        out = [e for recs in read_event_dir(self.out).values() for e in recs if name is None or e["event"] == name]
        return sorted(out, key=lambda e: e["time"])

    def join(self, timeout: float) -> dict[str, Any]:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the job did not end"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


@pytest.mark.timeout(240)
def test_promoted_spare_dies_while_restoring(tmp_path: Path, reference) -> None:
    """Slot 2 dies; the spare that takes it is killed as soon as it logs its promotion; a second spare takes over."""
    config = _config("scape")
    ref = reference(config)
    job = _Job(tmp_path, config, _res(spares=2, kills=((2, 12),)))
    promoted = wait_until(lambda: job.events("promoted"), 180, "a spare's promotion", interval=0.001)[0]
    victim = promoted["pid"]
    os.kill(victim, signal.SIGKILL)
    t_kill = time.time()
    run = job.join(200)
    _report("scape kill 2@12, then the promoted spare", run)
    own = [e for e in run["events"] if e.get("pid") == victim and e["source"] == "worker"]
    assert "restored" not in {e["event"] for e in own}, "the spare finished restoring before the kill"
    print(f"killed promoted spare {victim} {t_kill - promoted['time']:.3f} s after its promotion")
    _assert_transparent(run, ref, STEPS, failures=2)
    promotions = [e for e in run["events"] if e["event"] == "spare_promoted"]
    assert [e["slot"] for e in promotions] == [2, 2]


def _kill_buddy_and_ward(
    tmp_path: Path, config: TrainConfig, res: ResilienceConfig, after: int, on_disk: int | None = None
) -> tuple[dict[str, Any], int]:
    """Run the job; once step ``after`` is committed (and a checkpoint of step ``on_disk`` or later is complete on
    disk), SIGKILL slots 1 and 2 together (slot 1's own copy and its buddy's); return the run and the newest complete
    checkpoint step just before the kill (-1: none)."""
    job = _Job(tmp_path, config, res)
    disk = CheckpointStore(res.checkpoint_dir) if res.checkpoint_dir else None

    def slot_pids() -> dict[int, int] | None:
        joined = {e["rank"]: e["pid"] for e in job.events("joined")}
        return joined if len(joined) == config.nproc else None

    def newest_on_disk() -> int:
        return max(disk.complete_steps(config.nproc), default=-1) if disk else -1

    pids = wait_until(slot_pids, 180, "every worker to join")
    wait_until(lambda: any(e["step"] >= after for e in job.events("committed")), 120, f"step {after}", interval=0.001)
    # the checkpoint writers run at the lowest CPU priority: on a busy machine they may lag the training
    if on_disk is not None:
        wait_until(lambda: newest_on_disk() >= on_disk, 120, f"a complete checkpoint of step {on_disk} or later")
    newest = newest_on_disk()
    os.kill(pids[1], signal.SIGKILL)
    os.kill(pids[2], signal.SIGKILL)
    return job.join(240), newest


@pytest.mark.timeout(300)
def test_buddy_and_ward_lost_together_falls_back_to_disk(tmp_path: Path, reference) -> None:
    """As below, with persistent checkpoints every 4 steps: the members restore the newest complete one and go on."""
    config = _config("scape", nproc=5)
    res = _res(spares=2, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=4)
    run, newest = _kill_buddy_and_ward(tmp_path, config, res, after=10, on_disk=8)
    assert run["status"] == 0, _tail(run)
    restores = [e for e in run["events"] if e["event"] == "restored"]
    assert restores and all(e["from_disk"] for e in restores), _tail(run)
    # the newest complete checkpoint at the kill (or the next, completed in the instant before it): in memory the
    # state of 1 is gone
    assert {e["restore_step"] for e in restores} <= {newest, newest + 4}, (newest, restores)
    ref = reference(config)
    assert run["losses"] == ref["losses"] and run["params_digest"] == ref["params_digest"]


@pytest.mark.timeout(300)
def test_buddy_and_ward_lost_together_without_spares_shrinks_from_disk(tmp_path: Path, reference) -> None:
    """No spare: the three survivors restore the newest complete checkpoint of five slots, re-sharded onto three."""
    config = _config("scape", nproc=5)
    res = _res(spares=0, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=4)
    run, newest = _kill_buddy_and_ward(tmp_path, config, res, after=10, on_disk=8)
    assert run["status"] == 0, _tail(run)
    restores = [e for e in run["events"] if e["event"] == "restored"]
    assert restores and all(e["from_disk"] and e["world_size"] == 3 for e in restores), _tail(run)
    restored = {e["restore_step"] for e in restores}
    assert len(restored) == 1 and restored <= {newest, newest + 4}, (newest, restored)
    step = restored.pop()
    ref = reference(config)
    assert sorted(run["losses"]) == list(range(1, STEPS + 1)), "a committed step is missing"
    assert {s: v for s, v in run["losses"].items() if s <= step} == {s: ref["losses"][s] for s in range(1, step + 1)}
    later = [run["losses"][s] for s in range(step + 1, STEPS + 1)]
    assert all(math.isfinite(v) and v < run["losses"][1] for v in later), later  # it trains on, on three
    assert {r["world_size"] for r in run["results"].values()} == {3}
    assert run["digests_agree"]


@pytest.mark.timeout(240)
def test_buddy_and_ward_lost_together_stops_the_job(tmp_path: Path) -> None:
    """Slots 1 and 2 die at once: slot 1's state lived on 1 (own) and 2 (its buddy): the job must stop, loudly.

    Five slots, so that the three survivors keep the coordinator's quorum (two of
    four would end the job there, before any recovery is tried).
    """
    config = _config("scape", nproc=5)
    run, _ = _kill_buddy_and_ward(tmp_path, config, _res(spares=2), after=9)
    assert run["status"] != 0, _tail(run)
    errors = [e for e in run["events"] if e["event"] == "error" and e["source"] == "worker"]
    unrecoverable = [e for e in errors if e["error"].startswith("UnrecoverableStateError")]
    assert unrecoverable, _tail(run)
    for e in unrecoverable:
        assert "no copy left" in e["error"] and "[1]" in e["error"], e  # slot 1 is the one whose state is gone
    for e in errors:  # anything else: only processes told that the job failed (spares left in standby)
        assert e in unrecoverable or e["error"].startswith("MembershipError: the job failed"), e
    # never silently on: no rank finished, and no step after the failure was committed
    assert run["results"] == {}
    last = max(e["step"] for e in run["events"] if e["event"] == "committed")
    assert all(e["epoch"] == 0 for e in run["events"] if e["event"] == "committed"), "a step after the failure"
    assert not [e for e in run["events"] if e["event"] == "restored"]
    print(f"\nbuddy+ward lost: {len(unrecoverable)} stopped with {unrecoverable[0]['error']!r} after step {last}")
