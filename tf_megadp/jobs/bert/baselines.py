"""Whether a run learned: its held-out accuracy against the unigram baseline, and ratios to a baseline.

A masked-LM model first sits on the unigram plateau: it predicts the most
frequent token everywhere and scores the unigram baseline's accuracy
exactly. A run whose learning rate is too high (or zero) ends there, and its
accuracy says nothing about what DP costs. `learning_verdict` says whether a
run ended clearly above the baseline; `accuracy_ratio` refuses to divide by
the accuracy of a baseline run that did not.

The margin is the noise of an accuracy measured on the held-out masked
positions (`tf_megadp.jobs.common.verdicts`): the ~0.15 L positions of one
sequence are not independent draws.
"""

from __future__ import annotations

from typing import Any

from tf_megadp.jobs.common.verdicts import learned_beyond

__all__ = ["NOT_LEARNED_MESSAGE", "BaselineDidNotLearnError",
           "accuracy_ratio", "learning_verdict"]

NOT_LEARNED_MESSAGE = "this model did not learn; tune --learning-rate"


class BaselineDidNotLearnError(ValueError):
    """A ratio against a run that ended at or below the unigram baseline."""


def learning_verdict(accuracy: float, unigram_accuracy: float,
                     heldout_positions: float) -> dict[str, Any]:
    """Whether `accuracy` is above the unigram baseline by more than its noise.

    Args:
        accuracy: the run's held-out MLM accuracy (NaN: never evaluated).
        unigram_accuracy: the unigram baseline's accuracy on the same
            held-out masked positions.
        heldout_positions: n, the number (total weight) of those positions.

    Returns:
        report.json's fields: `learned` (True, False, or None without an
        evaluation), `unigram_baseline_accuracy`, `learned_threshold` (the
        accuracy a run must exceed: baseline + `verdicts.STANDARD_ERRORS` standard
        errors) and `heldout_masked_positions`.

    Example:
        >>> learning_verdict(0.0402, 0.0402, 10_000)["learned"]
        False
    """
    learned, threshold = learned_beyond(accuracy, unigram_accuracy, heldout_positions)
    return {"learned": learned, "unigram_baseline_accuracy": float(unigram_accuracy),
            "learned_threshold": threshold, "heldout_masked_positions": float(heldout_positions)}


def accuracy_ratio(report: dict[str, Any], baseline: dict[str, Any]) -> float:
    """`report`'s held-out accuracy over `baseline`'s (e.g. private / non-private).

    Args:
        report, baseline: two runs' report.json contents.

    Returns:
        The ratio of their held-out MLM accuracies.

    Raises:
        BaselineDidNotLearnError: the baseline did not end above the unigram
            baseline (`learned` false), or its report predates the verdict:
            the ratio would flatter the other run.

    Example:
        >>> accuracy_ratio({"heldout_mlm_accuracy": 0.11},
        ...                {"heldout_mlm_accuracy": 0.14, "learned": True})  # doctest: +ELLIPSIS
        0.78...
    """
    learned = baseline.get("learned")
    if learned is not True:
        why = ("did not learn" if learned is False else
               "has no learned verdict (a report.json from before issue 41)")
        raise BaselineDidNotLearnError(
            f"The baseline run {why}: held-out accuracy "
            f"{baseline['heldout_mlm_accuracy']:.4f} against the unigram baseline's "
            f"{baseline.get('unigram_baseline_accuracy', float('nan')):.4f}. No ratio against "
            "it; tune its --learning-rate and run it again.")
    return float(report["heldout_mlm_accuracy"]) / float(baseline["heldout_mlm_accuracy"])
