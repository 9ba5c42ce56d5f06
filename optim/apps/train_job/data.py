"""Training text: corpus loading, byte tokens, deterministic batches.

The default corpus is real text that exists offline on every machine: the
source of the Python standard library of the running interpreter. Files are
taken in a fixed order (a top-down walk with sorted directory and file names,
test directories and installed packages skipped) and concatenated, each after
a one-line header, until ``max_bytes`` is reached. The text is the same on any
two machines that run the same Python version; :attr:`Corpus.sha256` says
which text a run saw.

Tokens are bytes (vocabulary 256). The batch of a given ``(seed, step, rank)``
is a pure function of those three numbers (and the corpus): it is drawn with a
:class:`torch.Generator` seeded from a hash of them, so a rerun, a restart at
any step, or a different launcher sees exactly the same data.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "VOCAB_SIZE",
    "DEFAULT_MAX_BYTES",
    "Corpus",
    "stdlib_corpus_bytes",
    "TORCH_DOC_MODULES",
    "torch_doc_bytes",
    "load_corpus",
    "encode",
    "decode",
    "stream_seed",
    "sample_batch",
]

logger = logging.getLogger(__name__)

VOCAB_SIZE = 256
"""Byte-level vocabulary size."""

DEFAULT_MAX_BYTES = 4_000_000
"""Default size cap of the standard-library corpus (a few MB)."""

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """A byte corpus split into a training and a held-out validation part."""

    name: str
    """Where the text came from (``stdlib:<dir>`` or the file path)."""
    train: torch.Tensor
    """Training tokens, ``uint8``, 1-D."""
    val: torch.Tensor
    """Validation tokens (the last ``val_fraction`` of the text), ``uint8``, 1-D."""
    num_files: int
    """Number of source files concatenated (1 for a ``--data`` file)."""
    sha256: str
    """SHA-256 of the whole text, to tell runs on different text apart."""

    @property
    def num_bytes(self) -> int:
        """Total size of the text in bytes."""
        return int(self.train.numel() + self.val.numel())

    def describe(self) -> dict[str, object]:
        """Return a JSON-serialisable summary (no tokens)."""
        return {
            "name": self.name,
            "num_bytes": self.num_bytes,
            "train_bytes": int(self.train.numel()),
            "val_bytes": int(self.val.numel()),
            "num_files": self.num_files,
            "sha256": self.sha256,
        }


def stdlib_corpus_bytes(max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[bytes, int, str]:
    """Concatenate standard-library ``.py`` files of the running interpreter.

    Args:
        max_bytes: Stop once this many bytes are collected (the last file is
            cut to fit).

    Returns:
        ``(text, number of files, stdlib directory)``.

    Raises:
        RuntimeError: The standard library source is not there (a stripped
            install); pass a file instead.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    size = 0
    count = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for fname in sorted(filenames):
            if not fname.endswith(".py"):
                continue
            path = Path(dirpath) / fname
            try:
                body = path.read_bytes()
            except OSError:  # unreadable file: skip, the order stays fixed
                continue
            rel = path.relative_to(root).as_posix()
            chunk = f"# ---- {rel} ----\n".encode() + body + b"\n"
            parts.append(chunk[: max_bytes - size])
            size += len(parts[-1])
            count += 1
            if size >= max_bytes:
                return b"".join(parts), count, str(root)
    if size == 0:
        raise RuntimeError(f"no standard-library source found under {root}; use --data FILE")
    return b"".join(parts), count, str(root)


TORCH_DOC_MODULES = (
    "torch",
    "torch.nn",
    "torch.nn.functional",
    "torch.optim",
    "torch.linalg",
    "torch.fft",
    "torch.special",
)
"""The modules whose docstrings make :func:`torch_doc_bytes`, in this order."""


def torch_doc_bytes(max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[bytes, int, str]:
    """Concatenate the documentation of installed torch's public functions and classes.

    English prose with reStructuredText markup, formulas and interpreter
    examples: a text from another source than the standard library's code
    and the interpreter's own documentation. The modules of
    :data:`TORCH_DOC_MODULES` are read in order and their public names
    (functions and classes, no submodules) in sorted order from the module's
    own namespace, so nothing is imported lazily and the text depends only on
    the torch version. A docstring under 200 characters, one already taken
    (an alias) and a generated list of enum members are skipped; each
    docstring is cleaned of its indentation and follows a ``## module.name``
    header line.

    Args:
        max_bytes: Stop once this many bytes are collected (the last entry is cut to fit).

    Returns:
        ``(text, number of docstrings, "torch <version>")``.

    Raises:
        ValueError: ``max_bytes`` is not positive.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    seen: set[str] = set()
    parts: list[bytes] = []
    size = 0
    for module_name in TORCH_DOC_MODULES:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isroutine(obj) or inspect.isclass(obj)):
                continue
            doc = obj.__doc__
            if not isinstance(doc, str) or len(doc) < 200 or doc.lstrip().startswith("Members:") or doc in seen:
                continue
            seen.add(doc)
            chunk = f"## {module_name}.{name}\n{inspect.cleandoc(doc)}\n\n".encode()
            parts.append(chunk[: max_bytes - size])
            size += len(parts[-1])
            if size >= max_bytes:
                return b"".join(parts), len(parts), f"torch {torch.__version__}"
    return b"".join(parts), len(parts), f"torch {torch.__version__}"


def load_corpus(
    path: str | os.PathLike[str] | None = None,
    *,
    val_fraction: float = 0.05,
    max_bytes: int = DEFAULT_MAX_BYTES,
    min_bytes: int = 1024,
) -> Corpus:
    """Load the training text and split off the validation tail.

    Args:
        path: A text file to train on; ``None`` for the standard-library corpus.
        val_fraction: Fraction of the text, taken from its end, held out.
        max_bytes: Size cap for the standard-library corpus (a file is used whole).
        min_bytes: Smallest accepted text.

    Returns:
        The split corpus.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: The text is shorter than ``min_bytes`` or ``val_fraction``
            is not in (0, 0.5].
    """
    if not 0.0 < val_fraction <= 0.5:
        raise ValueError(f"val_fraction must be in (0, 0.5], got {val_fraction}")
    if path is None:
        text, num_files, root = stdlib_corpus_bytes(max_bytes)
        name = f"stdlib:{root}"
    else:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"data file not found: {p}")
        text, num_files, name = p.read_bytes(), 1, str(p)
    if len(text) < min_bytes:
        raise ValueError(f"corpus {name} has {len(text)} bytes, need at least {min_bytes}")
    tokens = encode(text)
    n_val = max(1, int(len(text) * val_fraction))
    corpus = Corpus(
        name=name,
        train=tokens[:-n_val],
        val=tokens[-n_val:],
        num_files=num_files,
        sha256=hashlib.sha256(text).hexdigest(),
    )
    logger.debug("loaded corpus %s", corpus.describe())
    return corpus


def encode(text: str | bytes) -> torch.Tensor:
    """Return the byte tokens of ``text`` (UTF-8 for ``str``) as a ``uint8`` tensor."""
    raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    if not raw:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def decode(tokens: torch.Tensor) -> str:
    """Return the text of byte tokens (invalid UTF-8 is replaced)."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def stream_seed(seed: int, step: int, rank: int, stream: str = "train") -> int:
    """Return a 63-bit generator seed that is a pure function of the arguments.

    Args:
        seed: Run seed.
        step: Step (or evaluation batch) index.
        rank: Rank of the caller.
        stream: Name of the random stream (``train``, ``val``, ...), so that
            different uses of the same ``(seed, step, rank)`` are independent.
    """
    key = f"{stream}:{seed}:{step}:{rank}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sample_batch(
    tokens: torch.Tensor,
    *,
    batch_size: int,
    context: int,
    seed: int,
    step: int,
    rank: int,
    stream: str = "train",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw the batch of ``(seed, step, rank)``: random windows of ``tokens``.

    Args:
        tokens: 1-D ``uint8`` token tensor.
        batch_size: Sequences per batch.
        context: Tokens per sequence.
        seed: Run seed.
        step: Step index.
        rank: Rank index.
        stream: Random stream name (see :func:`stream_seed`).

    Returns:
        ``(inputs, targets)``, both ``int64`` of shape ``(batch_size, context)``;
        ``targets`` is ``inputs`` shifted left by one token.

    Raises:
        ValueError: ``tokens`` is too short for one window.
    """
    n_windows = tokens.numel() - context
    if n_windows < 1:
        raise ValueError(f"{tokens.numel()} tokens are too few for context {context}")
    gen = torch.Generator().manual_seed(stream_seed(seed, step, rank, stream))
    starts = torch.randint(0, n_windows, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(context + 1)[None, :]
    chunk = tokens[idx].long()
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
