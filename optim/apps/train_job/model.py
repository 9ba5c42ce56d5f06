"""A tiny GPT-style decoder-only language model.

Pre-norm transformer blocks (LayerNorm, causal self-attention through
:func:`torch.nn.functional.scaled_dot_product_attention`, LayerNorm, GELU
MLP), learned position embeddings and an output head tied to the token
embedding. Initialisation draws only from torch's global generator, so
``torch.manual_seed(s)`` before construction gives the same weights on every
rank.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`."""

    vocab_size: int = 256
    """Number of token ids."""
    context: int = 64
    """Longest sequence (number of position embeddings)."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads per block; must divide ``d_model``."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of ``d_model``."""
    dropout: float = 0.0
    """Dropout probability on attention and residual branches."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} does not divide d_model={self.d_model}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    def as_dict(self) -> dict[str, object]:
        """Return the fields as a plain dict."""
        return asdict(self)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        """Build the projections.

        Args:
            cfg: Model shape.
        """
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over earlier positions.

        Args:
            x: Activations of shape ``(batch, time, d_model)``.

        Returns:
            Tensor of the same shape.
        """
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_heads, c // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        """Build the block.

        Args:
            cfg: Model shape.
        """
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        hidden = cfg.mlp_ratio * cfg.d_model
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, hidden),
            nn.GELU(),
            nn.Linear(hidden, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply attention and MLP with residual connections.

        Args:
            x: Activations of shape ``(batch, time, d_model)``.

        Returns:
            Tensor of the same shape.
        """
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only language model over a small vocabulary."""

    def __init__(self, cfg: GPTConfig) -> None:
        """Build and initialise the model.

        Args:
            cfg: Model shape.
        """
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self.apply(self._init_weights)
        # GPT-2 style: scale residual output projections by depth.
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Return the number of distinct trainable parameters (tied weights once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute next-token logits and, given targets, the mean cross-entropy.

        Args:
            idx: Token ids of shape ``(batch, time)``, ``time <= context``.
            targets: Next-token ids of the same shape, or ``None``.

        Returns:
            ``(logits, loss)``; logits have shape ``(batch, time, vocab)``,
            ``loss`` is ``None`` without targets.

        Raises:
            ValueError: The sequence is longer than the context.
        """
        _, t = idx.shape
        if t > self.cfg.context:
            raise ValueError(f"sequence length {t} exceeds context {self.cfg.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos)[None])
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
