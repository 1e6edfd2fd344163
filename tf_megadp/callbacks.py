"""Keras callbacks that keep a DP run's privacy spend recorded, visible and bounded.

Two callbacks share the work:

* `LedgerKeeper` (added by the private `fit` itself, first in the list, so
  no user can forget it): after every batch its `LedgerRecorder` turns the
  steps the compiled step applied (`DPOptimizer.applied_steps`, written in
  the graph with the values that step used) into privacy-ledger entries,
  adding what only the data can tell, N and how each step chose its
  examples (`tf_megadp.data.sources.DataSource`). A custom loop's
  `tf_megadp.PrivateStep` records with the same `LedgerRecorder`. The ledger lives in the optimizer's
  `privacy_ledger` variable, so `model.save`, `ModelCheckpoint`,
  `keras.callbacks.BackupAndRestore` and `tf_megadp.save_training_state`
  carry the spend and a resumed run continues it. It also ends partial
  logical steps where an example could otherwise enter one noisy sum twice.
* `PrivacyCallback` (the user's): writes `epsilon` and `delta` into the
  Keras `logs`, enforces a `target_epsilon` budget and writes the
  publishable report, with the code (`_PrivacyReporting`) that a custom
  loop's `tf_megadp.PrivacyReport` runs.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from typing import Any

import keras
import numpy as np

from tf_megadp import _keras_compat
from tf_megadp._validate import check_delta
from tf_megadp.accounting import (
    DEFAULT_ACCOUNTANT,
    LedgerEntry,
    PrivacyAccountant,
    PrivacyLedger,
)
from tf_megadp.accounting.engines import check_accountant
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.optimizer import (
    APPLIED_STEP_COLUMNS,
    DPOptimizer,
    _number,
    _weights_owner,
    read_ledger,
    write_ledger,
)
from tf_megadp.data.sources import FIXED_SIZE_SAMPLING, DataSource
from tf_megadp.steps import sampling_rate_of, step_capacity

__all__ = [
    "EVALUATION_METRICS", "LedgerKeeper", "LedgerRecorder", "PrivacyCallback", "model_ledger",
    "read_ledger", "RELEASED_OUTSIDE_EPSILON", "run_notes", "weights_digest",
]

# What a private Keras run publishes that epsilon does not cover.
RELEASED_OUTSIDE_EPSILON = (
    "training loss and metrics on training batches (exact batch statistics, in "
    "logs, History, CSV and TensorBoard)",
    "nonfinite_examples, when make_private(log_nonfinite_examples=True)",
    "step timings and the number of steps taken",
    "truncated-step counts of the Poisson sampler",
)

# Released by a run that evaluates: validation during fit, model.evaluate.
EVALUATION_METRICS = (
    "validation and evaluation metrics (val_loss and val_<metric> in logs, History, "
    "CSV and TensorBoard; what model.evaluate returns): exact statistics of the "
    "evaluated data, computed outside the DP step, so not covered by epsilon unless "
    "that data is public"
)

_FIXED_SIZE_WARNING = (
    "{description}: these are fixed-size batches, not Poisson draws, so each "
    "logical step holds a fixed number of examples. The epsilon reported for them is "
    "the Poisson-sampling estimate, NOT a proven guarantee (shuffled "
    "fixed-size batches can be much less private; Chua et al., 2024). For a "
    "guarantee, feed tf_megadp.PoissonSampler.from_arrays(x, y, ...).as_dataset()."
)


_PRIVATE_FLAG = "_tf_megadp_private"


def is_private(model: keras.Model) -> bool:
    """Whether `make_private` has been applied to `model`."""
    return bool(getattr(model, _PRIVATE_FLAG, False))


def mark_private(model: keras.Model) -> None:
    """Marks `model` as made private (`make_private` does, once it has checked the model)."""
    setattr(model, _PRIVATE_FLAG, True)


def model_ledger(model: keras.Model) -> PrivacyLedger:
    """The privacy ledger of every noisy update `model`'s weights received, or a refusal.

    The ledger is the one of the `DPOptimizer` that last trained (or
    loaded) the weights, which is `model.optimizer` unless the model was
    compiled again since. It must hold every logical step that optimizer
    applied: a reported epsilon is never stale.

    Args:
        model: a model trained with `tf_megadp.make_private` and a `DPOptimizer`.

    Returns:
        The complete ledger (steps without noise are not in it: see
        `DPOptimizer.noiseless_steps`, which make epsilon infinite).

    Raises:
        PrivacyConfigurationError: steps were applied outside `fit` (with
            `train_on_batch` or a loop calling `train_step`) and are in no
            ledger, or were taken on data of unknown size without a stated N.

    Example:
    ```python
    model = keras.models.load_model("run.keras")
    tf_megadp.PrivacyAccountant(N, 1e-5, ledger=tf_megadp.model_ledger(model)).epsilon()
    ```
    """
    optimizer = _ledger_optimizer(model)
    missing = optimizer.unrecorded_steps
    if missing:
        raise PrivacyConfigurationError(
            f"{missing} of the {optimizer.logical_steps_applied} logical steps applied to "
            "this model's weights are in no privacy ledger: they were taken outside "
            "fit (train_on_batch, or a loop calling train_step), where the data and "
            "its sampling are unknown, or by a tf_megadp.PrivateStep whose record() "
            "has not run since, so any epsilon would leave them out. Train with fit "
            "or a PrivateStep (and call its record()); to report an honest epsilon, "
            "restore a checkpoint taken before those steps."
        )
    unaccounted = _number(optimizer.unaccounted_steps)
    if unaccounted:
        raise PrivacyConfigurationError(
            f"{unaccounted} logical steps of this model were taken on data whose "
            "size was unknown (or outside fit, e.g. train_on_batch), so their "
            "privacy cannot be accounted. Train with a PrivacyCallback from the "
            "first step (with num_examples=N for data of unknown size)."
        )
    return read_ledger(optimizer)


def _ledger_optimizer(model) -> DPOptimizer:
    """The DPOptimizer whose ledger covers `model`'s weights (`model.optimizer` but after a recompile)."""
    return _weights_owner(model.trainable_variables) or _dp_optimizer(model)


def _dp_optimizer(model) -> DPOptimizer:
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, DPOptimizer):
        raise PrivacyConfigurationError(
            "Private training needs a model compiled with tf_megadp.DPOptimizer "
            f"(and made private with tf_megadp.make_private); got {optimizer!r}."
        )
    return optimizer


class _RunNotes:
    """What a private model's runs did outside the noisy steps, kept on the model in memory.

    A plain object (not trackable), so Keras saving never writes it.

    Attributes:
        released: items added to the report's `released_outside_epsilon`
            (e.g. `EVALUATION_METRICS` once the model was evaluated).
        weights_digest: digest of the trainable weights at the end of the
            last private `fit` (None before the first one).
        in_fit: a private `fit` is running (its steps change the weights).
        weights_changed: the trainable weights changed between private
            `fit` calls, outside any private step (a non-private model
            sharing a layer, `set_weights`, ...): sticky, the run is marked.
    """

    def __init__(self):
        self.released: list[str] = []
        self.weights_digest: bytes | None = None
        self.in_fit = False
        self.weights_changed = False

    def begin_fit(self, model) -> None:
        """A private fit starts: compares the weights with the last one's end."""
        self.check_weights(model)
        self.in_fit = True

    def end_fit(self, model) -> None:
        """A private fit ended (also by an error): its steps changed the weights."""
        self.in_fit = False
        self.weights_digest = weights_digest(model)

    def check_weights(self, model, warn: bool = True) -> bool:
        """Whether the weights changed outside the private steps (now or before).

        Args:
            model: the private model.
            warn: warn (loudly) when they did.
        """
        if not (self.in_fit or self.weights_digest is None or self.weights_changed):
            self.weights_changed = weights_digest(model) != self.weights_digest
        if self.weights_changed and warn:
            warnings.warn(_WEIGHTS_CHANGED_WARNING, UserWarning, stacklevel=3)
        return self.weights_changed

    def release(self, item: str) -> None:
        """Records that the run published `item`, outside epsilon."""
        if item not in self.released:
            self.released.append(item)


_WEIGHTS_CHANGED_WARNING = (
    "The trainable weights of this private model changed since its last private fit, "
    "outside any private step (e.g. a non-private model sharing a layer was trained, "
    "or set_weights/load_weights). Epsilon does NOT cover that change: if it was "
    "computed from the private data, the model is not differentially private. The "
    "privacy report marks the run (weights_changed_outside_private_steps)."
)


def weights_digest(model) -> bytes:
    """A digest of every trainable weight's value (exact: any changed bit changes it)."""
    digest = hashlib.blake2b(digest_size=16)
    for variable in model.trainable_variables:
        digest.update(variable.path.encode())
        digest.update(np.ascontiguousarray(keras.ops.convert_to_numpy(variable)).tobytes())
    return digest.digest()


def run_notes(model) -> _RunNotes:
    """The `_RunNotes` of a private model (created on first use)."""
    notes = getattr(model, "_tf_megadp_run_notes", None)
    if notes is None:
        notes = _RunNotes()
        model._tf_megadp_run_notes = notes
    return notes


class LedgerRecorder:
    """Records every applied logical step in the privacy ledger, with N and the sampling.

    One recorder serves every way of training: the private `fit` runs one
    as a Keras callback (`LedgerKeeper`), and a custom training loop's
    `tf_megadp.PrivateStep` owns one. What it checks before the first step
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
            }
        report["poisson_guarantee"] = self.sampling == "poisson"
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
        optimizer = _dp_optimizer(self.model)
        if not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        optimizer.check_ledger_covers(self.model.trainable_variables)
        if optimizer._carried_from:
            warnings.warn(
                f"Compiled with a new DPOptimizer: the {optimizer._carried_from} logical "
                "steps of the previous one stay in the privacy ledger.",
                UserWarning,
                stacklevel=3,
            )
        optimizer._carried_from = None
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
        if _number(optimizer.applied_rows):
            # Steps applied outside fit (train_on_batch, custom loops): their
            # data is unknown here, so their privacy cannot be accounted.
            steps = int(optimizer.applied_steps.numpy()[: _number(optimizer.applied_rows), 0].sum())
            optimizer.unaccounted_steps.assign_add(steps)
            optimizer.applied_rows.assign(0)
        self.num_examples = self._resolve_num_examples()
        self._check_source(optimizer)
        self.ledger = read_ledger(optimizer)
        self._check_consistent(optimizer)
        self.model._tf_megadp_keeper = self
        notes = run_notes(self.model)
        notes.begin_fit(self.model)
        if self.validation:
            notes.release(EVALUATION_METRICS)

    # -- Checks --------------------------------------------------------------------

    def _check_source(self, optimizer: DPOptimizer) -> None:
        source = self.source
        if self.require_poisson_sampling and self.sampling != "poisson":
            description = source.description if source else "this data"
            raise PrivacyConfigurationError(
                f"make_private(require_poisson_sampling=True) refuses {description}: "
                "no tf_megadp Poisson sampler drew it, so its epsilon would not be a "
                "proven guarantee. Feed tf_megadp.PoissonSampler(...).as_dataset() "
                "(or PoissonSampler.from_arrays for arrays)."
            )
        schedule = optimizer.schedule
        if source is not None and source.schedule is not None:
            iterations = _number(optimizer.iterations)
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
        if self.sampling != "poisson":
            description = source.description if source else "Data of unknown size"
            warnings.warn(_FIXED_SIZE_WARNING.format(description=description),
                          UserWarning, stacklevel=3)

    def _check_consistent(self, optimizer: DPOptimizer) -> None:
        recorded, applied = optimizer.logical_steps_recorded, optimizer.logical_steps_applied
        if recorded != applied:
            raise PrivacyConfigurationError(
                f"The optimizer's privacy ledger records {recorded} logical steps but "
                f"{applied} were applied: the optimizer state was restored only in "
                "part. Restore the optimizer and its ledger together (model.save / "
                "load_model, or tf_megadp.save_training_state / "
                "restore_training_state)."
            )

    def _end_partial_step(self, boundary: str) -> None:
        discarded = _dp_optimizer(self.model).discard_partial_step()
        if discarded:
            warnings.warn(
                f"Discarded the last {discarded} micro-batches: they did not complete "
                f"a logical step before the end of {boundary}, and a logical step "
                "must not span it. They were never released and cost no privacy.",
                UserWarning,
                stacklevel=2,
            )

    # -- Turning applied steps into ledger entries -------------------------------

    def drain(self) -> None:
        """Moves the steps the compiled step applied into the ledger."""
        self._record_rows(self._take_applied_rows())

    def _take_applied_rows(self) -> np.ndarray:
        """The rows (`APPLIED_STEP_COLUMNS`) the compiled step wrote since the last drain.

        They leave the optimizer's buffer: the caller records them.
        """
        optimizer = _dp_optimizer(self.model)
        count = _number(optimizer.applied_rows)
        if not count:
            return np.zeros((0, len(APPLIED_STEP_COLUMNS)))
        capacity = optimizer.applied_steps.shape[0]
        if count > capacity:
            raise PrivacyConfigurationError(
                f"More than {capacity} differently configured logical steps ran "
                "between two ledger updates, beyond what the step can record. Lower "
                "steps_per_execution (fit), or call PrivateStep.record() more often "
                "(a custom loop)."
            )
        table = optimizer.applied_steps.numpy()[:count]
        optimizer.applied_rows.assign(0)
        return table

    def _record_rows(self, table: np.ndarray) -> None:
        """Turns applied-step rows into ledger entries and stores the ledger."""
        if not len(table):
            return
        optimizer = _dp_optimizer(self.model)
        step = (self.ledger.total_steps + _number(optimizer.unaccounted_steps)
                + _number(optimizer.noiseless_steps) - _number(optimizer.carried_steps))
        for values in table:
            row = dict(zip(APPLIED_STEP_COLUMNS, values.tolist()))
            steps = int(row["steps"])
            self._record(optimizer, step, steps, row)
            step += steps
        write_ledger(optimizer, self.ledger)
        self._check_consistent(optimizer)

    def _record(self, optimizer: DPOptimizer, first_step: int, steps: int, row: dict) -> None:
        self._last_rows = row["rows"]
        if row["noise_multiplier"] == 0:
            optimizer.noiseless_steps.assign_add(steps)
            return
        if self.num_examples is None:
            optimizer.unaccounted_steps.assign_add(steps)
            return
        for step in range(first_step, first_step + steps):
            self.ledger.append(self._entry(optimizer, step, row))

    def _entry(self, optimizer: DPOptimizer, step: int, row: dict) -> LedgerEntry:
        sigma = row["noise_multiplier"]
        if self.sampling == "poisson":
            schedule = self.source.schedule
            phase = schedule.phase_at(step)
            used = (row["accumulation_steps"], row["rows"], row["divisor"])
            planned = (phase.accumulation_steps, schedule.capacity(phase), phase.batch_size)
            if not np.allclose(used, planned, rtol=1e-6) or not math.isclose(
                    sigma, optimizer.noise_multiplier_at(step), rel_tol=1e-6):
                raise PrivacyConfigurationError(
                    f"Logical step {step} used (accumulation steps, rows, divisor, sigma) "
                    f"= {used + (sigma,)} but the sampler planned "
                    f"{planned + (optimizer.noise_multiplier_at(step),)}. Feed the "
                    "sampler's micro-batches unchanged, with the optimizer built from "
                    "schedule=sampler.schedule."
                )
            return LedgerEntry(1, sampling_rate_of(phase.batch_size, self.num_examples), sigma,
                               schedule.capacity(phase), "poisson")
        return self._fixed_size_entry(row["rows"], sigma)

    def _fixed_size_entry(self, rows: float, sigma: float) -> LedgerEntry:
        if rows > self.num_examples:
            raise PrivacyConfigurationError(
                f"A logical step held {int(rows)} rows but the data has "
                f"{self.num_examples} examples: some example entered one noisy sum "
                "twice (a logical step spanning a pass over the data). Lower "
                "accumulation_steps or the batch size so that a logical step fits in "
                "one epoch."
            )
        return LedgerEntry(1, sampling_rate_of(rows, self.num_examples), sigma, 0,
                           FIXED_SIZE_SAMPLING)

    def next_entry(self, step: int) -> LedgerEntry | None:
        """The ledger entry logical step `step` will get, when it can be known."""
        optimizer = _dp_optimizer(self.model)
        sigma = optimizer.noise_multiplier_at(step)
        if self.num_examples is None or sigma == 0:
            return None
        if self.sampling == "poisson":
            schedule = self.source.schedule
            phase = schedule.phase_at(step)
            return LedgerEntry(1, sampling_rate_of(phase.batch_size, self.num_examples), sigma,
                               schedule.capacity(phase), "poisson")
        rows = self._last_rows
        if rows is None and self.micro_batch_size is not None:
            replicas = _keras_compat.optimizer_strategy(optimizer).num_replicas_in_sync
            rows = step_capacity(optimizer.accumulation_steps_at(step), self.micro_batch_size,
                                 replicas)
        if rows is None:
            return None
        return self._fixed_size_entry(min(rows, self.num_examples), sigma)


class LedgerKeeper(LedgerRecorder, keras.callbacks.Callback):
    """The private `fit`'s `LedgerRecorder`, as a Keras callback.

    The private `fit` (see `tf_megadp.make_private`) puts one first in the
    callback list; there is no need to create one. It begins at the start
    of training, records after every batch, and ends partial logical steps
    where an example could otherwise enter one noisy sum twice: at the end
    of every epoch of data that no sampler drew, and at the end of `fit`.

    Args: as `LedgerRecorder` (Keras gives it the model).
    """

    def __init__(self, *args, **kwargs):
        keras.callbacks.Callback.__init__(self)
        LedgerRecorder.__init__(self, *args, **kwargs)

    def on_train_begin(self, logs=None):
        self.begin()
        self._batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        self.drain()

    def on_epoch_end(self, epoch, logs=None):
        self.drain()
        if self.sampling != "poisson":
            # The next epoch is a new pass over the data: a logical step that
            # continued into it could hold an example twice.
            self._end_partial_step("an epoch")

    def on_train_end(self, logs=None):
        self.drain()
        self._end_partial_step("a fit call")
        # After Keras's finalize (an EMA average is in the weights by now).
        run_notes(self.model).end_fit(self.model)
        if (self.sampling == "poisson" and not self._batches and not self.model.stop_training
                and not self.nothing_to_train):
            raise PrivacyConfigurationError(
                "fit consumed no micro-batch of the sampler's dataset. Under a "
                "tf.distribute strategy Keras reads one batch to build an unbuilt model "
                "and restarts the data, which a sampler refuses (its draws are read "
                "once). Build the model before fit (e.g. call it once on a batch of the "
                "right shapes, or model.build(...)), then pass a fresh sampler's dataset."
            )


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
        if _number(_ledger_optimizer(self.model).noiseless_steps):
            return math.inf
        return self._accountant.epsilon(ledger)

    @property
    def ledger(self) -> PrivacyLedger:
        """A copy of the steps recorded so far."""
        return self._keeper.ledger.copy() if self._keeper else PrivacyLedger()

    @property
    def _optimizer(self) -> DPOptimizer:
        return _dp_optimizer(self.model)

    def _settings(self) -> dict[str, Any]:
        optimizer = self._optimizer
        return {
            "l2_norm_clip": optimizer.l2_norm_clip,
            "noise_multiplier": optimizer.noise_multiplier,
            "accumulation_steps": optimizer.accumulation_steps,
            "normalize_by": optimizer.normalize_by,
            "schedule": optimizer.schedule.to_dict() if optimizer.schedule else None,
            "optimizer": type(optimizer.inner_optimizer).__name__,
            "clipping": optimizer.clipping,
            "per_example_scaling": optimizer.per_example_scaling,
            "automatic_scaling_stability": optimizer.automatic_stability,
            "target_epsilon": self.target_epsilon,
        }

    def report(self) -> dict[str, Any]:
        """The publishable report of the run.

        The accountant's report (see `PrivacyAccountant.report`) plus what the
        data and the randomness were: whether N was measured or stated,
        whether the steps were Poisson draws, whether noise or sampling came
        from an explicit seed, and what the run releases outside epsilon.
        """
        keeper, optimizer = self._keeper, _ledger_optimizer(self.model)
        accountant = PrivacyAccountant(
            self._accountant.num_examples, self.delta, accountant=self.accountant_name,
            ledger=model_ledger(self.model))
        report = accountant.report(self._settings())
        data = keeper.data_report()
        report["data"] = data
        report["num_examples_measured"] = data["num_examples_measured"]
        report["seeded_noise"] = optimizer.seeded_noise
        run = run_notes(self.model)
        report["released_outside_epsilon"] = list(RELEASED_OUTSIDE_EPSILON) + run.released
        report["weights_changed_outside_private_steps"] = run.check_weights(self.model, warn=False)
        notes = report["warnings"]
        if report["weights_changed_outside_private_steps"]:
            notes.append("trainable weights changed outside the private steps (between "
                         "private fits): that change is NOT covered by epsilon; not for "
                         "release unless it came from public data only.")
        if _number(optimizer.noiseless_steps):
            report["epsilon"] = math.inf
            notes.append(f"{_number(optimizer.noiseless_steps)} logical steps had no "
                         "noise: the run is NOT differentially private.")
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
        iterations = _number(optimizer.iterations)
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
        if _number(self._optimizer.noiseless_steps):
            return False
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
        self._seen_iterations = _number(optimizer.iterations)
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
        left = steps * epochs - self._micro_batches_seen + _number(optimizer.micro_steps)
        return max(1, left // optimizer.accumulation_steps_at(step) + 1)

    def on_train_batch_end(self, batch, logs=None):
        self._micro_batches_seen += 1
        iterations = _number(self._optimizer.iterations)
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
