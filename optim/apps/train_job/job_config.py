"""The training job's configuration: :class:`TrainConfig`, the optimizer it builds and its learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bindings.json_object import JsonObject
from bindings.validate import check_bool, check_density
from optim.apps.train_job.data import DEFAULT_MAX_BYTES
from optim.apps.train_job.model import GPTConfig
from optim.apps.train_job.tasks import TaskSpec, check_choices
from optim.optimizers.adams import AdamS
from optim.optimizers.coded_gradients import CodedGradients
from optim.optimizers.demo import DeMo
from optim.optimizers.diloco import DiLoCo, diloco_period
from optim.optimizers.local import LOCAL_SCHEDULES, NORMALIZERS, WINDOW_ORDERS, LocalAdamS
from optim.optimizers.local_optimizer import NOISE, LocalOptimizer
from optim.optimizers.masked_loco import MaskedLoCo
from optim.optimizers.scape import MASK_SCORES, SCAPE, UNSELECTED_POLICIES
from optim.optimizers.sharded import ShardedAdamS, ShardedAdamW
from optim.optimizers.sparseloco import SparseLoCo
from optim.optimizers.topk import TopKAdamS, TopKGradients
from optim.optimizers.wrapping import WrappingOptimizer

__all__ = [
    "DDP_HOOKS",
    "DENSITY_ONLY",
    "LOCAL_WIRES",
    "OPTIMIZERS",
    "OUTER_LOOPS",
    "PERIODIC_OUTER",
    "WRAPPED_ADAMW",
    "WRAPPED_ADAMS",
    "WRAPPED_SGD",
    "WRAPPERS",
    "SPARSE_OPTIMIZERS",
    "TORCH_ADAMW",
    "TrainConfig",
    "build_optimizer",
    "lr_at",
]

DENSITY_ONLY = ("sparseloco-adamw", "maskedloco-adamw", "coded-adamw", "coded-adams", "topk-adamw", "demo-sgd")
"""The sparse choices whose settings beyond the dense ones are ``density`` and ``sparse_warmup_steps`` alone."""

OPTIMIZERS = (
    "adamw",
    "adams",
    "scape",
    "local-adams",
    "local-adamw",
    "topk-adams",
    "allreduce-adamw",
    "ddp-powersgd-adamw",
    "ddp-sparse-adamw",
    "diloco-adamw",
    "periodic-adamw",
    *DENSITY_ONLY,
)
"""Choices of ``TrainConfig.optimizer``: ShardedAdamW, ShardedAdamS, SCAPE, LocalAdamS,
:class:`torch.optim.AdamW` wrapped by :class:`optim.LocalOptimizer` (``local-adamw``), TopKAdamS,
:class:`torch.optim.AdamW` inside :class:`optim.DiLoCo`, :class:`optim.SparseLoCo` or :class:`optim.MaskedLoCo` at
the density's bytes per step (``diloco-adamw``, ``sparseloco-adamw``, ``maskedloco-adamw``; ``periodic-adamw``:
DiLoCo's period with the plain average of the replicas as its outer step), inside
:class:`optim.CodedGradients` (``coded-adamw``: the average gradient in codes of the density's bytes;
``coded-adams``: the same around :class:`optim.AdamS`) or :class:`optim.TopKGradients` (``topk-adamw``: the
average of every rank's top-k gradient entries),
:class:`torch.optim.SGD` inside :class:`optim.DeMo` (``demo-sgd``: DeMo's signum step on the ranks' fast momentum
components), and
:class:`torch.optim.AdamW` with the gradients
synchronized outside it: the original bucket all-reduce, or torch's DDP with the PowerSGD hook or sparsecomm's
sparse hook."""

SPARSE_OPTIMIZERS = (
    "scape",
    "local-adams",
    "local-adamw",
    "topk-adams",
    "ddp-sparse-adamw",
    "diloco-adamw",
    "periodic-adamw",
    *DENSITY_ONLY,
)
"""The choices that take ``density`` and ``sparse_warmup_steps``."""

OUTER_LOOPS: dict[str, type[DiLoCo] | type[SparseLoCo] | type[MaskedLoCo]] = {
    "diloco-adamw": DiLoCo,
    "periodic-adamw": DiLoCo,
    "sparseloco-adamw": SparseLoCo,
    "maskedloco-adamw": MaskedLoCo,
}
"""The choices that wrap :class:`torch.optim.AdamW` in an outer loop (:class:`optim.optimizers.outer.OuterLoop`)."""

WRAPPED_ADAMW: dict[str, type[WrappingOptimizer]] = {
    "local-adamw": LocalOptimizer,
    "coded-adamw": CodedGradients,
    "topk-adamw": TopKGradients,
    **OUTER_LOOPS,
}
"""The choices that wrap :class:`torch.optim.AdamW` (:class:`optim.optimizers.wrapping.WrappingOptimizer`)."""

WRAPPED_SGD: dict[str, type[WrappingOptimizer]] = {"demo-sgd": DeMo}
"""The choices that wrap :class:`torch.optim.SGD` without momentum (DeMo's step: ``lr * (sign(Q) + wd * theta)``)."""

WRAPPED_ADAMS: dict[str, type[WrappingOptimizer]] = {"coded-adams": CodedGradients}
"""The choices that wrap the plain (per-replica) :class:`optim.AdamS`."""

WRAPPERS: dict[str, type[WrappingOptimizer]] = {**WRAPPED_ADAMW, **WRAPPED_SGD, **WRAPPED_ADAMS}
"""Every choice that wraps a torch optimizer, and its wrapper."""

PERIODIC_OUTER: JsonObject = {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}
"""DiLoCo's outer step for ``periodic-adamw``: the parameters become the replicas' average (periodic averaging)."""

DDP_HOOKS = {"ddp-powersgd-adamw": "powersgd", "ddp-sparse-adamw": "sparse"}
"""The choices that run the model under DDP, and their comm hook (:mod:`optim.apps.train_job.ddp`)."""

TORCH_ADAMW = ("allreduce-adamw", *DDP_HOOKS)
"""The choices whose optimizer is :class:`torch.optim.AdamW` (gradients synchronized before its step)."""

LOCAL_WIRES = ("auto", "float32", "bfloat16", "int8", "int4", "int2", "int1")
"""Choices of ``TrainConfig.local_wire``: LocalAdamS's default (``wire_bits="auto"``), float32 values,
bfloat16 changes, or changes in ``intB`` codes (``wire_bits=B``)."""


LOCAL_MOMENTS = {"auto": "auto", "on": True, "off": False}
"""Choices of ``TrainConfig.local_moment``, as LocalAdamS's ``average_moment``."""


def _local_wire_kwargs(wire: str) -> JsonObject:
    if wire == "auto":
        return {"wire_dtype": "bfloat16", "wire_bits": "auto"}
    if wire.startswith("int"):
        return {"wire_dtype": "bfloat16", "wire_bits": int(wire[3:])}
    return {"wire_dtype": wire, "wire_bits": None}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that determines a training run."""

    steps: int = 300  # Optimizer steps.
    nproc: int = 4  # Local processes to spawn (ignored when a launcher started the job).
    backend: str = "gloo"  # ``gloo`` or ``mpi`` (``mpi`` needs mpirun).
    lr: float = 3e-3  # Peak learning rate.
    min_lr_ratio: float = 0.1  # Final learning rate of the cosine schedule, relative to ``lr``.
    warmup_steps: int = 30  # Steps of linear warm-up.
    weight_decay: float = 0.1  # Decoupled weight decay (matrices only).
    grad_clip: float = 1.0  # Global gradient-norm clip (0 disables).
    optimizer: str = "adamw"  # One of OPTIMIZERS.
    betas: tuple[float, float] = (0.9, 0.95)  # Adam / AdamS betas.
    eps: float = 1e-8  # Adam / AdamS epsilon.
    density: float = 0.01  # SCAPE, LocalAdamS, TopKAdamS: fraction of the dense bytes per step.
    mask_delay: int = 1  # SCAPE: mask made after step t is used at step t + 1 + mask_delay.
    sparse_warmup_steps: int = 10  # SCAPE, LocalAdamS, TopKAdamS, the DDP hooks: dense steps before compression.
    powersgd_rank: int = 4  # ddp-powersgd-adamw: rank of PowerSGD's low-rank approximation.
    local_schedule: str = "staggered"  # LocalAdamS: staggered | periodic averaging.
    local_wire: str = "auto"  # LocalAdamS: one of LOCAL_WIRES (auto codes, float32 values, bfloat16 or intB changes).
    local_normalizer: str = "auto"  # LocalAdamS: auto | debiased | measured | local (see optim.LocalAdamS).
    local_window_order: str = "auto"  # LocalAdamS: auto | contiguous | spread staggered window.
    local_moment: str = "auto"  # LocalAdamS, local-adamw: auto | on | off: the window carries the first moment too.
    local_normalizer_dtype: str = "float32"  # LocalAdamS: float32 | bfloat16 second-moment EMA of the normalizer.
    local_overlap: bool = False  # LocalAdamS: each averaging lands a step late, beside the next forward/backward.
    local_noise: str = "auto"  # local-adamw: auto | debias | keep: AdamW's second moment (optim.LocalOptimizer).
    unselected: str = "decay_m"  # SCAPE: policy of unselected coordinates (freeze | decay_m).
    error_feedback: bool = False  # SCAPE: keep the unsent gradient as a local residual.
    refresh_every: int = 0  # SCAPE: every this many steps a dense step (0: never).
    mask_score: str = "abs_m_theta"  # SCAPE: mask statistic (one of optim.MASK_SCORES).
    explore: float = 0.1  # SCAPE: fraction of k chosen round-robin instead of by score.
    background_proposal: bool = True  # SCAPE on CPU: build the next mask piece beside the next forward/backward.
    batch: int = 16  # Sequences per rank per step.
    context: int = 64  # Tokens per sequence.
    d_model: int = 128  # Model width.
    n_layers: int = 2  # Transformer blocks.
    n_heads: int = 4  # Attention heads.
    seed: int = 0  # Seed of the initialisation and of the data order.
    task: str = "text"  # ``text`` (byte LM) or ``digits`` (MLP or CNN on scikit-learn's digits).
    corpus: str = "stdlib"  # Text task without ``data``: stdlib | pydoc | synthetic | torchdoc.
    arch: str = "gpt"  # Model family: gpt | encoder | gru (text); mlp | cnn (digits; there gpt means mlp).
    out: str = "runs/train"  # Output directory of ``report.json`` and ``report.png``.
    data: str | None = None  # Text file to train on; ``None`` for the standard-library corpus.
    max_corpus_bytes: int = DEFAULT_MAX_BYTES  # Size cap of the standard-library corpus.
    val_fraction: float = 0.05  # Held-out tail of the text.
    eval_interval: int = 50  # Steps between validation passes (0: only at step 0 and the end).
    eval_batches: int = 4  # Validation batches per rank per pass.
    threads: int = 1  # ``torch.set_num_threads`` in every rank.
    comm_timeout_s: float = 120.0  # Deadline of every collective.
    job_timeout_s: float = 900.0  # Deadline of the whole local job (spawn to last exit).

    def __post_init__(self) -> None:
        positive = ("steps", "nproc", "batch", "context", "d_model", "n_layers", "n_heads")
        for name in positive + ("eval_batches", "threads", "max_corpus_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_interval", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        check_density(self.density)
        if self.powersgd_rank < 1:
            raise ValueError(f"powersgd_rank must be >= 1, got {self.powersgd_rank}")
        if self.optimizer in DDP_HOOKS and self.backend != "gloo":
            raise ValueError(f"{self.optimizer} runs torch's DDP: it needs the gloo backend, not {self.backend!r}")
        for name in ("mask_delay", "sparse_warmup_steps", "refresh_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        check_choices(
            self, {"local_wire": LOCAL_WIRES, "local_normalizer": NORMALIZERS, "local_window_order": WINDOW_ORDERS}
        )
        if self.local_normalizer_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"local_normalizer_dtype must be float32 or bfloat16, got {self.local_normalizer_dtype!r}")
        check_choices(self, {"local_noise": NOISE})
        check_bool("local_overlap", self.local_overlap)
        check_choices(
            self,
            {
                "local_moment": LOCAL_MOMENTS,
                "local_schedule": LOCAL_SCHEDULES,
                "unselected": UNSELECTED_POLICIES,
                "mask_score": MASK_SCORES,
            },
        )
        if self.mask_score == "abs_m_residual" and not self.error_feedback:
            raise ValueError("mask_score 'abs_m_residual' needs error_feedback")
        if not 0.0 <= self.explore < 1.0:
            raise ValueError(f"explore must be in [0, 1), got {self.explore}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas) or not self.eps > 0:
            raise ValueError(f"bad betas {self.betas} or eps {self.eps}")
        if self.backend not in ("gloo", "mpi"):
            raise ValueError(f"backend must be 'gloo' or 'mpi', got {self.backend!r}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"bad learning rate lr={self.lr} min_lr_ratio={self.min_lr_ratio}")
        if self.comm_timeout_s <= 0 or self.job_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        self.task_spec()  # validates the task and the model shape

    def task_spec(self) -> TaskSpec:
        """Return the task fields of this run."""
        return TaskSpec(
            task=self.task,
            corpus=self.corpus,
            arch=self.arch,
            data=self.data,
            max_corpus_bytes=self.max_corpus_bytes,
            val_fraction=self.val_fraction,
            batch=self.batch,
            context=self.context,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            seed=self.seed,
        )

    def model_config(self) -> GPTConfig:
        """Return the transformer shape of this run (text task)."""
        return self.task_spec().gpt_config()

    def optimizer_config(self) -> JsonObject:
        """Return the optimizer's name, class and constructor settings (JSON-serialisable)."""
        common: JsonObject = {
            "lr": self.lr,
            "betas": list(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }
        if self.optimizer in TORCH_ADAMW:
            out = {"name": self.optimizer, "class": "torch.optim.AdamW", "grad_clip": self.grad_clip, **common}
            return {**out, **self.sparse_kwargs()}
        if self.optimizer in WRAPPERS:
            inner = "torch.optim.AdamW"
            if self.optimizer in WRAPPED_SGD:
                inner = "torch.optim.SGD"
                common = {"lr": self.lr, "weight_decay": self.weight_decay}
            elif self.optimizer in WRAPPED_ADAMS:
                inner = "optim.AdamS"
            wrapper = WRAPPERS[self.optimizer].__name__
            out = {"name": self.optimizer, "class": f"optim.{wrapper}({inner})", **common}
            return {**out, "max_grad_norm": self.grad_clip, **self.sparse_kwargs()}
        cls = _CLASSES[self.optimizer]
        out = {"name": self.optimizer, "class": f"optim.{cls.__name__}", **common, "max_grad_norm": self.grad_clip}
        out.update(self.sparse_kwargs())
        return out

    def sparse_kwargs(self) -> JsonObject:
        """The constructor arguments of the sparse choices beyond the dense ones (``{}`` for dense ones)."""
        if self.optimizer == "scape":
            return self.scape_kwargs()
        if self.optimizer == "diloco-adamw":  # one fp32 all_reduce every 1/density steps
            return {"period": diloco_period(self.density), "warmup_steps": self.sparse_warmup_steps}
        if self.optimizer == "periodic-adamw":  # the same period, the replicas' plain average as the outer step
            return {
                "period": diloco_period(self.density),
                "warmup_steps": self.sparse_warmup_steps,
                **PERIODIC_OUTER,
            }
        if self.optimizer in DENSITY_ONLY:
            return {"density": self.density, "warmup_steps": self.sparse_warmup_steps}
        averaging = {  # LocalAdamS's and LocalOptimizer's averaging (optim.optimizers.averaging.Averaging)
            "density": self.density,
            "schedule": self.local_schedule,
            "warmup_steps": self.sparse_warmup_steps,
            **_local_wire_kwargs(self.local_wire),
            "window_order": self.local_window_order,
            "overlap": self.local_overlap,
        }
        if self.optimizer == "local-adams":
            return {
                **averaging,
                "normalizer": self.local_normalizer,
                "average_moment": LOCAL_MOMENTS[self.local_moment],
                "normalizer_dtype": self.local_normalizer_dtype,
            }
        if self.optimizer == "local-adamw":
            return {**averaging, "noise": self.local_noise, "average_moment": LOCAL_MOMENTS[self.local_moment]}
        if self.optimizer == "topk-adams":
            return {"density": self.density, "warmup_steps": self.sparse_warmup_steps}
        if self.optimizer == "ddp-sparse-adamw":
            return {"hook": "sparse", "density": self.density, "start_iter": self.sparse_warmup_steps}
        if self.optimizer == "ddp-powersgd-adamw":
            return {"hook": "powersgd", "powersgd_rank": self.powersgd_rank, "start_iter": self.sparse_warmup_steps}
        return {}

    def scape_kwargs(self) -> JsonObject:
        """The SCAPE-only constructor arguments of this config."""
        return {
            "density": self.density,
            "mask_delay": self.mask_delay,
            "warmup_steps": self.sparse_warmup_steps,
            "unselected": self.unselected,
            "error_feedback": self.error_feedback,
            "refresh_every": self.refresh_every,
            "score": self.mask_score,
            "explore": self.explore,
            "background_proposal": self.background_proposal,
        }


def build_optimizer(config: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Build ``config.optimizer`` over ``model``'s parameters (collective for the sharded ones).

    Weight decay applies to parameters with ``dim() >= 2`` only, for every choice.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    if config.optimizer in WRAPPED_SGD:
        sgd = torch.optim.SGD(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=config.lr,
        )
        return WRAPPED_SGD[config.optimizer](sgd, model, max_grad_norm=config.grad_clip, **config.sparse_kwargs())
    if config.optimizer in WRAPPED_ADAMS:  # AdamS decays the matrices only (wd_min_ndim=2), as above
        adams = AdamS(params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay)
        return WRAPPED_ADAMS[config.optimizer](adams, model, max_grad_norm=config.grad_clip, **config.sparse_kwargs())
    if config.optimizer in TORCH_ADAMW or config.optimizer in WRAPPED_ADAMW:
        adamw = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
        )
        if config.optimizer not in WRAPPED_ADAMW:
            return adamw
        if config.optimizer != "local-adamw":
            wrapper = WRAPPED_ADAMW[config.optimizer]
            return wrapper(adamw, model, max_grad_norm=config.grad_clip, **config.sparse_kwargs())
        local = config.sparse_kwargs()
        local["wire_dtype"] = getattr(torch, local["wire_dtype"])
        return LocalOptimizer(adamw, model, max_grad_norm=config.grad_clip, **local)
    sparse = config.sparse_kwargs()
    for key in ("wire_dtype", "normalizer_dtype"):
        if key in sparse:
            sparse[key] = getattr(torch, sparse[key])
    opt: torch.optim.Optimizer = _CLASSES[config.optimizer](
        params,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        max_grad_norm=config.grad_clip,
        **sparse,
    )
    return opt


_CLASSES: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": ShardedAdamW,
    "adams": ShardedAdamS,
    "scape": SCAPE,
    "local-adams": LocalAdamS,
    "topk-adams": TopKAdamS,
}


def lr_at(config: TrainConfig, step: int) -> float:
    """Return the learning rate of 1-based ``step``: linear warm-up, then cosine decay."""
    if config.warmup_steps and step <= config.warmup_steps:
        return config.lr * step / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    floor = config.lr * config.min_lr_ratio
    return floor + 0.5 * (config.lr - floor) * (1.0 + math.cos(math.pi * progress))
