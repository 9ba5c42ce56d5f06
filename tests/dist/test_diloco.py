"""DiLoCo (any torch optimizer inside, Nesterov SGD outside) on spawned gloo ranks.

* Every step's parameters equal, bit for bit, those of both replicas simulated
  in one process (warm-up, H local AdamW steps, the outer Nesterov step).
* H=1, outer lr 1, no momentum around plain SGD is SGD on the averaged gradient.
* Wire bytes: one dense all_reduce every H steps (half of it in bfloat16).
* State dicts resume bit for bit; bad input raises on every rank.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from optim.optimizers.outer import OuterLoop
from tests.dist.harness import build_outcome, case_on_rank, run_ranks
from tests.dist.test_local import _loss, _model

pytestmark = pytest.mark.dist

STEPS, WARM, H = 10, 2, 3


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]  # type: ignore[misc]


def _simulate(ws: int, lr: float, mu: float) -> list[list[torch.Tensor]]:
    """Every replica's parameters after every step, all in this process: the reference."""
    models = [_model() for _ in range(ws)]
    inners = [torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1) for m in models]
    glob, mom = _flat(models[0]), torch.zeros_like(_flat(models[0]))
    out: list[list[torch.Tensor]] = []
    for t in range(STEPS):
        for r, m in enumerate(models):
            m.zero_grad()
            _loss(m, r, t).backward()
        if t < WARM:
            avg = [sum(gs) / ws for gs in zip(*(_grads(m) for m in models), strict=True)]
            for m in models:
                for p, g in zip(m.parameters(), avg, strict=True):
                    p.grad = g.clone()
        for inner in inners:
            inner.step()
        if t >= WARM and (t + 1 - WARM) % H == 0:
            delta = sum(glob - _flat(m) for m in models) / ws
            mom.mul_(mu).add_(delta)
            glob = glob.sub(delta.add(mom, alpha=mu), alpha=lr)  # glob - lr * (delta + mu * mom), as torch's SGD
            for m in models:
                torch.nn.utils.vector_to_parameters(glob.clone(), m.parameters())
        elif t < WARM:
            glob = _flat(models[0])
        out.append([_flat(m) for m in models])
    return out


def _run(rank: int, ws: int, wire: str) -> dict:
    from optim import DiLoCo

    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    opt = DiLoCo(inner, model, period=H, warmup_steps=WARM, wire_dtype=getattr(torch, wire))
    stats = opt.communicator.stats
    flats, sent, synced = [], [], []
    for t in range(STEPS):
        before = stats.as_dict().get("diloco", {"bytes_sent": 0})["bytes_sent"]
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
        sent.append(stats.as_dict().get("diloco", {"bytes_sent": 0})["bytes_sent"] - before)
        flats.append(_flat(model).tolist())
        synced.append(opt.in_sync())
    avg_calls = stats.as_dict().get("average", {"calls": 0})["calls"]
    with opt.averaged():
        avg = _flat(model).tolist()
    own = _flat(model).tolist()
    opt.average_params()
    return {
        "flats": flats,
        "sent": sent,
        "synced": synced,
        "avg": avg,
        "own": own,
        "final": _flat(model).tolist(),
        "global": opt.global_params[: opt.bucket.numel].tolist(),
        "avg_calls": stats.as_dict()["average"]["calls"] - avg_calls,
        "numel": opt.bucket.numel,
    }


def test_diloco_is_its_two_replicas_simulated_in_one_process_bit_for_bit() -> None:
    res = run_ranks(_run, 2, "float32", timeout=60)
    ref = _simulate(2, 0.7, 0.9)
    for t in range(STEPS):
        for r in range(2):
            assert torch.equal(torch.tensor(res[r]["flats"][t]), ref[t][r]), f"step {t} rank {r}"
    # the replicas: one in the warm-up and after each outer step (steps 5, 8), apart between
    for t in range(STEPS):
        same = res[0]["flats"][t] == res[1]["flats"][t]
        assert same == res[0]["synced"][t] == (t < WARM or (t + 1 - WARM) % H == 0), t
    assert torch.allclose(torch.tensor(res[0]["avg"]), (torch.tensor(res[0]["own"]) + torch.tensor(res[1]["own"])) / 2)
    assert res[0]["final"] == res[1]["final"] == res[0]["global"] == res[1]["global"]
    assert res[0]["avg_calls"] == 2  # averaged() and average_params() mid-period: one all_reduce each


@pytest.mark.parametrize(("wire", "size"), [("float32", 4), ("bfloat16", 2)])
def test_one_dense_all_reduce_every_period(wire: str, size: int) -> None:
    res = run_ranks(_run, 2, wire, timeout=60)
    n = res[0]["numel"]
    for t, b in enumerate(res[0]["sent"]):
        outer = t >= WARM and (t + 1 - WARM) % H == 0
        assert b == (size * n if outer else 0), t  # ring all_reduce of 2 ranks: 2 (P-1)/P * bytes
    if wire == "bfloat16":
        assert res[0]["final"] == res[1]["final"]


def _sgd(rank: int, ws: int) -> dict:
    from optim import DiLoCo

    model, ref = _model(), _model()
    opt = DiLoCo(
        torch.optim.SGD(model.parameters(), lr=0.1), model, period=1, outer_lr=1.0, outer_momentum=0.0, warmup_steps=0
    )
    dense = torch.optim.SGD(ref.parameters(), lr=0.1)
    for t in range(6):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
        dense.zero_grad()
        grads = []
        for r in range(ws):
            ref.zero_grad()
            _loss(ref, r, t).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])  # type: ignore[union-attr]
        for p, *gs in zip(ref.parameters(), *grads, strict=True):
            p.grad = sum(gs) / ws
        dense.step()
    return {"diff": float((_flat(model) - _flat(ref)).abs().max())}


def test_period_one_without_momentum_is_sgd_on_the_averaged_gradient() -> None:
    for r in run_ranks(_sgd, 2, timeout=60):
        assert r["diff"] < 1e-6, r


def resumes(rank: int, build: Callable[[torch.nn.Module], OuterLoop], cut: int) -> bool:
    """Run STEPS steps; again with the state saved after step ``cut`` loaded into a new optimizer: the same end?"""
    runs = []
    for resumed in (False, True):
        model = _model()
        opt = build(model)
        saved: dict = {}
        for t in range(STEPS):
            if resumed and t == cut:
                model = _model(seed=7)  # other values: the load must bring everything back
                opt = build(model)
                with torch.no_grad():
                    for p, v in zip(model.parameters(), saved["params"], strict=True):
                        p.copy_(v)
                opt.load_state_dict(saved["state"])
            opt.zero_grad()
            _loss(model, rank, t).backward()
            opt.step()
            if t == cut - 1:
                saved = {
                    "params": [p.detach().clone() for p in model.parameters()],
                    "state": copy.deepcopy(opt.state_dict()),
                }
        runs.append((_flat(model).tolist(), opt.state_dict()["outer"]))
    (a, sa), (b, sb) = runs
    return (
        a == b
        and sa.keys() == sb.keys()
        and all(torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor))
    )


def _resume(rank: int, ws: int, cut: int) -> bool:
    from optim import DiLoCo

    return resumes(
        rank, lambda m: DiLoCo(torch.optim.AdamW(m.parameters(), lr=0.05), m, period=H, warmup_steps=WARM), cut
    )


@pytest.mark.parametrize("cut", [4, 5])
def test_state_dict_resumes_bit_for_bit(cut: int) -> None:
    """Cut mid-period (after step 4) and right after an outer step (step 5, with momentum)."""
    assert all(run_ranks(_resume, 2, cut, timeout=60))


BAD_SETTINGS: dict[str, dict[str, Any]] = {
    "period": {"period": 0},
    "outer-lr": {"outer_lr": 0.0},
    "momentum": {"outer_momentum": 1.0},
    "wire": {"wire_dtype": torch.float16},
    "warmup": {"warmup_steps": -1},
    "clip": {"max_grad_norm": -1.0},
    "both": {"period": 3, "density": 0.1},
    "density": {"density": 1.5},
    "fraction": {"fraction": 0.0},
    "chunk": {"chunk": 1},
    "bits": {"bits": 3},
    "decay": {"decay": 1.0},
}


def bad(rank: int, ws: int, cls_name: str, case: str) -> str:
    """Build ``optim.<cls_name>`` with the bad input of ``case`` (``one-rank-CASE``: on rank 1 only); the error."""
    import optim

    cls = getattr(optim, cls_name)
    model = _model()
    inner: object = torch.optim.AdamW(model.parameters(), lr=0.01)
    mine = case_on_rank(case, rank)
    kw = {"period": 3 + rank} if mine == "settings-differ" else BAD_SETTINGS.get(mine, {})
    if mine == "wrapper":
        inner = optim.DiLoCo(inner, model)  # type: ignore[arg-type]
    elif mine == "local":
        inner = optim.LocalOptimizer(inner, model)  # type: ignore[arg-type]
    elif mine == "twice":
        cls(inner, model)
    elif mine == "foreign":
        inner = torch.optim.AdamW([*model.parameters(), torch.nn.Parameter(torch.zeros(3))], lr=0.01)
    elif mine == "missing":
        inner = torch.optim.AdamW(list(model.parameters())[:2], lr=0.01)
    return build_outcome(lambda: cls(inner, model, **kw))


@pytest.mark.parametrize(
    ("case", "kind", "words"),
    [
        ("wrapper", "TypeError", "synchronizes the ranks itself"),
        ("local", "TypeError", "synchronizes the ranks itself"),
        ("twice", "ValueError", "already wrapped"),
        ("foreign", "ValueError", "not the model's"),
        ("period", "ValueError", "Invalid period"),
        ("outer-lr", "ValueError", "Invalid outer_lr"),
        ("momentum", "ValueError", "Invalid outer_momentum"),
        ("wire", "ValueError", "Invalid wire_dtype"),
        ("warmup", "ValueError", "Invalid warmup_steps"),
        ("settings-differ", "ValueError", "differ between ranks"),
    ],
)
def test_bad_input_raises_on_every_rank(case: str, kind: str, words: str) -> None:
    for r in run_ranks(bad, 2, "DiLoCo", case, timeout=60):
        assert r.startswith(kind) and words in r, r


def test_a_bad_argument_on_one_rank_raises_on_both() -> None:
    res = run_ranks(bad, 2, "DiLoCo", "one-rank-period", timeout=60)
    assert "Invalid period" in res[1]
    assert res[0].startswith("ValueError") and "another rank rejected" in res[0]


def test_equal_bytes_period() -> None:
    from optim.optimizers.diloco import diloco_period

    assert [diloco_period(d) for d in (1.0, 0.1, 0.01, 0.3)] == [1, 10, 100, 3]
    assert diloco_period(0.1, torch.bfloat16) == 5
    with pytest.raises(ValueError, match="density"):
        diloco_period(0.0)


def _from_config(rank: int, ws: int) -> list[tuple[str, int, int]]:
    from optim.apps.train_job.job_config import TrainConfig, build_optimizer

    out = []
    for name in ("diloco-adamw", "sparseloco-adamw"):
        for density in (0.1, 0.01):
            opt = build_optimizer(TrainConfig(optimizer=name, density=density, sparse_warmup_steps=3), _model())
            out.append((type(opt).__name__, opt.period, opt.warmup_steps))  # type: ignore[attr-defined]
    return out


def test_the_train_job_builds_both_at_the_densitys_bytes() -> None:
    """DiLoCo: H = 1/density. SparseLoCo on 103 parameters and 2 ranks: 0.01 is 4.12 payload bytes per step, and 3% of
    the one chunk (3 positions) 21 bytes: H = 5, then k = 2 (20 bytes)."""
    res = run_ranks(_from_config, 2, timeout=60)
    assert res[0] == [("DiLoCo", 10, 3), ("DiLoCo", 100, 3), ("SparseLoCo", 1, 3), ("SparseLoCo", 5, 3)]
