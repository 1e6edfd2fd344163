"""The exact per-layer fallback: per-example gradients of one layer's variables.

`clipping="auto"` gives every layer without a ghost rule (and `clipping="ghost"`
the small normalization layers of `rules.SMALL_LAYERS`) one of these rules.
Either covers the layer's whole subtree and records `Explicit` terms.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_megadp.clipping import base
from tf_megadp.clipping.rules import Rule
from tf_megadp.clipping.terms import Explicit, compute_dtype
from tf_megadp.errors import GhostClippingUnsupportedError

__all__ = ["PerExampleRule", "ReplayRule", "fallback_rule"]


def _wide(tensor):
    """float64 stays float64; every other float type is summed in float32."""
    return tf.cast(tensor, tf.float64 if tensor.dtype == tf.float64 else tf.float32)


class PerExampleRule(Rule):
    """Any layer: its forward pass runs per example with per-example variables.

    Each example gets its own copy of the layer's variables (a broadcast,
    watched by the tape), so the gradient with respect to the copies is the
    per-example gradient; memory is m times the layer's parameters. Dropout
    seeds get one distinct seed per example, as in `VectorizedClipping`.
    """

    covers_sublayers = True

    def __init__(self, layer):
        self.layer = layer
        self.variables = list(layer.trainable_variables)

    @classmethod
    def matches(cls, layer):
        return True

    def call(self, recorder, original, *args, **kwargs):
        layer, m = self.layer, recorder.batch_size
        # tf.tile, not tf.broadcast_to(tf.shape(v)): XLA would need the
        # variable as a compile-time constant and recompile whenever it changes.
        copies = [tf.tile(tf.expand_dims(v.value, 0), [m] + [1] * v.shape.rank)
                  for v in self.variables]
        indices = [recorder.watch(c) for c in copies]
        leaves = tf.nest.flatten((args, kwargs))
        batched = [recorder.has_batch_axis(t) for t in leaves]
        if not any(batched):
            raise GhostClippingUnsupportedError(
                f"Layer '{layer.name}' was called without any input carrying "
                f"the micro-batch axis (size {m}). Use clipping='vectorized'."
            )
        states, per_example = base.example_state_values(layer, m)
        varying = [s for s, varies in zip(states, per_example) if varies]

        def one_example(elements):
            example_leaves, example_copies, example_states = elements
            example_leaves = iter(example_leaves)
            rebuilt = [tf.expand_dims(next(example_leaves), 0) if is_batched else leaf
                       for leaf, is_batched in zip(leaves, batched)]
            example_args, example_kwargs = tf.nest.pack_sequence_as((args, kwargs), rebuilt)
            example_states = iter(example_states)
            state_values = [next(example_states) if varies else s
                            for s, varies in zip(states, per_example)]
            mapping = list(zip(self.variables, example_copies))
            mapping += list(zip(layer.non_trainable_variables, state_values))
            scope = _OwnVariablesScope(recorder, layer, self.variables, mapping)
            with scope:
                outputs = original(*example_args, **example_kwargs)
            return tf.nest.map_structure(lambda t: t[0], outputs)

        mapped = [_dense_gradient_boundary(leaf)
                  for leaf, is_batched in zip(leaves, batched) if is_batched]
        recorder.suspended += 1
        try:
            outputs = tf.vectorized_map(
                one_example, (mapped, [_dense_gradient_boundary(c) for c in copies], varying))
        finally:
            recorder.suspended -= 1
        base.advance_seed_states(layer)

        def finish(gradient_of):
            records = []
            for variable, index in zip(self.variables, indices):
                gradient = gradient_of(index)  # dense: it comes through the boundary
                if gradient is not None:
                    records.append((variable, Explicit(tf.cast(gradient, compute_dtype(variable)), variable.shape)))
            return records

        recorder.on_gradients(finish)
        return outputs


class ReplayRule(Rule):
    """Any deterministic layer: run batched, then replayed per example for its gradients.

    The layer runs once on the whole micro-batch, with a zero probe on every
    floating-point output, so the backward pass yields its output gradient G
    example by example. Example i's gradient is then the vector-Jacobian
    product of the layer at example i with G_i: the layer is re-run on
    example i alone under `vectorized_map` and differentiated there, with its
    variables loop-invariant, which is the structure `VectorizedClipping`
    uses. `PerExampleRule` instead gives every example its own copy of the
    variables; for a convolution that makes the filter loop-variant, which
    pfor cannot vectorize, and XLA then rejected the while-loop fallback
    ("XLA compilation requires a fixed tensor list size", Conv2D under
    `clipping="auto"`). The replay is exact only if the layer is a
    deterministic function of its inputs and variables, so layers that draw
    random numbers keep `PerExampleRule`.
    """

    covers_sublayers = True

    def __init__(self, layer):
        self.layer = layer
        self.variables = list(layer.trainable_variables)

    @classmethod
    def matches(cls, layer) -> bool:
        return not base.draws_random_numbers(layer)

    def call(self, recorder, original, *args, **kwargs):
        layer = self.layer
        leaves = tf.nest.flatten((args, kwargs))
        batched = [recorder.has_batch_axis(t) for t in leaves]
        if not any(batched):
            raise GhostClippingUnsupportedError(
                f"Layer '{layer.name}' was called without any input carrying "
                f"the micro-batch axis (size {recorder.static_batch_size}). Use "
                "clipping='vectorized'."
            )
        # The replay accounts for every variable below the layer; rules of
        # sublayers it shares with the rest of the model (a tied embedding)
        # must not record this call a second time.
        recorder.suspended += 1
        try:
            outputs = original(*args, **kwargs)
        finally:
            recorder.suspended -= 1
        output_leaves = tf.nest.flatten(outputs)
        probed, indices = [], []
        for leaf in output_leaves:
            if tf.is_tensor(leaf) and leaf.dtype.is_floating:
                leaf, index = recorder.probe(leaf, layer)
            else:
                index = None
            probed.append(leaf)
            indices.append(index)
        outputs = tf.nest.pack_sequence_as(outputs, probed)
        states = [tf.convert_to_tensor(v.value) for v in layer.non_trainable_variables]

        def finish(gradient_of):
            cotangents = [None if i is None else gradient_of(i) for i in indices]
            if all(g is None for g in cotangents):
                return []
            values = [tf.convert_to_tensor(v.value) for v in self.variables]
            reached = [g is not None for g in cotangents]
            connected = []

            def one_example(elements):
                example_leaves, example_cotangents = elements
                example_leaves = iter(example_leaves)
                rebuilt = [tf.expand_dims(next(example_leaves), 0) if is_batched else leaf
                           for leaf, is_batched in zip(leaves, batched)]
                example_args, example_kwargs = tf.nest.pack_sequence_as((args, kwargs), rebuilt)
                mapping = list(zip(self.variables, values))
                mapping += list(zip(layer.non_trainable_variables, states))
                with tf.GradientTape() as tape:
                    tape.watch(values)
                    with _OwnVariablesScope(recorder, layer, self.variables, mapping):
                        replayed = tf.nest.flatten(original(*example_args, **example_kwargs))
                    example_cotangents = iter(example_cotangents)
                    total = tf.add_n([
                        tf.reduce_sum(_wide(out) * _wide(next(example_cotangents))[None])
                        for out, is_reached in zip(replayed, reached) if is_reached
                    ])
                gradients = [base.dense_gradient(g) for g in tape.gradient(total, values)]
                # Which variables the layer's outputs reach is fixed at trace time.
                connected[:] = [g is not None for g in gradients]
                return [g for g in gradients if g is not None]

            mapped = [leaf for leaf, is_batched in zip(leaves, batched) if is_batched]
            per_example = iter(tf.vectorized_map(
                one_example, (mapped, [g for g in cotangents if g is not None])))
            return [(variable, Explicit(tf.cast(next(per_example), compute_dtype(variable)), variable.shape))
                    for variable, is_connected in zip(self.variables, connected) if is_connected]

        recorder.on_gradients(finish)
        return outputs


def fallback_rule(layer) -> Rule:
    """The exact per-example rule for a layer without a ghost rule."""
    return ReplayRule(layer) if ReplayRule.matches(layer) else PerExampleRule(layer)


def _dense_gradient_boundary(tensor):
    """Identity whose gradient is made dense here, against `tensor`'s own shape.

    Differentiating through `vectorized_map` yields IndexedSlices whose dense
    shape is computed inside pfor's backward function. When the micro-batch
    axis is not static (e.g. `fit` on arrays with a partial last batch), XLA
    cannot see through that function, so it would treat every input and
    weight as a compile-time constant and recompile at every step. The shape
    of `tensor`, taken outside, is one XLA can resolve.
    """
    if not tensor.dtype.is_floating:
        return tensor

    @tf.custom_gradient
    def boundary(value):
        def gradient(upstream):
            if isinstance(upstream, tf.IndexedSlices):
                return tf.math.unsorted_segment_sum(
                    upstream.values, upstream.indices, tf.shape(value)[0])
            return upstream

        return tf.identity(value), gradient

    return boundary(tensor)


class _OwnVariablesScope(keras.StatelessScope):
    """Inside a per-example forward: reads of foreign trainable variables are refused."""

    def __init__(self, recorder, layer, variables, mapping):
        super().__init__(state_mapping=mapping)
        self._recorder, self._layer = recorder, layer
        self._own = {id(v) for v in variables}

    def get_current_value(self, variable):
        if id(variable) in self._recorder._trainable and id(variable) not in self._own:
            self._recorder.violations.append(variable.path)
        return super().get_current_value(variable)

