"""The next epoch's membership, computed from the current one: pure, no I/O, no clock.

Both fault-aware communicators form a new epoch the same way, and both call
:func:`plan_next_epoch` to do it: the coordinator
(:class:`~resilient_comm.coordinator.Coordinator`) for
:class:`~resilient_comm.fault_aware.FaultAwareCommunicator`, and every live
process alike for :class:`~resilient_comm.ulfm_communicator.UlfmCommunicator`. The rule:

1. quorum: the survivors of the current epoch must satisfy the quorum rule
   (by default :func:`majority`: more than half of its slots), else no epoch
   forms (a minority never continues on its own);
2. ``hotswap``: every lost slot, in slot order, takes the next live spare in
   the order given; with no spare left the remaining lost slots are dropped
   (the epoch shrinks); ``shrink``: every lost slot is dropped;
3. the survivors keep their slot order, so dropping slots renumbers the ones
   after them; the new epoch's slot of a member is its rank;
4. the new epoch must keep at least ``min_world_size`` members.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from bindings.validate import check_choice, check_int
from resilient_comm.errors import MembershipError
from resilient_comm.view import MODES, SlotOrder

__all__ = ["EpochPlan", "QuorumRule", "majority", "plan_next_epoch", "PLAN_MODES"]

#: How a plan was formed: nobody lost, every lost slot filled by a spare, or slots dropped.
PLAN_MODES = ("same", "hotswap", "shrink")


class QuorumRule(Protocol):
    """Decides whether the survivors of an epoch may form the next one."""

    def __call__(self, survivors: int, world_size: int) -> str | None:
        """Return ``None`` when ``survivors`` of ``world_size`` members may go on, else what is missing."""
        ...


def majority(survivors: int, world_size: int) -> str | None:
    """The default quorum rule: more than half of the epoch's members survived."""
    return None if 2 * survivors > world_size else "a majority is needed"


@dataclass(frozen=True, kw_only=True)
class EpochPlan(SlotOrder):
    """The next epoch: who holds which slot and how it differs from the current one.

    Attributes:
        epoch: The new epoch's number (the current one plus one).
        members: Member index of each new slot, in rank order.
        lost_slots: Slots of the current epoch whose member is gone, ascending.
        promoted: New slot -> member index of each promoted spare, by ascending slot.
        rank_map: Current slot -> new slot of every survivor, by ascending current slot.
        mode: ``same`` (nobody lost), ``hotswap`` (every lost slot filled) or ``shrink``.
    """

    epoch: int
    members: tuple[int, ...]
    lost_slots: tuple[int, ...]
    promoted: Mapping[int, int]
    rank_map: Mapping[int, int]
    mode: str


def _check_member(name: str, value: object) -> int:
    return check_int(f"{name} member index", value, low=0)


def plan_next_epoch(
    epoch: int,
    slots: Sequence[int | None],
    dead: Collection[int],
    spares: Sequence[int],
    *,
    mode: str,
    min_world_size: int = 1,
    quorum: QuorumRule = majority,
) -> EpochPlan:
    """Plan the epoch after ``epoch`` (see the module docstring for the rule).

    Args:
        epoch: The current epoch (>= 0).
        slots: Member index of each slot of the current epoch; ``None`` marks a
            slot whose member is gone and unknown.
        dead: Members that are gone; a slot whose member is in it is lost, a
            spare in it is skipped. Other members in it are ignored.
        spares: Candidate spares, in promotion order.
        mode: ``hotswap`` or ``shrink`` (:data:`resilient_comm.view.MODES`).
        min_world_size: The fewest members the new epoch may have (>= 1).
        quorum: Whether the survivors may go on (default :func:`majority`).

    Returns:
        The new epoch's plan.

    Raises:
        ValueError: Bad arguments (a member in two slots, a spare that holds a
            slot, an unknown mode, ...).
        MembershipError: No quorum, or fewer than ``min_world_size`` members left.
    """
    check_int("epoch", epoch, low=0)
    check_choice("mode", mode, MODES)
    check_int("min_world_size", min_world_size, low=1)
    if isinstance(slots, (str, bytes)) or not isinstance(slots, Sequence) or not slots:
        raise ValueError(f"slots: must be a non-empty sequence, got {slots!r}")
    holders = [m for m in slots if m is not None]
    for m in holders:
        _check_member("slots", m)
    if len(set(holders)) != len(holders):
        raise ValueError(f"slots: a member holds two slots in {list(slots)}")
    if isinstance(spares, (str, bytes)) or not isinstance(spares, Sequence):
        raise ValueError(f"spares: must be a sequence, got {spares!r}")
    for m in spares:
        _check_member("spares", m)
    if len(set(spares)) != len(spares):
        raise ValueError(f"spares: a spare is listed twice in {list(spares)}")
    if set(spares) & set(holders):
        raise ValueError(f"spares: {sorted(set(spares) & set(holders))} already hold a slot")
    gone = frozenset(dead)

    world_size = len(slots)
    kept: list[int | None] = [m if m is not None and m not in gone else None for m in slots]
    lost = tuple(s for s, m in enumerate(kept) if m is None)
    survivors = world_size - len(lost)
    why = quorum(survivors, world_size)
    if why is not None:
        raise MembershipError(
            f"no quorum: {survivors} of epoch {epoch}'s {world_size} members survived, slots {list(lost)} lost ({why})"
        )
    promoted: dict[int, int] = {}
    if mode == "hotswap":
        candidates = iter(m for m in spares if m not in gone)
        for s in lost:
            spare = next(candidates, None)
            if spare is None:
                break
            kept[s] = promoted[s] = spare
    members = tuple(m for m in kept if m is not None)
    if len(members) < min_world_size:
        raise MembershipError(f"only {len(members)} members left, min_world_size is {min_world_size}")
    new_slot = {m: s for s, m in enumerate(members)}
    rank_map = {old: new_slot[m] for old, m in enumerate(slots) if m is not None and old not in lost}
    if not lost:
        kind = "same"
    elif len(promoted) == len(lost):
        kind = "hotswap"
    else:
        kind = "shrink"
    return EpochPlan(
        epoch=epoch + 1,
        members=members,
        lost_slots=lost,
        promoted=MappingProxyType(promoted),
        rank_map=MappingProxyType(rank_map),
        mode=kind,
    )


def plan_first_epoch(claims: Mapping[int, int], world_size: int) -> tuple[tuple[int, ...], list[int]]:
    """The members of epoch 0, slot by slot, and the active members left over (they wait as spares).

    A member gets the slot it claims (its launch rank) when that slot is in
    range and not claimed by a member with a lower id; the others fill the
    empty slots in id order.

    Args:
        claims: Every live active member's id and the slot it claims.
        world_size: Slots of the first epoch (>= 1); ``claims`` holds at least that many members.

    Returns:
        The members by slot, and the rest in id order.

    Raises:
        ValueError: Fewer claims than slots.
    """
    n = check_int("world_size", world_size, low=1)
    if len(claims) < n:
        raise ValueError(f"claims: {len(claims)} members for {n} slots")
    slots: list[int | None] = [None] * n
    rest = []
    for member in sorted(claims):
        slot = claims[member]
        if 0 <= slot < n and slots[slot] is None:
            slots[slot] = member
        else:
            rest.append(member)
    for slot in range(n):
        if slots[slot] is None:
            slots[slot] = rest.pop(0)
    return tuple(m for m in slots if m is not None), rest
