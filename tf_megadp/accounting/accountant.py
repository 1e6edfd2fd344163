"""`PrivacyAccountant`: a run's ledger and its (epsilon, delta), with budget search."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import dp_accounting

from tf_megadp._validate import check_delta as _check_delta
from tf_megadp._validate import check_num_examples as _check_num_examples
from tf_megadp.accounting.engines import DEFAULT_ACCOUNTANT, check_accountant, epsilon
from tf_megadp.accounting.events import ledger_event, sampling_kind
from tf_megadp.accounting.ledger import LedgerEntry, PrivacyLedger
from tf_megadp.accounting.report import check_report_format, privacy_report
from tf_megadp.accounting.run_description import RunDescription
from tf_megadp.files import write_json_atomically

__all__ = ["PrivacyAccountant"]


class PrivacyAccountant:
    """Tracks a run's ledger and reports its (epsilon, delta).

    Args:
        num_examples: N, the number of privacy units (training examples or
            sequences) in the dataset.
        delta: the target delta, in (0, 1); a warning is raised if it is above
            1/N.
        accountant: ``"pld"`` (default, tightest) or ``"rdp"``.
        ledger: the steps already taken (e.g. restored from a checkpoint).

    Example:
    ```python
    accountant = PrivacyAccountant(num_examples=60_000, delta=1e-5)
    accountant.record(1000, sampling_rate=256 / 60_000, noise_multiplier=1.1)
    accountant.epsilon()      # 0.599 (PLD)
    ```
    """

    def __init__(
        self,
        num_examples: int,
        delta: float,
        *,
        accountant: str = DEFAULT_ACCOUNTANT,
        ledger: PrivacyLedger | None = None,
    ):
        self.num_examples = _check_num_examples(num_examples)
        self.delta = _check_delta(delta, self.num_examples)
        self.accountant = check_accountant(accountant)
        self.ledger = ledger.copy() if ledger is not None else PrivacyLedger()
        self._warned: set[str] = set()
        self._warn_of_kinds(self.ledger)

    @classmethod
    def for_run(
        cls, delta: float, *, accountant: str = DEFAULT_ACCOUNTANT, **run: Any
    ) -> "PrivacyAccountant":
        """The accountant of a whole planned run.

        Args:
            delta: the target delta.
            accountant: a registered accountant's name.
            **run: the run, as the fields of `RunDescription` (a schedule, or
                num_examples, batch_size, steps or epochs, noise_multiplier;
                sampling, max_batch_size).

        Returns:
            The accountant, its ledger the run's.
        """
        run = RunDescription(**run)
        return cls(run.num_examples, delta, accountant=accountant, ledger=run.ledger())

    def _warn_of_kinds(self, ledger: PrivacyLedger) -> None:
        """Raises each sampling kind's warning once, when its steps first enter the ledger."""
        for name in dict.fromkeys(entry.sampling for entry in ledger):
            warning = sampling_kind(name).warning
            if warning and name not in self._warned:
                self._warned.add(name)
                warnings.warn(warning, UserWarning, stacklevel=3)

    def _check_entry(self, entry: LedgerEntry) -> None:
        if entry.max_batch_size > self.num_examples:
            raise ValueError(
                f"max_batch_size {entry.max_batch_size} exceeds num_examples "
                f"{self.num_examples}."
            )

    def record(self, steps: int, **numbers: Any) -> None:
        """Records `steps` identical logical steps; as `PrivacyLedger.record`."""
        entry = LedgerEntry(steps, **numbers)
        self._check_entry(entry)
        self.ledger.append(entry)
        self._warn_of_kinds(self.ledger)

    @property
    def steps(self) -> int:
        return self.ledger.total_steps

    def dp_event(self) -> dp_accounting.DpEvent:
        """The run as one `dp_accounting` event (composed per ledger entry)."""
        return ledger_event(self.ledger, self.num_examples)

    def epsilon(self, ledger: PrivacyLedger | None = None) -> float:
        """Epsilon at `self.delta` of the ledger (or of `ledger` if given)."""
        ledger = self.ledger if ledger is None else ledger
        for entry in ledger:
            self._check_entry(entry)
        return epsilon(ledger.entries, self.num_examples, self.delta, self.accountant)

    def steps_within_budget(
        self,
        target_epsilon: float,
        entry: LedgerEntry,
        *,
        limit: int | None = None,
    ) -> int:
        """How many more steps like `entry` fit in `target_epsilon`.

        Returns the largest n such that the ledger followed by n steps like
        `entry` (its own `steps` is ignored) has epsilon <= `target_epsilon`,
        capped at `limit` (without a limit, below 2**24). The answer never
        overstates what fits. Epsilon grows with the number of
        steps, so an exponential then binary search needs O(log n)
        evaluations; when all `limit` steps fit (e.g. the rest of a schedule
        phase), one evaluation says so.

        Args:
            target_epsilon: the budget, > 0.
            entry: the step to repeat.
            limit: the most steps worth asking about.

        Returns:
            n, an int in [0, limit].
        """
        if not target_epsilon > 0:
            raise ValueError(f"target_epsilon must be > 0, got {target_epsilon!r}.")

        def fits(count: int) -> bool:
            ledger = self.ledger.copy()
            ledger.append(dataclasses.replace(entry, steps=count))
            return self.epsilon(ledger) <= target_epsilon

        if limit is not None and fits(limit):
            return limit
        limit = 2**24 if limit is None else limit
        if limit < 1 or not fits(1):
            return 0
        low, high = 1, 2
        while high < limit and fits(high):
            low, high = high, high * 2
        # fits(low), and min(high, limit) is taken not to fit: that is known,
        # except at the default cap, where it only makes the answer smaller.
        return self._bisect(fits, low, min(high, limit))

    @staticmethod
    def _bisect(fits, low: int, high: int) -> int:
        # Invariant: fits(low) and not fits(high).
        while high - low > 1:
            middle = (low + high) // 2
            if fits(middle):
                low = middle
            else:
                high = middle
        return low

    def report(self, settings: dict[str, Any] | None = None) -> dict[str, Any]:
        """A publishable description of what the run spent.

        Args:
            settings: training settings to publish alongside (e.g. the clipping
                norm); must be JSON-serialisable.

        Returns:
            A dict with the privacy unit, adjacency, accountant, epsilon,
            delta, N, steps, the sampling assumption, the ledger and warnings
            (see `tf_megadp.accounting.report`).
        """
        return privacy_report(self, settings)

    def save_report(self, path: str | os.PathLike, settings: dict[str, Any] | None = None) -> None:
        """Writes `report(settings)` as JSON to `path`, atomically."""
        write_json_atomically(path, self.report(settings))

    @classmethod
    def from_report(cls, report: dict[str, Any]) -> "PrivacyAccountant":
        """Rebuilds the accountant of a `report()` (e.g. to re-check epsilon)."""
        check_report_format(report)
        return cls(
            report["num_examples"],
            report["delta"],
            accountant=report["accountant"],
            ledger=PrivacyLedger.from_list(report["ledger"]),
        )
