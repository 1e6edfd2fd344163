"""The samplers' secret randomness: OS entropy by default, a seed that warns, or a shared secret."""

from __future__ import annotations

import numbers
import os
import secrets
import sys
import warnings
from typing import Any

from tf_megadp.errors import PrivacyConfigurationError

_PACKAGE_DIRECTORY = os.path.dirname(os.path.abspath(__file__)) + os.sep

# Values below this cannot be a secret drawn from OS entropy (a 128-bit draw is
# below it with probability 2**-96); they are seeds passed as shared_secret.
_MIN_SHARED_SECRET = 1 << 32


def _os_entropy() -> int:
    """128 bits from the OS's cryptographic source, as `np.random.SeedSequence()` draws."""
    return secrets.randbits(128)


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """Warns at the user's line, however deep inside the data package it was raised."""
    # (a classmethod, a subclass constructor, a helper in another module of
    # the package). `warnings.warn(skip_file_prefixes=...)` does this from
    # Python 3.12 on; 3.11 needs the frames (CPython's `sys._getframe`).
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIRECTORY):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def non_negative_integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise TypeError(f"{name} must be a non-negative integer, got {type(value).__name__}.")
    return int(value)


def sampling_entropy(seed: int | None, shared_secret: int | None) -> tuple[int, bool]:
    """(entropy, seeded): OS entropy by default, else the caller's seed or shared secret."""
    if seed is not None and shared_secret is not None:
        raise PrivacyConfigurationError(
            "Pass seed= or shared_secret=, not both: shared_secret keeps the draws "
            "secret across hosts, seed makes them reproducible (and public to anyone "
            "who can guess it)."
        )
    if shared_secret is not None:
        secret = non_negative_integer("shared_secret", shared_secret)
        if secret < _MIN_SHARED_SECRET:
            # Messages never repeat the value: it is meant to be secret.
            raise PrivacyConfigurationError(
                "shared_secret is below 2**32, so it is a guessable seed, not a "
                "secret: draw it from OS entropy (secrets.randbits(128), or "
                "tf_megadp.distribute.shared_sampling_secret(strategy) on several "
                "hosts), or pass seed= for a reproducible, non-private debug run."
            )
        return secret, False
    if seed is not None:
        seed = non_negative_integer("seed", seed)
        warn_at_caller(
            "An explicit sampling seed makes every batch computable by anyone who can "
            "guess or learn the seed: against them the draws, and with them the DP "
            "guarantee, are not private. Use seed= only for tests and debugging (the "
            "privacy report marks the run as seeded); omit it for secret OS entropy, "
            "or pass shared_secret= so that several hosts draw the same steps.",
            UserWarning,
        )
        return seed, True
    return _os_entropy(), False
