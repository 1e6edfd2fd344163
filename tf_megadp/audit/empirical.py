"""Empirical lower bounds on epsilon from an attacker's guesses.

If a mechanism is (epsilon, delta)-DP, every test that tries to tell "the
example was in" from "the example was out" satisfies (Kairouz et al. 2015)

    TPR <= exp(epsilon) * FPR + delta   and   TNR <= exp(epsilon) * FNR + delta.

Solving for epsilon turns an attack's observed rates into a lower bound
(Jagielski et al. 2020, Nasr et al. 2021). Observed rates are noisy, so the
bound uses one-sided Clopper-Pearson intervals: a lower bound on TPR and an
upper bound on FPR, each at level 1 - alpha / 2, so that both hold together
with probability at least 1 - alpha (union bound). TNR = 1 - FPR and
FNR = 1 - TPR, so the second inequality needs no further intervals.

Assumptions the caller is responsible for:

* Every guess is an independent trial of the mechanism on a member or a
  non-member (e.g. one model per trial, or canaries whose inclusion was decided
  by independent coin flips). Guesses about many examples of a single training
  run are correlated; the number is then an indication, not a certificate.
* The decision rule was fixed before the evaluated counts were seen. Choosing
  the best threshold on the same scores and then reading its counts inflates
  the bound; `epsilon_lower_bound_from_scores` either selects the threshold on
  a disjoint half of the data ("split") or pays for a fixed grid of thresholds
  with a union bound ("union").
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy import stats

__all__ = [
    "clopper_pearson",
    "epsilon_lower_bound",
    "epsilon_lower_bound_from_scores",
]


def _check_confidence(confidence: float) -> float:
    confidence = float(confidence)
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"`confidence` must be in (0, 1), got {confidence!r}.")
    return confidence


def _check_delta(delta: float) -> float:
    delta = float(delta)
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"`delta` must be in [0, 1), got {delta!r}.")
    return delta


def clopper_pearson(
    successes: int | np.ndarray,
    trials: int | np.ndarray,
    *,
    confidence: float = 0.95,
    side: str = "lower",
) -> float | np.ndarray:
    """One-sided Clopper-Pearson (exact binomial) confidence bound.

    Args:
        successes: observed successes k (int or integer array).
        trials: number of trials n >= 1 (broadcasts against `successes`).
        confidence: probability that the true rate lies on the reported side
            of the bound.
        side: "lower" for p >= bound, "upper" for p <= bound.

    Returns:
        The bound, a float (or an array for array inputs).

    Example:
    ```python
    clopper_pearson(0, 10, side="upper")   # 0.2589...: 1 - 0.05 ** (1 / 10)
    ```
    """
    confidence = _check_confidence(confidence)
    k = np.asarray(successes)
    n = np.asarray(trials)
    if np.any(n < 1) or np.any(k < 0) or np.any(k > n):
        raise ValueError(
            "Need 0 <= successes <= trials and trials >= 1, got "
            f"successes={successes!r}, trials={trials!r}."
        )
    k = k.astype(np.float64)
    n = n.astype(np.float64)
    alpha = 1.0 - confidence
    with np.errstate(invalid="ignore"):
        if side == "lower":
            # The beta quantile is undefined at k = 0; the bound is then 0.
            bound = np.where(
                k > 0, stats.beta.ppf(alpha, np.maximum(k, 1), n - k + 1), 0.0
            )
        elif side == "upper":
            bound = np.where(
                k < n, stats.beta.ppf(1.0 - alpha, k + 1, np.maximum(n - k, 1)), 1.0
            )
        else:
            raise ValueError(f"`side` must be 'lower' or 'upper', got {side!r}.")
    return float(bound) if bound.ndim == 0 else bound


def _bound_from_counts(tp, fp, tn, fn, delta, per_interval_confidence):
    """Vectorized core of `epsilon_lower_bound`; returns nats, clipped at 0."""
    tp, fp, tn, fn = (np.asarray(v, dtype=np.int64) for v in (tp, fp, tn, fn))
    tpr_lo = clopper_pearson(
        tp, tp + fn, confidence=per_interval_confidence, side="lower"
    )
    fpr_hi = clopper_pearson(
        fp, fp + tn, confidence=per_interval_confidence, side="upper"
    )
    # An upper bound is > 0 and a lower bound is < 1 whenever trials >= 1, so
    # both denominators below are strictly positive.
    with np.errstate(divide="ignore", invalid="ignore"):
        from_positive = np.log(np.maximum(tpr_lo - delta, 0.0) / fpr_hi)
        from_negative = np.log(np.maximum((1.0 - fpr_hi) - delta, 0.0) / (1.0 - tpr_lo))
    return np.maximum(np.maximum(from_positive, from_negative), 0.0)


def epsilon_lower_bound(
    tp: int,
    fp: int,
    tn: int,
    fn: int,
    *,
    delta: float = 0.0,
    confidence: float = 0.95,
) -> float:
    """Lower bound on epsilon from the confusion counts of one fixed test.

    With probability at least `confidence` over the trials, the true epsilon of
    any (epsilon, delta)-DP mechanism that produced these counts is at least
    the returned value (natural log units, like accountants report).

    Args:
        tp: members guessed "member".
        fp: non-members guessed "member".
        tn: non-members guessed "non-member".
        fn: members guessed "non-member".
        delta: the delta the bound is stated for.
        confidence: joint confidence of the two Clopper-Pearson intervals.

    Returns:
        max(0, log((TPR_lo - delta) / FPR_hi), log((TNR_lo - delta) / FNR_hi)).

    Example:
    ```python
    epsilon_lower_bound(tp=950, fp=50, tn=950, fn=50)   # about 2.5
    ```
    """
    confidence = _check_confidence(confidence)
    delta = _check_delta(delta)
    counts = {"tp": tp, "fp": fp, "tn": tn, "fn": fn}
    for name, value in counts.items():
        if isinstance(value, bool) or int(value) != value or value < 0:
            raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
    if tp + fn < 1 or fp + tn < 1:
        raise ValueError(
            "Need at least one member (tp + fn >= 1) and one non-member "
            f"(fp + tn >= 1), got {counts}."
        )
    per_interval = 1.0 - (1.0 - confidence) / 2.0
    return float(_bound_from_counts(tp, fp, tn, fn, delta, per_interval))


def _counts_at(member_scores, nonmember_scores, thresholds):
    """Confusion counts of the rules "member iff score >= t", one per t."""
    members = np.sort(member_scores)
    nonmembers = np.sort(nonmember_scores)
    tp = members.size - np.searchsorted(members, thresholds, side="left")
    fp = nonmembers.size - np.searchsorted(nonmembers, thresholds, side="left")
    return tp, fp, nonmembers.size - fp, members.size - tp


def _as_scores(name, scores, minimum):
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    if scores.size < minimum or not np.all(np.isfinite(scores)):
        raise ValueError(
            f"`{name}` must hold at least {minimum} finite scores, got "
            f"{scores.size} (finite: {int(np.isfinite(scores).sum())})."
        )
    return scores


def epsilon_lower_bound_from_scores(
    member_scores: Sequence[float] | np.ndarray,
    nonmember_scores: Sequence[float] | np.ndarray,
    *,
    delta: float = 0.0,
    confidence: float = 0.95,
    selection: str = "split",
    thresholds: Sequence[float] | np.ndarray | None = None,
    seed: int = 0,
) -> dict:
    """Lower bound on epsilon from attack scores (higher = "more likely member").

    The attack is a threshold rule "member iff score >= t". Picking the best t
    after looking at the scores is itself a selection that must be paid for:

    * selection="split": members and non-members are each shuffled (with
      `seed`) and halved. The threshold that maximizes the bound on the first
      halves is evaluated on the second halves only, so the reported bound is a
      single pre-registered test. Costs half of the data.
    * selection="union": the caller supplies a grid of `thresholds` fixed
      before seeing the scores (e.g. from the score's known range); every
      threshold is evaluated on all data with intervals at level
      1 - alpha / (2 * len(thresholds)) (Bonferroni), and the best is reported.
      Thresholds read off the scores themselves would not be a fixed family,
      so they are refused.

    Args:
        member_scores: attack scores of members.
        nonmember_scores: attack scores of non-members.
        delta: the delta the bound is stated for.
        confidence: overall confidence of the bound.
        selection: "split" or "union", see above.
        thresholds: the fixed grid for selection="union"; must be None for
            "split".
        seed: shuffling seed for selection="split".

    Returns:
        A dict with "epsilon_lower_bound" (nats), "threshold", the counts
        "tp", "fp", "tn", "fn" it was computed from, and "selection".

    Example:
    ```python
    rng = np.random.default_rng(0)
    members, nonmembers = rng.normal(3, 1, 4000), rng.normal(0, 1, 4000)
    epsilon_lower_bound_from_scores(members, nonmembers)["epsilon_lower_bound"]
    ```
    """
    confidence = _check_confidence(confidence)
    delta = _check_delta(delta)
    if selection == "split":
        if thresholds is not None:
            raise ValueError(
                "selection='split' chooses its own threshold; pass thresholds=None, "
                "or use selection='union' with a fixed grid."
            )
        members = _as_scores("member_scores", member_scores, 2)
        nonmembers = _as_scores("nonmember_scores", nonmember_scores, 2)
        rng = np.random.default_rng(seed)
        members = rng.permutation(members)
        nonmembers = rng.permutation(nonmembers)
        m_half, n_half = members.size // 2, nonmembers.size // 2
        select_m, eval_m = members[:m_half], members[m_half:]
        select_n, eval_n = nonmembers[:n_half], nonmembers[n_half:]
        per_interval = 1.0 - (1.0 - confidence) / 2.0
        candidates = np.unique(np.concatenate([select_m, select_n]))
        bounds = _bound_from_counts(
            *_counts_at(select_m, select_n, candidates), delta, per_interval
        )
        threshold = float(candidates[int(np.argmax(bounds))])
        tp, fp, tn, fn = (int(c) for c in _counts_at(eval_m, eval_n, threshold))
        bound = float(_bound_from_counts(tp, fp, tn, fn, delta, per_interval))
    elif selection == "union":
        if thresholds is None or len(thresholds) == 0:
            raise ValueError(
                "selection='union' needs `thresholds`: a grid fixed before looking "
                "at the scores, e.g. np.linspace(low, high, 50) over the score's range."
            )
        members = _as_scores("member_scores", member_scores, 1)
        nonmembers = _as_scores("nonmember_scores", nonmember_scores, 1)
        grid = np.asarray(thresholds, dtype=np.float64).reshape(-1)
        per_interval = 1.0 - (1.0 - confidence) / (2.0 * grid.size)
        counts = _counts_at(members, nonmembers, grid)
        bounds = _bound_from_counts(*counts, delta, per_interval)
        best = int(np.argmax(bounds))
        threshold = float(grid[best])
        tp, fp, tn, fn = (int(c[best]) for c in counts)
        bound = float(bounds[best])
    else:
        raise ValueError(f"`selection` must be 'split' or 'union', got {selection!r}.")
    return {
        "epsilon_lower_bound": bound,
        "threshold": threshold,
        "tp": tp,
        "fp": fp,
        "tn": tn,
        "fn": fn,
        "selection": selection,
    }
