"""Argument checks shared by every package: one message format, one exception contract.

Every check returns the value it accepted (converted to its plain Python type)
and raises with the message ``"Invalid NAME: VALUE (must be ...)"``:

- a value of the wrong type raises :class:`ArgumentTypeError`, which is both a
  ``TypeError`` (the contract of the collectives and the drop-in API) and a
  ``ValueError`` (the contract of the optimizers and configurations), so every
  caller's documented exception type still catches it;
- a value of the right type outside its range raises ``ValueError``.

``bool`` is never accepted as a number, although it is an ``int``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection
from typing import TypeVar

__all__ = [
    "ArgumentTypeError",
    "check_bool",
    "check_choice",
    "check_density",
    "check_float",
    "check_int",
]

T = TypeVar("T")


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a ``TypeError`` and, for the callers documented so, a ``ValueError``."""


def _invalid(name: str, value: object, must: str) -> str:
    return f"Invalid {name}: {value!r} (must be {must})"


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _bounds(kind: str, low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"{kind} in {'(' if low_open else '['}{_num(low)}, {_num(high)}{')' if high_open else ']'}"
    if low is not None:
        return f"{kind} {'>' if low_open else '>='} {_num(low)}"
    if high is not None:
        return f"{kind} {'<' if high_open else '<='} {_num(high)}"
    return kind


def check_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """Return ``value`` as an ``int`` if it is an integer (not a bool) in ``[low, high]``.

    Args:
        name: The argument's name, for the message.
        value: The value to check.
        low: The smallest value allowed (``None``: no bound).
        high: The largest value allowed (``None``: no bound).

    Returns:
        ``int(value)``.

    Raises:
        ArgumentTypeError: ``value`` is not an integer, or is a bool.
        ValueError: ``value`` is outside ``[low, high]``.
    """
    must = _bounds("an int", low, high, False, False)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(_invalid(name, value, must))
    v = int(value)
    if (low is not None and v < low) or (high is not None and v > high):
        raise ValueError(_invalid(name, value, must))
    return v


def check_float(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = True,
) -> float:
    """Return ``value`` as a ``float`` if it is a real number (not a bool) between ``low`` and ``high``.

    Args:
        name: The argument's name, for the message.
        value: The value to check (an ``int`` is accepted).
        low: The lower bound (``None``: no bound).
        high: The upper bound (``None``: no bound).
        low_open: Exclude ``low`` itself.
        high_open: Exclude ``high`` itself.
        finite: Reject NaN and infinities. NaN is rejected anyway when a bound is given.

    Returns:
        ``float(value)``.

    Raises:
        ArgumentTypeError: ``value`` is not a real number, or is a bool.
        ValueError: ``value`` is not finite (when ``finite``) or is out of bounds.
    """
    must = _bounds("a finite number" if finite else "a number", low, high, low_open, high_open)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(_invalid(name, value, must))
    v = float(value)
    bad = (finite and not math.isfinite(v)) or ((low is not None or high is not None) and math.isnan(v))
    if low is not None and (v < low or (low_open and v == low)):
        bad = True
    if high is not None and (v > high or (high_open and v == high)):
        bad = True
    if bad:
        raise ValueError(_invalid(name, value, must))
    return v


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a ``bool``.

    Raises:
        ArgumentTypeError: ``value`` is not a bool (``0``/``1`` included).
    """
    if not isinstance(value, bool):
        raise ArgumentTypeError(_invalid(name, value, "a bool"))
    return value


def check_choice(name: str, value: T, choices: Collection[T]) -> T:
    """Return ``value`` if it is one of ``choices``.

    Raises:
        ValueError: ``value`` is not one of ``choices``.
    """
    if value not in choices:
        raise ValueError(_invalid(name, value, f"one of {tuple(choices)}"))
    return value


def check_density(value: object, name: str = "density") -> float:
    """Return ``value`` as a ``float`` if it is a density: a number in ``(0, 1]``.

    Raises:
        ArgumentTypeError: ``value`` is not a real number, or is a bool.
        ValueError: ``value`` is outside ``(0, 1]`` (NaN included).
    """
    return check_float(name, value, low=0.0, high=1.0, low_open=True)
