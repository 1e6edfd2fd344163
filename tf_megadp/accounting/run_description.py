"""`RunDescription`: a planned DP-SGD run, described once for the accountant.

`compute_epsilon`, `calibrate_noise_multiplier`, `PrivacyAccountant.for_run`
and `tf-megadp epsilon`/`calibrate` take the same description of a run: a
`BatchSizeSchedule`, or constant N, B, steps (or epochs), sigma and
truncation, and the sampling kind. They build this one value from their
keyword arguments, which checks it once and turns it into the run's ledger
(`ledger`) and `dp_accounting` event (`dp_event`).
"""

from __future__ import annotations

import dataclasses

import dp_accounting

from tf_megadp._validate import check_num_examples
from tf_megadp.accounting.events import ledger_event, sampling_kind
from tf_megadp.accounting.ledger import PrivacyLedger, ledger_from_schedule
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.steps import (
    BatchSizeSchedule,
    check_batch_fits,
    sampling_rate_of,
    steps_for_epochs,
)

__all__ = ["RunDescription"]


@dataclasses.dataclass(frozen=True)
class RunDescription:
    """A planned DP-SGD run, as the accountant reads it.

    Describe the run either by a `BatchSizeSchedule` (N, and the batch size
    and truncation of every phase; Poisson steps are truncated at each
    phase's capacity) or by constant `num_examples`, `batch_size`, `steps`
    (or `epochs`) and `noise_multiplier`, optionally truncated at
    `max_batch_size`. The value is checked when it is built and is fixed
    from then on: a calibration probes noise multipliers with
    `dataclasses.replace(run, noise_multiplier=sigma)`.

    What each step releases is the Gaussian of `noise_multiplier`, in the
    ledger's entries (`ledger`). Another mechanism of the step (correlated
    noise) is one more field here, read where `ledger` builds the entries:
    the functions that take a run pass it on whole.

    Args:
        schedule: a `BatchSizeSchedule`; `num_examples` is then its N.
        num_examples: N, the number of privacy units.
        batch_size: expected logical batch size B (q = B / N).
        steps: logical steps; with a schedule, defaults to its total (steps
            past its end stay in its last phase).
        epochs: instead of `steps` (not with a schedule): passes over the
            data; as many steps as the sampler of `sampling` draws, see
            `tf_megadp.steps.steps_for_epochs`.
        noise_multiplier: sigma; with a schedule, for the phases that do not
            set their own (None if every phase does).
        sampling: a registered sampling kind: ``"poisson"`` or ``"shuffle"``
            (reported as Poisson, with a warning).
        max_batch_size: truncation of constant-batch Poisson steps (None or
            0: none); with a schedule, each phase's capacity.
        prior: the ledger of steps released before this run on the same
            data, composed first (the release a run continues,
            `tf_megadp.continue_from_release`); None: none.

    Raises:
        PrivacyConfigurationError: both `steps` and `epochs`, or `epochs`
            with a schedule.
        ValueError: an unknown sampling kind, a setting missing or given
            twice, a batch larger than N, a phase the run reaches without a
            noise multiplier, or a number no ledger entry takes (the
            `LedgerEntry` checks).

    Example:
    ```python
    run = RunDescription(num_examples=60_000, batch_size=256, epochs=3,
                         noise_multiplier=1.1)
    run.ledger().total_steps   # 704
    ```
    """

    schedule: BatchSizeSchedule | None = None
    num_examples: int | None = None
    batch_size: int | None = None
    steps: int | None = None
    epochs: float | None = None
    noise_multiplier: float | None = None
    sampling: str = "poisson"
    max_batch_size: int | None = None
    prior: PrivacyLedger | None = None

    def __post_init__(self):
        sampling_kind(self.sampling)  # Refuses an unknown kind before anything else.
        if self.epochs is not None:
            if self.schedule is not None:
                raise PrivacyConfigurationError(
                    "epochs= describes a constant-batch run, but a BatchSizeSchedule "
                    "sets the steps of each phase itself: drop epochs (pass steps= to "
                    "stop early) or describe the run by num_examples, batch_size and "
                    "epochs without a schedule."
                )
            if self.steps is not None:
                raise PrivacyConfigurationError(
                    f"Pass steps or epochs, not both (got steps={self.steps!r}, "
                    f"epochs={self.epochs!r}): one of them fixes the number of logical "
                    "steps."
                )
        if self.schedule is not None:
            self._check_schedule()
        else:
            self._check_constant_batch()
        self.ledger()  # Checks every number its entries take (and each reached phase's sigma).

    def _check_schedule(self) -> None:
        if not isinstance(self.schedule, BatchSizeSchedule):
            raise TypeError(f"schedule must be a BatchSizeSchedule, got {self.schedule!r}.")
        if self.batch_size is not None or self.max_batch_size is not None:
            raise ValueError(
                "Pass either a schedule or batch_size/max_batch_size, not both: the "
                "schedule sets the batch size and the truncation of every phase."
            )
        if self.num_examples is not None and self.num_examples != self.schedule.num_examples:
            raise ValueError(
                f"num_examples {self.num_examples} differs from the schedule's "
                f"num_examples {self.schedule.num_examples}."
            )
        object.__setattr__(self, "num_examples", self.schedule.num_examples)

    def _check_constant_batch(self) -> None:
        missing = [
            name
            for name, value in (
                ("num_examples", self.num_examples),
                ("batch_size", self.batch_size),
                ("steps (or epochs)", self.steps if self.epochs is None else self.epochs),
                ("noise_multiplier", self.noise_multiplier),
            )
            if value is None
        ]
        if missing:
            raise ValueError(
                f"Without a schedule, pass {', '.join(missing)} (or pass a "
                "BatchSizeSchedule)."
            )
        object.__setattr__(self, "num_examples", check_num_examples(self.num_examples))
        batch_size = self.batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
        check_batch_fits(batch_size, self.num_examples)

    def _constant_batch_steps(self) -> int:
        if self.epochs is None:
            return self.steps
        return steps_for_epochs(self.epochs, num_examples=self.num_examples,
                                batch_size=self.batch_size, sampling=self.sampling)

    def ledger(self) -> PrivacyLedger:
        """The ledger the run will have: `prior`'s entries, then one per schedule phase or one in all.

        Returns:
            A new `PrivacyLedger`.
        """
        ledger = PrivacyLedger(self.prior or ())
        if self.schedule is not None:
            for entry in ledger_from_schedule(self.schedule, self.noise_multiplier,
                                              sampling=self.sampling, steps=self.steps):
                ledger.append(entry)
            return ledger
        ledger.record(
            self._constant_batch_steps(),
            sampling_rate=sampling_rate_of(self.batch_size, self.num_examples),
            noise_multiplier=self.noise_multiplier,
            max_batch_size=self.max_batch_size or 0,
            sampling=self.sampling,
        )
        return ledger

    def dp_event(self) -> dp_accounting.DpEvent:
        """The run as one `dp_accounting` event (the ledger's entries composed in order)."""
        return ledger_event(self.ledger(), self.num_examples)
