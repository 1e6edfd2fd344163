"""Ghost rule for `keras.layers.Dense`: Outer(inputs, dL/dpre-activation) plus the bias."""

from __future__ import annotations

import keras

from tf_megadp.clipping.rules import KernelBiasRule, builtin_rule, flat_tokens, plain
from tf_megadp.clipping.terms import Outer


@builtin_rule(keras.layers.Dense)
class DenseRule(KernelBiasRule):
    """`keras.layers.Dense` on inputs of any rank: example i's kernel gradient is A_i^T G_i."""

    @classmethod
    def matches(cls, layer):
        return plain(layer, keras.layers.Dense)

    def kernel_term(self, inputs, gradient, batch_size, dtype):
        return Outer(*self.kernel_sides(inputs, gradient, batch_size, dtype),
                     self.layer.kernel.shape)

    def kernel_sides(self, inputs, gradient, batch_size, dtype):
        """(A, G), [m, T, p] and [m, T, d]: example i's kernel gradient is A_i^T G_i."""
        return flat_tokens(inputs, batch_size, dtype), flat_tokens(gradient, batch_size, dtype)
