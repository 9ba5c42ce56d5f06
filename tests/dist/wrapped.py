"""What the tests of the wrappers whose replicas never differ share: a run resumed from its state dict."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tests.dist.test_local import _loss, _model


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def resumed_run(
    rank: int, build: Callable[[torch.nn.Module], Any], key: str, names: Sequence[str], cut: int, steps: int
) -> dict[str, Any]:
    """Train ``steps`` steps; again with the state after step ``cut`` saved and loaded into a new optimizer.

    Runs on one rank of a job (collective). ``build(model)`` makes the
    optimizer; ``key`` is its own entry in the state dict and ``names`` the
    tensors of that entry to compare.

    Returns:
        ``same``: whether both runs end with the same parameters and tensors, bit for bit; ``step``: the
        resumed optimizer's step count at the end.
    """
    runs = []
    for resumed in (False, True):
        model = _model()
        opt = build(model)
        saved: dict[str, Any] = {}
        for t in range(steps):
            if resumed and t == cut:
                model = _model(seed=7)
                opt = build(model)
                with torch.no_grad():
                    torch.nn.utils.vector_to_parameters(saved["params"], model.parameters())
                opt.load_state_dict(saved["state"])
            opt.zero_grad()
            _loss(model, rank, t).backward()
            opt.step()
            if t == cut - 1:
                saved = {"params": _flat(model), "state": copy.deepcopy(opt.state_dict())}
        runs.append((_flat(model).tolist(), opt.state_dict()[key]))
    (a, sa), (b, sb) = runs
    return {"same": a == b and all(torch.equal(sa[k], sb[k]) for k in names), "step": sb["step"]}
