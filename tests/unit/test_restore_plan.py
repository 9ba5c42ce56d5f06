"""The restore agreement (:func:`optim.state.restore.plan_restore`): which step, and who holds a lost slot's copy."""

from __future__ import annotations

import pytest

from optim.state.restore import ReportRow, RestorePlan, plan_restore
from optim.state.snapshot import UnrecoverableStateError


def _rows(world: int, own: dict[int, list[int]], ward: dict[int, list[int]], survivors: list[int]) -> list[list[int]]:
    """Rows of the survivors (old slots, in new-rank order), then one promoted spare per lost slot."""
    rows = [ReportRow.of(s, world, own.get(s, []), ward.get(s, [])) for s in survivors]
    rows += [ReportRow.of(-1, world, [], []) for _ in range(world - len(survivors))]
    return rows


def test_report_row_layout() -> None:
    assert ReportRow.of(2, 4, [7, 8], [8]).to_ints() == [2, 1, 7, 8, 8, -1]
    assert ReportRow.of(0, 4, [], []).to_ints() == [0, 3, -1, -1, -1, -1]
    assert ReportRow.of(-1, 4, [5], [5]).to_ints() == [-1] * 6
    for row in (ReportRow.of(2, 4, [7, 8], [8]), ReportRow.of(0, 4, [], []), ReportRow.of(-1, 4, [5], [5])):
        assert ReportRow.from_ints(row.to_ints()) == row


def test_nobody_lost_restores_the_newest_common_step() -> None:
    own = {s: [7, 8] for s in range(4)}
    ward = {s: [7, 8] for s in range(4)}
    plan = plan_restore(_rows(4, own, ward, [0, 1, 2, 3]), 4)
    assert plan == RestorePlan(step=8, holders={}, old_world=4)


def test_a_lost_slot_is_restored_from_its_buddy_at_the_newest_replicated_step() -> None:
    # slot 1 died; its buddy (slot 2) holds slot 1's copies of 7 and 8, but step 9 was not replicated yet
    own = {0: [8, 9], 2: [8, 9], 3: [8, 9]}
    ward = {0: [8, 9], 2: [7, 8], 3: [8, 9]}
    plan = plan_restore(_rows(4, own, ward, [0, 2, 3]), 4)
    assert plan.step == 8
    assert plan.holders == {1: 1}  # the survivor with old slot 2 is new rank 1 in this table


def test_buddy_and_ward_lost_together_is_unrecoverable() -> None:
    own = {0: [8, 9], 3: [8, 9]}
    ward = {0: [8, 9], 3: [8, 9]}
    with pytest.raises(UnrecoverableStateError, match=r"slots \[1\]"):
        plan_restore(_rows(4, own, ward, [0, 3]), 4)


def test_early_failure_falls_back_to_the_initial_state() -> None:
    # the first snapshot (0) is held by someone: the initial state is rebuilt from the seed everywhere
    own = {0: [0], 2: [0], 3: [0]}
    plan = plan_restore(_rows(4, own, {}, [0, 2, 3]), 4)
    assert plan.step == 0


def test_no_snapshots_restart_from_step_one() -> None:
    plan = plan_restore(_rows(2, {0: [], 1: []}, {}, [0, 1]), 2, snapshots=False)
    assert plan.step == -1


def test_a_promoted_spare_that_never_restored_counts_as_stateless() -> None:
    # new rank 1 holds old slot 1 but no versions (promoted by an epoch whose recovery failed):
    # slot 1's state comes from its buddy (old slot 2) as if it were lost
    table = [ReportRow.of(0, 3, [4, 5], [4, 5]), ReportRow(slot=1, ward=0), ReportRow.of(2, 3, [4, 5], [4, 5])]
    plan = plan_restore(table, 3)
    assert plan.step == 5 and plan.holders == {1: 2}


@pytest.mark.parametrize("ints", [[0, 0, 1, 2, 3], [0, 0, 1, 2, 3, 4, 5]])
def test_rows_of_the_wrong_length_are_rejected(ints: list[int]) -> None:
    with pytest.raises(ValueError):
        ReportRow.from_ints(ints)


@pytest.mark.parametrize(
    "table, world",
    [([ReportRow(slot=5, ward=4, own=(1,))], 2), ([ReportRow(slot=0, ward=0, own=(1,))], 0)],
)
def test_malformed_tables_are_rejected(table: list[ReportRow], world: int) -> None:
    with pytest.raises(ValueError):
        plan_restore(table, world)
