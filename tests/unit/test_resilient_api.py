"""Argument checks of the failure-transparent training API (before any communication)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from optim.resilient import ResilientConfig, ResilientTraining, Stateful


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.n = int(state_dict["n"])


def _adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters())


def test_stateful_protocol_matches_torch_objects() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert isinstance(torch.optim.lr_scheduler.StepLR(opt, 1), Stateful)
    assert isinstance(_Counter(), Stateful)
    assert not isinstance(object(), Stateful)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"timeout": timedelta(0)}, ValueError),
        ({"timeout": 5.0}, ValueError),
        ({"snapshots": 1}, TypeError),
        ({"snapshot_block": -1}, ValueError),
        ({"snapshot_block": True}, ValueError),
        ({"max_bad_steps": -1}, ValueError),
        ({"max_bad_steps": 1.5}, ValueError),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        ResilientConfig(**kwargs)


def test_config_snapshot_blocks() -> None:
    assert [ResilientConfig(snapshot_block=2).snapshots_at(s) for s in range(1, 7)] == [1, 1, 0, 0, 1, 1]
    assert all(ResilientConfig().snapshots_at(s) for s in range(1, 5))
    assert not ResilientConfig(snapshots=False).snapshots_at(1)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (("not a model", _adamw), {}, "model"),
        ((torch.nn.Linear(2, 2), "adamw"), {}, "optimizer"),
        ((torch.nn.Linear(2, 2), _adamw), {"scheduler": 3}, "scheduler"),
        ((torch.nn.Linear(2, 2), _adamw), {"state": {"rng": object()}}, "state"),
        ((torch.nn.Linear(2, 2), _adamw), {"state": {1: _Counter()}}, "state"),
        ((torch.nn.Linear(2, 2), _adamw), {"config": {"timeout": 3}}, "config"),
    ],
)
def test_constructor_rejects_bad_arguments_before_connecting(args: tuple, kwargs: dict, match: str) -> None:
    # no coordinator exists here: reaching the connect step would fail differently
    with pytest.raises(TypeError, match=match):
        ResilientTraining(*args, **kwargs)
