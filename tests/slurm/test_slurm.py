"""srun on a real one-node Slurm cluster (tests/slurm/conftest.py): the train job, a drop-in script, and the
fault-tolerant example with a spare and a standalone coordinator, as README.md describes for Slurm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.slurm.conftest import SlurmCluster, _free_port

pytestmark = [pytest.mark.slurm, pytest.mark.dist]

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    "PYTHONPATH": str(ROOT),
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}


def test_train_job_under_srun(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "train"
    r = slurm.srun(
        "-n",
        "2",
        sys.executable,
        "-m",
        "optim",
        "train",
        "--steps",
        "20",
        "--out",
        str(out),
        timeout=240,
        env={**ENV, "MASTER_PORT": str(_free_port())},
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + slurm.logs()
    report = json.loads((out / "report.json").read_text())
    assert report["launcher"] == "slurm" and report["world_size"] == 2
    assert report["final"]["val_loss"] < report["evals"][0]["val_loss"]


def test_drop_in_scape_and_hook_under_srun(slurm: SlurmCluster, tmp_path: Path) -> None:
    r = slurm.srun(
        "-n",
        "2",
        sys.executable,
        str(ROOT / "tests/dist/workers/torchrun_paths.py"),
        "--out",
        str(tmp_path),
        timeout=180,
        env={**ENV, "MASTER_PORT": str(_free_port())},
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for res in ranks:
        assert res["all_reduce"] == [3.0] * 4
        for path in ("scape", "ddp-sparse-hook", "fsdp2"):
            assert res[path]["digest"] == ranks[0][path]["digest"]


def _task_pids(job: str, procid: int) -> list[int]:
    """Processes of the example started for Slurm task ``procid`` of our job (from their environment)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if b"resilient_allreduce.py" in cmd and f"SPARSECOMM_JOB_ID={job}".encode() in env:
            if f"SLURM_PROCID={procid}".encode() in env:
                found.append(int(d.name))
    return found


def _coordinator(*args: str) -> subprocess.Popen[str]:
    """A standalone ``sparsecomm coordinator`` (its first line of output names the job's variables)."""
    return subprocess.Popen(
        [sys.executable, "-m", "optim", "coordinator", *args],
        env={**os.environ, **ENV},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_fault_tolerant_example_with_a_spare_under_srun(slurm: SlurmCluster, tmp_path: Path) -> None:
    coord = _coordinator("--world-size", "3", "--heartbeat-timeout", "1")
    try:
        assert coord.stdout is not None
        line = coord.stdout.readline()
        fields = dict(kv.split("=", 1) for kv in line.split())
        assert set(fields) == {"SPARSECOMM_COORDINATOR", "SPARSECOMM_JOB_ID", "SPARSECOMM_JOB_SECRET_FILE"}, line
        job = fields["SPARSECOMM_JOB_ID"]
        # 3 workers (a majority survives one loss) and task 3 the spare: the README's recipe,
        # SPARSECOMM_ROLE=spare for the tasks past the world size
        script = (
            'if [ "$SLURM_PROCID" -ge 3 ]; then export SPARSECOMM_ROLE=spare; fi; '
            f"exec {sys.executable} {ROOT / 'examples/resilient_allreduce.py'} --steps 60 --sleep 0.05"
        )
        step = subprocess.Popen(
            ["srun", "--overcommit", "--kill-on-bad-exit=0", "-n", "4", "bash", "-c", script],
            env={**slurm.env, **ENV, **fields},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines: list[str] = []
        assert step.stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(step.stdout), daemon=True)  # type: ignore[arg-type]
        reader.start()
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not any(ln.startswith("step 5 ") for ln in list(lines)):
                time.sleep(0.2)  # a few committed steps first (the first epoch needs every worker)
            victims = _task_pids(job, 1)
            assert victims, f"task 1 not found; output so far: {lines[-20:]}"
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            step.wait(timeout=120)
            reader.join(timeout=10)
            assert step.stderr is not None
            out, err = "".join(lines), step.stderr.read()
        except subprocess.TimeoutExpired:
            step.kill()
            pytest.fail(f"srun did not finish; output: {lines[-20:]}")
    finally:
        coord.send_signal(signal.SIGTERM)
        try:
            coord.wait(timeout=30)
        except subprocess.TimeoutExpired:
            coord.kill()
    steps = [int(line.split()[1]) for line in out.splitlines() if line.startswith("step ")]
    assert steps == list(range(60)), (out[-3000:], err[-3000:])  # every step committed once, in order
    assert "promoted into slot 1" in out, out[-3000:]
    assert "WRONG SUM" not in err
    assert "task 1: Killed" in err and "Exited with exit code" not in err, err[-3000:]  # the others ended well


def test_a_job_with_an_unused_spare_ends_under_srun(slurm: SlurmCluster, tmp_path: Path) -> None:
    """The README's srun recipe with a spare and no failure: srun returns (every task exited 0, the spare
    too) and the standalone coordinator exits 0 by itself."""
    coord = _coordinator("--world-size", "2", "--events", str(tmp_path / "ev.jsonl"))
    try:
        assert coord.stdout is not None
        fields = dict(kv.split("=", 1) for kv in coord.stdout.readline().split())
        # the spare registers before the workers start (so it is one when the work ends, however slow its start)
        registered = f'grep -q \'"role": "spare"\' {tmp_path / "ev.jsonl"}'
        script = (
            'if [ "$SLURM_PROCID" -ge 2 ]; then export SPARSECOMM_ROLE=spare; '
            f"else for i in $(seq 600); do {registered} && break; sleep 0.1; done; fi; "
            f"exec {sys.executable} {ROOT / 'examples/resilient_loop.py'} --optimizer adamw --steps 20 "
            f"--out {tmp_path / 'report.json'}"
        )
        r = slurm.srun("-n", "3", "bash", "-c", script, timeout=180, env={**ENV, **fields}, cwd=ROOT)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + slurm.logs()
        assert coord.wait(timeout=30) == 0
    finally:
        if coord.poll() is None:
            coord.kill()
            coord.wait()
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["losses"]) == 20 and report["world_size"] == 2
