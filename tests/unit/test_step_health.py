"""The straggler verdict (:class:`optim.resilient.step_health.StragglerDetector`): pure logic, fed step by step."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from optim.resilient.step_health import StragglerDetector


def _feed(det: StragglerDetector, steps: list[list[float]]) -> list[int | None]:
    return [det.observe(s) for s in steps]


def test_even_ranks_with_noise_are_never_stragglers() -> None:
    rnd = random.Random(0)
    det = StragglerDetector(factor=3.0, window=20)
    steps = [[0.1 * rnd.uniform(0.7, 1.5) for _ in range(4)] for _ in range(500)]
    for s in steps[::25]:
        s[rnd.randrange(4)] = 2.0  # an occasional very slow step of one rank (a GC pause, page faults)
    assert set(_feed(det, steps)) == {None}


def test_a_persistently_slow_rank_is_found_after_the_window_and_judged_afresh() -> None:
    det = StragglerDetector(factor=3.0, window=10)
    steps = [[0.1, 0.1, 0.5, 0.1] for _ in range(25)]
    got = _feed(det, steps)
    assert got[:9] == [None] * 9 and got[9] == 2  # at the window's end
    assert got[10:19] == [None] * 9 and got[19] == 2  # the history starts again after a verdict


def test_slow_but_within_the_factor_or_the_slack_is_not_a_straggler() -> None:
    det = StragglerDetector(factor=3.0, window=5)
    assert set(_feed(det, [[0.1, 0.25, 0.1]] * 20)) == {None}  # 2.5x
    det = StragglerDetector(factor=3.0, window=5, min_excess=timedelta(milliseconds=20))
    assert set(_feed(det, [[0.001, 0.01, 0.001]] * 20)) == {None}  # 10x, but 9 ms


def test_reset_a_new_world_size_and_off() -> None:
    det = StragglerDetector(factor=3.0, window=5)
    _feed(det, [[0.1, 0.5]] * 4)
    det.reset()
    assert _feed(det, [[0.1, 0.5]] * 4) == [None] * 4
    assert _feed(det, [[0.1, 0.5, 0.1]] * 5)[-1] == 1  # a new world size: the old history is dropped first
    off = StragglerDetector(factor=0, window=5)
    assert set(_feed(off, [[0.1, 5.0]] * 20)) == {None}
    assert StragglerDetector(factor=3.0, window=3).observe([1.0]) is None  # one rank: nobody to compare with


@pytest.mark.parametrize(
    "kwargs",
    [
        {"factor": 1.0, "window": 5},
        {"factor": -2, "window": 5},
        {"factor": 3.0, "window": 2},
        {"factor": True, "window": 5},
    ],
)
def test_bad_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        StragglerDetector(**kwargs)
