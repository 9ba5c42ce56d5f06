"""Persistent checkpoints (optim.state.checkpoint through optim.resilient): the whole job SIGKILLed, launcher and all,
then resumed bit for bit; and every kind of bad checkpoint directory refused on every rank before anything loads.
The job is ``examples/resilient_loop.py`` under a launcher (``sparsecomm launch`` where the whole job is killed).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from optim.apps.cli.main import main
from optim.apps.train_job.resilient_job import train_config_from
from optim.apps.train_job.tasks import make_task
from optim.state.checkpoint import MAGIC, CheckpointError, CheckpointStore
from tests.resilient.harness import JobWatch, run_job

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "resilient_loop.py"
RESUME_KILL = ROOT / "tests" / "resilient" / "workers" / "resume_kill.py"
STEPS, EVERY, NPROC = 30, 5, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(
    tmp: Path, ckpt: Path, *extra: str, kill_after: int | None = None, kill_when: Callable[[], bool] | None = None
) -> tuple[int, dict[str, Any] | None, str]:
    """Run the example under a launcher in this process; with ``kill_after``, under ``sparsecomm launch`` instead,
    SIGKILLed as a whole (launcher included) once that step committed (and ``kill_when()`` holds)."""
    tmp.mkdir(parents=True, exist_ok=True)
    out, port = tmp / "report.json", _free_port()
    job = [sys.executable, str(EXAMPLE), "--optimizer", "scape", "--steps", str(STEPS)]
    job += ["--out", str(out), "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY), *extra]
    if kill_after is None:
        rc, log = run_job(job, tmp / "logs", nproc=NPROC, job_timeout=timedelta(seconds=150))
        return rc, json.loads(out.read_text()) if out.exists() else None, log[-4000:]
    cmd = [sys.executable, "-m", "optim", "launch", "--nproc", str(NPROC), "--spares", "0", "--port", str(port)]
    cmd += ["--job-timeout", "150", "--", *job]
    watch = JobWatch()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.update(watch.env)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if kill_after is not None:
            deadline = time.monotonic() + 120
            watch.connect(port, lambda: proc.poll() is None, 120)
            while time.monotonic() < deadline and proc.poll() is None:
                if watch.committed() >= kill_after and (kill_when is None or kill_when()):
                    os.killpg(proc.pid, signal.SIGKILL)  # every process of the job, the launcher too
                    break
                time.sleep(0.005)
        output, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    report = json.loads(out.read_text()) if out.exists() else None
    return proc.returncode, report, output.decode(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """The example run once without failures, checkpointing (its report and its checkpoint directory): the
    reference of every resume below, made once for the module. Tests copy the directory before they touch it."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    rc, ref, log = _job(tmp / "run", tmp / "ckpt")
    assert rc == 0 and ref is not None, log
    return ref, tmp / "ckpt"


def test_whole_job_killed_then_resumed_bitwise(tmp_path: Path, uninterrupted: tuple[dict[str, Any], Path]) -> None:
    ref = uninterrupted[0]

    # Killed once step 15 is on disk: the first checkpoint that is a delta (SCAPE's state gains its mask between
    # steps 5 and 10, so 10 is written full). The checkpoint writer runs at nice 19 and may lag on a busy
    # machine; the pace keeps the job from ending first. It changes no result.
    def fifteen_on_disk() -> bool:
        return 15 in CheckpointStore(tmp_path / "ckpt").complete_steps(NPROC)

    ckpt = tmp_path / "ckpt"
    rc, _, log = _job(tmp_path / "a", ckpt, "--step-seconds", "0.3", kill_after=17, kill_when=fifteen_on_disk)
    assert rc == -signal.SIGKILL or rc != 0, log
    store = CheckpointStore(tmp_path / "ckpt")
    complete = store.complete_steps(NPROC)
    assert complete and 15 <= complete[-1] < STEPS and complete[-1] % EVERY == 0, (complete, log)
    # retention: the newest two complete steps, and the older files their deltas are built on; one more
    # where the kill came between the newest step's last file and the pruning that file's writer does next
    needed = {s for k in complete[-2:] for slot in range(NPROC) for s in store.chain(k, slot)}
    assert set(complete) - needed <= set(complete[-3:-2]), (complete, needed)
    kinds = {store.file_info(k, slot).kind for k in complete for slot in range(NPROC)}
    assert "delta" in kinds, kinds  # SCAPE 0.1: what changed in 5 steps is small
    rc, resumed, log = _job(tmp_path / "b", tmp_path / "ckpt", "--resume")
    assert rc == 0 and resumed is not None, log
    # the resumed run is the uninterrupted one, bit for bit: every loss and the final parameters
    assert resumed["losses"] == ref["losses"]
    assert resumed["params_sha256"] == ref["params_sha256"]


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_bad_checkpoint_directories_are_refused_everywhere(
    tmp_path: Path, uninterrupted: tuple[dict[str, Any], Path]
) -> None:
    ref, ckpt = uninterrupted[0], tmp_path / "ckpt"
    shutil.copytree(uninterrupted[1], ckpt)
    store = CheckpointStore(ckpt)
    complete = store.complete_steps(NPROC)
    newest = complete[-1]
    victim = store.slot_file(newest, 1)
    original = victim.read_bytes()

    def refused(what: str) -> str:
        rc, _, log = _job(tmp_path / what, ckpt, "--resume")
        assert rc != 0, f"{what}: the job ran\n{log}"
        assert "CheckpointError" in log and "cannot be loaded on ranks [1]" in log, f"{what}\n{log}"
        return log

    _flip(victim, len(original) - 10)  # a payload byte
    assert "corrupted" in refused("flipped")
    victim.write_bytes(original[: len(original) // 2])
    assert "truncated" in refused("truncated")
    victim.write_bytes(b"not a checkpoint at all")
    assert "bad magic" in refused("foreign")
    assert store.complete_steps(NPROC) == complete  # a refused resume overwrote nothing
    # a slot file missing: that step is incomplete, the newest complete one before it is resumed, bit for bit
    victim.unlink()
    rc, resumed, log = _job(tmp_path / "older", ckpt, "--resume")
    assert rc == 0 and resumed is not None, log
    assert resumed["losses"] == ref["losses"] and resumed["params_sha256"] == ref["params_sha256"]
    rc, _, log = _job(tmp_path / "nodir", tmp_path / "nowhere", "--resume")
    assert rc != 0 and "no checkpoint directory" in log, log
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    rc, _, log = _job(tmp_path / "unwritable", blocker / "sub")
    assert rc != 0 and "not writable" in log, log


def test_store_reads_back_and_checks_every_field(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    payload = torch.arange(100, dtype=torch.uint8)
    for step in (5, 10, 15):
        for slot in range(2):
            store.write(step, slot, 2, "fp", payload)
    assert store.complete_steps(2) == [10, 15]  # retention: the newest two complete steps
    assert torch.equal(store.read(15, 1, 2, "fp"), payload)
    with pytest.raises(CheckpointError, match="another model or optimizer"):
        store.read(15, 1, 2, "other")
    with pytest.raises(CheckpointError, match="world_size 2, not 3"):
        store.read(15, 1, 3, "fp")
    store.write(20, 0, 2, "fp", payload)  # slot 1 of step 20 not written yet: nothing older is dropped
    assert store.complete_steps(2) == [10, 15]
    assert store.slot_file(20, 0).read_bytes().startswith(MAGIC)
    assert not list(tmp_path.rglob(".*tmp*"))


def _check_export(ckpt: Path, out: Path, digest: str | None) -> None:
    """``sparsecomm export``: a plain state_dict that torch.load reads; the run's final weights bit for bit."""
    proc = subprocess.run(
        [sys.executable, "-m", "optim", "export", str(ckpt), str(out)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    state = torch.load(out, weights_only=True)
    model = make_task(train_config_from(ckpt).task_spec()).build_model()
    assert state.keys() == model.state_dict().keys()
    assert all(v.isfinite().all() for v in state.values())
    h = hashlib.sha256()
    for name, _ in model.named_parameters():
        h.update(name.encode())
        h.update(state[name].contiguous().view(torch.uint8).numpy().tobytes())
    if digest is not None:  # the sharded optimizer's replicas are the master weights: bit-identical
        assert h.hexdigest() == digest
    bad = subprocess.run([sys.executable, "-m", "optim", "export", str(out.parent), str(out)], capture_output=True)
    assert bad.returncode != 0 and b"not the settings of a sparsecomm train job" in bad.stderr


def _train(out: Path, *args: str) -> dict[str, Any]:
    """``sparsecomm train`` (its ``main``, in this process: the workers fork from the suite's fork server)."""
    argv = ["train", "--nproc", "2", "--eval-interval", "10", "--out", str(out), *args]
    assert main(argv) == 0
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    assert report["status"] == 0
    return report


def _losses(report: dict[str, Any]) -> dict[int, float]:
    return {s["step"]: s["train_loss"] for s in report["steps"]}


def test_train_command_checkpoints_and_resumes(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    # the same fault-tolerant path, with checkpoints that never come (every 100 steps)
    ref = _train(
        tmp_path / "ref", "--steps", "30", "--checkpoint-dir", str(tmp_path / "none"), "--checkpoint-every", "100"
    )
    _train(
        tmp_path / "first", "--steps", "20", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10", "--keep", "1"
    )
    assert [p.name for p in sorted(ckpt.iterdir())] == ["step-000000020", "train.json"]  # dense: full files
    resumed = _train(
        tmp_path / "second", "--steps", "30", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10", "--resume"
    )
    assert resumed["steps"] == ref["steps"]  # the steps before the resume come with the checkpoint
    assert resumed["params_digest"] == ref["params_digest"]


def test_lossy_checkpoints_are_smaller_and_resume_close_to_the_run(tmp_path: Path) -> None:
    """--lossy-checkpoints: full files keep SCAPE's first moment in bfloat16; a resume from them trains on close to
    the uninterrupted run (its history exact, its later losses within 2%)."""
    common = ["--optimizer", "scape", "--density", "0.1", "--checkpoint-every", "10"]
    ref = _train(tmp_path / "ref", "--steps", "30", "--checkpoint-dir", str(tmp_path / "plain"), *common)
    ckpt = tmp_path / "ckpt"
    _train(tmp_path / "first", "--steps", "20", "--checkpoint-dir", str(ckpt), "--lossy-checkpoints", *common)
    lossy, plain = CheckpointStore(ckpt), CheckpointStore(tmp_path / "plain")
    for slot in range(2):
        assert lossy.file_info(10, slot).kind == "lossy" and lossy.file_info(20, slot).kind == "delta"
        assert lossy.file_info(10, slot).disk_bytes < 0.9 * plain.file_info(10, slot).disk_bytes
    resumed = _train(tmp_path / "second", "--steps", "30", "--checkpoint-dir", str(ckpt), "--resume", *common)
    losses, want = _losses(resumed), _losses(ref)
    assert sorted(losses) == sorted(want)
    assert all(losses[k] == want[k] for k in want if k <= 20)
    assert all(abs(losses[k] - want[k]) <= 0.02 * want[k] for k in want), [(k, losses[k], want[k]) for k in want]


def test_export_state_dict_is_a_plain_torch_file(tmp_path: Path) -> None:
    from optim.state.checkpoint import export_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    path = export_state_dict(model, tmp_path / "model.pt")
    loaded = torch.load(path, weights_only=True)
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("optimizer", "worlds"),
    [("scape", (3, 8)), ("local-adams", (3,)), ("local-adamw", (3,)), ("coded-adamw", (3,))],
    ids=["scape-4to3-4to8", "local-4to3", "local-adamw-4to3", "coded-adamw-4to3"],
)
def test_resume_on_another_world_size_reshards(tmp_path: Path, optimizer: str, worlds: tuple[int, ...]) -> None:
    ckpt = tmp_path / "ckpt"
    common = ["--optimizer", optimizer, "--density", "0.1", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10"]
    first = _train(tmp_path / "first", "--nproc", "4", "--steps", "20", *common)
    _check_export(ckpt, tmp_path / "model.pt", first["params_digest"] if optimizer == "scape" else None)
    for n in worlds:
        r = _train(tmp_path / f"on{n}", "--nproc", str(n), "--steps", "30", "--resume", *common)
        losses = _losses(r)
        assert sorted(losses) == list(range(1, 31))
        assert all(losses[s] == v for s, v in _losses(first).items())  # the history
        assert all(v == v and v < losses[1] for s, v in losses.items() if s > 20)  # it trains on from there
        assert r["final_members_agree"]
        # the next run starts from this one's checkpoint again, so put the 4-slot step back first
        shutil.rmtree(ckpt / "step-000000030", ignore_errors=True)


def test_a_full_disk_ends_the_run_on_every_rank(tmp_path: Path) -> None:
    disk = tmp_path / "small"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        rc, report, log = _job(tmp_path / "run", disk / "ckpt")
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    assert rc != 0 and report is None, log
    assert "CheckpointError" in log and "could not be written on ranks" in log, log


@pytest.mark.parametrize("spares", [1, 0], ids=["hotswap", "shrink"])
def test_a_worker_killed_while_the_resume_loads_goes_on_from_the_checkpoint(tmp_path: Path, spares: int) -> None:
    """A failure before the resumed run's first snapshot: the recovery restores the checkpoint, not the seed's
    initial state (which would train from scratch with the history gone)."""

    def run(out: Path, *args: str) -> dict[str, Any]:
        out.mkdir(parents=True)
        cmd = [sys.executable, str(RESUME_KILL), "--out", str(out), *args]
        rc, log = run_job(cmd, out / "logs", nproc=3, spares=spares, job_timeout=timedelta(seconds=150))
        assert rc == 0 and (out / "report.json").exists(), log[-6000:]
        report: dict[str, Any] = json.loads((out / "report.json").read_text())
        return report

    ckpt = str(tmp_path / "ckpt")
    ref = run(tmp_path / "ref", "--steps", "20", "--checkpoint-dir", str(tmp_path / "ref-ckpt"))
    first = run(tmp_path / "first", "--steps", "10", "--checkpoint-dir", ckpt)
    resumed = run(tmp_path / "second", "--steps", "20", "--checkpoint-dir", ckpt, "--resume", "--kill-on-resume")
    assert (tmp_path / "second" / "killed").exists()  # the kill happened
    assert [(r["restore_step"], r["from_disk"]) for r in resumed["recoveries"]] == [(10, True)]
    assert all(resumed["losses"][k] == v for k, v in first["losses"].items())  # the history came back
    assert sorted(resumed["losses"], key=int) == [str(s) for s in range(1, 21)]
    if spares:  # the same world: bit for bit the uninterrupted run
        assert resumed["losses"] == ref["losses"] and resumed["digest"] == ref["digest"]
    else:  # two workers go on from step 10
        assert all(resumed["losses"][str(s)] < resumed["losses"]["1"] for s in range(11, 21))
