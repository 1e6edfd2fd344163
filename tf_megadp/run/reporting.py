"""`PrivacyReporting`: epsilon, the report and the budget of a private run, from its ledger.

The one implementation behind `tf_megadp.PrivacyCallback` (a private
`fit`'s) and `tf_megadp.PrivacyReport` (a custom loop's): both read the
ledger that the run's `LedgerRecorder` keeps in the optimizer, so a run
reports the same epsilon whichever way it trained.
"""

from __future__ import annotations

import math
import os
from typing import Any

from tf_megadp._validate import check_delta
from tf_megadp.accounting import LedgerEntry, PrivacyAccountant, PrivacyLedger
from tf_megadp.accounting.engines import check_accountant
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.optimizer import DPOptimizer
from tf_megadp.run import weights_origin
from tf_megadp.run.ledger_recorder import LedgerRecorder
from tf_megadp.run.state import (
    RELEASED_OUTSIDE_EPSILON,
    dp_optimizer,
    ledger_optimizer,
    model_ledger,
    run_notes,
)

__all__ = ["PrivacyReporting"]


class PrivacyReporting:
    """Epsilon, the publishable report and the budget of a private run, from its ledger.

    The one implementation behind `PrivacyCallback` (for `fit`) and
    `tf_megadp.PrivacyReport` (for custom training loops). A subclass
    provides `model` and calls `attach` with the run's `LedgerRecorder`
    before anything is read.
    """

    def init_reporting(self, delta, num_examples, batch_size, accountant, target_epsilon):
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
        # The run's recorder, once attached (`attach`).
        self.recorder: LedgerRecorder | None = None
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
        if self.recorder is None:
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
        return self.recorder.ledger.copy() if self.recorder else PrivacyLedger()

    @property
    def model_optimizer(self) -> DPOptimizer:
        """The model's `DPOptimizer`."""
        return dp_optimizer(self.model)

    def _settings(self) -> dict[str, Any]:
        return {**self.model_optimizer.settings_report(), "target_epsilon": self.target_epsilon}

    def report(self) -> dict[str, Any]:
        """The publishable report of the run.

        The accountant's report (see `PrivacyAccountant.report`) plus what the
        data and the randomness were: whether N was measured or stated,
        whether the steps were Poisson draws, whether noise or sampling came
        from an explicit seed, and what the run releases outside epsilon.
        """
        keeper, optimizer = self.recorder, ledger_optimizer(self.model)
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
        # What continue_from_release checks a release's report against:
        # these weights, and this ledger bound to them.
        report["weights_fingerprint"] = weights_origin.weights_fingerprint(self.model)
        report["ledger_binding"] = weights_origin.ledger_binding(
            report["weights_fingerprint"], accountant.ledger)
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
        """Writes `report()` as JSON to `path`, atomically.

        The file is publishable: every absolute path in the report (the
        release a run continues, `initial_weights.report`) is written as
        `files.publishable_path` names it from the file's folder.
        """
        from tf_megadp.files import publishable_paths, write_json_atomically

        folder = os.path.dirname(os.path.abspath(os.fspath(path)))
        write_json_atomically(path, publishable_paths(self.report(), folder))

    def attach(self, keeper: LedgerRecorder) -> None:
        """Reads the run's ledger through `keeper` from now on; checks it first.

        Raises:
            PrivacyConfigurationError: N is unknown, or steps were taken that
                no ledger accounts for.
            RuntimeError: the budget is spent: one more step would exceed
                `target_epsilon`.
        """
        optimizer = self.model_optimizer
        if keeper.num_examples is None:
            raise PrivacyConfigurationError(
                "fit cannot measure the size of this data (a dataset that no "
                "tf_megadp sampler returned): pass PrivacyCallback(num_examples=N, "
                "...) and the report will say N was stated, or feed arrays or a "
                "tf_megadp sampler's dataset."
            )
        model_ledger(self.model)  # Refuses steps that no ledger can account for.
        self.recorder = keeper
        self._accountant = PrivacyAccountant(
            keeper.num_examples, self.delta, accountant=self.accountant_name)
        self._stop_at = None
        self._budget_entry = None
        iterations = optimizer.logical_step
        self._check_batch_size(keeper.next_entry(iterations))
        if (self.target_epsilon is not None and not keeper.nothing_to_train
                and not self.next_step_fits(iterations)):
            raise RuntimeError(
                f"The privacy budget is spent: epsilon is {self.epsilon:.4g} after "
                f"{keeper.ledger.total_steps} logical steps and one more step would "
                f"exceed target_epsilon={self.target_epsilon:g}. Raise target_epsilon "
                "or stop training."
            )

    def _check_batch_size(self, entry: LedgerEntry | None) -> None:
        if self.batch_size is None or entry is None:
            return
        # A cyclic step samples one group of N / L at q = B L / N.
        actual = entry.sampling_rate * self.recorder.num_examples / max(1, entry.cycle_length)
        if not math.isclose(actual, self.batch_size, rel_tol=1e-9):
            raise PrivacyConfigurationError(
                f"PrivacyCallback(batch_size={self.batch_size}) but each logical step "
                f"of this run holds {actual:g} examples (expected). Remove batch_size: "
                "it is derived from the data and the optimizer."
            )

    def next_step_fits(self, step: int) -> bool:
        """Whether logical step `step` keeps epsilon within the budget."""
        if self.recorder.ledger.infinite_epsilon_steps:
            return False  # Epsilon is infinite already: no budget is left.
        entry = self.recorder.next_entry(step)
        if entry is None:
            return True  # Known after the first step, which the budget then checks.
        if entry != self._budget_entry or step >= self._stop_at:
            # Epsilon grows with each step, so one search tells how many steps
            # like `entry` still fit; recompute only when the step changes or
            # that many have been taken. With a schedule, asking about the
            # rest of the phase first usually settles it in one evaluation.
            schedule = self.model_optimizer.schedule
            limit = self.steps_left(step)
            if schedule is not None and step < schedule.total_steps:
                phase_left = schedule.phase_ends[schedule.phase_index(step)] - step
                limit = phase_left if limit is None else min(limit, phase_left)
            self._budget_entry = entry
            self._accountant.ledger = self.recorder.ledger.copy()
            self._stop_at = step + self._accountant.steps_within_budget(
                self.target_epsilon, entry, limit=limit
            )
        return step < self._stop_at

    def steps_left(self, step: int) -> int | None:
        """An upper bound on the logical steps the run can still take (None: unknown).

        A subclass that knows the end of its run says so: it bounds the
        budget search.
        """
        return None
