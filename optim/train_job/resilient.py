"""Failure-transparent training: the train job on a fault-aware communicator with in-memory snapshots.

The parent (:func:`run_resilient_training`) starts a coordinator, ``nproc``
workers and ``spares`` spares with :class:`resilient_comm.launcher.Launcher`,
SIGKILLs the workers named by ``kills`` (``(slot, step)``: while that step
runs) from outside, and collects the result. Every worker
(``python -m optim.train_job.resilient SPEC``) runs :func:`worker_main`:

* the step loop of :func:`optim.train_job.train.train_worker` (same model, data order
  from ``(seed, step, slot)``, learning-rate schedule, sharded optimizer) over
  a :class:`~resilient_comm.FaultAwareCommunicator`, with a commit vote after
  each ``optimizer.step()``: a step counts everywhere or nowhere;
* after each committed step, a snapshot of the rank's own state (optimizer
  shard with masks in flight, step, RNG) into a double-buffered host ring,
  replicated to the buddy (next slot) on a background thread over the epoch's
  side channel (:class:`optim.snapshot.Replicator`);
* on a failure: ``reconfigure()`` (a spare takes the dead slot, or the world
  shrinks), then :func:`_recover`: the members agree on the newest step ``R``
  whose state every slot still has (own ring, or the buddy's copy of a lost
  slot), the buddy sends the lost slot's snapshot to its new holder, everyone
  rebuilds the optimizer, restores ``R`` and the parameters, and the loop goes
  on at ``R + 1``. With no copy left the job stops with
  :class:`~optim.snapshot.UnrecoverableStateError`, never silently.

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
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

import sparsecomm.distributed as dist
from bindings.errors import CommError, PeerFailureError
from bindings.store import open_store
from optim.local import LocalAdamS, ReplicatedAdamS
from optim.scape import SCAPE
from optim.snapshot import Replicator, SnapshotRing, UnrecoverableStateError, decode_tree
from optim.train_job.tasks import make_task
from optim.train_job.train import TrainConfig, _evaluate, build_optimizer, lr_at
from resilient_comm import FaultAwareCommunicator, Reconfiguration
from resilient_comm.keys import COMMITTED
from resilient_comm.launcher import LaunchConfig, Launcher
from resilient_comm.membership import parse_address
from sparsecomm.mask import k_for

__all__ = ["ResilienceConfig", "run_resilient_training", "worker_main", "RECOVERY_MODES"]

logger = logging.getLogger(__name__)

RECOVERY_MODES = ("hotswap", "shrink")


@dataclass(frozen=True, kw_only=True)
class ResilienceConfig:
    """The fault-tolerance side of a training run.

    Attributes:
        spares: Spare processes in standby.
        kills: ``(slot, step)`` pairs: SIGKILL the worker holding ``slot`` while ``step`` runs.
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
    """

    spares: int = 1
    kills: tuple[tuple[int, int], ...] = ()
    snapshot: bool = True
    recovery: str = "hotswap"
    heartbeat_timeout_s: float = 2.0
    snapshot_block: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.spares, bool) or not isinstance(self.spares, int) or self.spares < 0:
            raise ValueError(f"spares: must be an int >= 0, got {self.spares!r}")
        if self.recovery not in RECOVERY_MODES:
            raise ValueError(f"recovery: must be one of {RECOVERY_MODES}, got {self.recovery!r}")
        if not self.heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s: must be > 0, got {self.heartbeat_timeout_s!r}")
        block = self.snapshot_block
        if isinstance(block, bool) or not isinstance(block, int) or block < 0:
            raise ValueError(f"snapshot_block: must be an int >= 0, got {block!r}")
        for kill in self.kills:
            if len(kill) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in kill):
                raise ValueError(f"kills: expected (slot, step) int pairs, got {kill!r}")
            if kill[0] < 0 or kill[1] < 1:
                raise ValueError(f"kills: slot must be >= 0 and step >= 1, got {kill!r}")

    def check_against(self, config: TrainConfig) -> None:
        """Raise ``ValueError`` for kills outside the run or a non-sharded optimizer."""
        if config.optimizer == "allreduce-adamw":
            raise ValueError(
                "resilient training needs one of our optimizers (adams, adamw, scape, local-adams, topk-adams), "
                f"not {config.optimizer}"
            )
        for slot, step in self.kills:
            if slot >= config.nproc or step > config.steps:
                raise ValueError(f"kill {slot}@{step}: outside {config.nproc} slots x {config.steps} steps")


# ---------------------------------------------------------------------------------------------- worker
class _Log:
    """One JSON object per line into this process's event file."""

    def __init__(self, directory: Path) -> None:
        self._file = open(directory / f"{os.getpid()}.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def __call__(self, event: str, **fields: Any) -> None:
        self._file.write(json.dumps({"time": time.time(), "event": event, "pid": os.getpid(), **fields}) + "\n")
        self._file.flush()


def _params_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _Worker:
    def __init__(self, config: TrainConfig, res: ResilienceConfig, out: Path) -> None:
        self.config, self.res, self.out = config, res, out
        self.log = _Log(out)
        torch.set_num_threads(config.threads)
        # torch imports its compiler stack lazily on the first optimizer built (about 1 s): pay it
        # now, not while every member waits for a promoted spare to rebuild its optimizer.
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        self.comm = FaultAwareCommunicator.connect(
            timeout=timedelta(seconds=config.comm_timeout_s), side_channel=res.snapshot
        )
        dist.init_process_group(communicator=self.comm)
        self.task = make_task(config.task_spec())
        torch.manual_seed(config.seed)
        self.model = self.task.build_model()
        self.init_state = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.init_rng = torch.get_rng_state()
        self.optimizer: Any = None
        self.own = SnapshotRing()
        self.ward = SnapshotRing()
        self.replicator: Replicator | None = None
        self.losses: dict[int, float] = {}
        self.evals: dict[int, float] = {}
        self.snapshot_s: list[float] = []
        self.recoveries: list[dict[str, Any]] = []

    # -------------------------------------------------------------- snapshots
    def _snapshot(self, step: int) -> None:
        """Snapshot the state after ``step``: collected here, copied and replicated by the replicator thread.

        The copy overlaps the next step's forward and backward; :meth:`_settle`
        waits for it before the optimizer changes the state again.
        """
        t0 = time.perf_counter()
        tree = {"optim": self.optimizer.snapshot_state(), "rng": torch.get_rng_state(), "step": step}
        if self.replicator is not None:
            self.replicator.submit_tree(step, tree, self.own)
        else:
            self.own.put(step, tree)
        self.snapshot_s.append(time.perf_counter() - t0)

    def _snapshots_at(self, step: int) -> bool:
        """Whether the state after ``step`` is snapshotted (always, unless ``snapshot_block`` alternates)."""
        block = self.res.snapshot_block
        return block == 0 or ((step - 1) // block) % 2 == 0

    def _settle(self) -> None:
        """Wait until the last snapshot was copied out (it reads the optimizer's live tensors)."""
        if self.replicator is not None:
            t0 = time.perf_counter()
            if not self.replicator.wait_encoded(self.config.comm_timeout_s):
                raise RuntimeError("snapshot copy did not finish")
            self.snapshot_s[-1] += time.perf_counter() - t0
            failed = self.replicator.failed
            if failed is not None and self.comm.healthy:
                # not a peer failure (the epoch is fine): going on would leave this slot unprotected
                raise RuntimeError(f"snapshot replication stopped: {failed}")

    def _start_replicator(self, version: int) -> None:
        """Start replicating on the current epoch, beginning with the held ``version``. Collective."""
        side = self.comm.side_channel
        if side is None:
            return
        cap = torch.tensor(
            [max((b.numel() for b in (self.own.get(v) for v in self.own.versions()) if b is not None), default=0)],
            dtype=torch.int64,
        )
        dist.all_reduce(cap, op=dist.ReduceOp.MAX)
        self.capacity = int(cap) + self._snapshot_headroom()
        self.replicator = Replicator(side, self.capacity, self.ward, timedelta(seconds=self.config.comm_timeout_s))
        buf = self.own.get(version)
        assert buf is not None
        self.replicator.submit(version, buf)

    def _snapshot_headroom(self) -> int:
        """Bytes a later snapshot may add to the largest one held now (the replication capacity's slack).

        Headers grow a little with the step number; SCAPE's snapshots hold no
        masks during its dense warm-up and ``mask_delay`` masks of
        ``world_size x k`` int64 indices once it is sparse. Without this slack
        such a snapshot would exceed the capacity and replication would stop.
        """
        headroom = 64 << 10
        density = getattr(self.optimizer, "density", 1.0)
        if isinstance(self.optimizer, SCAPE) and density < 1.0:
            b = self.optimizer.bucket
            headroom += self.optimizer.mask_delay * b.world_size * k_for(b.numel, b.world_size, density) * 8
        return headroom

    def _stop_replicator(self) -> None:
        if self.replicator is not None:
            self.replicator.stop()
            self.replicator = None

    # -------------------------------------------------------------- state
    def _build_optimizer(self) -> None:
        if self.optimizer is not None:
            self.optimizer.abandon()
        self.optimizer = build_optimizer(self.config, self.model)

    def _restore(self, tree: dict[str, Any] | None) -> None:
        """Rebuild the optimizer and load ``tree`` (``None``: the initial state). Collective."""
        if tree is None:
            self.model.load_state_dict(self.init_state)
            torch.set_rng_state(self.init_rng)  # as after the model's initialisation in the first epoch
            self._build_optimizer()
            return
        self._build_optimizer()
        self.optimizer.restore_snapshot(tree["optim"])
        self.optimizer.resync_params()
        torch.set_rng_state(tree["rng"])

    def _recover(self, change: Reconfiguration | None) -> int:
        """Agree on the restore step, move lost snapshots, restore. Returns the next step. Collective."""
        t0 = time.time()
        phases: dict[str, float] = {}
        self._stop_replicator()
        phases["stop_replication_s"] = time.time() - t0
        comm = self.comm
        old_slot = -1
        if change is not None and not change.promoted_here:
            inverse = {new: old for old, new in change.rank_map.items()}
            old_slot = inverse.get(comm.rank, comm.rank)
        old_world = comm.world_size + len(change.lost_slots) - len(change.promoted) if change else comm.world_size
        own_v = [v for v in self.own.versions()] if old_slot >= 0 else []
        ward_v = [v for v in self.ward.versions()] if old_slot >= 0 else []
        row = [old_slot, (old_slot - 1) % old_world if old_slot >= 0 else -1]
        row += (own_v + [-1, -1])[:2] + (ward_v + [-1, -1])[:2]
        mine = torch.tensor(row, dtype=torch.int64)
        rows = torch.empty(comm.world_size * len(row), dtype=torch.int64)
        dist.all_gather_into_tensor(rows, mine)
        table = rows.view(comm.world_size, len(row)).tolist()
        have: dict[int, set[int]] = {s: set() for s in range(old_world)}
        holder: dict[int, int] = {}
        # a slot's state is on its holder, unless the holder has none (a spare promoted by an epoch whose
        # recovery failed before it restored): then, as for a lost slot, the buddy's copy counts
        stateful = {r[0] for r in table if r[0] >= 0 and (r[2] >= 0 or r[3] >= 0)}
        for new_rank, (slot, ward_slot, o1, o2, w1, w2) in enumerate(table):
            if slot >= 0:
                have[slot] |= {v for v in (o1, o2) if v >= 0}
            if ward_slot >= 0 and ward_slot not in stateful:
                have[ward_slot] |= {v for v in (w1, w2) if v >= 0}
                holder[ward_slot] = new_rank
        if any(0 in (r[2], r[3]) for r in table) or not any(have.values()):
            # at most one step in (or not even the first snapshot taken): the initial state, version 0,
            # is rebuilt from the seed on every slot, also on one whose first snapshot never reached its buddy
            for versions in have.values():
                versions.add(0)
        common = set.intersection(*have.values()) if have else set()
        restore_step = max(common) if common and self.res.snapshot else -1
        if restore_step < 0 and self.res.snapshot and any(have.values()):
            lost = [s for s, v in have.items() if not v]
            raise UnrecoverableStateError(f"no common snapshot step: slots {lost} have no copy left")
        phases["agree_s"] = time.time() - t0
        shrunk = change is not None and len(change.lost_slots) > len(change.promoted)
        if shrunk and restore_step > 0 and isinstance(self.optimizer, ReplicatedAdamS):
            # every survivor holds a whole replica: it goes on from its own (the lost ones' drift is dropped)
            buf = self.own.get(restore_step)
            if buf is None:
                raise UnrecoverableStateError(f"no own snapshot of step {restore_step}")
            own = decode_tree(buf)
            phases["transfer_s"] = time.time() - t0
            self._build_optimizer()
            self.optimizer.restore_replica(own["optim"])
            torch.set_rng_state(own["rng"])
        elif shrunk and restore_step > 0:
            full, rng = self._gather_full_state(restore_step, old_slot, holder, old_world)
            phases["transfer_s"] = time.time() - t0
            self._restore_resharded(restore_step, full, rng)
        else:
            tree: dict[str, Any] | None = None
            if restore_step > 0:  # 0: the initial state, rebuilt from the seed (no snapshot needed)
                tree = self._fetch(restore_step, old_slot, table, holder, change)
            phases["transfer_s"] = time.time() - t0
            self._restore(tree)
        phases["restore_s"] = time.time() - t0
        self.own.clear()
        self.ward.clear()
        self._snapshot(max(restore_step, 0))
        self._start_replicator(max(restore_step, 0))
        phases["replication_s"] = time.time() - t0
        cfg = self.config
        if restore_step > 0 and (
            restore_step == cfg.steps or (cfg.eval_interval and restore_step % cfg.eval_interval == 0)
        ):
            self.evals[restore_step] = _evaluate(self.model, self.optimizer, self.task, cfg, comm.rank)
        dt = time.time() - t0
        last = max(self.losses) if self.losses else 0
        recomputed = max(0, last - restore_step) if restore_step >= 0 else last
        for s in [s for s in self.losses if s > restore_step]:
            del self.losses[s]
        for s in [s for s in self.evals if s > restore_step]:
            del self.evals[s]
        rec = {
            "restore_step": restore_step,
            "recover_s": dt,
            "steps_recomputed": recomputed,
            "epoch": comm.epoch,
            "world_size": comm.world_size,
            "rank": comm.rank,
            "phases_s": phases,
        }
        self.recoveries.append(rec)
        self.log("restored", **rec)
        return max(restore_step, 0) + 1  # no snapshot (-1): start again at step 1, as the first epoch did

    def _fetch(
        self, step: int, old_slot: int, table: list[list[int]], holder: dict[int, int], change: Reconfiguration | None
    ) -> dict[str, Any]:
        """This rank's snapshot of ``step``: from its own ring, or sent by the buddy of a lost slot."""
        comm = self.comm
        world = comm.world_size
        sizes = torch.zeros(1, dtype=torch.int64)
        received: dict[str, Any] | None = None
        for lost, h in sorted(holder.items()):
            target = lost  # hot-swap: the lost slot's new holder has the same rank
            if comm.rank == h:
                buf = self.ward.get(step)
                assert buf is not None
                sizes[0] = buf.numel()
            dist.broadcast(sizes, src=h)
            if comm.rank == h:
                dist.send(buf, dst=target)  # type: ignore[arg-type]
            elif comm.rank == target:
                recv = torch.empty(int(sizes[0]), dtype=torch.uint8)
                dist.recv(recv, src=h)
                received = decode_tree(recv)
        if received is not None:
            return received
        buf = self.own.get(step)
        if buf is None or old_slot < 0:
            raise UnrecoverableStateError(f"rank {comm.rank} of {world}: no snapshot of step {step}")
        return decode_tree(buf)

    def _gather_full_state(
        self, step: int, old_slot: int, holder: dict[int, int], old_world: int
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """Every member gets the whole flat optimizer state of ``step`` (shrink). Collective.

        Each old slot's shard comes from exactly one member: the slot's survivor
        (its own snapshot) or, for a lost slot, the buddy that holds its copy.
        Members place what they hold into zeroed full-size vectors and one SUM
        all-reduce assembles them (adding zeros is exact).
        """
        comm = self.comm
        mine: list[tuple[int, dict[str, Any]]] = []
        if old_slot >= 0:
            buf = self.own.get(step)
            if buf is None:
                raise UnrecoverableStateError(f"no own snapshot of step {step}")
            mine.append((old_slot, decode_tree(buf)))
        for lost, h in holder.items():
            if h == comm.rank:
                buf = self.ward.get(step)
                if buf is None:
                    raise UnrecoverableStateError(f"no copy of lost slot {lost} at step {step}")
                mine.append((lost, decode_tree(buf)))
        names = ["master", *sorted(self.optimizer.shard_state)]
        meta = torch.zeros(2, dtype=torch.int64)  # (shard size of the old layout, numel)
        if mine:
            snap = mine[0][1]["optim"]
            meta[0], meta[1] = snap["master"].numel(), int(snap["numel"])
        dist.all_reduce(meta, op=dist.ReduceOp.MAX)
        shard, numel = int(meta[0]), int(meta[1])
        flat = torch.zeros(len(names), shard * old_world, dtype=torch.float32)
        for slot, tree in mine:
            snap = tree["optim"]
            for i, name in enumerate(names):
                src = snap["master"] if name == "master" else snap["shard"][name]
                flat[i, slot * shard : (slot + 1) * shard] = src
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        rng = mine[0][1]["rng"] if mine and old_slot >= 0 else None
        return {name: flat[i, :numel] for i, name in enumerate(names)}, rng

    def _restore_resharded(self, step: int, full: dict[str, torch.Tensor], rng: torch.Tensor | None) -> None:
        """Rebuild the optimizer over the smaller world and load its new shard of ``full``. Collective.

        Masks in flight belonged to the old layout: SCAPE makes the masks of the
        next steps again from the restored state, in the new layout (the next
        step stays sparse: a dense step on SCAPE's state would apply its stale
        first moments everywhere at once). An error-feedback residual is per
        rank and starts again from zero.
        """
        self._build_optimizer()
        b = self.optimizer.bucket
        lo, hi = b.shard_lo, b.shard_lo + b.shard_size

        def piece(v: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(b.shard_size, dtype=torch.float32)
            real = v[lo:hi]
            out[: real.numel()] = real
            return out

        residual = getattr(self.optimizer, "residual", None)
        tree = {
            "step": step,
            "rank": b.rank,
            "world_size": b.world_size,
            "numel": b.numel,
            "master": piece(full["master"]),
            "shard": {name: piece(full[name]) for name in self.optimizer.shard_state},
            "extra": {"masks": {}, "residual": None if residual is None else torch.zeros_like(residual)}
            if hasattr(self.optimizer, "density")
            else {},
        }
        self.optimizer.restore_snapshot(tree)
        self.optimizer.resync_params()
        if rng is not None:
            torch.set_rng_state(rng)

    # -------------------------------------------------------------- loop
    def run(self) -> int:
        cfg, comm = self.config, self.comm
        if comm.view is None:
            change = comm.wait_for_promotion()
            if change is None:
                comm.close()
                return 0
            self.log("promoted", epoch=change.epoch, rank=change.rank)
            step = self._recover_until_ok(change)
        else:
            self.log("joined", epoch=comm.epoch, rank=comm.rank, world_size=comm.world_size)
            try:
                self._build_optimizer()
                self._snapshot(0)
                self._start_replicator(0)
                step = 1
            except PeerFailureError as exc:  # a member died before step 1: recover like at any step
                self.log("failed", step=0, epoch=comm.epoch, error=str(exc)[:200])
                step = self._recover_until_ok(comm.reconfigure())
        while step <= cfg.steps:
            try:
                step = self._step(step)
            except PeerFailureError as exc:
                self.log("failed", step=step, epoch=comm.epoch, error=str(exc)[:200])
                step = self._recover_until_ok(comm.reconfigure())
        self._finish()
        return 0

    def _recover_until_ok(self, change: Reconfiguration) -> int:
        while True:
            try:
                return self._recover(change)
            except PeerFailureError as exc:  # another failure during recovery: next epoch
                self.log("failed", step=-1, epoch=self.comm.epoch, error=str(exc)[:200])
                change = self.comm.reconfigure()

    def _step(self, step: int) -> int:
        cfg, comm, model, opt = self.config, self.comm, self.model, self.optimizer
        t0 = time.perf_counter()
        lr = lr_at(cfg, step)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = self.task.train_batch(step, comm.rank)
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        assert loss is not None
        loss.backward()
        loss_buf = loss.detach().reshape(1).clone()
        dist.all_reduce(loss_buf, op=dist.ReduceOp.AVG)
        self._settle()
        opt.step()
        if not comm.commit(step):
            raise PeerFailureError(f"step {step} was not committed everywhere")
        train_loss = float(loss_buf.item())
        if not math.isfinite(train_loss):
            raise RuntimeError(f"step {step}: training loss is {train_loss}")
        snap = self._snapshots_at(step)
        if snap:
            self._snapshot(step)
        self.losses[step] = train_loss
        if step == cfg.steps or (cfg.eval_interval and step % cfg.eval_interval == 0):
            self.evals[step] = _evaluate(model, self.optimizer, self.task, cfg, comm.rank)
        self.log(
            "committed", step=step, epoch=comm.epoch, loss=train_loss, step_s=time.perf_counter() - t0, snapshot=snap
        )
        return step + 1

    def _finish(self) -> None:
        comm = self.comm
        if self.replicator is not None:
            self.replicator.drain(10.0)
        if isinstance(self.optimizer, LocalAdamS):
            self.optimizer.average_params()  # the members end with one model (collective)
        result = {
            "rank": comm.rank,
            "world_size": comm.world_size,
            "epoch": comm.epoch,
            "losses": {str(k): v for k, v in sorted(self.losses.items())},
            "evals": {str(k): v for k, v in sorted(self.evals.items())},
            "params_digest": _params_digest(self.model),
            "recoveries": self.recoveries,
            "snapshot_ms_median": 1000 * sorted(self.snapshot_s)[len(self.snapshot_s) // 2] if self.snapshot_s else 0,
            "snapshot_bytes": (self.own.nbytes(), self.ward.nbytes()),
            "replicated_bytes": self.replicator.bytes_sent if self.replicator else 0,
            "replication_busy_s": self.replicator.busy_s if self.replicator else 0.0,
        }
        (self.out / f"result-{comm.rank}.json").write_text(json.dumps(result) + "\n")
        self._stop_replicator()
        if hasattr(self.optimizer, "close"):  # SCAPE: finish its mask gathers; ShardedAdamS has none
            self.optimizer.close()
        comm.close()


def worker_main(spec_path: str) -> int:
    """Entry point of one worker (``python -m optim.train_job.resilient SPEC``)."""
    spec = json.loads(Path(spec_path).read_text())
    train = spec["train"]
    train["betas"] = tuple(train["betas"])
    config = TrainConfig(**train)
    res = ResilienceConfig(**{**spec["resilience"], "kills": tuple(tuple(k) for k in spec["resilience"]["kills"])})
    logging.basicConfig(level=logging.WARNING)
    worker = _Worker(config, res, Path(spec["out"]))
    try:
        return worker.run()
    except (UnrecoverableStateError, CommError) as exc:
        worker.log("error", error=f"{type(exc).__name__}: {exc}")
        print(f"worker {os.getpid()}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3


# ---------------------------------------------------------------------------------------------- parent
def run_resilient_training(config: TrainConfig, res: ResilienceConfig, out: str | Path) -> dict[str, Any]:
    """Run the job with failures injected from outside; return what the workers and the coordinator saw.

    Returns:
        ``status`` (the job's exit status), ``losses`` (per step, from its
        last commit), ``evals`` (per step, from the final members), ``params_digest`` (every final member
        must agree), ``results`` (per final rank), ``events`` (coordinator and
        worker events, ``time`` in unix seconds), ``kills`` (slot, step, pid,
        time), ``wall_time_s``.
    """
    res.check_against(config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.jsonl")) + list(out.glob("result-*.json")):
        old.unlink()
    spec = {"train": dataclasses.asdict(config), "resilience": dataclasses.asdict(res), "out": str(out)}
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    repo = str(Path(__file__).resolve().parents[1])
    launcher = Launcher(
        [sys.executable, "-m", "optim.train_job.resilient", str(spec_path)],
        LaunchConfig(
            nproc=config.nproc,
            spares=res.spares,
            mode=res.recovery,
            min_world_size=1,
            heartbeat_timeout=timedelta(seconds=res.heartbeat_timeout_s),
            events=str(out / "coordinator.events"),
            job_timeout=timedelta(seconds=config.job_timeout_s),
            env={"PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH", "")]))},
        ),
    )
    t0 = time.time()
    status: list[int] = []
    launcher.start()
    waiter = threading.Thread(target=lambda: status.append(launcher.wait()), daemon=True)
    waiter.start()
    kills = _inject(launcher, res.kills, waiter)
    waiter.join()
    results = {}
    for path in out.glob("result-*.json"):
        r = json.loads(path.read_text())
        results[int(r["rank"])] = r
    events = [dict(e, source="coordinator") for e in launcher.coordinator.log.events]
    for path in out.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                events.append(dict(json.loads(line), source="worker"))
            except ValueError:
                continue
    events.sort(key=lambda e: e["time"])
    first = results.get(0, {})
    # A final rank that was promoted from a spare only knows the steps since its restore: take each
    # step's loss from its last commit (a recomputed step's commit supersedes the earlier one), and
    # each evaluation from the final ranks that ran it (slot 0 first).
    losses: dict[int, float] = {}
    for e in events:
        if e["source"] == "worker" and e["event"] == "committed":
            losses[int(e["step"])] = e["loss"]
    losses.update({int(k): v for k, v in first.get("losses", {}).items()})
    evals: dict[int, float] = {}
    for r in sorted(results.values(), key=lambda r: -int(r["rank"])):
        evals.update({int(k): v for k, v in r.get("evals", {}).items()})
    return {
        "status": status[0] if status else 1,
        "losses": dict(sorted(losses.items())) if results else {},
        "evals": dict(sorted(evals.items())),
        "params_digest": first.get("params_digest"),
        "digests_agree": len({r["params_digest"] for r in results.values()}) == 1 if results else False,
        "results": results,
        "events": events,
        "kills": kills,
        "wall_time_s": time.time() - t0,
    }


def _inject(launcher: Launcher, kills: tuple[tuple[int, int], ...], waiter: threading.Thread) -> list[dict[str, Any]]:
    """SIGKILL ``slot`` once step ``step - 1`` is committed (so ``step`` is running)."""
    done: list[dict[str, Any]] = []
    pending = sorted(kills, key=lambda k: k[1])
    if not pending:
        return done
    # wait until the first epoch is configured: a kill before that (step 1) would hit the workers
    # while they build their first transport, not while step 1 runs
    while waiter.is_alive() and not any(e["event"] == "epoch_configured" for e in launcher.coordinator.log.events):
        time.sleep(0.01)
    if not waiter.is_alive():
        return done
    host, port = parse_address(launcher.coordinator.address)
    store = open_store(host, port, server=False, timeout=timedelta(seconds=30))
    while pending and waiter.is_alive():
        try:
            committed = int(store.get(COMMITTED)) if store.check([COMMITTED]) else 0
        except RuntimeError:  # the job ended (its store went away) while kills were pending
            time.sleep(0.01)
            continue
        slot, step = pending[0]
        if committed >= step - 1:
            pid = launcher.pid_of_slot(slot)
            os.kill(pid, signal.SIGKILL)
            done.append({"slot": slot, "step": step, "pid": pid, "time": time.time()})
            logger.info("killed slot %d (pid %d) at step %d", slot, pid, step)
            pending.pop(0)
            # the next kill waits for the epoch that replaced this one
            while waiter.is_alive() and launcher.coordinator.view is not None and pid in _view_pids(launcher):
                time.sleep(0.01)
        time.sleep(0.002)
    return done


def _view_pids(launcher: Launcher) -> set[int]:
    view = launcher.coordinator.view
    members = launcher.coordinator.members()
    return set() if view is None else {members[m].pid for m in view.members}


if __name__ == "__main__":
    # A transport of a failed epoch may still have a native wait pending until its own
    # timeout; interpreter teardown would then abort the process. Everything is closed
    # and flushed by now, so leave without the teardown.
    code = worker_main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
