"""AdamS optimizer (:mod:`optim.optimizers.adams`): five invariants plus the ``torch.optim.Optimizer`` contract.

T1: the first step's closed form (paper form and code form); T2: every step is at
most ``lr * B`` (:func:`optim.optimizers.adams.step_bound`); T3: the normalizer uses ``m_{t-1}``,
not ``m_t``; T4: one state tensor per parameter; T5: a zero gradient with a zero
momentum gives no update.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from optim.optimizers.adams import AdamS, adams_step_, adams_step_foreach_, debiased_adams_step_, step_bound
from optim.optimizers.sharded import squared_norm

B1, B2 = 0.9, 0.95
PAPER_STEP1 = (1 - B1) / math.sqrt(1 - B2)  # 0.4472: m_1 / sqrt(nu_1), m_0 = 0, g = 1
CODE_STEP1 = 1 / math.sqrt(1 - B2)  # 4.4721: the same divided by c_1 = 1 - B1
WRONG_STEP1 = (1 - B1) / math.sqrt(B2 * (1 - B1) ** 2 + (1 - B2))  # 0.4100: nu from m_t^2

HYPER = dict(beta1=B1, beta2=B2, eps=1e-8, weight_decay=0.0)


def _scalar_reference(
    gs: list[float],
    *,
    lr: float,
    eps: float,
    wd: float,
    w0: float,
    bias_correction: bool,
    wrong: bool = False,
) -> list[float]:
    """Hand-written AdamS on Python floats (the update of :mod:`optim.optimizers.adams`); ``wrong`` squares m_t."""
    w, m, out = w0, 0.0, []
    for t, g in enumerate(gs, start=1):
        c = 1 - B1**t if bias_correction else 1.0
        m_new = B1 * m + (1 - B1) * g
        m_nu = m_new if wrong else m
        nu = B2 * (m_nu / c) ** 2 + (1 - B2) * g * g
        w = (1 - lr * wd) * w - lr * (m_new / c) / (math.sqrt(nu) + eps)
        m = m_new
        out.append(w)
    return out


def _official_code_step(
    p: torch.Tensor, exp_avg: torch.Tensor, g: torch.Tensor, step: int, lr: float, wd: float
) -> None:
    """The op sequence of the paper's official code (GitHub ``pku-huzhang/AdamS``), for cross-checking."""
    c = 1 - B1**step
    p.mul_(1 - lr * wd)
    m_hat = exp_avg.div(c)
    denom = (B2 * m_hat * m_hat + (1 - B2) * g * g).sqrt_().add_(HYPER["eps"])
    exp_avg.lerp_(g, 1 - B1)
    p.addcdiv_(exp_avg.div(c), denom, value=-lr)


def _wrong_variant_step_(p: torch.Tensor, m: torch.Tensor, g: torch.Tensor, **kw: float) -> None:
    """The known wrong third-party variant: nu from the NEW momentum m_t."""
    m.lerp_(g, 1 - kw["beta1"])
    denom = (kw["beta2"] * m * m + (1 - kw["beta2"]) * g * g).sqrt_().add_(kw["eps"])
    p.mul_(1 - kw["lr"] * kw["weight_decay"]).addcdiv_(m, denom, value=-kw["lr"])


def _ours_paper_form(p: torch.Tensor, m: torch.Tensor, g: torch.Tensor, **kw: float) -> None:
    adams_step_(p, m, g, bias_correction=False, **kw)  # type: ignore[arg-type]


def _one_param(value: float = 0.0, shape: tuple[int, ...] = (1,)) -> nn.Parameter:
    return nn.Parameter(torch.full(shape, value, dtype=torch.float64))


# ------------------------------------------------------------------ T1 closed form


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize(("bias_correction", "factor"), [(False, 0.4472), (True, 4.4721)])
def test_t1_closed_form_first_step(sign: float, bias_correction: bool, factor: float) -> None:
    lr = 1e-3
    p = _one_param()
    opt = AdamS([p], lr=lr, eps=0.0, bias_correction=bias_correction)
    p.grad = torch.full_like(p, sign)
    opt.step()
    moved = -p.item() * sign / lr
    assert round(moved, 4) == factor
    assert moved == pytest.approx(CODE_STEP1 if bias_correction else PAPER_STEP1, rel=1e-12)


@pytest.mark.parametrize("bias_correction", [False, True])
def test_t1_with_weight_decay(bias_correction: bool) -> None:
    lr, wd, w0 = 1e-2, 0.1, 2.0
    p = _one_param(w0, (2, 3))  # >= 2-D, so decayed by default
    opt = AdamS([p], lr=lr, eps=0.0, weight_decay=wd, bias_correction=bias_correction)
    p.grad = torch.ones_like(p)
    opt.step()
    step = lr * (CODE_STEP1 if bias_correction else PAPER_STEP1)
    torch.testing.assert_close(p.detach(), torch.full_like(p, (1 - lr * wd) * w0 - step))


def test_t1_paper_and_code_forms_agree_once_bias_correction_fades() -> None:
    torch.manual_seed(0)
    m0, g = torch.randn(100, dtype=torch.float64), torch.randn(100, dtype=torch.float64)
    deltas = {}
    for form, step in [("paper", 1), ("code", 1), ("paper", 400), ("code", 400)]:
        p, m = torch.zeros_like(g), m0.clone() if step > 1 else torch.zeros_like(g)
        adams_step_(p, m, g, lr=1.0, step=step, bias_correction=form == "code", **HYPER)
        deltas[form, step] = p
    # step 1 from m_0 = 0: the code form is exactly 1/c_1 = 10x the paper form
    torch.testing.assert_close(deltas["code", 1], 10 * deltas["paper", 1], rtol=1e-12, atol=0)
    # late steps: c_t = 1 - 0.9**400 ~ 1 - 5e-19, the two forms coincide
    torch.testing.assert_close(deltas["code", 400], deltas["paper", 400], rtol=1e-14, atol=0)


# ------------------------------------------------------------------ T2 bounded steps


def _gradient_sequence(seed: int, steps: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Random gradients with spikes, sign flips, exact zeros and tiny values."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        g = torch.randn(n, generator=gen, dtype=dtype)
        g *= torch.exp(3 * torch.randn(n, generator=gen, dtype=dtype))  # heavy tails
        if t % 7 == 3:
            g *= 1e4  # spike
        if t % 5 == 2:
            g = -g  # flip
        g[torch.rand(n, generator=gen) < 0.1] = 0.0
        g[torch.rand(n, generator=gen) < 0.05] *= 1e-12
        out.append(g)
    return out


def test_step_bound_values() -> None:
    assert round(step_bound(0.9, 0.95), 3) == 1.026
    assert round(step_bound(0.9, 0.99), 3) == 1.348
    assert round(step_bound(0.9, 0.999), 3) == 3.288
    code_form = [round(step_bound(0.9, 0.95, t), 2) for t in (1, 2, 5, 10)]
    assert code_form == [4.57, 2.53, 1.43, 1.15]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_t2_every_step_is_bounded(dtype: torch.dtype, bias_correction: bool, wd: float) -> None:
    # Bound (step_bound): |w_t - (1 - lr*wd) w_{t-1}| <= lr * B, with the paper
    # form's constant B = 1.026 for (0.9, 0.95) or, with bias correction, the code
    # form's B_t (4.57 at t = 1, falling to 1.027 by t = 50).
    lr = 0.1
    p = nn.Parameter(torch.randn(4, 500, dtype=dtype, generator=torch.Generator().manual_seed(1)))
    opt = AdamS([p], lr=lr, weight_decay=wd, bias_correction=bias_correction)
    tiny = torch.finfo(dtype).eps
    worst = 0.0
    for t, g in enumerate(_gradient_sequence(seed=2, steps=120, n=p.numel(), dtype=dtype), 1):
        before = p.detach().clone().double()
        p.grad = g.view_as(p)
        opt.step()
        after = p.detach().double()
        delta = (after - (1 - lr * wd) * before).abs()
        bound = lr * step_bound(B1, B2, t if bias_correction else None)
        slack = bound * 1e-9 + 2 * tiny * torch.maximum(after.abs(), before.abs())
        assert torch.all(delta <= bound + slack), f"step {t}: {delta.max().item()} > {bound}"
        worst = max(worst, (delta.max() / bound).item())
        assert torch.isfinite(p).all()
    assert worst > 0.9  # the sequence does push steps close to the bound


def test_t2_bound_is_attained() -> None:
    # Cauchy-Schwarz is tight when g / m_{t-1} = ((1-b1)/(1-b2)) / (b1/b2).
    m = torch.ones(1, dtype=torch.float64)
    g = m * ((1 - B1) / (1 - B2)) / (B1 / B2)
    p = torch.zeros(1, dtype=torch.float64)
    adams_step_(p, m, g, lr=1.0, step=1000, bias_correction=False, **{**HYPER, "eps": 0.0})
    assert -p.item() == pytest.approx(step_bound(B1, B2), rel=1e-12)


# ------------------------------------------------------------------ T3 m_{t-1} vs m_t


GS = [1.0, 1.0, -0.5, 2.0, 0.0, 0.0, 3.0, -1.0, 1e-3, -4.0, 0.25, 1.0]


def _matches_scalar_reference(step_fn: Callable[..., None]) -> bool:
    """Run ``step_fn`` (paper form) over GS and compare with the hand-computed reference."""
    lr, wd, w0 = 1e-2, 0.1, 0.7
    expected = _scalar_reference(GS, lr=lr, eps=1e-8, wd=wd, w0=w0, bias_correction=False)
    p, m = torch.tensor([w0], dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    for t, (g, want) in enumerate(zip(GS, expected, strict=True), 1):
        grad = torch.tensor([g], dtype=torch.float64)
        step_fn(p, m, grad, lr=lr, beta1=B1, beta2=B2, eps=1e-8, weight_decay=wd, step=t)
        if abs(p.item() - want) > 1e-13:
            return False
    return True


def test_t3_first_step_separates_previous_from_new_momentum() -> None:
    assert round(PAPER_STEP1, 4) == 0.4472 and round(WRONG_STEP1, 4) == 0.4100
    for fn, want in [(_ours_paper_form, PAPER_STEP1), (_wrong_variant_step_, WRONG_STEP1)]:
        p, m = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        fn(p, m, torch.ones(1, dtype=torch.float64), lr=1.0, step=1, **{**HYPER, "eps": 0.0})
        assert -p.item() == pytest.approx(want, rel=1e-12)


def test_t3_ours_matches_hand_reference_and_wrong_variant_does_not() -> None:
    assert _matches_scalar_reference(_ours_paper_form)
    assert not _matches_scalar_reference(_wrong_variant_step_)
    kw = dict(lr=1e-2, eps=1e-8, wd=0.1, w0=0.7, bias_correction=False)
    right, wrong = _scalar_reference(GS, **kw), _scalar_reference(GS, wrong=True, **kw)
    assert abs(wrong[0] - right[0]) > 3e-4  # (0.4472 - 0.4100) * lr


@pytest.mark.parametrize("bias_correction", [False, True])
def test_t3_optimizer_matches_scalar_reference_step_by_step(bias_correction: bool) -> None:
    lr, wd, w0 = 1e-2, 0.1, 0.7
    expected = _scalar_reference(GS, lr=lr, eps=1e-8, wd=wd, w0=w0, bias_correction=bias_correction)
    p = _one_param(w0, (1, 1))
    opt = AdamS([p], lr=lr, weight_decay=wd, bias_correction=bias_correction)
    for g, want in zip(GS, expected, strict=True):
        p.grad = torch.full_like(p, g)
        opt.step()
        assert p.item() == pytest.approx(want, rel=1e-13, abs=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_official_code_op_sequence(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(64, 32, generator=gen, dtype=dtype)
    ours = nn.Parameter(w0.clone())
    opt = AdamS([ours], lr=3e-3, weight_decay=0.1)
    ref, ref_m = w0.clone(), torch.zeros_like(w0)
    for t in range(1, 31):
        g = torch.randn(w0.shape, generator=gen, dtype=dtype)
        ours.grad = g
        opt.step()
        _official_code_step(ref, ref_m, g, t, lr=3e-3, wd=0.1)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(ours.detach(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(opt.state[ours]["exp_avg"], ref_m, rtol=tol, atol=tol)


# ------------------------------------------------------------------ T4 state


def test_t4_single_state_tensor_and_state_dict_contents() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    opt = AdamS(model.parameters(), lr=1e-3, weight_decay=0.1)
    for _ in range(3):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    for p in model.parameters():
        state = opt.state[p]
        assert set(state) == {"step", "exp_avg"}
        assert state["step"] == 3 and isinstance(state["step"], int)
        assert state["exp_avg"].shape == p.shape and state["exp_avg"].dtype == p.dtype
        assert not state["exp_avg"].requires_grad
    sd = opt.state_dict()
    assert len(sd["state"]) == len(list(model.parameters()))
    assert all(set(s) == {"step", "exp_avg"} for s in sd["state"].values())
    assert "exp_avg_sq" not in repr(sd)
    (group,) = sd["param_groups"]
    assert {"lr", "betas", "eps", "weight_decay", "bias_correction", "foreach"} <= set(group)
    assert group["betas"] == (0.9, 0.95) and group["wd_min_ndim"] == 2


# ------------------------------------------------------------------ T5 zeros


@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("eps", [1e-8, 1e-30, torch.finfo(torch.float32).tiny])
def test_t5_zero_gradient_and_zero_momentum_give_no_update(bias_correction: bool, eps: float) -> None:
    # 0 / (0 + eps) = 0 as long as eps > 0; eps = 0 gives 0/0 here
    # (and in the official code), so no eps = 0 case is asserted.
    w0 = torch.randn(3, 4)
    p, b = nn.Parameter(w0.clone()), nn.Parameter(torch.ones(4))
    opt = AdamS([p, b], lr=0.1, eps=eps, bias_correction=bias_correction)
    for _ in range(3):
        p.grad, b.grad = torch.zeros_like(p), torch.zeros_like(b)
        opt.step()
    assert torch.equal(p.detach(), w0) and torch.equal(b.detach(), torch.ones(4))
    assert torch.count_nonzero(opt.state[p]["exp_avg"]) == 0


def test_zero_gradient_after_history_coasts_at_b1_over_sqrt_b2() -> None:
    # m_{t-1} != 0, g = 0: step = lr * b1 / sqrt(b2) * sign(m) = 0.923 lr
    p, m = torch.zeros(2, dtype=torch.float64), torch.tensor([3.0, -0.5], dtype=torch.float64)
    adams_step_(p, m, torch.zeros_like(p), lr=1.0, step=500, bias_correction=True, **HYPER)
    torch.testing.assert_close(p, torch.tensor([-1.0, 1.0], dtype=torch.float64) * B1 / B2**0.5)


# ------------------------------------------------------------------ weight decay policy


def test_weight_decay_only_on_matrices_by_default_and_overridable_per_group() -> None:
    lr, wd = 0.1, 0.5
    lin, bias_all, bias_off = nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(3, 4)
    scalar = nn.Parameter(torch.tensor(2.0))
    params = [*lin.parameters(), scalar, *bias_all.parameters(), *bias_off.parameters()]
    before = [q.detach().clone() for q in params]
    opt = AdamS(
        [
            {"params": [*lin.parameters(), scalar]},
            {"params": bias_all.parameters(), "wd_min_ndim": 0},
            {"params": bias_off.parameters(), "weight_decay": 0.0},
        ],
        lr=lr,
        weight_decay=wd,
    )
    for q in params:
        q.grad = torch.zeros_like(q)  # g = m = 0: the only change is weight decay
    opt.step()
    decayed = [True, False, False, True, True, False, False]
    for q, q0, dec in zip(params, before, decayed, strict=True):
        assert torch.equal(q.detach(), q0 * (1 - lr * wd) if dec else q0)


# ------------------------------------------------------------------ groups, schedulers


def test_param_groups_with_different_lr() -> None:
    a, b = _one_param(), _one_param()
    opt = AdamS([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.01, bias_correction=False)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt.step()
    assert -a.item() == pytest.approx(0.01 * PAPER_STEP1, rel=1e-6)
    assert -b.item() == pytest.approx(0.5 * PAPER_STEP1, rel=1e-6)


@pytest.mark.parametrize(
    "make_sched",
    [
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: 0.8**t),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10),
    ],
    ids=["LambdaLR", "CosineAnnealingLR"],
)
def test_lr_scheduler_drives_the_step_size(make_sched: Callable) -> None:
    gen = torch.Generator().manual_seed(4)
    w0 = torch.randn(5, 6, generator=gen)
    grads = [torch.randn(5, 6, generator=gen) for _ in range(10)]
    p = nn.Parameter(w0.clone())
    opt = AdamS([p], lr=0.05, weight_decay=0.1)
    sched = make_sched(opt)
    lrs = []
    for g in grads:
        lrs.append(opt.param_groups[0]["lr"])
        p.grad = g
        opt.step()
        sched.step()
    assert len(set(lrs)) == len(lrs)  # the schedule really changed lr every step
    ref, m = w0.clone(), torch.zeros_like(w0)
    for t, (g, lr) in enumerate(zip(grads, lrs, strict=True), 1):
        adams_step_(ref, m, g, lr=lr, step=t, bias_correction=True, **{**HYPER, "weight_decay": 0.1})
    assert torch.equal(p.detach(), ref)


# ------------------------------------------------------------------ checkpoint / paths


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 150), nn.Tanh(), nn.Linear(150, 130), nn.Linear(130, 1))


def _train(model: nn.Module, opt: AdamS, sched, steps: range) -> None:
    for t in steps:
        gen = torch.Generator().manual_seed(100 + t)
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 1, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()


@pytest.mark.parametrize("foreach", [None, True, False])
def test_state_dict_round_trip_resumes_bit_identically(foreach: bool | None) -> None:
    def make(seed: int) -> tuple[nn.Module, AdamS, torch.optim.lr_scheduler.LRScheduler]:
        model = _mlp(seed)
        opt = AdamS(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach)
        return model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)

    full, full_opt, full_sched = make(0)
    _train(full, full_opt, full_sched, range(12))

    first, opt, sched = make(0)
    _train(first, opt, sched, range(6))
    buf = io.BytesIO()
    torch.save({"m": first.state_dict(), "o": opt.state_dict(), "s": sched.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    resumed, opt2, sched2 = make(1)  # different init: everything must come from the ckpt
    resumed.load_state_dict(ckpt["m"])
    opt2.load_state_dict(ckpt["o"])
    sched2.load_state_dict(ckpt["s"])
    _train(resumed, opt2, sched2, range(6, 12))
    for a, b in zip(full.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt2.state[next(resumed.parameters())]["step"] == 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_foreach_and_single_tensor_paths_are_bitwise_identical(dtype: torch.dtype) -> None:
    shapes = [(20000,), (7, 3), (3,), (), (130, 150), (1, 1)]  # sizes on both sides of 16384
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    runs = {}
    for foreach in (False, True, None):
        ps = [nn.Parameter(w.clone()) for w in init]
        opt = AdamS(ps, lr=0.01, weight_decay=0.1, foreach=foreach)
        g2 = torch.Generator().manual_seed(6)
        for t in range(6):
            for i, p in enumerate(ps):
                g = torch.randn(p.shape, generator=g2, dtype=dtype)
                p.grad = None if (t + i) % 4 == 0 else g  # per-tensor step counts differ
            opt.step()
        runs[foreach] = (ps, [opt.state[p]["exp_avg"] for p in ps])
    for foreach in (True, None):
        for a, b in zip(runs[False][0] + runs[False][1], runs[foreach][0] + runs[foreach][1], strict=True):
            assert torch.equal(a, b)


def test_functional_foreach_matches_per_tensor_calls() -> None:
    gen = torch.Generator().manual_seed(7)
    ps = [torch.randn(n, generator=gen) for n in (5, 300, 1)]
    ms = [torch.randn(n, generator=gen) for n in (5, 300, 1)]
    gs = [torch.randn(n, generator=gen) for n in (5, 300, 1)]
    ps2, ms2 = [x.clone() for x in ps], [x.clone() for x in ms]
    kw = dict(lr=0.1, beta1=B1, beta2=B2, eps=1e-8, bias_correction=True)
    adams_step_foreach_(ps, ms, gs, weight_decay=[0.1, 0.0, 0.2], step=[1, 4, 9], **kw)
    for p, m, g, wd, s in zip(ps2, ms2, gs, [0.1, 0.0, 0.2], [1, 4, 9], strict=True):
        adams_step_(p, m, g, weight_decay=wd, step=s, **kw)
    assert all(torch.equal(a, b) for a, b in zip(ps + ms, ps2 + ms2, strict=True))


def test_functional_core_on_a_strided_view_with_workspace() -> None:
    flat, m = torch.randn(20), torch.zeros(20)
    ref, ref_m = flat.clone(), m.clone()
    g = torch.randn(20)
    ws = torch.empty(10)
    adams_step_(flat[::2], m[::2], g[::2], lr=0.1, step=1, bias_correction=True, workspace=ws, **HYPER)
    adams_step_(ref[::2], ref_m[::2], g[::2], lr=0.1, step=1, bias_correction=True, **HYPER)
    assert torch.equal(flat, ref) and torch.equal(m, ref_m)
    assert torch.equal(flat[1::2], ref[1::2])
    with pytest.raises(ValueError, match="step"):
        adams_step_(flat, m, g, lr=0.1, step=0, bias_correction=True, **HYPER)


def test_mixed_dtypes_in_one_group() -> None:
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = AdamS([a, b], lr=0.1, bias_correction=False)
    a.grad, b.grad = torch.ones(3), torch.ones(3, dtype=torch.float64)
    opt.step()
    assert a.dtype == torch.float32 and b.dtype == torch.float64
    torch.testing.assert_close(a.double(), b.detach(), rtol=1e-6, atol=0)


# ------------------------------------------------------------------ Optimizer contract


def test_closure_is_called_with_grad_enabled_and_its_loss_returned() -> None:
    model = nn.Linear(3, 1)
    opt = AdamS(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    w0 = model.weight.detach().clone()
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad
    assert not torch.equal(model.weight.detach(), w0)


def test_zero_grad_and_params_without_grad_are_skipped() -> None:
    a, b = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(2))
    opt = AdamS([a, b], lr=0.1)
    a.grad = torch.ones_like(a)
    opt.step()
    assert b not in opt.state and torch.equal(b.detach(), torch.ones(2))
    opt.zero_grad()
    assert a.grad is None
    a0 = a.detach().clone()
    opt.step()
    assert torch.equal(a.detach(), a0) and opt.state[a]["step"] == 1


def test_sparse_gradients_are_rejected() -> None:
    emb = nn.Embedding(10, 4, sparse=True)
    opt = AdamS(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"lr": -1e-3}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"betas": (1.0, 0.95)}, r"betas\[0\]"),
        ({"betas": (-0.1, 0.95)}, r"betas\[0\]"),
        ({"betas": (0.9, 1.0)}, r"betas\[1\]"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"wd_min_ndim": -1}, "wd_min_ndim"),
    ],
)
def test_invalid_hyperparameters_raise_value_error_naming_the_argument(kwargs: dict, name: str) -> None:
    p = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=f"Invalid {name}"):
        AdamS([p], **kwargs)
    with pytest.raises(ValueError, match=f"Invalid {name}"):  # also as a group override
        AdamS([{"params": [p], **kwargs}])


def test_tiny_regression_converges() -> None:
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(128, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen) + 0.5
    torch.manual_seed(8)
    model = nn.Linear(8, 1)
    opt = AdamS(model.parameters(), lr=0.05, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=400)
    first = nn.functional.mse_loss(model(x), y).item()
    for _ in range(400):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
    assert loss.item() < 1e-4 * first


def _debiased_reference(w, m, s, g, *, lr, beta1, beta2, eps, wd, step, p, shared=False):  # type: ignore[no-untyped-def]
    """The debiased step as whole-tensor arithmetic (what the chunked version must equal bit for bit)."""
    c = 1.0 - beta1**step
    excess = 1.0 - 1.0 / p
    m_prev2 = (m / c).square_()
    var = (s / (1.0 - beta2**step)).sub_(m_prev2).clamp_(min=0.0)
    if not shared:  # a first moment averaged across the ranks keeps all of its square
        m_prev2.sub_(var * (excess * (1.0 - beta1) / (1.0 + beta1))).clamp_(min=0.0)
    g2 = torch.maximum(g * g - excess * var, var / p)
    nu = m_prev2.mul_(beta2).add_(g2, alpha=1.0 - beta2)
    m.lerp_(g, 1.0 - beta1)
    if wd != 0.0:
        w.mul_(1.0 - lr * wd)
    w.addcdiv_(m, nu.sqrt_().add_(eps), value=-lr / c)


@pytest.mark.parametrize("n", [1, 1000, (1 << 18) * 2 + 123])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("shared", [False, True])
def test_debiased_step_in_chunks_equals_whole_tensor_arithmetic(n: int, wd: float, shared: bool) -> None:
    gen = torch.Generator().manual_seed(n)
    w, m, g = (torch.randn(n, generator=gen) for _ in range(3))
    s = m * m + torch.rand(n, generator=gen)  # an EMA of g**2 at or above m**2, mostly
    s[: n // 3] *= 0.5  # and below it in places: the clamps engage
    kw = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "step": 7}
    w2, m2 = w.clone(), m.clone()
    _debiased_reference(w2, m2, s.clone(), g, wd=wd, p=4, shared=shared, **kw)
    debiased_adams_step_(w, m, s, g, weight_decay=wd, world_size=4, shared_moment=shared, **kw)
    assert torch.equal(w, w2) and torch.equal(m, m2)


@pytest.mark.parametrize("n", [1, 1000, (1 << 16) * 3 + 17, 1 << 18])
def test_squared_norm_matches_float64_sum(n: int) -> None:
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3
    ref = g.double().square().sum()
    got = squared_norm(g)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert abs(float(got) - float(ref)) <= 1e-6 * float(ref)


def test_squared_norm_does_not_overflow_where_float32_would() -> None:
    g = torch.full(((1 << 16) + 5,), 3e19)  # each square overflows float32
    assert math.isfinite(float(squared_norm(g)))
    assert float(squared_norm(g)) == pytest.approx(float(g.double().square().sum()), rel=1e-12)
    g[7] = float("inf")
    assert float(squared_norm(g)) == float("inf")
