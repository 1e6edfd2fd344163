"""Ghost rule for `keras.layers.EinsumDense` (MultiHeadAttention, transformer blocks)."""

from __future__ import annotations

from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

from tf_megadp.clipping.rules import KernelBiasRule, builtin_rule, plain
from tf_megadp.clipping.terms import Outer

__all__ = ["EinsumDenseRule", "EinsumPlan", "einsum_plan"]


class EinsumPlan(NamedTuple):
    """How an EinsumDense equation maps to [m, T, P] x [m, T, D] per example."""

    to_left: str  # einsum taking the input to batch + tokens + P letters
    to_right: str  # einsum taking the output gradient to batch + tokens + D letters
    kernel: str  # the kernel's letters
    contracted: str  # P: kernel letters summed against the input
    produced: str  # D: kernel letters that appear in the output
    swap: bool  # kernel letters are D then P (the gradient is right^T left)


def einsum_plan(equation: str) -> EinsumPlan | None:
    """Splits an EinsumDense equation into token, contracted and output letters.

    Args:
        equation: the layer's equation, e.g. "abc,cde->abde".

    Returns:
        The plan, or None for equations ghost norms do not cover (ellipses,
        kernel letters kept in both input and output, batch axis in the
        kernel, or kernel letters whose order interleaves input and output
        axes).
    """
    if "..." in equation:
        return None
    inputs, rest = equation.split(",")
    kernel, outputs = rest.split("->")
    batch = inputs[0]
    if outputs[:1] != batch or batch in kernel:
        return None
    contracted = [c for c in kernel if c in inputs and c not in outputs]
    produced = [c for c in kernel if c in outputs and c not in inputs]
    if len(contracted) + len(produced) != len(kernel):
        return None
    tokens = "".join(c for c in inputs[1:] if c in outputs and c not in kernel)
    p, d = "".join(contracted), "".join(produced)
    if kernel == p + d:
        swap = False
    elif kernel == d + p:
        swap = True
    else:
        return None
    return EinsumPlan(f"{inputs}->{batch}{tokens}{p}", f"{outputs}->{batch}{tokens}{d}",
                      kernel, p, d, swap)


@builtin_rule(keras.layers.EinsumDense)
class EinsumDenseRule(KernelBiasRule):
    """`keras.layers.EinsumDense`: Outer of the input and output gradient, regrouped by letters."""

    @classmethod
    def matches(cls, layer):
        return plain(layer, keras.layers.EinsumDense) and einsum_plan(layer.equation) is not None

    def kernel_term(self, inputs, gradient, batch_size, dtype):
        return Outer(*self.kernel_sides(inputs, gradient, batch_size, dtype),
                     self.layer.kernel.shape)

    def kernel_sides(self, inputs, gradient, batch_size, dtype):
        """(L, R), [m, T, *] each: example i's kernel gradient is L_i^T R_i.

        L holds the kernel's leading letters and R its trailing ones, in the
        kernel's order (the input's and the output gradient's sides, swapped
        when the kernel lists its output letters first).
        """
        plan = einsum_plan(self.layer.equation)
        left = tf.einsum(plan.to_left, tf.cast(inputs, dtype))
        right = tf.einsum(plan.to_right, tf.cast(gradient, dtype))
        sizes = dict(zip(plan.kernel, self.layer.kernel.shape))
        size = lambda letters: int(np.prod([sizes[c] for c in letters]))
        left = tf.reshape(left, [batch_size, -1, size(plan.contracted)])
        right = tf.reshape(right, [batch_size, -1, size(plan.produced)])
        return (right, left) if plan.swap else (left, right)
