"""`PrivacyReport`: epsilon, the budget and the published report of a custom loop's `PrivateStep`."""

from __future__ import annotations

from typing import Any

import keras

from tf_megadp.accounting import DEFAULT_ACCOUNTANT
from tf_megadp.run.reporting import PrivacyReporting
from tf_megadp.training.custom_loop import PrivateStep

__all__ = ["PrivacyReport"]


class PrivacyReport(PrivacyReporting):
    """Epsilon, the publishable report and the budget of a custom loop's `PrivateStep`.

    What `PrivacyCallback` gives a private `fit`, computed by the same code
    from the ledger the step keeps: every read records the steps applied so
    far first (`PrivateStep.record`), so epsilon is never stale, and it
    refuses (PrivacyConfigurationError) when steps were taken that no ledger
    accounts for.

    Args:
        step: the loop's `PrivateStep`, after `begin`.
        delta: the delta of the reported (epsilon, delta); at most 1/N.
        accountant: ``"pld"`` (default) or ``"rdp"``.
        target_epsilon: optional budget, for `within_budget`.
        batch_size: optional check of the expected logical batch size.

    Raises:
        RuntimeError: the budget is already spent (one more step would
            exceed `target_epsilon`), or `step.begin` was not called.

    Example:
    ```python
    privacy = tf_megadp.PrivacyReport(step, delta=1e-5, target_epsilon=3.0)
    while privacy.within_budget():
        ...  # the micro-batches of one more logical step
    privacy.save_report("privacy.json")
    ```
    """

    def __init__(self, step: PrivateStep, delta: float, *, accountant: str = DEFAULT_ACCOUNTANT,
                 target_epsilon: float | None = None, batch_size: int | None = None):
        if not isinstance(step, PrivateStep):
            raise TypeError(f"PrivacyReport reads a tf_megadp.PrivateStep's ledger, got {step!r}.")
        self.init_reporting(delta, None, batch_size, accountant, target_epsilon)
        self.step = step
        self._refresh()

    @property
    def model(self) -> keras.Model:
        return self.step.model

    def _refresh(self) -> None:
        """Records the step's applied steps; follows the step's current data."""
        if self.step.recorder is None:
            raise RuntimeError("Call step.begin(data) before creating its PrivacyReport.")
        self.step.record()
        if self.recorder is not self.step.recorder:
            self.attach(self.step.recorder)

    @property
    def epsilon(self) -> float:
        """Epsilon spent by every noisy update of the model's weights (inf without noise)."""
        self._refresh()
        return PrivacyReporting.epsilon.fget(self)

    @property
    def ledger(self):
        """A copy of the steps recorded so far."""
        self._refresh()
        return PrivacyReporting.ledger.fget(self)

    def report(self) -> dict[str, Any]:
        """The publishable report (as `PrivacyCallback.report`)."""
        self._refresh()
        return super().report()

    def within_budget(self) -> bool:
        """Whether one more logical step keeps epsilon within `target_epsilon`.

        Always True without a target. Ask it when a logical step has just
        been applied (`logs["applied"]`) and stop the loop when it says False:
        the run then never spends more than the budget.
        """
        self._refresh()
        if self.target_epsilon is None:
            return True
        return self.next_step_fits(self.step.logical_step)

    def steps_left(self, step: int) -> int | None:
        source = self.step.recorder.source
        end = None if source is None else source.end_step
        return None if end is None else max(1, end - step)
