"""`LedgerRecorder`: turns the steps a private run applied into privacy-ledger entries.

The compiled step appends every noisy update it applies, with the values
it used, to the optimizer's buffer of applied steps; the recorder takes
them (`take_applied_steps`) and records them (`record_steps`), adding what
only the data can tell: N and how each step chose its examples
(`tf_megadp.data.sources.DataSource`). The ledger lives in the optimizer's
`privacy_ledger` variable, so every file that can continue training
carries the spend and a resumed run continues it.

One recorder serves every way of training, through its public protocol:

* the private `fit`'s `tf_megadp.run.callbacks.LedgerKeeper` (a recorder
  as a Keras callback) begins it, drains it after every batch and ends
  partial logical steps where an example could enter one noisy sum twice;
* a custom loop's `tf_megadp.PrivateStep` begins it, takes the applied
  steps, checks them against its own calls, and records them
  (`record_steps`) or, when their data cannot be known,
  `record_unaccounted`;
* the BERT job begins one to check a run resumed after its last step.

Besides the optimizer's own ledger module, this is the one module that
writes the ledger.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import keras
import numpy as np

from tf_megadp import _keras_compat, adaptive_clipping
from tf_megadp.accounting import LedgerEntry, PrivacyLedger
from tf_megadp.accounting.events import (
    FIXED_ORDER,
    NOISELESS,
    UNACCOUNTED,
    SamplingKind,
    sampling_kind,
)
from tf_megadp.accounting.mechanisms import equivalent_noise_multiplier
from tf_megadp.accounting.run_description import segment_fields
from tf_megadp.data.sources import FIXED_SIZE_SAMPLING, DataSource
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.optimizer import APPLIED_STEP_COLUMNS, DPOptimizer, read_ledger, write_ledger
from tf_megadp.run import weights_origin
from tf_megadp.run.state import EVALUATION_METRICS, dp_optimizer, run_notes
from tf_megadp.steps import sampling_rate_of, step_capacity

__all__ = ["LedgerRecorder"]

_FIXED_SIZE_WARNING = (
    "{description}: these are fixed-size batches, not Poisson draws, so each "
    "logical step holds a fixed number of examples. The epsilon reported for them is "
    "the Poisson-sampling estimate, NOT a proven guarantee (shuffled "
    "fixed-size batches can be much less private; Chua et al., 2024). For a "
    "guarantee, feed tf_megadp.PoissonSampler.from_arrays(x, y, ...).as_dataset()."
)


class LedgerRecorder:
    """Records every applied logical step in the privacy ledger, with N and the sampling.

    One recorder serves every way of training: the private `fit` runs one
    as a Keras callback (`tf_megadp.run.callbacks.LedgerKeeper`), and a
    custom training loop's `tf_megadp.PrivateStep` owns one. What it checks before the first step
    (`begin`), each with an error that names the fix:

    * N: measured from the data when it can be; a stated
      `PrivacyCallback(num_examples=...)` must agree with it;
    * a sampler's dataset: its schedule is the optimizer's and it starts at
      the optimizer's logical step;
    * `require_poisson_sampling`: no data that no sampler drew.

    Args:
        source: the `DataSource` of the data, or None when it has no
            measurable size.
        stated_num_examples: N as the user stated it, if they did.
        require_poisson_sampling: refuse fixed-size batches.
        micro_batch_size: the micro-batch size of array inputs.
        nothing_to_train: the fit was asked for no epoch (`initial_epoch >=
            epochs`, as for a run that `keras.callbacks.BackupAndRestore`
            restored at its end): an exhausted or empty sampler is then no
            error.
        validation: `fit` was given validation data (its metrics are
            released outside epsilon).
        model: the private model (a callback is given it by Keras instead).
    """

    def __init__(
        self,
        source: DataSource | None,
        stated_num_examples: int | None = None,
        *,
        require_poisson_sampling: bool = False,
        micro_batch_size: int | None = None,
        nothing_to_train: bool = False,
        validation: bool = False,
        model: keras.Model | None = None,
    ):
        self._model = model
        self.source = source
        self.nothing_to_train = nothing_to_train
        self.validation = validation
        self.stated_num_examples = stated_num_examples
        self.require_poisson_sampling = require_poisson_sampling
        self.micro_batch_size = micro_batch_size
        self.num_examples: int | None = None
        self.ledger = PrivacyLedger()
        self._last_rows: float | None = None

    # -- What the run is -------------------------------------------------------

    @property
    def model(self) -> keras.Model:
        return self._model

    @property
    def sampling(self) -> str:
        return self.source.sampling if self.source is not None else FIXED_SIZE_SAMPLING

    @property
    def kind(self) -> SamplingKind:
        """The registered sampling kind of the data: what the keeper asks of its steps."""
        return sampling_kind(self.sampling)

    @property
    def num_examples_measured(self) -> bool:
        return self.source is not None and self.source.num_examples_measured

    def data_report(self) -> dict[str, Any]:
        """The data's part of the privacy report."""
        if self.source is not None:
            report = self.source.report()
        else:
            report = {
                "sampling": FIXED_SIZE_SAMPLING,
                "description": "data of unknown size; N stated by the user",
                "num_examples_measured": False,
                "seeded_sampling": False,
                "privacy_unit": "example",
                "examples_per_unit": 1,
                "cycle_length": 1,
            }
        report["poisson_guarantee"] = self.kind.proven_guarantee
        return report

    def _resolve_num_examples(self) -> int | None:
        stated = self.stated_num_examples
        if self.source is None:
            return stated
        measured = self.source.num_examples
        if stated is not None and stated != measured:
            kind = "measured" if self.source.num_examples_measured else "stated"
            raise PrivacyConfigurationError(
                f"num_examples={stated} was stated (PrivacyCallback or "
                f"PrivateStep.begin) but the data has {measured} examples ({kind}: "
                f"{self.source.description}). Remove num_examples: N is measured from "
                "the data."
            )
        return measured

    # -- The run's start -----------------------------------------------------------

    def begin(self) -> None:
        """Everything checked and prepared before the first private step of a run.

        Builds the optimizer (which takes over the ledger of the weights it
        trains, see `DPOptimizer.build`), checks that its ledger covers the
        model's weights and is complete, discards a partial step left by an
        earlier call, and checks the data against the optimizer. Each
        failure raises before any step runs.
        """
        optimizer = dp_optimizer(self.model)
        if not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        optimizer.check_ledger_covers(self.model.trainable_variables)
        carried = optimizer.take_carried_over_steps()
        if carried:
            warnings.warn(
                f"Compiled with a new DPOptimizer: the {carried} logical "
                "steps of the previous one stay in the privacy ledger.",
                UserWarning,
                stacklevel=3,
            )
        discarded = optimizer.discard_partial_step()
        if discarded:
            warnings.warn(
                f"Discarded {discarded} micro-batches of a logical step left "
                "unfinished by an earlier fit call or loop: a logical step never spans "
                "two fit calls or two runs of a loop (an example could enter its noisy "
                "sum twice). They were never released and cost no privacy.",
                UserWarning,
                stacklevel=3,
            )
        outside = self.take_applied_steps()
        if len(outside):
            # Steps applied outside fit (train_on_batch, custom loops): their
            # data is unknown here, so their privacy cannot be accounted.
            self.record_unaccounted(int(outside[:, 0].sum()))
        self.num_examples = self._resolve_num_examples()
        if self.num_examples == 0:
            raise PrivacyConfigurationError(
                "The data holds no example: every row has a zero sample weight (padding "
                "is not an example). Pass the real examples, with non-zero sample weights."
            )
        self._check_source(optimizer)
        self._check_noise(optimizer)
        # First: it may compose the ledger of a DP run whose values the
        # model holds into the optimizer's (which the run then continues).
        weights_origin.check_starting_weights(self.model)
        self.ledger = read_ledger(optimizer)
        self._check_consistent(optimizer)
        adaptive_clipping.check_updates_finite(optimizer, self.model.trainable_variables)
        self.model._tf_megadp_keeper = self
        notes = run_notes(self.model)
        notes.begin_fit(self.model)
        if self.validation:
            notes.release(EVALUATION_METRICS)

    # -- Checks --------------------------------------------------------------------

    def _check_source(self, optimizer: DPOptimizer) -> None:
        source = self.source
        if self.require_poisson_sampling and not self.kind.proven_guarantee:
            description = source.description if source else "this data"
            raise PrivacyConfigurationError(
                f"make_private(require_poisson_sampling=True) refuses {description}: "
                "no tf_megadp Poisson sampler drew it, so its epsilon would not be a "
                "proven guarantee. Feed tf_megadp.PoissonSampler(...).as_dataset() "
                "(or PoissonSampler.from_arrays for arrays)."
            )
        _check_privacy_unit(source, optimizer)
        schedule = optimizer.schedule
        if source is not None and source.schedule is not None:
            iterations = optimizer.logical_step
            if (schedule is not None and iterations >= schedule.total_steps
                    and not self.nothing_to_train):
                raise PrivacyConfigurationError(
                    f"The optimizer's schedule is exhausted: all {schedule.total_steps} "
                    "logical steps of it were applied, so no sampler of it has steps "
                    "left to draw. To train further, extend the run: schedule = "
                    "tf_megadp.extend_schedule(model, [(steps, batch_size)]), then fit "
                    "a sampler built with schedule=schedule, "
                    f"start_step={iterations}. The ledger continues."
                )
            if schedule != source.schedule:
                raise PrivacyConfigurationError(
                    f"The sampler draws steps of {source.schedule} but the optimizer "
                    f"follows {schedule}: each step would hold other examples than the "
                    "accountant composes. Build the DPOptimizer with "
                    "schedule=sampler.schedule."
                )
            if source.start_step != iterations:
                raise PrivacyConfigurationError(
                    f"The sampler starts at logical step {source.start_step} but the "
                    f"optimizer is at step {iterations}. Create the sampler with "
                    "start_step=int(optimizer.iterations)."
                )
            if source.end_step == source.start_step and not self.nothing_to_train:
                raise PrivacyConfigurationError(
                    f"The sampler's dataset is empty: it draws the logical steps "
                    f"[{source.start_step}, {source.end_step}). Build the sampler with an "
                    "end_step after its start_step (by default, the end of its schedule)."
                )
        elif schedule is not None and self.num_examples is not None and (
                schedule.num_examples != self.num_examples):
            raise PrivacyConfigurationError(
                f"The optimizer's schedule was planned for num_examples="
                f"{schedule.num_examples} but the data has {self.num_examples} "
                "examples. Build the schedule with the data's size."
            )
        if not self.kind.proven_guarantee:
            description = source.description if source else "Data of unknown size"
            warnings.warn(_FIXED_SIZE_WARNING.format(description=description),
                          UserWarning, stacklevel=3)

    def _check_noise(self, optimizer: DPOptimizer) -> None:
        """Refuses noise that the data's sampling has no proof for; ends a segment on other data.

        Correlated noise continues its open segment only over the data it
        was drawing (the same sampler's assignment of examples to steps): a
        new sampler's groups or order would let an example join two steps
        of one segment closer than the accounting assumes.
        """
        optimizer.noise_strategy.mechanism().check_sampling(
            self.sampling, self.source.cycle_length if self.source is not None else 1)
        optimizer.continue_noise_segment(
            self.source.assignment if self.source is not None else None)

    def _check_consistent(self, optimizer: DPOptimizer, recorded: int | None = None) -> None:
        """The ledger records every step applied.

        Args:
            recorded: the steps of the ledger just written (None: read the
                stored one). After every logical step the recorder passes
                its own, which it has just stored, rather than parse the
                stored JSON back (a millisecond a step on the host).
        """
        if recorded is None:
            recorded = optimizer.logical_steps_recorded
        applied = optimizer.logical_steps_applied
        if recorded != applied:
            raise PrivacyConfigurationError(
                f"The optimizer's privacy ledger records {recorded} logical steps but "
                f"{applied} were applied: the optimizer state was restored only in "
                "part. Restore the optimizer and its ledger together (model.save / "
                "load_model, or tf_megadp.save_training_state / "
                "restore_training_state)."
            )

    def end_partial_step(self, boundary: str) -> None:
        """Discards the micro-batches of an unfinished logical step at `boundary` (warns).

        Args:
            boundary: what the step must not span, for the warning ("a fit call").
        """
        discarded = dp_optimizer(self.model).discard_partial_step()
        if discarded:
            warnings.warn(
                f"Discarded the last {discarded} micro-batches: they did not complete "
                f"a logical step before the end of {boundary}, and a logical step "
                "must not span it. They were never released and cost no privacy.",
                UserWarning,
                stacklevel=2,
            )

    # -- Turning applied steps into ledger entries -------------------------------

    def record_unaccounted(self, steps: int) -> None:
        """Records `steps` applied logical steps whose data is unknown, as `UNACCOUNTED` steps.

        They join the optimizer's ledger as it stands (which may have been
        restored since this recorder read it), so no step is lost and every
        report refuses from now on.

        Args:
            steps: how many logical steps.
        """
        optimizer = dp_optimizer(self.model)
        ledger = read_ledger(optimizer)
        ledger.append(LedgerEntry.steps_only(steps, UNACCOUNTED))
        write_ledger(optimizer, ledger)
        self.ledger = ledger

    def drain(self) -> None:
        """Moves the steps the compiled step applied into the ledger."""
        self.record_steps(self.take_applied_steps())

    def take_applied_steps(self) -> np.ndarray:
        """The rows (`APPLIED_STEP_COLUMNS`) the compiled step wrote since the last take.

        They leave the optimizer's buffer: the caller records them, with
        `record_steps` or, when their data cannot be known, `record_unaccounted`.

        Raises:
            PrivacyConfigurationError: more differently configured steps ran
                than the buffer holds.
        """
        return dp_optimizer(self.model).take_applied_steps()

    def record_steps(self, table: np.ndarray) -> None:
        """Turns applied-step rows into ledger entries and stores the ledger.

        Args:
            table: rows of `APPLIED_STEP_COLUMNS`, from `take_applied_steps`.

        Raises:
            PrivacyConfigurationError: a step does not match what the data
                planned, held more rows than the data has examples, or (with
                adaptive clipping) was not noised as planned.
        """
        if not len(table):
            return
        optimizer = dp_optimizer(self.model)
        # The ledger holds every step recorded, of every kind; the steps that
        # earlier optimizers applied are not this one's iterations.
        step = self.ledger.total_steps - optimizer.steps_carried
        for values in table:
            row = dict(zip(APPLIED_STEP_COLUMNS, values.tolist()))
            steps = int(row["steps"])
            self._record(optimizer, step, steps, row)
            step += steps
        write_ledger(optimizer, self.ledger)
        self._check_consistent(optimizer, recorded=self.ledger.total_steps)
        adaptive_clipping.note_clip_norm(optimizer)

    def _record(self, optimizer: DPOptimizer, first_step: int, steps: int, row: dict) -> None:
        self._last_rows = row["rows"]
        planned_sigma = optimizer.noise_multiplier_at(first_step)
        if optimizer.adaptive_clipping is not None and not _noise_as_planned(row, planned_sigma):
            # Before anything else: a step whose N is unknown is refused too.
            raise PrivacyConfigurationError(
                f"Logical step {first_step} released the gradient with noise multiplier "
                f"{row['noise_multiplier']} and the count of unclipped examples with "
                f"{row['count_noise_multiplier']}, which do not amount to the planned noise "
                f"multiplier {planned_sigma}. With adaptive clipping, the count's noise "
                "multiplier 2 * count_stddev must exceed sigma: raise "
                "AdaptiveClipping(count_stddev=...) or the batch size.")
        if row["noise_multiplier"] == 0:
            self.ledger.append(LedgerEntry.steps_only(steps, NOISELESS))
            return
        if self.num_examples is None:
            self.ledger.append(LedgerEntry.steps_only(steps, UNACCOUNTED))
            return
        for step in range(first_step, first_step + steps):
            # Only the first step of a row can open a noise segment.
            new_segment = bool(row["new_segment"]) and step == first_step
            self.ledger.append(self._entry(optimizer, step, row, new_segment))

    def _entry(self, optimizer: DPOptimizer, step: int, row: dict,
               new_segment: bool = True) -> LedgerEntry:
        sigma, count_sigma = row["noise_multiplier"], row["count_noise_multiplier"]
        planned_sigma = optimizer.noise_multiplier_at(step)
        kind = self.kind
        if kind.follows_schedule:
            schedule = self.source.schedule
            phase = schedule.phase_at(step)
            used = (row["accumulation_steps"], row["rows"], row["divisor"])
            planned = (phase.accumulation_steps, schedule.capacity(phase), phase.batch_size)
            if not np.allclose(used, planned, rtol=1e-6) or not _noise_as_planned(
                    row, planned_sigma):
                raise PrivacyConfigurationError(
                    f"Logical step {step} used (accumulation steps, rows, divisor, sigma) "
                    f"= {used + (sigma,)} but the sampler planned "
                    f"{planned + (planned_sigma,)}. Feed the "
                    "sampler's micro-batches unchanged, with the optimizer built from "
                    "schedule=sampler.schedule."
                )
            if kind.segment_event is not None:
                return self._segment_entry(optimizer, step, sigma, count_sigma, new_segment)
            return LedgerEntry(1, sampling_rate_of(phase.batch_size, self.num_examples), sigma,
                               schedule.capacity(phase) if kind.truncates else 0, kind.name,
                               count_sigma)
        return self._fixed_size_entry(row["rows"], sigma, count_sigma)

    def _segment_entry(self, optimizer: DPOptimizer, step: int, sigma: float,
                       count_sigma: float, new_segment: bool) -> LedgerEntry:
        """Logical step `step` of a kind accounted by noise segment, with the noise's mechanism.

        A step that opens a segment counts a fixed-order segment's
        participation over the schedule's steps left; the others continue
        the segment of the ledger's last entry.

        Raises:
            PrivacyConfigurationError: the step continues a segment the
                ledger does not end with.
        """
        schedule, kind = self.source.schedule, self.kind
        strategy = optimizer.noise_strategy
        phase = schedule.phase_at(step)
        last = self.ledger.entries[-1] if len(self.ledger) else None
        if not new_segment and (last is None or last.sampling != kind.name
                                or last.noise != strategy.record()):
            raise PrivacyConfigurationError(
                f"Logical step {step} continued a noise segment that the privacy ledger does "
                "not end with (its state was restored apart from the optimizer's). Restore "
                "the optimizer and its ledger together (model.save / load_model, or "
                "tf_megadp.save_training_state / restore_training_state).")
        steps_per_epoch = (self.num_examples // phase.batch_size if kind.name == FIXED_ORDER
                           else None)
        fields = segment_fields(
            strategy, sampling=kind.name,
            sampling_rate=sampling_rate_of(phase.batch_size, self.num_examples),
            noise_multiplier=sigma,
            max_batch_size=schedule.capacity(phase) if kind.truncates else 0,
            count_noise_multiplier=count_sigma, num_examples=self.num_examples,
            first_step=step, segment_start=new_segment, cycle_length=self.source.cycle_length,
            steps_per_epoch=steps_per_epoch,
            planned_steps=max(1, schedule.total_steps - step) if new_segment else 1)
        if not new_segment and kind.name == FIXED_ORDER:
            # The segment's participation was counted when it opened.
            fields.update(participations=last.participations, sensitivity=last.sensitivity)
        return LedgerEntry(1, **fields)

    def _fixed_size_entry(self, rows: float, sigma: float,
                          count_sigma: float = 0.0) -> LedgerEntry:
        if rows > self.num_examples:
            raise PrivacyConfigurationError(
                f"A logical step held {int(rows)} rows but the data has "
                f"{self.num_examples} examples: some example entered one noisy sum "
                "twice (a logical step spanning a pass over the data). Lower "
                "accumulation_steps or the batch size so that a logical step fits in "
                "one epoch."
            )
        return LedgerEntry(1, sampling_rate_of(rows, self.num_examples), sigma, 0,
                           self.sampling, count_sigma)

    def next_entry(self, step: int) -> LedgerEntry | None:
        """The ledger entry logical step `step` will get, when it can be known."""
        optimizer = dp_optimizer(self.model)
        sigma = optimizer.noise_multiplier_at(step)
        if self.num_examples is None or sigma == 0:
            return None
        kind = self.kind
        if kind.follows_schedule:
            schedule = self.source.schedule
            phase = schedule.phase_at(step)
            if kind.segment_event is not None:
                new_segment = not optimizer.noise_segment_continues(step)
                count_sigma = 0.0
                if not new_segment and len(self.ledger):
                    # A continued segment keeps the noise its steps recorded
                    # (the step's float32 sigma; a fixed-order segment refuses
                    # any other, and the budget's next step would not differ).
                    last = self.ledger.entries[-1]
                    sigma, count_sigma = last.noise_multiplier, last.count_noise_multiplier
                return self._segment_entry(optimizer, step, sigma, count_sigma, new_segment)
            return LedgerEntry(1, sampling_rate_of(phase.batch_size, self.num_examples), sigma,
                               schedule.capacity(phase) if kind.truncates else 0, kind.name)
        rows = self._last_rows
        if rows is None and self.micro_batch_size is not None:
            replicas = _keras_compat.optimizer_strategy(optimizer).num_replicas_in_sync
            rows = step_capacity(optimizer.accumulation_steps_at(step), self.micro_batch_size,
                                 replicas)
        if rows is None:
            return None
        return self._fixed_size_entry(min(rows, self.num_examples), sigma)


def _check_privacy_unit(source: DataSource | None, optimizer: DPOptimizer) -> None:
    """The optimizer clips the units the data lays out: k rows per unit, or one example.

    Clipping single examples of k-row unit slots would let one unit move the
    sum by k C while epsilon is reported per unit; clipping k-row groups of
    data that holds no units would group unrelated examples.
    """
    unit = source.privacy_unit if source is not None else "example"
    k = source.examples_per_unit if source is not None else 1
    if optimizer.examples_per_unit != k:
        raise PrivacyConfigurationError(
            f"The data lays out privacy units of {k} rows ({unit!r}) but the optimizer "
            f"clips units of examples_per_unit={optimizer.examples_per_unit} rows: a "
            "unit's contribution would not be bounded by C as the accountant assumes. "
            "Build the DPOptimizer with examples_per_unit=sampler.examples_per_unit "
            "(1 for data without privacy units)."
        )


def _noise_as_planned(row: dict, planned_sigma: float) -> bool:
    """Whether a step's noise (gradient and, with adaptive clipping, count) is one
    Gaussian of the planned sigma; an impossible pair was recorded as NaN."""
    return math.isclose(equivalent_noise_multiplier(
        row["noise_multiplier"], row["count_noise_multiplier"]), planned_sigma, rel_tol=1e-6)
