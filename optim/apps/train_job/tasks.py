"""What the training job trains: a model, its batches and its validation batches.

Two tasks, both offline and deterministic (the batch of ``(seed, step, rank)``
is a pure function of those numbers):

* ``text``: a byte-level language model on one of four corpora from
  different sources -- ``stdlib`` (the standard library's source code, the
  default), ``pydoc`` (the English documentation text that ships with the
  interpreter in ``pydoc_data``), ``synthetic`` (a generated language with known
  structure: a seeded random vocabulary, a sparse first-order Markov chain over
  it, and counting sequences), ``torchdoc`` (the docstrings of installed torch's
  public functions and classes, :func:`optim.apps.train_job.data.torch_doc_bytes`)
  -- or a user's text file. Three model families (:data:`TEXT_ARCHS`):
  ``gpt`` (:class:`optim.apps.train_job.model.GPT`: pre-norm blocks, tied head),
  ``encoder`` (:class:`torch.nn.TransformerEncoder` with a causal mask, an
  untied head) and ``gru`` (:class:`optim.apps.train_job.small_models.RecurrentLM`).
* ``digits``: classification of scikit-learn's bundled 8x8 digits (1,797
  images, a fixed 80/20 split) with an MLP (``n_layers`` hidden layers of
  width ``d_model``, GELU) or a CNN (``arch="cnn"``:
  :class:`optim.apps.train_job.small_models.DigitsCNN`, ``n_layers`` convolutions
  of ``d_model`` channels). Needs ``scikit-learn`` (the ``bench`` extra).

Every model's ``forward(x, y)`` returns ``(logits, loss)``. Initialisation
draws only from torch's global generator.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from bindings.json_object import JsonObject
from optim.apps.train_job.data import (
    VOCAB_SIZE,
    Corpus,
    encode,
    load_corpus,
    sample_batch,
    stream_seed,
    torch_doc_bytes,
)
from optim.apps.train_job.model import GPT, GPTConfig
from optim.apps.train_job.small_models import DigitsCNN, RecurrentLM

__all__ = [
    "ARCHS",
    "CORPORA",
    "DIGITS_ARCHS",
    "TEXT_ARCHS",
    "TASKS",
    "Task",
    "TaskSpec",
    "check_choices",
    "DigitsTask",
    "TextTask",
    "make_task",
    "synthetic_text",
]

TASKS = ("text", "digits")
CORPORA = ("stdlib", "pydoc", "synthetic", "torchdoc")
TEXT_ARCHS = ("gpt", "encoder", "gru")
"""Model families of the ``text`` task."""
DIGITS_ARCHS = ("mlp", "cnn")
"""Model families of the ``digits`` task; there ``gpt``, the default of ``arch``, also means the MLP."""
ARCHS = TEXT_ARCHS + DIGITS_ARCHS


def check_choices(config: object, choices: Mapping[str, Collection[object]]) -> None:
    """Check that each named field of ``config`` holds one of its choices, in the order given.

    Args:
        config: The object whose fields are checked.
        choices: Field name -> the values it may hold.

    Raises:
        ValueError: Naming the first field whose value is not one of its choices.
    """
    for name, allowed in choices.items():
        value = getattr(config, name)
        if value not in allowed:
            raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """The fields of a training run that decide its task (a view of ``TrainConfig``)."""

    task: str = "text"
    corpus: str = "stdlib"
    arch: str = "gpt"
    data: str | None = None
    max_corpus_bytes: int = 4_000_000
    val_fraction: float = 0.05
    batch: int = 16
    context: int = 64
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        check_choices(self, {"task": TASKS, "corpus": CORPORA, "arch": ARCHS})
        if self.task == "text":
            if self.arch not in TEXT_ARCHS:
                raise ValueError(f"the text task's arch must be one of {TEXT_ARCHS}, got {self.arch!r}")
            self.gpt_config()  # validates the shape
        elif self.arch not in DIGITS_ARCHS + ("gpt",):
            raise ValueError(f"the digits task's arch must be one of {DIGITS_ARCHS}, got {self.arch!r}")

    def gpt_config(self) -> GPTConfig:
        """The transformer shape of a ``text`` task."""
        return GPTConfig(
            vocab_size=VOCAB_SIZE,
            context=self.context,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
        )


class Task(Protocol):
    """A training task: what every rank of the job trains on."""

    def build_model(self) -> nn.Module:
        """A new model (seed torch first); ``model(x, y)`` returns ``(logits, loss)``."""
        ...

    def train_batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``(step, rank)``."""
        ...

    def val_batch(self, index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation batch ``index`` of ``rank`` (the same at every evaluation)."""
        ...

    def describe(self) -> JsonObject:
        """Data and model, JSON-serialisable."""
        ...


def synthetic_text(num_bytes: int = 1_000_000, seed: int = 7) -> bytes:
    """A generated language with known structure (deterministic in ``seed``).

    A vocabulary of 400 random lowercase words; sentences follow a first-order
    Markov chain in which each word has 3 possible successors (weights 6:3:1);
    one sentence in eight is a run of counting numbers (``17 18 19 20 .``). The
    entropy is low and known, so a model that learns the structure shows it.
    """
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(400)]
    succ = [[rng.randrange(400) for _ in range(3)] for _ in range(400)]
    out: list[str] = []
    size, w = 0, 0
    while size < num_bytes:
        if rng.random() < 0.125:
            start = rng.randint(0, 990)
            sentence = " ".join(str(i) for i in range(start, start + rng.randint(3, 8))) + " .\n"
        else:
            toks = []
            for _ in range(rng.randint(4, 12)):
                toks.append(words[w])
                w = rng.choices(succ[w], weights=(6, 3, 1))[0]
            sentence = " ".join(toks).capitalize() + " .\n"
        out.append(sentence)
        size += len(sentence)
    return "".join(out).encode()[:num_bytes]


def _named_corpus(spec: TaskSpec) -> Corpus:
    if spec.data is not None or spec.corpus == "stdlib":
        return load_corpus(
            spec.data, val_fraction=spec.val_fraction, max_bytes=spec.max_corpus_bytes, min_bytes=spec.context + 2
        )
    if spec.corpus == "pydoc":
        import pydoc_data.topics as topics  # ships with CPython

        text = "\n".join(topics.topics[k] for k in sorted(topics.topics)).encode()[: spec.max_corpus_bytes]
        name = "pydoc_data.topics"
    elif spec.corpus == "torchdoc":
        text, _, version = torch_doc_bytes(spec.max_corpus_bytes)
        name = f"torchdoc:{version}"
    else:
        text = synthetic_text(min(spec.max_corpus_bytes, 1_000_000))
        name = "synthetic:markov400"
    tokens = encode(text)
    n_val = max(1, int(len(text) * spec.val_fraction))
    return Corpus(
        name=name, train=tokens[:-n_val], val=tokens[-n_val:], num_files=1, sha256=hashlib.sha256(text).hexdigest()
    )


class _EncoderLM(nn.Module):
    """A causal byte LM from :class:`torch.nn.TransformerEncoder` (pre-norm layers, untied head)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(cfg.context, cfg.d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.n_heads, cfg.mlp_ratio * cfg.d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.enc = nn.TransformerEncoder(layer, cfg.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        h = self.enc(self.emb(x) + self.pos[:t], mask=mask, is_causal=True)
        logits = self.head(self.norm(h))
        loss = None if y is None else F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        return logits, loss


class TextTask:
    """A byte-level LM on a corpus (see the module docstring)."""

    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec
        self.corpus = _named_corpus(spec)
        if self.corpus.val.numel() <= spec.context:
            raise ValueError(f"validation split of {self.corpus.val.numel()} bytes is below the context")

    def build_model(self) -> nn.Module:
        cfg = self.spec.gpt_config()
        if self.spec.arch == "gru":
            return RecurrentLM(vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers)
        return GPT(cfg) if self.spec.arch == "gpt" else _EncoderLM(cfg)

    def _batch(self, tokens: torch.Tensor, step: int, rank: int, stream: str) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        return sample_batch(
            tokens, batch_size=s.batch, context=s.context, seed=s.seed, step=step, rank=rank, stream=stream
        )

    def train_batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._batch(self.corpus.train, step, rank, "train")

    def val_batch(self, index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._batch(self.corpus.val, index, rank, "val")

    def describe(self) -> JsonObject:
        return {
            "task": "text",
            "arch": self.spec.arch,
            "model": self.spec.gpt_config().as_dict(),
            "corpus": self.corpus.describe(),
        }


class _MLP(nn.Module):
    def __init__(self, n_in: int, width: int, layers: int, n_out: int) -> None:
        super().__init__()
        dims = [n_in] + [width] * layers
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True))
        self.out = nn.Linear(dims[-1], n_out)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        for lin in self.hidden:
            x = F.gelu(lin(x))
        logits = self.out(x)
        return logits, None if y is None else F.cross_entropy(logits, y)


class DigitsTask:
    """scikit-learn's 8x8 digits with an MLP (see the module docstring)."""

    def __init__(self, spec: TaskSpec) -> None:
        try:
            from sklearn.datasets import load_digits
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError("the digits task needs scikit-learn: pip install 'sparsecomm[bench]'") from exc
        self.spec = spec
        data = load_digits()
        x = torch.tensor(data.data, dtype=torch.float32) / 16.0
        y = torch.tensor(data.target, dtype=torch.int64)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
        n_val = len(y) // 5
        self.x_val, self.y_val = x[order[:n_val]], y[order[:n_val]]
        self.x_train, self.y_train = x[order[n_val:]], y[order[n_val:]]

    @property
    def arch(self) -> str:
        """``cnn`` or ``mlp`` (the spec's default ``gpt`` means the MLP)."""
        return "cnn" if self.spec.arch == "cnn" else "mlp"

    def build_model(self) -> nn.Module:
        if self.arch == "cnn":
            return DigitsCNN(channels=self.spec.d_model, layers=self.spec.n_layers)
        return _MLP(64, self.spec.d_model, self.spec.n_layers, 10)

    def _batch(
        self, x: torch.Tensor, y: torch.Tensor, step: int, rank: int, stream: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(stream_seed(self.spec.seed, step, rank, stream))
        idx = torch.randint(0, len(y), (self.spec.batch,), generator=gen)
        return x[idx], y[idx]

    def train_batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._batch(self.x_train, self.y_train, step, rank, "train")

    def val_batch(self, index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._batch(self.x_val, self.y_val, index, rank, "val")

    def describe(self) -> JsonObject:
        return {
            "task": "digits",
            "arch": self.arch,
            "model": {"width": self.spec.d_model, "layers": self.spec.n_layers},
            "corpus": {"name": "sklearn.datasets.load_digits", "train": len(self.y_train), "val": len(self.y_val)},
        }


def make_task(spec: TaskSpec) -> Task:
    """Build the task of ``spec`` (loads its data)."""
    return TextTask(spec) if spec.task == "text" else DigitsTask(spec)
