"""The ledger stage: the `DPOptimizer` variables that hold the privacy spent, declared, read and written here only.

Every variable of the ledger is declared, read and written in this module
(`LedgerStage`, the last stage of a `DPOptimizer`'s logical step):

* `privacy_ledger` and `privacy_ledger_length`: the `PrivacyLedger` of
  every noisy update the weights received, as the JSON of its entries
  (`PrivacyLedger.to_json`, the same form as a report's), packed 6 bytes to
  a float64 cell (`read_ledger`, `write_ledger`). The format is the same
  whatever the noise mechanism: each entry's noise is one record its
  mechanism reads back. A file whose ledger is malformed or holds a
  record no registered mechanism reads is refused by name;
* `weights_origin` and `weights_origin_length`: where the weights of the
  run's start came from, as `tf_megadp.run.weights_origin` found or the
  user declared it (a release composed, public weights, data disjoint from
  DP runs whose values the model keeps), JSON packed as the ledger is
  (`read_weights_origin`, `write_weights_origin`): a declaration is part
  of the run and is restored with its ledger;
* `carried_steps`: the logical steps earlier optimizers of the same weights
  applied (a model compiled again with a new `DPOptimizer` continues the
  ledger of the weights: the model's variables name the optimizer whose
  ledger covers their value, `ledger_owner`);
* `applied_steps` and `applied_rows`: the buffer where the compiled step
  appends each noisy update as it applied it (`APPLIED_STEP_COLUMNS`), which
  the run's ledger recorder drains (`take_applied_steps`) and turns into
  ledger entries, adding N, the sampling and the noise record.

Outside this module, only the run's ledger recorder
(`tf_megadp.run.ledger_recorder`) writes the ledger, through the functions
and methods here.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from tf_megadp.accounting import LedgerEntry, PrivacyLedger
from tf_megadp.accounting.events import UNACCOUNTED
from tf_megadp.errors import PrivacyConfigurationError

__all__ = ["APPLIED_STEP_COLUMNS", "LEDGER_CAPACITY", "LedgerStage", "ledger_owner",
           "read_ledger", "read_weights_origin", "write_ledger", "write_weights_origin"]

# Bytes of ledger JSON the variable holds (about 300 bytes an entry, and
# consecutive identical steps share an entry).
LEDGER_CAPACITY = 96 * 1024
# Bytes per float64 cell: a 48-bit integer is exact in a float64.
_BYTES_PER_CELL = 6
_CELLS = -(-LEDGER_CAPACITY // _BYTES_PER_CELL)
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

    def __init__(self, optimizer):
        self.optimizer = optimizer


def ledger_owner(variables):
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


def claim(optimizer, variables) -> None:
    """Marks `variables` as covered by `optimizer`'s ledger."""
    holder = _LedgerOwner(optimizer)
    for variable in variables:
        setattr(variable, _LEDGER_OWNER, holder)


def read_ledger(optimizer) -> PrivacyLedger:
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
    stage = getattr(optimizer, "ledger_stage", None)
    if not isinstance(stage, LedgerStage):
        raise TypeError(
            f"read_ledger reads a tf_megadp.DPOptimizer's ledger; got {optimizer!r}, "
            "which keeps none."
        )
    return stage.read() if optimizer.built else PrivacyLedger()


def write_ledger(optimizer, ledger: PrivacyLedger) -> None:
    """Stores `ledger` in a built `DPOptimizer`'s `privacy_ledger` variable.

    Raises:
        RuntimeError: the ledger is longer than the variable holds.
    """
    optimizer.ledger_stage.write(ledger)


def read_weights_origin(optimizer) -> dict[str, Any] | None:
    """Where a built `DPOptimizer`'s run recorded its weights came from, or None.

    (`write_weights_origin` stores it.)
    """
    return optimizer.ledger_stage.read_origin() if optimizer.built else None


def write_weights_origin(optimizer, origin: dict[str, Any]) -> None:
    """Stores where the weights of the run's start came from (JSON) in a built `DPOptimizer`.

    Raises:
        RuntimeError: its JSON is longer than `LEDGER_CAPACITY` bytes.
    """
    optimizer.ledger_stage.write_origin(origin)


def _number(variable) -> int:
    return int(keras.ops.convert_to_numpy(variable))


def _packed(text: str, what: str = "The privacy ledger", fix: str = (
        "the sampling rate or noise multiplier changed too often. Change them per phase of "
        "a BatchSizeSchedule instead of per step")) -> tuple[np.ndarray, int]:
    """(float64 cells holding the UTF-8 bytes of `text`, 6 to a cell, zero-padded; its length)."""
    data = text.encode("utf-8")
    if len(data) > LEDGER_CAPACITY:
        raise RuntimeError(
            f"{what} needs {len(data)} bytes but the optimizer stores {LEDGER_CAPACITY}: "
            f"{fix}.")
    # Only the cells the text fills are computed (it is written after every
    # logical step; the rest of the 96 KiB stays zero).
    used = -(-len(data) // _BYTES_PER_CELL)
    padded = data + bytes(used * _BYTES_PER_CELL - len(data))
    cells = np.frombuffer(padded, np.uint8).reshape(used, _BYTES_PER_CELL).astype(np.uint64)
    weights = (np.uint64(256) ** np.arange(_BYTES_PER_CELL - 1, -1, -1, dtype=np.uint64))
    packed = np.zeros(_CELLS, np.float64)
    packed[:used] = (cells * weights).sum(axis=1)
    return packed, len(data)


def _unpacked(cells: np.ndarray, length: int) -> str:
    """The text `_packed` stored: the first `length` bytes of the cells.

    Raises:
        ValueError: cells that hold no 6-byte integers, a length past them,
            or bytes that are not UTF-8.
    """
    cells = np.asarray(cells, np.float64).reshape(-1)
    if not (0 <= length <= cells.size * _BYTES_PER_CELL):
        raise ValueError(f"its length {length} is outside its {cells.size} cells")
    if not np.all((cells >= 0) & (cells < 2.0 ** (8 * _BYTES_PER_CELL))
                  & (cells == np.floor(cells))):
        raise ValueError("its cells are not 6-byte integers")
    values = cells.astype(np.uint64)
    shifts = np.uint64(8) * np.arange(_BYTES_PER_CELL - 1, -1, -1, dtype=np.uint64)
    data = ((values[:, None] >> shifts) & np.uint64(255)).astype(np.uint8).tobytes()
    return data[:length].decode("utf-8")


class LedgerStage:
    """The privacy ledger of the weights a `DPOptimizer` trains, and the steps its graph applied.

    Its variables are the optimizer's own (made by its `add_variable`, so
    saved with every file of the optimizer); `build` declares them.
    """

    def __init__(self):
        self._carried_from: int | None = None  # See `take_carried_over_steps`.

    def __repr__(self) -> str:
        return "<DPOptimizer ledger stage>"

    def build(self, add_variable: Callable[..., Any], iterations) -> None:
        """Declares the ledger's variables (saved with every file of the optimizer).

        Args:
            add_variable: the optimizer's `add_variable`. The order of the
                calls is the variables' position in Keras's saved files.
            iterations: the optimizer's count of logical steps applied.
        """
        self._iterations = iterations
        self.privacy_ledger = add_variable(shape=(_CELLS,), dtype="float64",
                                           name="privacy_ledger")
        self.privacy_ledger_length = add_variable(shape=(), dtype="int64",
                                                  name="privacy_ledger_length")
        # Ledger steps taken by earlier optimizers of the same model.
        self.carried_steps = add_variable(shape=(), dtype="int64", name="carried_steps")
        self.applied_steps = add_variable(
            shape=(_APPLIED_CAPACITY, len(APPLIED_STEP_COLUMNS)), dtype="float64",
            aggregation="only_first_replica", name="applied_steps")
        self.applied_rows = add_variable(
            shape=(), dtype="int64", aggregation="only_first_replica", name="applied_rows")
        self.weights_origin = add_variable(shape=(_CELLS,), dtype="float64",
                                           name="weights_origin")
        self.weights_origin_length = add_variable(shape=(), dtype="int64",
                                                  name="weights_origin_length")

    # -- The ledger (eager) -------------------------------------------------------

    def read(self) -> PrivacyLedger:
        """The stored ledger.

        Raises:
            PrivacyConfigurationError: the variable holds no ledger this
                tf_megadp reads (malformed, or a noise record of a mechanism
                it does not know), named.
        """
        try:
            text = _unpacked(keras.ops.convert_to_numpy(self.privacy_ledger),
                             _number(self.privacy_ledger_length))
            return PrivacyLedger.from_json(text) if text else PrivacyLedger()
        except ValueError as error:
            raise PrivacyConfigurationError(
                f"The optimizer's privacy_ledger variable holds no ledger tf_megadp can "
                f"account: {error}. The file was not written by this tf_megadp with these "
                "settings, or was changed; its ledger cannot be loaded, so neither can the "
                "state. Start a new run, or restore a file this version wrote.") from None

    def write(self, ledger: PrivacyLedger) -> None:
        """Stores `ledger` (its JSON, packed).

        Raises:
            RuntimeError: its JSON is longer than `LEDGER_CAPACITY` bytes.
        """
        cells, length = _packed(ledger.to_json() if len(ledger) else "")
        self.privacy_ledger.assign(cells)
        self.privacy_ledger_length.assign(length)

    def read_origin(self) -> dict[str, Any] | None:
        """The stored start of the weights (`write_origin`), or None.

        Raises:
            PrivacyConfigurationError: the variable holds no JSON object.
        """
        try:
            text = _unpacked(keras.ops.convert_to_numpy(self.weights_origin),
                             _number(self.weights_origin_length))
            origin = json.loads(text) if text else None
            if origin is not None and not isinstance(origin, dict):
                raise ValueError("it is no JSON object")
            return origin
        except ValueError as error:
            raise PrivacyConfigurationError(
                f"The optimizer's weights_origin variable holds no record tf_megadp reads: "
                f"{error}. The file was not written by this tf_megadp, or was changed. Start "
                "a new run, or restore a file this version wrote.") from None

    def write_origin(self, origin: dict[str, Any]) -> None:
        """Stores the start of the weights (JSON, packed)."""
        cells, length = _packed(
            json.dumps(origin, sort_keys=True), "Where the weights come from",
            "shorten the statement of declare_disjoint_data or declare_public_weights")
        self.weights_origin.assign(cells)
        self.weights_origin_length.assign(length)

    @property
    def steps_carried(self) -> int:
        """Logical steps that earlier optimizers of the same weights applied (in the ledger)."""
        return _number(self.carried_steps)

    @property
    def steps_applied(self) -> int:
        """Noisy updates these weights received: this optimizer's and those it took over."""
        return _number(self.carried_steps) + _number(self._iterations)

    @property
    def steps_recorded(self) -> int:
        """Logical steps in the ledger, of every kind (noiseless and unaccounted ones too)."""
        return self.read().total_steps

    def has_history(self) -> bool:
        return self.steps_applied > 0 or self.steps_recorded > 0

    def start(self, ledger: PrivacyLedger) -> None:
        """Makes `ledger` the start of this one, as steps applied by another optimizer (a release's)."""
        self.write(ledger)
        self.carried_steps.assign(ledger.total_steps)

    def take_over(self, previous: "LedgerStage", *, continues_iterations: bool,
                  unrecorded_steps: int) -> None:
        """Continues `previous`'s ledger: its entries, and the count of steps it applied.

        Args:
            previous: the ledger stage of the optimizer that trained the weights.
            continues_iterations: whether this optimizer's step count
                continues `previous`'s (it wraps the same inner optimizer).
            unrecorded_steps: steps `previous` applied outside fit, which
                join the ledger as unaccounted steps.
        """
        carried = previous.steps_carried if continues_iterations else previous.steps_applied
        ledger = previous.read()
        ledger.append(LedgerEntry.steps_only(max(0, unrecorded_steps), UNACCOUNTED))
        self.write(ledger)
        origin = previous.read_origin()
        if origin is not None:
            self.write_origin(origin)
        self.carried_steps.assign(carried)
        self._carried_from = previous.steps_applied

    def take_carried_over_steps(self) -> int | None:
        """The steps taken over from another optimizer when built, reported once (else None)."""
        carried, self._carried_from = self._carried_from, None
        return carried

    def forget_carried_over_steps(self) -> None:
        """A loaded ledger replaces whatever was taken over: nothing is reported."""
        self._carried_from = None

    # -- The steps the graph applied ------------------------------------------------

    @property
    def pending_applied_steps(self) -> int:
        """Logical steps the compiled step applied that no one has taken from its buffer yet."""
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
        count = _number(self.applied_rows)
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

    def record_applied_step(self, noise_multiplier, accumulation_steps, rows, divisor,
                            count_noise_multiplier, new_segment) -> None:
        """Appends the step just applied to `applied_steps`, as the graph used it (graph).

        Consecutive identical steps share a row, except a step that opened a
        noise segment (`new_segment`), which starts one. A full buffer stops
        recording and sets the row count past capacity, which the ledger
        keeper refuses (it drains the buffer after every batch, so only
        `steps_per_execution` far above the capacity can fill it).
        """
        row = tf.stack([
            tf.constant(1.0, tf.float64),
            tf.cast(noise_multiplier, tf.float64),
            tf.cast(accumulation_steps, tf.float64),
            tf.cast(rows, tf.float64),
            tf.cast(divisor, tf.float64),
            tf.cast(count_noise_multiplier, tf.float64),
            tf.cast(new_segment, tf.float64),
        ])
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
