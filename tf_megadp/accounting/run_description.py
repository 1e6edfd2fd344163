"""`RunDescription`: a planned DP-SGD run, described once for the accountant.

`compute_epsilon`, `calibrate_noise_multiplier`, `PrivacyAccountant.for_run`
and `tf-megadp epsilon`/`calibrate` take the same description of a run: a
`BatchSizeSchedule`, or constant N, B, steps (or epochs), sigma and
truncation, the sampling kind (with cyclic Poisson's cycle length) and the
gradient noise's mechanism (a registered `tf_megadp.accounting.noise` mechanism). They build this
one value from their keyword arguments, which checks it once and turns it
into the run's ledger (`ledger`) and `dp_accounting` event (`dp_event`).
"""

from __future__ import annotations

import dataclasses
import math

import dp_accounting

from tf_megadp._validate import check_num_examples, check_positive_int
from tf_megadp.accounting.events import CYCLIC_POISSON, FIXED_ORDER, ledger_event, sampling_kind
from tf_megadp.accounting.noise import NoiseMechanism, NoiseStrategy, noise_kinds, resolve_noise
from tf_megadp.accounting.ledger import LedgerEntry, PrivacyLedger, ledger_from_schedule
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.steps import (
    BatchSizeSchedule,
    check_batch_fits,
    sampling_rate_of,
    steps_for_epochs,
)

__all__ = ["RunDescription", "segment_fields"]

# The per-step kind whose entries describe a segment kind's steps before the
# mechanism is added: the same q = B / N, truncation and noise.
_PER_STEP_KIND = {CYCLIC_POISSON: "poisson", FIXED_ORDER: "shuffle"}


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

    What each step releases is the Gaussian of `noise_multiplier`,
    independent from step to step or, with `noise`, correlated by a
    matrix-factorization strategy (`noise` is read where `ledger` builds
    the entries: the functions that take a run pass it on whole). A run
    with correlated noise or a cyclic or fixed-order sampler is one noise
    segment: its entries are accounted together (`events.ledger_event`).

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
        sampling: a registered sampling kind: ``"poisson"``, ``"shuffle"``
            (reported as Poisson, with a warning), ``"cyclic_poisson"`` (or
            ``"poisson"`` with `cycle_length` > 1) or ``"fixed_order"``.
        max_batch_size: truncation of constant-batch Poisson steps (None or
            0: none); with a schedule, each phase's capacity.
        noise: None (independent noise, DP-SGD) or a registered noise
            mechanism (`tf_megadp.accounting.noise`);
            `noise_multiplier` is then sigma on its unit-norm strategy,
            resolved for the run's steps (and epochs).
        cycle_length: L of cyclic Poisson sampling: step t samples group
            t mod L of the N examples at q = B L / N (None or 1: Poisson
            without cycles).
        prior: the ledger of steps released before this run on the same
            data, composed first (the release a run continues,
            `tf_megadp.continue_from_release`); None: none. A correlated-noise
            run opens its own noise segment after them.

    Raises:
        PrivacyConfigurationError: both `steps` and `epochs`, or `epochs`
            with a schedule; a pairing of noise and sampling without proof
            (the mechanism's `check_sampling`); cyclic q = B L / N > 1; a
            fixed-order run whose batch size or noise changes.
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
    noise: NoiseMechanism | None = None
    cycle_length: int | None = None
    prior: PrivacyLedger | None = None

    def __post_init__(self):
        sampling_kind(self.sampling)  # Refuses an unknown kind before anything else.
        self._check_sampling_and_noise()
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
        # Checks every number its entries take (and each reached phase's sigma),
        # and a noise segment's rounds.
        self.dp_event()

    def _check_sampling_and_noise(self) -> None:
        """Names the kind of a cyclic run, and refuses noise without a proof for its sampling."""
        if self.noise is not None and not isinstance(self.noise, NoiseMechanism):
            raise TypeError(f"noise must be None or a registered noise mechanism "
                            f"({list(noise_kinds())}), got {self.noise!r}.")
        cycle = 1 if self.cycle_length is None else check_positive_int(
            "cycle_length", self.cycle_length)
        if self.sampling == "poisson" and cycle > 1:
            object.__setattr__(self, "sampling", CYCLIC_POISSON)
        if self.sampling != CYCLIC_POISSON and cycle > 1:
            raise PrivacyConfigurationError(
                f"cycle_length={cycle} describes cyclic Poisson sampling, but the run's "
                f"sampling is {self.sampling!r}. Pass sampling='poisson' (or "
                "'cyclic_poisson'), or drop cycle_length.")
        object.__setattr__(self, "cycle_length", cycle)
        if self.noise is not None:
            self.noise.check_sampling(self.sampling, cycle)

    @property
    def segmented(self) -> bool:
        """Whether the run's steps are accounted as one noise segment (cyclic or fixed order)."""
        return sampling_kind(self.sampling).segment_event is not None

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

        A cyclic or fixed-order run is one noise segment from step 0: its
        entries carry the mechanism (`NoiseStrategy`, resolved for the run's
        steps), the cycle or the participation.

        Returns:
            A new `PrivacyLedger`.
        """
        # A segment's steps are first described as the per-step kind with the
        # same q = B / N and truncation, then given the mechanism.
        sampling = _PER_STEP_KIND.get(self.sampling, self.sampling)
        if self.schedule is not None:
            ledger = ledger_from_schedule(self.schedule, self.noise_multiplier,
                                          sampling=sampling, steps=self.steps)
        else:
            ledger = PrivacyLedger()
            ledger.record(
                self._constant_batch_steps(),
                sampling_rate=sampling_rate_of(self.batch_size, self.num_examples),
                noise_multiplier=self.noise_multiplier,
                max_batch_size=self.max_batch_size or 0,
                sampling=sampling,
            )
        if self.segmented:
            ledger = self._segment(ledger)
        # Released steps first: the run's own steps (a correlated-noise run's
        # one segment) follow them.
        return PrivacyLedger(list(self.prior or ()) + list(ledger))

    def _segment(self, ledger: PrivacyLedger) -> PrivacyLedger:
        """The planned entries as one noise segment from step 0, with the run's mechanism."""
        total = ledger.total_steps
        if self.sampling == FIXED_ORDER:
            sizes = {round(entry.sampling_rate * self.num_examples) for entry in ledger}
            if len(sizes) > 1:
                raise PrivacyConfigurationError(
                    f"A fixed-order run keeps one batch size (one slot per example), got "
                    f"{sorted(sizes)}. Use one batch size, or cyclic Poisson sampling for a "
                    "growing batch.")
            steps_per_epoch = self.num_examples // sizes.pop()
        else:
            steps_per_epoch = None
        strategy = resolve_noise(self.noise, total, steps_per_epoch=steps_per_epoch)
        segment = PrivacyLedger()
        step = 0
        for entry in ledger:
            segment.append(LedgerEntry(entry.steps, **segment_fields(
                strategy, sampling=self.sampling, sampling_rate=entry.sampling_rate,
                noise_multiplier=entry.noise_multiplier, max_batch_size=entry.max_batch_size,
                count_noise_multiplier=entry.count_noise_multiplier,
                num_examples=self.num_examples, first_step=step, segment_start=step == 0,
                cycle_length=self.cycle_length, steps_per_epoch=steps_per_epoch,
                planned_steps=total)))
            step += entry.steps
        return segment

    def dp_event(self) -> dp_accounting.DpEvent:
        """The run as one `dp_accounting` event (the ledger's entries composed in order)."""
        return ledger_event(self.ledger(), self.num_examples)


def segment_fields(strategy: NoiseStrategy, *, sampling: str, sampling_rate: float,
                   noise_multiplier: float, max_batch_size: int, count_noise_multiplier: float,
                   num_examples: int, first_step: int, segment_start: bool, cycle_length: int,
                   steps_per_epoch: int | None, planned_steps: int) -> dict:
    """The `LedgerEntry` fields (but `steps`) of a step of a segment kind, with its mechanism.

    One function for a planned run (`RunDescription.ledger`) and an applied
    one (the ledger recorder), so both record a step alike.

    Args:
        strategy: the noise's `NoiseStrategy`.
        sampling: "cyclic_poisson" or "fixed_order".
        sampling_rate: q = B / N of the step's expected batch B.
        noise_multiplier: sigma.
        max_batch_size: the step's truncation (cyclic Poisson), else 0.
        count_noise_multiplier: adaptive clipping's count multiplier, or 0.
        num_examples: N.
        first_step: the logical step (its group is that mod L).
        segment_start: it opens a noise segment.
        cycle_length: L (cyclic Poisson).
        steps_per_epoch: s (fixed order), else None.
        planned_steps: a fixed-order segment's planned steps, over which its
            participation and sensitivity are counted.

    Returns:
        The keywords.

    Raises:
        PrivacyConfigurationError: q = B L / N > 1 for a cyclic run.
    """
    fields = {
        "sampling_rate": sampling_rate, "noise_multiplier": noise_multiplier,
        "max_batch_size": max_batch_size, "sampling": sampling,
        "count_noise_multiplier": count_noise_multiplier, "noise": strategy.record(),
        "segment_start": segment_start,
    }
    if sampling == CYCLIC_POISSON:
        rate = sampling_rate * cycle_length
        if rate > 1 + 1e-12:
            batch = sampling_rate * num_examples
            raise PrivacyConfigurationError(
                f"Cyclic Poisson sampling at batch_size {batch:g} with cycle_length "
                f"{cycle_length} needs q = B L / N = {rate:.4g} > 1 ({num_examples} examples "
                f"in {cycle_length} groups). Lower cycle_length to at most "
                f"{int(num_examples // batch)}, or the batch size.")
        fields.update(sampling_rate=min(rate, 1.0), cycle_length=cycle_length,
                      cycle_position=first_step % cycle_length)
    else:
        fields.update(max_batch_size=0, steps_per_epoch=steps_per_epoch,
                      participations=math.ceil(planned_steps / steps_per_epoch),
                      sensitivity=strategy.sensitivity(
                          planned_steps, steps_per_epoch=steps_per_epoch).value)
    return fields
