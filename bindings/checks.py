"""Argument checks of the collectives (:class:`~bindings.communicator.BaseCommunicator`).

Each runs before any communication and raises ``TypeError`` or ``ValueError``;
the outcome depends only on the arguments, so every rank that passes matching
arguments gets the same one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from bindings.ops import SUPPORTED_DTYPES, ReduceOp
from bindings.validate import check_bool, check_int

__all__ = [
    "check_async",
    "check_op_dtype",
    "check_pair",
    "check_rank",
    "check_ranks_list",
    "check_tag",
    "check_tensor",
]


def check_tensor(name: str, t: Any) -> torch.Tensor:
    """Return ``t`` if it is a dense tensor of a supported dtype, else raise ``TypeError`` naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name}: dtype {t.dtype} is not supported; supported: "
            f"{', '.join(sorted(str(d) for d in SUPPORTED_DTYPES))}"
        )
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"{name}: only dense (strided) tensors are supported, got {t.layout}")
    return t


def check_pair(out_name: str, out: torch.Tensor, in_name: str, inp: torch.Tensor) -> None:
    """Raise unless ``out`` and ``inp`` share their dtype (``TypeError``) and device (``ValueError``)."""
    if out.dtype != inp.dtype:
        raise TypeError(f"{out_name}: dtype {out.dtype} does not match {in_name} dtype {inp.dtype}")
    if out.device != inp.device:
        raise ValueError(f"{out_name}: device {out.device} does not match {in_name} device {inp.device}")


def check_op_dtype(op: ReduceOp, dtype: torch.dtype) -> None:
    """Raise ``TypeError`` when ``op`` cannot reduce ``dtype`` (bitwise on floats, ``AVG`` on integers)."""
    floating = dtype.is_floating_point
    if op.is_bitwise and floating:
        raise TypeError(f"op: {op.name} needs an integer or bool tensor, got {dtype}")
    if op == ReduceOp.AVG and not floating:
        raise TypeError(f"op: AVG needs a floating-point tensor, got {dtype}")


def check_rank(name: str, value: Any, world_size: int, *, allow_none: bool = False) -> None:
    """Raise unless ``value`` is an int rank in ``[0, world_size)`` (or ``None`` when allowed)."""
    if value is None and allow_none:
        return
    check_int(name, value)
    if not 0 <= value < world_size:
        raise ValueError(f"{name}: rank {value} is out of range for world_size {world_size}")


def check_tag(tag: Any) -> None:
    """Raise ``ValueError`` unless ``tag`` is a non-negative int."""
    check_int("tag", tag, low=0)


def check_async(async_op: Any) -> None:
    """Raise ``TypeError`` unless ``async_op`` is a bool."""
    check_bool("async_op", async_op)


def check_ranks_list(ranks: Any, world_size: int) -> list[int]:
    """Return the distinct ranks of the non-empty sequence ``ranks``, sorted, or raise."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise TypeError(f"ranks: expected a sequence of ints, got {type(ranks).__name__}")
    out: list[int] = []
    for r in ranks:
        check_rank("ranks", r, world_size)
        out.append(int(r))
    if len(set(out)) != len(out):
        raise ValueError(f"ranks: duplicate ranks in {list(ranks)}")
    if not out:
        raise ValueError("ranks: must not be empty")
    return sorted(out)
