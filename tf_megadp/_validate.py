"""Argument checks written once, for the modules that take the same arguments."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

__all__ = ["check_delta", "check_num_examples", "check_positive_int"]


def check_positive_int(name: str, value: Any) -> int:
    """`value` as an int, if it is an integer (not a bool) >= 1; else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)


def check_num_examples(num_examples: Any) -> int:
    """N, the number of privacy units: a positive integer."""
    return check_positive_int("num_examples", num_examples)


def check_delta(delta: float, num_examples: int | None) -> float:
    """delta in (0, 1); warns (at the caller's caller) when it is above 1/N."""
    if isinstance(delta, bool) or not isinstance(delta, (int, float)):
        raise ValueError(f"delta must be a number in (0, 1), got {delta!r}.")
    delta = float(delta)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}.")
    if num_examples is not None and delta > 1.0 / num_examples:
        warnings.warn(
            f"delta = {delta:g} is larger than 1/N = {1.0 / num_examples:g}: a "
            "mechanism that publishes one random example in full would meet it. "
            f"Use delta <= 1/N, e.g. {1.0 / num_examples ** 1.1:.3g} (N^-1.1).",
            UserWarning,
            stacklevel=3,
        )
    return delta
