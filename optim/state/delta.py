"""Lossless deltas between two snapshot encodings: what a delta checkpoint stores.

Two encodings (:func:`optim.state.snapshot.encode_tree`) of the same training state
at different steps hold the same tensors: only the JSON header (step numbers)
and values differ, and a few tensors grow (the loss history). A delta keeps
the new header whole and lines the base's tensor bytes up with the new ones
(tensor ``i`` of the base under tensor ``i`` of the new encoding, the common
prefix where sizes differ, zeros where the base has no such tensor); of the
tensor bytes it stores only the 4-byte words that differ from that lined-up
base, bit for bit: their positions (a bitmask, or a sorted index list where
that is smaller) and their new values. Applying it to the base gives the new
encoding back exactly, so a resume from a delta is bit-identical.

*Decay prediction.* SCAPE changes its master weights only at the masked
coordinates, but multiplies the first moment of every other coordinate by
``beta1`` in each sparse step. A delta may name float32 tensors that decay
so (``decay``: tensor index -> ``(factor, times)``): the lined-up base of such
a tensor is multiplied by ``factor`` ``times`` times, one float32 multiply
after another exactly as the optimizer does, before the comparison, so only
the coordinates that did something else are stored. Applying the delta
repeats the same multiplications; a wrong prediction costs bytes, never
exactness.

A dense optimizer changes every word and gets no delta (:func:`encode_delta`
returns ``None`` when a delta would not be smaller than ``max_ratio`` of the
full encoding).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from optim.state.snapshot import decode_tree, encode_tree, tensor_layout

__all__ = ["apply_delta", "encode_delta"]

_WORD = 4
_FIELDS = {"head", "mask", "index", "values", "tail", "decay_index", "decay_factor"}


def _lined_up(base: bytes, head: bytes, decay: Mapping[int, tuple[float, int]]) -> np.ndarray:
    """The base's tensor bytes placed where the tensors of the encoding that starts with ``head`` lie."""
    old, new = tensor_layout(base), tensor_layout(head)
    size = sum(n for _, n, _ in new.tensors)
    out = np.zeros(size, dtype=np.uint8)
    src = np.frombuffer(base, dtype=np.uint8)
    for i, ((n_off, n_bytes, n_dtype), (b_off, b_bytes, b_dtype)) in enumerate(
        zip(new.tensors, old.tensors, strict=False)
    ):
        k = min(n_bytes, b_bytes)
        piece = src[old.start + b_off : old.start + b_off + k]
        if i in decay and n_dtype == b_dtype == "torch.float32" and n_bytes == b_bytes:
            factor, times = decay[i]
            x = torch.from_numpy(piece.copy().view(np.float32))
            for _ in range(times):
                x = x * factor  # one float32 multiply per step, as the optimizer's update
            piece = x.numpy().view(np.uint8)
        out[n_off : n_off + k] = piece
    return out


def _split(region: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = region.size // _WORD
    return region[: n * _WORD].view(np.uint32), region[n * _WORD :]


def encode_delta(
    base: bytes, new: bytes, *, decay: Mapping[int, tuple[float, int]] | None = None, max_ratio: float = 0.5
) -> bytes | None:
    """The delta that turns encoding ``base`` into encoding ``new``.

    Args:
        base: The encoding the delta builds on.
        new: The encoding it must give back.
        decay: Tensor index (in ``new``) -> ``(factor, times)``: predict that float32
            tensor as the base's multiplied by ``factor``, ``times`` times.
        max_ratio: No delta larger than this fraction of ``new``.

    Returns:
        The delta's bytes, or ``None`` when it would be larger than ``max_ratio * len(new)``.

    Raises:
        ValueError: ``base`` or ``new`` is not an encoding.
    """
    decay = dict(decay or {})
    start = tensor_layout(new).start
    old_words, _ = _split(_lined_up(base, new[:start], decay))
    new_words, tail = _split(np.frombuffer(new, dtype=np.uint8, offset=start))
    changed = old_words != new_words
    count = int(np.count_nonzero(changed))
    # positions: one bit per word, or one 4-byte index per changed word, whichever is smaller
    as_mask = (changed.size + 7) // 8 < _WORD * count
    delta = {
        "head": torch.frombuffer(bytearray(new[:start]), dtype=torch.uint8),
        "mask": torch.from_numpy(np.packbits(changed)) if as_mask else None,
        "index": None if as_mask else torch.from_numpy(np.flatnonzero(changed).astype(np.int32)),
        "values": torch.from_numpy(new_words[changed].view(np.int32)),
        "tail": torch.from_numpy(tail.copy()),
        "decay_index": torch.tensor([[i, t] for i, (_, t) in sorted(decay.items())], dtype=torch.int64).reshape(-1, 2),
        "decay_factor": torch.tensor([f for _, (f, _) in sorted(decay.items())], dtype=torch.float64),
    }
    out = encode_tree(delta).numpy().tobytes()
    return out if len(out) <= max_ratio * len(new) else None


def apply_delta(base: bytes, delta: bytes) -> bytes:
    """The encoding that :func:`encode_delta` ``(base, new)`` was made from: ``new``, exactly.

    Raises:
        ValueError: ``delta`` is not a delta, or does not fit ``base``.
    """
    d = decode_tree(torch.frombuffer(bytearray(delta), dtype=torch.uint8))
    if not isinstance(d, dict) or set(d) != _FIELDS:
        raise ValueError("delta: not a checkpoint delta")
    head = d["head"].numpy().tobytes()
    pairs, factors = d["decay_index"].tolist(), d["decay_factor"].tolist()
    if len(pairs) != len(factors):
        raise ValueError("delta: its decay lists disagree")
    decay = {int(i): (float(f), int(t)) for (i, t), f in zip(pairs, factors, strict=True)}
    words, tail = _split(_lined_up(base, head, decay))
    words = words.copy()
    values = d["values"].numpy().view(np.uint32)
    if tail.size != d["tail"].numel():
        raise ValueError("delta: its tensor layout does not fit the base")
    if d["mask"] is not None:
        if d["mask"].numel() != (words.size + 7) // 8:
            raise ValueError("delta: its bitmask does not fit the base")
        changed = np.unpackbits(d["mask"].numpy(), count=words.size).astype(bool)
        if int(np.count_nonzero(changed)) != values.size:
            raise ValueError("delta: the bitmask and the values disagree")
        words[changed] = values
    else:
        index = d["index"].numpy()
        if index.size != values.size or (index.size and (index.min() < 0 or index.max() >= words.size)):
            raise ValueError("delta: bad word indices")
        words[index] = values
    return head + words.tobytes() + d["tail"].numpy().tobytes()
