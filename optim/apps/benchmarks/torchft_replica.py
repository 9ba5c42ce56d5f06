"""One replica-group process of the torchft recovery benchmark (:mod:`optim.apps.benchmarks.torchft_baseline`).

The parent starts :func:`replica_main` with multiprocessing ``spawn``, one process per replica group, and passes
it a :class:`ReplicaSettings`.  The process runs rank 0 of a replica group of size 1 with its own ``TCPStore``, loops
over ``manager.start_quorum()`` -> ``manager.allreduce(t).wait()`` -> ``manager.should_commit()`` and appends one
JSON line per event, stamped with ``time.time()``, to its own event file.  It stops at the step in the stop file
(:func:`read_stop_step`), which the parent moves forward (:func:`write_stop_step`) while a replacement catches up.

torch and torchft are imported inside the functions, in the child, so that importing this module requires neither.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resilient_comm.events import EventWriter

if TYPE_CHECKING:
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager

__all__ = ["POLL_S", "ReplicaSettings", "read_stop_step", "replica_main", "write_stop_step"]

#: Polling period of the replicas and the parent, in seconds.
POLL_S = 0.005


def _emit(events: EventWriter, kind: str, **fields: Any) -> None:
    """Appends one timestamped event to this replica's event file.

    Args:
        events: Event file of this replica process.
        kind: Event name.
        **fields: Extra JSON-serialisable fields.
    """
    events.write({"t": time.time(), "kind": kind, **fields})


def read_stop_step(path: Path, default: int) -> int:
    """Reads the step at which replicas stop; the parent may move it forward while a replacement catches up.

    Args:
        path: File holding the stop step as decimal text.
        default: Value used when the file is missing or unreadable.

    Returns:
        The stop step.
    """
    try:
        return int(path.read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return default


def write_stop_step(path: Path, step: int) -> None:
    """Atomically writes the stop step.

    Args:
        path: File holding the stop step.
        step: New stop step.
    """
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(str(step), encoding="utf-8")
    os.replace(tmp, path)


@dataclass(frozen=True, kw_only=True)
class ReplicaSettings:
    """What one replica-group process gets from the parent; pickled across the ``spawn`` boundary.

    Attributes:
        index: Replica-group index; its replica id is ``replica_{index}``.
        events: This process's JSON-lines event file.
        stop_file: File holding the step at which the replicas stop (the parent moves it forward).
        steps: Stop step while ``stop_file`` is missing or unreadable.
        numel: Float32 elements allreduced per step.
        lighthouse_addr: Address of the torchft lighthouse.
        min_replica_size: Manager ``min_replica_size``.
        manager_timeout: Manager ``timeout``.
        quorum_timeout: Manager ``quorum_timeout``.
        connect_timeout: Manager ``connect_timeout``.
        pg_timeout: ``ProcessGroupGloo(timeout=...)``, the collective timeout.
        heartbeat_interval: Manager heartbeat period to the lighthouse.
        step_sleep: Sleep between quorum and allreduce that stands in for compute.
        deadline: Absolute ``time.time()`` after which the process stops.
        rust_log: ``RUST_LOG`` of the process unless already set.
        go_file: A pre-warmed spare waits, imports done, until this file exists; None: no waiting.
    """

    index: int
    events: Path
    stop_file: Path
    steps: int
    numel: int
    lighthouse_addr: str
    min_replica_size: int
    manager_timeout: timedelta
    quorum_timeout: timedelta
    connect_timeout: timedelta
    pg_timeout: timedelta
    heartbeat_interval: timedelta
    step_sleep: timedelta
    deadline: float
    rust_log: str
    go_file: Path | None = None


@dataclass(frozen=True, kw_only=True)
class _Replica:
    """The live objects of one replica process.

    Attributes:
        manager: Its torchft manager.
        store: Its ``TCPStore`` master, referenced here so that it lives as long as the manager.
        weights: The replicated state, one float32 vector.
    """

    manager: Manager
    store: TCPStore
    weights: torch.Tensor


def replica_main(settings: ReplicaSettings) -> None:
    """Body of one replica-group process (rank 0 of a replica group of size 1).

    Args:
        settings: This replica's settings from the parent.
    """
    events = EventWriter(settings.events)
    _emit(events, "process_start", pid=os.getpid())
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("RUST_LOG", settings.rust_log)
    _import_torchft()
    _emit(events, "imported")
    if settings.go_file is not None and not _wait_for_go(settings.go_file, settings.deadline, events):
        return
    replica = _start_replica(settings, events)
    try:
        _train(replica, settings, events)
    finally:
        with contextlib.suppress(Exception):
            replica.manager.shutdown(wait=False)


def _import_torchft() -> None:
    """Imports torch and torchft (a replica's ``imported`` event comes after this) and pins torch to one thread."""
    import torch
    import torch.distributed  # noqa: F401 - its import time is part of the measured start-up
    import torchft  # noqa: F401 - its import time is part of the measured start-up

    torch.set_num_threads(1)


def _wait_for_go(go_file: Path, deadline: float, events: EventWriter) -> bool:
    """Holds a pre-warmed spare (interpreter and imports paid) until the parent's go signal.

    Args:
        go_file: The parent creates this file to release the spare.
        deadline: Absolute ``time.time()`` after which the spare gives up.
        events: The spare's event file.

    Returns:
        True once the signal is seen; False (after a ``fatal`` event) when the deadline passed first.
    """
    while not go_file.exists():
        if time.time() >= deadline:
            _emit(events, "fatal", where="prewarm", error="no go signal before the deadline")
            return False
        time.sleep(POLL_S)
    _emit(events, "go_seen")
    return True


def _start_replica(settings: ReplicaSettings, events: EventWriter) -> _Replica:
    """Starts this replica's store and torchft manager (it heals through ``load_state_dict``).

    Args:
        settings: This replica's settings.
        events: Its event file (``healed`` and ``ready`` events).

    Returns:
        The manager, the store it uses and the weights it replicates.
    """
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    weights = torch.zeros(settings.numel, dtype=torch.float32)

    def load_state_dict(state: dict[str, torch.Tensor]) -> None:
        weights.copy_(state["weights"])
        _emit(events, "healed")

    def state_dict() -> dict[str, torch.Tensor]:
        return {"weights": weights}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=settings.pg_timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=settings.min_replica_size,
        use_async_quorum=False,
        timeout=settings.manager_timeout,
        quorum_timeout=settings.quorum_timeout,
        connect_timeout=settings.connect_timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=settings.lighthouse_addr,
        replica_id=f"replica_{settings.index}",
        hostname="127.0.0.1",
        heartbeat_interval=settings.heartbeat_interval,
    )
    _emit(events, "ready")
    return _Replica(manager=manager, store=store, weights=weights)


def _train(replica: _Replica, settings: ReplicaSettings, events: EventWriter) -> None:
    """Runs steps until the stop step or the deadline, then records the final step and checksum.

    Args:
        replica: The replica's manager and weights.
        settings: This replica's settings.
        events: Its event file.
    """
    import torch

    manager, weights = replica.manager, replica.weights
    grad = torch.empty_like(weights)
    while time.time() < settings.deadline:
        step = manager.current_step()
        if step >= read_stop_step(settings.stop_file, settings.steps):
            break
        if not _quorum(manager, step, events):
            return
        time.sleep(settings.step_sleep.total_seconds())  # stand-in for forward/backward
        grad.fill_(float(settings.index + 1))
        _allreduce_and_commit(manager, weights, grad, events)
    _emit(events, "done", step=manager.current_step(), checksum=float(weights.double().sum()))


def _quorum(manager: Manager, step: int, events: EventWriter) -> bool:
    """Starts the quorum of the next step.

    Args:
        manager: The replica's manager.
        step: The step about to run.
        events: The replica's event file (``quorum_start``, then ``quorum_done`` or ``fatal``).

    Returns:
        False when the quorum failed, which torchft treats as fatal for the process.
    """
    _emit(events, "quorum_start", step=step)
    try:
        manager.start_quorum()
    except Exception as exc:  # torchft treats a failed quorum as fatal for the process
        _emit(events, "fatal", where="start_quorum", error=repr(exc)[:300])
        return False
    _emit(
        events,
        "quorum_done",
        step=manager.current_step(),
        quorum_id=getattr(manager, "_quorum_id", None),
        participants=manager.num_participants(),
        errored=manager.errored() is not None,
    )
    return True


def _allreduce_and_commit(manager: Manager, weights: torch.Tensor, grad: torch.Tensor, events: EventWriter) -> None:
    """Averages ``grad`` over the quorum and applies it to ``weights`` if the step commits.

    Args:
        manager: The replica's manager.
        weights: The replicated state.
        grad: This replica's gradient; averaged in place.
        events: The replica's event file (``allreduce`` and ``commit``).
    """
    ok = bool(manager.allreduce(grad).wait())
    err = manager.errored()
    _emit(
        events,
        "allreduce",
        step=manager.current_step(),
        ok=ok and err is None,
        error=None if err is None else repr(err.original_exception)[:300],
    )
    committed = manager.should_commit()
    if committed:
        weights.add_(grad, alpha=-1e-3)
    _emit(events, "commit", committed=bool(committed), step=manager.current_step())
