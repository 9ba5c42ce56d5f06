"""CodedGradients (any torch optimizer on the ranks' average gradient in low-bit codes) on spawned gloo ranks.

* Every step's parameters equal, bit for bit, those of the ranks simulated in
  one process (warm-up, then the codes of every rank's gradient plus its
  residual, the owners' average plus their residual in the gather codes).
* The replicas stay one model; wire bytes per step are what the codes cost.
* Error feedback loses nothing: the steps' decoded averages sum to the true
  averages' sum less what the residuals hold.
* State dicts resume bit for bit, also on another world size; bad input raises on every rank.
* The train job's ``coded-adams`` is AdamS on the same coded average, bit for bit.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from optim.apps.train_job.job_config import TrainConfig, build_optimizer
from sparsecomm.quantized import Quantizer
from tests.dist.harness import build_outcome, case_on_rank, run_ranks
from tests.dist.test_local import _loss, _model
from tests.dist.wrapped import resumed_run

pytestmark = pytest.mark.dist

STEPS, WARM = 8, 2

CODED_ADAMS = TrainConfig(optimizer="coded-adams", density=0.1, sparse_warmup_steps=WARM, lr=0.05, grad_clip=0.0)
"""The train job's AdamS inside CodedGradients, unclipped (the simulation does not clip)."""


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def _grad(model: torch.nn.Module, padded: int) -> torch.Tensor:
    g = torch.nn.utils.parameters_to_vector([p.grad for p in model.parameters()])  # type: ignore[misc]
    return torch.cat([g, torch.zeros(padded - g.numel())])


def _adam_scale(model: torch.nn.Module, inner: torch.optim.AdamW, padded: int) -> torch.Tensor:
    """AdamW's denominator per position, floored at 1% of each tensor's mean (1 without state, in the padding)."""
    parts = []
    for p in model.parameters():
        st = inner.state[p]
        d = torch.div(st["exp_avg_sq"], 1.0 - 0.999 ** float(st["step"])).sqrt_().add_(1e-8)
        parts.append(d.clamp_(min=float(d.mean()) * 0.01).flatten())
    d = torch.cat(parts)
    return torch.cat([d, torch.ones(padded - d.numel())])


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _simulate(
    ws: int, bits: tuple[int, int], adam: bool = True, make_inner: Callable[[torch.nn.Module], Any] = _adamw
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The model after every step and the true average gradient of every step, all in this process."""
    send, gather = Quantizer(bits=bits[0], block=64), Quantizer(bits=bits[1], block=128)
    model = _model()
    inner = make_inner(model)
    n = _flat(model).numel()
    chunk = math.ceil(n / ws)
    residual = [torch.zeros(chunk * ws) for _ in range(ws)]
    own = [torch.zeros(chunk) for _ in range(ws)]
    flats, truth = [], []
    for t in range(STEPS):
        grads = []
        for r in range(ws):
            model.zero_grad()
            _loss(model, r, t).backward()
            grads.append(_grad(model, chunk * ws))
        truth.append(sum(grads) / ws)
        if t < WARM:
            avg = sum(grads) / ws
        else:
            scale = _adam_scale(model, inner, chunk * ws) if adam else torch.ones(chunk * ws)
            decoded = []
            for r in range(ws):
                x = grads[r] + residual[r]
                if adam:
                    x /= scale
                d = torch.cat([send.encode(x[c * chunk : (c + 1) * chunk])[1] for c in range(ws)])
                residual[r] = x - d
                if adam:
                    residual[r] *= scale
                residual[r][n:] = 0.0  # the padding's
                decoded.append(d)
            parts = []
            for c in range(ws):
                a = torch.zeros(chunk)
                for r in range(ws):
                    a += decoded[r][c * chunk : (c + 1) * chunk]
                a /= ws
                own_scale = scale[c * chunk : (c + 1) * chunk]
                a += own[c] / own_scale if adam else own[c]
                dec = gather.encode(a)[1]
                own[c] = a - dec
                if adam:
                    own[c] *= own_scale
                own[c][max(0, n - c * chunk) :] = 0.0
                parts.append(dec)
            avg = torch.cat(parts)
            if adam:
                avg *= scale
        off = 0
        for p in model.parameters():
            p.grad = avg[off : off + p.numel()].view(p.shape).clone()
            off += p.numel()
        inner.step()
        flats.append(_flat(model))
    return flats, truth


def _run(rank: int, ws: int, bits: tuple[int, int], adam: bool = True) -> dict[str, Any]:
    from optim import CodedGradients

    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    opt = CodedGradients(inner, model, bits=bits, warmup_steps=WARM, precondition="adam" if adam else "none")
    stats = opt.communicator.stats
    flats, sent, used = [], [], []
    for t in range(STEPS):
        before = stats.as_dict().get("coded_gradients", {"bytes_sent": 0})["bytes_sent"]
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
        sent.append(stats.as_dict().get("coded_gradients", {"bytes_sent": 0})["bytes_sent"] - before)
        flats.append(_flat(model).tolist())
        used.append(_grad(model, opt.bucket.padded_numel).tolist())
    state = opt.state_dict()["coded"]
    return {
        "flats": flats,
        "sent": sent,
        "used": used,
        "residual": state["residual"].tolist(),
        "own": state["own_residual"].tolist(),
        "chunk": opt.bucket.shard_size,
    }


@pytest.mark.parametrize(("bits", "adam"), [((2, 4), True), ((2, 4), False), ((1, 8), True)])
def test_every_step_is_the_ranks_simulated_in_one_process_bit_for_bit(bits: tuple[int, int], adam: bool) -> None:
    ws = 2
    res = run_ranks(_run, ws, bits, adam, timeout=60)
    ref, _ = _simulate(ws, bits, adam)
    for t in range(STEPS):
        assert res[0]["flats"][t] == res[1]["flats"][t], f"step {t}: the replicas differ"
        assert torch.equal(torch.tensor(res[0]["flats"][t]), ref[t]), f"step {t}"
    send, gather = Quantizer(bits=bits[0], block=64), Quantizer(bits=bits[1], block=128)
    chunk = res[0]["chunk"]
    for t, b in enumerate(res[0]["sent"]):  # one chunk to the other rank each way
        assert b == (0 if t < WARM else send.encoded_bytes(chunk) + gather.encoded_bytes(chunk)), t


def _train_job_adams(rank: int, ws: int) -> list[list[float]]:
    """The train job's ``coded-adams``: AdamS inside CodedGradients, built from its config."""
    model = _model()
    opt = build_optimizer(CODED_ADAMS, model)
    assert type(opt).__name__ == "CodedGradients" and type(opt.optimizer).__name__ == "AdamS"  # type: ignore[attr-defined]
    flats = []
    for t in range(STEPS):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
        flats.append(_flat(model).tolist())
    return flats


def _adams(model: torch.nn.Module) -> torch.optim.Optimizer:
    from optim import AdamS

    c = CODED_ADAMS
    return AdamS(model.parameters(), lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay)


def test_the_train_jobs_coded_adams_is_adams_on_the_coded_average() -> None:
    """AdamS (no Adam denominator to precondition by: the raw gradient in codes), bit for bit."""
    ws = 2
    res = run_ranks(_train_job_adams, ws, timeout=60)
    ref, _ = _simulate(ws, (2, 4), adam=False, make_inner=_adams)  # density 0.1: 2-bit codes out, 4-bit back
    for t in range(STEPS):
        assert res[0][t] == res[1][t], f"step {t}: the replicas differ"
        assert torch.equal(torch.tensor(res[0][t]), ref[t]), f"step {t}"
    assert CODED_ADAMS.optimizer_config()["class"] == "optim.CodedGradients(optim.AdamS)"


@pytest.mark.parametrize("adam", [True, False])
def test_error_feedback_loses_nothing(adam: bool) -> None:
    """Summed over the coded steps, the averages the optimizer stepped on equal the true averages less what the
    residuals still hold (the ranks' mean residual and the owners' residuals), in the gradient's own units also
    where the codes carried it divided by Adam's denominator."""
    ws = 3
    res = run_ranks(_run, ws, (2, 4), adam, timeout=60)
    _, truth = _simulate(ws, (2, 4), adam)
    used = torch.tensor(res[0]["used"][WARM:], dtype=torch.float64).sum(0)
    true = torch.stack(truth[WARM:]).double().sum(0)
    held = sum(torch.tensor(r["residual"], dtype=torch.float64) for r in res) / ws
    held = held + torch.cat([torch.tensor(r["own"], dtype=torch.float64) for r in res])
    n = len(_flat(_model()))  # the padding's residual is never stepped on
    gap = (used + held - true)[:n]
    assert float(gap.abs().max()) < 1e-5, float(gap.abs().max())
    assert float(held[:n].abs().max()) > 1e-3  # the codes did drop something


def _resume(rank: int, ws: int, cut: int) -> dict[str, Any]:
    from optim import CodedGradients

    def build(model: torch.nn.Module) -> CodedGradients:
        return CodedGradients(torch.optim.AdamW(model.parameters(), lr=0.05), model, warmup_steps=WARM)

    return resumed_run(rank, build, "coded", ("residual", "own_residual"), cut, STEPS)


@pytest.mark.parametrize("cut", [1, 5])
def test_state_dict_resumes_bit_for_bit(cut: int) -> None:
    """Cut in the warm-up (after step 1) and in the coded steps (after step 5, both residuals non-zero)."""
    for r in run_ranks(_resume, 2, cut, timeout=60):
        assert r["same"] and r["step"] == STEPS, r


def _reshard(rank: int, ws: int) -> dict[str, Any]:
    """A state saved by rank 1 of 3 loaded on this rank of 2: its residual whole, the owner's where it owns."""
    from optim import CodedGradients

    model = _model()
    opt = CodedGradients(torch.optim.AdamW(model.parameters(), lr=0.05), model)
    b = opt.bucket
    old_chunk = math.ceil(b.numel / 3)
    saved = copy.deepcopy(opt.state_dict())
    saved["coded"].update(
        rank=1,
        world_size=3,
        residual=torch.arange(3 * old_chunk, dtype=torch.float32) + 1,
        own_residual=torch.arange(old_chunk, dtype=torch.float32) + 1000,
    )
    opt.load_state_dict(saved)
    state = opt.state_dict()["coded"]
    return {"residual": state["residual"].tolist(), "own": state["own_residual"].tolist(), "lo": b.shard_lo}


def test_load_under_another_world_size_keeps_what_it_can() -> None:
    res = run_ranks(_reshard, 2, timeout=60)
    n = len(_flat(_model()))
    old_chunk = math.ceil(n / 3)
    for r in res:
        assert r["residual"][:n] == [float(i + 1) for i in range(n)]
        for i, v in enumerate(r["own"]):
            pos = r["lo"] + i
            held = old_chunk <= pos < min(2 * old_chunk, n)
            assert v == (1000.0 + pos - old_chunk if held else 0.0), (r["lo"], i, v)


BAD: dict[str, dict[str, Any]] = {
    "density": {"density": 0.02},
    "bits": {"bits": (3, 4)},
    "bits-word": {"bits": "wide"},
    "warmup": {"warmup_steps": -1},
    "precondition": {"precondition": "newton"},
    "clip": {"max_grad_norm": -1.0},
}


def _bad(rank: int, ws: int, case: str) -> str:
    import optim

    model = _model()
    inner: object = torch.optim.AdamW(model.parameters(), lr=0.01)
    mine = case_on_rank(case, rank)
    kw = {"density": 0.1 + 0.1 * rank} if mine == "settings-differ" else BAD.get(mine, {})
    if mine == "wrapper":
        inner = optim.LocalOptimizer(inner, model)  # type: ignore[arg-type]
    elif mine == "twice":
        optim.CodedGradients(inner, model)  # type: ignore[arg-type]
    elif mine == "sgd-adam":
        inner, kw = torch.optim.SGD(model.parameters(), lr=0.1), {"precondition": "adam"}
    elif mine == "foreign":
        inner = torch.optim.AdamW([*model.parameters(), torch.nn.Parameter(torch.zeros(3))], lr=0.01)
    return build_outcome(lambda: optim.CodedGradients(inner, model, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("case", "kind", "words"),
    [
        ("wrapper", "TypeError", "synchronizes the ranks itself"),
        ("twice", "ValueError", "already wrapped"),
        ("foreign", "ValueError", "not the model's"),
        ("density", "ValueError", "at least 0.0371"),
        ("bits", "ValueError", "Invalid bits"),
        ("bits-word", "ValueError", "Invalid bits"),
        ("warmup", "ValueError", "Invalid warmup_steps"),
        ("precondition", "ValueError", "Invalid precondition"),
        ("sgd-adam", "ValueError", "precondition='adam' divides"),
        ("clip", "ValueError", "Invalid max_grad_norm"),
        ("settings-differ", "ValueError", "differ between ranks"),
        ("one-rank-density", "ValueError", ""),
    ],
)
def test_bad_input_raises_on_every_rank(case: str, kind: str, words: str) -> None:
    for r in run_ranks(_bad, 2, case, timeout=60):
        assert r.startswith(kind) and words in r, r


def test_the_densitys_codes() -> None:
    from optim.optimizers.coded_gradients import coded_bits, wire_cost

    assert [coded_bits(d) for d in (0.04, 0.07, 0.1, 0.131, 0.2, 1.0)] == [
        (1, 1),
        (2, 2),
        (2, 4),
        (4, 4),
        (4, 8),
        (8, 8),
    ]
    assert wire_cost(2, 4) == pytest.approx((2.25 + 4.125) / 2 / 32)
    assert all(wire_cost(*coded_bits(d)) <= d for d in (0.04, 0.05, 0.07, 0.1, 0.15, 0.3))
