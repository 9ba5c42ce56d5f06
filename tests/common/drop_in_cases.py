"""Differential test bodies for ``sparsecomm.distributed``, shared by gloo and mpi runs.

Each ``case_*`` function runs inside one rank after ``init_process_group``.
Inputs are small integers drawn from a generator seeded by (seed, rank), so
every rank can compute every other rank's input, reductions are exact in
every dtype, and each result is checked against

* the single-process reference computed locally, and
* on gloo, ``torch.distributed``'s own result for the same call.

Every rank runs the same sequence of collectives whatever its data, so a
failed check raises locally without leaving peers blocked.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as tdist

import sparsecomm.distributed as dist

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)
SHAPES: tuple[tuple[int, ...], ...] = ((0,), (1,), (7,), (3, 5), (2, 3, 4), (0, 3), ())
OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")


def _reduction_cases() -> Iterator[tuple[int, torch.dtype, str, tuple[int, ...]]]:
    """Every (dtype index, dtype, op, shape) a reduction is checked on, in order: AVG on floating dtypes only."""
    for (i, dtype), op, shape in itertools.product(enumerate(DTYPES), OPS, SHAPES):
        if op != "AVG" or dtype.is_floating_point:
            yield i, dtype, op, shape


def make_input(
    seed: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype, *, small: bool = False
) -> torch.Tensor:
    """Deterministic small-integer tensor of (seed, rank)."""
    g = torch.Generator().manual_seed(seed * 1009 + rank * 7919 + 13)
    if small:  # for PRODUCT: values in {-1, 1, 2}
        choice = torch.tensor([-1, 1, 2])[torch.randint(0, 3, shape, generator=g)]
        return choice.to(dtype)
    return torch.randint(-4, 5, shape, generator=g).to(dtype)


def non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Return a non-contiguous tensor with the values and shape of ``t`` (2-D or more)."""
    if t.dim() < 2 or t.shape[-1] < 2 or t.shape[-2] < 2:
        return t
    base = t.transpose(-1, -2).contiguous()
    out = base.transpose(-1, -2)
    assert not out.is_contiguous()
    return out


def reduce_ref(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """Single-process reference reduction of the ranks' inputs."""
    dtype = inputs[0].dtype
    wide = torch.stack([x.to(torch.float64) if dtype.is_floating_point else x for x in inputs])
    if op == "SUM":
        r = wide.sum(0)
    elif op == "AVG":
        r = wide.sum(0) / len(inputs)
    elif op == "PRODUCT":
        r = wide.prod(0)
    elif op == "MIN":
        r = wide.min(0).values if wide.numel() else wide.sum(0)
    elif op == "MAX":
        r = wide.max(0).values if wide.numel() else wide.sum(0)
    else:
        raise ValueError(op)
    return r.to(dtype)


def _torch_ok() -> bool:
    return dist.get_backend() == "gloo" and tdist.is_initialized()


def _same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _maybe_wait(work: Any, async_op: bool) -> None:
    if async_op:
        assert work is not None, "async_op=True must return a work handle"
        assert work.wait() is True
    else:
        assert work is None, "blocking call must return None"


def case_all_reduce(rank: int, ws: int, seed: int = 0) -> int:
    """all_reduce over dtypes x ops x shapes x (contiguous, non-contiguous) x (sync, async)."""
    checks = 0
    for i, dtype, op, shape in _reduction_cases():
        small = op == "PRODUCT"
        inputs = [make_input(seed + i, r, shape, dtype, small=small) for r in range(ws)]
        expected = reduce_ref(inputs, op)
        for strided, async_op in ((False, False), (True, True)):
            t = non_contiguous(inputs[rank].clone()) if strided else inputs[rank].clone()
            work = dist.all_reduce(t, op=getattr(dist.ReduceOp, op), async_op=async_op)
            _maybe_wait(work, async_op)
            _same(t, expected, f"all_reduce {op} {dtype} {shape} strided={strided}")
            checks += 1
        if _torch_ok():
            ref = inputs[rank].clone()
            tdist.all_reduce(ref, op=getattr(tdist.ReduceOp, op))
            _same(ref, expected, f"torch all_reduce {op} {dtype}")
            checks += 1
    return checks


def case_broadcast(rank: int, ws: int, seed: int = 1) -> int:
    """broadcast from every root, by global and by group rank."""
    checks = 0
    for (i, dtype), shape, src in itertools.product(enumerate(DTYPES), SHAPES, range(ws)):
        inputs = [make_input(seed + i, r, shape, dtype) for r in range(ws)]
        t = inputs[rank].clone()
        dist.broadcast(t, src=src)
        _same(t, inputs[src], f"broadcast {dtype} {shape} src={src}")
        t2 = non_contiguous(inputs[rank].clone())
        work = dist.broadcast(t2, group_src=src, async_op=True)
        _maybe_wait(work, True)
        _same(t2, inputs[src], f"broadcast group_src {dtype} {shape}")
        checks += 2
        if _torch_ok():
            ref = inputs[rank].clone()
            tdist.broadcast(ref, src=src)
            _same(t, ref, "torch broadcast")
            checks += 1
    return checks


def case_all_gather(rank: int, ws: int, seed: int = 2) -> int:
    """all_gather into a list of tensors."""
    checks = 0
    for (i, dtype), shape, async_op in itertools.product(enumerate(DTYPES), SHAPES, (False, True)):
        inputs = [make_input(seed + i, r, shape, dtype) for r in range(ws)]
        outs = [torch.full(shape, 99).to(dtype) for _ in range(ws)]
        work = dist.all_gather(outs, non_contiguous(inputs[rank].clone()), async_op=async_op)
        _maybe_wait(work, async_op)
        for r in range(ws):
            _same(outs[r], inputs[r], f"all_gather {dtype} {shape} block {r}")
        checks += 1
        if _torch_ok():
            refs = [torch.empty(shape, dtype=dtype) for _ in range(ws)]
            tdist.all_gather(refs, inputs[rank].clone())
            for r in range(ws):
                _same(outs[r], refs[r], "torch all_gather")
            checks += 1
    return checks


def _gather_into(fn: Callable[..., Any], torch_fn: Callable[..., Any] | None, rank: int, ws: int, seed: int) -> int:
    checks = 0
    for (i, dtype), shape, stacked in itertools.product(enumerate(DTYPES), SHAPES, (False, True)):
        if not stacked and len(shape) == 0:
            continue
        inputs = [make_input(seed + i, r, shape, dtype) for r in range(ws)]
        out_shape = (ws, *shape) if stacked else (ws * shape[0], *shape[1:])
        out = torch.full(out_shape, 99).to(dtype)
        fn(out, inputs[rank].clone())
        expected = torch.stack(inputs) if stacked else torch.cat(inputs)
        _same(out, expected, f"{fn.__name__} {dtype} {shape} stacked={stacked}")
        checks += 1
        if _torch_ok() and torch_fn is not None and not stacked:  # gloo rejects the stacked form
            ref = torch.empty(out_shape, dtype=dtype)
            torch_fn(ref, inputs[rank].clone())
            _same(out, ref, f"torch {fn.__name__}")
            checks += 1
    return checks


def case_all_gather_into_tensor(rank: int, ws: int, seed: int = 3) -> int:
    """all_gather_into_tensor, concatenated and stacked outputs."""
    return _gather_into(dist.all_gather_into_tensor, tdist.all_gather_single, rank, ws, seed)


def case_all_gather_single(rank: int, ws: int, seed: int = 4) -> int:
    """all_gather_single (the newer torch name)."""
    return _gather_into(dist.all_gather_single, tdist.all_gather_single, rank, ws, seed)


def _scatter_tensor(fn: Callable[..., Any], rank: int, ws: int, seed: int) -> int:
    checks = 0
    for i, dtype, op, shape in _reduction_cases():
        if len(shape) == 0:
            continue
        small = op == "PRODUCT"
        full = (ws * shape[0], *shape[1:])
        inputs = [make_input(seed + i, r, full, dtype, small=small) for r in range(ws)]
        expected = reduce_ref(inputs, op).split(shape[0])[rank] if full[0] else reduce_ref(inputs, op)
        out = torch.full(shape, 99).to(dtype)
        work = fn(out, non_contiguous(inputs[rank].clone()), op=getattr(dist.ReduceOp, op), async_op=True)
        _maybe_wait(work, True)
        _same(out, expected, f"{fn.__name__} {op} {dtype} {shape}")
        checks += 1
        if _torch_ok():
            ref = torch.empty(shape, dtype=dtype)
            tdist.reduce_scatter_single(ref, inputs[rank].clone(), op=getattr(tdist.ReduceOp, op))
            _same(out, ref, f"torch {fn.__name__}")
            checks += 1
    return checks


def case_reduce_scatter_tensor(rank: int, ws: int, seed: int = 5) -> int:
    """reduce_scatter_tensor over dtypes x ops x shapes."""
    return _scatter_tensor(dist.reduce_scatter_tensor, rank, ws, seed)


def case_reduce_scatter_single(rank: int, ws: int, seed: int = 6) -> int:
    """reduce_scatter_single (the newer torch name)."""
    return _scatter_tensor(dist.reduce_scatter_single, rank, ws, seed)


def case_reduce_scatter(rank: int, ws: int, seed: int = 7) -> int:
    """reduce_scatter with a list of inputs."""
    checks = 0
    for i, dtype, op, shape in _reduction_cases():
        small = op == "PRODUCT"
        lists = [[make_input(seed + i, r * 31 + j, shape, dtype, small=small) for j in range(ws)] for r in range(ws)]
        expected = reduce_ref([lists[r][rank] for r in range(ws)], op)
        out = torch.full(shape, 99).to(dtype)
        dist.reduce_scatter(out, [t.clone() for t in lists[rank]], op=getattr(dist.ReduceOp, op))
        _same(out, expected, f"reduce_scatter {op} {dtype} {shape}")
        checks += 1
        if _torch_ok():
            ref = torch.empty(shape, dtype=dtype)
            tdist.reduce_scatter(ref, [t.clone() for t in lists[rank]], op=getattr(tdist.ReduceOp, op))
            _same(out, ref, "torch reduce_scatter")
            checks += 1
    return checks


def case_barrier(rank: int, ws: int, seed: int = 8) -> int:
    """barrier, blocking and async, with a deadline."""
    from datetime import timedelta

    assert dist.barrier() is None
    work = dist.barrier(async_op=True)
    _maybe_wait(work, True)
    assert dist.barrier(timeout=timedelta(seconds=30)) is None
    return 3


def case_send_recv(rank: int, ws: int, seed: int = 9) -> int:
    """send/recv/isend/irecv around a ring, with tags and any-source receives."""
    if ws == 1:
        return 0
    checks = 0
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    for (i, dtype), shape in itertools.product(enumerate(DTYPES), SHAPES):
        mine = make_input(seed + i, rank, shape, dtype)
        theirs = make_input(seed + i, prv, shape, dtype)
        # Even ranks send first, odd ranks receive first: blocking calls cannot deadlock.
        buf = torch.full(shape, 99).to(dtype)
        if rank % 2 == 0:
            dist.send(mine, dst=nxt, tag=3)
            src = dist.recv(buf, src=prv, tag=3)
        else:
            src = dist.recv(buf, src=prv, tag=3)
            dist.send(mine, dst=nxt, tag=3)
        assert src == prv, f"recv returned sender {src}, expected {prv}"
        _same(buf, theirs, f"send/recv {dtype} {shape}")
        buf2 = non_contiguous(torch.full(shape, 99).to(dtype))
        rw = dist.irecv(buf2, src=None)
        sw = dist.isend(mine, group_dst=nxt)
        sw.wait()
        rw.wait()
        _same(buf2, theirs, f"isend/irecv any-source {dtype} {shape}")
        checks += 2
    return checks


def case_new_group(rank: int, ws: int, seed: int = 10) -> int:
    """new_group: members see their group rank and reduce among themselves only."""
    checks = 0
    for members in ([0], [ws - 1, 0], list(range(0, ws, 2)), list(range(ws))):
        members = sorted(set(members))
        g = dist.new_group(members)
        if rank in members:
            assert g is not dist.GroupMember.NON_GROUP_MEMBER
            assert dist.get_rank(g) == members.index(rank)
            assert dist.get_world_size(g) == len(members)
            assert dist.get_process_group_ranks(g) == members
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t, group=g)
            assert t.item() == sum(m + 1 for m in members), (members, t)
            t2 = torch.tensor([float(rank)])
            dist.broadcast(t2, src=members[-1], group=g)
            assert t2.item() == members[-1]
            checks += 2
        else:
            assert g is dist.GroupMember.NON_GROUP_MEMBER
            assert dist.get_rank(g) == -1
            assert dist.all_reduce(torch.ones(1), group=g) is None  # torch: a no-op off-group
            checks += 2
    return checks


def case_lifecycle(rank: int, ws: int, seed: int = 11) -> int:
    """is_initialized/get_rank/get_world_size/get_backend and double init."""
    assert dist.is_initialized()
    assert dist.is_available()
    assert dist.get_rank() == rank
    assert dist.get_world_size() == ws
    assert dist.get_backend() in ("gloo", "mpi")
    assert dist.group.WORLD is not None and dist.GroupMember.WORLD is dist.group.WORLD
    try:
        dist.init_process_group(dist.get_backend())
    except RuntimeError as exc:
        assert "twice" in str(exc)
    else:
        raise AssertionError("double init_process_group did not raise")
    if _torch_ok():
        assert tdist.get_rank() == rank and tdist.get_world_size() == ws
    return 5


def case_byte_accounting(rank: int, ws: int, seed: int = 12) -> int:
    """Counted bytes equal the analytic ring volumes, op by op."""
    from bindings.stats import ring_bytes

    stats = dist.get_stats()
    stats.reset()
    x = torch.ones(1000)
    dist.all_reduce(x)
    dist.all_gather_into_tensor(torch.empty(250 * ws, dtype=torch.float64), torch.ones(250, dtype=torch.float64))
    dist.reduce_scatter_tensor(torch.empty(100, dtype=torch.bfloat16), torch.ones(100 * ws, dtype=torch.bfloat16))
    dist.broadcast(x, src=0)
    dist.barrier()
    expect = {
        "all_reduce": ring_bytes("all_reduce", 4000, ws),
        "all_gather": ring_bytes("all_gather", 2000, ws),
        # gloo builds reduce_scatter from all_reduce (faster there) and counts what it sends
        "reduce_scatter": ring_bytes("all_reduce", 200 * ws, ws)
        if getattr(dist.get_communicator(), "reduce_scatter_uses_all_reduce", lambda b: False)(200 * ws)
        else ring_bytes("reduce_scatter", 200, ws),
        "broadcast": ring_bytes("broadcast", 4000, ws, is_root=rank == 0),
        "barrier": (0, 0),
    }
    for op, (sent, received) in expect.items():
        got = stats.get(op)
        assert (got.calls, got.bytes_sent, got.bytes_received) == (1, sent, received), (op, got)
    assert stats.bytes_sent == sum(s for s, _ in expect.values())
    return len(expect)


def case_no_deprecation_warnings(rank: int, ws: int, seed: int = 13) -> int:
    """Both spellings of the tensor collectives work without warnings from us."""
    import warnings

    x = torch.ones(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * ws))
        dist.reduce_scatter_single(torch.empty(4), torch.ones(4 * ws))
        dist.all_gather_into_tensor(torch.empty(4 * ws), x)
        dist.all_gather_single(torch.empty(4 * ws), x)
    noisy = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not noisy, noisy
    return 4


def case_large_reduce_scatter_bytes(rank: int, ws: int) -> int:
    """A >= 32 MB gloo reduce_scatter runs as an all-reduce and counts those bytes."""
    from bindings.stats import ring_bytes

    comm = dist.get_communicator()
    per = ((32 << 20) // 4 + ws - 1) // ws
    nbytes = per * ws * 4
    uses_ar = getattr(comm, "reduce_scatter_uses_all_reduce", lambda b: False)(nbytes)
    assert uses_ar == (comm.backend == "gloo")
    stats = comm.stats
    stats.reset()
    out = torch.empty(per)
    dist.reduce_scatter_tensor(out, torch.full((per * ws,), float(rank + 1)))
    assert bool((out == ws * (ws + 1) / 2).all())
    sent = stats.get("reduce_scatter").bytes_sent
    expected = ring_bytes("all_reduce", nbytes, ws) if uses_ar else ring_bytes("reduce_scatter", per * 4, ws)
    assert sent == expected[0], (sent, expected)
    return 1


CASES: dict[str, Callable[[int, int], int]] = {
    "large_reduce_scatter_bytes": case_large_reduce_scatter_bytes,
    "no_deprecation_warnings": case_no_deprecation_warnings,
    "byte_accounting": case_byte_accounting,
    "all_reduce": case_all_reduce,
    "broadcast": case_broadcast,
    "all_gather": case_all_gather,
    "all_gather_into_tensor": case_all_gather_into_tensor,
    "all_gather_single": case_all_gather_single,
    "reduce_scatter_tensor": case_reduce_scatter_tensor,
    "reduce_scatter_single": case_reduce_scatter_single,
    "reduce_scatter": case_reduce_scatter,
    "barrier": case_barrier,
    "send_recv": case_send_recv,
    "new_group": case_new_group,
    "lifecycle": case_lifecycle,
}


def run_cases(rank: int, ws: int, names: list[str] | None = None) -> dict[str, int]:
    """Run the named cases (all by default) in order; return checks per case."""
    done: dict[str, int] = {}
    for name in names or sorted(CASES):
        try:
            done[name] = CASES[name](rank, ws)
        except Exception as exc:
            raise AssertionError(f"case {name!r} failed on rank {rank} of {ws}: {exc}") from exc
    return done
