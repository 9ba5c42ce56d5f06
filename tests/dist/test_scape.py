"""SCAPE and the dense sharded AdamS/AdamW baselines on spawned gloo ranks.

Parameters of odd sizes (N = 73) so every world size pads the flat buffer.
Gradients are integer-valued, so the rank average is exact and the sharded
optimizers can be compared bitwise with single-process references. Rank
functions return only plain Python data (lists, strings, bools).
"""

from __future__ import annotations

import hashlib
import io
import math

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

SHAPES = [(7, 5), (13,), (3, 4, 2), (1,)]  # N = 73
NUMEL = 73


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(rank: int, t: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * t + rank)
    return [torch.randint(-8, 9, s, generator=g).float() for s in SHAPES]


def _set_grads(ps: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
    for p, g in zip(ps, grads, strict=True):
        p.grad = g.clone()


def _flat(ps: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in ps])


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def _split(flat: torch.Tensor) -> list[torch.Tensor]:
    out, off = [], 0
    for s in SHAPES:
        n = torch.Size(s).numel()
        out.append(flat[off : off + n].view(s).clone())
        off += n
    return out


# ---------------------------------------------------------------------------- density 1
def _rank_dense_equivalence(rank: int, ws: int, steps: int) -> dict:
    from optim.optimizers.adams import AdamS
    from optim.optimizers.scape import SCAPE
    from optim.optimizers.sharded import ShardedAdamS, ShardedAdamW

    hp = dict(lr=0.05, weight_decay=0.1)
    ps_a, ps_b, ps_r, ps_w, ps_rw = (_params() for _ in range(5))
    a = SCAPE(ps_a, density=1.0, warmup_steps=0, **hp)
    b = ShardedAdamS(ps_b, **hp)
    ref = AdamS(ps_r, foreach=False, **hp)
    w = ShardedAdamW(ps_w, **hp)
    ref_w = torch.optim.AdamW(
        [
            {"params": [p for p in ps_rw if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in ps_rw if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=0.05,
        foreach=False,
    )
    out: dict = {"scape_eq_sharded": [], "sharded_eq_ref": [], "adamw_eq_ref": [], "digests": []}
    for t in range(steps):
        mine = _grads(rank, t)
        per_rank = [_grads(r, t) for r in range(ws)]
        avg = [torch.stack([g[i] for g in per_rank]).sum(0) / ws for i in range(len(SHAPES))]
        for ps in (ps_a, ps_b, ps_w):
            _set_grads(ps, mine)
        for ps in (ps_r, ps_rw):
            _set_grads(ps, avg)
        for opt in (a, b, ref, w, ref_w):
            opt.step()
        out["scape_eq_sharded"].append(torch.equal(_flat(ps_a), _flat(ps_b)))
        out["sharded_eq_ref"].append(torch.equal(_flat(ps_b), _flat(ps_r)))
        out["adamw_eq_ref"].append(torch.equal(_flat(ps_w), _flat(ps_rw)))
        out["digests"].append(_digest(_flat(ps_a)))
    stats = a.communicator.stats.as_dict()
    out["sparse_calls"] = stats.get("sparse_reduce_scatter", {}).get("calls", 0)
    a.close()
    return out


def check_dense_equivalence(res: list[dict]) -> None:
    """Assertions on the per-rank results of :func:`_rank_dense_equivalence`."""
    for r in res:
        assert all(r["scape_eq_sharded"]), r["scape_eq_sharded"]
        assert all(r["sharded_eq_ref"]), r["sharded_eq_ref"]
        assert all(r["adamw_eq_ref"]), r["adamw_eq_ref"]
        assert r["sparse_calls"] == 0
        assert r["digests"] == res[0]["digests"]  # replicas identical after every step


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_density_one_equals_sharded_and_single_process(world_size: int) -> None:
    check_dense_equivalence(run_ranks(_rank_dense_equivalence, world_size, 5, timeout=120, op_timeout=60))


# ---------------------------------------------------------------------------- sparse steps
def _expected_scores(
    score: str, explore: float, k: int, made_at: int, m: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """The mask statistic SCAPE documents, computed independently: |m| or |m|*|w|, plus the exploration window."""
    scores = m.abs() if score == "abs_m" else m.abs() * w.abs()
    n = min(len(scores), math.ceil(explore * k))
    if n:
        lo = (made_at * n) % len(scores)
        scores[[(lo + i) % len(scores) for i in range(n)]] = math.inf
    return scores


def _rank_sparse(
    rank: int, ws: int, delay: int, policy: str, poison: bool, score: str = "abs_m", explore: float = 0.0
) -> dict:
    from optim.optimizers.scape import SCAPE
    from sparsecomm.mask import topk_piece

    ps = _params()
    beta1 = 0.9
    opt = SCAPE(
        ps,
        lr=0.05,
        weight_decay=0.1,
        density=0.2,
        mask_delay=delay,
        warmup_steps=2,
        unselected=policy,
        score=score,
        explore=explore,
    )
    b = opt.bucket
    stats = opt.communicator.stats
    m = opt.shard_state["exp_avg"]
    m_hist: dict[int, torch.Tensor] = {}
    w_hist: dict[int, torch.Tensor] = {}
    out: dict = {"digests": [], "masks": [], "checks": {}, "sparse_steps": 0}
    checks = out["checks"]

    def check(name: str, ok: bool) -> None:
        checks[name] = checks.get(name, True) and bool(ok)

    for t in range(9):
        mask = opt.next_mask()
        grads = _grads(rank, t)
        sel = torch.zeros(NUMEL, dtype=torch.bool)
        if mask is not None:
            gi = mask.global_indices()
            sel[gi[gi < NUMEL]] = True
            if poison:
                fg = torch.cat([g.reshape(-1) for g in grads])
                bad = torch.where(torch.arange(NUMEL) % 2 == 0, float("nan"), float("inf"))
                fg[~sel] = bad[~sel] * (1 if rank % 2 == 0 else -1)
                grads = _split(fg)
        _set_grads(ps, grads)
        before = _flat(ps).clone()
        master0, m0 = opt.master_shard.clone(), m.clone()
        stats0 = stats.as_dict()
        opt.step()
        after = _flat(ps)
        stats1 = stats.as_dict()
        check("finite", bool(torch.isfinite(after).all()) and bool(torch.isfinite(m).all()))
        check("last_mask", opt.last_mask is mask)
        # T12: this rank's replica equals its master shard on every real coordinate
        check("replica_eq_master", torch.equal(after[b.shard_lo : b.shard_lo + b.real], opt.master_shard[: b.real]))
        out["digests"].append(_digest(after))
        out["masks"].append(None if mask is None else mask.digest())
        if mask is not None:
            out["sparse_steps"] += 1
            check("sparse_only_after_warmup", t >= 2)
            # T11: unmasked replica coordinates bitwise unchanged
            check("frozen_params", torch.equal(after[~sel], before[~sel]))
            own = torch.ones(b.shard_size, dtype=torch.bool)
            own[mask.piece(rank)] = False
            own[b.real :] = False
            check("frozen_master", torch.equal(opt.master_shard[own], master0[own]))
            if policy == "freeze":
                check("frozen_m", torch.equal(m[own], m0[own]))
            else:
                check("decayed_m", torch.equal(m[own], m0[own] * beta1))
            # T10: the mask of step t is the top-k score after step t-1-D
            made = t - 1 - delay
            src = _expected_scores(score, explore, mask.k, made, m_hist[made], w_hist[made])
            expect = topk_piece(src, mask.k, shard_size=b.shard_size)
            check("provenance", torch.equal(expect, mask.piece(rank)))
            if delay >= 1 and (t - 1) in m_hist:
                newer_scores = _expected_scores(score, explore, mask.k, t - 1, m_hist[t - 1], w_hist[t - 1])
                newer = topk_piece(newer_scores, mask.k, shard_size=b.shard_size)
                out.setdefault("newer_differs", []).append(not torch.equal(newer, expect))
            # T17: one value RS, one value AG, at most one mask AG, nothing else
            diff = {
                k: stats1[k]["calls"] - stats0.get(k, {}).get("calls", 0)
                for k in stats1
                if stats1[k]["calls"] != stats0.get(k, {}).get("calls", 0)
            }
            check(
                "collectives",
                diff.get("sparse_reduce_scatter") == 1
                and diff.get("sparse_all_gather") == 1
                and diff.get("mask_sync", 0) <= 1
                and set(diff) <= {"sparse_reduce_scatter", "sparse_all_gather", "mask_sync"},
            )
        m_hist[t] = m[: b.real].clone()
        w_hist[t] = opt.master_shard[: b.real].clone()
    opt.close()
    return out


@pytest.mark.parametrize(
    ("world_size", "delay", "policy", "score", "explore"),
    [
        (1, 1, "freeze", "abs_m", 0.0),
        (2, 1, "freeze", "abs_m", 0.0),
        (3, 0, "decay_m", "abs_m", 0.0),
        (4, 1, "freeze", "abs_m", 0.0),
        (2, 1, "decay_m", "abs_m_theta", 0.1),  # the defaults
        (3, 1, "freeze", "abs_m", 0.5),
    ],
)
def test_sparse_step_invariants(world_size: int, delay: int, policy: str, score: str, explore: float) -> None:
    res = run_ranks(_rank_sparse, world_size, delay, policy, True, score, explore, timeout=120, op_timeout=60)
    check_sparse(res, delay)


def check_sparse(res: list[dict], delay: int) -> None:
    """Assertions on the per-rank results of :func:`_rank_sparse`."""
    for r in res:
        assert r["checks"] and all(r["checks"].values()), r["checks"]
        assert r["sparse_steps"] == 7
        assert r["digests"] == res[0]["digests"]  # replicas identical after every step
        assert r["masks"] == res[0]["masks"]  # masks identical on all ranks
    assert res[0]["masks"][:2] == [None, None]
    if delay >= 1:  # a mask built from the newest m would differ at some step
        assert any(any(r.get("newer_differs", [])) for r in res)
    assert len(set(res[0]["masks"][2:])) > 1  # the mask moves


# ---------------------------------------------------------------------------- resume, determinism
def _run_scape(rank: int, steps: int, split: int | None, kw: dict) -> str:
    from optim.optimizers.scape import SCAPE

    ps = _params()
    opt = SCAPE(ps, **kw)
    for t in range(steps):
        if t == split:
            buf = io.BytesIO()
            torch.save({"opt": opt.state_dict(), "params": [p.detach().clone() for p in ps]}, buf)
            opt.close()
            buf.seek(0)
            saved = torch.load(buf, weights_only=False)
            ps = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
            opt = SCAPE(ps, **kw)
            opt.load_state_dict(saved["opt"])
        g = _grads(rank, t)
        _set_grads(ps, [x * 0.37 for x in g])  # non-integer grads for this test
        opt.step()
    parts = [_flat(ps), opt.master_shard] + [opt.shard_state["exp_avg"]]
    if opt.residual is not None:
        parts.append(opt.residual)
    opt.close()
    return "|".join(_digest(x) for x in parts)


def _rank_resume(rank: int, ws: int) -> dict:
    kw = dict(
        lr=0.05,
        weight_decay=0.1,
        density=0.25,
        mask_delay=1,
        warmup_steps=2,
        error_feedback=True,
        refresh_every=5,
        max_grad_norm=20.0,
        unselected="decay_m",
    )
    kw0 = dict(kw, mask_delay=0, error_feedback=False, unselected="freeze", refresh_every=0)
    return {
        "a": _run_scape(rank, 10, None, kw),
        "b": _run_scape(rank, 10, None, kw),
        "inline": _run_scape(rank, 10, None, dict(kw, background_proposal=False)),
        "inline_split3": _run_scape(rank, 10, 3, dict(kw, background_proposal=False)),
        "split3": _run_scape(rank, 10, 3, kw),
        "split7": _run_scape(rank, 10, 7, kw),
        "d0": _run_scape(rank, 8, None, kw0),
        "d0_split4": _run_scape(rank, 8, 4, kw0),
    }


def test_resume_and_determinism() -> None:
    res = run_ranks(_rank_resume, 2, timeout=120, op_timeout=60)
    for r in res:
        assert r["a"] == r["b"]  # determinism across two runs
        assert r["inline"] == r["a"]  # the piece built beside the caller's compute == built inside step()
        assert r["inline_split3"] == r["a"]
        assert r["split3"] == r["a"]
        assert r["split7"] == r["a"]
        assert r["d0_split4"] == r["d0"]


# ---------------------------------------------------------------------------- error feedback
def _rank_error_feedback(rank: int, ws: int) -> dict:
    from optim.optimizers.scape import SCAPE

    ps = _params()
    opt = SCAPE(ps, lr=0.05, density=0.2, mask_delay=1, warmup_steps=2, refresh_every=6, error_feedback=True)
    e = torch.zeros(opt.bucket.padded_numel)
    total_g = torch.zeros(opt.bucket.padded_numel, dtype=torch.float64)
    total_sent = torch.zeros_like(total_g)
    ok = True
    for t in range(9):
        mask = opt.next_mask()
        grads = [g * 0.37 for g in _grads(rank, t)]
        _set_grads(ps, grads)
        g = torch.zeros_like(e)
        g[:NUMEL] = torch.cat([x.reshape(-1) for x in grads])
        eff = g + e
        sent = eff.clone()
        if mask is not None:
            keep = torch.ones_like(sent, dtype=torch.bool)
            keep[mask.global_indices()] = False
            sent[keep] = 0.0
        e = eff - sent
        total_g += g.double()
        total_sent += sent.double()
        opt.step()
        assert opt.residual is not None
        ok = ok and torch.equal(opt.residual, e)
    # T13: sent + residual == sum of gradients (no mass lost or duplicated)
    err = float((total_sent + e.double() - total_g).abs().max())
    opt.close()
    return {"residual_matches": ok, "conservation_err": err, "residual_nonzero": bool(e.any())}


def test_error_feedback_conservation() -> None:
    res = run_ranks(_rank_error_feedback, 2, timeout=120, op_timeout=60)
    for r in res:
        assert r["residual_matches"]
        assert r["residual_nonzero"]
        assert r["conservation_err"] < 1e-4


# ---------------------------------------------------------------------------- bad input
def _rank_bad_input(rank: int, ws: int) -> dict:
    from optim.optimizers.scape import SCAPE
    from optim.optimizers.sharded import ShardedAdamS

    def outcome(fn) -> str:
        try:
            fn()
        except ValueError as exc:
            return f"ValueError: {exc}"
        return "ok"

    out = {
        "density0": outcome(lambda: SCAPE(_params(), density=0.0)),
        "density1.5": outcome(lambda: SCAPE(_params(), density=1.5)),
        "delay": outcome(lambda: SCAPE(_params(), mask_delay=-1)),
        "warmup": outcome(lambda: SCAPE(_params(), warmup_steps=-2)),
        "policy": outcome(lambda: SCAPE(_params(), unselected="zero")),
        "extra_param": outcome(lambda: SCAPE(_params() + ([torch.nn.Parameter(torch.zeros(2))] if rank == 1 else []))),
        "shape": outcome(lambda: ShardedAdamS([torch.nn.Parameter(torch.zeros(6 if rank else 5, 2))])),
        "setting": outcome(lambda: SCAPE(_params(), density=0.1 if rank else 0.2)),
        "dtype": outcome(
            lambda: SCAPE([torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
        ),
    }
    try:
        SCAPE(_params(), background_proposal=1)  # type: ignore[arg-type]
        out["background"] = "ok"
    except TypeError as exc:
        out["background"] = f"TypeError: {exc}"
    ps = _params()  # the group still works afterwards
    opt = SCAPE(ps, density=0.5, warmup_steps=0, mask_delay=0)
    for t in range(3):
        _set_grads(ps, _grads(rank, t))
        opt.step()
    out["after"] = _digest(_flat(ps))
    opt.close()
    return out


def test_bad_input_raises_on_every_rank() -> None:
    res = run_ranks(_rank_bad_input, 2, timeout=120, op_timeout=30)
    for r in res:
        for key in ("density0", "density1.5", "delay", "warmup", "policy", "extra_param", "shape", "setting", "dtype"):
            assert r[key].startswith("ValueError"), (key, r[key])
        assert r["background"].startswith("TypeError"), r["background"]
        assert r["after"] == res[0]["after"]


# ---------------------------------------------------------------------------- resume with delayed masks
def _rank_scape_resume(rank: int, ws: int, delay: int, via: str) -> dict:
    """Train 9 steps; take a snapshot or state dict after step 5 (masks of later steps in flight) and load it
    into a fresh optimizer: both the run that took it and the restored one must match a run that took none."""
    import copy

    from optim import SCAPE
    from optim.state.snapshot import decode_tree, encode_tree

    def run(save_at: int | None) -> tuple[list[list[float]], object]:
        ps = _params()
        opt = SCAPE(ps, lr=0.01, density=0.25, mask_delay=delay, warmup_steps=2)
        flats, saved = [], None
        for t in range(9):
            _set_grads(ps, _grads(rank, t))
            opt.step()
            flats.append(_flat(ps).tolist())
            if t == save_at:
                state = encode_tree(opt.snapshot_state()) if via == "snapshot" else opt.state_dict()
                saved = (copy.deepcopy(state), [p.detach().clone() for p in ps])
        opt.close()
        return flats, saved

    plain, _ = run(None)
    taken, saved = run(5)
    state, params = saved  # type: ignore[misc]
    ps = _params(seed=3)  # other values: the load must bring them back
    with torch.no_grad():
        for p, v in zip(ps, params, strict=True):
            p.copy_(v)
    opt = SCAPE(ps, lr=0.01, density=0.25, mask_delay=delay, warmup_steps=2)
    if via == "snapshot":
        opt.restore_snapshot(decode_tree(state))
        opt.resync_params()
    else:
        opt.load_state_dict(state)
    again = []
    for t in range(6, 9):
        _set_grads(ps, _grads(rank, t))
        opt.step()
        again.append(_flat(ps).tolist())
    opt.close()
    return {"plain": plain, "taken": taken, "again": again}


@pytest.mark.parametrize("delay", [1, 2])
@pytest.mark.parametrize("via", ["snapshot", "state_dict"])
def test_saving_mid_run_changes_nothing_and_a_restore_resumes_bit_for_bit(delay: int, via: str) -> None:
    for r in run_ranks(_rank_scape_resume, 2, delay, via, timeout=120, op_timeout=60):
        assert r["taken"] == r["plain"]
        assert r["again"] == r["plain"][6:]
