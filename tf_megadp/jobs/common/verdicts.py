"""Whether a run learned: its held-out accuracy against its trivial baseline, beyond the noise.

A model that learned nothing scores its trivial baseline exactly (the
unigram's for a masked LM, the majority class's for a classifier). A run
learned when its accuracy is above that baseline by more than the noise
of an accuracy measured on n held-out predictions: `STANDARD_ERRORS`
binomial standard errors sqrt(p (1 - p) / n) at the baseline's p. Three,
not two, because predictions within one example are not independent (so
the effective n may be smaller than n).
"""

from __future__ import annotations

import math

__all__ = ["STANDARD_ERRORS", "learned_beyond", "verdict_line"]

STANDARD_ERRORS = 3.0


def learned_beyond(accuracy: float, baseline_accuracy: float,
                   predictions: float) -> tuple[bool | None, float]:
    """(learned, threshold): whether `accuracy` exceeds the baseline + `STANDARD_ERRORS` s.e.

    Args:
        accuracy: the run's held-out accuracy (NaN: never evaluated).
        baseline_accuracy: the trivial baseline's accuracy on the same predictions.
        predictions: n, how many predictions (their total weight).

    Returns:
        `learned` (True, False, or None without an evaluation) and the
        accuracy a run must exceed.

    Example:
        >>> learned_beyond(0.40, 1 / 3, 1_000)[0]
        True
    """
    p, n = float(baseline_accuracy), float(predictions)
    margin = STANDARD_ERRORS * math.sqrt(p * (1.0 - p) / n) if n > 0 else math.inf
    threshold = p + margin
    return (None if math.isnan(accuracy) else bool(accuracy > threshold)), threshold


def verdict_line(learned: bool | None, threshold: float, baseline: str) -> str:
    """The summary's `learned` line, from `learned_beyond`'s answer.

    Args:
        learned, threshold: what `learned_beyond` returned.
        baseline: the trivial baseline's name (e.g. "the majority class").
    """
    if learned is None:
        return "not evaluated"
    if learned:
        return (f"yes (above {threshold:.4f}: {baseline} + {STANDARD_ERRORS:g} "
                "standard errors)")
    return f"NO: not above {threshold:.4f} ({baseline} + {STANDARD_ERRORS:g} standard errors)"
