"""Differential tests of every drop-in function on spawned gloo ranks (world sizes 1-4).

One spawn per world size runs every case of ``tests.common.drop_in_cases``
(spawning costs more than the cases themselves); a failure names the case
and carries each rank's traceback.
"""

from __future__ import annotations

import pytest

from tests.common.drop_in_cases import CASES, run_cases
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_drop_in_function_matches_torch(world_size: int) -> None:
    per_rank = run_ranks(run_cases, world_size, timeout=240, op_timeout=60)
    assert set(per_rank[0]) == set(CASES)
    for name in CASES:
        counts = [done[name] for done in per_rank]
        assert len(set(counts)) == 1, (name, counts)
        if not (name == "send_recv" and world_size == 1):
            assert counts[0] > 0, name
