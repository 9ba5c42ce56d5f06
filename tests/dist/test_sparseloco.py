"""SparseLoCo (local steps, a chunk-wise top-k of an error-feedback accumulator in 2-bit codes) on spawned gloo ranks.

* The replicas are one after every outer step, apart between them.
* Error feedback: the accumulator keeps exactly what was not sent (unsent
  positions whole, the codes' error at the sent ones), and the global
  parameters move by the average of what the ranks sent.
* Wire bytes: one all_gather of ``payload_bytes`` per outer step, none between;
  the density plan's bytes per step come out at or just under the density.
* State dicts resume bit for bit; bad input raises on every rank.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.test_diloco import bad, resumes
from tests.dist.test_local import _loss, _model

pytestmark = pytest.mark.dist

STEPS, WARM, H, LR, DECAY = 10, 2, 3, 0.05, 0.9
SETTINGS = dict(period=H, fraction=0.19, chunk=32, outer_lr=0.8, decay=DECAY, warmup_steps=WARM)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def _run(rank: int, ws: int) -> dict:
    from optim import SparseLoCo

    model = _model()
    opt = SparseLoCo(torch.optim.SGD(model.parameters(), lr=LR), model, **SETTINGS)  # type: ignore[arg-type]
    stats, n = opt.communicator.stats, opt.bucket.numel
    out: dict = {"flats": [], "sent": [], "feedback": [], "outer": []}
    for t in range(STEPS):
        before = stats.as_dict().get("sparseloco", {"bytes_sent": 0})["bytes_sent"]
        opt.zero_grad()
        _loss(model, rank, t).backward()
        # what this step's outer step will see: the replica after plain SGD, the accumulator decayed plus the delta
        replica = _flat(model).sub_(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), alpha=LR)  # type: ignore[union-attr]
        glob, err = opt.global_params[:n].clone(), opt.error.clone()
        opt.step()
        out["sent"].append(stats.as_dict().get("sparseloco", {"bytes_sent": 0})["bytes_sent"] - before)
        out["flats"].append(_flat(model).tolist())
        if t >= WARM and (t + 1 - WARM) % H == 0:
            acc = err.clone()
            acc[:n].mul_(DECAY).add_(glob - replica)
            pos, dec = opt.last_sent  # type: ignore[misc]
            want = acc.clone()
            want[pos] = acc[pos] - dec
            out["feedback"].append(torch.equal(opt.error, want) and not opt.error[n:].any())
            sent = torch.zeros(n)
            sent.index_add_(0, pos[pos < n], dec[pos < n])
            out["outer"].append(
                {"before": glob.tolist(), "after": opt.global_params[:n].tolist(), "sent": sent.tolist()}
            )
    out["payload"] = opt.plan.payload_bytes
    out["k"], out["chunks"], out["chunk"] = opt.plan.k, opt.plan.chunks, opt.plan.chunk
    return out


def test_replicas_are_one_after_each_outer_step_and_the_accumulator_keeps_the_rest() -> None:
    res = run_ranks(_run, 2, timeout=60)
    assert (res[0]["chunks"], res[0]["chunk"], res[0]["k"]) == (4, 26, 5)  # 103 parameters, chunks up to 32
    for t in range(STEPS):
        synced = t < WARM or (t + 1 - WARM) % H == 0
        assert (res[0]["flats"][t] == res[1]["flats"][t]) == synced, t
    for r in res:
        assert r["feedback"] == [True, True]  # the outer steps after steps 5 and 8
    for a, b in zip(res[0]["outer"], res[1]["outer"], strict=True):
        assert a["after"] == b["after"] and a["before"] == b["before"]
        moved = torch.tensor(a["before"]) - torch.tensor(a["after"])
        want = 0.8 * (torch.tensor(a["sent"]) + torch.tensor(b["sent"])) / 2
        assert torch.allclose(moved, want, atol=1e-6)
        assert 0 < int((want != 0).sum()) <= 2 * 4 * 5  # at most k of every chunk from each rank


def test_one_all_gather_of_the_payload_per_outer_step() -> None:
    from optim.optimizers.sparseloco import SparseLoCoPlan

    res = run_ranks(_run, 2, timeout=60)
    payload = res[0]["payload"]
    plan = SparseLoCoPlan(period=H, k=5, chunks=4, chunk=26, bits=2)
    # 20 values: one block of 64 codes (2 + 16 bytes); 20 positions of 5 bits: 13 bytes (odd: the next rank's
    # codes start unaligned)
    assert payload == plan.payload_bytes == 18 + 13
    for t, b in enumerate(res[0]["sent"]):
        outer = t >= WARM and (t + 1 - WARM) % H == 0
        assert b == (payload if outer else 0), t  # all_gather of 2 ranks: (P - 1) * payload
    assert plan.wire_bytes_per_step(2) == payload / H


def _resume(rank: int, ws: int, cut: int) -> bool:
    from optim import SparseLoCo

    return resumes(rank, lambda m: SparseLoCo(torch.optim.AdamW(m.parameters(), lr=LR), m, **SETTINGS), cut)  # type: ignore[arg-type]


@pytest.mark.parametrize("cut", [6, 8])
def test_state_dict_resumes_bit_for_bit(cut: int) -> None:
    """Cut mid-period (after step 6) and right after an outer step (step 8), with a non-zero accumulator."""
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
        ("chunk", "ValueError", "Invalid chunk"),
        ("bits", "ValueError", "Invalid bits"),
        ("decay", "ValueError", "Invalid decay"),
        ("outer-lr", "ValueError", "Invalid outer_lr"),
        ("clip", "ValueError", "Invalid max_grad_norm"),
    ],
)
def test_bad_input_raises_on_every_rank(case: str, kind: str, words: str) -> None:
    for r in run_ranks(bad, 2, "SparseLoCo", case, timeout=60):
        assert r.startswith(kind) and words in r, r


def test_a_bad_argument_on_one_rank_raises_on_both() -> None:
    res = run_ranks(bad, 2, "SparseLoCo", "one-rank-chunk", timeout=60)
    assert "Invalid chunk" in res[1]
    assert res[0].startswith("ValueError") and "another rank rejected" in res[0]


@pytest.mark.parametrize(("density", "ws"), [(0.1, 4), (0.01, 4), (0.01, 2), (0.001, 4), (0.1, 2)])
def test_the_density_plan_sends_density_times_the_dense_bytes(density: float, ws: int) -> None:
    from optim.optimizers.sparseloco import sparseloco_plan

    n = 26122  # the digits MLP of the convergence suite
    plan = sparseloco_plan(density, n, ws)
    dense = 2 * (ws - 1) / ws * 4 * n  # ring all_reduce of the fp32 model
    ratio = plan.wire_bytes_per_step(ws) / dense
    assert (plan.chunks, plan.chunk, plan.index_bits) == (7, 3732, 12)
    assert density * 0.9 < ratio <= density, (plan, ratio)
    if density <= 0.001:
        assert plan.period > 1 and plan.k <= round(0.03 * plan.chunk)


def test_indices_pack_into_their_width_and_back() -> None:
    from optim.optimizers.sparseloco import pack_indices, unpack_indices

    idx = torch.tensor([0, 4095, 17, 2048, 1, 4094, 3000])
    packed = pack_indices(idx, 12)
    assert packed.dtype == torch.uint8 and packed.numel() == 11  # ceil(7 * 12 / 8)
    assert torch.equal(unpack_indices(packed, 7, 12), idx)
