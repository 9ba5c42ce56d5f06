"""Collective benchmarks in the conventions of nccl-tests.

For each backend, op, dtype and size, every rank times our layer
(``sparsecomm.distributed``) and the raw transport calls of
:mod:`bindings.reference` (torch.distributed for gloo, mpi4py for mpi)
*in the same run*, interleaved iteration by iteration so drift hits both
alike. Columns follow nccl-tests:

* ``size``: bytes of the full buffer S (for all_gather / reduce_scatter, the
  gathered size ``count x sizeof(type) x nranks`` as in nccl-tests);
* ``time_us``: median over iterations of one call, then the maximum over ranks;
* ``algbw`` = S / time (GB/s); ``busbw`` = algbw x (2(n-1)/n for all_reduce,
  (n-1)/n for all_gather and reduce_scatter);
* ``#wrong``: elements that differ from the expected result in a separate
  checked call, summed over ranks;
* ``wire_bytes``: bytes this rank sent per call, from our byte accounting.

This module only computes rows; the ``sparsecomm bench`` command prints and saves them.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch

import sparsecomm.distributed as dist
from bindings.json_object import JsonObject
from bindings.reference import raw_collectives
from bindings.spawn import mpirun_python, run_local
from optim.apps.benchmarks.sparse_ops import bench_sparse_rank

__all__ = [
    "CollectivesBenchConfig",
    "OPS",
    "BUSBW_FACTOR",
    "bench_collectives_rank",
    "run_collectives_bench",
    "size_sweep",
]

logger = logging.getLogger(__name__)

OPS = ("all_reduce", "reduce_scatter", "all_gather")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def BUSBW_FACTOR(op: str, n: int) -> float:  # noqa: N802 - a table, spelled like one
    """nccl-tests' bus-bandwidth factor of ``op`` on ``n`` ranks."""
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


@dataclass(frozen=True, kw_only=True)
class CollectivesBenchConfig:
    """What to measure."""

    backends: tuple[str, ...] = ("gloo", "mpi")
    """Backends to run, one local job each."""
    nproc: int = 4
    """Local ranks per job."""
    ops: tuple[str, ...] = OPS
    """Collectives to time."""
    dtypes: tuple[str, ...] = ("float32",)
    """Element types (``float32``, ``bfloat16``, ``float16``, ``float64``)."""
    min_bytes: int = 1 << 10
    """Smallest buffer S in bytes."""
    max_bytes: int = 64 << 20
    """Largest buffer S in bytes."""
    factor: int = 4
    """Size step factor (nccl-tests ``-f``)."""
    warmup: int = 3
    """Untimed calls per size and implementation (nccl-tests ``-w``)."""
    iters: int = 20
    """Timed calls per size and implementation (nccl-tests ``-n``)."""
    check_collectives: bool = False
    """Run our layer with the cross-rank metadata check on."""
    dense: bool = True
    """Run the dense sweep (ours vs the raw transport)."""
    sparse: bool = False
    """Add the sparse rows (:mod:`optim.apps.benchmarks.sparse_ops`)."""
    sparse_numels: tuple[int, ...] = (1 << 24,)
    """Buffer sizes N (elements) of the sparse rows."""
    densities: tuple[float, ...] = (1.0, 0.1, 0.01, 0.001)
    """Densities of the sparse rows; 1 is the dense baseline."""
    sparse_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    """Value types of the sparse rows."""
    timeout_s: float = 1800.0
    """Deadline of each backend's whole job."""
    extra: JsonObject = field(default_factory=dict)
    """Free-form notes copied into every row."""

    def __post_init__(self) -> None:
        unknown = [o for o in self.ops if o not in OPS]
        if unknown:
            raise ValueError(f"ops: unknown {unknown}; expected some of {list(OPS)}")
        bad = [d for d in self.dtypes + self.sparse_dtypes if d not in _DTYPES]
        if bad:
            raise ValueError(f"dtypes: unknown {bad}; expected some of {list(_DTYPES)}")
        for b in self.backends:
            if b not in ("gloo", "mpi"):
                raise ValueError(f"backends: {b!r} is not a CPU backend this benchmark can launch")
        if self.nproc < 1 or self.iters < 1 or self.warmup < 0:
            raise ValueError("nproc and iters must be >= 1 and warmup >= 0")
        if not 0 < self.min_bytes <= self.max_bytes or self.factor < 2:
            raise ValueError("need 0 < min_bytes <= max_bytes and factor >= 2")
        if any(not 0 < d <= 1 for d in self.densities) or any(n < 1 for n in self.sparse_numels):
            raise ValueError("densities must lie in (0, 1] and sparse_numels be >= 1")
        if not (self.dense or self.sparse):
            raise ValueError("nothing to run: enable dense or sparse rows")


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Return min, min*f, … up to max (inclusive where it lands)."""
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


def _count(op: str, size: int, n: int, elem: int) -> int:
    """Elements per rank-local input so that the full buffer S is ``size`` bytes."""
    per = max(1, size // elem)
    return max(1, per // n) if op in ("all_gather", "reduce_scatter") else per


def _buffers(op: str, count: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if op == "all_reduce":
        buf = torch.zeros(count, dtype=dtype)
        return buf, buf
    if op == "all_gather":
        return torch.zeros(count * n, dtype=dtype), torch.zeros(count, dtype=dtype)
    return torch.zeros(count, dtype=dtype), torch.zeros(count * n, dtype=dtype)


def _ours(op: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
    if op == "all_reduce":
        return lambda out, inp: dist.all_reduce(inp)
    if op == "all_gather":
        return lambda out, inp: dist.all_gather_into_tensor(out, inp)
    return lambda out, inp: dist.reduce_scatter_tensor(out, inp)


def _wrong(
    op: str, fn: Callable[[torch.Tensor, torch.Tensor], None], count: int, n: int, rank: int, dtype: torch.dtype
) -> int:
    """Run one checked call; return the number of wrong elements on this rank."""
    out, inp = _buffers(op, count, n, dtype)
    if op == "all_gather":
        inp.fill_(rank + 1)
        fn(out, inp)
        expected = torch.arange(1, n + 1, dtype=dtype).repeat_interleave(count)
        return int((out != expected).sum())
    inp.copy_(torch.full_like(inp, rank + 1))
    fn(out, inp)
    result = inp if op == "all_reduce" else out
    return int((result != n * (n + 1) // 2).sum())


def bench_collectives_rank(config: CollectivesBenchConfig) -> list[JsonObject]:
    """Measure every row on this rank; rows come back identical on every rank.

    Collective: every rank of the default group must call this.
    """
    comm = dist.get_communicator()
    n, rank = comm.world_size, comm.rank
    raw_name, raw = raw_collectives(comm)
    rows: list[JsonObject] = []
    for op in config.ops:
        for dname in config.dtypes:
            dtype = _DTYPES[dname]
            elem = torch.empty((), dtype=dtype).element_size()
            for size in size_sweep(config.min_bytes, config.max_bytes, config.factor):
                count = _count(op, size, n, elem)
                full_bytes = count * elem * (n if op != "all_reduce" else 1)
                impls = {"sparsecomm": _ours(op), raw_name: raw[op]}
                out, inp = _buffers(op, count, n, dtype)
                for fn in impls.values():
                    for _ in range(config.warmup):
                        fn(out, inp)
                times: dict[str, list[float]] = {k: [] for k in impls}
                names = list(impls)
                before = comm.stats.get(op)
                for i in range(config.iters):
                    order = names if i % 2 == 0 else names[::-1]
                    for name in order:
                        t0 = time.perf_counter()
                        impls[name](out, inp)
                        times[name].append(time.perf_counter() - t0)
                after = comm.stats.get(op)
                ours_calls = max(1, after.calls - before.calls)
                wire = (after.bytes_sent - before.bytes_sent) // ours_calls
                wrong = {k: _wrong(op, fn, count, n, rank, dtype) for k, fn in impls.items()}
                # Reduce across ranks: max time, sum of wrong elements.
                med = torch.tensor([statistics.median(times[k]) for k in names], dtype=torch.float64)
                dist.all_reduce(med, op=dist.ReduceOp.MAX)
                bad = torch.tensor([wrong[k] for k in names], dtype=torch.int64)
                dist.all_reduce(bad)
                for j, name in enumerate(names):
                    t = float(med[j])
                    algbw = full_bytes / t / 1e9 if t > 0 else 0.0
                    rows.append(
                        {
                            "kind": "dense",
                            "op": op,
                            "backend": comm.backend,
                            "impl": name,
                            "nranks": n,
                            "size": full_bytes,
                            "count": count * (n if op != "all_reduce" else 1),
                            "type": dname,
                            "redop": "sum" if op != "all_gather" else "none",
                            "time_us": t * 1e6,
                            "algbw": algbw,
                            "busbw": algbw * BUSBW_FACTOR(op, n),
                            "#wrong": int(bad[j]),
                            "wire_bytes": wire if name == "sparsecomm" else None,
                            "check_collectives": config.check_collectives if name == "sparsecomm" else None,
                            **config.extra,
                        }
                    )
                ours_t, raw_t = float(med[0]), float(med[1])
                rows[-2]["overhead_pct"] = (ours_t / raw_t - 1) * 100 if raw_t > 0 else None
                rows[-1]["overhead_pct"] = None
    return rows


def _rank_rows(config: CollectivesBenchConfig) -> list[JsonObject]:
    rows = bench_collectives_rank(config) if config.dense else []
    if config.sparse:
        rows += bench_sparse_rank(
            numels=config.sparse_numels,
            densities=config.densities,
            dtypes=config.sparse_dtypes,
            iters=config.iters,
            warmup=config.warmup,
        )
    return rows


def _gloo_rank(rank: int, world_size: int, config: CollectivesBenchConfig) -> list[JsonObject]:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        timeout=timedelta(seconds=config.timeout_s),
        check_collectives=config.check_collectives,
    )
    try:
        return _rank_rows(config)
    finally:
        dist.destroy_process_group()


def run_collectives_bench(config: CollectivesBenchConfig) -> list[JsonObject]:
    """Launch one local job per backend and return all rows (from rank 0)."""
    rows: list[JsonObject] = []
    for backend in config.backends:
        logger.info("benchmarking %s on %d local ranks", backend, config.nproc)
        if backend == "gloo":
            rows += run_local(_gloo_rank, config.nproc, config, timeout=config.timeout_s)[0]
        else:
            rows += _run_under_mpirun(config)
    return rows


def _run_under_mpirun(config: CollectivesBenchConfig) -> list[JsonObject]:
    with tempfile.TemporaryDirectory(prefix="sc-bench-") as tmp:
        cfg_path = os.path.join(tmp, "config.json")
        out_path = os.path.join(tmp, "rows.json")
        with open(cfg_path, "w") as f:
            json.dump(asdict(config), f)
        cmd = mpirun_python(config.nproc, ["-m", "optim.apps.benchmarks.collective_ops", cfg_path, out_path])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=config.timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(
                f"mpirun benchmark failed with code {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            )
        with open(out_path) as f:
            return list(json.load(f))


def _mpi_main(argv: Sequence[str]) -> None:
    """Entry point of each rank under mpirun: ``python -m optim.apps.benchmarks.collective_ops CONFIG OUT``."""
    cfg_path, out_path = argv
    with open(cfg_path) as f:
        raw = json.load(f)
    raw["backends"] = tuple(raw["backends"])
    raw["ops"] = tuple(raw["ops"])
    for key in ("dtypes", "sparse_numels", "densities", "sparse_dtypes"):
        raw[key] = tuple(raw[key])
    config = CollectivesBenchConfig(**raw)
    torch.set_num_threads(1)
    dist.init_process_group(
        "mpi", timeout=timedelta(seconds=config.timeout_s), check_collectives=config.check_collectives
    )
    try:
        rows = _rank_rows(config)
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _mpi_main(sys.argv[1:])
