"""Run a worker script of ``tests/dist/workers`` under ``torchrun`` with a hard deadline.

``run_torchrun("hf_trainer", 2, "--out", path)`` runs ``python -m
torch.distributed.run --standalone --nproc-per-node 2
tests/dist/workers/hf_trainer.py --out path`` from the repository root, as a
user launches a job, and returns the completed process. On timeout the whole
process group (torchrun and every rank) is killed and the test fails with
everything the ranks printed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import pytest

__all__ = ["ROOT", "end_worker", "run_torchrun", "run_torchrun_results"]

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "tests" / "dist" / "workers"


def run_torchrun(worker: str, nproc: int, *args: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    """Run ``tests/dist/workers/<worker>.py`` (or ``worker``, a path ending in ``.py``) on ``nproc`` local ranks.

    The test fails on timeout.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(ROOT / worker if worker.endswith(".py") else WORKERS / f"{worker}.py"),
        *args,
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun {worker} did not finish in {timeout:.0f} s; output:\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def run_torchrun_results(worker: str, out: Path, *args: str, timeout: float = 240.0) -> list[dict[str, Any]]:
    """Run ``worker`` on 2 local ranks with ``--out out`` and ``args``; each rank's ``<out>/rank<r>.json``, by rank.

    The test fails on timeout or when torchrun exits non-zero (with the end of what the ranks printed).
    """
    proc = run_torchrun(worker, 2, "--out", str(out), *args, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def end_worker(out: Path, results: dict[str, Any]) -> NoReturn:
    """End a worker (under torchrun): write this rank's ``results`` where :func:`run_torchrun_results` reads them.

    Then leave the default group and exit 0 at once: interpreter teardown after gloo groups can abort
    ("terminate called without an active exception"), with torch.distributed alone as well.
    """
    import sparsecomm.distributed as dist

    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)
