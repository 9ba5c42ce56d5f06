"""MaskedLoCo (SparseLoCo over a mask agreed one outer step ahead) on spawned gloo ranks.

* The replicas are one after every outer step, apart between them; every rank holds the same mask.
* The mask of an outer step is each owner's top-k of its accumulator's shard after the step before.
* Error feedback: the accumulator keeps exactly what was not sent (unsent positions whole, the codes'
  error at the sent ones); the global parameters move at the mask's positions only.
* Wire bytes: ``round_bytes`` per outer step (plus the first mask's agreement), none between; the density
  plan's bytes per step come out at or just under the density.
* State dicts resume bit for bit; bad input raises on every rank.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.test_diloco import bad, resumes
from tests.dist.test_local import _loss, _model

pytestmark = pytest.mark.dist

STEPS, WARM, H, LR, DECAY = 11, 2, 3, 0.05, 0.9
SETTINGS = dict(period=H, fraction=0.2, outer_lr=0.8, decay=DECAY, warmup_steps=WARM)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def _run(rank: int, ws: int) -> dict:
    from optim import MaskedLoCo

    model = _model()
    opt = MaskedLoCo(torch.optim.SGD(model.parameters(), lr=LR), model, **SETTINGS)  # type: ignore[arg-type]
    stats, n, plan = opt.communicator.stats, opt.bucket.numel, opt.plan
    out: dict = {"flats": [], "sent": [], "feedback": [], "outer": [], "masks": [], "owner_topk": [], "at_mask": []}
    for t in range(STEPS):
        before = stats.as_dict().get("masked_loco", {"bytes_sent": 0})["bytes_sent"]
        opt.zero_grad()
        _loss(model, rank, t).backward()
        replica = _flat(model).sub_(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), alpha=LR)  # type: ignore[union-attr]
        glob, err = opt.global_params[:n].clone(), opt.error.clone()
        mask = None if opt.mask is None else opt.mask.clone()
        opt.step()
        out["sent"].append(stats.as_dict().get("masked_loco", {"bytes_sent": 0})["bytes_sent"] - before)
        out["flats"].append(_flat(model).tolist())
        if t >= WARM and (t + 1 - WARM) % H == 0:
            acc = err.clone()
            acc[:n].mul_(DECAY).add_(glob - replica)
            if mask is None:  # the first outer step agrees on its mask from the accumulator at once
                lo = rank * plan.shard
                mine = acc[lo : lo + plan.shard].abs()
                mine[max(0, n - lo) :] = -1.0
                out["first_topk"] = sorted((torch.topk(mine, plan.k).indices + lo).tolist())
                out["first_mask"] = None
            else:
                out["masks"].append(mask.tolist())
            used = opt.mask  # after the step: the next one's; the one used is what the error kept
            moved = glob - opt.global_params[:n]
            out["outer"].append({"moved": moved.tolist(), "after": opt.global_params[:n].tolist()})
            kept = opt.error.clone()
            unsent = torch.ones(kept.numel(), dtype=torch.bool)
            if mask is not None:
                unsent[mask] = False
                out["feedback"].append(
                    torch.equal(kept[unsent], acc[unsent])
                    and not kept[n:].any()
                    and bool((moved[unsent[:n]] == 0).all())
                )
                out["at_mask"].append({"acc": acc[mask].tolist(), "kept": kept[mask].tolist(), "mask": mask.tolist()})
            lo = rank * plan.shard  # the next mask: this owner's top-k of its shard, as the accumulator is now
            mine = kept[lo : lo + plan.shard].abs()
            mine[max(0, n - lo) :] = -1.0
            assert used is not None
            out["owner_topk"].append(
                sorted((torch.topk(mine, plan.k).indices + lo).tolist())
                == sorted(used[rank * plan.k : (rank + 1) * plan.k].tolist())
            )
            out["next_mask"] = used.tolist()
    out["plan"] = (plan.k, plan.shard, plan.index_bits, plan.round_bytes, plan.index_bytes)
    return out


def test_replicas_are_one_after_each_outer_step_and_the_mask_is_agreed_ahead() -> None:
    res = run_ranks(_run, 2, timeout=60)
    assert res[0]["plan"][:3] == (10, 52, 6)  # 103 parameters in 2 shards of 52, k = round(0.2 * 52)
    for t in range(STEPS):
        synced = t < WARM or (t + 1 - WARM) % H == 0
        assert (res[0]["flats"][t] == res[1]["flats"][t]) == synced, t
    assert res[0]["masks"] == res[1]["masks"] and len(res[0]["masks"]) == 2  # the outer steps after steps 7, 10
    assert res[0]["next_mask"] == res[1]["next_mask"]
    for r in res:
        assert r["owner_topk"] == [True, True, True]
        assert r["feedback"] == [True, True]
    for a, b in zip(res[0]["outer"], res[1]["outer"], strict=True):
        assert a["after"] == b["after"] and a["moved"] == b["moved"]
        assert 0 < sum(m != 0 for m in a["moved"]) <= 2 * 10


def test_each_rank_keeps_what_its_codes_dropped_and_the_global_moves_by_the_decoded_average() -> None:
    from sparsecomm.quantized import Quantizer

    res = run_ranks(_run, 2, timeout=60)
    q, k = Quantizer(bits=2, block=64), res[0]["plan"][0]
    for i, moved in enumerate(o["moved"] for o in res[0]["outer"][1:]):
        mask = torch.tensor(res[0]["at_mask"][i]["mask"])
        decoded = []
        for r in res:
            acc, kept = torch.tensor(r["at_mask"][i]["acc"]), torch.tensor(r["at_mask"][i]["kept"])
            dec = torch.cat([q.encode(acc[o * k : (o + 1) * k])[1] for o in range(2)])  # each owner's k values
            assert torch.equal(kept, acc - dec)  # what the codes dropped stays, exactly
            decoded.append(dec)
        avg = torch.cat(
            [q.encode((decoded[0][o * k : (o + 1) * k] + decoded[1][o * k : (o + 1) * k]) / 2)[1] for o in range(2)]
        )
        want = torch.zeros(len(moved))
        real = mask < len(moved)
        want[mask[real]] = 0.8 * avg[real]
        assert torch.allclose(torch.tensor(moved), want, atol=1e-6)


def test_bytes_per_outer_step_are_the_plans() -> None:
    res = run_ranks(_run, 2, timeout=60)
    k, shard, width, round_bytes, index_bytes = res[0]["plan"]
    assert index_bytes == 8  # 10 positions of 6 bits
    assert round_bytes == 1 * (2 * (2 + 16) + 8)  # P - 1 = 1: codes of 10 values both ways (one block), the mask
    outer = [t for t in range(STEPS) if t >= WARM and (t + 1 - WARM) % H == 0]
    for t, b in enumerate(res[0]["sent"]):
        want = round_bytes + (index_bytes if t == outer[0] else 0) if t in outer else 0
        assert b == want, t


def _resume(rank: int, ws: int, cut: int) -> bool:
    from optim import MaskedLoCo

    return resumes(rank, lambda m: MaskedLoCo(torch.optim.AdamW(m.parameters(), lr=LR), m, **SETTINGS), cut)  # type: ignore[arg-type]


@pytest.mark.parametrize("cut", [6, 8])
def test_state_dict_resumes_bit_for_bit(cut: int) -> None:
    """Cut mid-period with a mask agreed (after step 6) and right after an outer step (step 8)."""
    assert all(run_ranks(_resume, 2, cut, timeout=60))


@pytest.mark.parametrize(
    ("case", "kind", "words"),
    [
        ("wrapper", "TypeError", "synchronizes the ranks itself"),
        ("twice", "ValueError", "already wrapped"),
        ("missing", "ValueError", "not the optimizer's"),
        ("both", "ValueError", "not both"),
        ("density", "ValueError", "Invalid density"),
        ("fraction", "ValueError", "Invalid fraction"),
        ("bits", "ValueError", "Invalid bits"),
        ("decay", "ValueError", "Invalid decay"),
        ("outer-lr", "ValueError", "Invalid outer_lr"),
    ],
)
def test_bad_input_raises_on_every_rank(case: str, kind: str, words: str) -> None:
    for r in run_ranks(bad, 2, "MaskedLoCo", case, timeout=60):
        assert r.startswith(kind) and words in r, r


@pytest.mark.parametrize(("density", "ws"), [(0.1, 4), (0.01, 4), (0.01, 2), (0.001, 4), (0.1, 2)])
def test_the_density_plan_sends_density_times_the_dense_bytes(density: float, ws: int) -> None:
    from optim.optimizers.masked_loco import masked_loco_plan

    n = 26122  # the digits MLP of the convergence suite
    plan = masked_loco_plan(density, n, ws)
    dense = 2 * (ws - 1) / ws * 4 * n  # ring all_reduce of the fp32 model
    ratio = plan.wire_bytes_per_step() / dense
    assert plan.shard == -(-n // ws)
    assert density * 0.9 < ratio <= density, (plan, ratio)
