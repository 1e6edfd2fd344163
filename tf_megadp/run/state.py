"""What a DP run keeps on its model: whether it is private, its ledger, and its run notes."""

from __future__ import annotations

import hashlib
import warnings

import keras
import numpy as np
import tensorflow as tf

from tf_megadp.accounting import PrivacyLedger
from tf_megadp.accounting.events import refusal_error
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.optimizer import DPOptimizer, ledger_owner, read_ledger

__all__ = ["EVALUATION_METRICS", "RELEASED_OUTSIDE_EPSILON", "STALE_STEP_MARKER",
           "advance_generation", "current_generation", "dp_optimizer", "is_private",
           "ledger_optimizer", "mark_private",
           "model_ledger", "run_notes", "stale_step_error", "weights_digest"]

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
        The complete ledger, of every step applied. Steps without noise are
        in it as ``"noiseless"`` entries: they make epsilon infinite, which
        `PrivacyCallback` and `PrivacyReport` state and a
        `PrivacyAccountant` refuses to compute.

    Raises:
        PrivacyConfigurationError: steps were applied outside `fit` (with
            `train_on_batch` or a loop calling `train_step`) and are in no
            ledger, or the ledger holds steps that no epsilon may leave out
            (``"unaccounted"``: taken on data of unknown size without a
            stated N, or whose data the recorder could not know).

    Example:
    ```python
    model = keras.models.load_model("run.keras")
    tf_megadp.PrivacyAccountant(N, 1e-5, ledger=tf_megadp.model_ledger(model)).epsilon()
    ```
    """
    optimizer = ledger_optimizer(model)
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
    ledger = read_ledger(optimizer)
    refused = ledger.unreportable_steps()
    if refused is not None:
        raise refusal_error(*refused)
    return ledger


def ledger_optimizer(model) -> DPOptimizer:
    """The DPOptimizer whose ledger covers `model`'s weights (`model.optimizer` but after a recompile)."""
    return ledger_owner(model.trainable_variables) or dp_optimizer(model)


def dp_optimizer(model) -> DPOptimizer:
    """`model.optimizer`, which must be a `DPOptimizer`.

    Raises:
        PrivacyConfigurationError: the model is not compiled with one.
    """
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, DPOptimizer):
        wrapped = isinstance(getattr(optimizer, "inner_optimizer", None), DPOptimizer)
        raise PrivacyConfigurationError(
            "Private training needs a model compiled with tf_megadp.DPOptimizer "
            f"(and made private with tf_megadp.make_private); got {optimizer!r}."
            + (" Keras wrapped the DPOptimizer in a LossScaleOptimizer (the "
               "'mixed_float16' policy): tf_megadp.make_private(model) replaces it by "
               "the DPOptimizer's fixed loss scale (DPOptimizer(..., loss_scale=...))."
               if wrapped else "")
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


# The first words of the in-graph assertion of `current_generation`, so that
# an InvalidArgumentError raised by it can be recognised (`stale_step_error`).
STALE_STEP_MARKER = "tf_megadp: a traced private step outlived its optimizer"
# No apostrophes: TensorFlow escapes them in an assertion's message.
_STALE_STEP_FIX = (
    " (the model was compiled again, made private again, extended or given a new "
    "PrivateStep, or the step begun with data of another kind, since this step was "
    "traced, so what it checks is no longer what the model reports; the "
    "micro-batch was not added to any sum). "
    "Trace the step again after every compile: call tf.function(step.run) anew on "
    "the current PrivateStep of the model (build one with tf_megadp.PrivateStep(model) "
    "after compile), or let fit trace its own train function."
)


class _Generation:
    """A private model's training generation: it grows whenever what a traced step captured changes.

    A traced step holds the optimizer, the step and the schedule it was traced
    with as graph captures and constants; the checks that refuse a stale
    optimizer run in Python, at trace time. The generation is what the graph
    can still compare at run time: the value a step was traced at, against
    the variable that `advance_generation` moves. A plain holder (not
    trackable), so that no file saves the variable and no restore brings an
    old generation back.
    """

    def __init__(self, model: keras.Model):
        self.count = 0
        with tf.init_scope(), model.distribute_strategy.scope():
            self.variable = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="tf_megadp_generation",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


def _generation(model: keras.Model) -> _Generation:
    generation = getattr(model, "_tf_megadp_generation", None)
    if generation is None:
        generation = _Generation(model)
        model._tf_megadp_generation = generation
    return generation


def advance_generation(model: keras.Model) -> None:
    """Makes every private step traced before now refuse to run (see `current_generation`).

    Called by `make_private`, a private model's `compile`, `extend_schedule`,
    every new `PrivateStep` and a `PrivateStep.begin` that switches between
    a sampler's tagged data and other data: each changes what a traced step
    captured.
    """
    generation = _generation(model)
    generation.count += 1
    with tf.init_scope():
        generation.variable.assign(generation.count)


def current_generation(model: keras.Model) -> tf.Tensor:
    """In a traced step: whether the model is still in the generation it was traced in.

    The generation at trace time is a constant of the graph and the current
    one is read from a variable when the step runs, so a step traced before
    a compile, a new `PrivateStep` or `make_private` refuses at run time: an
    assertion raises InvalidArgumentError (marked `STALE_STEP_MARKER`, with
    the fix), and where XLA drops assertions the caller zeroes the
    micro-batch with the returned flag.

    Returns:
        A bool scalar, True when the step may train.
    """
    generation = _generation(model)
    current = tf.equal(generation.variable.read_value(), generation.count)
    check = tf.debugging.Assert(current, [STALE_STEP_MARKER + _STALE_STEP_FIX])
    with tf.control_dependencies([check]):
        return tf.identity(current)


def stale_step_error(error: Exception) -> PrivacyConfigurationError | None:
    """The named error behind an InvalidArgumentError of `current_generation`'s assertion.

    Returns None for any other error.
    """
    if STALE_STEP_MARKER not in str(error):
        return None
    return PrivacyConfigurationError(STALE_STEP_MARKER + _STALE_STEP_FIX)
