"""Exact per-example gradients with `tf.vectorized_map`, compiled by XLA.

Each example runs its own forward and backward pass (batch axis of one);
`vectorized_map` turns the m passes into batched kernels. Memory grows with
m times the number of parameters, which is what ghost clipping avoids.
XLA compilation is not optional: without it, `vectorized_map` over a
keras-hub BERT segfaults on TF 2.21 (see docs/concepts.md).
"""

from __future__ import annotations

import weakref

import keras
import tensorflow as tf

from tf_megadp.clipping import base, units, vectorized_pfor
from tf_megadp.clipping.terms import Explicit, compute_dtype

# Without these converters part of the per-example pass runs as a while_loop
# over the examples (see vectorized_pfor).
vectorized_pfor.register_converters()

__all__ = ["VectorizedClipping"]


class VectorizedClipping(base.ClippingStrategy):
    """Clips materialised per-example gradients.

    Args:
        jit_compile: compile the per-example pass with XLA (default True; only
            turn it off to debug small dense models).

    Example:
    ```python
    strategy = VectorizedClipping()
    batch = strategy.clip_and_sum(model, x, y, sample_weight, l2_norm_clip=1.0)
    batch.gradient_sum  # one tensor per trainable variable (None if unused)
    ```
    """

    name = "vectorized"

    def __init__(self, jit_compile: bool = True):
        self.jit_compile = jit_compile
        self._functions = weakref.WeakKeyDictionary()

    def clip_and_sum(self, model, x, y, sample_weight, l2_norm_clip,
                     automatic_stability=None, examples_per_unit=1, loss_scale=None):
        units.check_unit_layout(tf.nest.flatten(x)[0].shape[0], examples_per_unit)
        function = self._function_for(model)
        # float64, so that a float64 model clips at C itself, not at float32(C).
        clip = (tf.cast(l2_norm_clip, tf.float64) if tf.is_tensor(l2_norm_clip)
                else tf.constant(l2_norm_clip, tf.float64))
        return function(x, y, sample_weight, clip, automatic_stability, examples_per_unit,
                        loss_scale)

    def per_example_gradients(self, model: keras.Model, x, y, sample_weight=None,
                              loss_scale=None):
        """Per-example gradients, for tests and diagnostics (eager or graph).

        Args:
            loss_scale: None, or the fixed loss scale of float16 compute
                (`ClippingStrategy.clip_and_sum`): the gradients returned
                are unscaled, in float32.

        Returns:
            (gradients, losses, y_pred): `gradients` has one [m, ...] tensor per
            trainable variable, or None where the loss does not reach it.
        """
        return _per_example_gradients(model, x, y, sample_weight, loss_scale)

    def _function_for(self, model):
        function = self._functions.get(model)
        if function is None:
            if self.jit_compile:
                base.refuse_layers_without_xla(model)

            def clip_and_sum(x, y, sample_weight, l2_norm_clip, automatic_stability,
                             examples_per_unit=1, loss_scale=None):
                return _clip_and_sum(model, x, y, sample_weight, l2_norm_clip,
                                     automatic_stability, examples_per_unit, loss_scale)

            # No autograph: the pass needs no conversion (see ghost.py).
            function = tf.function(clip_and_sum, jit_compile=self.jit_compile,
                                   autograph=False)
            self._functions[model] = function
        return function


def _per_example_gradients(model, x, y, sample_weight, loss_scale=None):
    batch_size = tf.shape(tf.nest.flatten(x)[0])[0]
    trainable_values = [tf.convert_to_tensor(v.value) for v in model.trainable_variables]
    state_values, per_example = base.example_state_values(model, batch_size)
    # Dropout masks are drawn for the whole micro-batch from the layer's own
    # seed (vectorized_pfor.per_example_dropout): its state is not batched.
    shared_seeds = vectorized_pfor.dropout_seed_states(model)
    for j, variable in enumerate(model.non_trainable_variables):
        if id(variable) in shared_seeds:
            state_values[j] = tf.convert_to_tensor(variable.value)
            per_example[j] = False
    varying_states = [v for v, varies in zip(state_values, per_example) if varies]
    connected = []

    def one_example(elements):
        x_i = elements["x"]
        y_i = elements.get("y")
        w_i = elements.get("sample_weight")
        example_states = elements["states"]
        example_states = iter(example_states)
        states = [next(example_states) if varies else value
                  for value, varies in zip(state_values, per_example)]
        with vectorized_pfor.per_example_dropout(model, elements["index"], batch_size), \
                tf.GradientTape() as tape:
            tape.watch(trainable_values)
            loss, y_pred_i = base.stateless_loss(
                model,
                trainable_values,
                states,
                base.add_batch_axis(x_i),
                base.add_batch_axis(y_i),
                base.add_batch_axis(w_i),
            )
            # Float16 compute: the backward pass runs on the scaled loss, and
            # each gradient is unscaled in float32 before anything reads it.
            scaled = base.scaled_loss(loss, loss_scale)
        gradients = [base.unscaled_gradient(base.dense_gradient(g), loss_scale)
                     for g in tape.gradient(scaled, trainable_values)]
        # Which variables the loss reaches is a property of the graph, fixed
        # at trace time; record it for the caller.
        connected[:] = [g is not None for g in gradients]
        y_pred_i = tf.nest.map_structure(lambda t: t[0], y_pred_i)
        return [g for g in gradients if g is not None], loss, y_pred_i

    # vectorized_map cannot carry None leaves: leave absent parts out.
    elements = {"x": x, "states": varying_states,
                "index": tf.range(batch_size, dtype=tf.int32)}
    if y is not None:
        elements["y"] = y
    if sample_weight is not None:
        elements["sample_weight"] = sample_weight
    with base.example_axis_guards(model), base.secret_seed_draws(model):
        gradients, losses, y_pred = tf.vectorized_map(one_example, elements)
    base.advance_seed_states(model)
    gradients = iter(gradients)
    full = [next(gradients) if is_connected else None for is_connected in connected]
    return full, losses, y_pred


def _clip_and_sum(model, x, y, sample_weight, l2_norm_clip, automatic_stability=None,
                  examples_per_unit=1, loss_scale=None):
    gradients, losses, y_pred = _per_example_gradients(model, x, y, sample_weight, loss_scale)
    batch_size = tf.shape(losses)[0]
    # The per-example gradients are `Explicit` terms: their norms and
    # clipped sums are the ones ghost clipping computes for such records, in
    # float32 for 16-bit gradients (neither a norm nor a sum of m examples
    # is rounded to a 16-bit float) and float64 for float64 ones.
    terms = [None if g is None else Explicit(tf.cast(g, compute_dtype(g)))
             for g in gradients]
    present = [t for t in terms if t is not None]
    # One norm over all variables: in float64 as soon as one of them is.
    norm_dtype = (tf.float64 if any(t.dtype == tf.float64 for t in present)
                  else tf.float32)
    # The norm of each privacy unit's summed gradient (of each example's
    # when a unit is one example), given to every row of the unit.
    squared = tf.add_n([tf.cast(units.regrouped(t, examples_per_unit).squared_norms(),
                                norm_dtype) for t in present])
    norms = units.unit_rows(tf.sqrt(squared), examples_per_unit)
    is_real = base.example_weights_present(sample_weight, batch_size)
    factors, nonfinite = base.clip_factors(norms, l2_norm_clip, is_real, automatic_stability)
    # Rows with a non-finite norm are zeroed before the sums (0 * NaN is NaN);
    # padding has factor 0 and finite gradients.
    keep = tf.math.is_finite(norms)
    gradient_sum = [None if t is None else t.clipped_sum(factors, keep) for t in terms]
    return base.clipped_batch(gradient_sum, losses, y_pred, norms, is_real, nonfinite)
