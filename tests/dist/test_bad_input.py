"""Bad input on spawned gloo ranks: clear errors on every rank, nothing sent, nothing hangs."""

from __future__ import annotations

import pytest

from tests.common.bad_input_cases import (
    case_bad_arguments,
    case_mismatch_detected,
    case_missing_peer_times_out,
)
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("world_size", [1, 3])
def test_bad_arguments_raise_before_communicating(world_size: int) -> None:
    counts = run_ranks(case_bad_arguments, world_size, timeout=120, op_timeout=30)
    assert counts[0] > 30 and len(set(counts)) == 1


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_mismatch_is_detected_on_every_rank(world_size: int) -> None:
    counts = run_ranks(
        case_mismatch_detected,
        world_size,
        timeout=120,
        op_timeout=30,
        init_kwargs={"check_collectives": True},
    )
    assert counts == [6] * world_size


def test_collective_without_peers_ends_at_timeout() -> None:
    elapsed = run_ranks(case_missing_peer_times_out, 2, timeout=60, op_timeout=30)
    assert 1.5 < elapsed[0] < 20, elapsed
