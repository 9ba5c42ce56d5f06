"""Optimizer step-time and memory benchmark: ShardedAdamW, ShardedAdamS, SCAPE and LocalAdamS.

:func:`run_optimizer_bench` spawns ``nproc`` local gloo ranks
(:func:`bindings.spawn.run_local`); every rank runs :func:`optimizer_bench_worker`,
which builds the training job's GPT model (:class:`optim.apps.train_job.model.GPT`, same
initialisation on every rank) and, for each variant

* ``adamw``: :class:`optim.ShardedAdamW` (dense ZeRO-1),
* ``adams``: :class:`optim.ShardedAdamS` (dense ZeRO-1; the reference of the speedups),
* ``scape@D``: :class:`optim.SCAPE` at each density ``D``,
* ``scape@D/inline``: the same with ``background_proposal=False`` (the next
  mask piece built inside ``opt.step()``, not beside the next forward and
  backward; same selections bit for bit), when ``inline_rows`` is on,
* ``local@D``: :class:`optim.LocalAdamS` at each density ``D`` with its
  defaults (codes of ``auto_wire_bits(D)`` bits), when ``local_rows`` is on,
  and ``local@D/overlap`` (``overlap=True``: each averaging beside the next
  forward and backward) and ``local@D/lean`` (the normalizer's second-moment
  EMA in bfloat16), when ``local_variant_rows`` is on as well,
* ``local-adamw@D``: :class:`torch.optim.AdamW` wrapped by
  :class:`optim.LocalOptimizer` at each density ``D`` with its defaults, when
  ``local_adamw_rows`` is on,
* ``coded-adamw@D``: :class:`torch.optim.AdamW` inside :class:`optim.CodedGradients`
  at each density ``D`` its codes fit (from 0.037), when ``coded_rows`` is on,
* ``demo-sgd@D``: :class:`torch.optim.SGD` inside :class:`optim.DeMo` at each density
  ``D`` its plan fits (:func:`optim.optimizers.demo.demo_plan`), when ``demo_rows`` is on,

builds the optimizer exactly as the training job does
(:func:`optim.apps.train_job.train.build_optimizer`: weight decay on matrices, global-norm clip),
runs ``warmup`` untimed steps and ``steps`` timed steps of
``zero_grad + forward + backward + opt.step()`` on random tokens. SCAPE's own
dense warm-up (``scape_warmup_steps``) and the first mask's delay fall inside the
untimed steps, so every timed SCAPE step is sparse (checked; a dense timed step
raises).

Per variant and rank it measures the median step time and the median time inside
``opt.step()`` over the timed steps (then the max over ranks, by one
``all_reduce(MAX)`` after all variants), the bytes the communicator's stats
counted over the timed steps (per step, split by op), and the optimizer state this
rank holds: master shard, ``exp_avg`` (plus ``exp_avg_sq`` for AdamW, plus the
error-feedback residual when on; LocalAdamS: its full-size first moment, anchor
and residual; a wrapped AdamW: AdamW's own state, the anchor, the residual and
the gradient's running mean). Nothing here prints (``optim.apps.cli.bench`` does).
"""

from __future__ import annotations

import gc
import logging
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

import sparsecomm.distributed as dist
from bindings.json_object import JsonObject
from bindings.spawn import run_local
from bindings.stats import op_delta
from optim.apps.train_job.data import VOCAB_SIZE
from optim.apps.train_job.job_config import TrainConfig, build_optimizer
from optim.apps.train_job.model import GPT, GPTConfig
from optim.apps.train_job.train import joined_group
from optim.optimizers.coded_gradients import CODED_MIN_DENSITY
from optim.optimizers.demo import demo_plan

__all__ = [
    "OptimizerBenchConfig",
    "bench_variants",
    "optimizer_bench_worker",
    "summarize_ranks",
    "run_optimizer_bench",
]

logger = logging.getLogger(__name__)

_FP32 = 4


@dataclass(frozen=True, kw_only=True)
class OptimizerBenchConfig:
    """Everything that determines an optimizer benchmark run."""

    nproc: int = 4  # Local ranks to spawn.
    d_model: int = 512  # Model width.
    n_layers: int = 7  # Transformer blocks (512 x 7 gives ~22.2M parameters).
    n_heads: int = 8  # Attention heads.
    context: int = 64  # Tokens per sequence.
    batch: int = 1  # Sequences per rank per step (small: communication should dominate).
    steps: int = 10  # Timed steps per optimizer.
    warmup: int = 3  # Untimed steps per optimizer (must cover SCAPE's dense warm-up and first mask).
    densities: tuple[float, ...] = (0.1, 0.01)  # SCAPE densities.
    inline_rows: bool = True  # Also time SCAPE with its mask piece built inside opt.step() (the old way).
    local_rows: bool = True  # Also time LocalAdamS (its defaults) at each density.
    local_variant_rows: bool = True  # And LocalAdamS with overlap=True, and with a bfloat16 normalizer EMA.
    local_adamw_rows: bool = True  # Also time torch.optim.AdamW wrapped by LocalOptimizer at each density.
    coded_rows: bool = True  # Also time torch.optim.AdamW inside CodedGradients at each density it fits.
    demo_rows: bool = True  # Also time torch.optim.SGD inside DeMo at each density its plan fits.
    scape_warmup_steps: int = 1  # SCAPE: dense steps before sparsity starts.
    mask_delay: int = 1  # SCAPE: the mask made after step t is used at step t + 1 + mask_delay.
    lr: float = 1e-3  # Constant learning rate of every optimizer.
    seed: int = 0  # Seed of the model initialisation and of the random tokens.
    threads: int = 1  # ``torch.set_num_threads`` in every rank.
    comm_timeout_s: float = 300.0  # Deadline of every collective.
    job_timeout_s: float = 1800.0  # Deadline of the whole local job.

    def __post_init__(self) -> None:
        for name in ("nproc", "d_model", "n_layers", "n_heads", "context", "batch", "steps", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "scape_warmup_steps", "mask_delay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.densities or any(not 0.0 < d < 1.0 for d in self.densities):
            raise ValueError(f"densities must be in (0, 1) (1 is dense AdamS), got {self.densities}")
        first_sparse = self.first_sparse_step()
        if self.warmup < first_sparse:
            raise ValueError(
                f"warmup={self.warmup} < {first_sparse}: SCAPE's first sparse step (0-based) would be timed "
                f"after dense ones (scape_warmup_steps={self.scape_warmup_steps}, mask_delay={self.mask_delay})"
            )
        if not self.lr > 0 or self.comm_timeout_s <= 0 or self.job_timeout_s <= 0:
            raise ValueError("lr and timeouts must be positive")
        self.model_config()  # validates the model shape

    def first_sparse_step(self) -> int:
        """0-based index of SCAPE's first sparse step: after its warm-up and the first mask's delay."""
        return max(self.scape_warmup_steps, self.mask_delay + 1)

    def model_config(self) -> GPTConfig:
        """The benchmarked model shape (the training job's GPT, byte vocabulary)."""
        return self.train_config("adams").model_config()

    def train_config(
        self, optimizer: str, density: float = 0.01, world_size: int | None = None, *, variant: str = ""
    ) -> TrainConfig:
        """The :class:`TrainConfig` whose :func:`~optim.apps.train_job.train.build_optimizer` builds one variant.

        ``variant``: ``""``, ``"inline"`` (SCAPE), ``"overlap"`` or ``"lean"`` (LocalAdamS).
        """
        return TrainConfig(
            background_proposal=variant != "inline",
            local_overlap=variant == "overlap",
            local_normalizer_dtype="bfloat16" if variant == "lean" else "float32",
            optimizer=optimizer,
            nproc=world_size or self.nproc,
            lr=self.lr,
            density=density,
            sparse_warmup_steps=self.scape_warmup_steps,
            mask_delay=self.mask_delay,
            batch=self.batch,
            context=self.context,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            seed=self.seed,
            threads=self.threads,
        )

    def as_dict(self) -> JsonObject:
        """The fields as a JSON-serialisable dict."""
        d = asdict(self)
        d["densities"] = list(self.densities)
        return d


def bench_variants(config: OptimizerBenchConfig) -> list[tuple[str, str, float]]:
    """``(name, TrainConfig.optimizer, density)`` of every variant, in run order."""
    out = [("adamw", "adamw", 1.0), ("adams", "adams", 1.0)]
    for d in config.densities:
        out.append((f"scape@{d:g}", "scape", float(d)))
        if config.inline_rows:
            out.append((f"scape@{d:g}/inline", "scape", float(d)))
    if config.local_rows:
        for d in config.densities:
            out.append((f"local@{d:g}", "local-adams", float(d)))
            if config.local_variant_rows:
                out += [(f"local@{d:g}/{v}", "local-adams", float(d)) for v in ("overlap", "lean")]
    if config.local_adamw_rows:
        out += [(f"local-adamw@{d:g}", "local-adamw", float(d)) for d in config.densities]
    if config.coded_rows:
        out += [(f"coded-adamw@{d:g}", "coded-adamw", float(d)) for d in config.densities if d >= CODED_MIN_DENSITY]
    if config.demo_rows:
        out += [(f"demo-sgd@{d:g}", "demo-sgd", float(d)) for d in config.densities if _demo_fits(d, config.nproc)]
    return out


def _demo_fits(density: float, world_size: int) -> bool:
    try:
        demo_plan(density, world_size)
    except ValueError:
        return False
    return True


def _batch(config: OptimizerBenchConfig, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(config.seed * 1_000_003 + step * 1009 + rank)
    tokens = torch.randint(VOCAB_SIZE, (config.batch, config.context + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _state_bytes(opt: Any) -> dict[str, int]:
    """Bytes of this rank's optimizer state, by part (master shard, each state tensor, residual).

    The master shard counts only where it is memory of its own: a master kept in the parameters
    themselves (SCAPE, LocalAdamS with fp32 parameters) is the model's memory, not the optimizer's.
    """
    local_state = getattr(opt, "local_state", None)  # LocalOptimizer, CodedGradients, DeMo: what the wrapper keeps
    if local_state is not None:  # the wrapped optimizer's own state, then what the averaging keeps
        parts: dict[str, int] = {}
        for st in opt.state.values():
            for name, t in st.items():
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    parts[name] = parts.get(name, 0) + t.numel() * t.element_size()
        return {**parts, **{n: t.numel() * t.element_size() for n, t in local_state.items()}}
    master = opt.master_shard
    in_params = any(master.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in opt.bucket.params)
    parts = {} if in_params else {"master": master.numel() * master.element_size()}
    for name, s in opt.shard_state.items():
        parts[name] = s.numel() * s.element_size()
    residual = getattr(opt, "residual", None)
    if residual is not None:
        parts["residual"] = residual.numel() * residual.element_size()
    for name, t in getattr(opt, "replica_state", {}).items():  # LocalAdamS: full-size state
        parts[name] = t.numel() * t.element_size()
    return parts


def _run_variant(
    config: OptimizerBenchConfig, rank: int, world_size: int, optimizer: str, density: float, variant: str
) -> JsonObject:
    """Time one optimizer on this rank; return rank-local medians, bytes and state sizes."""
    torch.manual_seed(config.seed)
    model = GPT(config.model_config())
    params = [p for p in model.parameters() if p.requires_grad]
    comm = dist.get_communicator()
    stats = comm.stats
    with stats.scope("init"):
        opt = build_optimizer(config.train_config(optimizer, density, world_size, variant=variant), model)
    scape: Any = opt if hasattr(opt, "last_mask") else None  # SCAPE: the mask of every step
    in_flight = getattr(opt, "wait_in_flight", None)  # LocalAdamS with overlap: bytes of a step move after it
    is_scape = scape is not None
    step_s: list[float] = []
    opt_s: list[float] = []
    sparse_flags: list[bool] = []
    try:
        for step in range(config.warmup + config.steps):
            timed = step >= config.warmup
            if step == config.warmup:
                if in_flight is not None:
                    in_flight()  # the warm-up's last averaging has moved its bytes before the count starts
                with stats.scope("bench_barrier"):
                    dist.barrier()
                ops0 = stats.as_dict()
            x, y = _batch(config, step, rank)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            assert loss is not None
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if timed:
                step_s.append(t2 - t0)
                opt_s.append(t2 - t1)
                if scape is not None:
                    sparse_flags.append(scape.last_mask is not None)
        if in_flight is not None:
            in_flight()  # and the last timed step's, before it ends
        ops = op_delta(ops0, stats.as_dict())
    finally:
        close = getattr(opt, "close", None)
        if close is not None:
            close()  # finish the mask gathers or the averaging in flight (the next variant uses the same group)
    if is_scape and not all(sparse_flags):
        raise RuntimeError(
            f"scape@{density:g}: {sparse_flags.count(False)} of {len(sparse_flags)} timed steps were dense; "
            "raise the warm-up"
        )
    b = opt.bucket  # type: ignore[attr-defined]
    parts = _state_bytes(opt)
    out = {
        "num_parameters": sum(p.numel() for p in params),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "numel": b.numel,
        "shard_size": b.shard_size,
        "state_bytes": sum(parts.values()),
        "state_bytes_by_part": parts,
        "wire_bytes_per_step": sum(d["bytes_sent"] for d in ops.values()) / config.steps,
        "wire_bytes_received_per_step": sum(d["bytes_received"] for d in ops.values()) / config.steps,
        "wire_bytes_per_step_by_op": {op: d["bytes_sent"] / config.steps for op, d in ops.items()},
        "calls_per_step_by_op": {op: d["calls"] / config.steps for op, d in ops.items()},
        "step_s_median": statistics.median(step_s),
        "opt_step_s_median": statistics.median(opt_s),
        "fwd_bwd_s_median": statistics.median(s - o for s, o in zip(step_s, opt_s, strict=True)),
        "sparse_steps": sum(sparse_flags) if is_scape else 0,
    }
    del opt, scape, model, params
    gc.collect()
    return out


def optimizer_bench_worker(rank: int, world_size: int, config: OptimizerBenchConfig) -> JsonObject:
    """Run every variant as one rank of an initialised default group; return this rank's results.

    Collective: every rank of the group must call this with the same config. The
    timings of the result are already the max over ranks of the per-rank medians
    (one ``all_reduce(MAX)`` after the last variant); bytes and state sizes are this
    rank's.

    Returns:
        ``rank``, ``world_size``, ``peak_rss_bytes`` and ``variants``: one dict per
        :func:`bench_variants` entry (``name``, ``optimizer``, ``density`` plus the
        measurements).
    """
    if dist.get_rank() != rank or dist.get_world_size() != world_size:
        raise RuntimeError(f"rank/world_size {rank}/{world_size} differ from the process group's")
    torch.set_num_threads(config.threads)
    results = []
    for name, optimizer, density in bench_variants(config):
        t0 = time.perf_counter()
        r = _run_variant(config, rank, world_size, optimizer, density, name.partition("/")[2])
        results.append({"name": name, "optimizer": optimizer, "density": density, **r})
        logger.info(
            "rank %d: %s done in %.1f s (local median step %.1f ms)",
            rank,
            name,
            time.perf_counter() - t0,
            r["step_s_median"] * 1e3,
        )
    keys = ("step_s_median", "opt_step_s_median", "fwd_bwd_s_median")
    local = torch.tensor([[r[k] for k in keys] for r in results], dtype=torch.float64)
    worst = local.clone()
    with dist.get_communicator().stats.scope("bench_result"):
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    for r, row_local, row_max in zip(results, local.tolist(), worst.tolist(), strict=True):
        for k, lv, mv in zip(keys, row_local, row_max, strict=True):
            r[k + "_local"] = lv
            r[k] = mv
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "rank": rank,
        "world_size": world_size,
        "peak_rss_bytes": rss if sys.platform == "darwin" else rss * 1024,
        "variants": results,
    }


def summarize_ranks(config: OptimizerBenchConfig, per_rank: list[JsonObject]) -> JsonObject:
    """Merge every rank's :func:`optimizer_bench_worker` result into one row per variant.

    A row holds the timings (max over ranks of the medians, ms), rank 0's wire
    bytes per step, every rank's state bytes, the largest of them, its ratio to the
    full fp32 master weights (``4 * numel``), and ``speedup`` /
    ``opt_step_speedup``: dense ShardedAdamS's time over the row's.
    """
    world_size = len(per_rank)
    base = next(v for v in per_rank[0]["variants"] if v["name"] == "adams")
    rows = []
    for i, v0 in enumerate(per_rank[0]["variants"]):
        vs = [pr["variants"][i] for pr in per_rank]
        state = [v["state_bytes"] for v in vs]
        full_master = _FP32 * v0["numel"]
        rows.append(
            {
                "name": v0["name"],
                "optimizer": v0["optimizer"],
                "density": v0["density"],
                "world_size": world_size,
                "num_parameters": v0["num_parameters"],
                "param_bytes": v0["param_bytes"],
                "shard_size": v0["shard_size"],
                "state_bytes_per_rank": state,
                "state_bytes_max": max(state),
                "state_bytes_by_part": v0["state_bytes_by_part"],
                "state_to_full_master": max(state) / full_master,
                "wire_bytes_per_step": v0["wire_bytes_per_step"],
                "wire_bytes_per_step_per_rank": [v["wire_bytes_per_step"] for v in vs],
                "wire_bytes_per_step_by_op": v0["wire_bytes_per_step_by_op"],
                "calls_per_step_by_op": v0["calls_per_step_by_op"],
                "step_ms": v0["step_s_median"] * 1e3,
                "opt_step_ms": v0["opt_step_s_median"] * 1e3,
                "fwd_bwd_ms": v0["fwd_bwd_s_median"] * 1e3,
                "step_ms_per_rank_median": [v["step_s_median_local"] * 1e3 for v in vs],
                "speedup": base["step_s_median"] / v0["step_s_median"],
                "opt_step_speedup": base["opt_step_s_median"] / v0["opt_step_s_median"],
                "sparse_steps": v0["sparse_steps"],
                "timed_steps": config.steps,
            }
        )
    return {
        "config": config.as_dict(),
        "world_size": world_size,
        "peak_rss_bytes_per_rank": [pr["peak_rss_bytes"] for pr in per_rank],
        "rows": rows,
    }


def _rank_main(rank: int, world_size: int, config: OptimizerBenchConfig) -> JsonObject:
    with joined_group("gloo", config.threads, config.comm_timeout_s):
        return optimizer_bench_worker(rank, world_size, config)


def run_optimizer_bench(config: OptimizerBenchConfig) -> JsonObject:
    """Spawn ``config.nproc`` local gloo ranks, run every variant, return :func:`summarize_ranks`'s dict.

    Raises:
        LocalRunError: A rank raised, died, or the job ran past ``config.job_timeout_s``.
    """
    t0 = time.perf_counter()
    per_rank = run_local(_rank_main, config.nproc, config, timeout=config.job_timeout_s)
    out = summarize_ranks(config, per_rank)
    out["wall_time_s"] = time.perf_counter() - t0
    return out
