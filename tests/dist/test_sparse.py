"""Sparse collectives and the delayed mask schedule on spawned gloo ranks (world sizes 1-4)."""

from __future__ import annotations

import pytest

from tests.common.sparse_cases import SPARSE_CASES, run_sparse_cases
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sparse_collectives(world_size: int) -> None:
    per_rank = run_ranks(run_sparse_cases, world_size, timeout=300, op_timeout=60)
    for name in SPARSE_CASES:
        counts = [done[name] for done in per_rank]
        assert len(set(counts)) == 1 and counts[0] > 0, (name, counts)
