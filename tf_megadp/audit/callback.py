"""A Keras callback that audits the model while it trains."""

from __future__ import annotations

from typing import Iterable, Sequence

import keras

from tf_megadp.audit.canaries import Canary
from tf_megadp.audit.runner import run_audit

__all__ = ["AuditCallback"]


def _check_reiterable(name: str, batches) -> None:
    # A generator would be empty from the second epoch on.
    if iter(batches) is batches:
        raise ValueError(
            f"`{name}` is a one-shot iterator; pass a list of batches or a "
            "tf.data.Dataset so that every audit sees the same sequences."
        )


class AuditCallback(keras.callbacks.Callback):
    """Runs `run_audit` at the end of some epochs and puts the numbers in `logs`.

    Every scalar of the `run_audit` report is written as `logs[prefix + key]`
    (e.g. "audit_mia_auc", "audit_exposure_r16_mean"), so `History`, CSV
    loggers and TensorBoard record it like any metric. The full last report,
    per-canary details included, is kept in `last_report`.

    Args:
        member_batches: re-iterable batches of training sequences (see
            `run_audit`).
        nonmember_batches: re-iterable batches of held-out sequences.
        canaries: the inserted canaries and controls.
        mask_token_id: the mask token id used in training.
        every_n_epochs: audit after epochs n, 2n, ...; the audit costs model
            calls on all members, non-members and canary candidates.
        prefix: prefix of the keys written into `logs`.
        **audit_kwargs: further keyword arguments of `run_audit` (e.g.
            `num_candidates`, `delta`, `reference_model`).

    Example:
    ```python
    audit = tf_megadp.audit.AuditCallback(members, held_out, canaries,
                                          mask_token_id=4, num_candidates=1000)
    history = model.fit(train_data, epochs=3, callbacks=[audit])
    history.history["audit_mia_auc"]
    ```
    """

    def __init__(
        self,
        member_batches: Iterable,
        nonmember_batches: Iterable,
        canaries: Sequence[Canary] = (),
        *,
        mask_token_id: int,
        every_n_epochs: int = 1,
        prefix: str = "audit_",
        **audit_kwargs,
    ):
        super().__init__()
        _check_reiterable("member_batches", member_batches)
        _check_reiterable("nonmember_batches", nonmember_batches)
        if every_n_epochs < 1:
            raise ValueError(f"`every_n_epochs` must be >= 1, got {every_n_epochs}.")
        self.member_batches = member_batches
        self.nonmember_batches = nonmember_batches
        self.canaries = tuple(canaries)
        self.mask_token_id = mask_token_id
        self.every_n_epochs = every_n_epochs
        self.prefix = prefix
        self.audit_kwargs = audit_kwargs
        self.last_report = None

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.every_n_epochs != 0:
            return
        report = run_audit(
            self.model,
            self.member_batches,
            self.nonmember_batches,
            self.canaries,
            mask_token_id=self.mask_token_id,
            **self.audit_kwargs,
        )
        self.last_report = report
        if logs is not None:
            for key, value in report.items():
                if isinstance(value, (int, float)):
                    logs[self.prefix + key] = float(value)
