"""Records the coordinator reads from members and strangers, checked and reduced to what it acts on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bindings.json_object import JsonObject
from resilient_comm.auth import RecordError
from resilient_comm.view import decode_json

__all__ = ["Suspicion", "refusal_fields"]


@dataclass(frozen=True, kw_only=True)
class Suspicion:
    """A member's report: a transport failure in ``epoch``, or (``evict`` set) a straggler to replace."""

    epoch: int
    member: int
    evict: int | None
    reason: str

    @classmethod
    def parse(cls, record: bytes | RecordError, members: set[int] | dict[int, Any]) -> Suspicion:
        """Check a suspicion record (``ValueError`` if it is malformed, rejected, or from a stranger)."""
        if isinstance(record, RecordError):
            raise record
        rec = decode_json(record, "suspicion record")
        try:
            epoch, member = int(rec["epoch"]), int(rec["member"])
            evict = None if rec.get("evict") is None else int(rec["evict"])
        except (KeyError, TypeError, OverflowError) as exc:
            raise ValueError(f"malformed suspicion record: {exc!r}") from exc
        if member not in members:
            raise ValueError(f"from member {member}, which never registered")
        return cls(epoch=epoch, member=member, evict=evict, reason=str(rec.get("reason", ""))[:500])


def refusal_fields(member: int | None, record: bytes | RecordError, why: str = "") -> JsonObject:
    """The ``member_refused`` event of a refused process: what it claims to be (unchecked, bounded) and why."""
    claimed: JsonObject = {}
    try:
        claimed = decode_json(record, "refusal note") if isinstance(record, bytes) else {}
    except ValueError:
        pass
    pid, host = claimed.get("pid"), claimed.get("host")
    return {
        "pid": pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
        "member": member,
        "host": str(host)[:200] if host is not None else None,
        "reason": (why or str(claimed.get("reason", "")))[:500],
    }
