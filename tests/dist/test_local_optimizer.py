"""LocalOptimizer (any torch optimizer + the replicas' averaging) on spawned gloo ranks.

* Wrapping :class:`optim.AdamS` gives :class:`optim.LocalAdamS` (plain
  normalizer, no moment averaging) bit for bit: every step's parameters, the
  wire bytes and ``averaged()``, for each schedule, encoding, window order and
  with ``overlap``.
* A wrapped :class:`torch.optim.AdamW`: identical replicas through the
  warm-up, identical anchors after, state dicts that resume bit for bit (also
  with ``overlap`` and in another layout), one model after ``average_params()``.
* Bad input raises the same kind of error on every rank before any communication
  but the one agreement.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from tests.dist.harness import build_outcome, case_on_rank, run_ranks
from tests.dist.test_local import STEPS, WARM, _loss, _model

pytestmark = pytest.mark.dist


def _flat(model: torch.nn.Module) -> list[float]:
    """The parameters as a list (tensors do not cross the rank processes' pipes)."""
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().tolist()


def _t(x: list[float]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


AVERAGING = {
    "codes-0.01": dict(density=0.01),
    "codes-0.1": dict(density=0.1),
    "int4-periodic": dict(density=0.05, schedule="periodic", wire_bits=4),
    "bf16": dict(density=0.1, wire_bits=None),
    "f32-spread": dict(density=0.1, wire_dtype=torch.float32, window_order="spread"),
    "overlap": dict(density=0.1, overlap=True),
}
MOMENT = {
    "codes-0.1-moment": dict(density=0.1, average_moment=True),
    "overlap-moment": dict(density=0.1, overlap=True, average_moment=True),
    "codes-0.1-clip": dict(density=0.1, max_grad_norm=0.05),
}
"""Settings tested on the wrapped Adam(W) only (``average_moment``; clipping by the average's norm, which
LocalAdamS does not do)."""


def _build(kind: str, model: torch.nn.Module, averaging: str) -> torch.optim.Optimizer:
    from optim import AdamS, LocalAdamS, LocalOptimizer

    kw = {**AVERAGING, **MOMENT}[averaging]
    if kind == "local-adams":
        return LocalAdamS(
            model.parameters(),
            lr=0.05,
            weight_decay=0.1,
            warmup_steps=WARM,
            normalizer="local",
            average_moment=False,
            **kw,
        )
    if kind == "adams":
        inner: torch.optim.Optimizer = AdamS(model.parameters(), lr=0.05, weight_decay=0.1, foreach=False)
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    return LocalOptimizer(inner, model, warmup_steps=WARM, **kw)


def _run(rank: int, ws: int, kind: str, averaging: str) -> dict:
    model = _model()
    opt = _build(kind, model, averaging)
    stats = opt.communicator.stats  # type: ignore[attr-defined]
    flats, sent = [], []
    for t in range(STEPS):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
        opt.wait_in_flight()  # type: ignore[attr-defined]
        flats.append(_flat(model))
        sent.append(sum(d["bytes_sent"] for op, d in stats.as_dict().items() if op != "param_check"))
    with opt.averaged():  # type: ignore[attr-defined]
        avg = _flat(model)
    own = _flat(model)
    opt.average_params()  # type: ignore[attr-defined]
    opt.close()  # type: ignore[attr-defined]
    anchor = opt.anchor  # type: ignore[attr-defined]
    return {
        "flats": flats,
        "sent": sent,
        "avg": avg,
        "own": own,
        "final": _flat(model),
        "anchor": None if anchor is None else anchor.tolist(),
    }


@pytest.mark.parametrize("averaging", list(AVERAGING))
def test_wrapped_adams_is_local_adams_bit_for_bit(averaging: str) -> None:
    wrapped = run_ranks(_run, 2, "adams", averaging, timeout=120)
    local = run_ranks(_run, 2, "local-adams", averaging, timeout=120)
    for w, loc in zip(wrapped, local, strict=True):
        for t, (a, b) in enumerate(zip(w["flats"], loc["flats"], strict=True)):
            assert a == b, f"{averaging}: step {t} differs"
        assert w["sent"] == loc["sent"]
        assert w["avg"] == loc["avg"] and w["final"] == loc["final"]
    # the replicas differ between averages, and the warm-up and the last average make them one
    assert wrapped[0]["own"] != wrapped[1]["own"]
    assert wrapped[0]["final"] == wrapped[1]["final"]
    assert wrapped[0]["avg"] == wrapped[0]["final"] or AVERAGING[averaging].get("overlap")


def test_wrapped_adamw_replicas_start_as_one_and_share_their_anchors() -> None:
    res = run_ranks(_run, 2, "adamw", "codes-0.1", timeout=120)
    for t in range(WARM):
        assert res[0]["flats"][t] == res[1]["flats"][t]
    assert res[0]["flats"][-1] != res[1]["flats"][-1]
    assert res[0]["anchor"] == res[1]["anchor"]
    assert res[0]["final"] == res[1]["final"]
    assert torch.allclose(_t(res[0]["final"]), (_t(res[0]["own"]) + _t(res[1]["own"])) / 2, atol=1e-6)
    # the codes' bytes per local step: every step past the warm-up sends the same amount, far below dense
    per_step = [b - a for a, b in zip(res[0]["sent"][WARM:], res[0]["sent"][WARM + 1 :], strict=False)]
    dense = res[0]["sent"][0]
    assert len(set(per_step)) == 1 and 0 < per_step[0] < dense


def _moments(rank: int, ws: int, average_moment: bool) -> dict:
    from optim import LocalOptimizer

    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    opt = LocalOptimizer(inner, model, warmup_steps=WARM, density=0.1, average_moment=average_moment)
    for t in range(STEPS):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
    m = torch.cat([inner.state[p]["exp_avg"].reshape(-1) for p in model.parameters()])
    local = opt.state_dict()["local"]
    opt.close()
    return {
        "on": opt.averaging.average_moment,
        "m": m.tolist(),
        "m_anchor": local["exp_avg_anchor"].tolist() if "exp_avg_anchor" in local else None,
    }


def test_average_moment_averages_the_wrapped_adamws_first_moment() -> None:
    """With ``average_moment`` the window carries AdamW's exp_avg too: the replicas' moments stay close."""
    on = run_ranks(_moments, 2, True, timeout=120)
    off = run_ranks(_moments, 2, False, timeout=120)
    assert on[0]["on"] and not off[0]["on"]
    assert on[0]["m_anchor"] == on[1]["m_anchor"] and off[0]["m_anchor"] is None
    spread_on = (_t(on[0]["m"]) - _t(on[1]["m"])).norm()
    spread_off = (_t(off[0]["m"]) - _t(off[1]["m"])).norm()
    assert 0 < spread_on < 0.5 * spread_off


def _resume(rank: int, ws: int, averaging: str, cut: int) -> dict:
    """Run STEPS steps; and again with the state saved after step ``cut`` loaded into a new optimizer."""
    runs = []
    for resumed in (False, True):
        model = _model()
        opt = _build("adamw", model, averaging)
        saved = None
        for t in range(STEPS):
            if resumed and t == cut:
                opt.wait_in_flight()  # type: ignore[attr-defined]  # its bytes moved on this transport: then drop it
                opt.abandon()  # type: ignore[attr-defined]
                model = _model(seed=7)  # other values: the load must bring everything back
                opt = _build("adamw", model, averaging)
                with torch.no_grad():
                    for p, v in zip(model.parameters(), saved["params"], strict=True):
                        p.copy_(v)
                opt.load_state_dict(saved["state"])
                assert opt.param_groups is opt.optimizer.param_groups  # type: ignore[attr-defined]
            for group in opt.param_groups:  # a schedule drives the wrapped optimizer, also after a load
                group["lr"] = 0.05 / (1 + t)
            opt.zero_grad()
            _loss(model, rank, t).backward()
            opt.step()
            if t == cut - 1:
                saved = {
                    "params": [p.detach().clone() for p in model.parameters()],
                    "state": copy.deepcopy(opt.state_dict()),
                }
        with opt.averaged():  # type: ignore[attr-defined]
            avg = _flat(model)
        opt.close()  # type: ignore[attr-defined]
        runs.append((_flat(model), avg))
    return {"equal": runs[0] == runs[1]}


@pytest.mark.parametrize(
    "averaging", ["codes-0.01", "codes-0.1", "overlap", "codes-0.1-moment", "overlap-moment", "bf16", "codes-0.1-clip"]
)
def test_state_dict_resumes_bit_for_bit(averaging: str) -> None:
    res = run_ranks(_resume, 2, averaging, 5, timeout=120)
    assert all(r["equal"] for r in res)


def _other_layout(rank: int, ws: int, data: bytes | None) -> dict | bytes:
    model = _model()
    opt = _build("adamw", model, "codes-0.01")
    if data is None:
        for t in range(5):
            opt.zero_grad()
            _loss(model, rank, t).backward()
            opt.step()
        saved = {"params": [p.detach().clone() for p in model.parameters()], "state": copy.deepcopy(opt.state_dict())}
        buf = io.BytesIO()
        torch.save(saved, buf)
        return buf.getvalue()  # bytes, not tensors, cross the pipe
    saved = torch.load(io.BytesIO(data))
    with torch.no_grad():
        for p, v in zip(model.parameters(), saved["params"], strict=True):
            p.copy_(v)
    opt.load_state_dict(saved["state"])
    local = opt.state_dict()["local"]
    opt.zero_grad()
    _loss(model, rank, 5).backward()
    opt.step()
    return {"residual": local["wire_residual"].tolist(), "anchor": local["anchor"].tolist(), "step": local["step"]}


def test_state_dict_of_two_ranks_loads_on_one() -> None:
    saved = run_ranks(_other_layout, 2, None, timeout=120)
    res = run_ranks(_other_layout, 1, saved[1], timeout=120)[0]
    old = torch.load(io.BytesIO(saved[1]))["state"]["local"]
    residual, shard = _t(res["residual"]), old["wire_residual"].numel()
    assert res["step"] == 5
    assert torch.equal(_t(res["anchor"]), old["anchor"][: len(res["anchor"])])
    assert old["wire_residual"].any()
    # one rank owns everything now: rank 1's old shard lands where it was, the rest is zero
    assert torch.equal(residual[shard : 2 * shard], old["wire_residual"][: residual.numel() - shard])
    assert not residual[:shard].any()


def _bad(rank: int, ws: int, case: str) -> str:
    from optim import SCAPE, LocalAdamS, LocalOptimizer, ShardedAdamW

    model = _model()
    inner: object = torch.optim.AdamW(model.parameters(), lr=0.01)
    kw: dict = {}
    mine = case_on_rank(case, rank)
    if mine == "sharded":
        inner = ShardedAdamW(model.parameters(), lr=0.01)
    elif mine == "local-adams":
        inner = LocalAdamS(model.parameters(), lr=0.01)
    elif mine == "scape":
        inner = SCAPE(model.parameters(), lr=0.01)
    elif mine == "twice":
        LocalOptimizer(inner, model)  # type: ignore[arg-type]
    elif mine == "wrapper":
        inner = LocalOptimizer(inner, model)  # type: ignore[arg-type]
    elif mine == "foreign":
        inner = torch.optim.AdamW([*model.parameters(), torch.nn.Parameter(torch.zeros(3))], lr=0.01)
    elif mine == "missing":
        inner = torch.optim.AdamW(list(model.parameters())[:2], lr=0.01)
    elif mine == "bf16":
        model = model.to(torch.bfloat16)
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    elif mine == "not-a-model":
        model = "model"  # type: ignore[assignment]
    elif mine == "density":
        kw = {"density": 0.0}
    elif mine == "overlap-values":
        kw = {"overlap": True, "wire_bits": None}
    elif mine == "clip":
        kw = {"max_grad_norm": -1.0}
    elif mine == "debias-sgd":
        inner = torch.optim.SGD(model.parameters(), lr=0.01)
        kw = {"noise": "debias"}
    elif mine == "noise":
        kw = {"noise": "quiet"}
    elif mine == "moment-sgd":
        inner = torch.optim.SGD(model.parameters(), lr=0.01)
        kw = {"average_moment": True, "noise": "keep"}
    elif mine == "moment":
        kw = {"average_moment": "yes"}
    elif mine == "moment-values":
        kw = {"average_moment": True, "wire_bits": None}
    return build_outcome(lambda: LocalOptimizer(inner, model, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("case", "kind", "words"),
    [
        ("sharded", "TypeError", "synchronizes the ranks itself"),
        ("local-adams", "TypeError", "synchronizes the ranks itself"),
        ("scape", "TypeError", "synchronizes the ranks itself"),
        ("wrapper", "TypeError", "synchronizes the ranks itself"),
        ("twice", "ValueError", "already wrapped"),
        ("foreign", "ValueError", "not the model's"),
        ("missing", "ValueError", "not the optimizer's"),
        ("bf16", "ValueError", "fp32"),
        ("not-a-model", "TypeError", "torch.nn.Module"),
        ("density", "ValueError", "density"),
        ("overlap-values", "ValueError", "overlap"),
        ("clip", "ValueError", "max_grad_norm"),
        ("debias-sgd", "ValueError", "noise='debias'"),
        ("noise", "ValueError", "Invalid noise"),
        ("moment-sgd", "ValueError", "exp_avg"),
        ("moment", "ValueError", "Invalid average_moment"),
        ("moment-values", "ValueError", "set wire_bits"),
    ],
)
def test_bad_input_raises_on_every_rank(case: str, kind: str, words: str) -> None:
    res = run_ranks(_bad, 2, case, timeout=60)
    for r in res:
        assert r.startswith(kind) and words in r, r


def test_a_bad_argument_on_one_rank_raises_on_both() -> None:
    res = run_ranks(_bad, 2, "one-rank-foreign", timeout=60)
    assert "not the model's" in res[1]
    assert res[0].startswith("ValueError") and "another rank rejected" in res[0]


def _second_moments(rank: int, ws: int, noise: str) -> dict:
    """AdamW at lr 0 on ``mu + e_rank`` (unit noise per rank), wrapped; and a dense AdamW on the ranks' mean."""
    from optim import LocalOptimizer

    n = 4000
    model = torch.nn.Linear(n, 1, bias=False)
    inner = torch.optim.AdamW(model.parameters(), lr=0.0, betas=(0.9, 0.95), weight_decay=0.0)
    opt = LocalOptimizer(inner, model, density=0.1, warmup_steps=5, noise=noise)
    ref = torch.nn.Parameter(torch.zeros(n))
    dense = torch.optim.AdamW([ref], lr=0.0, betas=(0.9, 0.95), weight_decay=0.0)
    mu = torch.linspace(-1.0, 1.0, n)
    for t in range(200):
        noises = [torch.randn(n, generator=torch.Generator().manual_seed(97 * t + r)) for r in range(ws)]
        model.weight.grad = (mu + noises[rank]).view(1, n)
        opt.step()
        ref.grad = mu + torch.stack(noises).mean(0)
        dense.step()
    v = inner.state[model.weight]["exp_avg_sq"].view(-1)
    return {"local": v.mean().item(), "dense": dense.state[ref]["exp_avg_sq"].mean().item()}


@pytest.mark.parametrize("noise", ["measured", "debias", "keep"])
def test_debias_gives_adamw_the_second_moment_of_the_averaged_gradient(noise: str) -> None:
    """Dense: mean(mu**2) + 1/P = 0.33 + 0.25; one rank's own gradient: 0.33 + 1 (P = 4)."""
    res = run_ranks(_second_moments, 4, noise, timeout=120)
    for r in res:
        if noise != "keep":  # all of this noise is noise across the ranks: measured, all of it comes out
            assert abs(r["local"] / r["dense"] - 1.0) < 0.1, r
        else:
            assert r["local"] / r["dense"] > 2.0, r


def _clipped(rank: int, ws: int) -> dict:
    """Gradients ``mu + e_rank`` (noise 3x the signal per coordinate): the norm each rank clips by after the warm-up."""
    from optim import LocalOptimizer

    n = 4000
    model = torch.nn.Linear(n, 1, bias=False)
    inner = torch.optim.AdamW(model.parameters(), lr=0.0)
    opt = LocalOptimizer(inner, model, density=0.1, warmup_steps=2, max_grad_norm=1.0)
    mu = torch.linspace(-1.0, 1.0, n)
    out = []
    for t in range(40):
        noises = [3.0 * torch.randn(n, generator=torch.Generator().manual_seed(97 * t + r)) for r in range(ws)]
        model.weight.grad = (mu + noises[rank]).view(1, n)
        opt.step()
        mean = (mu + torch.stack(noises).mean(0)).norm().item()
        out.append((opt.last_grad_norm, mean, (mu + noises[rank]).norm().item()))
    return {"norms": out[2:]}


def test_local_steps_clip_by_the_norm_of_the_ranks_average() -> None:
    """Every rank clips by the same norm, the averaged gradient's within the sketch's error, not by its own
    (with P = 4 and this noise a rank's own norm is twice the average's)."""
    res = run_ranks(_clipped, 4, timeout=120)
    ratios = []
    for step in range(len(res[0]["norms"])):
        used = {r["norms"][step][0] for r in res}
        assert len(used) == 1, used  # the same on every rank
        clip, mean, own = res[0]["norms"][step]
        assert own > 1.8 * mean
        ratios.append(clip / mean)
    assert all(0.75 < q < 1.25 for q in ratios), ratios  # the sketch's norm: about 5% standard deviation
    assert abs(sum(ratios) / len(ratios) - 1.0) < 0.05, ratios


def _scheduled(rank: int, ws: int) -> dict:
    from optim import LocalOptimizer

    model = _model()
    opt = LocalOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), model, warmup_steps=1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for t in range(3):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
        sched.step()
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # replaces the wrapped optimizer's param groups
    sched.step()
    opt.close()
    return {"inner": [g["lr"] for g in opt.optimizer.param_groups], "sched": sched.get_last_lr()}


def test_an_lr_scheduler_over_the_wrapper_drives_the_wrapped_optimizer() -> None:
    for r in run_ranks(_scheduled, 2, timeout=60):
        assert r["inner"] == r["sched"] == [pytest.approx(0.1 / 5)]
