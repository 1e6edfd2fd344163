"""Keras callbacks that keep a DP run's privacy spend visible and bounded.

* `PrivacyCallback` (the user's): writes `epsilon` and `delta` into the
  Keras `logs`, enforces a `target_epsilon` budget and writes the
  publishable report, with the code (`_PrivacyReporting`) that a custom
  loop's `tf_megadp.PrivacyReport` runs.
* `LedgerKeeper` (added by the private `fit` itself) records the spend:
  see `tf_megadp.ledger_keeping`.
"""

from __future__ import annotations

import math
import os
from typing import Any

import keras

from tf_megadp import weights_origin
from tf_megadp._validate import check_delta
from tf_megadp.accounting import DEFAULT_ACCOUNTANT, LedgerEntry, PrivacyAccountant, PrivacyLedger
from tf_megadp.accounting.engines import check_accountant
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.ledger_keeping import LedgerRecorder
from tf_megadp.optimizer import DPOptimizer
from tf_megadp.run_state import (
    RELEASED_OUTSIDE_EPSILON,
    dp_optimizer,
    ledger_optimizer,
    model_ledger,
    run_notes,
)

__all__ = ["PrivacyCallback"]

class _PrivacyReporting:
    """Epsilon, the publishable report and the budget of a private run, from its ledger.

    The one implementation behind `PrivacyCallback` (for `fit`) and
    `tf_megadp.PrivacyReport` (for custom training loops). A subclass
    provides `model` and calls `_attach` with the run's `LedgerRecorder`
    before anything is read.
    """

    def _init_reporting(self, delta, num_examples, batch_size, accountant, target_epsilon):
        if delta is None:
            raise ValueError("PrivacyCallback needs delta (at most 1/num_examples).")
        if target_epsilon is not None and not (
            isinstance(target_epsilon, (int, float)) and 0 < target_epsilon < float("inf")
        ):
            raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}.")
        if batch_size is not None and (
                isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
        # Validates N, delta and the accountant now rather than at fit time.
        if num_examples is not None:
            PrivacyAccountant(num_examples, delta, accountant=accountant)
        else:
            check_delta(delta, None)
            check_accountant(accountant)
        self._accountant: PrivacyAccountant | None = None
        self.num_examples = num_examples
        self.delta = delta
        self.batch_size = batch_size
        self.accountant_name = accountant
        self.target_epsilon = target_epsilon
        self._keeper: LedgerRecorder | None = None
        self._stop_at: int | None = None
        self._budget_entry: LedgerEntry | None = None

    # -- Results -------------------------------------------------------------------

    @property
    def epsilon(self) -> float:
        """Epsilon spent by every noisy update of the model's weights (inf without noise).

        Derived from the optimizer's own count of the steps it applied (see
        `model_ledger`), so it includes the steps of earlier runs the
        ledger carried over, and refuses (PrivacyConfigurationError, naming
        the steps) when steps were taken outside `fit`.

        Raises:
            RuntimeError: the callback was not passed to a `fit` yet, so it
                does not know N or the model.
        """
        if self._keeper is None:
            raise RuntimeError(
                "PrivacyCallback.epsilon is known once the callback was passed to a "
                "private fit (it measures N there). For a custom loop, use "
                "tf_megadp.PrivacyReport(step, delta). For a loaded model, use "
                "tf_megadp.PrivacyAccountant(N, delta, ledger=tf_megadp.model_ledger(model))."
            )
        ledger = model_ledger(self.model)
        if ledger.infinite_epsilon_steps:
            return math.inf  # The accountant refuses steps without noise; they spend all.
        return self._accountant.epsilon(ledger)

    @property
    def ledger(self) -> PrivacyLedger:
        """A copy of the steps recorded so far."""
        return self._keeper.ledger.copy() if self._keeper else PrivacyLedger()

    @property
    def _optimizer(self) -> DPOptimizer:
        return dp_optimizer(self.model)

    def _settings(self) -> dict[str, Any]:
        return {**self._optimizer.settings_report(), "target_epsilon": self.target_epsilon}

    def report(self) -> dict[str, Any]:
        """The publishable report of the run.

        The accountant's report (see `PrivacyAccountant.report`) plus what the
        data and the randomness were: whether N was measured or stated,
        whether the steps were Poisson draws, whether noise or sampling came
        from an explicit seed, and what the run releases outside epsilon.
        """
        keeper, optimizer = self._keeper, ledger_optimizer(self.model)
        accountant = PrivacyAccountant(
            self._accountant.num_examples, self.delta, accountant=self.accountant_name,
            ledger=model_ledger(self.model))
        report = accountant.report(self._settings())
        data = keeper.data_report()
        report["data"] = data
        if data["privacy_unit"] != "example":
            # What epsilon protects: every example of one unit (a user), not one.
            report["privacy_unit"] = data["privacy_unit"]
        report["num_examples_measured"] = data["num_examples_measured"]
        report["seeded_noise"] = optimizer.seeded_noise
        run = run_notes(self.model)
        report["released_outside_epsilon"] = list(RELEASED_OUTSIDE_EPSILON) + run.released
        report["weights_changed_outside_private_steps"] = run.check_weights(self.model, warn=False)
        # What continue_from_release checks a release's report against.
        report["weights_fingerprint"] = weights_origin.weights_fingerprint(self.model)
        report["initial_weights"] = weights_origin.origin_report(self.model)
        notes = report["warnings"]
        if report["weights_changed_outside_private_steps"]:
            notes.append("trainable weights changed outside the private steps (between "
                         "private fits): that change is NOT covered by epsilon; not for "
                         "release unless it came from public data only.")
        if optimizer.seeded_noise:
            notes.append("seeded noise: not for release (DPOptimizer(seed=...)).")
        if data["seeded_sampling"]:
            notes.append("seeded sampling: not for release (the sampler's seed= makes "
                         "its draws recomputable).")
        if not data["num_examples_measured"]:
            notes.append("num_examples was stated by the user, not measured.")
        return report

    def save_report(self, path: str | os.PathLike) -> None:
        """Writes `report()` as JSON to `path`, atomically."""
        from tf_megadp.files import write_json_atomically

        write_json_atomically(path, self.report())

    def _attach(self, keeper: LedgerRecorder) -> None:
        """Reads the run's ledger through `keeper` from now on; checks it first.

        Raises:
            PrivacyConfigurationError: N is unknown, or steps were taken that
                no ledger accounts for.
            RuntimeError: the budget is spent: one more step would exceed
                `target_epsilon`.
        """
        optimizer = self._optimizer
        if keeper.num_examples is None:
            raise PrivacyConfigurationError(
                "fit cannot measure the size of this data (a dataset that no "
                "tf_megadp sampler returned): pass PrivacyCallback(num_examples=N, "
                "...) and the report will say N was stated, or feed arrays or a "
                "tf_megadp sampler's dataset."
            )
        model_ledger(self.model)  # Refuses steps that no ledger can account for.
        self._keeper = keeper
        self._accountant = PrivacyAccountant(
            keeper.num_examples, self.delta, accountant=self.accountant_name)
        self._stop_at = None
        self._budget_entry = None
        iterations = optimizer.logical_step
        self._check_batch_size(keeper.next_entry(iterations))
        if (self.target_epsilon is not None and not keeper.nothing_to_train
                and not self._next_step_fits(iterations)):
            raise RuntimeError(
                f"The privacy budget is spent: epsilon is {self.epsilon:.4g} after "
                f"{keeper.ledger.total_steps} logical steps and one more step would "
                f"exceed target_epsilon={self.target_epsilon:g}. Raise target_epsilon "
                "or stop training."
            )

    def _check_batch_size(self, entry: LedgerEntry | None) -> None:
        if self.batch_size is None or entry is None:
            return
        actual = entry.sampling_rate * self._keeper.num_examples
        if not math.isclose(actual, self.batch_size, rel_tol=1e-9):
            raise PrivacyConfigurationError(
                f"PrivacyCallback(batch_size={self.batch_size}) but each logical step "
                f"of this run holds {actual:g} examples (expected). Remove batch_size: "
                "it is derived from the data and the optimizer."
            )

    def _next_step_fits(self, step: int) -> bool:
        """Whether logical step `step` keeps epsilon within the budget."""
        if self._keeper.ledger.infinite_epsilon_steps:
            return False  # Epsilon is infinite already: no budget is left.
        entry = self._keeper.next_entry(step)
        if entry is None:
            return True  # Known after the first step, which the budget then checks.
        if entry != self._budget_entry or step >= self._stop_at:
            # Epsilon grows with each step, so one search tells how many steps
            # like `entry` still fit; recompute only when the step changes or
            # that many have been taken. With a schedule, asking about the
            # rest of the phase first usually settles it in one evaluation.
            schedule = self._optimizer.schedule
            limit = self._steps_left_in_fit(step)
            if schedule is not None and step < schedule.total_steps:
                phase_left = schedule.phase_ends[schedule.phase_index(step)] - step
                limit = phase_left if limit is None else min(limit, phase_left)
            self._budget_entry = entry
            self._accountant.ledger = self._keeper.ledger.copy()
            self._stop_at = step + self._accountant.steps_within_budget(
                self.target_epsilon, entry, limit=limit
            )
        return step < self._stop_at

    def _steps_left_in_fit(self, step: int) -> int | None:
        """An upper bound on the logical steps the run can still take (None: unknown)."""
        return None


class PrivacyCallback(_PrivacyReporting, keras.callbacks.Callback):
    """Reports epsilon during `fit`, enforces a budget, writes the report.

    Epsilon is computed from the privacy ledger that the private `fit` keeps
    (see `LedgerKeeper`): the steps the compiled step applied, N measured
    from the data, and the way each step chose its examples. Nothing here is
    taken on trust: a value you pass is checked against what `fit` consumes.

    Place it before `CSVLogger` and `TensorBoard` in the callback list so that
    they see the `epsilon` and `delta` it adds to each epoch's logs (the
    progress bar and `History` always see them).

    Args:
        delta: the delta of the reported (epsilon, delta); at most 1/N.
        num_examples: N, only for data whose size `fit` cannot measure (a
            `tf.data.Dataset` or `PyDataset` that no tf_megadp sampler
            returned); the report then says N was stated. For arrays and
            sampler datasets N is measured, and a different value raises.
        batch_size: optional check of the expected logical batch size: a
            value different from what the run's steps hold raises.
        accountant: ``"pld"`` (default) or ``"rdp"``.
        target_epsilon: optional budget. At the end of every logical step, if
            one more step would make epsilon exceed it, training stops, so
            the run never spends more than the budget. Needs
            `steps_per_execution=1` to stop exactly at a step boundary.
        log_every_steps: also write `epsilon` and `delta` into the batch logs
            every this many logical steps.
        report_path: write the publishable JSON report here when training
            ends (atomically).
        verbose: 1 prints when the budget stops training; 0 is silent.

    Example:
    ```python
    callback = tf_megadp.PrivacyCallback(delta=1e-5, target_epsilon=3.0)
    model.fit(sampler.as_dataset(), callbacks=[callback])
    callback.epsilon              # spent so far
    callback.report()             # publishable dict
    ```
    """

    def __init__(
        self,
        delta: float | None = None,
        num_examples: int | None = None,
        *,
        batch_size: int | None = None,
        accountant: str = DEFAULT_ACCOUNTANT,
        target_epsilon: float | None = None,
        log_every_steps: int | None = None,
        report_path: str | os.PathLike | None = None,
        verbose: int = 1,
    ):
        super().__init__()
        if isinstance(delta, int) and not isinstance(delta, bool) and delta >= 1 and (
                num_examples is None or isinstance(num_examples, float)):
            raise TypeError(
                "PrivacyCallback takes delta first: PrivacyCallback(delta=1e-5). "
                "N is measured from the data; pass num_examples= only for data of "
                "unknown size."
            )
        if log_every_steps is not None and (
            isinstance(log_every_steps, bool)
            or not isinstance(log_every_steps, int)
            or log_every_steps < 1
        ):
            raise ValueError(
                f"log_every_steps must be a positive integer, got {log_every_steps!r}."
            )
        self._init_reporting(delta, num_examples, batch_size, accountant, target_epsilon)
        self.log_every_steps = log_every_steps
        self.report_path = report_path
        self.verbose = verbose
        self.stopped_at_step: int | None = None
        self._seen_iterations = 0

    # -- Keras hooks ---------------------------------------------------------------

    def on_train_begin(self, logs=None):
        keeper = getattr(self.model, "_tf_megadp_keeper", None)
        optimizer = self._optimizer  # Raises first for a model without a DPOptimizer.
        if keeper is None or keeper.model is not self.model:
            raise PrivacyConfigurationError(
                "PrivacyCallback needs the private fit of tf_megadp.make_private(model)."
            )
        if self.target_epsilon is not None and getattr(self.model, "steps_per_execution", 1) != 1:
            raise ValueError(
                "PrivacyCallback(target_epsilon=...) must see every micro-batch to "
                "stop exactly before the step that would exceed the budget: compile "
                "with steps_per_execution=1."
            )
        self._micro_batches_seen = 0
        self.stopped_at_step = None
        self._seen_iterations = optimizer.logical_step
        self._attach(keeper)

    def _steps_left_in_fit(self, step: int) -> int | None:
        """An upper bound on the logical steps this fit can still take (None: unknown).

        It bounds the budget search: without it, a search past the end of
        a schedule would look up to 2^24 steps ahead, many evaluations for
        steps this fit never takes (a later fit searches again).
        """
        steps, epochs = self.params.get("steps"), self.params.get("epochs")
        if not steps or not epochs:
            return None
        optimizer = self._optimizer
        left = steps * epochs - self._micro_batches_seen + optimizer.micro_step
        return max(1, left // optimizer.accumulation_steps_at(step) + 1)

    def on_train_batch_end(self, batch, logs=None):
        self._micro_batches_seen += 1
        iterations = self._optimizer.logical_step
        if iterations == self._seen_iterations:
            return  # Mid-accumulation: no noisy update was released.
        previous, self._seen_iterations = self._seen_iterations, iterations
        if logs is not None and self.log_every_steps and (
            iterations // self.log_every_steps > previous // self.log_every_steps
        ):
            logs["epsilon"] = self.epsilon
            logs["delta"] = self.delta
        if self.target_epsilon is not None and not self._next_step_fits(iterations):
            self.model.stop_training = True
            self.stopped_at_step = iterations
            if self.verbose:
                print(
                    f"PrivacyCallback: stopping after logical step {iterations}: "
                    f"epsilon = {self.epsilon:.4g} (delta = {self.delta:g}); one more "
                    f"step would exceed target_epsilon = {self.target_epsilon:g}."
                )

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["epsilon"] = self.epsilon
            logs["delta"] = self.delta

    def on_train_end(self, logs=None):
        if self.report_path is not None:
            self.save_report(self.report_path)
