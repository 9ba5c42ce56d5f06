"""Reduction operators and dtype facts shared by the transports."""

from __future__ import annotations

import enum
from typing import Any

import torch

__all__ = ["ReduceOp", "parse_reduce_op", "element_size", "SUPPORTED_DTYPES"]


class ReduceOp(str, enum.Enum):
    """Reduction operators, with the names torch.distributed uses."""

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    @property
    def is_bitwise(self) -> bool:
        """Whether the operator only makes sense on integer and bool tensors."""
        return self in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)


def parse_reduce_op(op: Any) -> ReduceOp:
    """Turn any spelling of a reduction operator into a :class:`ReduceOp`.

    Accepts a :class:`ReduceOp`, a string such as ``"sum"``, or
    ``torch.distributed.ReduceOp.SUM`` (and its ``RedOpType`` members).

    Raises:
        ValueError: The operator is unknown or not supported (``PREMUL_SUM``).
    """
    if isinstance(op, ReduceOp):
        return op
    name: object = None
    if isinstance(op, str):
        name = op
    else:
        import torch.distributed as tdist

        if isinstance(op, tdist.ReduceOp.RedOpType):
            name = op.name
    if isinstance(name, str):
        try:
            return ReduceOp(name.lower())
        except ValueError:
            pass
    raise ValueError(
        f"op: unsupported reduction operator {op!r}; expected one of {', '.join(m.name for m in ReduceOp)}"
    )


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()
