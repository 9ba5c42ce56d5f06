"""What the state machinery reports about a run: snapshot times and sizes, replication totals, files written.

Each record is frozen and typed; ``to_json`` gives the object the job's ``result-RANK.json`` stores, with the key
names the committed result files use.
"""

from __future__ import annotations

from dataclasses import dataclass

from bindings.json_object import JsonObject

__all__ = ["SlotFileInfo", "SnapshotStats", "StateStats", "WrittenFile"]


@dataclass(frozen=True, kw_only=True)
class WrittenFile:
    """One slot file a :class:`~optim.state.checkpoint.CheckpointStore` wrote.

    Attributes:
        step: The training step the file holds.
        slot: The slot (rank) it belongs to.
        kind: ``full``, ``lossy`` or ``delta``.
        nbytes: Its payload size.
        seconds: How long encoding and writing it took.
    """

    step: int
    slot: int
    kind: str
    nbytes: int
    seconds: float

    def to_json(self) -> JsonObject:
        """The JSON object of the record (``nbytes`` under ``bytes``)."""
        return {"step": self.step, "slot": self.slot, "kind": self.kind, "bytes": self.nbytes, "seconds": self.seconds}


@dataclass(frozen=True, kw_only=True)
class SlotFileInfo:
    """The header of one slot file on disk (:meth:`~optim.state.checkpoint.CheckpointStore.file_info`).

    Attributes:
        step: The training step the file holds.
        slot: The slot it belongs to.
        world_size: The world size of the run that wrote it.
        fingerprint: The model and optimizer it fits.
        kind: ``full``, ``lossy`` or ``delta``.
        base: A delta's base step (``None``: a full or lossy file).
        disk_bytes: The file's size on disk.
        full_bytes: The size of the full payload a restore of it rebuilds.
    """

    step: int
    slot: int
    world_size: int
    fingerprint: str
    kind: str
    base: int | None
    disk_bytes: int
    full_bytes: int

    def to_json(self) -> JsonObject:
        """The JSON object of the record (``disk_bytes`` under ``bytes``)."""
        return {
            "step": self.step,
            "slot": self.slot,
            "world_size": self.world_size,
            "fingerprint": self.fingerprint,
            "kind": self.kind,
            "base": self.base,
            "bytes": self.disk_bytes,
            "full_bytes": self.full_bytes,
        }


@dataclass(frozen=True, kw_only=True)
class SnapshotStats:
    """One member's in-memory snapshots over a run.

    Attributes:
        snapshot_ms_median: Median time a snapshot held the step (the critical path), in milliseconds.
        own_bytes: Bytes of the member's own ring.
        ward_bytes: Bytes of the ring of its ward's copies.
        replicated_bytes: Bytes sent to the buddy.
        replication_busy_s: Seconds the replicator was busy (encode, copies, exchange, ack).
    """

    snapshot_ms_median: float
    own_bytes: int
    ward_bytes: int
    replicated_bytes: int
    replication_busy_s: float

    def to_json(self) -> JsonObject:
        """The JSON object of the record (the rings' sizes as ``snapshot_bytes: [own, ward]``)."""
        return {
            "snapshot_ms_median": self.snapshot_ms_median,
            "snapshot_bytes": [self.own_bytes, self.ward_bytes],
            "replicated_bytes": self.replicated_bytes,
            "replication_busy_s": self.replication_busy_s,
        }


@dataclass(frozen=True, kw_only=True)
class StateStats:
    """What a finished resilient run's state machinery did on one member.

    Attributes:
        snapshots: The in-memory snapshots.
        checkpoints: Every persistent file this member wrote, in order (empty without a store).
    """

    snapshots: SnapshotStats
    checkpoints: tuple[WrittenFile, ...] = ()

    def to_json(self) -> JsonObject:
        """The JSON object: the snapshot fields and ``checkpoints``, a list of written files."""
        return {**self.snapshots.to_json(), "checkpoints": [w.to_json() for w in self.checkpoints]}
