"""FSDP2 (``fully_shard``) with its collectives routed through sparsecomm (sparsecomm.fsdp), on gloo ranks.

The twin run with FSDP2's own collectives gives the same parameters, bit for
bit, and our counters see exactly FSDP2's traffic.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

STEPS = 4


def _build(ws: int, ours: bool) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sparsecomm.fsdp

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 30), torch.nn.Tanh(), torch.nn.Linear(30, 30), torch.nn.Tanh(), torch.nn.Linear(30, 4)
    )
    mesh = init_device_mesh("cpu", (ws,))
    units = [m for m in model if isinstance(m, torch.nn.Linear)]
    for m in units:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if ours:
        assert sparsecomm.fsdp.use_sparsecomm(model) == len(units) + 1
    return model, units


def _rank_twins(rank: int, ws: int) -> dict[str, Any]:
    import sparsecomm.distributed as dist

    out: dict[str, Any] = {}
    for kind in ("torch", "ours"):
        model, units = _build(ws, kind == "ours")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        before = dist.get_stats().as_dict()
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(8, 16, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x[:, :4].cos())
            loss.backward()
            opt.step()
            opt.zero_grad()
        after = dist.get_stats().as_dict()
        out[kind] = {
            "params": [p.to_local().detach().reshape(-1).tolist() for p in model.parameters()],
            "bytes": {k: v["bytes_sent"] - before.get(k, {}).get("bytes_sent", 0) for k, v in after.items()},
            "calls": {k: v["calls"] - before.get(k, {}).get("calls", 0) for k, v in after.items()},
        }
    # FSDP2's traffic per step: each unit's parameters gathered in forward and in backward, its gradients
    # reduce-scattered once; every rank holds dim 0 padded to a multiple of ws, split in ws
    shard = [sum(math.ceil(p.shape[0] / ws) * math.prod(p.shape[1:]) for p in m.parameters()) for m in units]
    out["expect"] = {
        "fsdp_all_gather": STEPS * sum(2 * (ws - 1) * 4 * s for s in shard),
        "fsdp_reduce_scatter": STEPS * sum((ws - 1) * 4 * s for s in shard),
    }
    return out


@pytest.mark.parametrize("ws", [2, 4])
def test_fsdp2_over_sparsecomm_is_fsdp2_bitwise(ws: int) -> None:
    res = run_ranks(_rank_twins, ws, timeout=120, op_timeout=60)
    for r in res:
        for a, b in zip(r["ours"]["params"], r["torch"]["params"], strict=True):
            assert a == b
        assert r["torch"]["bytes"] == {}  # FSDP2's own collectives bypass sparsecomm
        ours = r["ours"]["bytes"]
        assert ours == r["expect"], (ours, r["expect"])


def _rank_refusals(rank: int, ws: int) -> list[str]:
    import sparsecomm.fsdp

    out = []
    try:
        sparsecomm.fsdp.use_sparsecomm(torch.nn.Linear(2, 2))
    except ValueError as exc:
        out.append(str(exc))
    return out


def test_use_sparsecomm_refuses_a_module_without_fully_shard() -> None:
    res = run_ranks(_rank_refusals, 2, timeout=60, op_timeout=30)
    assert res[0] == res[1] and "call fully_shard first" in res[0][0]
