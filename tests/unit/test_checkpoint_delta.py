"""Delta checkpoints: the codec (:mod:`optim.state.delta`) and the store's chains, retention and refusals."""

from __future__ import annotations

import random

import pytest
import torch

from optim.state import lossy
from optim.state.checkpoint import CheckpointError, CheckpointStore
from optim.state.delta import apply_delta, encode_delta
from optim.state.snapshot import decode_tree, encode_tree

FP = "f" * 32


def _tree(step: int, w: torch.Tensor, m: torch.Tensor) -> dict:
    return {"step": step, "master": w, "shard": {"exp_avg": m}, "losses": torch.rand(step, 2, dtype=torch.float64)}


def _bytes(tree: dict) -> bytes:
    return encode_tree(tree).numpy().tobytes()


def _sparse_change(w: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = w.clone()
    idx = torch.randperm(w.numel(), generator=g)[: int(frac * w.numel())]
    out[idx] += torch.randn(idx.numel(), generator=g)
    return out


_rnd = random.Random(7)
_CASES = [(_rnd.uniform(0.0, 0.3), _rnd.randrange(1000), _rnd.randrange(1, 5000), _rnd.randrange(4)) for _ in range(40)]


@pytest.mark.parametrize(("frac", "seed", "n", "tail"), _CASES + [(0.0, 0, 1, 0), (1.0, 1, 7, 3)])
def test_delta_round_trip_is_exact(frac: float, seed: int, n: int, tail: int) -> None:
    w = torch.randn(n)
    old = {**_tree(3, w, w * 2), "odd": torch.arange(tail, dtype=torch.uint8)}
    new = {**_tree(4, _sparse_change(w, frac, seed), w * 2), "odd": torch.arange(tail, dtype=torch.uint8) + 1}
    a, b = _bytes(old), _bytes(new)
    delta = encode_delta(a, b, max_ratio=10.0)
    assert delta is not None
    assert apply_delta(a, delta) == b


def test_both_position_codings_are_used_and_exact() -> None:
    w = torch.randn(100_000)
    base = _bytes(_tree(1, w, w))
    for frac in (0.001, 0.2):  # few changes: an index list; many: a bitmask
        new = _bytes(_tree(2, _sparse_change(w, frac, 0), w))
        delta = encode_delta(base, new)
        assert delta is not None and apply_delta(base, delta) == new
        d = decode_tree(torch.frombuffer(bytearray(delta), dtype=torch.uint8))
        assert (d["mask"] is None) == (frac < 1 / 32), frac
    small = encode_delta(base, _bytes(_tree(2, _sparse_change(w, 0.01, 0), w)))
    assert small is not None and len(small) < len(base) / 10


def test_a_grown_tensor_costs_its_new_part_and_a_dense_change_gets_no_delta() -> None:
    w = torch.randn(10_000)
    base = _bytes(_tree(1, w, w))
    grown = _bytes({**_tree(1, w, w), "losses": torch.cat([_tree(1, w, w)["losses"], torch.ones(40, 2)])})
    delta = encode_delta(base, grown)
    assert delta is not None and len(delta) < 2000 and apply_delta(base, delta) == grown
    assert encode_delta(base, _bytes(_tree(2, torch.randn(10_000), torch.randn(10_000)))) is None  # all changed


def test_a_delta_on_the_wrong_base_is_caught() -> None:
    """The codec rebuilds whatever the base gives (the store's sha256 of the result catches a wrong base)."""
    w = torch.randn(1000)
    base, new = _bytes(_tree(1, w, w)), _bytes(_tree(2, _sparse_change(w, 0.01, 1), w))
    delta = encode_delta(base, new)
    assert delta is not None
    assert apply_delta(_bytes(_tree(1, w + 1, w)), delta) != new
    with pytest.raises(ValueError, match="not a checkpoint delta"):
        apply_delta(base, base)


def _payload(tree: dict) -> torch.Tensor:
    return encode_tree(tree)


def _run(store: CheckpointStore, steps: list[int], world: int = 2, frac: float = 0.01) -> dict[tuple[int, int], bytes]:
    """Write ``steps`` for every slot of ``world``; return what each file must read back as."""
    written = {}
    ws = {s: torch.randn(20_000, generator=torch.Generator().manual_seed(s)) for s in range(world)}
    for step in steps:
        for slot in range(world):
            ws[slot] = _sparse_change(ws[slot], frac, step * 10 + slot)
            payload = _payload(_tree(step, ws[slot], ws[slot] * 0.5))
            store.write(step, slot, world, FP, payload)
            written[(step, slot)] = payload.numpy().tobytes()
    return written


def test_store_writes_a_full_file_every_m_and_reads_every_step_back(tmp_path) -> None:
    store = CheckpointStore(tmp_path, keep=10, full_every=3)
    written = _run(store, [10, 20, 30, 40, 50, 60, 70])
    kinds = [w.kind for w in store.written if w.slot == 0]
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    full = [w.nbytes for w in store.written if w.kind == "full"]
    delta = [w.nbytes for w in store.written if w.kind == "delta"]
    assert max(delta) * 10 < min(full)
    fresh = CheckpointStore(tmp_path, keep=10, full_every=3)  # another process reads: nothing held in memory
    for (step, slot), data in written.items():
        assert fresh.read(step, slot, 2, FP).numpy().tobytes() == data


def test_retention_keeps_the_files_the_kept_deltas_build_on(tmp_path) -> None:
    store = CheckpointStore(tmp_path, keep=1, full_every=4)
    written = _run(store, [1, 2, 3, 4, 5, 6])  # full at 1 and 5; 6 is a delta on 5
    assert store.steps() == [5, 6]
    for slot in range(2):
        assert store.read(6, slot, 2, FP).numpy().tobytes() == written[(6, slot)]


def test_forget_and_a_new_layout_start_a_new_full_file(tmp_path) -> None:
    store = CheckpointStore(tmp_path, keep=5, full_every=8)
    _run(store, [1, 2])
    store.forget()
    _run(store, [3])
    _run(store, [4], world=3)  # another world size: nothing to build on
    kinds = {(w.step, w.slot): w.kind for w in store.written}
    assert kinds[(2, 0)] == "delta" and kinds[(3, 0)] == "full" and kinds[(4, 0)] == "full"


def test_a_corrupted_or_missing_base_fails_the_delta_loudly(tmp_path) -> None:
    store = CheckpointStore(tmp_path, keep=5, full_every=8)
    _run(store, [1, 2, 3])
    base = store.slot_file(1, 0)
    raw = bytearray(base.read_bytes())
    raw[-100] ^= 0xFF
    base.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupted"):
        store.read(3, 0, 2, FP)
    base.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        store.read(3, 0, 2, FP)
    assert store.read(1, 1, 2, FP) is not None  # the other slot's chain is whole


def test_full_every_is_checked() -> None:
    with pytest.raises(CheckpointError, match="full_every"):
        CheckpointStore("x", full_every=0)


# ---------------------------------------------------------------------- lossy first moment
def test_lossy_pack_rounds_only_the_named_float32_tensor() -> None:
    m = torch.randn(5001) * 1e-3
    tree = {**_tree(3, torch.randn(5001), m), "ints": torch.arange(7), "odd": torch.arange(3, dtype=torch.uint8)}
    full = _bytes(tree)
    packed = lossy.pack(full, ["shard/exp_avg"])
    assert packed is not None and len(packed) < len(full) - 2 * m.numel() + 1000
    back = decode_tree(torch.frombuffer(bytearray(lossy.unpack(packed)), dtype=torch.uint8))
    assert torch.equal(back["shard"]["exp_avg"], m.to(torch.bfloat16).float())  # round to nearest even
    assert torch.equal(back["master"], tree["master"]) and torch.equal(back["losses"], tree["losses"])
    assert torch.equal(back["ints"], tree["ints"]) and torch.equal(back["odd"], tree["odd"]) and back["step"] == 3
    assert lossy.pack(full, ["ints", "nothing"]) is None  # no float32 tensor named: nothing to round
    with pytest.raises(ValueError, match="not a lossy file"):
        lossy.unpack(full)


def _lossy_run(store: CheckpointStore, steps: list[int], beta: float = 0.9) -> dict[int, dict]:
    """SCAPE-like: the master changes on 1% of the coordinates, the first moment decays elsewhere."""
    g = torch.Generator().manual_seed(0)
    w, m = torch.randn(20_000, generator=g), torch.randn(20_000, generator=g)
    exact = {}
    for step in steps:
        w = _sparse_change(w, 0.01, step)
        m = m * beta
        idx = torch.randperm(m.numel(), generator=g)[:200]
        m[idx] = torch.randn(200, generator=g)
        tree = _tree(step, w, m)
        store.write(step, 0, 1, FP, _payload(tree), {"shard/exp_avg": beta}, ["shard/exp_avg"])
        exact[step] = tree
    return exact


def test_a_lossy_store_rounds_full_files_keeps_deltas_exact_and_checks_every_rebuild(tmp_path) -> None:
    store = CheckpointStore(tmp_path, keep=10, full_every=4, lossy=True)
    exact = _lossy_run(store, [1, 2, 3, 4, 5])
    assert [w.kind for w in store.written] == ["lossy", "delta", "delta", "delta", "lossy"]
    plain = CheckpointStore(tmp_path / "plain", keep=10, full_every=4)
    _lossy_run(plain, [1, 2, 3, 4, 5])
    lossy_full = [w.nbytes for w in store.written if w.kind == "lossy"]
    assert max(lossy_full) < 0.8 * min(w.nbytes for w in plain.written if w.kind == "full")
    fresh = CheckpointStore(tmp_path, keep=10, full_every=4)  # a reader needs no flag: the header says it
    for step, tree in exact.items():
        got = decode_tree(fresh.read(step, 0, 1, FP))
        assert torch.equal(got["master"], tree["master"])  # the master weights stay exact
        err = (got["shard"]["exp_avg"] - tree["shard"]["exp_avg"]).abs()
        assert float((err / tree["shard"]["exp_avg"].abs().clamp_min(1e-30)).max()) <= 2**-8
        assert float(err.max()) > 0  # rounded where nothing changed since the lossy file
    raw = bytearray(store.slot_file(1, 0).read_bytes())
    raw[-50] ^= 0x01  # one flipped bit in the lossy base
    store.slot_file(1, 0).write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupted"):
        fresh.read(3, 0, 1, FP)


def test_lossy_is_checked() -> None:
    with pytest.raises(CheckpointError, match="lossy"):
        CheckpointStore("x", lossy=1)  # type: ignore[arg-type]
