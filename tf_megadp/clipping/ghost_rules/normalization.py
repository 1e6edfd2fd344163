"""Ghost rule for `keras.layers.LayerNormalization`: closed-form per-example gradients."""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_megadp.clipping.rules import Rule, builtin_rule
from tf_megadp.clipping.terms import Explicit, compute_dtype
from tf_megadp.errors import PrivacyConfigurationError


@builtin_rule(keras.layers.LayerNormalization)
class LayerNormalizationRule(Rule):
    """`keras.layers.LayerNormalization`: closed-form per-example gradients.

    The layer is `normalized(x) * gamma + beta`; example i's gradients are
    `sum(normalized(x_i) * g_i)` and `sum(g_i)` over its non-normalized axes,
    with `g` the output gradient. Much cheaper than the per-example fallback,
    which would run the layer per example.
    """

    @classmethod
    def matches(cls, layer):
        cls_ = keras.layers.LayerNormalization
        return isinstance(layer, cls_) and type(layer).call is cls_.call

    def call(self, recorder, original, inputs):
        layer = self.layer
        recorder.check_batch_axis(inputs, layer)
        rank = inputs.shape.rank
        axes = sorted(a % rank for a in layer.axis)
        if 0 in axes:
            raise PrivacyConfigurationError(
                f"Layer '{layer.name}' normalizes over the micro-batch axis, which "
                "mixes examples; no per-example gradient exists. Normalize over "
                "feature axes only."
            )
        shape = [1] * rank
        for a in axes:
            shape[a] = inputs.shape[a]
        dtype = compute_dtype(self.variables[0]) if self.variables else tf.float32
        normalized = keras.ops.layer_normalization(
            tf.cast(inputs, dtype), None, None, axes, layer.epsilon,
            rms_scaling=layer.rms_scaling)
        outputs = normalized
        if layer.gamma is not None:
            outputs = outputs * tf.reshape(tf.cast(layer.gamma, dtype), shape)
        if layer.beta is not None:
            outputs = outputs + tf.reshape(tf.cast(layer.beta, dtype), shape)
        outputs, index = recorder.probe(outputs, layer)
        summed = [a for a in range(1, rank) if a not in axes]

        def finish(gradient_of):
            gradient = gradient_of(index)
            if gradient is None:
                return []
            gradient = tf.cast(gradient, dtype)
            per_example = lambda t, variable: Explicit(tf.reduce_sum(t, axis=summed),
                                                       variable.shape)
            records = []
            if layer.gamma is not None:
                records.append((layer.gamma, per_example(normalized * gradient, layer.gamma)))
            if layer.beta is not None:
                records.append((layer.beta, per_example(gradient, layer.beta)))
            return records

        recorder.on_gradients(finish)
        return tf.cast(outputs, layer.compute_dtype)
