"""The ledger of the weights: the `DPOptimizer` variables that hold the privacy spent.

Every variable of the ledger is declared, read and written in this module
(`LedgerOfWeights`, the part of `DPOptimizer` that keeps them):

* `privacy_ledger` and `privacy_ledger_rows`: the `PrivacyLedger` of every
  noisy update the weights received (`read_ledger`, `write_ledger`);
* `carried_steps`: the logical steps earlier optimizers of the same weights
  applied (a model compiled again with a new `DPOptimizer` continues the
  ledger of the weights: the model's variables name the optimizer whose
  ledger covers their value);
* `applied_steps` and `applied_rows`: the buffer where the compiled step
  appends each noisy update as it applied it (`APPLIED_STEP_COLUMNS`), which
  the run's ledger recorder drains (`take_applied_steps`) and turns into
  ledger entries, adding N and the sampling.

Outside this module, only the run's ledger recorder
(`tf_megadp.run.ledger_recorder`) writes the ledger, through the functions
and methods here.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tf_megadp.accounting import LEDGER_COLUMNS, LedgerEntry, PrivacyLedger
from tf_megadp.accounting.events import UNACCOUNTED
from tf_megadp.errors import PrivacyConfigurationError

__all__ = ["APPLIED_STEP_COLUMNS", "LEDGER_CAPACITY", "LedgerOfWeights", "ledger_owner",
           "read_ledger", "write_ledger"]

# Rows of phases the ledger variable can hold; consecutive identical steps share a row.
LEDGER_CAPACITY = 256
# What the compiled step records of every noisy update it applies, as it used
# them; the ledger recorder of the private `fit` turns these rows into ledger
# entries (adding N and the sampling) after every batch, so the buffer only
# needs to hold the steps of one `steps_per_execution` call.
APPLIED_STEP_COLUMNS = (
    "steps", "noise_multiplier", "accumulation_steps", "rows", "divisor",
    "count_noise_multiplier", "new_segment",
)
_APPLIED_CAPACITY = 64
# The attribute of a model variable that names the DPOptimizer whose ledger
# covers its current value (a plain holder, which neither Keras saving nor
# tf.train.Checkpoint follows).
_LEDGER_OWNER = "_tf_megadp_ledger_owner"


class _LedgerOwner:
    """The optimizer whose ledger covers a variable's value (see `_LEDGER_OWNER`)."""

    def __init__(self, optimizer: "LedgerOfWeights"):
        self.optimizer = optimizer


def ledger_owner(variables) -> "LedgerOfWeights | None":
    """The DPOptimizer whose ledger covers `variables` (None if none does).

    Raises:
        PrivacyConfigurationError: two optimizers with their own histories
            each cover part of the variables, so no single ledger covers
            the model.
    """
    owners = []
    for variable in variables:
        holder = getattr(variable, _LEDGER_OWNER, None)
        if holder is not None and all(holder.optimizer is not o for o in owners):
            owners.append(holder.optimizer)
    if len(owners) > 1:
        raise PrivacyConfigurationError(
            f"The model's variables were trained by {len(owners)} DPOptimizers, each with "
            "its own privacy ledger, so no one ledger covers the model. Train the whole "
            "model with one DPOptimizer (restore it from one training checkpoint)."
        )
    return owners[0] if owners else None


def read_ledger(optimizer: "LedgerOfWeights") -> PrivacyLedger:
    """The `PrivacyLedger` stored in a `DPOptimizer`.

    An optimizer that is not built yet has recorded nothing and returns an
    empty ledger; when it is built for weights that another `DPOptimizer`
    trained (a loaded model compiled again), it takes that ledger over.

    Args:
        optimizer: the `DPOptimizer` (e.g. `model.optimizer` after
            `keras.models.load_model`).

    Returns:
        The ledger of the logical steps recorded so far.

    Raises:
        TypeError: `optimizer` is not a `DPOptimizer`.

    Example:
    ```python
    model = keras.models.load_model("run.keras")
    tf_megadp.read_ledger(model.optimizer).total_steps
    ```
    """
    if not isinstance(optimizer, LedgerOfWeights):
        raise TypeError(
            f"read_ledger reads a tf_megadp.DPOptimizer's ledger; got {optimizer!r}, "
            "which keeps none."
        )
    if not optimizer.built:
        return PrivacyLedger()
    rows = int(keras.ops.convert_to_numpy(optimizer.privacy_ledger_rows))
    table = keras.ops.convert_to_numpy(optimizer.privacy_ledger)
    return PrivacyLedger.from_rows(table[:rows])


def write_ledger(optimizer: "LedgerOfWeights", ledger: PrivacyLedger) -> None:
    """Stores `ledger` in a built `DPOptimizer`'s `privacy_ledger` variable.

    Raises:
        RuntimeError: the ledger has more rows than the variable holds.
    """
    rows = ledger.to_rows()
    capacity = optimizer.privacy_ledger.shape[0]
    if len(rows) > capacity:
        raise RuntimeError(
            f"The privacy ledger needs {len(rows)} rows but the optimizer stores "
            f"{capacity}: the sampling rate or noise multiplier changed too often. "
            "Change them per phase of a BatchSizeSchedule instead of per step."
        )
    table = np.zeros(optimizer.privacy_ledger.shape, np.float64)
    table[: len(rows)] = rows
    optimizer.privacy_ledger.assign(table)
    optimizer.privacy_ledger_rows.assign(len(rows))


def _number(variable) -> int:
    return int(keras.ops.convert_to_numpy(variable))


class LedgerOfWeights:
    """The part of `DPOptimizer` that keeps the ledger of the weights it trains."""

    def _build_ledger_variables(self) -> None:
        """Declares the ledger's variables (saved with every file of the optimizer).

        Their order is their position in Keras's saved files; the attribute
        names are their names in a `tf.train.Checkpoint`.
        """
        self.privacy_ledger = self.add_variable(
            shape=(LEDGER_CAPACITY, len(LEDGER_COLUMNS)), dtype="float64", name="privacy_ledger")
        self.privacy_ledger_rows = self.add_variable(
            shape=(), dtype="int64", name="privacy_ledger_rows")
        # Ledger steps taken by earlier optimizers of the same model.
        self.carried_steps = self.add_variable(shape=(), dtype="int64", name="carried_steps")
        self.applied_steps = self.add_variable(
            shape=(_APPLIED_CAPACITY, len(APPLIED_STEP_COLUMNS)), dtype="float64",
            aggregation="only_first_replica", name="applied_steps")
        self.applied_rows = self.add_variable(
            shape=(), dtype="int64", aggregation="only_first_replica", name="applied_rows")

    @property
    def steps_carried(self) -> int:
        """Logical steps that earlier optimizers of the same weights applied (in the ledger)."""
        return _number(self.carried_steps) if self.built else 0

    @property
    def logical_steps_applied(self) -> int:
        """Noisy updates these weights received: this optimizer's and those it took over."""
        if not self.built:
            return 0
        return _number(self.carried_steps) + _number(self.iterations)

    @property
    def logical_steps_recorded(self) -> int:
        """Logical steps in the ledger, of every kind (noiseless and unaccounted ones too)."""
        if not self.built:
            return 0
        return read_ledger(self).total_steps

    @property
    def unrecorded_steps(self) -> int:
        """Applied logical steps that no ledger entry records (taken outside `fit`).

        The private `fit` records every step it applies after each batch,
        and a custom loop's `tf_megadp.PrivateStep` when its `record` runs;
        steps applied by `train_on_batch` or a loop that calls `train_step`
        itself stay unrecorded, and epsilon cannot be reported while there
        are any.
        """
        return self.logical_steps_applied - self.logical_steps_recorded

    @property
    def pending_applied_steps(self) -> int:
        """Logical steps the compiled step applied that no one has taken from its buffer yet."""
        if not self.built:
            return 0
        rows = min(_number(self.applied_rows), self.applied_steps.shape[0])
        return int(self.applied_steps.numpy()[:rows, 0].sum())

    def take_applied_steps(self) -> np.ndarray:
        """The rows (`APPLIED_STEP_COLUMNS`) the compiled step appended since the last take.

        They leave the buffer: the caller (the run's ledger recorder) turns
        them into ledger entries.

        Raises:
            PrivacyConfigurationError: more differently configured steps ran
                than the buffer holds, so some were not recorded.
        """
        count = _number(self.applied_rows) if self.built else 0
        if not count:
            return np.zeros((0, len(APPLIED_STEP_COLUMNS)))
        capacity = self.applied_steps.shape[0]
        if count > capacity:
            raise PrivacyConfigurationError(
                f"More than {capacity} differently configured logical steps ran "
                "between two ledger updates, beyond what the step can record. Lower "
                "steps_per_execution (fit), or call PrivateStep.record() more often "
                "(a custom loop)."
            )
        table = self.applied_steps.numpy()[:count]
        self.applied_rows.assign(0)
        return table

    def take_carried_over_steps(self) -> int | None:
        """The steps this optimizer took over from another when built, reported once.

        Returns:
            The previous optimizer's applied steps the first time it is
            asked after `build` took them over (the private run warns), else None.
        """
        carried, self._carried_from = getattr(self, "_carried_from", None), None
        return carried

    def start_ledger(self, ledger: PrivacyLedger) -> None:
        """Makes `ledger` the start of this optimizer's, as steps it applied (a release's).

        Args:
            ledger: the ledger of the weights' earlier steps.
        """
        write_ledger(self, ledger)
        # Those steps were applied to these weights by another optimizer.
        self.carried_steps.assign(ledger.total_steps)

    def _ledger_loaded(self, variables) -> None:
        """The saved ledger was just loaded: it is the ledger of `variables`, as they are."""
        self._carried_from = None
        self._claim(variables)

    def _has_history(self) -> bool:
        return self.built and (self.logical_steps_applied > 0 or self.logical_steps_recorded > 0)

    def _claim(self, variables) -> None:
        """Marks `variables` as covered by this optimizer's ledger."""
        holder = _LedgerOwner(self)
        for variable in variables:
            setattr(variable, _LEDGER_OWNER, holder)

    def _continue_ledger_of(self, variables) -> None:
        """Takes over the ledger of the DPOptimizer whose ledger covers `variables`.

        The new optimizer continues exactly where the previous one stopped:
        its ledger (with the steps it could not account and those without
        noise), and the count of steps applied (`carried_steps` plus this
        optimizer's `iterations`). Wrapping the previous optimizer's inner
        optimizer continues its state (moments, iterations) as well.
        """
        previous = ledger_owner(variables)
        self._carried_from = None
        if previous is not None and previous is not self and previous._has_history():
            if previous.inner_optimizer is self.inner_optimizer:
                carried = _number(previous.carried_steps)  # Its iterations continue.
            elif _number(self.iterations) == 0:
                carried = previous.logical_steps_applied
            else:
                raise PrivacyConfigurationError(
                    f"The inner optimizer has already taken {_number(self.iterations)} "
                    "steps that no privacy ledger recorded, and this model's weights "
                    "carry the ledger of another DPOptimizer. Wrap a fresh inner "
                    "optimizer, or the inner optimizer of the DPOptimizer that trained "
                    "the model (model.optimizer.inner_optimizer) to continue its state."
                )
            ledger = read_ledger(previous)
            # Steps the previous optimizer applied outside fit were never
            # recorded: they join the ledger as unaccounted steps.
            ledger.append(LedgerEntry.steps_only(max(0, previous.unrecorded_steps), UNACCOUNTED))
            write_ledger(self, ledger)
            self.carried_steps.assign(carried)
            self._carried_from = previous.logical_steps_applied
        self._claim(variables)

    def check_ledger_covers(self, variables) -> None:
        """Checks, before a private step, that this optimizer's ledger covers `variables`.

        Args:
            variables: the model's trainable variables.

        Raises:
            PrivacyConfigurationError: another DPOptimizer trained them
                after this one (for example the model was compiled with a
                new DPOptimizer, trained, and compiled again with this one),
                so this ledger misses its steps.
        """
        owner = ledger_owner(variables)
        if owner is not None and owner is not self and owner._has_history() and (
            owner.logical_steps_applied != self.logical_steps_applied
            or read_ledger(owner) != read_ledger(self)
        ):
            raise PrivacyConfigurationError(
                f"This model's weights were trained further by another DPOptimizer "
                f"({owner.logical_steps_applied} logical steps in all, this optimizer "
                f"records {self.logical_steps_applied}): its ledger misses those steps. "
                "Compile with a fresh DPOptimizer (it takes the ledger of the weights "
                "over), or restore the run with keras.models.load_model or "
                "tf_megadp.restore_training_state."
            )
        self._claim(variables)

    def _record_applied_step(self, noise_multiplier, accumulation_steps, divisor,
                             count_noise_multiplier, new_segment):
        """Appends the step just applied to `applied_steps`, as the graph used it.

        Consecutive identical steps share a row, except a step that opened a
        noise segment (`new_segment`), which starts one. A full buffer stops
        recording and sets the row count past capacity, which the ledger
        keeper refuses (it drains the buffer after every batch, so only
        `steps_per_execution` far above the capacity can fill it).
        """
        state = self._in_memory
        row = tf.stack([
            tf.constant(1.0, tf.float64),
            tf.cast(noise_multiplier, tf.float64),
            tf.cast(accumulation_steps, tf.float64),
            tf.cast(state.step_rows.value, tf.float64),
            tf.cast(divisor, tf.float64),
            tf.cast(count_noise_multiplier, tf.float64),
            tf.cast(new_segment, tf.float64),
        ])
        state.step_rows.assign(0)
        count = self.applied_rows.value
        table = self.applied_steps.value
        last = tf.maximum(count - 1, 0)
        same = tf.logical_and(
            tf.logical_and(count > 0, tf.logical_not(new_segment)),
            tf.logical_and(count <= _APPLIED_CAPACITY,
                           tf.reduce_all(tf.gather(table, last)[1:] == row[1:])),
        )

        def merge():
            return tf.tensor_scatter_nd_add(table, [[last, 0]], [1.0]), count

        def append():
            index = tf.minimum(count, _APPLIED_CAPACITY - 1)
            updated = tf.tensor_scatter_nd_update(table, [[index]], [row])
            full = count >= _APPLIED_CAPACITY
            return tf.where(full, table, updated), count + 1

        table, count = tf.cond(same, merge, append)
        self.applied_steps.assign(table)
        self.applied_rows.assign(count)
