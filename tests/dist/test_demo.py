"""DeMo (decoupled momentum, the ranks' fast DCT components averaged) on spawned gloo ranks.

* Every step's parameters equal, bit for bit, those of the ranks simulated in
  one process (dense warm-up, then each rank's top-k DCT components of its
  momentum per chunk); the replicas stay one model; wire bytes per step are the plan's.
* The plan fits the density; the fast DCT is the orthonormal DCT-II and its
  inverse; state dicts resume bit for bit; bad input raises on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist.harness import build_outcome, case_on_rank, run_ranks
from tests.dist.test_local import _loss, _model
from tests.dist.wrapped import resumed_run

pytestmark = pytest.mark.dist

STEPS, WARM, DENSITY, BETA, LR = 8, 2, 0.2, 0.9, 0.01


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def _simulate(ws: int) -> list[torch.Tensor]:
    """The model after every step, all in this process."""
    from optim.optimizers.demo import dct, demo_plan, idct

    plan = demo_plan(DENSITY, ws)
    c, k = plan.chunk, plan.k
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=LR, weight_decay=0.1)
    n = _flat(model).numel()
    chunks = -(-n // c)
    mom = [torch.zeros(chunks * c) for _ in range(ws)]
    flats = []
    for t in range(STEPS):
        grads = []
        for r in range(ws):
            model.zero_grad()
            _loss(model, r, t).backward()
            g = torch.nn.utils.parameters_to_vector([p.grad for p in model.parameters()])  # type: ignore[misc]
            grads.append(torch.cat([g, torch.zeros(chunks * c - n)]))
        if t < WARM:
            avg = sum(grads) / ws
            for r in range(ws):
                mom[r] = mom[r] * BETA + avg
            q = mom[0].clone()
            mom = [torch.zeros_like(m) for m in mom]
        else:
            total = torch.zeros(chunks, c)
            for r in range(ws):
                mom[r] = mom[r] * BETA + grads[r]
                spec = dct(mom[r].view(chunks, c))
                idx = torch.topk(spec.abs(), k, dim=1, sorted=False).indices
                sent = torch.zeros_like(spec).scatter_(1, idx, spec.gather(1, idx))
                mom[r] = (mom[r].view(chunks, c) - idct(sent)).view(-1)
                total += sent
            q = idct(total / ws).view(-1)
        step = torch.sign(q[:n])
        off = 0
        for p in model.parameters():
            p.grad = step[off : off + p.numel()].view(p.shape).clone()
            off += p.numel()
        inner.step()
        flats.append(_flat(model))
    return flats


def _run(rank: int, ws: int) -> dict[str, Any]:
    from optim import DeMo

    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=LR, weight_decay=0.1)
    opt = DeMo(inner, model, density=DENSITY, beta=BETA, warmup_steps=WARM)
    stats = opt.communicator.stats
    flats, sent = [], []
    for t in range(STEPS):
        before = stats.as_dict().get("demo", {"bytes_sent": 0})["bytes_sent"]
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
        sent.append(stats.as_dict().get("demo", {"bytes_sent": 0})["bytes_sent"] - before)
        flats.append(_flat(model).tolist())
    return {"flats": flats, "sent": sent, "chunk": opt.plan.chunk, "k": opt.plan.k, "numel": opt.bucket.numel}


@pytest.mark.parametrize("ws", [1, 2])
def test_every_step_is_the_ranks_simulated_in_one_process(ws: int) -> None:
    res = run_ranks(_run, ws, timeout=60)
    ref = _simulate(ws)
    for t in range(STEPS):
        assert all(r["flats"][t] == res[0]["flats"][t] for r in res), f"step {t}: the replicas differ"
        assert torch.equal(torch.tensor(res[0]["flats"][t]), ref[t]), f"step {t}"
    chunks = -(-res[0]["numel"] // res[0]["chunk"])
    width = (res[0]["chunk"] - 1).bit_length()
    payload = chunks * res[0]["k"] * 4 + -(-chunks * res[0]["k"] * width // 8)
    for t, b in enumerate(res[0]["sent"][WARM:]):  # one all_gather of values and positions to the other rank
        assert b == payload * (ws - 1), t


@pytest.mark.parametrize("ws", [2, 4, 8])
@pytest.mark.parametrize("density", [0.1, 0.01, 0.001, 0.5])
def test_the_plan_fills_the_density_best(density: float, ws: int) -> None:
    from optim.optimizers.demo import MAX_CHUNK, MIN_CHUNK, DeMoPlan, demo_plan

    if DeMoPlan(chunk=MAX_CHUNK, k=1).cost(ws) > density:  # not one component of the longest chunk fits
        with pytest.raises(ValueError, match="too small for DeMo"):
            demo_plan(density, ws)
        return
    plan = demo_plan(density, ws)
    assert plan.cost(ws) <= density and plan.k >= 1
    assert MIN_CHUNK <= plan.chunk <= MAX_CHUNK
    chunk = MIN_CHUNK
    while chunk <= MAX_CHUNK:  # no other chunk's most components that fit come closer
        for k in range(1, chunk + 1):
            other = DeMoPlan(chunk=chunk, k=k)
            if other.cost(ws) > density:
                break
            assert other.cost(ws) <= plan.cost(ws)
        chunk *= 2


def test_the_plan_at_four_ranks() -> None:
    from optim.optimizers.demo import DeMoPlan, demo_plan

    assert demo_plan(0.1, 4) == DeMoPlan(chunk=1024, k=39)
    assert demo_plan(0.01, 4) == DeMoPlan(chunk=256, k=1)
    assert demo_plan(0.001, 4) == DeMoPlan(chunk=4096, k=1)
    with pytest.raises(ValueError, match="too small for DeMo"):
        demo_plan(0.0005, 4)


def _dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II by its definition, in float64 (rows are the basis)."""
    j = torch.arange(n, dtype=torch.float64)
    c = torch.cos(torch.pi * j.unsqueeze(1) * (j.unsqueeze(0) + 0.5) / n) * (2.0 / n) ** 0.5
    c[0] /= 2.0**0.5
    return c


@pytest.mark.parametrize("n", [2, 4, 64, 1024, 4096])
def test_fast_dct_is_the_orthonormal_dct(n: int) -> None:
    from optim.optimizers.demo import dct, idct

    basis = _dct_matrix(n)
    assert torch.allclose(basis @ basis.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    x = torch.randn(3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    spectrum = dct(x.float()).double()
    assert torch.allclose(spectrum, x @ basis.T, atol=1e-5)  # the DCT-II
    assert torch.allclose(idct(x.float()).double(), x @ basis, atol=1e-5)  # its transpose, the DCT-III
    assert torch.allclose(idct(dct(x.float())).double(), x, atol=1e-5)  # and its inverse
    assert torch.allclose(spectrum[:, 0], x.sum(1) / n**0.5, atol=1e-5)  # the first component is the mean's


def _resume(rank: int, ws: int, cut: int) -> dict[str, Any]:
    from optim import DeMo

    def build(model: torch.nn.Module) -> DeMo:
        return DeMo(torch.optim.SGD(model.parameters(), lr=LR), model, density=DENSITY, warmup_steps=WARM)

    return resumed_run(rank, build, "demo", ("momentum",), cut, STEPS)


@pytest.mark.parametrize("cut", [1, 5])
def test_state_dict_resumes_bit_for_bit(cut: int) -> None:
    for r in run_ranks(_resume, 2, cut, timeout=60):
        assert r["same"] and r["step"] == STEPS, r


BAD: dict[str, dict[str, Any]] = {
    "density": {"density": 1e-7},
    "beta": {"beta": 1.0},
    "sign": {"sign": "yes"},
    "warmup": {"warmup_steps": -1},
    "clip": {"max_grad_norm": -1.0},
}


def _bad(rank: int, ws: int, case: str) -> str:
    import optim

    model = _model()
    inner: object = torch.optim.SGD(model.parameters(), lr=0.01)
    mine = case_on_rank(case, rank)
    kw = {"beta": 0.9 + 0.05 * rank} if mine == "settings-differ" else BAD.get(mine, {})
    if mine == "wrapper":
        inner = optim.TopKGradients(inner, model)  # type: ignore[arg-type]
    elif mine == "twice":
        optim.DeMo(inner, model)  # type: ignore[arg-type]
    return build_outcome(lambda: optim.DeMo(inner, model, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("case", "kind", "words"),
    [
        ("wrapper", "TypeError", "synchronizes the ranks itself"),
        ("twice", "ValueError", "already wrapped"),
        ("density", "ValueError", "too small for DeMo"),
        ("beta", "ValueError", "Invalid beta"),
        ("sign", "ValueError", "Invalid sign"),
        ("warmup", "ValueError", "Invalid warmup_steps"),
        ("clip", "ValueError", "Invalid max_grad_norm"),
        ("settings-differ", "ValueError", "differ between ranks"),
    ],
)
def test_bad_input_raises_on_every_rank(case: str, kind: str, words: str) -> None:
    for r in run_ranks(_bad, 2, case, timeout=60):
        assert r.startswith(kind) and words in r, r
