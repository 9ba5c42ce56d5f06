"""The epoch planner (:mod:`resilient_comm.plan`): hot-swap, shrink, quorum, rank map, bad input."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from resilient_comm.errors import MembershipError
from resilient_comm.plan import majority, plan_next_epoch
from resilient_comm.ulfm_communicator import _plan_from_table


def test_hotswap_fills_the_dead_slot_with_the_first_spare() -> None:
    plan = plan_next_epoch(3, (10, 11, 12, 13), {12}, [20, 21], mode="hotswap")
    assert plan.epoch == 4
    assert plan.members == (10, 11, 20, 13)
    assert plan.lost_slots == (2,)
    assert dict(plan.promoted) == {2: 20}
    assert dict(plan.rank_map) == {0: 0, 1: 1, 3: 3}
    assert plan.mode == "hotswap"
    assert plan.world_size == 4 and plan.slot_of(20) == 2 and plan.slot_of(12) is None


def test_hotswap_fills_dead_slots_in_slot_order() -> None:
    plan = plan_next_epoch(0, (10, 11, 12, 13, 14), {13, 11}, [30, 20, 25], mode="hotswap")
    assert plan.members == (10, 30, 12, 20, 14)
    assert dict(plan.promoted) == {1: 30, 3: 20}
    assert plan.mode == "hotswap"


def test_shrink_drops_the_dead_slot_and_renumbers_the_rest() -> None:
    plan = plan_next_epoch(0, (10, 11, 12, 13), {11}, [20], mode="shrink")
    assert plan.members == (10, 12, 13)
    assert plan.lost_slots == (1,)
    assert dict(plan.promoted) == {}
    assert dict(plan.rank_map) == {0: 0, 2: 1, 3: 2}
    assert plan.mode == "shrink"


def test_not_enough_spares_fills_the_first_slots_and_shrinks() -> None:
    plan = plan_next_epoch(1, (10, 11, 12, 13, 14), {11, 13}, [20], mode="hotswap")
    assert plan.members == (10, 20, 12, 14)
    assert plan.lost_slots == (1, 3)
    assert dict(plan.promoted) == {1: 20}
    assert dict(plan.rank_map) == {0: 0, 2: 2, 4: 3}
    assert plan.mode == "shrink"


def test_no_spare_at_all_shrinks() -> None:
    plan = plan_next_epoch(0, (10, 11, 12), {12}, [], mode="hotswap")
    assert plan.members == (10, 11) and plan.mode == "shrink"


def test_dead_spares_are_skipped() -> None:
    plan = plan_next_epoch(0, (10, 11, 12), {11, 20}, [20, 21], mode="hotswap")
    assert dict(plan.promoted) == {1: 21}
    assert plan.mode == "hotswap"


def test_nobody_lost_is_the_same_membership() -> None:
    plan = plan_next_epoch(5, (10, 11, 12), {99}, [20], mode="hotswap")
    assert plan.members == (10, 11, 12)
    assert plan.lost_slots == () and dict(plan.promoted) == {}
    assert dict(plan.rank_map) == {0: 0, 1: 1, 2: 2}
    assert plan.mode == "same" and plan.epoch == 6


def test_unknown_holders_count_as_lost() -> None:
    plan = plan_next_epoch(2, (10, None, 12), (), [20], mode="hotswap")
    assert plan.members == (10, 20, 12) and plan.lost_slots == (1,)
    assert dict(plan.rank_map) == {0: 0, 2: 2}


@pytest.mark.parametrize(
    ("world", "dead", "ok"),
    [(4, {0, 1}, False), (4, {0}, True), (5, {0, 1}, True), (5, {0, 1, 2}, False), (1, {0}, False), (2, {1}, False)],
)
def test_majority_quorum(world: int, dead: set[int], ok: bool) -> None:
    slots = tuple(range(world))
    if ok:
        assert plan_next_epoch(0, slots, dead, [], mode="shrink").world_size == world - len(dead)
    else:
        survivors = world - len(dead)
        lost = sorted(dead)
        want = f"no quorum: {survivors} of epoch 0's {world} members survived, slots {lost} lost (a majority is needed)"
        with pytest.raises(MembershipError, match=re.escape(want)):
            plan_next_epoch(0, slots, dead, [100, 101, 102], mode="hotswap")


def test_quorum_is_checked_before_spares_are_promoted() -> None:
    # Three spares could refill every slot, but a minority of the members never goes on.
    with pytest.raises(MembershipError, match="no quorum"):
        plan_next_epoch(0, (10, 11, 12), {10, 11}, [20, 21, 22], mode="hotswap")


def test_custom_quorum_rule() -> None:
    calls: list[tuple[int, int]] = []

    def at_least_one(survivors: int, world_size: int) -> str | None:
        calls.append((survivors, world_size))
        return None if survivors >= 1 else "one member is needed"

    plan = plan_next_epoch(0, (10, 11, 12, 13), {10, 11, 12}, [], mode="shrink", quorum=at_least_one)
    assert plan.members == (13,) and calls == [(1, 4)]
    with pytest.raises(MembershipError, match="one member is needed"):
        plan_next_epoch(0, (10,), {10}, [20], mode="hotswap", quorum=at_least_one)
    assert majority(3, 5) is None and majority(2, 4) is not None


def test_min_world_size() -> None:
    with pytest.raises(MembershipError, match="only 2 members left, min_world_size is 3"):
        plan_next_epoch(0, (10, 11, 12), {12}, [], mode="hotswap", min_world_size=3)
    assert plan_next_epoch(0, (10, 11, 12), {12}, [20], mode="hotswap", min_world_size=3).world_size == 3
    with pytest.raises(MembershipError, match="only 2 members left"):
        plan_next_epoch(0, (10, 11, 12), {12}, [20], mode="shrink", min_world_size=3)


def test_rank_map_and_promoted_are_in_slot_order() -> None:
    # Members listed out of index order: the maps still follow the slots.
    plan = plan_next_epoch(0, (13, 11, 12, 10, 14), {11, 10}, [30, 20], mode="hotswap")
    assert list(plan.rank_map) == [0, 2, 4]
    assert list(plan.promoted) == [1, 3]
    plan = plan_next_epoch(0, (13, 11, 12, 10, 14), {11, 10}, [], mode="shrink")
    assert list(plan.rank_map.items()) == [(0, 0), (2, 1), (4, 2)]
    # every survivor keeps its member and the new slots keep the old order
    assert [plan.members[new] for new in plan.rank_map.values()] == [13, 12, 14]


def test_plan_is_immutable() -> None:
    plan = plan_next_epoch(0, (10, 11, 12), {11}, [20], mode="hotswap")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.epoch = 7  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.promoted[1] = 99  # type: ignore[index]
    with pytest.raises(TypeError):
        plan.rank_map[0] = 99  # type: ignore[index]


def test_inputs_are_not_modified() -> None:
    slots, dead, spares = [10, 11, 12], {11}, [20, 21]
    plan_next_epoch(0, slots, dead, spares, mode="hotswap")
    assert (slots, dead, spares) == ([10, 11, 12], {11}, [20, 21])


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((-1, (1, 2), (), ()), {"mode": "shrink"}, "epoch"),
        ((True, (1, 2), (), ()), {"mode": "shrink"}, "epoch"),
        ((0, (1, 2), (), ()), {"mode": "grow"}, "mode"),
        ((0, (), (), ()), {"mode": "shrink"}, "slots"),
        ((0, "12", (), ()), {"mode": "shrink"}, "slots"),
        ((0, (1, 1), (), ()), {"mode": "shrink"}, "two slots"),
        ((0, (1, -2), (), ()), {"mode": "shrink"}, "slots"),
        ((0, (1, 2.0), (), ()), {"mode": "shrink"}, "slots"),
        ((0, (1, 2), (), (3, 3)), {"mode": "hotswap"}, "twice"),
        ((0, (1, 2), (), (2,)), {"mode": "hotswap"}, "already hold a slot"),
        ((0, (1, 2), (), (False,)), {"mode": "hotswap"}, "spares"),
        ((0, (1, 2), (), {3}), {"mode": "hotswap"}, "spares"),
        ((0, (1, 2), (), ()), {"mode": "shrink", "min_world_size": 0}, "min_world_size"),
    ],
)
def test_bad_input(args: tuple[Any, ...], kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_next_epoch(*args, **kwargs)


# --------------------------------------------------------------------------- the ULFM table
def _row(member: int, slot: int, epoch: int = 3, world: int = 4, closing: int = 0, committed: int = 7) -> list[int]:
    return [member, slot, epoch, world, closing, committed]


def test_ulfm_table_plans_like_the_coordinator() -> None:
    # After a hot-swap, slot 2 is held by member 4 (a former spare); member 1 died; 5 and 6 are spares.
    rows = [_row(0, 0), _row(3, 3, committed=8), _row(4, 2), _row(6, -1, epoch=2), _row(5, -1)]
    table = _plan_from_table(rows, "hotswap", 1)
    assert table is not None
    plan, committed = table
    assert committed == 8
    assert plan == plan_next_epoch(3, (0, 1, 4, 3), {1}, [5, 6], mode="hotswap")
    assert plan.members == (0, 5, 4, 3) and dict(plan.promoted) == {1: 5}
    assert list(plan.rank_map.items()) == [(0, 0), (2, 2), (3, 3)]


def test_ulfm_table_closing_and_quorum() -> None:
    assert _plan_from_table([_row(0, 0), _row(1, 1, closing=1)], "hotswap", 1) is None
    with pytest.raises(MembershipError, match="no quorum: 2 of epoch 3's 4 members survived"):
        _plan_from_table([_row(0, 0), _row(1, 1), _row(5, -1)], "hotswap", 1)


def test_the_first_epoch_gives_each_member_the_slot_it_claims() -> None:
    from resilient_comm.plan import plan_first_epoch

    assert plan_first_epoch({10: 2, 11: 0, 12: 1}, 3) == ((11, 12, 10), [])


def test_the_first_epoch_fills_taken_or_out_of_range_slots_in_id_order_and_leaves_the_rest_spare() -> None:
    from resilient_comm.plan import plan_first_epoch

    # 5 and 7 both claim slot 0 (the lower id wins), 9 claims slot 4 of 3: they fill slots 1 and 2 in id order
    assert plan_first_epoch({7: 0, 5: 0, 9: 4}, 3) == ((5, 7, 9), [])
    assert plan_first_epoch({1: 1, 2: 1, 3: 1, 4: 0}, 2) == ((4, 1), [2, 3])


def test_the_first_epoch_needs_a_member_per_slot() -> None:
    from resilient_comm.plan import plan_first_epoch

    with pytest.raises(ValueError, match="2 members for 3 slots"):
        plan_first_epoch({1: 0, 2: 1}, 3)
