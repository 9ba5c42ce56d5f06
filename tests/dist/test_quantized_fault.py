"""A quantized all-reduce whose peer never joins: it ends by its deadline and writes nothing."""

from __future__ import annotations

import time

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def _rank(rank: int, ws: int) -> dict:
    import sparsecomm.distributed as dist
    from bindings.errors import CommError
    from sparsecomm.quantized import Quantizer, quantized_all_reduce

    if rank == 1:
        time.sleep(6.0)  # never joins: rank 0's call must end by its own deadline
        return {}
    values = torch.linspace(-1.0, 1.0, 64 * ws)
    residual = torch.full((64,), 0.25)
    t0 = time.monotonic()
    try:
        quantized_all_reduce(dist.get_communicator(), values, Quantizer(bits=4), residual=residual)
        raised = ""
    except CommError as exc:
        raised = type(exc).__name__
    return {
        "raised": raised,
        "elapsed": time.monotonic() - t0,
        "values_kept": torch.equal(values, torch.linspace(-1.0, 1.0, 64 * ws)),
        "residual_kept": torch.equal(residual, torch.full((64,), 0.25)),
    }


def test_a_peer_that_never_joins_times_out_and_nothing_is_written() -> None:
    res = run_ranks(_rank, 2, timeout=60, op_timeout=2.0)[0]
    assert res["raised"], res
    assert res["elapsed"] < 5.0, res
    assert res["values_kept"] and res["residual_kept"], res
