"""Persistent checkpoints beneath the in-memory snapshots: one file per slot and step, written atomically.

Layout of a checkpoint directory::

    DIR/step-000000120/slot-00000.ckpt
    DIR/step-000000120/slot-00001.ckpt
    ...

A slot file is an 8-byte magic (``SPCKPT1\\n``), an 8-byte little-endian header
length, a JSON header (``format``, ``step``, ``slot``, ``world_size``,
``fingerprint`` of the model and optimizer, ``nbytes`` and ``sha256`` of the
payload) and the payload: the slot's snapshot exactly as the in-memory ring
holds it (:func:`optim.state.snapshot.encode_tree`), so nothing is encoded twice.
A *delta* file (header ``kind: "delta"``, ``base``: the step of the slot's
previous checkpoint) holds only what changed since that checkpoint
(:mod:`optim.state.delta`); its header also carries the size and ``sha256`` of
the full payload it restores to, checked after the chain of deltas back to
the last full file is applied. A slot writes a full file at least every
``full_every`` checkpoints (and whenever a delta would not be at most half
the size of the full payload, or it has no previous checkpoint of the same
layout to build on), so restoring reads at most ``full_every`` files.
With ``lossy``, a full file stores the first moment in bfloat16
(:mod:`optim.state.lossy`, header ``kind: "lossy"``); the deltas after it stay
the lossless ones between the exact snapshots, and every file's
``full_sha256`` is that of what a restore rebuilds (the writer applies each
delta to its own copy of the lossy state to know it), so a restore is
checked as strictly as a lossless one, and differs from the training state
only by the rounding of first-moment values the optimizer has not changed
since the lossy file.
Every file is written to a temporary name, flushed, ``fsync``-ed and renamed
into place (then its directory is ``fsync``-ed): a crash mid-write leaves no
file under the final name. A step is *complete* when every slot of its world
size has its file; only complete steps are loaded, and retention keeps the
newest ``keep`` complete steps and the older files their deltas are built
on (files of newer, still incomplete steps are never removed).

The layout is ours, not ``torch.distributed.checkpoint``'s (DCP): a slot's
snapshot is the sharded optimizer's flat shard plus masks in flight, RNG and
the loop's history, which DCP's planners have no notion of. For users who want
the weights, :func:`export_state_dict` writes a plain ``model.state_dict()``
file that ``torch.load`` reads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import sparsecomm.distributed as dist
from bindings.validate import check_bool, check_int
from optim.state import lossy
from optim.state.delta import apply_delta, encode_delta
from optim.state.run_stats import SlotFileInfo, WrittenFile
from optim.state.snapshot import decode_tree, tensor_layout

__all__ = ["CheckpointError", "CheckpointStore", "export_state_dict", "model_fingerprint", "read_newest"]

logger = logging.getLogger(__name__)

MAGIC = b"SPCKPT1\n"
FORMAT = 1
_STEP = re.compile(r"^step-(\d{9})$")
_SLOT = re.compile(r"^slot-(\d{5})\.ckpt$")


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be used: missing, truncated, corrupted, foreign or not writable."""


def model_fingerprint(model: torch.nn.Module, optimizer: Any) -> str:
    """A digest of the parameter names, shapes and dtypes and of the optimizer's class: a checkpoint's identity."""
    h = hashlib.sha256(type(optimizer).__qualname__.encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class _Header:
    step: int
    slot: int
    world_size: int
    fingerprint: str
    nbytes: int
    sha256: str
    kind: str  # full, lossy or delta
    base: int | None  # a delta's base step (None: a full or lossy file)
    full_nbytes: int
    full_sha256: str


class CheckpointStore:
    """The checkpoint directory of a job.

    Args:
        path: The directory (made if missing when writing).
        keep: Complete steps to keep (>= 1).
        full_every: A slot writes a full file at least every this many checkpoints,
            deltas between (1: every file full).
        lossy: Store the first moment (the paths a write names) of full files in
            bfloat16 (:mod:`optim.state.lossy`): resumes are then close, not bit-identical.

    Raises:
        CheckpointError: ``keep`` or ``full_every`` < 1.
    """

    def __init__(
        self, path: str | os.PathLike[str], keep: int = 2, full_every: int = 8, *, lossy: bool = False
    ) -> None:
        try:
            check_int("keep", keep, low=1)
            check_int("full_every", full_every, low=1)
            check_bool("lossy", lossy)
        except ValueError as e:  # the documented error of a bad store setting
            raise CheckpointError(str(e)) from None
        self.path = Path(path)
        self.keep = keep
        self.full_every = full_every
        self.lossy = lossy
        # per slot, of its last write: step, world size, fingerprint, payload, deltas since the last full
        # file, and what a restore of it rebuilds (None: the payload itself)
        self._last: dict[int, tuple[int, int, str, bytes, int, bytes | None]] = {}
        self.written: list[WrittenFile] = []  # every file written here, in order
        self.error: str | None = None
        """Why the last background write failed (``None``: none failed)."""
        self._queue: queue.Queue[tuple[Any, ...] | None] | None = None
        self._thread: threading.Thread | None = None

    def forget(self) -> None:
        """Build the next checkpoint of every slot on nothing: it is written full (after a recovery)."""
        self.drain()
        self._last.clear()

    # ------------------------------------------------------------------ background writes
    def persister(
        self,
        step: int,
        slot: int,
        world_size: int,
        fingerprint: str,
        decay: Mapping[str, float] | None = None,
        first_moment: Collection[str] = (),
    ) -> Callable[[torch.Tensor], None]:
        """What hands the snapshot of ``step`` (encoded bytes) to the background writer (:meth:`submit`)."""

        def persist(data: torch.Tensor) -> None:
            payload = data.detach().reshape(-1).numpy().tobytes()
            self.submit(step, slot, world_size, fingerprint, payload, decay, first_moment)

        return persist

    def submit(
        self,
        step: int,
        slot: int,
        world_size: int,
        fingerprint: str,
        payload: bytes,
        decay: Mapping[str, float] | None = None,
        first_moment: Collection[str] = (),
    ) -> None:
        """Queue a :meth:`write` for the writer thread; a failure lands in :attr:`error`, never raised here.

        The thread runs at the lowest CPU priority (``nice`` 19, Linux), so on a
        machine whose cores the training fills it takes the time the ranks
        leave (waits on communication); two queued writes make the next
        submission wait.
        """
        if self._thread is None:
            self._queue = queue.Queue(maxsize=2)
            self._thread = threading.Thread(target=self._run, name="sparsecomm-checkpoint-writer", daemon=True)
            self._thread.start()
        assert self._queue is not None
        self._queue.put((step, slot, world_size, fingerprint, payload, decay, first_moment))

    def drain(self, timeout: float = 600.0) -> bool:
        """Wait until every submitted write finished (written or failed); ``False`` at the deadline."""
        end = time.monotonic() + timeout
        while self._queue is not None and self._queue.unfinished_tasks:
            if time.monotonic() > end:
                return False
            time.sleep(0.002)
        return True

    def close(self) -> None:
        """Finish the queued writes and stop the writer thread (idempotent)."""
        if self._thread is not None and self._queue is not None:
            self._queue.put(None)
            self._thread.join(timeout=120)
        self._thread = self._queue = None

    def _run(self) -> None:
        try:  # on Linux a thread has its own nice value
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        q = self._queue
        assert q is not None
        while True:
            item = q.get()
            try:
                if item is None:
                    return
                self.write(*item)
            except Exception as exc:  # noqa: BLE001 - kept for the trainer, which ends the run on every rank
                self.error = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
                logger.warning("checkpoint write failed: %s", self.error)
            finally:
                q.task_done()

    # ------------------------------------------------------------------ names
    def step_dir(self, step: int) -> Path:
        return self.path / f"step-{step:09d}"

    def slot_file(self, step: int, slot: int) -> Path:
        return self.step_dir(step) / f"slot-{slot:05d}.ckpt"

    # ------------------------------------------------------------------ writing
    def check_writable(self) -> None:
        """Make the directory and write, sync and remove a probe file there.

        Raises:
            CheckpointError: The directory cannot be made or written.
        """
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".probe-{os.getpid()}"
            with open(probe, "wb") as f:
                f.write(b"probe")
                f.flush()
                os.fsync(f.fileno())
            probe.unlink()
        except OSError as exc:
            raise CheckpointError(f"checkpoint directory {self.path} is not writable: {exc}") from exc

    def write(
        self,
        step: int,
        slot: int,
        world_size: int,
        fingerprint: str,
        payload: torch.Tensor | bytes,
        decay: Mapping[str, float] | None = None,
        first_moment: Collection[str] = (),
    ) -> Path:
        """Write one slot's snapshot of ``step`` atomically, then drop what retention no longer keeps.

        ``decay``: paths in the snapshot tree (``"optim/shard/exp_avg"``) of
        float32 tensors that the optimizer multiplies by a factor in every step
        wherever it does nothing else; a delta predicts them so
        (:mod:`optim.state.delta`), which only changes its size. ``first_moment``:
        the paths a ``lossy`` store keeps in bfloat16 in full files.

        Raises:
            CheckpointError: The file could not be written (the final name then does not exist).
        """
        t0 = time.perf_counter()
        full = payload if isinstance(payload, bytes) else payload.detach().reshape(-1).to(torch.uint8).numpy().tobytes()
        prev = self._last.pop(slot, None)
        data, base, chain, kind, rebuilt = full, None, 0, "full", None
        if (
            prev is not None
            and prev[1:3] == (world_size, fingerprint)
            and prev[0] < step
            and prev[4] + 1 < self.full_every
        ):
            try:
                paths = tensor_layout(full).paths
                predict = {paths[k]: (f, step - prev[0]) for k, f in (decay or {}).items() if k in paths}
                delta = encode_delta(prev[3], full, decay=predict)
            except ValueError:  # not a snapshot encoding: nothing to line up, a full file
                delta = None
            if delta is not None:
                data, base, chain, kind = delta, prev[0], prev[4] + 1, "delta"
                rebuilt = None if prev[5] is None else apply_delta(prev[5], delta)  # on the lossy base
        if base is None and self.lossy and first_moment:
            try:
                packed = lossy.pack(full, first_moment)
            except ValueError:  # not a snapshot encoding: written as it is
                packed = None
            if packed is not None:
                data, kind, rebuilt = packed, "lossy", lossy.unpack(packed)
        restores = full if rebuilt is None else rebuilt
        header = json.dumps(
            {
                "format": FORMAT,
                "step": step,
                "slot": slot,
                "world_size": world_size,
                "fingerprint": fingerprint,
                "nbytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "kind": kind,
                "base": base,
                "full_nbytes": len(restores),
                "full_sha256": hashlib.sha256(restores).hexdigest() if kind != "full" else None,
            }
        ).encode()
        final = self.slot_file(step, slot)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(MAGIC)
                f.write(len(header).to_bytes(8, "little"))
                f.write(header)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"checkpoint of step {step}, slot {slot}: cannot write {final}: {exc}") from exc
        self._last[slot] = (step, world_size, fingerprint, full, chain, rebuilt)
        seconds = time.perf_counter() - t0
        self.written.append(WrittenFile(step=step, slot=slot, kind=kind, nbytes=len(data), seconds=seconds))
        self.prune(slot, world_size)
        return final

    def prune(self, slot: int, world_size: int) -> None:
        """Remove every step older than the newest ``keep`` complete ones (any slot may; it is never needed again).

        Steps newer than the oldest kept one stay, complete or not (their
        other slots may still be writing).
        """
        complete = self.complete_steps(world_size)
        if len(complete) <= self.keep:
            return
        floor = complete[-self.keep]
        for step in complete[-self.keep :]:  # the files the kept deltas are built on stay too
            for s in range(world_size):
                floor = min(floor, self.chain(step, s)[-1])
        for step in self.steps():
            if step < floor:
                shutil.rmtree(self.step_dir(step), ignore_errors=True)

    # ------------------------------------------------------------------ reading
    def steps(self) -> list[int]:
        """Steps with a directory, oldest first."""
        if not self.path.is_dir():
            return []
        out = []
        for d in self.path.iterdir():
            m = _STEP.match(d.name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def complete_steps(self, world_size: int) -> list[int]:
        """Steps that have a file for every slot of ``world_size``, oldest first (contents not checked)."""
        out = []
        for step in self.steps():
            try:
                names = {p.name for p in self.step_dir(step).iterdir()}
            except FileNotFoundError:  # another slot's retention just removed it
                continue
            if all(f"slot-{s:05d}.ckpt" in names for s in range(world_size)):
                out.append(step)
        return out

    def newest_complete(self) -> tuple[int, int] | None:
        """``(step, world size)`` of the newest step that has a file for every slot of the world that wrote it."""
        for step in reversed(self.steps()):
            try:
                ws = self.world_size_of(step)
            except CheckpointError:
                continue  # slot 0's file missing or unreadable: not this step
            if step in self.complete_steps(ws):
                return step, ws
        return None

    def world_size_of(self, step: int) -> int:
        """The world size the files of ``step`` were written by (from the first slot's header)."""
        return self._header(self.slot_file(step, 0))[0].world_size

    def read(self, step: int, slot: int, world_size: int, fingerprint: str) -> torch.Tensor:
        """The payload of one slot file, after checking every header field and the payload's digest.

        Raises:
            CheckpointError: The file is missing, truncated, corrupted, or of another step, slot,
                world size, model or optimizer.
        """
        return torch.frombuffer(bytearray(self._read_full(step, slot, world_size, fingerprint, 0)), dtype=torch.uint8)

    def _read_full(self, step: int, slot: int, world_size: int, fingerprint: str, depth: int) -> bytes:
        path = self.slot_file(step, slot)
        header, offset = self._header(path)
        want: dict[str, object] = {"step": step, "slot": slot, "world_size": world_size, "fingerprint": fingerprint}
        got: dict[str, object] = {
            "step": header.step,
            "slot": header.slot,
            "world_size": header.world_size,
            "fingerprint": header.fingerprint,
        }
        for key, value in want.items():
            if got[key] != value:
                what = "another model or optimizer" if key == "fingerprint" else f"{key} {got[key]}, not {value}"
                raise CheckpointError(f"{path}: written for {what}")
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
        if len(data) != header.nbytes:
            raise CheckpointError(f"{path}: truncated ({len(data)} of {header.nbytes} payload bytes)")
        if hashlib.sha256(data).hexdigest() != header.sha256:
            raise CheckpointError(f"{path}: corrupted (the payload's sha256 does not match its header)")
        if header.kind == "lossy":
            try:
                full = lossy.unpack(data)
            except ValueError as exc:
                raise CheckpointError(f"{path}: {exc}") from exc
            if len(full) != header.full_nbytes or hashlib.sha256(full).hexdigest() != header.full_sha256:
                raise CheckpointError(f"{path}: its first moment, widened again, does not match its sha256")
            return full
        if header.base is None:
            return data
        if not 0 <= header.base < step or depth >= self.full_every + 64:
            raise CheckpointError(f"{path}: corrupted (a delta on step {header.base})")
        base = self._read_full(header.base, slot, world_size, fingerprint, depth + 1)
        try:
            full = apply_delta(base, data)
        except ValueError as exc:
            raise CheckpointError(f"{path}: the delta does not fit its base of step {header.base}: {exc}") from exc
        if len(full) != header.full_nbytes or hashlib.sha256(full).hexdigest() != header.full_sha256:
            raise CheckpointError(f"{path}: rebuilt from step {header.base}, it does not match its sha256")
        return full

    def file_info(self, step: int, slot: int) -> SlotFileInfo:
        """The header of one slot file and its size on disk.

        Raises:
            CheckpointError: The file is missing or its header is unreadable.
        """
        path = self.slot_file(step, slot)
        h, _ = self._header(path)
        return SlotFileInfo(
            step=h.step,
            slot=h.slot,
            world_size=h.world_size,
            fingerprint=h.fingerprint,
            kind=h.kind,
            base=h.base,
            disk_bytes=path.stat().st_size,
            full_bytes=h.full_nbytes,
        )

    def chain(self, step: int, slot: int) -> list[int]:
        """The steps whose files restoring ``(step, slot)`` reads, newest first, down to its full file."""
        out = [step]
        while len(out) <= self.full_every + 1:
            try:
                base = self._header(self.slot_file(out[-1], slot))[0].base
            except CheckpointError:
                break
            if base is None or base >= out[-1]:
                break
            out.append(base)
        return out

    def _header(self, path: Path) -> tuple[_Header, int]:
        try:
            with open(path, "rb") as f:
                magic = f.read(len(MAGIC))
                if magic != MAGIC:
                    raise CheckpointError(f"{path}: not a sparsecomm checkpoint (bad magic)")
                n = int.from_bytes(f.read(8), "little")
                if not 0 < n <= 1 << 20:
                    raise CheckpointError(f"{path}: corrupted header length {n}")
                raw = f.read(n)
        except FileNotFoundError as exc:
            raise CheckpointError(f"{path}: missing") from exc
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read: {exc}") from exc
        try:
            h = json.loads(raw)
            if h.get("format") != FORMAT:
                raise CheckpointError(f"{path}: format {h.get('format')!r}, expected {FORMAT}")
            base = None if h.get("base") is None else int(h["base"])
            kind = str(h.get("kind", "full" if base is None else "delta"))
            if kind not in ("full", "lossy", "delta") or (kind == "delta") != (base is not None):
                raise CheckpointError(f"{path}: corrupted header (kind {kind!r}, base {base!r})")
            header = _Header(
                step=int(h["step"]),
                slot=int(h["slot"]),
                world_size=int(h["world_size"]),
                fingerprint=str(h["fingerprint"]),
                nbytes=int(h["nbytes"]),
                sha256=str(h["sha256"]),
                kind=kind,
                base=base,
                full_nbytes=int(h.get("full_nbytes", h["nbytes"])),
                full_sha256=str(h.get("full_sha256") or h["sha256"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{path}: corrupted header ({exc})") from exc
        return header, len(MAGIC) + 8 + n

    def remove(self) -> None:
        """Delete the whole directory (tests and tools)."""
        shutil.rmtree(self.path, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def export_state_dict(model: torch.nn.Module, path: str | os.PathLike[str]) -> Path:
    """Write ``model.state_dict()`` as a plain ``torch.save`` file (atomically), for users who want the weights."""
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, tmp)
    os.replace(tmp, final)
    return final


def read_newest(
    store: CheckpointStore, rank: int, world_size: int, fingerprint: str, *, shares: bool
) -> tuple[int, int, dict[int, Any]]:
    """Agree on the newest complete checkpoint and read this member's slot files of it. Collective.

    A member reads old slot ``rank % old world``; when the world size changed
    and ``shares`` (a sharded optimizer, re-sharded from every old slot), also
    the old slots ``s`` with ``s % world_size == rank``, so that each old slot
    is read by exactly one member.

    Returns:
        ``(step, old world size, {old slot: decoded snapshot tree})``.

    Raises:
        CheckpointError: On every member: no complete checkpoint, members that see different
            ones, or a slot file that cannot be loaded (missing, truncated, corrupted, foreign).
    """
    store.drain()  # this member's own writes in flight first
    found = store.newest_complete()
    mine = torch.tensor([found[0] if found else -1, found[1] if found else -1], dtype=torch.int64)
    seen = torch.empty(2 * world_size, dtype=torch.int64)
    dist.all_gather_into_tensor(seen, mine)
    steps, worlds = seen[0::2], seen[1::2]
    newest, old_ws = int(steps.max()), int(worlds.max())
    if newest < 0:
        raise CheckpointError(f"no checkpoint in {store.path} has a file for each of its slots")
    if int(steps.min()) != newest or int(worlds.min()) != old_ws:
        raise CheckpointError(f"the members see different newest checkpoints in {store.path}: {seen.tolist()}")
    slots = {rank % old_ws}
    if shares and old_ws != world_size:
        slots |= {s for s in range(old_ws) if s % world_size == rank}
    error = None
    trees: dict[int, Any] = {}
    try:
        for slot in sorted(slots):
            tree = decode_tree(store.read(newest, slot, old_ws, fingerprint))
            if not isinstance(tree, dict) or tree.get("step") != newest:
                raise CheckpointError(f"slot {slot}'s file of step {newest} holds another step")
            trees[slot] = tree
    except (CheckpointError, ValueError) as exc:
        error = str(exc)
    verdict = torch.empty(world_size, dtype=torch.int64)
    dist.all_gather_into_tensor(verdict, torch.tensor([0 if error is None else 1], dtype=torch.int64))
    bad = [r for r in range(world_size) if int(verdict[r])]
    if bad:
        raise CheckpointError(
            f"the checkpoint of step {newest} in {store.path} cannot be loaded on ranks {bad}"
            + (f": {error}" if error is not None else "")
        )
    return newest, old_ws, trees
