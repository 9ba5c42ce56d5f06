"""Model families of the training job beyond the transformers: a recurrent byte LM and a small CNN.

* :class:`RecurrentLM`: a byte-level language model from :class:`torch.nn.GRU`
  (``n_layers`` stacked layers of width ``d_model``, a final LayerNorm, an
  untied head). Causal by construction; ``n_heads`` plays no part.
* :class:`DigitsCNN`: a classifier of 8x8 one-channel images (scikit-learn's
  digits): ``n_layers`` 3x3 convolutions of ``d_model`` channels (padding 1,
  GELU), a 2x2 max-pool, then a linear layer over the pooled 4x4 map.

Both follow the contract of every model of :mod:`optim.apps.train_job.tasks`:
``forward(x, y)`` returns ``(logits, loss)`` (``loss`` is ``None`` without
targets) and the initialisation draws only from torch's global generator.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bindings.validate import check_int

__all__ = ["DigitsCNN", "RecurrentLM"]


def _positive(**values: int) -> None:
    for name, value in values.items():
        check_int(name, value, low=1)


class RecurrentLM(nn.Module):
    """A GRU byte-level language model (see the module docstring)."""

    def __init__(self, *, vocab_size: int, d_model: int, n_layers: int) -> None:
        """Build the embedding, the GRU stack and the head.

        Args:
            vocab_size: Number of token ids.
            d_model: Embedding and hidden width.
            n_layers: Stacked GRU layers.

        Raises:
            ValueError: A size below 1.
        """
        super().__init__()
        _positive(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers)
        self.emb = nn.Embedding(vocab_size, d_model)
        self.rnn = nn.GRU(d_model, d_model, num_layers=n_layers, batch_first=True)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits of every position of ``x`` (batch, time) and, given targets, their cross-entropy."""
        h, _ = self.rnn(self.emb(x))
        logits = self.head(self.norm(h))
        loss = None if y is None else F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        return logits, loss


class DigitsCNN(nn.Module):
    """A small CNN over 8x8 images given as 64 flat pixels (see the module docstring)."""

    SIDE = 8
    """Height and width of an image."""

    def __init__(self, *, channels: int, layers: int, classes: int = 10) -> None:
        """Build the convolutions and the classifier.

        Args:
            channels: Channels of every convolution.
            layers: Number of 3x3 convolutions.
            classes: Number of classes.

        Raises:
            ValueError: A size below 1.
        """
        super().__init__()
        _positive(channels=channels, layers=layers, classes=classes)
        ins = [1] + [channels] * (layers - 1)
        self.convs = nn.ModuleList(nn.Conv2d(c, channels, 3, padding=1) for c in ins)
        self.out = nn.Linear(channels * (self.SIDE // 2) ** 2, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Class logits of a batch of flat images ``x`` (batch, 64) and, given labels, their cross-entropy."""
        h = x.reshape(-1, 1, self.SIDE, self.SIDE)
        for conv in self.convs:
            h = F.gelu(conv(h))
        logits = self.out(F.max_pool2d(h, 2).flatten(1))
        return logits, None if y is None else F.cross_entropy(logits, y)
