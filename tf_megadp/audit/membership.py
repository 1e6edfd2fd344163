"""Loss-based membership inference: how well does low loss give members away?

The attack of Yeom et al. (2018) guesses "member" when the model's loss on a
sequence is low. Its score is the negated loss. The calibrated variant
(Watson et al. 2022; the offline form of Carlini et al.'s LiRA) subtracts the
loss of a reference model trained without the targets, so that sequences that
are merely easy (low loss under any model) stop looking like members.

Metrics follow Carlini et al. (2022): ROC AUC, and the true-positive rate at a
low false-positive rate, which is what matters for privacy (an attack that is
confidently right about a few members is a real leak even at AUC 0.5).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["membership_scores", "membership_metrics"]


def _as_vector(name: str, values) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    if values.size == 0 or not np.all(np.isfinite(values)):
        raise ValueError(
            f"`{name}` must be a non-empty array of finite numbers, got "
            f"{values.size} values ({int(np.isfinite(values).sum())} finite)."
        )
    return values


def membership_scores(
    losses: Sequence[float] | np.ndarray,
    reference_losses: Sequence[float] | np.ndarray | None = None,
) -> np.ndarray:
    """Attack scores, higher meaning "more likely a training member".

    Args:
        losses: per-sequence losses under the target model.
        reference_losses: per-sequence losses of the same sequences under a
            reference model that did not train on them, or None for the
            reference-free attack.

    Returns:
        -losses (reference-free) or reference_losses - losses (calibrated).

    Example:
    ```python
    membership_scores([0.5, 2.0], reference_losses=[1.0, 2.0])  # [0.5, 0.0]
    ```
    """
    losses = _as_vector("losses", losses)
    if reference_losses is None:
        return -losses
    reference_losses = _as_vector("reference_losses", reference_losses)
    if reference_losses.shape != losses.shape:
        raise ValueError(
            "`reference_losses` must hold one loss per target loss, got "
            f"{reference_losses.size} and {losses.size}."
        )
    return reference_losses - losses


def membership_metrics(
    member_scores: Sequence[float] | np.ndarray,
    nonmember_scores: Sequence[float] | np.ndarray,
    *,
    fpr_levels: Sequence[float] = (0.01, 0.001),
) -> dict:
    """ROC summary of a membership attack.

    Args:
        member_scores: attack scores of training members.
        nonmember_scores: attack scores of held-out sequences.
        fpr_levels: false-positive rates at which to report the TPR.

    Returns:
        A dict with "auc", "advantage" (max over thresholds of TPR - FPR),
        "tpr_at_fpr_<level>" for each level (the best TPR among ROC points
        with FPR <= level), "num_members" and "num_nonmembers". A TPR at an
        FPR below 1 / num_nonmembers can only be read at FPR = 0, so it is
        pessimistic: report it with the number of non-members.

    Example:
    ```python
    membership_metrics([3.0, 2.0, 0.5], [1.0, 0.0])["auc"]   # 5/6
    ```
    """
    # Imported here: scikit-learn is a dependency of the audit's metrics only,
    # not of `import tf_megadp.audit`.
    from sklearn import metrics

    members = _as_vector("member_scores", member_scores)
    nonmembers = _as_vector("nonmember_scores", nonmember_scores)
    labels = np.concatenate([np.ones(members.size), np.zeros(nonmembers.size)])
    scores = np.concatenate([members, nonmembers])
    fpr, tpr, _ = metrics.roc_curve(labels, scores)
    result = {
        "auc": float(metrics.roc_auc_score(labels, scores)),
        "advantage": float(np.max(tpr - fpr)),
    }
    for level in fpr_levels:
        if not 0.0 < level < 1.0:
            raise ValueError(f"FPR levels must be in (0, 1), got {level!r}.")
        # roc_curve always includes the point (0, 0), so the set is non-empty.
        result[f"tpr_at_fpr_{level:g}"] = float(np.max(tpr[fpr <= level]))
    result["num_members"] = int(members.size)
    result["num_nonmembers"] = int(nonmembers.size)
    return result
