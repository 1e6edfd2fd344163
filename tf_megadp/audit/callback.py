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
    """Audits the model during `fit` and puts the numbers in `logs`.

    Two audits, either or both:

    * the masked-LM audit (`run_audit`) at the end of some epochs: every
      scalar of its report is written as `logs[prefix + key]` (e.g.
      "audit_mia_auc", "audit_exposure_r16_mean"), so `History`, CSV loggers
      and TensorBoard record it like any metric; the full last report,
      per-canary details included, is kept in `last_report`;
    * a one-run audit (`one_run=`: a `GradientCanaryAudit` or
      `InputCanaries`, built for this run) scored once, at the end of the
      last epoch (or at the end of training if it stops early): its bounds
      go into `logs` as "audit_one_run_<attack>_eps_lower_bound" (with
      "..._correct" and "..._guesses"), the full results into
      `one_run_results`. Its coins can be scored only once, so it is never
      scored mid-run.

    Args:
        member_batches: re-iterable batches of training sequences (see
            `run_audit`); None for a one-run audit only.
        nonmember_batches: re-iterable batches of held-out sequences.
        canaries: the inserted canaries and controls.
        mask_token_id: the mask token id used in training (masked-LM audit).
        every_n_epochs: masked-LM audit after epochs n, 2n, ...; the audit
            costs model calls on all members, non-members and canary candidates.
        prefix: prefix of the keys written into `logs`.
        one_run: an object with `finish(model) -> {attack: OneRunResult}`.
        **audit_kwargs: further keyword arguments of `run_audit` (e.g.
            `num_candidates`, `delta`, `reference_model`).

    Example:
    ```python
    audit = tf_megadp.audit.AuditCallback(members, held_out, canaries,
                                          mask_token_id=4, num_candidates=1000)
    history = model.fit(train_data, epochs=3, callbacks=[audit])
    history.history["audit_mia_auc"]

    canaries = tf_megadp.audit.GradientCanaryAudit(model, sampler.schedule, 2000, delta=1e-6)
    ...  # compile with DPOptimizer(..., clipping=canaries.clipping())
    model.fit(sampler.as_dataset(), callbacks=[tf_megadp.audit.AuditCallback(one_run=canaries)])
    ```
    """

    def __init__(
        self,
        member_batches: Iterable | None = None,
        nonmember_batches: Iterable | None = None,
        canaries: Sequence[Canary] = (),
        *,
        mask_token_id: int | None = None,
        every_n_epochs: int = 1,
        prefix: str = "audit_",
        one_run=None,
        **audit_kwargs,
    ):
        super().__init__()
        masked_lm = member_batches is not None or nonmember_batches is not None
        if masked_lm:
            if member_batches is None or nonmember_batches is None or mask_token_id is None:
                raise ValueError(
                    "The masked-LM audit needs member_batches, nonmember_batches and "
                    "mask_token_id."
                )
            _check_reiterable("member_batches", member_batches)
            _check_reiterable("nonmember_batches", nonmember_batches)
        elif one_run is None:
            raise ValueError(
                "Nothing to audit: pass member_batches, nonmember_batches and mask_token_id "
                "(masked-LM audit), or one_run= (a GradientCanaryAudit or InputCanaries)."
            )
        if one_run is not None and not callable(getattr(one_run, "finish", None)):
            raise TypeError(
                f"one_run must have finish(model) (GradientCanaryAudit, InputCanaries), got {one_run!r}.")
        if every_n_epochs < 1:
            raise ValueError(f"`every_n_epochs` must be >= 1, got {every_n_epochs}.")
        self.masked_lm = masked_lm
        self.member_batches = member_batches
        self.nonmember_batches = nonmember_batches
        self.canaries = tuple(canaries)
        self.mask_token_id = mask_token_id
        self.every_n_epochs = every_n_epochs
        self.prefix = prefix
        self.one_run = one_run
        self.audit_kwargs = audit_kwargs
        self.last_report = None
        self.one_run_results = None

    def on_epoch_end(self, epoch, logs=None):
        if self.masked_lm and (epoch + 1) % self.every_n_epochs == 0:
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
        epochs = (self.params or {}).get("epochs")
        if self.one_run is not None and epochs is not None and epoch + 1 == epochs:
            self._finish_one_run(logs)

    def on_train_end(self, logs=None):
        # Training stopped before its last epoch (e.g. at the privacy budget).
        if self.one_run is not None and self.one_run_results is None:
            self._finish_one_run(logs)

    def _finish_one_run(self, logs):
        self.one_run_results = self.one_run.finish(self.model)
        if logs is None:
            return
        for attack, result in self.one_run_results.items():
            key = f"{self.prefix}one_run_{attack}"
            logs[f"{key}_eps_lower_bound"] = float(result.epsilon_lower_bound)
            logs[f"{key}_correct"] = float(result.num_correct)
            logs[f"{key}_guesses"] = float(result.num_guesses)
