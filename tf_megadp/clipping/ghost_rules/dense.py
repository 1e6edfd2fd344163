"""Ghost rule for `keras.layers.Dense`: Outer(inputs, dL/dpre-activation) plus the bias."""

from __future__ import annotations

import keras

from tf_megadp.clipping.rules import (Rule, bias_gradient, builtin_rule,
                                      call_with_probed_activation, flat_tokens, plain)
from tf_megadp.clipping.terms import Outer, compute_dtype


@builtin_rule(keras.layers.Dense)
class DenseRule(Rule):
    """`keras.layers.Dense` on inputs of any rank: example i's kernel gradient is A_i^T G_i."""

    @classmethod
    def matches(cls, layer):
        return plain(layer, keras.layers.Dense)

    def call(self, recorder, original, inputs, *args, **kwargs):
        layer = self.layer
        recorder.check_batch_axis(inputs, layer)
        outputs, index = call_with_probed_activation(
            recorder, layer, original, inputs, *args, **kwargs)

        def finish(gradient_of):
            gradient = gradient_of(index)
            if gradient is None:
                return []
            m, dtype = recorder.batch_size, compute_dtype(layer.kernel)
            records = [(layer.kernel, Outer(flat_tokens(inputs, m, dtype),
                                            flat_tokens(gradient, m, dtype), layer.kernel.shape))]
            if layer.bias is not None:
                records.append((layer.bias, bias_gradient(gradient, layer.bias)))
            return records

        recorder.on_gradients(finish)
        return outputs
