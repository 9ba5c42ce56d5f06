"""The control plane in etcd: a 3-member cluster started here, coordinators that replace each other, real SIGKILLs.

* :class:`~bindings.etcd_store.EtcdStore` keeps torch's ``Store`` contract
  (waits, atomic counters, compare-and-set) and carries a gloo rendezvous;
* the active coordinator SIGKILLed mid-training: a standby takes over through
  the lease, a worker SIGKILLed after that is hot-swapped by the new
  coordinator, and the losses and final parameters are the failure-free
  run's, bit for bit;
* a paused (SIGSTOPped) coordinator loses its lease, and when it wakes its
  writes are fenced off: it becomes a standby, the job goes on;
* one of the three etcd members SIGKILLed mid-training: the job goes on and
  commits every step once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import DistStoreError

from bindings.etcd_store import EtcdStore, FencedError
from optim.testing.etcd_cluster import EtcdCluster, etcd_unavailable
from optim.testing.hosts import wait_for
from resilient_comm.config import CoordinatorConfig
from resilient_comm.events import read_event_dir, read_events
from tests.resilient.harness import JobWatch, check_contiguous

pytestmark = [pytest.mark.dist, pytest.mark.skipif(etcd_unavailable() is not None, reason=str(etcd_unavailable()))]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "resilient_loop.py"
STEPS = 40
JOB_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with EtcdCluster(3, tmp_path_factory.mktemp("etcd")) as c:
        yield c


def _env(extra: dict[str, str]) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def _store(cluster: EtcdCluster, prefix: str, timeout: float = 5.0) -> EtcdStore:
    return EtcdStore(f"{cluster.address}/{prefix}{time.monotonic_ns()}", timedelta(seconds=timeout))


# ---------------------------------------------------------------------- the store
@pytest.mark.timeout(60)
def test_the_store_keeps_torchs_contract(cluster: EtcdCluster) -> None:
    s = _store(cluster, "contract")
    s.set("a", b"\x00\xffbytes")
    assert s.get("a") == b"\x00\xffbytes" and s.check(["a"]) and not s.check(["a", "b"])
    threading.Timer(0.3, lambda: s.clone().set("late", "1")).start()
    t0 = time.monotonic()
    assert s.get("late") == b"1" and 0.2 < time.monotonic() - t0 < 3  # get waits for the key
    s.set_timeout(timedelta(seconds=0.5))
    t0 = time.monotonic()
    with pytest.raises(DistStoreError):
        s.get("never")
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(DistStoreError):
        s.wait(["never"], timedelta(seconds=0.3))
    s.set_timeout(timedelta(seconds=5))
    # compare_set: TCPStore's rule
    assert s.compare_set("c", "", "v1") == b"v1"
    assert s.compare_set("c", "wrong", "v2") == b"v1"
    assert s.compare_set("c", "v1", "v3") == b"v3"
    assert s.compare_set("absent", "x", "y") == b"x" and not s.check(["absent"])
    assert s.multi_get(["a", "c"]) == [b"\x00\xffbytes", b"v3"]
    assert s.delete_key("a") and not s.delete_key("a") and s.num_keys() == 2  # late and c


@pytest.mark.timeout(60)
def test_add_is_atomic_across_clients(cluster: EtcdCluster) -> None:
    s = _store(cluster, "add")
    clients = [s.clone() for _ in range(4)]
    seen: list[int] = []
    lock = threading.Lock()

    def bump(c: EtcdStore) -> None:
        for _ in range(25):
            v = c.add("n", 1)
            with lock:
                seen.append(v)

    threads = [threading.Thread(target=bump, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(1, 101)) and s.add("n", 0) == 100


@pytest.mark.timeout(60)
def test_a_fenced_writer_cannot_write_once_the_fence_moved(cluster: EtcdCluster) -> None:
    s = _store(cluster, "fence")
    lease = s.grant(timedelta(seconds=2))
    assert s.create_leased("leader", "me", lease) and not s.create_leased("leader", "you", lease)
    s.fence("leader", "me")
    s.set("k", "1")
    assert s.add("n", 2) == 2
    s.revoke(lease)  # the leader key goes with the lease
    with pytest.raises(FencedError):
        s.set("k", "2")
    with pytest.raises(FencedError):
        s.compare_set("k", "1", "3")
    s.fence(None)
    assert s.get("k") == b"1"


@pytest.mark.timeout(60)
def test_a_dead_endpoint_is_skipped(cluster: EtcdCluster) -> None:
    with EtcdCluster(1) as lone:
        dead = lone.address.removeprefix("etcd://")
    s = EtcdStore(f"etcd://{dead},{cluster.address.removeprefix('etcd://')}/dead{time.monotonic_ns()}")
    s.set("a", "1")
    assert s.get("a") == b"1"


GLOO_WORKER = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
from bindings.etcd_store import EtcdStore
from bindings.store import prefix_store
rank, address = int(sys.argv[1]), sys.argv[2]
base = EtcdStore(address, timedelta(seconds=30))
dist.init_process_group("gloo", store=prefix_store("ep0/", base), rank=rank, world_size=2)
x = torch.full((4,), float(rank + 1))
dist.all_reduce(x)
print(x.tolist())
dist.destroy_process_group()
"""


@pytest.mark.timeout(90)
def test_a_gloo_rendezvous_through_the_store(cluster: EtcdCluster) -> None:
    address = f"{cluster.address}/gloo{time.monotonic_ns()}"
    procs = [
        subprocess.Popen([sys.executable, "-c", GLOO_WORKER, str(r), address], env=_env({}), stdout=subprocess.PIPE)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=60)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert all("[3.0, 3.0, 3.0, 3.0]" in o for o in outs), outs


# ---------------------------------------------------------------------- coordinators
def _coordinator(
    cluster: EtcdCluster, job: str, tmp: Path, name: str, watch: JobWatch, hb: float, world_size: int = 4
) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "optim", "coordinator", "--store", cluster.address, "--job", job]
    argv += ["--world-size", str(world_size), "--heartbeat-timeout", str(hb), "--events", str(tmp / f"{name}.jsonl")]
    return subprocess.Popen(
        argv, env=_env(watch.env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )


def _events(tmp: Path, name: str, event: str, **match: Any) -> list[dict[str, Any]]:
    recs = read_events(tmp / f"{name}.jsonl", missing_ok=True)
    return [e for e in recs if e["event"] == event and all(e.get(k) == v for k, v in match.items())]


def _launch_example(
    tmp: Path, store: str, watch: JobWatch, job: str | None, hb: float, spares: int, step_seconds: float = 0.0
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "optim", "launch", "--nproc", "4", "--spares", str(spares), "--store", store]
    cmd += ["--heartbeat-timeout", str(hb), "--job-timeout", str(JOB_TIMEOUT_S), "--events", str(tmp / "launch.jsonl")]
    cmd += [] if job is None else ["--job", job]
    cmd += ["--", sys.executable, str(EXAMPLE), "--optimizer", "scape", "--steps", str(STEPS)]
    cmd += ["--out", str(tmp / "report.json"), "--step-seconds", str(step_seconds)]
    return subprocess.Popen(
        cmd, env=_env(watch.env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )


def _finish(proc: subprocess.Popen[bytes]) -> str:
    """Wait for ``proc`` to end; its output's tail."""
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT_S + 30)
    finally:
        _kill(proc)
    return out.decode(errors="replace")[-3000:]


def _kill(*procs: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL the process groups of those still running."""
    for p in procs:
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The example without failures, on the default TCPStore control plane."""
    tmp = tmp_path_factory.mktemp("ref")
    proc = _launch_example(tmp, "tcp", JobWatch(), None, 10.0, 0)
    log = _finish(proc)
    assert proc.returncode == 0, log
    return dict(json.loads((tmp / "report.json").read_text()))


def _job(tag: str) -> str:
    return f"{tag}{time.monotonic_ns() % 10**9}"


@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 60)
def test_killed_coordinator_is_replaced_and_training_is_bitwise_unchanged(
    cluster: EtcdCluster, tmp_path: Path, reference: dict[str, Any]
) -> None:
    """c1 (standalone) is active, the launcher's coordinator stands by; SIGKILL c1, then a worker."""
    hb, job, watch = 3.0, _job("ha"), JobWatch()
    pace = 0.3  # s per step: training goes on through the takeover and must still be running after it
    c1 = _coordinator(cluster, job, tmp_path, "c1", watch, hb)
    launcher: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: _events(tmp_path, "c1", "coordinator_elected"), 30, "c1 to become active")
        launcher = _launch_example(tmp_path, cluster.address, watch, job, hb, spares=1, step_seconds=pace)
        address = CoordinatorConfig(world_size=1, store=cluster.address, job=job).store_address
        watch.connect(address, lambda: launcher is not None and launcher.poll() is None, 60)
        wait_for(lambda: watch.committed() >= 8 and _events(tmp_path, "c1", "member_started"), 90, "step 8")
        wait_for(lambda: len(_events(tmp_path, "c1", "member_started")) == 5, 60, "the spare to register")
        t_kill = time.time()
        c1.send_signal(signal.SIGKILL)
        c1.wait()
        committed_at_kill = watch.committed()
        took = wait_for(lambda: _events(tmp_path, "launch", "coordinator_elected", resumed=True), 30, "a takeover")[0]
        after = watch.committed()
        print(f"\ncoordinator SIGKILL at step {committed_at_kill}: standby active after {took['time'] - t_kill:.2f} s")
        assert took["time"] - t_kill <= hb + 3.0
        assert len(took["members"]) == 5 and len(took["spares"]) == 1
        assert after >= committed_at_kill  # training never waited for a coordinator
        wait_for(lambda: watch.committed() >= min(after + 3, STEPS - 10), 90, "progress after the takeover")
        worker = watch.pid_of_slot(1)
        os.kill(worker, signal.SIGKILL)
        assert watch.committed() <= STEPS - 4, "the job was nearly done before the worker's kill: raise the pace"
        log = _finish(launcher)
        assert launcher.returncode == 0, log
    finally:
        _kill(c1, launcher)
    got = json.loads((tmp_path / "report.json").read_text())
    assert _events(tmp_path, "launch", "spare_promoted"), "the new coordinator did not hot-swap the spare"
    assert sorted(int(k) for k in got["losses"]) == list(range(1, STEPS + 1)), "a committed step is missing"
    assert got["losses"] == reference["losses"]  # exact, every step
    assert got["params_sha256"] == reference["params_sha256"]
    assert got["world_size"] == 4 and len(got["recoveries"]) >= 1


def _drill_job(
    cluster: EtcdCluster, tmp: Path, watch: JobWatch, job: str, hb: float, steps: int, spares: int = 0
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "optim", "launch", "--nproc", "3", "--store", cluster.address, "--job", job]
    cmd += ["--spares", str(spares)]
    cmd += ["--heartbeat-timeout", str(hb), "--job-timeout", str(JOB_TIMEOUT_S), "--events", str(tmp / "launch.jsonl")]
    cmd += ["--", sys.executable, "-m", "optim.testing.drill", "--steps", str(steps), "--sleep", "0.02"]
    cmd += ["--log", str(tmp / "drill"), "--timeout", "20"]
    return subprocess.Popen(
        cmd, env=_env(watch.env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )


def _check_drill(tmp: Path, steps: int, processes: int = 3, killed: int = -1) -> None:
    """Every drill process but ``killed`` committed each step once and ended cleanly."""
    logs = {int(path.stem): recs for path, recs in read_event_dir(tmp / "drill").items()}
    assert len(logs) == processes
    for pid, recs in logs.items():
        if pid == killed:
            continue
        steps_seen = check_contiguous(recs)
        assert steps_seen[-1] == steps - 1 and recs[-1]["event"] == "done", (pid, recs[-3:])
        if killed < 0:
            assert steps_seen == list(range(steps)), pid
            assert not [r for r in recs if r["event"] in ("raised", "reconfigured", "error")], (pid, recs[-3:])


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_a_paused_coordinator_is_fenced_off_and_becomes_a_standby(cluster: EtcdCluster, tmp_path: Path) -> None:
    hb, job, watch, steps = 2.0, _job("pause"), JobWatch(), 200
    launcher = _drill_job(cluster, tmp_path, watch, job, hb, steps)
    c2: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: _events(tmp_path, "launch", "epoch_configured"), 60, "the job to start")
        c2 = _coordinator(cluster, job, tmp_path, "c2", watch, hb)
        time.sleep(1.0)  # c2 stands by
        assert not _events(tmp_path, "c2", "coordinator_elected")
        os.kill(launcher.pid, signal.SIGSTOP)  # the launcher and its coordinator; the workers run on
        try:
            wait_for(lambda: _events(tmp_path, "c2", "coordinator_elected", resumed=True), 30, "c2 to take over")
        finally:
            os.kill(launcher.pid, signal.SIGCONT)
        wait_for(lambda: _events(tmp_path, "launch", "coordinator_deposed"), 30, "the old coordinator to step down")
        log = _finish(launcher)
        assert launcher.returncode == 0, log
    finally:
        _kill(c2, launcher)
    _check_drill(tmp_path, steps)
    assert not _events(tmp_path, "c2", "failure_detected") and not _events(tmp_path, "launch", "job_failed")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_one_of_three_etcd_members_killed_mid_training(tmp_path: Path) -> None:
    steps, watch = 300, JobWatch()
    with EtcdCluster(3, tmp_path) as own:  # its own cluster: the module's keeps all three members
        launcher = _drill_job(own, tmp_path, watch, _job("etcdkill"), 3.0, steps)
        try:
            wait_for(lambda: _events(tmp_path, "launch", "epoch_configured"), 60, "the job to start")
            logs = tmp_path / "drill"
            wait_for(
                lambda: any(check_contiguous(r)[-1:] >= [50] for r in read_event_dir(logs).values()), 60, "step 50"
            )
            own.kill(0)
            log = _finish(launcher)
            assert launcher.returncode == 0, log
        finally:
            _kill(launcher)
    _check_drill(tmp_path, steps)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_a_coordinator_killed_while_it_replaces_a_worker_is_finished_by_the_standby(
    cluster: EtcdCluster, tmp_path: Path
) -> None:
    """A worker SIGKILLed; the moment the active coordinator declares it dead, the coordinator is SIGKILLed too."""
    hb, job, watch, steps = 2.0, _job("midway"), JobWatch(), 150
    c1 = _coordinator(cluster, job, tmp_path, "c1", watch, hb, world_size=3)
    launcher: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: _events(tmp_path, "c1", "coordinator_elected"), 30, "c1 to become active")
        launcher = _drill_job(cluster, tmp_path, watch, job, hb, steps, spares=1)
        wait_for(lambda: len(_events(tmp_path, "c1", "member_started")) == 4, 60, "every process to register")
        logs = tmp_path / "drill"
        wait_for(lambda: any(check_contiguous(r)[-1:] >= [20] for r in read_event_dir(logs).values()), 60, "step 20")
        address = CoordinatorConfig(world_size=1, store=cluster.address, job=job).store_address
        watch.connect(address, lambda: launcher is not None and launcher.poll() is None, 60)
        victim = watch.pid_of_slot(1)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: _events(tmp_path, "c1", "failure_detected"), 30, "c1 to detect the failure", 0.002)
        c1.send_signal(signal.SIGKILL)
        c1.wait()
        proposed = [e["epoch"] for e in _events(tmp_path, "c1", "epoch_proposed")]
        print(f"\nc1 killed after proposing epochs {proposed}")
        took = wait_for(lambda: _events(tmp_path, "launch", "coordinator_elected", resumed=True), 30, "a takeover")
        log = _finish(launcher)
        assert launcher.returncode == 0, log
    finally:
        _kill(c1, launcher)
    assert len(took[0]["members"]) == 4, took
    promoted = _events(tmp_path, "c1", "spare_promoted") + _events(tmp_path, "launch", "spare_promoted")
    assert len(promoted) == 1, promoted  # one hot-swap, by whichever coordinator got that far
    _check_drill(tmp_path, steps, processes=4, killed=victim)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_when_the_work_ends_the_spare_and_both_coordinators_exit_0(cluster: EtcdCluster, tmp_path: Path) -> None:
    """Two standalone coordinators (one active, one standing by), two workers and a spare started by hand:
    when the workers finish, the spare, the active coordinator and the standby all exit 0."""
    job, watch = _job("end"), JobWatch()
    coords = [_coordinator(cluster, job, tmp_path, name, watch, 2.0, world_size=2) for name in ("c1", "c2")]
    address = CoordinatorConfig(world_size=1, store=cluster.address, job=job).store_address
    procs: list[subprocess.Popen[bytes]] = []
    try:
        names = ("c1", "c2")
        wait_for(lambda: any(_events(tmp_path, n, "coordinator_elected") for n in names), 30, "an active coordinator")
        for role, slot in (("active", 0), ("active", 1), ("spare", -1)):
            env = {**watch.env, "SPARSECOMM_COORDINATOR": address, "SPARSECOMM_JOB_ID": job}
            env.update({"SPARSECOMM_ROLE": role, "SPARSECOMM_SLOT": str(slot)})
            cmd = [sys.executable, str(EXAMPLE), "--optimizer", "adamw", "--steps", "20"]
            cmd += ["--out", str(tmp_path / f"out{slot}.json")]
            procs.append(subprocess.Popen(cmd, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outs = [p.communicate(timeout=JOB_TIMEOUT_S)[0].decode(errors="replace")[-2000:] for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], outs
        codes = [c.wait(timeout=30) for c in coords]
        assert codes == [0, 0], [c.communicate()[0].decode(errors="replace")[-2000:] for c in coords]
    finally:
        _kill(*coords, *procs)
    completed = _events(tmp_path, "c1", "job_completed") + _events(tmp_path, "c2", "job_completed")
    assert len(completed) == 1 and completed[0]["committed_step"] == 20, completed
