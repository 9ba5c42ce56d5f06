"""DDP comm-hook benchmark: plain DDP, PowerSGD and sparsecomm's sparse hook, same model, data and steps.

:func:`run_hook_bench` spawns ``nproc`` local gloo ranks; every rank trains the
train job's GPT on the standard-library corpus (same initialisation, the same
batches for every variant) under ``torch.nn.parallel.DistributedDataParallel``
with ``torch.optim.AdamW``, once per variant:

* ``ddp``: torch's own all-reduce hook (what DDP does without a hook);
* ``powersgd-rR``: torch's PowerSGD hook at rank R (error feedback on, its
  dense iterations first as ``start_powerSGD_iter``);
* ``sparse@D``: :func:`sparsecomm.hooks.sparse_allreduce_hook` at density D.

Every variant gets the same number of dense first iterations
(``start_iter``). Per variant: the final training loss (mean of the last 10
steps over ranks), the validation loss (held-out tail of the corpus), the
bytes one rank sent per step, and the median step time (max over ranks).
The hooks and their byte counting are :mod:`optim.apps.train_job.ddp`'s.
Nothing here prints (``optim.apps.cli.bench`` does).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

import sparsecomm.distributed as dist
from bindings.json_object import JsonObject
from bindings.spawn import run_local
from bindings.stats import CommStats, ring_bytes
from optim.apps.train_job.data import load_corpus, sample_batch
from optim.apps.train_job.ddp import close_hook, count_torch_collectives, register_hook
from optim.apps.train_job.model import GPT, GPTConfig
from optim.apps.train_job.train import joined_group
from sparsecomm.hooks import SparseHookState

__all__ = ["HookBenchConfig", "hook_variants", "run_hook_bench"]

_LOSS_TAIL = 10


@dataclass(frozen=True, kw_only=True)
class HookBenchConfig:
    """Everything that determines a hook benchmark run."""

    nproc: int = 2  # Local ranks to spawn.
    d_model: int = 128  # Model width.
    n_layers: int = 2  # Transformer blocks.
    n_heads: int = 4  # Attention heads.
    context: int = 64  # Tokens per sequence.
    batch: int = 8  # Sequences per rank per step.
    steps: int = 300  # Training steps per variant.
    start_iter: int = 10  # Dense first iterations of every compressed variant.
    densities: tuple[float, ...] = (0.1, 0.01)  # Sparse hook densities.
    powersgd_ranks: tuple[int, ...] = (1, 4)  # PowerSGD matrix approximation ranks.
    lr: float = 2e-3  # AdamW learning rate (constant).
    eval_batches: int = 8  # Validation batches per rank.
    bucket_cap_mb: float = 25.0  # DDP's bucket size.
    seed: int = 0  # Seed of the initialisation and the batches.
    max_corpus_bytes: int = 2_000_000  # Size cap of the standard-library corpus.
    threads: int = 1  # ``torch.set_num_threads`` in every rank.
    comm_timeout_s: float = 300.0  # Deadline of every collective.
    job_timeout_s: float = 3600.0  # Deadline of the whole job.

    def __post_init__(self) -> None:
        for name in ("nproc", "d_model", "n_layers", "n_heads", "context", "batch", "steps", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.start_iter < 0:
            raise ValueError(f"start_iter must be >= 0, got {self.start_iter}")
        if any(not 0.0 < d < 1.0 for d in self.densities):
            raise ValueError(f"densities must be in (0, 1), got {self.densities}")
        if any(r < 1 for r in self.powersgd_ranks):
            raise ValueError(f"powersgd_ranks must be >= 1, got {self.powersgd_ranks}")
        if not self.lr > 0 or self.bucket_cap_mb <= 0 or self.comm_timeout_s <= 0 or self.job_timeout_s <= 0:
            raise ValueError("lr, bucket_cap_mb and timeouts must be positive")
        self.model_config()

    def model_config(self) -> GPTConfig:
        """The train job's GPT at this size."""
        return GPTConfig(
            context=self.context, d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads, dropout=0.0
        )

    def as_dict(self) -> JsonObject:
        """The fields as a JSON-serialisable dict."""
        d = asdict(self)
        d["densities"] = list(self.densities)
        d["powersgd_ranks"] = list(self.powersgd_ranks)
        return d


def hook_variants(config: HookBenchConfig) -> list[str]:
    """Variant names in run order."""
    return ["ddp", *[f"powersgd-r{r}" for r in config.powersgd_ranks], *[f"sparse@{d:g}" for d in config.densities]]


def _register(config: HookBenchConfig, ddp: DistributedDataParallel, name: str) -> tuple[Any, CommStats]:
    """Register the variant's hook (:func:`optim.apps.train_job.ddp.register_hook`); its state and byte counter."""
    if name.startswith("sparse@"):
        return register_hook(ddp, "sparse", density=float(name.removeprefix("sparse@")), start_iter=config.start_iter)
    if name.startswith("powersgd-r"):
        rank = int(name.removeprefix("powersgd-r"))
        return register_hook(ddp, "powersgd", powersgd_rank=rank, start_iter=config.start_iter, seed=config.seed)
    return register_hook(ddp, "allreduce")


def _run_variant(config: HookBenchConfig, rank: int, ws: int, name: str, corpus: Any) -> JsonObject:
    torch.manual_seed(config.seed)
    model = GPT(config.model_config())
    ddp = DistributedDataParallel(model, bucket_cap_mb=config.bucket_cap_mb)
    state, stats = _register(config, ddp, name)
    opt = torch.optim.AdamW(ddp.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses: list[float] = []
    step_s: list[float] = []
    before: dict[str, dict[str, int]] = {}
    counting = contextlib.nullcontext() if isinstance(state, SparseHookState) else count_torch_collectives(stats, ws)
    with counting:
        for step in range(config.steps):
            if step == config.start_iter:
                before = stats.as_dict()
            x, y = sample_batch(
                corpus.train, batch_size=config.batch, context=config.context, seed=config.seed, step=step, rank=rank
            )
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            _, loss = ddp(x, y)
            assert loss is not None
            loss.backward()
            opt.step()
            step_s.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
    after = stats.as_dict()
    compressed = config.steps - config.start_iter
    per_op = {
        op: (v["bytes_sent"] - before.get(op, {}).get("bytes_sent", 0)) / max(1, compressed) for op, v in after.items()
    }
    close_hook(state)
    model.eval()
    val = 0.0
    with torch.no_grad():
        for i in range(config.eval_batches):
            x, y = sample_batch(
                corpus.val,
                batch_size=config.batch,
                context=config.context,
                seed=config.seed,
                step=i,
                rank=rank,
                stream="val",
            )
            _, vloss = model(x, y)
            assert vloss is not None
            val += float(vloss) / config.eval_batches
    numel = sum(p.numel() for p in model.parameters())
    return {
        "name": name,
        "num_parameters": numel,
        "train_loss": statistics.fmean(losses[-_LOSS_TAIL:]),
        "val_loss": val,
        "wire_bytes_per_step": sum(per_op.values()),
        "wire_bytes_per_step_by_op": per_op,
        "dense_bytes_per_step": ring_bytes("all_reduce", numel * 4, ws)[0],
        "step_s_median": statistics.median(step_s[config.start_iter :] or step_s),
    }


def _rank_main(rank: int, ws: int, config: HookBenchConfig) -> list[JsonObject]:
    with joined_group("gloo", config.threads, config.comm_timeout_s):
        corpus = load_corpus(max_bytes=config.max_corpus_bytes)
        rows = [_run_variant(config, rank, ws, name, corpus) for name in hook_variants(config)]
        # losses: the mean over ranks; step times: the slowest rank
        keys = ("train_loss", "val_loss", "step_s_median")
        t = torch.tensor([[r[k] for k in keys] for r in rows], dtype=torch.float64)
        mean, worst = t.clone(), t.clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        for r, m, w in zip(rows, mean.tolist(), worst.tolist(), strict=True):
            r["train_loss"], r["val_loss"], r["step_s_median"] = m[0], m[1], w[2]
        return rows


def run_hook_bench(config: HookBenchConfig) -> JsonObject:
    """Spawn the ranks, run every variant; return ``config``, ``rows`` (rank 0's, ratios to ``ddp`` added).

    Raises:
        LocalRunError: A rank raised, died, or the job ran past ``config.job_timeout_s``.
    """
    t0 = time.perf_counter()
    rows = run_local(_rank_main, config.nproc, config, timeout=config.job_timeout_s)[0]
    ref = next(r for r in rows if r["name"] == "ddp")
    for r in rows:
        r["val_ratio_to_ddp"] = r["val_loss"] / ref["val_loss"]
        r["wire_ratio_to_ddp"] = r["wire_bytes_per_step"] / ref["wire_bytes_per_step"]
        r["step_ratio_to_ddp"] = r["step_s_median"] / ref["step_s_median"]
    return {"config": config.as_dict(), "rows": rows, "wall_time_s": time.perf_counter() - t0}
