"""LocalAdamS and TopKAdamS on spawned gloo ranks, checked against single-process references.

* LocalAdamS (staggered): every rank's parameters equal a reference that runs
  one AdamS per rank on that rank's batches and averages the window
  positions after every step; the window positions are bitwise identical
  on every rank; every position is averaged within ceil(shard / k) steps;
  the wire carries exactly the staggered window's values and nothing else.
* LocalAdamS (periodic): replicas bitwise identical right after each average.
* TopKAdamS: replicas bitwise identical every step and equal to a reference
  top-k + error-feedback AdamS; values plus int32 indices on the wire.
* Snapshots and state dicts continue bit for bit; ``averaged()`` evaluates
  the mean of the replicas and puts this rank's own back.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

STEPS, WARM = 9, 2


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def _loss(model: torch.nn.Module, rank: int, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * t + rank)
    x, y = torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)
    return torch.nn.functional.cross_entropy(model(x), y)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, t: int) -> None:
    """One training step of ``opt`` on ``model`` with this rank's batch of step ``t``."""
    opt.zero_grad()
    _loss(model, rank, t).backward()
    opt.step()


def _make(kind: str, params: object, density: float) -> torch.optim.Optimizer:
    from optim import LocalAdamS, TopKAdamS

    kw = dict(lr=0.05, weight_decay=0.1, density=density, warmup_steps=WARM)
    if kind == "topk":
        return TopKAdamS(params, **kw)
    if kind == "default":
        return LocalAdamS(params, **kw)  # codes of the changes, normalizer="auto"
    if kind in ("debiased", "measured"):
        return LocalAdamS(params, normalizer=kind, **kw)
    if kind == "lean":  # the defaults with the normalizer's second-moment EMA in bfloat16
        return LocalAdamS(params, normalizer_dtype=torch.bfloat16, **kw)
    if kind == "overlap":
        return LocalAdamS(params, overlap=True, **kw)  # the defaults, each average landing a step late
    if kind.startswith("overlap-"):  # 8-bit codes and plain per-rank AdamS, as the references below
        return LocalAdamS(
            params,
            wire_bits=8,
            average_moment=kind == "overlap-moment",
            normalizer="local",
            window_order="spread" if kind == "overlap-spread" else "contiguous",
            overlap=True,
            **kw,
        )
    # the references below run plain AdamS per rank: the local normalizer
    if kind == "staggered-spread":
        return LocalAdamS(
            params, schedule="staggered", wire_dtype=torch.float32, normalizer="local", window_order="spread", **kw
        )
    if kind.endswith("-moment"):
        return LocalAdamS(
            params,
            schedule=kind[:-7],
            wire_bits=8,
            average_moment=True,
            normalizer="local",
            window_order="contiguous",
            **kw,
        )
    if kind.endswith("-int4"):
        return LocalAdamS(params, schedule=kind[:-5], wire_bits=4, normalizer="local", window_order="contiguous", **kw)
    if kind.endswith("-bf16"):
        return LocalAdamS(
            params, schedule=kind[:-5], wire_dtype=torch.bfloat16, wire_bits=None, normalizer="local", **kw
        )
    return LocalAdamS(params, schedule=kind, wire_dtype=torch.float32, normalizer="local", **kw)


def _rank_run(rank: int, ws: int, kind: str, density: float) -> dict:
    model = _model()
    opt = _make(kind, model.parameters(), density)
    stats = opt.communicator.stats
    flats, windows, sent, anchors, moments, moment_anchors = [], [], [], [], [], []
    for t in range(STEPS):
        before = stats.as_dict()
        _step(model, opt, rank, t)
        after = stats.as_dict()
        sent.append({op: after[op]["bytes_sent"] - before.get(op, {"bytes_sent": 0})["bytes_sent"] for op in after})
        flats.append(_flat(model).tolist())
        anchors.append(None if getattr(opt, "anchor", None) is None else opt.anchor[: opt.bucket.numel].tolist())
        state = getattr(opt, "replica_state", {})
        if "exp_avg_anchor" in state:
            moments.append(state["exp_avg"][: opt.bucket.numel].tolist())
            moment_anchors.append(state["exp_avg_anchor"][: opt.bucket.numel].tolist())
        if (kind.startswith("staggered") or kind.startswith("overlap")) and t >= WARM:
            windows.append(opt.window(t).global_indices().tolist())
    avg = None
    if kind != "topk":
        with opt.averaged():
            avg = _flat(model).tolist()
    own_after = _flat(model).tolist()
    landed = None
    if getattr(opt, "overlap", False):
        opt.close()  # the last averaging lands
        landed = _flat(model).tolist()
    total = {op: d["bytes_sent"] for op, d in stats.as_dict().items()}
    cover = []
    if kind.startswith("staggered"):
        span = math.ceil(opt.bucket.shard_size / opt.k)
        cover = [opt.window(t).piece(0).tolist() for t in range(WARM, WARM + span)]
    return {
        "flats": flats,
        "anchors": anchors,
        "moments": moments,
        "moment_anchors": moment_anchors,
        "windows": windows,
        "cover": cover,
        "sent": sent,
        "avg": avg,
        "own_after": own_after,
        "landed": landed,
        "total_sent": total,
        "k": opt.k,
        "shard": opt.bucket.shard_size,
        "numel": opt.bucket.numel,
    }


def _moments(opts: list, models: list) -> list[torch.Tensor]:
    return [
        torch.cat([o.state[p]["exp_avg"].reshape(-1) for p in m.parameters()])
        for o, m in zip(opts, models, strict=True)
    ]


def _set_moments(opts: list, models: list, ms: list[torch.Tensor]) -> None:
    for x, o, m in zip(ms, opts, models, strict=True):
        torch.nn.utils.vector_to_parameters(x, [o.state[p]["exp_avg"] for p in m.parameters()])


def _reference_local(
    ws: int,
    kind: str,
    density: float,
    k: int,
    shard: int,
    windows: list,
    *,
    moment: bool = False,
    late: bool = False,
) -> list[list[torch.Tensor]]:
    """One AdamS per rank on its own batches; window (or periodic) averages; the warm-up averages gradients.

    ``moment``: the first moments are averaged at the same positions as the parameters. ``late``: the
    average of the positions read after step ``t`` lands after step ``t + 1``: each replica gets the average
    minus its own value read then added to its current one.
    """
    from optim import AdamS

    models = [_model() for _ in range(ws)]
    opts = [AdamS(m.parameters(), lr=0.05, weight_decay=0.1, foreach=False) for m in models]  # decay: matrices
    period = max(1, round(1 / density))
    pending: tuple[torch.Tensor, list[list[torch.Tensor]]] | None = None
    out = []
    for t in range(STEPS):
        grads = []
        for r, m in enumerate(models):
            m.zero_grad()
            _loss(m, r, t).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        if t < WARM:
            for m in models:
                for i, p in enumerate(m.parameters()):
                    p.grad = torch.stack([g[i] for g in grads]).sum(0) / ws
        for o in opts:
            o.step()
        flats = [_flat(m) for m in models]
        if late:  # land the average read after the last step, then read this step's window
            bufs = [flats] + ([_moments(opts, models)] if moment else [])
            if pending is not None:
                pos, reads = pending
                for buf, read in zip(bufs, reads, strict=True):
                    mean = torch.stack(read).sum(0) / ws
                    for x, own in zip(buf, read, strict=True):
                        x[pos] += mean - own
            if t >= WARM:
                pos = torch.tensor([i for i in windows[t - WARM] if i < flats[0].numel()], dtype=torch.long)
                pending = (pos, [[x[pos].clone() for x in buf] for buf in bufs])
            for f, m in zip(flats, models, strict=True):
                torch.nn.utils.vector_to_parameters(f, m.parameters())
            if moment:
                _set_moments(opts, models, bufs[1])
        elif t >= WARM:
            if kind == "periodic":
                pos = (
                    torch.arange(flats[0].numel()) if (t + 1 - WARM) % period == 0 else torch.zeros(0, dtype=torch.long)
                )
            else:
                pos = torch.tensor([i for i in windows[t - WARM] if i < flats[0].numel()], dtype=torch.long)
            mean = torch.stack([f[pos] for f in flats]).sum(0) / ws
            for f, m in zip(flats, models, strict=True):
                f[pos] = mean
                torch.nn.utils.vector_to_parameters(f, m.parameters())
            if moment:
                ms = _moments(opts, models)
                mean = torch.stack([x[pos] for x in ms]).sum(0) / ws
                for x in ms:
                    x[pos] = mean
                _set_moments(opts, models, ms)
        out.append([f.clone() for f in flats])
    return out


@pytest.mark.parametrize("ws,density", [(2, 0.25), (3, 0.1)])
@pytest.mark.parametrize("kind", ["staggered", "staggered-spread"])
def test_staggered_matches_reference_and_window_is_identical(ws: int, density: float, kind: str) -> None:
    res = run_ranks(_rank_run, ws, kind, density, timeout=120, op_timeout=60)
    k, shard, numel = res[0]["k"], res[0]["shard"], res[0]["numel"]
    assert k == math.ceil(density * shard)
    windows = res[0]["windows"]
    assert all(r["windows"] == windows for r in res)
    ref = _reference_local(ws, "staggered", density, k, shard, windows)
    for t in range(STEPS):
        got = [torch.tensor(r["flats"][t]) for r in res]
        for r in range(ws):
            assert torch.allclose(got[r], ref[t][r], rtol=1e-5, atol=1e-6), (t, r, (got[r] - ref[t][r]).abs().max())
        if t < WARM:
            assert all(torch.equal(got[0], g) for g in got)  # the warm-up keeps the replicas identical
        else:
            pos = torch.tensor([i for i in windows[t - WARM] if i < numel])
            assert all(torch.equal(got[0][pos], g[pos]) for g in got)  # averaged positions: bitwise the same
            assert not all(torch.equal(got[0], g) for g in got)  # the rest: each rank's own steps
    # every position is averaged within ceil(shard / k) consecutive steps
    assert len(res[0]["cover"]) == math.ceil(shard / k)
    assert {i for w in res[0]["cover"] for i in w} == set(range(shard))
    # wire: the window's values (sparse reduce-scatter + all-gather), no mask, no clip scalar
    for t, sent in enumerate(res[0]["sent"]):
        if t < WARM:
            assert set(k_ for k_, v in sent.items() if v) == {"all_reduce"}
        else:
            assert {op for op, v in sent.items() if v} == {"sparse_all_reduce"}
            assert sent["sparse_all_reduce"] == 2 * (ws - 1) * k * 4
    # averaged(): every rank sees the same mean of the replicas; its own comes back afterwards
    mean = torch.stack([torch.tensor(r["flats"][-1]) for r in res]).mean(0)
    for r in res:
        assert torch.allclose(torch.tensor(r["avg"]), mean, atol=1e-6)
        assert r["avg"] == res[0]["avg"]
        assert r["own_after"] == r["flats"][-1]


def test_periodic_averages_every_period() -> None:
    ws, density = 2, 0.34  # period 3
    res = run_ranks(_rank_run, ws, "periodic", density, timeout=120, op_timeout=60)
    ref = _reference_local(ws, "periodic", density, res[0]["k"], res[0]["shard"], [])
    for t in range(STEPS):
        got = [torch.tensor(r["flats"][t]) for r in res]
        for r in range(ws):
            assert torch.allclose(got[r], ref[t][r], rtol=1e-5, atol=1e-6), (t, r)
        same = torch.equal(got[0], got[1])
        averaged = t < WARM or (t + 1 - WARM) % 3 == 0
        assert same == averaged, t
        assert (res[0]["sent"][t].get("all_reduce", 0) > 0) == averaged


def _reference_topk(ws: int, k: int) -> list[torch.Tensor]:
    from optim import AdamS

    model = _model()
    opt = AdamS(model.parameters(), lr=0.05, weight_decay=0.1, foreach=False)
    n = _flat(model).numel()
    residual = [torch.zeros(n) for _ in range(ws)]
    out = []
    for t in range(STEPS):
        gs = []
        for r in range(ws):
            model.zero_grad()
            _loss(model, r, t).backward()
            gs.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        if t < WARM:
            g = torch.stack(gs).sum(0) / ws
        else:
            g = torch.zeros(n)
            for r in range(ws):
                e = residual[r] + gs[r]
                idx = torch.topk(e.abs(), k).indices
                g[idx] += e[idx]
                e[idx] = 0.0
                residual[r] = e
            g /= ws
        torch.nn.utils.vector_to_parameters(g, [p.grad for p in model.parameters()])
        opt.step()
        out.append(_flat(model))
    return out


def test_topk_replicas_identical_and_match_reference() -> None:
    ws, density = 2, 0.2
    res = run_ranks(_rank_run, ws, "topk", density, timeout=120, op_timeout=60)
    k = res[0]["k"]
    ref = _reference_topk(ws, k)
    for t in range(STEPS):
        assert res[0]["flats"][t] == res[1]["flats"][t], t
        assert torch.allclose(torch.tensor(res[0]["flats"][t]), ref[t], rtol=1e-5, atol=1e-6), t
    for t, sent in enumerate(res[0]["sent"]):
        if t >= WARM:
            assert {op for op, v in sent.items() if v} == {"topk"}
            assert sent["topk"] == (ws - 1) * k * (4 + 4)  # fp32 values + int32 indices


def _rank_resume(rank: int, ws: int, kind: str, via: str) -> dict:
    from optim.state.snapshot import decode_tree, encode_tree

    a = _model()
    oa = _make(kind, a.parameters(), 0.25)
    for t in range(4):
        _step(a, oa, rank, t)
    saved = encode_tree(oa.snapshot_state()) if via == "snapshot" else oa.state_dict()
    import copy

    saved = copy.deepcopy(saved)
    cont = []
    for t in range(4, 8):
        _step(a, oa, rank, t)
        cont.append(_flat(a).tolist())
    if hasattr(oa, "close"):
        oa.close()  # one optimizer's averaging at a time on a communicator
    b = _model(seed=5)  # other values: the load must bring this rank's replica back
    ob = _make(kind, b.parameters(), 0.25)
    if via == "snapshot":
        ob.restore_snapshot(decode_tree(saved))
        ob.resync_params()
    else:
        ob.load_state_dict(saved)
    again = []
    for t in range(4, 8):
        _step(b, ob, rank, t)
        again.append(_flat(b).tolist())
    return {"cont": cont, "again": again}


@pytest.mark.parametrize(
    "kind",
    ["staggered", "staggered-bf16", "staggered-int4", "default", "debiased", "measured", "topk", "overlap", "lean"],
)
@pytest.mark.parametrize("via", ["snapshot", "state_dict"])
def test_resume_is_bitwise(kind: str, via: str) -> None:
    res = run_ranks(_rank_resume, 2, kind, via, timeout=120, op_timeout=60)
    for r in res:
        assert r["cont"] == r["again"]


def _rank_snapshot(rank: int, ws: int) -> bytes:
    from optim.state.snapshot import encode_tree

    model = _model()
    opt = _make("staggered-int4", model.parameters(), 0.25)
    for t in range(5):
        _step(model, opt, rank, t)
    import io

    buf = io.BytesIO()
    torch.save(encode_tree(opt.snapshot_state()), buf)
    return buf.getvalue()


def _rank_restore_replica(rank: int, ws: int, saved: list[bytes]) -> dict:
    import io

    from optim.state.snapshot import decode_tree

    model = _model(seed=5)
    opt = _make("staggered-int4", model.parameters(), 0.25)
    snap = decode_tree(torch.load(io.BytesIO(saved[1]), weights_only=False))  # the old rank 1's replica
    opt.restore_replica(snap)
    return {
        "residual": opt.replica_state["wire_residual"].tolist(),
        "saved": snap["extra"]["wire_residual"].tolist(),
        "params": _flat(model).tolist(),
        "saved_params": snap["extra"]["params"][: opt.bucket.numel].tolist(),
        "shard_lo": opt.bucket.shard_lo,
    }


def test_restore_replica_in_another_layout_keeps_the_owner_residual_where_the_rank_owned_it_then_and_now() -> None:
    """A 2-rank snapshot into 1 rank: the old rank 1's residual lands on the positions it owned, zero elsewhere."""
    saved = run_ranks(_rank_snapshot, 2, timeout=120, op_timeout=60)
    (got,) = run_ranks(_rank_restore_replica, 1, saved, timeout=120, op_timeout=60)
    assert got["params"] == got["saved_params"]
    old_shard = len(got["saved"])
    assert any(v != 0.0 for v in got["saved"])
    numel = len(got["params"])
    expected = [0.0] * old_shard + got["saved"][: numel - old_shard]
    assert got["residual"][:numel] == expected


def _rank_auto_normalizer(rank: int, ws: int) -> list[tuple[str, bool]]:
    from optim import LocalAdamS

    out = []
    for kw in ({"density": 0.1}, {"density": 0.01}, {"density": 0.1, "wire_dtype": torch.float32}):
        opt = LocalAdamS(_model().parameters(), **kw)
        out.append((opt.normalizer, opt.noise is not None))
    return out


def test_auto_normalizer_is_measured_where_the_window_covers_under_half_the_shard() -> None:
    res = run_ranks(_rank_auto_normalizer, 2, timeout=60, op_timeout=30)
    # 4-bit codes at 0.1 cover 75% of the shard per step; 1-bit codes at 0.01 25.6%; float32 values at 0.1 10%
    assert res[0] == res[1] == [("debiased", False), ("measured", True), ("measured", True)]


def _rank_bad(rank: int, ws: int) -> list[str]:
    from optim import LocalAdamS, TopKAdamS

    out = []
    m = _model()
    for make in (
        lambda: LocalAdamS(m.parameters(), density=0.0),
        lambda: LocalAdamS(m.parameters(), density=1.5),
        lambda: LocalAdamS(m.parameters(), schedule="ring"),
        lambda: LocalAdamS(m.parameters(), warmup_steps=-1),
        lambda: LocalAdamS(m.parameters(), window_order="random"),
        lambda: LocalAdamS(m.parameters(), wire_bits=3),
        lambda: LocalAdamS(m.parameters(), wire_bits=4, wire_dtype=torch.float32),
        lambda: LocalAdamS(m.parameters(), average_moment="yes"),
        lambda: LocalAdamS(m.parameters(), average_moment=True, wire_bits=None),
        lambda: TopKAdamS(m.parameters(), density=True),
        lambda: LocalAdamS(m.parameters(), overlap="yes"),
        lambda: LocalAdamS(m.parameters(), normalizer_dtype=torch.float16),
        lambda: LocalAdamS(m.parameters(), overlap=True, wire_bits=None),
        lambda: LocalAdamS(m.parameters(), density=0.1 if rank == 0 else 0.2),  # differs between ranks
    ):
        try:
            make()
            out.append("ok")
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_bad_arguments_raise_the_same_everywhere() -> None:
    res = run_ranks(_rank_bad, 2, timeout=60, op_timeout=30)
    for msgs in res:
        assert all(m != "ok" for m in msgs), msgs
    assert res[0][:-1] == res[1][:-1]
    assert "differ between ranks" in res[0][-1] and "differ between ranks" in res[1][-1]


@pytest.mark.parametrize("kind", ["staggered-bf16", "periodic-bf16"])
def test_bfloat16_wire_averages_twice_as_much_for_the_same_bytes(kind: str) -> None:
    """bfloat16 changes since the last average: the same replicas as float32 values up to that rounding."""
    ws, density = 2, 0.125
    res = run_ranks(_rank_run, ws, kind, density, timeout=120, op_timeout=60)
    k, shard, numel = res[0]["k"], res[0]["shard"], res[0]["numel"]
    assert k == math.ceil(2 * density * shard)  # twice the positions of a float32 window
    schedule = kind[:-5]
    ref = _reference_local(ws, schedule, 2 * density, k, shard, res[0]["windows"])  # period 4, not 8
    for t in range(STEPS):
        got = [torch.tensor(r["flats"][t]) for r in res]
        for r in range(ws):
            err = (got[r] - ref[t][r]).abs()
            # bfloat16 rounds each change by <= 2**-9 relative; AdamS may amplify it where m is near 0, never
            # beyond one step (lr 0.05)
            assert err.mean() < 1e-3 and err.max() < 0.05, (t, r, err.mean(), err.max())
        if t >= WARM and schedule == "staggered":
            pos = torch.tensor([i for i in res[0]["windows"][t - WARM] if i < numel])
            assert torch.equal(got[0][pos], got[1][pos])  # the new anchor is the same on every rank
            assert res[0]["sent"][t]["sparse_all_reduce"] == 2 * (ws - 1) * k * 2  # bfloat16 on the wire
        if t >= WARM and schedule == "periodic":
            averaged = (t + 1 - WARM) % 4 == 0
            assert torch.equal(got[0], got[1]) == averaged, t
            assert res[0]["sent"][t].get("all_reduce", 0) == (
                2 * (ws - 1) * math.ceil(numel / ws) * 2 if averaged else 0
            )


@pytest.mark.parametrize("kind", ["staggered-int4", "periodic-int4"])
def test_int4_wire_averages_more_positions_and_keeps_what_it_drops(kind: str) -> None:
    """4-bit changes with error feedback: 32 / 4.25 times the float32 window; the anchor is the same everywhere."""
    from sparsecomm.quantized import Quantizer

    ws, density = 2, 0.05
    res = run_ranks(_rank_run, ws, kind, density, timeout=120, op_timeout=60)
    k, shard, numel = res[0]["k"], res[0]["shard"], res[0]["numel"]
    wire_density = density * 32 / 4.25
    assert k == math.ceil(wire_density * shard)
    schedule = kind[:-5]
    period = round(1 / wire_density)  # 3
    ref = _reference_local(ws, schedule, wire_density, k, shard, res[0]["windows"])
    code_bytes = Quantizer(bits=4).encoded_bytes
    for t in range(STEPS):
        got = [torch.tensor(r["flats"][t]) for r in res]
        anchors = [torch.tensor(r["anchors"][t]) for r in res]
        assert torch.equal(anchors[0], anchors[1]), t  # every rank holds the same last average
        for r in range(ws):
            err = (got[r] - ref[t][r]).abs()
            # each rank keeps what the codes dropped, so it trails the exact average by a fraction of one step (lr
            # 0.05); the collective itself is checked bit for bit in tests/common/quantized_cases.py
            assert err.mean() < 0.01 and err.max() < 0.05, (t, r, err.mean(), err.max())
        if t < WARM:
            continue
        sent = res[0]["sent"][t]
        if schedule == "staggered":
            pos = torch.tensor([i for i in res[0]["windows"][t - WARM] if i < numel])
            for r in range(ws):  # a replica is the anchor plus its own encoding error at the averaged positions
                assert (got[r][pos] - anchors[r][pos]).abs().max() < 0.02, (t, r)
            assert {op for op, v in sent.items() if v} == {"quantized_all_reduce"}
            assert sent["quantized_all_reduce"] == 2 * (ws - 1) * code_bytes(k)
        else:
            averaged = (t + 1 - WARM) % period == 0
            assert sent.get("quantized_all_reduce", 0) == (2 * (ws - 1) * code_bytes(shard) if averaged else 0), t


@pytest.mark.parametrize("kind", ["staggered-moment", "periodic-moment"])
def test_average_moment_carries_the_first_moments_in_the_same_bytes(kind: str) -> None:
    """average_moment: the window averages the first moments' changes too, half the positions for the same bytes."""
    from sparsecomm.quantized import Quantizer

    ws, density = 2, 0.1
    res = run_ranks(_rank_run, ws, kind, density, timeout=120, op_timeout=60)
    k, shard, numel = res[0]["k"], res[0]["shard"], res[0]["numel"]
    wire_density = density * 32 / (2 * 8.25)  # two buffers' 8-bit codes per position
    assert k == math.ceil(wire_density * numel / ws)
    schedule = kind[: -len("-moment")]
    period = round(1 / wire_density)  # 5
    windows = res[0]["windows"]
    ref = _reference_local(ws, schedule, wire_density, k, shard, windows, moment=True)
    alone = _reference_local(ws, schedule, wire_density, k, shard, windows)  # the parameters alone averaged
    code_bytes = Quantizer(bits=8).encoded_bytes
    for t in range(STEPS):
        got = [torch.tensor(r["flats"][t]) for r in res]
        for name in ("anchors", "moment_anchors"):
            assert torch.equal(torch.tensor(res[0][name][t]), torch.tensor(res[1][name][t])), (name, t)
        for r in range(ws):
            err = (got[r] - ref[t][r]).abs()
            # each rank keeps what the codes dropped in its parameters and first moment: a small lag, no drift
            assert err.mean() < 2e-3 and err.max() < 0.01, (t, r, err.mean(), err.max())
        if t < WARM:
            assert res[0]["moments"][t] == res[1]["moments"][t]  # averaged gradients: the same first moments
            continue
        sent = res[0]["sent"][t]
        if schedule == "staggered":
            pos = torch.tensor([i for i in windows[t - WARM] if i < numel])
            for r in range(ws):  # a first moment is its anchor plus its own encoding error at the averaged positions
                m, anchor = torch.tensor(res[r]["moments"][t]), torch.tensor(res[r]["moment_anchors"][t])
                assert (m[pos] - anchor[pos]).abs().max() < 0.01 * m.abs().max(), (t, r)
            assert sent["quantized_all_reduce"] == 2 * 2 * (ws - 1) * code_bytes(k)  # parameters, first moments
        else:
            averaged = (t + 1 - WARM) % period == 0
            assert sent.get("quantized_all_reduce", 0) == (4 * (ws - 1) * code_bytes(shard) if averaged else 0), t
        assert {op for op, v in sent.items() if v} <= {"quantized_all_reduce"}
    # by the end the run is far nearer the reference that averages the first moments than the one that does not
    for r in range(ws):
        last = torch.tensor(res[r]["flats"][-1])
        assert (last - ref[-1][r]).abs().mean() < 0.1 * (last - alone[-1][r]).abs().mean(), r


@pytest.mark.parametrize("kind", ["overlap-contiguous", "overlap-spread", "overlap-moment"])
def test_overlap_lands_each_average_one_step_late(kind: str) -> None:
    """overlap: the window read after step t is averaged beside step t + 1 and lands after its update.

    Each replica then gets the average minus its own change as read (8-bit codes, so a small lag), the anchor
    stays the same everywhere, and the wire carries the same bytes as without overlap.
    """
    from sparsecomm.quantized import Quantizer

    ws, density, moment = 2, 0.1, kind == "overlap-moment"
    res = run_ranks(_rank_run, ws, kind, density, timeout=120, op_timeout=60)
    k, shard, numel = res[0]["k"], res[0]["shard"], res[0]["numel"]
    buffers = 2 if moment else 1
    wire_density = min(1.0, density * 32 / (buffers * 8.25))
    assert k == math.ceil(wire_density * numel / ws)
    windows = res[0]["windows"]
    assert all(r["windows"] == windows for r in res)
    late = _reference_local(ws, "staggered", wire_density, k, shard, windows, moment=moment, late=True)
    now = _reference_local(ws, "staggered", wire_density, k, shard, windows, moment=moment)
    for t in range(STEPS):
        got = [torch.tensor(r["flats"][t]) for r in res]
        assert torch.equal(torch.tensor(res[0]["anchors"][t]), torch.tensor(res[1]["anchors"][t])), t
        for r in range(ws):
            err = (got[r] - late[t][r]).abs()
            assert err.mean() < 2e-3 and err.max() < 0.02, (t, r, err.mean(), err.max())
        if t <= WARM:  # the warm-up, and the first local step (its average is still in flight)
            assert torch.equal(torch.tensor(res[0]["anchors"][t]), torch.tensor(res[0]["flats"][t])) == (t < WARM)
    for r in range(ws):  # far nearer the late reference than the one that lands at once
        last = torch.tensor(res[r]["flats"][-1])
        assert (last - late[-1][r]).abs().mean() < 0.2 * (last - now[-1][r]).abs().mean(), r
    # the same bytes as landing at once: every local step's window, once
    sent = res[0]["total_sent"]
    assert sent["quantized_all_reduce"] == (STEPS - WARM) * buffers * 2 * (ws - 1) * Quantizer(bits=8).encoded_bytes(k)
    # averaged() is the mean of the replicas as they are once the average in flight landed
    landed = torch.stack([torch.tensor(r["landed"]) for r in res])
    for r in res:
        assert torch.allclose(torch.tensor(r["avg"]), landed.mean(0), atol=1e-6)
        assert r["own_after"] == r["flats"][-1]  # and the replica is as it was


def _rank_overlap_eval(rank: int, ws: int, evaluate: bool) -> list[list[float]]:
    model = _model()
    opt = _make("overlap", model.parameters(), 0.1)
    flats = []
    for t in range(STEPS):
        _step(model, opt, rank, t)
        if evaluate:
            with opt.averaged():
                pass
        flats.append(_flat(model).tolist())
    opt.close()
    return flats


def test_overlap_evaluating_inside_averaged_does_not_change_the_run() -> None:
    plain = run_ranks(_rank_overlap_eval, 2, False, timeout=120, op_timeout=60)
    evaluated = run_ranks(_rank_overlap_eval, 2, True, timeout=120, op_timeout=60)
    assert plain == evaluated
    assert plain[0][-1] != plain[1][-1]  # the replicas differ: there was something to average


def _rank_ahead(rank: int, ws: int, where: str, overlap: bool, patience_s: float) -> bool:
    """Rank 1 starts its first local step only once rank 0's returned; False if it waited ``patience_s`` in vain."""
    import time
    from pathlib import Path

    from optim import LocalAdamS

    model = _model()
    opt = LocalAdamS(model.parameters(), lr=0.05, density=0.1, warmup_steps=WARM, overlap=overlap)
    flag = Path(where) / "rank0-returned"
    ok = True
    for t in range(WARM + 2):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        if rank == 1 and t == WARM:
            deadline = time.monotonic() + patience_s
            while not flag.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            ok = flag.exists()
        opt.step()
        if rank == 0 and t == WARM:
            flag.touch()
    opt.close()
    return ok


def test_overlap_step_returns_before_the_peers_reach_theirs(tmp_path) -> None:
    """With overlap a step's averaging runs on after step() returns: a rank goes on while its peer computes."""
    assert run_ranks(_rank_ahead, 2, str(tmp_path), True, 30.0, timeout=120, op_timeout=60) == [True, True]
    # without it, rank 0's step waits for rank 1's, which waits for rank 0's to return: rank 1 gives up
    (tmp_path / "sync").mkdir()
    assert run_ranks(_rank_ahead, 2, str(tmp_path / "sync"), False, 3.0, timeout=120, op_timeout=60) == [True, False]


def _rank_auto_moment(rank: int, ws: int) -> list[tuple[bool, int | None, float]]:
    from optim import LocalAdamS

    out = []
    for kw in (
        {"density": 0.1},
        {"density": 0.01},
        {"density": 0.1, "wire_bits": 4},
        {"density": 0.1, "wire_dtype": torch.float32},
    ):
        opt = LocalAdamS(_model().parameters(), **kw)
        out.append((opt.average_moment, opt.wire_bits, round(opt.wire_density, 4)))
    return out


def test_average_moment_auto_is_on_where_the_window_of_the_parameters_alone_covers_half_the_shard() -> None:
    res = run_ranks(_rank_auto_moment, 2, timeout=60, op_timeout=30)
    assert (
        res[0]
        == res[1]
        == [
            (True, 2, round(0.1 * 32 / (2 * 2.25), 4)),  # 2-bit codes of both buffers cover 71% of the shard per step
            (False, 1, round(0.01 * 32 / 1.25, 4)),
            (True, 4, round(0.1 * 32 / (2 * 4.25), 4)),  # the code width given: half the positions
            (False, None, 0.1),
        ]
    )


def _rank_written(rank: int, ws: int) -> dict:
    from optim import LocalAdamS

    model = _model().to(torch.bfloat16)  # not views of the fp32 replica: writes must be noticed
    opt = LocalAdamS(model.parameters(), lr=1e-3, density=0.5, warmup_steps=1)

    def step(t: int) -> None:
        opt.zero_grad()
        g = torch.Generator().manual_seed(1000 * t + rank)
        x, y = torch.randn(12, 6, generator=g, dtype=torch.bfloat16), torch.randint(0, 3, (12,), generator=g)
        torch.nn.functional.cross_entropy(model(x).float(), y).backward()
        opt.step()

    for t in range(3):
        step(t)
    new = {k: v * 0.5 + 0.25 for k, v in model.state_dict().items()}
    model.load_state_dict(new)  # in place
    step(3)
    got = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    want = torch.cat([new[k].float().reshape(-1) for k, _ in model.named_parameters()])
    return {"err": float((got - want).abs().max())}


def test_values_written_into_low_precision_params_are_taken() -> None:
    res = run_ranks(_rank_written, 2, timeout=60, op_timeout=30)
    for r in res:
        assert r["err"] < 0.02, r  # one small step from the written values, not the old ones (>= 0.25 away)


def _rank_noisy_signal(rank: int, ws: int, normalizer: str) -> float:
    """Gradients mu + noise (signal-to-noise 0.1 per rank): how far does the averaged model move along mu?"""
    from optim import LocalAdamS

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(400))
    mu = torch.full((400,), 0.1)
    opt = LocalAdamS([w], lr=0.01, density=1.0, warmup_steps=0, wire_dtype=torch.float32, normalizer=normalizer)
    for t in range(60):
        noise = torch.randn(400, generator=torch.Generator().manual_seed(1000 * t + rank))
        opt.zero_grad()
        (w * (mu + noise)).sum().backward()
        opt.step()
    return float(-w.detach().mean())  # every rank holds the average (density 1)


def _dense_noisy_signal(ws: int) -> float:
    from optim import AdamS

    w = torch.nn.Parameter(torch.zeros(400))
    mu = torch.full((400,), 0.1)
    opt = AdamS([w], lr=0.01)
    for t in range(60):
        noise = torch.stack(
            [torch.randn(400, generator=torch.Generator().manual_seed(1000 * t + r)) for r in range(ws)]
        )
        w.grad = mu + noise.mean(0)
        opt.step()
    return float(-w.detach().mean())


def test_debiased_normalizer_moves_low_signal_coordinates_like_dense_adams() -> None:
    """Plain per-rank AdamS normalizes by ws times the noise and moves the signal about sqrt(ws) times less."""
    ws = 4
    dense = _dense_noisy_signal(ws)
    plain = run_ranks(_rank_noisy_signal, ws, "local", timeout=120, op_timeout=60)[0]
    debiased = run_ranks(_rank_noisy_signal, ws, "debiased", timeout=120, op_timeout=60)[0]
    assert dense > 0 and plain > 0
    assert plain < 0.75 * dense  # the effect being corrected
    # measured: plain 0.53x, debiased 0.69x of dense AdamS's displacement (the instantaneous g**2 of one rank
    # still has a heavier tail than that of the average): closer, never past dense
    assert 1.2 * plain < debiased < 1.05 * dense, (dense, plain, debiased)


def _rank_measured_share(rank: int, ws: int, shared: bool) -> dict:
    """Gradients that differ across ranks (batch noise) or are the same on every rank but flip sign over the steps."""
    from optim import LocalAdamS

    w = torch.nn.Parameter(torch.zeros(3000))
    opt = LocalAdamS([w], lr=0.01, density=0.1, warmup_steps=2, wire_dtype=torch.float32, normalizer="measured")
    mu = torch.full((3000,), 0.05)
    rhos = []
    for t in range(40):
        seed = 1000 * t + (0 if shared else rank + 1)
        noise = torch.randn(3000, generator=torch.Generator().manual_seed(seed))
        opt.zero_grad()
        (w * (mu + noise)).sum().backward()
        opt.step()
        assert opt.noise is not None
        rhos.append(opt.noise.rho)
    return {"rhos": rhos, "noise_bytes": opt.communicator.stats.as_dict()["noise"]["bytes_sent"]}


@pytest.mark.parametrize("shared", [False, True])
def test_measured_normalizer_takes_out_only_the_noise_across_ranks(shared: bool) -> None:
    """The same noise on every rank is no batch noise: the measured share falls to ~0 (rho the same everywhere)."""
    res = run_ranks(_rank_measured_share, 4, shared, timeout=120, op_timeout=60)
    assert all(r["rhos"] == res[0]["rhos"] for r in res)
    rhos = res[0]["rhos"]
    assert rhos[:2] == [1.0, 1.0]  # the warm-up: nothing measured
    if shared:
        assert sum(rhos[10:]) / 30 < 0.08 and max(rhos[10:]) < 0.2, rhos
    else:  # i.i.d. noise per rank: the per-coordinate estimate is right, up to the sketch's error
        assert min(rhos[10:]) > 0.7, rhos
    assert 0 < res[0]["noise_bytes"] <= 38 * (64 + 2) * 4 * 2  # 38 local steps of one tiny all_reduce each


def _rank_single(rank: int, ws: int) -> list[float]:
    from optim import LocalAdamS

    model = _model()
    opt = LocalAdamS(model.parameters(), lr=0.05, weight_decay=0.1, density=0.5, warmup_steps=2)
    for t in range(6):
        _step(model, opt, rank, t)
    return _flat(model).tolist()


def test_one_rank_is_plain_adams() -> None:
    from optim import AdamS

    got = torch.tensor(run_ranks(_rank_single, 1, timeout=60, op_timeout=30)[0])
    model = _model()
    opt = AdamS(model.parameters(), lr=0.05, weight_decay=0.1, foreach=False)
    for t in range(6):
        _step(model, opt, 0, t)
    assert torch.allclose(got, _flat(model), rtol=1e-5, atol=1e-6)
