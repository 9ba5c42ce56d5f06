"""mpirun worker (ULFM): ``UlfmCommunicator`` surviving a SIGKILL, and its commit vote.

Run: ``mpirun --with-ft ulfm ... python -m mpi4py tests/mpi/workers/ulfm_recover.py SCENARIO OUTDIR``
with SCENARIO one of:

* ``shrink`` (4 ranks, no spare): COMM_WORLD rank 2 SIGKILLs itself at step
  5 of an all_reduce loop; the survivors reconfigure to 3 ranks and go on;
* ``hotswap`` (5 ranks, 1 spare): the same kill; the spare takes slot 2;
* ``commit`` (4 ranks, 1 spare): slot 1 votes ``ok=False`` at step 2; at the
  end the actives release the spare.

Each process writes ``OUTDIR/rank<COMM_WORLD rank>.json`` (the victim writes
the wall-clock time of its kill); a survivor writes only after it finished, so
the test checks these files, not mpirun's exit status (non-zero: a rank died).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

from bindings.errors import PeerFailureError
from resilient_comm.ulfm_communicator import UlfmCommunicator, ulfm_support

STEPS = 10
KILL_STEP = 5
VICTIM = 2  # COMM_WORLD rank
TIMEOUT = timedelta(seconds=20)


def _write(out: Path, member: int, data: dict[str, object]) -> None:
    tmp = out / f"rank{member}.json.tmp"
    tmp.write_text(json.dumps(data))
    tmp.rename(out / f"rank{member}.json")


def _step_sum(comm: UlfmCommunicator) -> tuple[float, float]:
    """All-reduce (slot + 1); return (got, expected) for the current world."""
    t = torch.full((1024,), float(comm.rank + 1), dtype=torch.float64)
    comm.all_reduce(t)
    ws = comm.world_size
    expected = ws * (ws + 1) / 2
    assert torch.all(t == t[0]), "all_reduce: elements differ"
    return float(t[0]), expected


def run_loop(comm: UlfmCommunicator, data: dict[str, object], start: int, kill: bool) -> None:
    """Steps ``start..STEPS-1`` of the training loop; reconfigure on a failure and redo the lost step."""
    sums: list[list[float]] = data.setdefault("sums", [])  # type: ignore[assignment]
    events: list[dict[str, object]] = data.setdefault("events", [])  # type: ignore[assignment]
    step = start
    while step < STEPS:
        if kill and comm.member == VICTIM and step == KILL_STEP:
            _write(Path(data["out"]), comm.member, {"victim": True, "kill_time": time.time()})  # type: ignore[arg-type]
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            got, expected = _step_sum(comm)
            if not comm.commit(step):
                raise AssertionError(f"step {step} not committed")
        except PeerFailureError as exc:
            t_raise = time.time()
            rec = comm.reconfigure()
            t_reconf = time.time()
            events.append(
                {
                    "step": step,
                    "raise": t_raise,
                    "reconfigured": t_reconf,
                    "error": str(exc)[:300],
                    "failed_ranks": sorted(exc.failed_ranks),
                    "rec": rec.__dict__ | {"lost_slots": list(rec.lost_slots)},
                }
            )
            step = rec.committed_step + 1
            continue
        sums.append([step, got, expected, comm.world_size, comm.epoch])
        assert got == expected, f"step {step}: sum {got} != {expected} (world {comm.world_size})"
        step += 1


def main(scenario: str, out: Path) -> None:
    torch.set_num_threads(1)
    why = ulfm_support()
    if why is not None:  # the test skips
        _write(out, int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")), {"skip": why})
        os._exit(0)
    spares = {"shrink": 0, "hotswap": 1, "commit": 1}[scenario]
    mode = "shrink" if scenario == "shrink" else "hotswap"
    comm = UlfmCommunicator.connect(spares=spares, mode=mode, timeout=TIMEOUT)
    data: dict[str, object] = {"out": str(out), "member": comm.member, "start_slot": comm.slot}
    try:
        if comm.slot is None:
            t0 = time.time()
            rec = comm.wait_for_promotion(timeout=timedelta(seconds=40))
            data["promotion"] = None if rec is None else rec.__dict__ | {"lost_slots": list(rec.lost_slots)}
            data["promoted_at"] = time.time()
            data["waited"] = time.time() - t0
            if rec is not None:
                run_loop(comm, data, rec.committed_step + 1, kill=False)
        elif scenario == "commit":
            votes = []
            for step in range(4):
                votes.append(comm.commit(step, ok=not (step == 2 and comm.rank == 1)))
            data["votes"] = votes
            data["committed"] = comm.committed_step
        else:
            run_loop(comm, data, 0, kill=True)
        data["final"] = {"epoch": comm.epoch, "rank": comm.rank, "world_size": comm.world_size}
        comm.close()
        data["ok"] = True
    except BaseException:  # noqa: BLE001 - reported through the file
        data["ok"] = False
        data["traceback"] = traceback.format_exc()
    _write(out, comm.member, data)
    sys.stdout.flush()
    sys.stderr.flush()
    # MPI_Finalize after a peer died may wait on the runtime; the result is written.
    os._exit(0 if data["ok"] else 1)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
