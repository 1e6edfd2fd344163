"""One call that audits a trained masked LM: membership inference and canaries."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from tf_megadp.audit.canaries import Canary, canary_exposure
from tf_megadp.audit.empirical import epsilon_lower_bound_from_scores
from tf_megadp.audit.membership import membership_metrics, membership_scores
from tf_megadp.audit.scoring import MaskedLMScorer

__all__ = ["run_audit"]


def _attack_summary(prefix, member_scores, nonmember_scores, delta, confidence, seed):
    result = {
        f"{prefix}_{key}": value
        for key, value in membership_metrics(member_scores, nonmember_scores).items()
    }
    if min(len(member_scores), len(nonmember_scores)) >= 2:
        bound = epsilon_lower_bound_from_scores(
            member_scores, nonmember_scores, delta=delta, confidence=confidence, seed=seed
        )
        result[f"{prefix}_eps_lower_bound"] = bound["epsilon_lower_bound"]
    return result


def run_audit(
    model,
    member_batches: Iterable,
    nonmember_batches: Iterable,
    canaries: Sequence[Canary] = (),
    *,
    mask_token_id: int,
    pad_token_id: int = 0,
    reference_model=None,
    delta: float = 0.0,
    confidence: float = 0.95,
    canary_mode: str = "pseudo",
    num_candidates: int | None = None,
    max_enumerate: int = 65536,
    batch_size: int = 256,
    seed: int = 0,
) -> dict:
    """Audits a masked LM: loss-based membership inference and canary exposure.

    The epsilon lower bounds treat every member and non-member (every
    canary) as an independent trial; sequences of one training run are not
    quite that, so read them as an indication beside the accountant's
    epsilon, not as a certificate (see `tf_megadp.audit.empirical`).

    Args:
        model: the trained masked LM (`BertMaskedLM` contract, see
            `MaskedLMScorer`).
        member_batches: batches `(x, y[, sample_weight])` of training
            sequences, with fixed mask positions so that the loss is
            reproducible (re-iterable if used more than once).
        nonmember_batches: batches of held-out sequences from the same
            distribution, masked the same way.
        canaries: canaries that were inserted into the training corpus, plus
            any controls (repetitions=0).
        mask_token_id: the mask token id used in training.
        pad_token_id: the padding token id.
        reference_model: optionally a model of the same family trained
            without the member sequences: adds the calibrated attack.
        delta: delta of the empirical epsilon lower bounds.
        confidence: confidence of the lower bounds.
        canary_mode: "pseudo" or "joint", see `MaskedLMScorer.secret_score_fn`.
        num_candidates: sampled candidates per canary; None enumerates the
            candidate space (up to `max_enumerate`).
        max_enumerate: largest candidate space that is enumerated.
        batch_size: sequences per model call.
        seed: seed of candidate sampling and of the bound's data split.

    Returns:
        A flat dict of numbers: "mia_auc", "mia_advantage",
        "mia_tpr_at_fpr_0.01", "mia_tpr_at_fpr_0.001", "mia_num_members",
        "mia_num_nonmembers", "mia_eps_lower_bound"; the same with prefix
        "mia_calibrated" when a reference model is given; for each repetition
        count r among the canaries "exposure_r<r>_mean", "exposure_r<r>_max",
        "exposure_lower_r<r>_mean", "exposure_extrapolated_r<r>_mean"; when
        controls and inserted canaries are both present,
        "canary_eps_lower_bound_r<r>" (exposure as attack score, r-times
        inserted canaries against controls: a bound for a group of r copies).
        Plus "canaries": one dict per canary (see `canary_exposure`), the only
        non-scalar entry.

    Example:
    ```python
    report = run_audit(model, member_batches, nonmember_batches, canaries,
                       mask_token_id=vocab.mask_id, num_candidates=2000)
    report["mia_auc"], report["exposure_r16_mean"]
    ```
    """
    scorer = MaskedLMScorer(
        model, mask_token_id=mask_token_id, pad_token_id=pad_token_id, batch_size=batch_size
    )
    member_losses = scorer.example_losses(member_batches)
    nonmember_losses = scorer.example_losses(nonmember_batches)
    result = _attack_summary(
        "mia",
        membership_scores(member_losses),
        membership_scores(nonmember_losses),
        delta,
        confidence,
        seed,
    )
    if reference_model is not None:
        reference = MaskedLMScorer(
            reference_model,
            mask_token_id=mask_token_id,
            pad_token_id=pad_token_id,
            batch_size=batch_size,
        )
        result.update(
            _attack_summary(
                "mia_calibrated",
                membership_scores(member_losses, reference.example_losses(member_batches)),
                membership_scores(
                    nonmember_losses, reference.example_losses(nonmember_batches)
                ),
                delta,
                confidence,
                seed,
            )
        )
    details = []
    score_fns = {}
    for index, canary in enumerate(canaries):
        slots = canary.format.secret_positions
        if slots not in score_fns:
            score_fns[slots] = scorer.secret_score_fn(slots, mode=canary_mode)
        details.append(
            canary_exposure(
                canary,
                score_fns[slots],
                num_candidates=num_candidates,
                max_enumerate=max_enumerate,
                confidence=confidence,
                seed=seed + index,
            )
        )
    by_count: dict[int, list[dict]] = {}
    for item in details:
        by_count.setdefault(item["repetitions"], []).append(item)
    for count in sorted(by_count):
        values = np.array([item["exposure"] for item in by_count[count]])
        result[f"exposure_r{count}_mean"] = float(values.mean())
        result[f"exposure_r{count}_max"] = float(values.max())
        for kind in ("lower", "extrapolated"):
            result[f"exposure_{kind}_r{count}_mean"] = float(
                np.mean([item[f"exposure_{kind}"] for item in by_count[count]])
            )
    controls = [item["exposure"] for item in by_count.get(0, [])]
    for count in sorted(c for c in by_count if c > 0):
        inserted = [item["exposure"] for item in by_count[count]]
        if len(controls) >= 2 and len(inserted) >= 2:
            bound = epsilon_lower_bound_from_scores(
                inserted, controls, delta=delta, confidence=confidence, seed=seed
            )
            result[f"canary_eps_lower_bound_r{count}"] = bound["epsilon_lower_bound"]
    result["canaries"] = details
    return result
