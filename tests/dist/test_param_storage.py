"""The sharded optimizers keep training whatever happens to the parameters' storage.

Each case trains a tiny embedding + linear-head model on spawned gloo ranks and
does something to its parameters after two steps, the way trainers and users
do: replace the storage (``p.data = ...``, ``torch.utils.swap_tensors``),
load a state dict with ``assign=True`` (new Parameter objects), load one in
place, tie or re-tie the head to the embedding, move or cast the model.

Where the values are kept, the run must be bitwise the run without the
manipulation (a twin model and optimizer in the same process). Where new
values are loaded, training must go on from them exactly as single-process
AdamS does after the same load. Where training cannot go on (a changed dtype,
no gradient at all), every rank raises a clear error before any
communication.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

VOCAB, DIM = 11, 6


def _model(tied: bool, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(VOCAB, DIM), torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, VOCAB))
    if tied:
        m[2].weight = m[0].weight
    return m


def _batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * t + rank)
    return torch.randint(0, VOCAB, (16,), generator=g), torch.randint(0, VOCAB, (16,), generator=g)


def _loss(model: torch.nn.Module, rank: int, t: int) -> torch.Tensor:
    x, y = _batch(rank, t)
    return torch.nn.functional.cross_entropy(model(x), y)


def _live(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _make(kind: str, params: object) -> torch.optim.Optimizer:
    from optim import SCAPE, LocalAdamS, ShardedAdamS, ShardedAdamW

    if kind == "local":
        return LocalAdamS(params, lr=0.05, density=0.5, warmup_steps=1)
    if kind == "adams":
        return ShardedAdamS(params, lr=0.05, weight_decay=0.1)
    if kind == "adamw":
        return ShardedAdamW(params, lr=0.05)
    return SCAPE(params, lr=0.05, density=0.5, warmup_steps=1, mask_delay=1)


def _new_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() * 0.5 + 0.25 for k, v in model.state_dict().items()}


def _manipulate(model: torch.nn.Module, how: str) -> None:
    with torch.no_grad():
        if how == "data_clone":
            for p in model.parameters():
                p.data = p.data.clone()
        elif how == "swap_tensors":
            for p in model.parameters():
                torch.utils.swap_tensors(p, torch.nn.Parameter(p.detach().clone()))
        elif how == "assign_same":
            tied = model[2].weight is model[0].weight
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
            if tied:  # assign=True unties; trainers tie again after loading (HF's tie_weights)
                model[2].weight = model[0].weight
        elif how == "to":
            model.to("cpu")
            model.to(torch.float32)
        elif how == "retie":
            model[2].weight = model[0].weight
        elif how == "assign_new":
            tied = model[2].weight is model[0].weight
            model.load_state_dict({k: v.clone() for k, v in _new_values(model).items()}, assign=True)
            if tied:
                model[2].weight = model[0].weight
        elif how == "load_new":
            model.load_state_dict(_new_values(model))
        elif how == "data_new":
            new = _new_values(model)
            for name, p in model.named_parameters():
                p.data = new[name].clone()
        else:
            raise AssertionError(how)


# ---------------------------------------------------------------------------- values kept: bitwise the twin run
KEEP = ["data_clone", "swap_tensors", "assign_same", "to"]


def _rank_twin(rank: int, ws: int, kind: str, tied: bool) -> dict:
    out: dict = {}
    for how in KEEP:
        a, b = _model(tied), _model(tied)
        oa, ob = _make(kind, a.parameters()), _make(kind, b.parameters())
        same, moved = [], None
        for t in range(6):
            if t == 2:
                _manipulate(a, how)
                moved = [False] * len(_live(a))
            before = _live(a)
            for model, opt in ((a, oa), (b, ob)):
                opt.zero_grad()
                _loss(model, rank, t).backward()
                opt.step()
            same.append(all(torch.equal(x, y) for x, y in zip(_live(a), _live(b), strict=True)))
            if moved is not None:
                moved = [m or not torch.equal(x, y) for m, x, y in zip(moved, before, _live(a), strict=True)]
        out[how] = {"same": same, "moved": moved, "tied": a[2].weight is a[0].weight}
        for opt in (oa, ob):
            getattr(opt, "close", lambda: None)()
    return out


@pytest.mark.parametrize("kind", ["adams", "scape", "adamw", "local"])
@pytest.mark.parametrize("tied", [False, True])
def test_storage_replaced_values_kept_bitwise(kind: str, tied: bool) -> None:
    res = run_ranks(_rank_twin, 2, kind, tied, timeout=180, op_timeout=60)
    for r in res:
        for how, case in r.items():
            assert all(case["same"]), (how, case)
            assert all(case["moved"]), (how, case)  # every live parameter trained after the change
            assert case["tied"] == tied, how


# ---------------------------------------------------------------------------- new values: go on from them
NEW = ["load_new", "assign_new", "data_new", "retie"]


def _rank_new_values(rank: int, ws: int, tied: bool) -> dict:
    from optim import AdamS, ShardedAdamS

    out: dict = {}
    for how in NEW:
        if how == "retie" and tied:
            continue
        a, ref = _model(tied), _model(tied)
        oa = ShardedAdamS(a.parameters(), lr=0.05, weight_decay=0.1)
        oref = AdamS(ref.parameters(), lr=0.05, weight_decay=0.1, foreach=False)
        err = []
        for t in range(6):
            if t == 2:
                _manipulate(a, how)
                _manipulate(ref, how if how == "retie" else "load_new")
            oa.zero_grad()
            _loss(a, rank, t).backward()
            oa.step()
            oref.zero_grad()
            grads = []
            for r in range(ws):  # the average of every rank's gradient, as the sharded step sees it
                ref.zero_grad()
                _loss(ref, r, t).backward()
                grads.append([None if p.grad is None else p.grad.clone() for p in ref.parameters()])
            for i, p in enumerate(ref.parameters()):
                gs = [g[i] for g in grads]
                p.grad = None if gs[0] is None else torch.stack(gs).sum(0) / ws
            oref.step()
            err.append(max((x - y).abs().max().item() for x, y in zip(_live(a), _live(ref), strict=True)))
        out[how] = {"err": err, "tied": a[2].weight is a[0].weight}
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_new_values_are_trained_from(tied: bool) -> None:
    res = run_ranks(_rank_new_values, 2, tied, timeout=180, op_timeout=60)
    for r in res:
        for how, case in r.items():
            assert max(case["err"]) < 1e-5, (how, case["err"])
            assert case["tied"] == (tied or how == "retie")


# ---------------------------------------------------------------------------- cannot go on: clear errors
def _rank_refusals(rank: int, ws: int) -> dict:
    from optim import SCAPE, ShardedAdamS

    def outcome(fn) -> str:
        try:
            fn()
        except (ValueError, RuntimeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    out = {}
    m = _model(False)
    opt = ShardedAdamS(m.named_parameters(), lr=0.05)
    _loss(m, rank, 0).backward()
    opt.step()
    m.to(torch.float64)
    _loss(m, rank, 1).backward()
    out["dtype"] = outcome(opt.step)

    m = _model(False)
    opt = SCAPE(m.parameters(), lr=0.05, density=0.5)
    copy_ = copy.deepcopy(m)  # trained instead of the model the optimizer holds
    _loss(copy_, rank, 0).backward()
    out["no_grad"] = outcome(opt.step)

    m = _model(False)
    opt = ShardedAdamS(m.named_parameters(), lr=0.05)
    m[2].weight = torch.nn.Parameter(torch.zeros(VOCAB + 1, DIM))
    m[0].weight.sum().backward()
    out["shape"] = outcome(opt.step)
    # the group still works afterwards
    m = _model(False)
    opt = ShardedAdamS(m.parameters(), lr=0.05)
    _loss(m, rank, 0).backward()
    opt.step()
    out["after"] = [p.detach().sum().item() for p in m.parameters()]
    return out


def test_changes_that_cannot_be_followed_raise_on_every_rank() -> None:
    res = run_ranks(_rank_refusals, 2, timeout=120, op_timeout=30)
    for r in res:
        assert r["dtype"].startswith("ValueError: parameter 0.weight"), r["dtype"]
        assert "torch.float64" in r["dtype"] and "torch.float32" in r["dtype"]
        assert r["no_grad"].startswith("RuntimeError") and "has a gradient" in r["no_grad"], r["no_grad"]
        assert r["shape"].startswith("ValueError: parameter 2.weight"), r["shape"]
        assert r["after"] == res[0]["after"]
