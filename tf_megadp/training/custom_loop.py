"""Custom training loops: the private step and its privacy report, without `fit`.

Many TensorFlow programs, and most TPU pretraining scripts, do not call
`model.fit`: they write a `tf.function` around `strategy.run(step, ...)`.
`PrivateStep` is that step for a private model, and `PrivacyReport` is what
`PrivacyCallback` gives a `fit`, for a loop without callbacks:

* `PrivateStep` runs the private `fit`'s own step
  (`tf_megadp.training.step.private_step`: every example clipped, the clipped
  sum accumulated into the `DPOptimizer`, noise once per logical step) and
  keeps the privacy ledger with the private `fit`'s `LedgerRecorder` (N and
  the sampling from what feeds the loop, with the same checks).
* `PrivacyReport` reads that ledger with `PrivacyCallback`'s code: epsilon,
  the publishable report, the budget.

What the compiled step runs is checked when it runs, not only when it is
traced: a step traced before the model was compiled again (or given a new
`PrivateStep`, made private again, its schedule extended) refuses
(`tf_megadp.run.state.current_generation`), and a step begun with a sampler
admits only the micro-batches of that sampler's tagged dataset, each at its
place in the run (`tf_megadp.data.tags`). A refused micro-batch adds nothing
to any sum, also where XLA drops the assertion.

The steps the compiled step applies enter the ledger when `record` runs (a
Python call between two calls of the loop's `tf.function`; `PrivacyReport`,
the step's `checkpoint` and the save helpers call it). Until then a report
refuses to count them. The noise key and the un-noised sums stay in the
`DPOptimizer`'s memory: `PrivateStep.checkpoint()` (a `tf.train.Checkpoint`),
`model.save` and `tf_megadp.save_training_state` never hold them.

Example:
```python
with strategy.scope():
    model = build_model()
    step = tf_megadp.PrivateStep(model, tf_megadp.DPOptimizer(
        keras.optimizers.Adam(1e-3), l2_norm_clip=1.0, noise_multiplier=1.1,
        schedule=sampler.schedule), loss="sparse_categorical_crossentropy")
step.begin(sampler)
privacy = tf_megadp.PrivacyReport(step, delta=1e-5, target_epsilon=3.0)
data = tf_megadp.distribute.distribute_micro_batches(
    strategy, lambda _: sampler.as_dataset(tagged=True))

@tf.function
def train(iterator):
    return step.run(next(iterator))

iterator = iter(data)
for _ in range(sampler.total_micro_steps):
    logs = train(iterator)
    if logs["applied"] and not privacy.within_budget():
        break
print(privacy.epsilon, privacy.report())
```
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_megadp import _keras_compat
from tf_megadp.clipping import independence
from tf_megadp.data import sources, tags
from tf_megadp.data.fit_inputs import distinct_real_examples, is_array_input
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.optimizer import DPOptimizer, read_ledger
from tf_megadp.run.ledger_recorder import LedgerRecorder
from tf_megadp.run.state import advance_generation, current_generation, is_private
from tf_megadp.training.make_private import make_private
from tf_megadp.training.step import private_step

__all__ = ["PrivateStep"]

_UNTAGGED_MESSAGE = (
    # No apostrophes: TensorFlow escapes them in an assertion's message.
    "tf_megadp: a micro-batch is not the next one of the sampler this step was "
    "begun with, as the sampler produced it (its rows changed since they were "
    "tagged, or its tags are missing, forged, replayed or out of order); it was "
    "added to no sum. Feed the dataset of the sampler given to step.begin(), "
    "sampler.as_dataset(map_fn, tagged=True), in order and each element once, "
    "and do per-micro-batch processing in its map_fn (which the sampler checks "
    "for mixing before it tags the rows), not in a map of the tagged dataset.")

# Logs that are the same on every replica: `run` takes replica 0's value.
_GLOBAL_LOGS = ("logical_step", "applied", "nonfinite_examples")


class PrivateStep:
    """The DP training step for custom loops: one call per micro-batch, in your `tf.function`.

    It is the private `fit`'s step, shared code and all: each example's loss
    (the compiled `loss` on that example alone) is differentiated and its
    gradient clipped to norm C, the clipped sum of the micro-batch is added
    to the `DPOptimizer`'s accumulators, and after the last micro-batch of a
    logical step the optimizer adds Gaussian noise once and applies the
    update. Under a `tf.distribute` strategy (Mirrored, multi-worker, TPU)
    each replica clips its own micro-batch, exactly as in `fit`.

    Use it in three moves:

    1. Build it (inside `strategy.scope()`), restore a checkpoint if you
       resume (`step.checkpoint()`), then `begin(data)` with what feeds the
       loop: a tf_megadp sampler (or its dataset, plain or distributed), so
       that N and the sampling are measured and the sampler's schedule and
       start step are checked against the optimizer, as `fit` does; or
       data no sampler drew, with its size `num_examples` and the micro-steps
       of one pass `micro_batches_per_pass`.
    2. Call it once per micro-batch: `strategy.run(step, args=(batch,))`
       returns each replica's logs, or `step.run(batch)` runs it on every
       replica and reduces them (inside your `tf.function`).
    3. Call `record()` now and then between calls of your `tf.function` (a
       `PrivacyReport`, `checkpoint()` and the save helpers call it for
       you): it moves the logical steps the step applied into the privacy
       ledger, and refuses (raising `PrivacyConfigurationError`, and leaving
       those steps out of every epsilon) when something else trained the
       model in between, a logical step spanned two passes, or the model
       mixed examples.

    Everything the private `fit` refuses is refused here: layers that mix
    examples, a model compiled with another optimizer, a `DPOptimizer`
    whose settings change, aggregated gradients (`apply_gradients` on a
    `DPOptimizer` raises), a `DPOptimizer` whose weights another one
    trained further.

    Args:
        model: a built Keras model (call it once on a batch first). It is
            made private (`tf_megadp.make_private`) if it is not.
        optimizer: the `DPOptimizer`; the model is compiled with it, `loss`
            and `compile_kwargs`. None: the model is already compiled with
            a `DPOptimizer` (e.g. by `tf_megadp.restore_training_state`).
        loss: the loss of one example: a Keras loss (name, instance, or
            function of `(y_true, y_pred)` with the default reduction),
            evaluated on each example alone.
        require_poisson_sampling: refuse data that no tf_megadp Poisson
            sampler drew; None keeps `make_private`'s setting.
        **compile_kwargs: passed to `model.compile` (e.g. `weighted_metrics`).

    Returns (per call, each replica): the logs `fit` shows, `loss` (the mean
    loss of the real examples) and the compiled metrics, running since the
    last `model.reset_metrics()`; and `logical_step` (int64, logical steps
    applied so far) and `applied` (bool: this micro-batch ended a logical
    step and the noisy update was applied).

    Raises:
        PrivacyConfigurationError: the model mixes examples, or is not
            compiled with a `DPOptimizer`.
        ValueError: the model is not built.

    Example:
    ```python
    step = tf_megadp.PrivateStep(model, tf_megadp.DPOptimizer(
        keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=1.1,
        schedule=sampler.schedule), loss="mse")
    step.begin(sampler)
    train = tf.function(step.run)
    for batch in sampler.as_dataset(tagged=True):   # (micro-batch, its tag)
        logs = train(batch)
    step.record()
    ```
    """

    def __init__(
        self,
        model: keras.Model,
        optimizer: DPOptimizer | None = None,
        loss: Any = None,
        *,
        require_poisson_sampling: bool | None = None,
        **compile_kwargs,
    ):
        if not isinstance(model, keras.Model):
            raise TypeError(f"PrivateStep expects a keras.Model, got {type(model).__name__}.")
        if optimizer is None and (loss is not None or compile_kwargs):
            raise ValueError(
                "PrivateStep compiles the model only together with its optimizer: pass "
                "optimizer=tf_megadp.DPOptimizer(...) with loss=..., or compile the "
                "model yourself and pass neither.")
        previous = getattr(model, "_tf_megadp_step", None)
        if previous is not None and previous.recorder is not None and (
                model.optimizer is previous.optimizer and not previous._state_replaced()):
            previous.record()  # Its steps are its data's: record them before a new step.
        strategy = model.distribute_strategy
        with strategy.scope():
            if not is_private(model):
                make_private(model)
            if optimizer is not None:
                model.compile(optimizer=optimizer, loss=loss, **compile_kwargs)
        optimizer = getattr(model, "optimizer", None)
        if not isinstance(optimizer, DPOptimizer):
            raise PrivacyConfigurationError(
                f"PrivateStep trains with a tf_megadp.DPOptimizer; the model is compiled "
                f"with {optimizer!r}, which adds no noise. Pass "
                "optimizer=tf_megadp.DPOptimizer(...)."
            )
        if not model.built or not model.trainable_variables:
            raise ValueError(
                "PrivateStep needs a built model with trainable weights: call the model "
                "once on a batch of the right shapes (or model.build(...)) first."
            )
        self.model = model
        self.optimizer = optimizer
        self.recorder: LedgerRecorder | None = None
        self._require_poisson = require_poisson_sampling
        with strategy.scope():
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            # Each replica counts its own calls (all count the same); never saved.
            self._calls = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="private_step_calls",
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            self._mixing = tf.Variable(
                independence.MIXING_OK, dtype=tf.int32, trainable=False,
                name="private_step_mixing",
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            # The begun sampler's tag key (tf_megadp.data.tags): in memory
            # only, as the step is not trackable.
            self._tag_key = tf.Variable(
                [0, 0], dtype=tf.int64, trainable=False, name="private_step_tag_key",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            # Micro-batches refused (not added to any sum) since the last
            # record, summed over this worker's replicas: where XLA drops the
            # assertions, record() raises instead.
            self._refused = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="private_step_refused",
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM)
        self._tagged = False
        self._micro_batches_per_pass: int | None = None
        self._synced_calls = self._synced_micro = self._synced_applied = self._pass_origin = 0
        # The model's current step: the save helpers record its steps first,
        # and an older step refuses to run, also where it was traced before.
        model._tf_megadp_step = self
        advance_generation(model)

    # -- Before the first step ---------------------------------------------------

    def begin(
        self,
        data=None,
        *,
        num_examples: int | None = None,
        micro_batches_per_pass: int | None = None,
    ) -> None:
        """Checks what feeds the loop against the optimizer, and starts its ledger.

        Call it before the first step, and again whenever the loop's data
        changes (a new sampler, a restored checkpoint). It finishes the
        ledger of the data before, discards a partial logical step (its
        micro-batches were never released, so they cost no privacy), and
        checks, as the private `fit` does, that the optimizer's ledger
        covers the model and is complete, that a sampler's schedule is the
        optimizer's and starts at its logical step, and that N agrees with
        a stated one.

        Args:
            data: a tf_megadp sampler, or the tagged dataset it returned
                (`as_dataset(..., tagged=True)`, plain or split by
                `tf_megadp.distribute.distribute_micro_batches`); the loop
                then feeds that tagged dataset, whose tags the step checks.
                Or arrays (N is their length); None for data of unknown
                size (then state `num_examples`).
            num_examples: N, only for data whose size cannot be measured
                (the report says it was stated).
            micro_batches_per_pass: for data that no sampler drew: the calls
                of the step that make one pass over the data. A logical step
                that spans two passes could hold an example twice: `record`
                refuses it; call `end_pass()` at the end of every pass when
                passes are not whole logical steps.

        Raises:
            PrivacyConfigurationError: the data does not match the optimizer
                (schedule, start step, N), `require_poisson_sampling` refuses
                it, its passes or N are not stated, or it is a sampler's
                whose tags the step cannot check (an untagged dataset, a
                `DataSource` alone).
        """
        source = self._source_of(data)
        sampled = source is not None and source.schedule is not None
        if sampled and micro_batches_per_pass is not None:
            raise ValueError(
                "A sampler draws every logical step whole, so its data has no passes "
                "to state: drop micro_batches_per_pass.")
        if not sampled:
            if (isinstance(micro_batches_per_pass, bool)
                    or not isinstance(micro_batches_per_pass, int) or micro_batches_per_pass < 1):
                raise PrivacyConfigurationError(
                    "Data that no tf_megadp sampler drew comes in passes, and a logical "
                    "step that spans two of them could hold an example twice. State "
                    "micro_batches_per_pass=P (the calls of the step in one pass) so that "
                    "record() refuses such a step, or feed a sampler, which draws every "
                    "step whole (tf_megadp.PoissonSampler.from_arrays(x, y, ...)); got "
                    f"micro_batches_per_pass={micro_batches_per_pass!r}."
                )
        if source is None and num_examples is None:
            raise PrivacyConfigurationError(
                "The size of this data cannot be measured (no tf_megadp sampler returned "
                "it): state it with begin(data, num_examples=N, ...), and the report will "
                "say N was stated; or feed a sampler's dataset."
            )
        tag_key = self._tag_key_of(data) if sampled else None
        if self.recorder is not None and not self._state_replaced():
            self.record()
        require_poisson = (self.model._tf_megadp_require_poisson
                           if self._require_poisson is None else self._require_poisson)
        recorder = LedgerRecorder(source, num_examples, model=self.model,
                                  require_poisson_sampling=require_poisson)
        with self.model.distribute_strategy.scope():
            recorder.begin()
        # As at the start of every fit: the first step checks independence
        # again, forward and backward (mixing that depends on the data shows
        # on new data).
        reset = getattr(self.optimizer.clipping_strategy, "reset_checks", None)
        if reset is not None:
            reset(self.model)
        if self._tagged != (tag_key is not None):
            # A step traced for untagged data checks no tag: it must not
            # run on a sampler's account (nor a tagged trace on other data).
            advance_generation(self.model)
        self._tagged = tag_key is not None
        self._tag_key.assign(tag_key.value if self._tagged else [0, 0])
        self._refused.assign(0)
        self._build_compiled_metrics(data)
        self.recorder = recorder
        self._micro_batches_per_pass = None if sampled else micro_batches_per_pass
        self._sync(micro_steps=0)
        self._pass_origin = self._synced_calls

    @staticmethod
    def _tag_key_of(data):
        """The tag key of a sampler (or of its tagged dataset), which the step checks."""
        key = getattr(data, "tag_key", None) or tags.tag_key_of(data)
        if key is None:
            raise PrivacyConfigurationError(
                "A sampler's N and sampling rate are accounted only for micro-batches "
                "the step can tell are the sampler's: begin with the sampler itself "
                "(step.begin(sampler)) or with its tagged dataset, and feed "
                "sampler.as_dataset(..., tagged=True) (plain, or through "
                "tf_megadp.distribute.distribute_micro_batches), whose every "
                "micro-batch carries its secret tag.")
        return key

    def _source_of(self, data) -> sources.DataSource | None:
        if data is None or isinstance(data, sources.DataSource):
            return data
        sampler_source = getattr(data, "source", None)  # A tf_megadp sampler.
        if isinstance(sampler_source, sources.DataSource):
            return sampler_source
        source = sources.source_of(data)
        if source is None and is_array_input(data):
            rows = int(tf.nest.flatten(data)[0].shape[0])
            x, y, sample_weight = (keras.utils.unpack_x_y_sample_weight(data)
                                   if isinstance(data, tuple) else (data, None, None))
            # As fit counts arrays: padding rows and copies are not examples.
            examples = distinct_real_examples(x, y, sample_weight, rows)
            source = sources.DataSource(
                sampling=sources.FIXED_SIZE_SAMPLING, num_examples=examples,
                num_examples_measured=True,
                description=f"arrays given to PrivateStep.begin: {examples} distinct "
                            f"examples with a non-zero weight in {rows} rows, in "
                            "fixed-size batches")
        return source

    def _build_compiled_metrics(self, data) -> None:
        """Builds the compiled loss and metrics from the data's shapes, before any trace.

        Keras creates their variables on first use, which under a strategy
        would be inside `strategy.run`, where TensorFlow forbids it; `fit`
        builds them beforehand in the same way.
        """
        model = self.model
        if _keras_compat.model_strategy(model) is None:
            return  # Without a strategy they are built when the step is traced.
        compiled_loss, compiled_metrics = _keras_compat.compiled_loss_and_metrics(model)
        unbuilt = [part for part in (compiled_metrics, compiled_loss)
                   if part is not None and not part.built]
        if not unbuilt:
            return
        spec = _per_replica_spec(data, model.distribute_strategy)
        if spec is not None and self._tagged:
            spec = spec[0]  # (batch, tag): the model sees the batch.
        if spec is None and compiled_metrics is None:
            return  # A loss alone is built in the trace without variables.
        if spec is None:
            raise ValueError(
                "The model's compiled metrics are built from the shapes of the data: pass "
                "the dataset the loop reads (a sampler's, plain or distributed) to "
                "begin(), or compile without metrics.")
        with model.distribute_strategy.scope():
            _keras_compat.symbolic_build(model, spec)

    # -- The step ------------------------------------------------------------------

    def __call__(self, data) -> dict[str, tf.Tensor]:
        """One micro-batch on this replica: call it inside `strategy.run` (or use `run`).

        Args:
            data: this replica's micro-batch, `(x, y)` or `(x, y,
                sample_weight)`; examples of sample weight 0 are padding.

        Returns:
            This replica's logs (see the class docstring).
        """
        self._check_current()
        admitted = current_generation(self.model)
        if self._tagged:
            data, tag = _split_tag(data)
            admitted = tf.logical_and(admitted, self._tag_admitted(data, tag))
        outcome = private_step(
            self.model, data,
            log_nonfinite_examples=getattr(self.model, "_tf_megadp_log_nonfinite", False),
            admitted=admitted)
        self._refused.assign_add(tf.cast(tf.logical_not(admitted), tf.int64))
        with tf.control_dependencies([admitted]):
            self._calls.assign_add(1)
        logs = dict(outcome.logs)
        mixing = logs.pop(independence.LOG_KEY, None)
        if mixing is not None:
            self._mixing.assign(tf.maximum(self._mixing.read_value(), tf.cast(mixing, tf.int32)))
        logs["logical_step"] = tf.cast(self.optimizer.iterations, tf.int64)
        logs["applied"] = outcome.applied
        return logs

    def _tag_admitted(self, data, tag: tf.Tensor) -> tf.Tensor:
        """Whether every row of `data` is the sampler's at this step's place in the run (asserted).

        The rows' tags are recomputed from the rows themselves, at their
        index in the global micro-batch (this replica's share starts at
        replica id x m).
        """
        rows = tf.shape(tag)[0]
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        replicas = self.model.distribute_strategy.num_replicas_in_sync
        # Static where the shapes are (XLA needs it), else read at run time.
        local_rows = tf.nest.flatten(data)[0].shape[0] or rows
        expected = tags.row_tags(
            self._tag_key.read_value(), self.optimizer.iterations,
            self.optimizer.micro_steps.value, data,
            tf.cast(replica, tf.int32) * rows, local_rows * replicas)
        admitted = tf.reduce_all(tf.equal(tag, expected))
        check = tf.debugging.Assert(admitted, [_UNTAGGED_MESSAGE])
        with tf.control_dependencies([check]):
            return tf.identity(admitted)

    def run(self, data) -> dict[str, tf.Tensor]:
        """This step on every replica of the model's strategy, with the logs reduced.

        Call it inside your `tf.function` with the distributed micro-batch
        (`next(iterator)` of a `distribute_micro_batches` dataset), or with
        the micro-batch itself on one device.

        Returns:
            `loss` and the metrics averaged over the replicas; `logical_step`
            and `applied` (the same on every replica).
        """
        strategy = self.model.distribute_strategy
        logs = strategy.run(self, args=(data,))
        return {
            name: (strategy.experimental_local_results(value)[0] if name in _GLOBAL_LOGS
                   else strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None))
            for name, value in logs.items()
        }

    def _check_current(self) -> None:
        """Checks, when the step is traced, that it may train the model."""
        if self.recorder is None:
            raise RuntimeError(
                "Call step.begin(data) before the first step: it checks the data "
                "against the optimizer and starts the privacy ledger.")
        if getattr(self.model, "_tf_megadp_step", None) is not self:
            raise PrivacyConfigurationError(
                "A newer PrivateStep was built for this model: train with that one (each "
                "step keeps the ledger of its own calls).")
        if self.model.optimizer is not self.optimizer:
            raise PrivacyConfigurationError(
                "The model was compiled again with another optimizer since this "
                "PrivateStep was built: build a new PrivateStep (its ledger continues).")
        if tf.distribute.in_cross_replica_context():
            raise RuntimeError(
                "Under a tf.distribute strategy, call the step in each replica: "
                "strategy.run(step, args=(batch,)), or step.run(batch).")

    @property
    def logical_step(self) -> int:
        """Logical steps applied to the weights so far (the optimizer's `iterations`)."""
        return self.optimizer.logical_step

    # -- The ledger ------------------------------------------------------------------

    def record(self) -> None:
        """Moves the logical steps this step applied into the privacy ledger.

        Call it between calls of your `tf.function` (it reads a few
        variables; `PrivacyReport`, `checkpoint()`, `model.save` and
        `tf_megadp.save_training_state` call it first). Steps applied but not
        yet recorded are left out of nothing: a report refuses until they are.

        Raises:
            PrivacyConfigurationError: the steps since the last record cannot
                be accounted and stay out of every epsilon: the model was
                trained by something else in between (`fit`,
                `train_on_batch`, another step), its optimizer was restored
                (call `begin` again), a logical step spanned two passes of
                data that no sampler drew, or the model mixed examples.
        """
        if self.recorder is None:
            return
        optimizer = self.optimizer
        if self.model.optimizer is not optimizer:
            raise PrivacyConfigurationError(
                "The model was compiled again with another optimizer since this "
                "PrivateStep was built: its steps are in that optimizer's ledger. Build a "
                "new PrivateStep.")
        replaced = self._state_replaced()
        table = self.recorder.take_applied_steps()
        steps = int(table[:, 0].sum())
        micro_steps = optimizer.micro_step
        problem = None
        if replaced:
            problem = (
                "the DPOptimizer's state was replaced since the last record (a checkpoint "
                "was restored, or another optimizer's ledger loaded): call "
                "step.begin(data) after restoring, with data that starts at the restored "
                "logical step")
        elif (self._read(self._calls) - self._synced_calls
              != int((table[:, 0] * table[:, 2]).sum()) + micro_steps - self._synced_micro):
            problem = (
                "the micro-batches the optimizer holds are not the ones this step fed it "
                "since its last record: the model was trained by something else (fit, "
                "train_on_batch or another step), or its optimizer restored, so these "
                "steps' data is unknown. Train a model with one PrivateStep at a time, "
                "call step.record() before switching to fit, and step.begin(data) after "
                "restoring a checkpoint")
        elif self._micro_batches_per_pass and self._spans_a_pass(table):
            problem = (
                "a logical step spanned the end of a pass over the data (every "
                f"{self._micro_batches_per_pass} calls), so it could hold an example "
                "twice. Call step.end_pass() at the end of every pass, or make a pass a "
                "whole number of logical steps")
        if problem is not None:
            self.recorder.record_unaccounted(steps)
            self._sync(micro_steps)
            raise PrivacyConfigurationError(
                f"{steps} logical steps cannot be accounted and are in no privacy "
                f"ledger (a report refuses from now on): {problem}.")
        self.recorder.record_steps(table)
        self._sync(micro_steps)
        # This worker's replicas, read without a collective: under several
        # workers the chief alone records again before it saves
        # (checkpointing.record_custom_loop), and a cross-worker sum there
        # waited for an all-reduce that no other worker joined. Each worker
        # records its own micro-steps, so each raises for its own replicas.
        refused = sum(int(value.numpy()) for value in
                      self.model.distribute_strategy.experimental_local_results(self._refused))
        if refused:
            self._refused.assign(0)
            # Where XLA dropped the assertion: the steps recorded are honest
            # (the refused micro-batches added nothing), but the loop is wrong.
            raise PrivacyConfigurationError(
                f"{refused} micro-batches were refused and added to no sum: "
                + _UNTAGGED_MESSAGE.removeprefix("tf_megadp: "))
        code = self._read(self._mixing)
        if code != independence.MIXING_OK:
            raise independence.mixing_error(
                self.model, code, getattr(optimizer.clipping_strategy, "name", "ghost"))

    def end_pass(self) -> None:
        """Ends a pass over data that no sampler drew: discards its partial logical step.

        The micro-batches of a logical step left unfinished at the end of a
        pass were never released (no privacy spent); the next pass starts a
        new logical step, so no step holds an example twice.

        Raises:
            PrivacyConfigurationError: the data is a sampler's, whose steps
                are drawn whole (discarding part of one would misalign the
                rest).
        """
        if self.recorder is None:
            raise RuntimeError("Call step.begin(data) first.")
        if self._micro_batches_per_pass is None:
            raise PrivacyConfigurationError(
                "A sampler's data has no passes: each of its logical steps is drawn "
                "whole, and discarding part of one would join the rest of it to the "
                "next. Call end_pass() only for data begun with micro_batches_per_pass.")
        self.record()
        self.recorder.end_partial_step("a pass over the data")
        self._sync(micro_steps=0)
        self._pass_origin = self._synced_calls

    def _spans_a_pass(self, table: np.ndarray) -> bool:
        """Whether a recorded step's micro-batches straddle a multiple of P calls."""
        per_pass = self._micro_batches_per_pass
        first = self._synced_calls - self._synced_micro - self._pass_origin
        for row in table:
            for _ in range(int(row[0])):
                last = first + int(row[2]) - 1
                if first // per_pass != last // per_pass:
                    return True
                first = last + 1
        return False

    def _state_replaced(self) -> bool:
        """Whether the optimizer's ledger changed other than through this step."""
        optimizer = self.optimizer
        pending = optimizer.pending_applied_steps
        return (optimizer.logical_steps_applied != self._synced_applied + pending
                or read_ledger(optimizer) != self.recorder.ledger)

    def _sync(self, micro_steps: int) -> None:
        self._synced_calls = self._read(self._calls)
        self._synced_micro = micro_steps
        self._synced_applied = self.optimizer.logical_steps_applied

    @staticmethod
    def _read(variable) -> int:
        return int(variable.read_value().numpy())

    # -- Checkpoints -----------------------------------------------------------------

    def checkpoint(self, **trackables) -> tf.train.Checkpoint:
        """A `tf.train.Checkpoint` of the model and its `DPOptimizer`, ledger included.

        It holds the weights, the inner optimizer's state, the logical-step
        count and the privacy ledger, never the noise key nor a mid-step
        (un-noised) sum, which the `DPOptimizer` keeps in memory only. Every
        write records the applied steps first, so the ledger in the file is
        complete. After restoring one, call `begin` with data that starts
        at the restored step (`step.logical_step`).

        Args:
            **trackables: more objects to save with them (e.g. a step counter).

        Returns:
            The checkpoint; use it with `tf.train.CheckpointManager` as usual.

        Example:
        ```python
        manager = tf.train.CheckpointManager(step.checkpoint(), "ckpt", max_to_keep=3)
        manager.restore_or_initialize()
        step.begin(tf_megadp.PoissonSampler(shards, schedule, start_step=step.logical_step))
        ```
        """
        # Every write records the applied steps first.
        return _keras_compat.checkpoint_calling_before_write(
            self.record, model=self.model, optimizer=self.optimizer, **trackables)


def _split_tag(data):
    """(batch, tag) of a tagged micro-batch; refuses, when traced, one without a tag."""
    tag = data[1] if isinstance(data, (tuple, list)) and len(data) == 2 else None
    if not (isinstance(tag, tf.Tensor) and tag.dtype == tags.TAG_DTYPE
            and tag.shape.rank == 1):
        raise PrivacyConfigurationError(
            "This step was begun with a sampler, so it accounts only the sampler's "
            "micro-batches, and these carry no tag: feed "
            "sampler.as_dataset(..., tagged=True), whose elements are (batch, tag). "
            "Do per-micro-batch processing in the sampler's map_fn, before the rows "
            "are tagged.")
    return data[0], tag


def _per_replica_spec(data, strategy):
    """The element spec one replica's micro-batch has (None when `data` has none)."""
    spec = getattr(data, "element_spec", None)
    if spec is None:
        return None
    if isinstance(data, tf.data.Dataset):
        # Global micro-steps of m * R rows (a sampler's dataset).
        replicas = strategy.num_replicas_in_sync
        return tf.nest.map_structure(
            lambda s: tf.TensorSpec([s.shape[0] // replicas, *s.shape[1:]], s.dtype), spec)
    # A distributed dataset: a PerReplicaSpec (several local replicas) holds
    # one replica's spec per replica; a TensorSpec is one replica's already.
    return tf.nest.map_structure(lambda s: getattr(s, "_value_specs", [s])[0], spec)
