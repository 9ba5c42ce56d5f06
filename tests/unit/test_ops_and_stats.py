"""Reduce-op parsing, byte formulas and counters."""

from __future__ import annotations

import pytest
import torch.distributed as tdist

from bindings.ops import ReduceOp, parse_reduce_op
from bindings.stats import CommStats, ring_bytes


@pytest.mark.parametrize("name", ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"])
def test_every_spelling_of_an_op_parses(name: str) -> None:
    expected = ReduceOp(name.lower())
    assert parse_reduce_op(name.lower()) is expected
    assert parse_reduce_op(getattr(tdist.ReduceOp, name)) is expected
    assert parse_reduce_op(expected) is expected


@pytest.mark.parametrize("bad", ["median", tdist.ReduceOp.PREMUL_SUM, 3, None])
def test_unknown_ops_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="op"):
        parse_reduce_op(bad)


def test_ring_byte_formulas() -> None:
    assert ring_bytes("all_reduce", 1000, 4) == (1500, 1500)
    assert ring_bytes("all_reduce", 1000, 1) == (0, 0)
    assert ring_bytes("reduce_scatter", 250, 4) == (750, 750)
    assert ring_bytes("all_gather", 250, 4) == (750, 750)
    assert ring_bytes("broadcast", 100, 4, is_root=True) == (100, 0)
    assert ring_bytes("broadcast", 100, 4) == (0, 100)
    assert ring_bytes("send", 8, 2) == (8, 0) and ring_bytes("recv", 8, 2) == (0, 8)
    with pytest.raises(ValueError):
        ring_bytes("all_to_all", 8, 2)


def test_stats_accumulate_per_op() -> None:
    s = CommStats()
    s.record("all_reduce", 10, 12)
    s.record("all_reduce", 1, 1)
    s.record("send", 5, 0)
    assert s.get("all_reduce").calls == 2
    assert (s.bytes_sent, s.bytes_received) == (16, 13)
    assert s.as_dict()["send"] == {"calls": 1, "bytes_sent": 5, "bytes_received": 0}
    s.reset()
    assert s.bytes_sent == 0 and s.get("send").calls == 0
