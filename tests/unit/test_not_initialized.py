"""The drop-in API before init_process_group: clear errors, nothing else."""

from __future__ import annotations

import pytest
import torch

import sparsecomm.distributed as dist


@pytest.mark.parametrize(
    "call",
    [
        lambda: dist.get_rank(),
        lambda: dist.get_world_size(),
        lambda: dist.get_backend(),
        lambda: dist.all_reduce(torch.ones(2)),
        lambda: dist.barrier(),
        lambda: dist.new_group([0]),
        lambda: dist.destroy_process_group(),
    ],
)
def test_calls_before_init_raise(call) -> None:  # type: ignore[no-untyped-def]
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        call()
    with pytest.raises(ValueError, match="init_process_group"):  # torch raises ValueError
        call()


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="backend"):
        dist.init_process_group("carrier-pigeon", rank=0, world_size=1)
    assert not dist.is_initialized()


def test_bad_rank_is_rejected_before_rendezvous() -> None:
    with pytest.raises(ValueError, match="rank"):
        dist.init_process_group("gloo", rank=3, world_size=2, init_method="tcp://127.0.0.1:1")
    with pytest.raises(TypeError, match="timeout"):
        dist.init_process_group("gloo", rank=0, world_size=1, timeout=30)
    assert not dist.is_initialized()
