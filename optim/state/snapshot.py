"""In-memory snapshots of a rank's training state, double-buffered and replicated to a buddy.

A snapshot is a tree (dicts, lists, tensors, ints, floats, strings, bools,
``None``) encoded into one ``uint8`` tensor: an 8-byte header length, a JSON
header (the tree with tensors replaced by references, and each tensor's dtype,
shape and byte range), then the tensor bytes. Decoding validates every field
of the header against the buffer: no pickle of peer-supplied data.

:class:`Replicator` runs on a background thread: after each committed step the
trainer hands it the step's encoded snapshot; it sends it to the buddy (the
next slot) and receives the ward's (the previous slot) over a side channel,
then acknowledges. A version counts as *replicated* once the buddy's
acknowledgement arrived. Two versions are kept on each side (double buffer), so
a complete version always exists while the next one is in flight.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from bindings.base import Communicator
from bindings.errors import CommError
from bindings.json_object import JsonObject
from bindings.validate import check_int

__all__ = [
    "encode_tree",
    "decode_tree",
    "TensorLayout",
    "tensor_layout",
    "SnapshotRing",
    "Replicator",
    "UnrecoverableStateError",
]

logger = logging.getLogger(__name__)

_DTYPES = {
    str(d): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
_HEADER_LEN = 8
_MAX_HEADER = 1 << 24


class UnrecoverableStateError(RuntimeError):
    """The state of a lost slot exists nowhere (its buddy was lost too, or no copy was committed)."""


def encode_tree(tree: Any, out: torch.Tensor | None = None) -> torch.Tensor:
    """Encode ``tree`` into a ``uint8`` tensor (into ``out`` when it is large enough).

    Returns:
        The encoded bytes: ``out[:n]`` when ``out`` was given and large enough,
        else a new tensor.
    """
    tensors: list[torch.Tensor] = []

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            if str(node.dtype) not in _DTYPES:
                raise TypeError(f"snapshot: tensors of dtype {node.dtype} are not supported")
            tensors.append(node.detach().to("cpu").contiguous())
            return {"__tensor__": len(tensors) - 1}
        if isinstance(node, dict):
            if not all(isinstance(k, (str, int)) for k in node):
                raise TypeError("snapshot: dict keys must be str or int")
            return {"__dict__": [[k, walk(v)] for k, v in node.items()]}
        if isinstance(node, (list, tuple)):
            return {"__list__": [walk(v) for v in node]}
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise TypeError(f"snapshot: cannot store a {type(node).__name__}")

    shape_tree = walk(tree)
    metas: list[JsonObject] = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        metas.append({"dtype": str(t.dtype), "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
        offset += nbytes
    header = json.dumps({"tree": shape_tree, "tensors": metas}, separators=(",", ":")).encode()
    total = _HEADER_LEN + len(header) + offset
    buf = out[:total] if out is not None and out.numel() >= total else torch.empty(total, dtype=torch.uint8)
    buf[:_HEADER_LEN] = torch.frombuffer(bytearray(len(header).to_bytes(_HEADER_LEN, "little")), dtype=torch.uint8)
    buf[_HEADER_LEN : _HEADER_LEN + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    base = _HEADER_LEN + len(header)
    for t, meta in zip(tensors, metas, strict=True):
        lo, n = base + int(meta["offset"]), int(meta["nbytes"])
        if n:
            buf[lo : lo + n].copy_(t.reshape(-1).view(torch.uint8))
    return buf


@dataclass(frozen=True)
class TensorLayout:
    """Where the tensors of an :func:`encode_tree` encoding lie (see :func:`tensor_layout`).

    Attributes:
        start: Offset of the first tensor byte (after the length field and the header).
        tensors: ``(offset from start, nbytes, dtype)`` of each tensor, in encoding order.
        paths: ``"a/b/0"`` (dict keys and list positions from the root) -> tensor index.
    """

    start: int
    tensors: list[tuple[int, int, str]]
    paths: dict[str, int]


def tensor_layout(buf: bytes) -> TensorLayout:
    """Where the tensor bytes of an :func:`encode_tree` encoding lie, read from its header alone.

    Raises:
        ValueError: ``buf`` does not start with such a header.
    """
    if len(buf) < _HEADER_LEN:
        raise ValueError("snapshot: too short")
    hlen = int.from_bytes(buf[:_HEADER_LEN], "little")
    if not 0 < hlen <= min(_MAX_HEADER, len(buf) - _HEADER_LEN):
        raise ValueError(f"snapshot: bad header length {hlen}")
    paths: dict[str, int] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict) and "__tensor__" in node:
            paths[path] = int(node["__tensor__"])
        elif isinstance(node, dict) and "__dict__" in node:
            for k, v in node["__dict__"]:
                walk(v, f"{path}/{k}" if path else str(k))
        elif isinstance(node, dict) and "__list__" in node:
            for n, v in enumerate(node["__list__"]):
                walk(v, f"{path}/{n}" if path else str(n))

    try:
        header = json.loads(buf[_HEADER_LEN : _HEADER_LEN + hlen])
        tensors = [(int(m["offset"]), int(m["nbytes"]), str(m["dtype"])) for m in header["tensors"]]
        walk(header["tree"], "")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"snapshot: bad header ({exc})") from exc
    return TensorLayout(start=_HEADER_LEN + hlen, tensors=tensors, paths=paths)


def decode_tree(buf: torch.Tensor) -> Any:
    """Decode a tensor made by :func:`encode_tree` (extra bytes after the content are ignored).

    Raises:
        ValueError: The bytes are not a valid snapshot.
    """
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError("snapshot: expected a 1-D uint8 tensor")
    if buf.numel() < _HEADER_LEN:
        raise ValueError("snapshot: too short")
    raw = buf.numpy() if buf.device.type == "cpu" else buf.cpu().numpy()
    hlen = int.from_bytes(raw[:_HEADER_LEN].tobytes(), "little")
    if not 0 < hlen <= min(_MAX_HEADER, buf.numel() - _HEADER_LEN):
        raise ValueError(f"snapshot: bad header length {hlen}")
    try:
        header = json.loads(raw[_HEADER_LEN : _HEADER_LEN + hlen].tobytes())
    except ValueError as exc:
        raise ValueError(f"snapshot: header is not JSON ({exc})") from exc
    if not isinstance(header, dict) or not isinstance(header.get("tensors"), list) or "tree" not in header:
        raise ValueError("snapshot: malformed header")
    base = _HEADER_LEN + hlen
    tensors = []
    for meta in header["tensors"]:
        tensors.append(_tensor_from(meta, raw, base))

    def build(node: Any) -> Any:
        if isinstance(node, dict):
            if set(node) == {"__tensor__"}:
                return tensors[check_int("snapshot tensor reference", node["__tensor__"], low=0, high=len(tensors) - 1)]
            if set(node) == {"__dict__"} and isinstance(node["__dict__"], list):
                out = {}
                for item in node["__dict__"]:
                    if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))):
                        raise ValueError("snapshot: bad dict entry")
                    out[item[0]] = build(item[1])
                return out
            if set(node) == {"__list__"} and isinstance(node["__list__"], list):
                return [build(v) for v in node["__list__"]]
            raise ValueError("snapshot: unknown node")
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise ValueError("snapshot: unknown node type")

    return build(header["tree"])


def _tensor_from(meta: Any, raw: np.ndarray, base: int) -> torch.Tensor:
    if not isinstance(meta, dict) or not isinstance(meta.get("dtype"), str) or meta["dtype"] not in _DTYPES:
        raise ValueError("snapshot: bad tensor dtype")
    shape = meta.get("shape")
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise ValueError("snapshot: bad tensor shape")
    offset, nbytes = _nat(meta.get("offset")), _nat(meta.get("nbytes"))
    dtype = _DTYPES[meta["dtype"]]
    numel = math.prod(shape)  # Python ints: no overflow on absurd shapes
    if numel * torch.empty(0, dtype=dtype).element_size() != nbytes or base + offset + nbytes > raw.size:
        raise ValueError("snapshot: tensor bytes do not match its shape or the buffer")
    data = torch.from_numpy(raw[base + offset : base + offset + nbytes].copy())
    return data.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)


def _nat(v: Any) -> int:
    return check_int("snapshot tensor range", v, low=0)


class SnapshotRing:
    """Keeps the last two encoded versions of one slot's state (a double buffer).

    Three buffers are allocated once (and grown only if a snapshot outgrows
    them) and reused: two hold the newest versions, the third takes the next
    one, so a held version is never overwritten while the next is written.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._versions: dict[int, tuple[int, int]] = {}  # version -> (buffer index, length)
        self._buffers: list[torch.Tensor] = []

    def _free_buffer(self, nbytes: int) -> int:
        used = {i for i, _ in self._versions.values()}
        for i, b in enumerate(self._buffers):
            if i not in used:
                if b.numel() < nbytes:
                    self._buffers[i] = torch.empty(nbytes, dtype=torch.uint8)
                return i
        self._buffers.append(torch.empty(nbytes, dtype=torch.uint8))
        return len(self._buffers) - 1

    def put(self, version: int, tree: Any) -> torch.Tensor:
        """Encode ``tree`` as ``version`` (keeping only the newest other version); return the bytes."""
        with self._lock:
            i = self._free_buffer(0)
            buf = encode_tree(tree, self._buffers[i])
            if buf.data_ptr() != self._buffers[i].data_ptr():  # outgrew the buffer: keep the new one
                self._buffers[i] = buf
            self._commit(version, i, buf.numel())
            return buf

    def put_bytes(self, version: int, data: torch.Tensor) -> None:
        """Store a copy of already-encoded bytes as ``version``."""
        with self._lock:
            i = self._free_buffer(data.numel())
            self._buffers[i][: data.numel()].copy_(data)
            self._commit(version, i, data.numel())

    def _commit(self, version: int, index: int, length: int) -> None:
        self._versions[version] = (index, length)
        for old in sorted(self._versions)[:-2]:
            del self._versions[old]

    def get(self, version: int) -> torch.Tensor | None:
        """The bytes of ``version`` (a view, valid until two newer versions arrive), or ``None``."""
        with self._lock:
            entry = self._versions.get(version)
            return None if entry is None else self._buffers[entry[0]][: entry[1]]

    def versions(self) -> list[int]:
        """The versions held, oldest first."""
        with self._lock:
            return sorted(self._versions)

    def clear(self) -> None:
        """Forget every version (the buffers stay allocated)."""
        with self._lock:
            self._versions.clear()

    def nbytes(self) -> int:
        """Bytes of host memory this ring holds."""
        with self._lock:
            return sum(b.numel() for b in self._buffers)


@dataclass
class _Job:
    version: int
    data: torch.Tensor | None = None  # encoded bytes, or
    tree: Any = None  # a tree to encode into ``ring`` first (off the caller's critical path)
    ring: SnapshotRing | None = None
    persist: Callable[[torch.Tensor], None] | None = None  # also write the bytes to disk, once replicated


class Replicator:
    """Sends each snapshot to the buddy and receives the ward's, on a background thread.

    Collective in lockstep: every member of the epoch submits the same versions
    in the same order. One instance per epoch; :meth:`stop` before the epoch's
    transport goes away.

    Args:
        channel: The epoch's side channel (a communicator only this thread uses).
        capacity: Bytes of the fixed-size wire buffer (the largest snapshot of any rank).
        ward_ring: Where the ward's versions go.
        timeout: Deadline of each transfer.
    """

    def __init__(self, channel: Communicator, capacity: int, ward_ring: SnapshotRing, timeout: timedelta) -> None:
        if capacity < _HEADER_LEN:
            raise ValueError(f"capacity: must be >= {_HEADER_LEN}, got {capacity}")
        self._ch = channel
        self.capacity = capacity
        self._ward = ward_ring
        self._timeout = timeout
        n, r = channel.world_size, channel.rank
        self.buddy, self.ward = (r + 1) % n, (r - 1) % n
        self._send = torch.zeros(capacity, dtype=torch.uint8)
        self._recv = torch.zeros(capacity, dtype=torch.uint8)
        self._ack_out = torch.zeros(1, dtype=torch.int64)
        self._ack_in = torch.zeros(1, dtype=torch.int64)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._encoded = threading.Event()
        self._encoded.set()
        self._lock = threading.Lock()
        self._replicated = -1
        self._failed: str | None = None
        self.bytes_sent = 0
        self.busy_s = 0.0
        self.persist_error: str | None = None
        """Why the last persistent checkpoint write failed (``None``: none failed)."""
        self._thread = threading.Thread(target=self._run, name="sparsecomm-replicator", daemon=True)
        self._thread.start()

    @property
    def replicated(self) -> int:
        """Newest version the buddy acknowledged (-1: none)."""
        with self._lock:
            return self._replicated

    @property
    def failed(self) -> str | None:
        """Why replication stopped (a transfer failed), or ``None``."""
        return self._failed

    def submit(self, version: int, data: torch.Tensor) -> None:
        """Queue ``data`` (encoded, at most ``capacity`` bytes) as ``version``."""
        if data.numel() > self.capacity:
            raise ValueError(f"snapshot of {data.numel()} bytes exceeds the replication capacity {self.capacity}")
        self._jobs.put(_Job(version, data))

    def submit_tree(
        self, version: int, tree: Any, ring: SnapshotRing, persist: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        """Queue ``tree``: the thread encodes it into ``ring`` as ``version``, then replicates it.

        The tree's tensors are read by the thread: the caller must not change
        them before :meth:`wait_encoded` returns. With ``persist``, the thread
        then hands it the encoded bytes (a persistent checkpoint); an error
        there is kept in :attr:`persist_error`, never raised.
        """
        self._encoded.clear()
        self._jobs.put(_Job(version, tree=tree, ring=ring, persist=persist))

    def wait_encoded(self, timeout: float) -> bool:
        """Wait until the last tree passed to :meth:`submit_tree` has been copied out."""
        return self._encoded.wait(timeout)

    def drain(self, timeout: float) -> bool:
        """Wait until every submitted version was replicated (or replication failed)."""
        import time

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self._jobs.unfinished_tasks == 0 or self._failed is not None:
                return self._failed is None
            time.sleep(0.001)
        return False

    def stop(self) -> None:
        """Stop after the transfers in progress (they end at once if the transport was aborted)."""
        self._jobs.put(None)
        self._thread.join(timeout=self._timeout.total_seconds() + 5)

    def _run(self) -> None:
        import time

        ch = self._ch
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                t0 = time.perf_counter()
                if job.tree is not None:
                    assert job.ring is not None
                    try:
                        job.data = job.ring.put(job.version, job.tree)
                    finally:
                        job.tree = None
                        self._encoded.set()
                if self._failed is not None:
                    continue
                assert job.data is not None
                n = job.data.numel()
                if n > self.capacity:
                    self._failed = f"version {job.version}: {n} bytes exceed the capacity {self.capacity}"
                    continue
                self._send[:n].copy_(job.data)
                recv = self._recv
                try:
                    if ch.world_size > 1:
                        rw = ch.recv(recv, self.ward, tag=1, async_op=True)
                        sw = ch.send(self._send, self.buddy, tag=1, async_op=True)
                        assert rw is not None and sw is not None and not isinstance(rw, int)
                        rw.wait(self._timeout)
                        sw.wait(self._timeout)
                        # held before it is acknowledged: the ward's put() waits for this ack before its next
                        # version, and a failure from here on must not lose what the ward was told is safe
                        self._ward.put_bytes(job.version, recv)
                        self._ack_out[0] = job.version
                        aw = ch.recv(self._ack_in, self.buddy, tag=2, async_op=True)
                        ch.send(self._ack_out, self.ward, tag=2)
                        assert aw is not None and not isinstance(aw, int)
                        aw.wait(self._timeout)
                        self.bytes_sent += self.capacity
                        acked = int(self._ack_in[0])
                    else:
                        acked = job.version
                except CommError as exc:
                    self._failed = f"version {job.version}: {exc}"
                    logger.info("replication stopped: %s", self._failed)
                    continue
                with self._lock:
                    self._replicated = max(self._replicated, acked)
                if job.persist is not None:
                    try:
                        job.persist(self._send[:n])
                    except Exception as exc:  # noqa: BLE001 - reported to the trainer, which raises everywhere
                        self.persist_error = f"version {job.version}: {exc}"
                        logger.warning("checkpoint write failed: %s", self.persist_error)
                self.busy_s += time.perf_counter() - t0
            finally:
                self._jobs.task_done()
