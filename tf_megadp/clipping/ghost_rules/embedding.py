"""Ghost rules for embeddings: `ReversibleEmbedding` (tied or not) and `Embedding`."""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_megadp.clipping.rules import Rule, builtin_rule, flat_tokens, plain
from tf_megadp.clipping.terms import Gather, Outer, compute_dtype


# Registered before EmbeddingRule: a ReversibleEmbedding is also an Embedding.
@builtin_rule(keras.layers.ReversibleEmbedding)
class ReversibleEmbeddingRule(Rule):
    """`ReversibleEmbedding`: Gather for the lookup, Outer for the projection.

    With tied weights both calls record a term for the SAME matrix; the
    strategy includes their cross term in each example's norm.
    """

    @classmethod
    def matches(cls, layer):
        return (plain(layer, keras.layers.ReversibleEmbedding)
                and layer.reverse_dtype is None and layer.logit_soft_cap is None)

    def call(self, recorder, original, inputs, reverse=False):
        layer = self.layer
        outputs, index = recorder.probe(original(inputs, reverse=reverse), layer)
        ids = None if reverse else tf.cast(inputs, tf.int32)
        recorder.check_batch_axis(inputs, layer)

        def finish(gradient_of):
            gradient = gradient_of(index)
            if gradient is None:
                return []
            m, dtype = recorder.batch_size, compute_dtype(layer.embeddings)
            gradient = flat_tokens(gradient, m, dtype)
            if not reverse:
                return [(layer.embeddings, Gather(tf.reshape(ids, [m, -1]), gradient,
                                                  layer.embeddings.shape))]
            hidden = flat_tokens(inputs, m, dtype)
            if layer.tie_weights:
                # logits = h E^T: dE = (dlogits)^T h, an [input_dim, output_dim] matrix.
                return [(layer.embeddings, Outer(gradient, hidden, layer.embeddings.shape))]
            return [(layer.reverse_embeddings,
                     Outer(hidden, gradient, layer.reverse_embeddings.shape))]

        recorder.on_gradients(finish)
        return outputs


@builtin_rule(keras.layers.Embedding)
class EmbeddingRule(Rule):
    """`keras.layers.Embedding`: Gather(token ids, dL/doutput)."""

    @classmethod
    def matches(cls, layer):
        return plain(layer, keras.layers.Embedding)

    def call(self, recorder, original, inputs, *args, **kwargs):
        layer = self.layer
        outputs, index = recorder.probe(original(inputs, *args, **kwargs), layer)
        ids = tf.cast(inputs, tf.int32)

        def finish(gradient_of):
            gradient = gradient_of(index)
            if gradient is None:
                return []
            m, dtype = recorder.batch_size, compute_dtype(layer.embeddings)
            return [(layer.embeddings, Gather(tf.reshape(ids, [m, -1]),
                                              flat_tokens(gradient, m, dtype),
                                              layer.embeddings.shape))]

        recorder.on_gradients(finish)
        return outputs
