"""Membership views and the records the control plane keeps in its store.

Everything a process reads from the store is JSON of a known shape and is
validated here: no pickle of peer-supplied data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from bindings.json_object import JsonObject
from bindings.validate import check_int

__all__ = ["View", "MemberInfo", "SlotOrder", "decode_json", "MODES", "ROLES"]

#: Reconfiguration modes: ``hotswap`` fills a dead slot with a spare (falling
#: back to shrink when no spare is left); ``shrink`` always drops the slot.
MODES = ("hotswap", "shrink")
#: Roles a process registers with.
ROLES = ("active", "spare")


def decode_json(raw: bytes | str, what: str) -> JsonObject:
    """Parse one JSON object read from the store, or raise ``ValueError`` naming ``what``."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what}: not valid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{what}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _int(obj: JsonObject, key: str, what: str, lo: int = 0) -> int:
    return check_int(f"{what} field {key!r}", obj.get(key), low=lo)


class SlotOrder:
    """``world_size`` and ``slot_of`` of a membership that lists its ``members`` in slot order."""

    members: tuple[int, ...]

    @property
    def world_size(self) -> int:
        """Number of slots."""
        return len(self.members)

    def slot_of(self, member: int) -> int | None:
        """The slot ``member`` holds, or ``None``."""
        try:
            return self.members.index(member)
        except ValueError:
            return None


@dataclass(frozen=True, kw_only=True)
class MemberInfo:
    """What a process tells the coordinator when it registers.

    Attributes:
        index: Unique index the store handed out (one per process start).
        member_id: ``host:pid:uuid``: a fast restart is a new member.
        pid: Process id (the launcher maps exits to members with it).
        host: Host name.
        role: ``active`` or ``spare``.
        slot: The slot an active member asks for (``-1``: any; spares: ``-1``).
        job: The job id the process was started for.
    """

    index: int
    member_id: str
    pid: int
    host: str
    role: str
    slot: int
    job: str

    def to_json(self) -> str:
        """Encode for the store."""
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> MemberInfo:
        """Decode and validate a registration record."""
        what = "member record"
        obj = decode_json(raw, what)
        role = obj.get("role")
        if role not in ROLES:
            raise ValueError(f"{what}: role must be one of {ROLES}, got {role!r}")
        for key in ("member_id", "host", "job"):
            if not isinstance(obj.get(key), str):
                raise ValueError(f"{what}: field {key!r} must be a string")
        slot = check_int(f"{what} field 'slot'", obj.get("slot"), low=-1)
        return cls(
            index=_int(obj, "index", what),
            member_id=obj["member_id"],
            pid=_int(obj, "pid", what),
            host=obj["host"],
            role=role,
            slot=slot,
            job=obj["job"],
        )


@dataclass(frozen=True, kw_only=True)
class View(SlotOrder):
    """One epoch's membership: who holds which slot (slot = rank in the epoch).

    Attributes:
        epoch: Strictly increasing epoch number (the first view is epoch 0).
        job: Job id.
        members: Member index of each slot, in rank order.
        lost_slots: Slots of the previous view whose member failed.
        promoted: Slot -> member index of each spare promoted into this view.
        rank_map: Previous rank -> rank in this view, for the members that stayed.
        committed_step: Last step committed everywhere before this view formed (-1: none).
        mode: How the view was formed (``start``, ``hotswap``, ``shrink``, ``same``).
    """

    epoch: int
    job: str
    members: tuple[int, ...]
    lost_slots: tuple[int, ...] = ()
    promoted: dict[int, int] = field(default_factory=dict)
    rank_map: dict[int, int] = field(default_factory=dict)
    committed_step: int = -1
    mode: str = "start"

    def to_json(self) -> str:
        """Encode for the store."""
        return json.dumps(
            {
                "epoch": self.epoch,
                "job": self.job,
                "members": list(self.members),
                "lost_slots": list(self.lost_slots),
                "promoted": {str(k): v for k, v in self.promoted.items()},
                "rank_map": {str(k): v for k, v in self.rank_map.items()},
                "committed_step": self.committed_step,
                "mode": self.mode,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> View:
        """Decode and validate a view record."""
        what = "view record"
        obj = decode_json(raw, what)
        members = obj.get("members")
        lost = obj.get("lost_slots", [])
        if not isinstance(members, list) or not members or not all(_is_nat(m) for m in members):
            raise ValueError(f"{what}: 'members' must be a non-empty list of ints >= 0")
        if len(set(members)) != len(members):
            raise ValueError(f"{what}: a member holds two slots")
        if not isinstance(lost, list) or not all(_is_nat(s) for s in lost):
            raise ValueError(f"{what}: 'lost_slots' must be a list of ints >= 0")
        maps = {}
        for key in ("promoted", "rank_map"):
            raw_map = obj.get(key, {})
            if not isinstance(raw_map, dict):
                raise ValueError(f"{what}: {key!r} must be an object")
            try:
                maps[key] = {int(k): v for k, v in raw_map.items()}
            except ValueError as exc:
                raise ValueError(f"{what}: {key!r} keys must be ints") from exc
            if not all(_is_nat(k) and _is_nat(v) for k, v in maps[key].items()):
                raise ValueError(f"{what}: {key!r} must map ints >= 0 to ints >= 0")
        committed = check_int(f"{what} field 'committed_step'", obj.get("committed_step", -1), low=-1)
        job, mode = obj.get("job"), obj.get("mode", "start")
        if not isinstance(job, str) or not isinstance(mode, str):
            raise ValueError(f"{what}: 'job' and 'mode' must be strings")
        return cls(
            epoch=_int(obj, "epoch", what),
            job=job,
            members=tuple(members),
            lost_slots=tuple(lost),
            promoted=maps["promoted"],
            rank_map=maps["rank_map"],
            committed_step=committed,
            mode=mode,
        )


def _is_nat(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
