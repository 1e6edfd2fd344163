"""The private micro-step: the one implementation that `fit` and `PrivateStep` run.

For one micro-batch, in a replica context: every example's loss and
gradient, clipped by the optimizer's clipping strategy (a micro-batch of
padding only skips that pass), the clipped sum handed to the `DPOptimizer`
(`DPOptimizer.add_micro_batch`, which applies the noisy update at the end
of a logical step), and the loss and metrics Keras shows.
"""

from __future__ import annotations

from typing import NamedTuple

import keras
import tensorflow as tf

from tf_megadp import _keras_compat, adaptive_clipping
from tf_megadp.clipping import base, independence
from tf_megadp.clipping.base import ClippedBatch, example_weights_present
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.optimizer import PRIVATE_STEP_TOKEN, DPOptimizer, accumulation_dtype

__all__ = ["StepOutcome", "check_no_example_mixing", "private_step"]

# Layers whose training-mode output for one example depends on the others.
_EXAMPLE_MIXING_LAYERS = (keras.layers.BatchNormalization,)


def check_no_example_mixing(model: keras.Model) -> None:
    """Refuses a model with layers that mix the examples of a batch (BatchNormalization).

    Raises:
        PrivacyConfigurationError: naming the layer and its replacement.
    """
    for layer in _keras_compat.flatten_layers(model):
        if isinstance(layer, _EXAMPLE_MIXING_LAYERS):
            raise PrivacyConfigurationError(
                f"Layer '{layer.name}' ({type(layer).__name__}) mixes examples "
                "within a batch during training, which breaks the per-example "
                "sensitivity bound of DP-SGD. Replace it with "
                "keras.layers.LayerNormalization or GroupNormalization."
            )


class StepOutcome(NamedTuple):
    """What one micro-batch of the DP step gives its caller (in a replica context).

    Attributes:
        logs: Keras's logs of the step (`compute_metrics`), as `fit` shows them.
        applied: bool scalar, whether this micro-batch ended a logical step
            and the noisy update was applied.
    """

    logs: dict
    applied: tf.Tensor


# Not converted by autograph: the step's control flow is written with tf.cond
# (as every backend-neutral Keras layer's is), and converting the hundreds of
# functions it reaches cost seconds of CPU on every trace.
@tf.autograph.experimental.do_not_convert
def private_step(model: keras.Model, data, *, log_nonfinite_examples: bool = False,
                 admitted: tf.Tensor | None = None) -> StepOutcome:
    """One micro-batch of the DP step: the one implementation `fit` and `PrivateStep` run.

    Clips every example of the micro-batch, hands the clipped sum to the
    `DPOptimizer` (which applies the noisy update at the end of a logical
    step), and updates the loss and metrics.

    Args:
        admitted: a bool scalar of the caller's run-time checks (None: no
            check). A micro-batch not admitted adds nothing to the sums, as
            padding does, so that no unchecked data is released where XLA
            drops the checks' assertions.
    """
    optimizer = model.optimizer
    if not isinstance(optimizer, DPOptimizer):
        raise PrivacyConfigurationError(
            "The model was made private but is compiled with "
            f"{type(optimizer).__name__}, which adds no noise. Compile with "
            "tf_megadp.DPOptimizer(...)."
        )
    check_no_example_mixing(model)
    if not model.trainable_weights:
        raise ValueError("The model has no trainable weights to train privately.")
    # Traced once per compiled step: a seeded (test) optimizer seeds dropout too.
    base.set_randomness_seed(model, optimizer.seed, owner=optimizer)
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    # Before the forward pass: a logical step replayed after a rollback draws
    # its dropout masks (and later its noise) in a new generation.
    base.set_draw_generation(
        model, optimizer.draw_generation(tf.equal(optimizer.micro_steps.value, 0)))
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    micro_batch_size = tf.nest.flatten(x)[0].shape[0]
    if micro_batch_size is None:
        micro_batch_size = tf.shape(tf.nest.flatten(x)[0])[0]
    clip_norm = optimizer.current_clip_norm
    if admitted is not None and sample_weight is not None:
        # A refused micro-batch is all padding: it skips its pass and adds
        # exactly nothing (a product of m weights, the cheapest gate).
        sample_weight = tf.nest.map_structure(
            lambda weight: weight * tf.cast(admitted, weight.dtype), sample_weight)
    batch = _clip_and_sum_unless_padding(model, optimizer, x, y, sample_weight, micro_batch_size,
                                         clip_norm)
    if admitted is not None and sample_weight is None:
        batch = _admitted_only(batch, admitted)
    centred_count = None
    if optimizer.adaptive_clipping is not None:
        norms, is_real = batch.norms, batch.is_real
        units = optimizer.examples_per_unit
        if units > 1:
            # One count per privacy unit: its norm is repeated on its k rows,
            # and a count over rows would move by up to k per unit.
            norms = tf.reshape(norms, [-1, units])[:, 0]
            is_real = tf.reduce_max(tf.reshape(tf.cast(is_real, tf.float32), [-1, units]), axis=1)
        centred_count = adaptive_clipping.centred_count(norms, is_real, clip_norm)
    # The optimizer and its schedule count privacy units (slots of k rows).
    # After the checks: a micro-batch whose assertion fails moves no counter.
    with tf.control_dependencies([] if admitted is None else [admitted]):
        applied = optimizer.add_micro_batch(
            PRIVATE_STEP_TOKEN, batch.gradient_sum, model.trainable_variables,
            micro_batch_size // optimizer.examples_per_unit, batch.nonfinite, centred_count,
        )
    real_examples = tf.reduce_sum(batch.is_real)
    mean_loss = tf.math.divide_no_nan(tf.reduce_sum(batch.losses), real_examples)
    _keras_compat.loss_tracker(model).update_state(mean_loss, sample_weight=real_examples)
    logs = model.compute_metrics(x, y, batch.y_pred, sample_weight=sample_weight)
    if batch.mixing is not None:
        mixing = tf.cast(batch.mixing, tf.float32)
        replica_context = tf.distribute.get_replica_context()
        if replica_context is not None and replica_context.num_replicas_in_sync > 1:
            # ReduceOp has no MAX: gather every replica's code and take the largest.
            mixing = tf.reduce_max(replica_context.all_gather(tf.reshape(mixing, [1]), axis=0))
        logs[independence.LOG_KEY] = mixing
    if optimizer.adaptive_clipping is not None:
        # C after this micro-batch (it moves at the end of a logical step): a DP release.
        logs["clip_norm"] = tf.cast(optimizer.current_clip_norm, tf.float32)
    if not log_nonfinite_examples:
        return StepOutcome(logs, applied)
    nonfinite = optimizer.nonfinite_examples.value
    replica_context = tf.distribute.get_replica_context()
    if replica_context is not None and replica_context.num_replicas_in_sync > 1:
        # Each replica counts only its own examples and Keras averages logs
        # over replicas: report the global count.
        nonfinite = replica_context.all_reduce(
            tf.distribute.ReduceOp.SUM, tf.cast(nonfinite, tf.float32))
    logs["nonfinite_examples"] = nonfinite
    return StepOutcome(logs, applied)


def _admitted_only(batch: ClippedBatch, admitted: tf.Tensor) -> ClippedBatch:
    """`batch` with its clipped sum, norms and counts zeroed unless `admitted` (data without weights)."""
    def kept(tensor):
        return None if tensor is None else tf.where(admitted, tensor, tf.zeros_like(tensor))

    # Adaptive clipping's count reads the norms and is_real: zeroed alike.
    return batch._replace(gradient_sum=[kept(g) for g in batch.gradient_sum],
                          norms=kept(batch.norms), is_real=kept(batch.is_real),
                          nonfinite=kept(batch.nonfinite))


def _clip_and_sum_unless_padding(model, optimizer, x, y, sample_weight, micro_batch_size,
                                 clip):
    """The strategy's clipped sum, skipping micro-batches that hold only padding.

    Poisson steps are padded to a static k*m capacity above the expected
    batch, so the last micro-batches of a step are often all padding. Their
    exact contribution is zero; skipping their per-example pass (the costly
    part) changes no number and saves up to a third of a small step.
    """
    strategy = optimizer.clipping_strategy
    # Passed only when set, so that a user's strategy written for flat
    # clipping keeps working (and fails loudly if asked for automatic).
    scaling = ({} if optimizer.automatic_stability is None
               else {"automatic_stability": optimizer.automatic_stability})
    if optimizer.examples_per_unit > 1:
        scaling["examples_per_unit"] = optimizer.examples_per_unit
    if optimizer.loss_scale is not None:
        scaling["loss_scale"] = optimizer.loss_scale
    if sample_weight is None:
        return strategy.clip_and_sum(model, x, y, sample_weight, clip, **scaling)
    is_real = example_weights_present(sample_weight, micro_batch_size)
    variables = model.trainable_variables
    reached, checked = [], []

    def zeros(variable):
        return tf.zeros(variable.shape, accumulation_dtype(variable.dtype))

    def compute():
        batch = strategy.clip_and_sum(model, x, y, sample_weight, clip, **scaling)
        reached[:] = [g is not None for g in batch.gradient_sum]
        checked[:] = [batch.mixing is not None]
        gradients = [zeros(v) if g is None else tf.cast(g, accumulation_dtype(v.dtype))
                     for g, v in zip(batch.gradient_sum, variables)]
        mixing = (tf.constant(independence.MIXING_OK, tf.int32) if batch.mixing is None
                  else tf.cast(batch.mixing, tf.int32))
        return (gradients, tf.cast(batch.losses, tf.float32), batch.y_pred,
                tf.cast(batch.norms, tf.float32), batch.is_real, batch.nonfinite, mixing)

    def skip():
        no_examples = tf.zeros_like(is_real)
        # Metrics still need predictions; they carry weight zero.
        y_pred = model(x, training=False)
        return ([zeros(v) for v in variables], no_examples, y_pred, no_examples, no_examples,
                tf.constant(0, tf.int64), tf.constant(independence.MIXING_OK, tf.int32))

    gradients, losses, y_pred, norms, is_real, nonfinite, mixing = tf.cond(
        tf.reduce_any(is_real > 0), compute, skip)
    # Variables the loss does not reach stay None: neither noised nor updated.
    gradients = [g if connected else None for g, connected in zip(gradients, reached)]
    # Only strategies that check independence (ghost, auto) report mixing.
    return ClippedBatch(gradients, losses, y_pred, norms, is_real, nonfinite,
                        mixing if checked[0] else None)
