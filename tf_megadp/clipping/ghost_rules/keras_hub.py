"""Ghost rules for keras-hub layers: `PositionEmbedding`, a tied `MaskedLMHead`.

Imported by `plan_rules` only once keras-hub is already loaded (a model built
from keras-hub layers), so that `import tf_megadp` does not load keras-hub.
"""

from __future__ import annotations

import keras_hub
import tensorflow as tf

from tf_megadp import _keras_compat
from tf_megadp.clipping.rules import (Rule, accept_without_rule, bias_gradient, builtin_rule,
                                      call_with_probed_activation, flat_tokens)
from tf_megadp.clipping.terms import Gather, compute_dtype
from tf_megadp.errors import GhostClippingUnsupportedError

accept_without_rule(keras_hub.layers.RMSNormalization)


@builtin_rule(keras_hub.layers.PositionEmbedding)
class PositionEmbeddingRule(Rule):
    """`keras_hub.layers.PositionEmbedding`: Gather(positions, dL/doutput)."""

    def call(self, recorder, original, inputs, start_index=0, positions=None):
        layer = self.layer
        if positions is not None:
            raise GhostClippingUnsupportedError(
                f"Ghost clipping does not cover '{layer.name}' called with explicit "
                "`positions`. Use clipping='vectorized'."
            )
        outputs, index = recorder.probe(original(inputs, start_index=start_index), layer)
        length = outputs.shape[-2]
        ids = tf.cast(start_index, tf.int32) + tf.range(length, dtype=tf.int32)
        ids = tf.broadcast_to(ids[:, None], outputs.shape[1:-1] + [1])[..., 0]

        def finish(gradient_of):
            gradient = gradient_of(index)
            if gradient is None:
                return []
            m, table = recorder.batch_size, layer.position_embeddings
            tiled = tf.broadcast_to(ids, tf.concat([[m], tf.shape(ids)], 0))
            return [(table, Gather(tf.reshape(tiled, [m, -1]),
                                   flat_tokens(gradient, m, compute_dtype(table)), table.shape))]

        recorder.on_gradients(finish)
        return outputs


@builtin_rule(keras_hub.layers.MaskedLMHead)
class MaskedLMHeadRule(Rule):
    """keras-hub `MaskedLMHead` tied to a token embedding: its output bias.

    The intermediate Dense, LayerNormalization and the tied projection are
    sublayers with rules of their own.
    """

    @classmethod
    def matches(cls, layer):
        return super().matches(layer) and layer.token_embedding is not None

    def call(self, recorder, original, *args, **kwargs):
        layer = self.layer
        outputs, index = call_with_probed_activation(recorder, layer, original, *args, **kwargs)

        def finish(gradient_of):
            gradient = gradient_of(index)
            return [] if gradient is None else [(_keras_compat.keras_hub_bias(layer),
                                            bias_gradient(gradient, _keras_compat.keras_hub_bias(layer)))]

        recorder.on_gradients(finish)
        return outputs
