"""Lossy full checkpoint files: chosen float32 tensors (the first moment) stored as bfloat16.

A lossy file holds a snapshot encoding (:func:`optim.state.snapshot.encode_tree`)
with the named float32 tensors cut out and stored as bfloat16 (rounded to
nearest, ties to even: 2 bytes a value instead of 4); every other byte is
kept as it is. :func:`unpack` gives back the encoding with those tensors as
float32 again, each value the bfloat16 one (a relative error below 2**-8),
so what is restored has the original layout and dtypes, and the optimizer
loads it as any snapshot.

Only the first moment is a sensible choice: it is a running average that
every step overwrites with ``beta1`` weight, so a small error in it fades
within a few tens of steps; the master weights and the second moment stay
exact. The deltas written after a lossy full file are still the lossless
ones between the exact snapshots (:mod:`optim.state.delta`): applied on the lossy
base they overwrite every coordinate the optimizer changed with its exact
value, and the others keep the rounded one.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch

from optim.state.snapshot import decode_tree, encode_tree, tensor_layout

__all__ = ["pack", "unpack"]

_FIELDS = {"head", "rest", "index", "bf16"}


def pack(full: bytes, paths: Collection[str]) -> bytes | None:
    """The lossy file of encoding ``full``, with the float32 tensors at ``paths`` as bfloat16.

    Returns:
        The file's bytes, or ``None`` when none of ``paths`` names a float32
        tensor of ``full`` (nothing to round: write it full).

    Raises:
        ValueError: ``full`` is not an encoding.
    """
    layout = tensor_layout(full)
    wanted = set(paths)
    order = sorted(
        (i for p, i in layout.paths.items() if p in wanted and layout.tensors[i][2] == "torch.float32"),
        key=lambda i: layout.tensors[i][0],
    )
    if not order:
        return None
    region = np.frombuffer(full, dtype=np.uint8, offset=layout.start)
    rest, halves, pos = [], [], 0
    for i in order:
        offset, nbytes, _ = layout.tensors[i]
        rest.append(region[pos:offset])
        halves.append(torch.from_numpy(region[offset : offset + nbytes].copy().view(np.float32)).to(torch.bfloat16))
        pos = offset + nbytes
    rest.append(region[pos:])
    tree = {
        "head": torch.frombuffer(bytearray(full[: layout.start]), dtype=torch.uint8),
        "rest": torch.from_numpy(np.concatenate(rest)),
        "index": torch.tensor(order, dtype=torch.int64),
        "bf16": halves,
    }
    return encode_tree(tree).numpy().tobytes()


def unpack(data: bytes) -> bytes:
    """The encoding a :func:`pack` file stands for: its bfloat16 tensors widened to float32 again.

    Raises:
        ValueError: ``data`` is not a lossy file, or its parts do not fit together.
    """
    d = decode_tree(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    if not isinstance(d, dict) or set(d) != _FIELDS or not isinstance(d["bf16"], list):
        raise ValueError("lossy checkpoint: not a lossy file")
    head = d["head"].numpy().tobytes()
    layout = tensor_layout(head)
    order = [int(i) for i in d["index"].tolist()]
    if len(order) != len(d["bf16"]) or any(not 0 <= i < len(layout.tensors) for i in order):
        raise ValueError("lossy checkpoint: its tensor list does not fit its header")
    rest = d["rest"].numpy()
    pieces, pos, used = [], 0, 0
    for i, half in zip(order, d["bf16"], strict=True):
        offset, nbytes, dtype = layout.tensors[i]
        if dtype != "torch.float32" or half.dtype != torch.bfloat16 or 4 * half.numel() != nbytes or offset < pos:
            raise ValueError(f"lossy checkpoint: tensor {i} does not fit its header")
        gap = offset - pos
        pieces.append(rest[used : used + gap])
        pieces.append(half.to(torch.float32).numpy().view(np.uint8))
        used, pos = used + gap, offset + nbytes
    if used > rest.size:
        raise ValueError("lossy checkpoint: its bytes do not fit its header")
    pieces.append(rest[used:])
    body = np.concatenate(pieces)
    if body.size < max((o + n for o, n, _ in layout.tensors), default=0):
        raise ValueError("lossy checkpoint: its bytes do not fit its header")
    return head + body.tobytes()
