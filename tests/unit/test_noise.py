"""The noise measurement of LocalAdamS's measured normalizer: the sketch, the effective world size, the state."""

from __future__ import annotations

import contextlib

import pytest
import torch

from optim.optimizers.adams import debiased_adams_step_
from optim.optimizers.noise import MeanNorm, NoiseScale, effective_world_size, sign_sketch


@pytest.mark.parametrize("n,columns", [(1, 64), (640, 64), (1000, 64), (5, 3), (4096, 1)])
def test_sketch_squares_sum_to_the_squared_norm_on_average(n: int, columns: int) -> None:
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)) * torch.linspace(0.1, 3.0, n)
    draws = torch.stack([sign_sketch(g, columns, torch.Generator().manual_seed(s)).square().sum() for s in range(2000)])
    ref = float(g.square().sum())
    assert float(draws.mean()) == pytest.approx(ref, rel=0.05)
    if columns >= n:  # every position has a column of its own: exact
        assert torch.allclose(draws, torch.full_like(draws, ref), rtol=1e-5)


def test_sketch_is_linear_in_the_gradient() -> None:
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(1001, generator=gen), torch.randn(1001, generator=gen)
    sa, sb, sab = (sign_sketch(x, 64, torch.Generator().manual_seed(7)) for x in (a, b, (a + b) / 2))
    assert torch.allclose((sa + sb) / 2, sab, atol=1e-5)


def test_sketch_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="1-D"):
        sign_sketch(torch.zeros(2, 3), 4, torch.Generator())
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="columns"):
            sign_sketch(torch.zeros(8), bad, torch.Generator())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="columns"):
        NoiseScale(columns=0)
    with pytest.raises(ValueError, match="beta"):
        NoiseScale(beta=1.0)


def test_effective_world_size_spans_one_rank_to_all() -> None:
    assert effective_world_size(1.0, 4) == pytest.approx(4.0)
    assert effective_world_size(0.0, 4) == 1.0
    assert 1.0 < effective_world_size(0.5, 4) < 4.0
    assert effective_world_size(0.5, 4) == pytest.approx(1.0 / (1.0 - 0.5 * 0.75))


def test_rho_is_one_until_measured_then_clamped() -> None:
    ns = NoiseScale()
    assert ns.rho == 1.0
    ns.ema.copy_(torch.tensor([0.3, 0.6], dtype=torch.float64))
    assert ns.rho == pytest.approx(0.5)
    ns.ema.copy_(torch.tensor([-0.1, 0.6], dtype=torch.float64))
    assert ns.rho == 0.0
    ns.ema.copy_(torch.tensor([2.0, 0.6], dtype=torch.float64))
    assert ns.rho == 1.0


def test_state_round_trips_and_is_checked() -> None:
    ns = NoiseScale()
    ns.ema.copy_(torch.tensor([0.25, 0.5], dtype=torch.float64))
    other = NoiseScale()
    other.load_state_dict(ns.state_dict())
    assert torch.equal(other.ema, ns.ema) and other.rho == ns.rho
    for bad in ({}, {"noise_ema": torch.zeros(3, dtype=torch.float64)}, {"noise_ema": torch.zeros(2)}):
        with pytest.raises(ValueError, match="noise_ema"):
            other.load_state_dict(bad)


def test_debiased_step_sums_the_variance_it_estimates() -> None:
    n = (1 << 18) + 77  # more than one chunk
    gen = torch.Generator().manual_seed(3)
    w, m, g = (torch.randn(n, generator=gen) for _ in range(3))
    s = m * m + torch.rand(n, generator=gen)
    s[: n // 4] *= 0.3  # below m**2 in places: clamped to 0 there
    step, beta1, beta2 = 5, 0.9, 0.95
    ref = ((s / (1 - beta2**step)) - (m / (1 - beta1**step)).square()).clamp(min=0.0).double().sum()
    total = torch.zeros((), dtype=torch.float64)
    w2, m2 = w.clone(), m.clone()
    kw = {"lr": 1e-3, "beta1": beta1, "beta2": beta2, "eps": 1e-8, "weight_decay": 0.0, "step": step}
    debiased_adams_step_(w, m, s, g, world_size=4, var_sum=total, **kw)
    debiased_adams_step_(w2, m2, s, g, world_size=4, **kw)
    assert float(total) == pytest.approx(float(ref), rel=1e-6)
    assert torch.equal(w, w2) and torch.equal(m, m2)  # summing changes nothing else


class _OneRank:
    """One rank's communicator for the pure estimate: its all_reduce of one rank is the identity."""

    world_size = 1

    class stats:  # noqa: N801 - the communicator's attribute
        @staticmethod
        def scope(name: str) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

    def all_reduce(self, t: torch.Tensor, op: object) -> None:
        pass


def test_mean_norm_holds_where_a_few_coordinates_carry_the_norm() -> None:
    """Five coordinates carry 99% of the squared norm, three of them in one column of the sketch (positions equal mod
    64): a single step's sketch is wrong by up to half the norm; the estimate, the exact mean of the squared norms
    less the noise's EMA, is not."""
    g = torch.randn(20000, generator=torch.Generator().manual_seed(3)) * 0.01
    g[[11, 75, 139, 4000, 4064]] = torch.tensor([30.0, -25.0, 20.0, 28.0, -22.0])
    true = float(g.norm())
    norm = MeanNorm()
    est = [norm.measure(_OneRank(), g, step) / true for step in range(300)]
    sketch = [float(sign_sketch(g, 64, torch.Generator().manual_seed(s)).norm()) / true for s in range(300)]
    assert max(abs(q - 1.0) for q in sketch) > 0.5  # what a single sketch gets wrong
    assert all(abs(q - 1.0) < 0.35 for q in est[20:]), (min(est[20:]), max(est[20:]))
    assert torch.tensor(est[20:]).std() < 0.4 * torch.tensor(sketch).std()
    assert abs(sum(est[20:]) / len(est[20:]) - 1.0) < 0.03


def test_mean_norm_state_round_trips_and_is_checked() -> None:
    a = MeanNorm()
    g = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    for step in range(5):
        a.measure(_OneRank(), g, step)
    b = MeanNorm()
    b.load_state_dict(a.state_dict())
    assert a.measure(_OneRank(), g, 5) == b.measure(_OneRank(), g, 5)
    with pytest.raises(ValueError, match="clip_noise_ema"):
        b.load_state_dict({"clip_noise_ema": torch.zeros(3)})
    with pytest.raises(ValueError, match="beta"):
        MeanNorm(beta=1.0)
    with pytest.raises(ValueError, match="columns"):
        MeanNorm(columns=0)
