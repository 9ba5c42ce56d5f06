"""mpirun worker: every operation of ``MPICommunicator`` against locally computed values.

Each rank builds every rank's input itself (small integers, so sums are
exact), runs the operation and compares. After each check the ranks agree on
pass / fail over ``COMM_WORLD`` (our communicator is a private duplicate), stop
at the first failure, and every rank exits with the same status; rank 0
prints ``PASS backend_smoke n=<ranks>`` or the failures of every rank.

Run: ``mpirun -n 4 python -m mpi4py tests/mpi/workers/backend_smoke.py``
"""

from __future__ import annotations

import functools
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
from mpi4py import MPI

from bindings.errors import CollectiveMismatchError, CommAbortedError, CommTimeoutError
from bindings.mpi_backend import MPICommunicator
from bindings.ops import ReduceOp
from bindings.stats import ring_bytes

TIMEOUT = timedelta(seconds=30)
FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
HALF = (torch.bfloat16, torch.float16)

Check = Callable[[MPICommunicator], None]
CHECKS: list[tuple[str, Check]] = []


def check(fn: Check) -> Check:
    CHECKS.append((fn.__name__, fn))
    return fn


# ---------------------------------------------------------------------- data
def data(rank: int, numel: int, dtype: torch.dtype, *, small: bool = False) -> torch.Tensor:
    """Rank ``rank``'s input: small integers (1..3 when ``small``, for products)."""
    i = torch.arange(numel, dtype=torch.int64)
    if dtype == torch.bool:
        return ((i + rank) % 3 == 0) | (i % 4 == 0)
    if small:
        v = (i + 2 * rank) % 3 + 1
    elif dtype == torch.uint8:
        v = (3 * i + 5 * rank) % 11
    else:
        v = (3 * i + 5 * rank) % 11 - 3
    return v.to(dtype)


def expected(op: ReduceOp, ins: list[torch.Tensor]) -> torch.Tensor:
    """Reduce the ranks' inputs the way torch (gloo) defines it."""
    dtype = ins[0].dtype
    if dtype == torch.bool:
        stack = torch.stack(ins).to(torch.int64)
        any_, all_ = stack.amax(0).bool(), stack.amin(0).bool()
        return {
            ReduceOp.SUM: any_,
            ReduceOp.MAX: any_,
            ReduceOp.BOR: any_,
            ReduceOp.PRODUCT: all_,
            ReduceOp.MIN: all_,
            ReduceOp.BAND: all_,
            ReduceOp.BXOR: (stack.sum(0) % 2).bool(),
        }[op]
    wide = torch.stack([t.double() if dtype.is_floating_point else t.long() for t in ins])
    if op == ReduceOp.SUM:
        out = wide.sum(0)
    elif op == ReduceOp.AVG:
        out = wide.sum(0) / len(ins)
    elif op == ReduceOp.PRODUCT:
        out = wide.prod(0)
    elif op == ReduceOp.MIN:
        out = wide.amin(0)
    elif op == ReduceOp.MAX:
        out = wide.amax(0)
    else:
        bit = {
            ReduceOp.BAND: torch.bitwise_and,
            ReduceOp.BOR: torch.bitwise_or,
            ReduceOp.BXOR: torch.bitwise_xor,
        }[op]
        out = functools.reduce(bit, list(wide))
    return out.to(dtype)


def same(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype.is_floating_point:
        tol = 1e-2 if got.dtype in HALF else 1e-6
        ok = torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
    elif got.dtype == torch.bool:  # compare bytes: a bool must hold 0 or 1, not a count
        ok = torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    else:
        ok = torch.equal(got, want)
    assert ok, f"{what}: got {got.flatten().tolist()[:12]} want {want.flatten().tolist()[:12]}"


def ops_for(dtype: torch.dtype) -> list[ReduceOp]:
    if dtype.is_floating_point:
        return [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
    return [
        ReduceOp.SUM,
        ReduceOp.PRODUCT,
        ReduceOp.MIN,
        ReduceOp.MAX,
        ReduceOp.BAND,
        ReduceOp.BOR,
        ReduceOp.BXOR,
    ]


def noncontig(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` (2-D) in a transposed, non-contiguous tensor."""
    out = torch.empty(t.shape[1], t.shape[0], dtype=t.dtype).t()
    out.copy_(t)
    assert not out.is_contiguous()
    return out


# ---------------------------------------------------------------------- checks
@check
def all_reduce_every_op_and_dtype(c: MPICommunicator) -> None:
    n, r = c.world_size, c.rank
    for dtype in (*FLOATS, *INTS, torch.bool):
        for op in ops_for(dtype):
            small = op == ReduceOp.PRODUCT
            ins = [data(q, 15, dtype, small=small).view(5, 3) for q in range(n)]
            t = ins[r].clone()
            c.all_reduce(t, op)
            same(f"all_reduce {dtype} {op.name}", t, expected(op, ins))


@check
def all_reduce_shapes(c: MPICommunicator) -> None:
    n, r = c.world_size, c.rank
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        ins = [data(q, 12, dtype).view(3, 4) for q in range(n)]
        t = noncontig(ins[r])
        c.all_reduce(t, "sum")
        same(f"all_reduce non-contiguous {dtype}", t, expected(ReduceOp.SUM, ins))
        empty = torch.empty(0, 4, dtype=dtype)
        c.all_reduce(empty)
        assert empty.shape == (0, 4)
        scalars = [data(q, 1, dtype).view(()) for q in range(n)]
        s = scalars[r].clone()
        c.all_reduce(s, ReduceOp.MAX)
        same(f"all_reduce 0-dim {dtype}", s, expected(ReduceOp.MAX, scalars))


@check
def all_reduce_large(c: MPICommunicator) -> None:
    """Sizes past libnbc's 64 KiB threshold (another schedule), mixed with small ones in flight."""
    n, r = c.world_size, c.rank
    for dtype, numel in ((torch.float32, 100_003), (torch.bfloat16, 40_000), (torch.int64, 9_000)):
        for op in (ReduceOp.SUM, ReduceOp.MAX):
            ins = [data(q, numel, dtype) for q in range(n)]
            t = ins[r].clone()
            c.all_reduce(t, op)
            same(f"large all_reduce {dtype} {op.name}", t, expected(op, ins))
    sizes = (5, 70_000, 7, 300_000, 1)
    ins = [[data(q, k, torch.float32) for q in range(n)] for k in sizes]
    ts = [ins[i][r].clone() for i in range(len(sizes))]
    hs = [c.all_reduce(t, async_op=True) for t in ts]
    for i, h in enumerate(hs):
        assert h is not None
        h.wait()
        same(f"mixed-size async all_reduce numel={sizes[i]}", ts[i], expected(ReduceOp.SUM, ins[i]))


@check
def reduce_scatter(c: MPICommunicator) -> None:
    n, r = c.world_size, c.rank
    for dtype in (
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.bool,
    ):
        for op in ops_for(dtype)[:4]:
            ins = [data(q, 6 * n, dtype, small=op == ReduceOp.PRODUCT) for q in range(n)]
            out = torch.empty(6, dtype=dtype)
            c.reduce_scatter(out, ins[r].clone(), op)
            want = expected(op, ins)[6 * r : 6 * r + 6]
            same(f"reduce_scatter {dtype} {op.name}", out, want)
        ins = [data(q, 6 * n, dtype).view(n * 2, 3) for q in range(n)]
        out = noncontig(torch.zeros(3, 2, dtype=dtype))
        c.reduce_scatter(out, noncontig(ins[r]), ReduceOp.MAX)
        want = expected(ReduceOp.MAX, ins).flatten()[6 * r : 6 * r + 6].view(3, 2)
        same(f"reduce_scatter non-contiguous {dtype}", out, want)
    out = torch.empty(0)
    c.reduce_scatter(out, torch.empty(0))


@check
def all_gather(c: MPICommunicator) -> None:
    n, r = c.world_size, c.rank
    for dtype in (*FLOATS, torch.int64, torch.int8, torch.bool):
        ins = [data(q, 6, dtype).view(2, 3) for q in range(n)]
        out = torch.empty(2 * n, 3, dtype=dtype)
        c.all_gather(out, ins[r].clone())
        same(f"all_gather {dtype}", out, torch.cat(ins))
        out2 = noncontig(torch.zeros(2 * n, 3, dtype=dtype))
        c.all_gather(out2, noncontig(ins[r]))
        same(f"all_gather non-contiguous {dtype}", out2, torch.cat(ins))
    c.all_gather(torch.empty(0, dtype=torch.bfloat16), torch.empty(0, dtype=torch.bfloat16))


@check
def broadcast(c: MPICommunicator) -> None:
    n, r = c.world_size, c.rank
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.bool, torch.int64):
        for src in range(n):
            t = data(r, 12, dtype).view(3, 4).clone()
            c.broadcast(t, src)
            same(f"broadcast {dtype} src={src}", t, data(src, 12, dtype).view(3, 4))
            t2 = noncontig(data(r, 12, dtype).view(3, 4))
            c.broadcast(t2, src)
            same(f"broadcast non-contiguous {dtype} src={src}", t2, data(src, 12, dtype).view(3, 4))
    c.broadcast(torch.empty(0), 0)


@check
def barrier(c: MPICommunicator) -> None:
    c.barrier()
    h = c.barrier(async_op=True)
    assert h is not None
    h.wait()
    assert h.is_completed()


@check
def send_recv(c: MPICommunicator) -> None:
    n, r = c.world_size, c.rank
    if n == 1:
        return
    nxt, prv = (r + 1) % n, (r - 1) % n
    for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.int64):
        h = c.send(data(r, 6, dtype).view(2, 3), nxt, tag=7, async_op=True)
        got = noncontig(torch.zeros(2, 3, dtype=dtype))
        src = c.recv(got, prv, tag=7)
        assert src == prv, f"recv returned source {src}, want {prv}"
        assert h is not None
        h.wait()
        same(f"send/recv {dtype}", got, data(prv, 6, dtype).view(2, 3))
    # any-source: everyone else sends its rank-tagged payload to rank 0
    if r == 0:
        seen = set()
        for _ in range(n - 1):
            buf = torch.zeros(4, dtype=torch.float64)
            hr = c.recv(buf, None, tag=3, async_op=True)
            assert not isinstance(hr, int)
            s = hr.source_rank()
            same(f"recv any-source from {s}", buf, data(s, 4, torch.float64))
            seen.add(s)
        assert seen == set(range(1, n)), f"any-source senders {sorted(seen)}"
    else:
        c.send(data(r, 4, torch.float64), 0, tag=3)
    zero = torch.empty(0)
    h = c.send(zero, nxt, tag=9, async_op=True)
    c.recv(torch.empty(0), prv, tag=9)
    assert h is not None
    h.wait()


@check
def async_handles(c: MPICommunicator) -> None:
    n, r = c.world_size, c.rank
    ins = [[data(q, 1000 + k, torch.float32) for q in range(n)] for k in range(3)]
    ts = [ins[k][r].clone() for k in range(3)]
    hs = [c.all_reduce(t, ReduceOp.SUM, async_op=True) for t in ts]
    ag_out = torch.empty(2 * n, dtype=torch.bfloat16)
    h_ag = c.all_gather(ag_out, data(r, 2, torch.bfloat16), async_op=True)
    for k in reversed(range(3)):
        h = hs[k]
        assert h is not None
        assert h.wait(timedelta(seconds=20)) is True
        assert h.is_completed()
        same(f"async all_reduce #{k}", ts[k], expected(ReduceOp.SUM, ins[k]))
    assert h_ag is not None
    h_ag.wait()
    same("async all_gather", ag_out, torch.cat([data(q, 2, torch.bfloat16) for q in range(n)]))
    # AVG in bfloat16 through the async path (cast back, then divide, in wait)
    bf = [data(q, 8, torch.bfloat16) for q in range(n)]
    t = bf[r].clone()
    h = c.all_reduce(t, ReduceOp.AVG, async_op=True)
    assert h is not None
    h.wait()
    same("async all_reduce AVG bfloat16", t, expected(ReduceOp.AVG, bf))


def _times_out(what: str, fn: Callable[[], object]) -> None:
    """``fn`` raises CommTimeoutError naming ``what`` after its 300 ms deadline (not much later)."""
    t0 = time.monotonic()
    try:
        fn()
    except CommTimeoutError as exc:
        assert what in str(exc), exc
    else:
        raise AssertionError(f"{what} did not time out")
    took = time.monotonic() - t0
    assert 0.25 <= took < 5, f"timeout took {took:.3f} s"


@check
def recv_timeout(c: MPICommunicator) -> None:
    h = c.recv(torch.empty(3), None, tag=31000, async_op=True)  # nobody ever sends this tag
    assert not isinstance(h, int)
    _times_out("recv", lambda: h.wait(timedelta(milliseconds=300)))
    assert not h.is_completed()


@check
def collective_timeout(c: MPICommunicator) -> None:
    """A collective a peer joins late ends at the caller's deadline; the late peer still completes it."""
    if c.world_size < 2:
        return
    tc = MPICommunicator(timeout=timedelta(milliseconds=300))
    try:
        t = torch.full((1 << 16,), float(c.rank + 1))
        if c.rank == 0:
            _times_out("all_reduce", lambda: tc.all_reduce(t))
            c.barrier()  # now the others join the call still running in the background
        else:
            c.barrier()
            tc.all_reduce(t)
            same("late all_reduce", t, torch.full((1 << 16,), float(sum(range(1, c.world_size + 1)))))
        tc.barrier()  # the communicator is still in step
    finally:
        tc.close()


@check
def split(c: MPICommunicator) -> None:
    n, r = c.world_size, c.rank
    members = list(range(0, n, 2))
    sub = c.split(members[::-1])
    if r not in members:
        assert sub is None, "non-member got a communicator"
        return
    assert sub is not None and sub.backend == "mpi"
    assert (sub.rank, sub.world_size) == (members.index(r), len(members))
    t = data(r, 5, torch.int64)
    sub.all_reduce(t)
    same("split all_reduce", t, expected(ReduceOp.SUM, [data(m, 5, torch.int64) for m in members]))
    sub.close()
    try:
        sub.barrier()
    except CommAbortedError:
        pass
    else:
        raise AssertionError("barrier on a closed communicator did not raise")


@check
def stats_bytes(c: MPICommunicator) -> None:
    n, r = c.world_size, c.rank
    c.stats.reset()
    c.all_reduce(torch.ones(1000))
    c.all_reduce(noncontig(torch.ones(10, 10, dtype=torch.bfloat16)))
    c.reduce_scatter(torch.empty(100, dtype=torch.float64), torch.ones(100 * n, dtype=torch.float64))
    c.all_gather(torch.empty(50 * n, dtype=torch.int16), torch.ones(50, dtype=torch.int16))
    c.broadcast(torch.ones(64, dtype=torch.uint8), n - 1)
    c.barrier()
    want = {
        "all_reduce": [
            a + b for a, b in zip(ring_bytes("all_reduce", 4000, n), ring_bytes("all_reduce", 200, n), strict=True)
        ],
        "reduce_scatter": list(ring_bytes("reduce_scatter", 800, n)),
        "all_gather": list(ring_bytes("all_gather", 100, n)),
        "broadcast": list(ring_bytes("broadcast", 64, n, is_root=r == n - 1)),
        "barrier": [0, 0],
    }
    for op, (sent, received) in want.items():
        got = c.stats.get(op)
        calls = 2 if op == "all_reduce" else 1
        assert (got.calls, got.bytes_sent, got.bytes_received) == (calls, sent, received), (
            f"stats {op}: got {got}, want calls={calls} sent={sent} received={received}"
        )
    if n > 1:
        c.stats.reset()
        h = c.send(torch.ones(10), (r + 1) % n, tag=11, async_op=True)
        c.recv(torch.empty(10), (r - 1) % n, tag=11)
        assert h is not None
        h.wait()
        assert (c.stats.get("send").bytes_sent, c.stats.get("recv").bytes_received) == (40, 40)


@check
def check_collectives(c: MPICommunicator) -> None:
    n, r = c.world_size, c.rank
    cc = MPICommunicator(timeout=TIMEOUT, check_collectives=True)
    try:
        t = torch.full((4,), float(r))
        cc.all_reduce(t)
        same("checked all_reduce", t, torch.full((4,), float(sum(range(n)))))
        if n > 1:
            try:
                cc.all_reduce(torch.ones(4 if r else 5))
            except CollectiveMismatchError as exc:
                assert "numel" in str(exc), exc
            else:
                raise AssertionError("mismatched numel was not detected")
    finally:
        cc.close()


@check
def abort(c: MPICommunicator) -> None:
    ac = MPICommunicator(timeout=TIMEOUT)
    ac.barrier()
    ac.abort()
    ac.abort()  # idempotent
    try:
        ac.all_reduce(torch.ones(3))
    except CommAbortedError:
        pass
    else:
        raise AssertionError("all_reduce after abort did not raise")
    c.barrier()  # the main communicator is unaffected


@check
def errors(c: MPICommunicator) -> None:
    try:
        c.all_reduce(torch.ones(3, dtype=torch.int32), ReduceOp.AVG)
    except TypeError:
        pass
    else:
        raise AssertionError("AVG on int32 did not raise TypeError")
    if c.world_size > 1:
        try:
            c.send(torch.ones(1), (c.rank + 1) % c.world_size, tag=1 << 40)
        except ValueError:
            pass
        else:
            raise AssertionError("tag above MPI_TAG_UB did not raise ValueError")


# ---------------------------------------------------------------------- driver
def main() -> int:
    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    comm = MPICommunicator(timeout=TIMEOUT)
    assert (comm.rank, comm.world_size) == (world.rank, world.size)
    assert comm.mpi_comm != world
    failure = ""
    for name, fn in CHECKS:
        mine = ""
        try:
            fn(comm)
        except Exception:  # noqa: BLE001 - report every failure, on every rank
            mine = f"rank {world.rank}: {name}: {traceback.format_exc()}"
        reports = world.allgather(mine)  # every rank reaches the same decision
        if world.rank == 0:
            print(f"CHECK {name} {'FAIL' if any(reports) else 'PASS'}", flush=True)
        if any(reports):
            failure = "\n".join(x for x in reports if x)
            break
    comm.close()
    if world.rank == 0:
        if failure:
            print(f"FAIL backend_smoke n={world.size}\n{failure}", flush=True)
        else:
            print(f"PASS backend_smoke n={world.size} ({len(CHECKS)} checks)", flush=True)
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
