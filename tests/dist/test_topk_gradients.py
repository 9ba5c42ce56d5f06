"""TopKGradients (any torch optimizer on the average of every rank's top-k gradient entries) on spawned gloo ranks.

* Every step's parameters equal, bit for bit, those of the ranks simulated in
  one process (warm-up, then every rank's top-k of its gradient plus residual),
  clipped and not; the replicas stay one model; wire bytes per step are ``k``
  values and positions to every other rank.
* Error feedback loses nothing; state dicts resume bit for bit; bad input raises on every rank.
* The train job's ``periodic-adamw`` is DiLoCo whose outer step is the replicas' plain average.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist.harness import build_outcome, case_on_rank, run_ranks
from tests.dist.test_local import _loss, _model
from tests.dist.wrapped import resumed_run

pytestmark = pytest.mark.dist

STEPS, WARM, DENSITY = 8, 2, 0.1


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def _grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector([p.grad for p in model.parameters()]).clone()  # type: ignore[misc]


def _k(n: int, ws: int) -> int:
    return -(-n // (10 * ws))  # ceil(0.1 * n / ws)


def _simulate(ws: int, clip: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The model after every step and the true average gradient of every step, all in this process."""
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    n = _flat(model).numel()
    k = _k(n, ws)
    residual = [torch.zeros(n) for _ in range(ws)]
    flats, truth = [], []
    for t in range(STEPS):
        grads = []
        for r in range(ws):
            model.zero_grad()
            _loss(model, r, t).backward()
            grads.append(_grad(model))
        truth.append(sum(grads) / ws)
        if t < WARM:
            avg = sum(grads) / ws
        else:
            vals, idx = [], []
            for r in range(ws):
                residual[r] += grads[r]
                i = torch.topk(residual[r].abs(), k, sorted=False).indices
                vals.append(residual[r].index_select(0, i))
                idx.append(i)
                residual[r].index_fill_(0, i, 0.0)
            avg = torch.zeros(n).index_add_(0, torch.cat(idx), torch.cat(vals)).div_(ws)
        off = 0
        for p in model.parameters():
            p.grad = avg[off : off + p.numel()].view(p.shape).clone()
            off += p.numel()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
        inner.step()
        flats.append(_flat(model))
    return flats, truth


def _run(rank: int, ws: int, clip: float) -> dict[str, Any]:
    from optim import TopKGradients

    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    opt = TopKGradients(inner, model, density=DENSITY, warmup_steps=WARM, max_grad_norm=clip)
    stats = opt.communicator.stats
    flats, sent, used = [], [], []
    for t in range(STEPS):
        before = stats.as_dict().get("topk", {"bytes_sent": 0})["bytes_sent"]
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
        sent.append(stats.as_dict().get("topk", {"bytes_sent": 0})["bytes_sent"] - before)
        flats.append(_flat(model).tolist())
        used.append(_grad(model).tolist())
    return {"flats": flats, "sent": sent, "used": used, "residual": opt.residual.tolist(), "k": opt.k}


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_every_step_is_the_ranks_simulated_in_one_process_bit_for_bit(clip: float) -> None:
    ws = 2
    res = run_ranks(_run, ws, clip, timeout=60)
    ref, _ = _simulate(ws, clip)
    n = ref[0].numel()
    assert res[0]["k"] == _k(n, ws)
    for t in range(STEPS):
        assert res[0]["flats"][t] == res[1]["flats"][t], f"step {t}: the replicas differ"
        assert torch.equal(torch.tensor(res[0]["flats"][t]), ref[t]), f"step {t}"
    k = res[0]["k"]
    for t, b in enumerate(res[0]["sent"]):  # k fp32 values and k int32 positions to the other rank
        assert b == (0 if t < WARM else 8 * k), t


def test_error_feedback_loses_nothing() -> None:
    """Summed over the sparse steps, the averages stepped on equal the true averages less the mean residual."""
    ws = 3
    res = run_ranks(_run, ws, 0.0, timeout=60)
    _, truth = _simulate(ws, 0.0)
    n = truth[0].numel()
    used = torch.tensor(res[0]["used"][WARM:], dtype=torch.float64).sum(0)
    true = torch.stack(truth[WARM:]).double().sum(0)
    held = sum(torch.tensor(r["residual"][:n], dtype=torch.float64) for r in res) / ws
    gap = used + held - true
    assert float(gap.abs().max()) < 1e-5, float(gap.abs().max())
    assert float(held.abs().max()) > 1e-3  # something is still waiting


def _resume(rank: int, ws: int, cut: int) -> dict[str, Any]:
    from optim import TopKGradients

    def build(model: torch.nn.Module) -> TopKGradients:
        return TopKGradients(torch.optim.AdamW(model.parameters(), lr=0.05), model, density=0.1, warmup_steps=WARM)

    return resumed_run(rank, build, "topk", ("residual",), cut, STEPS)


@pytest.mark.parametrize("cut", [1, 5])
def test_state_dict_resumes_bit_for_bit(cut: int) -> None:
    for r in run_ranks(_resume, 2, cut, timeout=60):
        assert r["same"] and r["step"] == STEPS, r


BAD: dict[str, dict[str, Any]] = {
    "density": {"density": 0.0},
    "density-type": {"density": "dense"},
    "warmup": {"warmup_steps": -1},
    "clip": {"max_grad_norm": -1.0},
}


def _bad(rank: int, ws: int, case: str) -> str:
    import optim

    model = _model()
    inner: object = torch.optim.AdamW(model.parameters(), lr=0.01)
    mine = case_on_rank(case, rank)
    kw = {"density": 0.1 + 0.1 * rank} if mine == "settings-differ" else BAD.get(mine, {})
    if mine == "wrapper":
        inner = optim.CodedGradients(inner, model)  # type: ignore[arg-type]
    elif mine == "twice":
        optim.TopKGradients(inner, model)  # type: ignore[arg-type]
    elif mine == "foreign":
        inner = torch.optim.AdamW([*model.parameters(), torch.nn.Parameter(torch.zeros(3))], lr=0.01)
    return build_outcome(lambda: optim.TopKGradients(inner, model, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("case", "kind", "words"),
    [
        ("wrapper", "TypeError", "synchronizes the ranks itself"),
        ("twice", "ValueError", "already wrapped"),
        ("foreign", "ValueError", "not the model's"),
        ("density", "ValueError", "Invalid density"),
        ("density-type", "ArgumentTypeError", "Invalid density"),
        ("warmup", "ValueError", "Invalid warmup_steps"),
        ("clip", "ValueError", "Invalid max_grad_norm"),
        ("settings-differ", "ValueError", "differ between ranks"),
        ("one-rank-density", "ValueError", ""),
    ],
)
def test_bad_input_raises_on_every_rank(case: str, kind: str, words: str) -> None:
    for r in run_ranks(_bad, 2, case, timeout=60):
        assert r.startswith(kind) and words in r, r


def _periodic(rank: int, ws: int) -> dict[str, Any]:
    """The train job's periodic-adamw over one period beside this rank's AdamW stepping alone."""
    from optim.apps.train_job.job_config import TrainConfig, build_optimizer

    config = TrainConfig(optimizer="periodic-adamw", density=0.25, sparse_warmup_steps=0, lr=0.05)
    model, alone = _model(), _model()
    opt = build_optimizer(config, model)
    groups = [
        {"params": [p for p in alone.parameters() if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in alone.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    inner = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)
    for t in range(4):
        for m, o in ((model, opt), (alone, inner)):
            o.zero_grad()
            _loss(m, rank, t).backward()
            o.step()
        if t < 3:
            assert torch.equal(_flat(model), _flat(alone)), t  # no exchange inside the period
    return {"period": opt.period, "alone": _flat(alone).tolist(), "after": _flat(model).tolist()}  # type: ignore[attr-defined]


def test_periodic_adamw_is_the_replicas_plain_average() -> None:
    res = run_ranks(_periodic, 2, timeout=60)
    mean = (torch.tensor(res[0]["alone"]) + torch.tensor(res[1]["alone"])) / 2
    assert not torch.allclose(torch.tensor(res[0]["alone"]), mean, atol=1e-4)  # the replicas had drifted
    for r in res:
        assert r["period"] == 4
        assert torch.allclose(torch.tensor(r["after"]), mean, atol=1e-6), r
