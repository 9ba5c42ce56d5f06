"""A script that ends with ``destroy_process_group()`` exits 0, under torchrun and on our own spawned processes.

gloo's worker threads (``pt_gloo_runloop``) live as long as their process
group. A group that outlives ``destroy_process_group()`` takes them into
interpreter teardown, where a worker that frees its last collective needs the
GIL and is ended with ``pthread_exit``: "terminate called without an active
exception", SIGABRT, a failed torchrun job. ``destroy_process_group()`` must
therefore end every worker thread itself, whatever the script still holds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from bindings.spawn import _child, free_port
from tests.dist.torchrun import run_torchrun
from tests.dist.workers import clean_exit

pytestmark = pytest.mark.dist

#: Jobs per launcher in the repeated test (every fourth one also trains with a torch optimizer); two run at a time.
RUNS = 6
_JOB_TIMEOUT_S = 90.0
_ABORT = "terminate called"


def _thread_names() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return names


def _hold_everything_then_destroy(rank: int, world_size: int) -> dict[str, Any]:
    import sparsecomm.distributed as dist

    dynamo_before_init = "torch._dynamo" in sys.modules
    dist.init_process_group("gloo")
    world = dist.group.WORLD
    pair = dist.new_group([0, 1])
    comm = dist.get_communicator()
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # imports torch._dynamo now, after init
    model(torch.ones(3, 8)).sum().backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
    opt.step()
    t = torch.ones(4)
    handle = dist.all_reduce(t, async_op=True)
    handle.wait()
    dist.all_reduce(t, group=pair)
    during = _thread_names()
    dist.destroy_process_group()
    after = _thread_names()
    assert world is not None and comm is not None and opt is not None  # all held past destroy
    return {"dynamo_before_init": dynamo_before_init, "during": during, "after": after, "sum": t.tolist()}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc thread names")
@pytest.mark.timeout(120)
def test_destroy_ends_the_gloo_worker_threads_whatever_the_script_holds() -> None:
    """Held: the default group, a subgroup, the communicator, a work handle, a torch optimizer made after init.

    Spawned, not forked from the fork server: that one has imported torch._dynamo already."""
    codes, reports = _spawned(_hold_everything_then_destroy, ())
    assert codes == [0, 0] and len(reports) == 2, (codes, reports)
    for _, status, r in reports:
        assert status == "ok", r
        assert not r["dynamo_before_init"]  # the optimizer's torch._dynamo import came after init_process_group
        assert r["sum"] == [4.0] * 4
        assert r["during"].count("pt_gloo_runloop") >= 4, r["during"]  # two groups, two workers each
        assert "pt_gloo_runloop" not in r["after"], r["after"]


def _spawned(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[list[int | None], list[tuple[int, str, Any]]]:
    """``fn(rank, 2, *args)`` on 2 processes spawned as :func:`bindings.spawn.run_local` spawns them where there
    is no fork server (a fresh interpreter per rank, which tears itself down at the end).

    Unlike ``run_local`` (which kills ranks still running once all reported),
    the processes end on their own: their exit codes and ``(rank, status, value)`` reports are returned.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [
        ctx.Process(target=_child, args=(fn, r, 2, env, os.getcwd(), args, results), name=f"rank{r}", daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    reports = []
    try:
        for _ in procs:
            reports.append(results.get(timeout=_JOB_TIMEOUT_S))
        for p in procs:
            p.join(timeout=_JOB_TIMEOUT_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        results.close()
    return [p.exitcode for p in procs], reports


def _spawned_job(optimizer: bool) -> tuple[list[int | None], str]:
    """One job of ``clean_exit.run`` on 2 spawned processes: exit codes, and the errors reported."""
    codes, reports = _spawned(clean_exit.run, (30, optimizer))
    return codes, "\n".join(str(value) for _, status, value in reports if status != "ok")


def _torchrun_job(optimizer: bool) -> tuple[int, str]:
    proc = run_torchrun("clean_exit", 2, *(["--optimizer"] if optimizer else []), timeout=_JOB_TIMEOUT_S)
    return proc.returncode, proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_scripts_ending_with_destroy_process_group_always_exit_zero(capfd: pytest.CaptureFixture[str]) -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:
        torchrun_jobs = [pool.submit(_torchrun_job, i % 3 == 2) for i in range(RUNS)]
        spawned_jobs = [pool.submit(_spawned_job, i % 3 == 2) for i in range(RUNS)]
        torchrun = [j.result() for j in torchrun_jobs]
        spawned = [j.result() for j in spawned_jobs]
    spawned_stderr = capfd.readouterr().err  # the spawned ranks write to this process's stderr

    bad = [(rc, out[-3000:]) for rc, out in torchrun if rc != 0 or _ABORT in out]
    assert not bad, f"{len(bad)}/{RUNS} torchrun jobs failed; first:\n{bad[0][1]}"
    for codes, errors in spawned:
        assert codes == [0, 0] and not errors, (codes, errors, spawned_stderr[-3000:])
    assert _ABORT not in spawned_stderr, spawned_stderr[-3000:]
