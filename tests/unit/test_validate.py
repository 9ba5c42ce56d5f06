"""The shared argument checks: accepted values, exception types and the message format."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bindings.validate import (
    ArgumentTypeError,
    check_bool,
    check_choice,
    check_density,
    check_float,
    check_int,
)


def test_int_accepts_integers_in_range() -> None:
    assert check_int("n", 3, low=1, high=3) == 3
    assert check_int("n", np.int64(2), low=0) == 2
    assert type(check_int("n", np.int64(2))) is int


@pytest.mark.parametrize("value", [True, 1.0, "1", None])
def test_int_rejects_other_types_as_type_and_value_error(value: object) -> None:
    with pytest.raises(TypeError, match=r"Invalid n: .* \(must be an int >= 0\)"):
        check_int("n", value, low=0)
    with pytest.raises(ValueError):
        check_int("n", value, low=0)


def test_int_range_message() -> None:
    with pytest.raises(ValueError, match=r"^Invalid n: 5 \(must be an int in \[0, 4\]\)$") as e:
        check_int("n", 5, low=0, high=4)
    assert not isinstance(e.value, TypeError)


def test_float_bounds() -> None:
    assert check_float("x", 1, low=0.0, high=1.0) == 1.0
    with pytest.raises(ValueError, match=r"must be a finite number in \(0, 1\)"):
        check_float("x", 0.0, low=0.0, high=1.0, low_open=True, high_open=True)
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        check_float("x", -0.5, low=0.0)
    with pytest.raises(ValueError):
        check_float("x", math.inf)
    assert check_float("x", math.inf, finite=False) == math.inf
    with pytest.raises(ValueError):
        check_float("x", math.nan, low=0.0, finite=False)
    with pytest.raises(ArgumentTypeError):
        check_float("x", False)


def test_bool_and_choice() -> None:
    assert check_bool("b", True) is True
    with pytest.raises(ArgumentTypeError, match=r"Invalid b: 1 \(must be a bool\)"):
        check_bool("b", 1)
    assert check_choice("c", "a", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"Invalid c: 'z' \(must be one of \('a', 'b'\)\)"):
        check_choice("c", "z", ("a", "b"))


@pytest.mark.parametrize("bad", [0.0, 1.5, -1, math.nan, math.inf])
def test_density_range(bad: float) -> None:
    with pytest.raises(ValueError, match=r"Invalid density: .* \(must be a finite number in \(0, 1\]\)"):
        check_density(bad)


def test_density_type_and_value() -> None:
    assert check_density(1) == 1.0
    assert check_density(0.25) == 0.25
    with pytest.raises(TypeError, match="density"):
        check_density("0.1")
