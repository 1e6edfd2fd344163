"""Ghost rules for Keras LoRA: `Dense` and `EinsumDense` after `enable_lora(rank)`.

With LoRA enabled, Keras (3.15, `Dense.kernel`, `EinsumDense.kernel`) computes
the layer with the merged kernel K = W + s A B, s = lora_alpha / lora_rank,
and freezes W: A holds the kernel's axes but the last, then the rank r; B is
[r, L], L the kernel's last axis. Example i's gradient of K is, as for the
layer without LoRA, an outer product over its tokens, X_i^T G_i (`Outer`:
X the layer's input, G its pre-activation output gradient, both laid out as
the kernel's leading and trailing axes). Through the product A B:

    dA_i = s G_K,i B^T = X_i^T (s G_i B^T)       Outer(X, s G B^T)
    dB_i = s A^T G_K,i = (s X_i A)^T G_i         Outer(s X A, G)

two `Outer` terms whose inner widths are the rank: norms and clipped sums
follow without any per-example gradient of W's size, in the form
`terms.Outer` picks (the per-example [p, r] and [r, d] gradients where they
are smaller than the records, Gram forms otherwise). When the kernel's
trailing letters are several axes (an attention projection "abc,cde->abde":
heads, then head size), the leading ones besides the last become extra
"tokens" of the B term. The base kernel W, frozen by `enable_lora`, gets a
record (Outer(X, G), as without LoRA) only if the user unfreezes it.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_megadp import _keras_compat
from tf_megadp.clipping.ghost_rules.dense import DenseRule
from tf_megadp.clipping.ghost_rules.einsum import EinsumDenseRule, einsum_plan
from tf_megadp.clipping.rules import builtin_rule
from tf_megadp.clipping.terms import Outer, compute_dtype

__all__ = ["LoraDenseRule", "LoraEinsumDenseRule", "factor_terms"]


def factor_terms(left, right, lora_kernel_a, lora_kernel_b, scale: float,
                 batch_size) -> tuple[Outer, Outer]:
    """Example i's gradients of the LoRA factors, from those of the merged kernel.

    Args:
        left: [m, T, F], the kernel's leading axes (the layer's inputs, laid out).
        right: [m, T, S * L], its trailing ones (the output gradient), the
            kernel's last axis (L) last: example i's gradient of the merged
            kernel is left_i^T right_i.
        lora_kernel_a: A, [..., r] with F * S entries before r.
        lora_kernel_b: B, [r, L].
        scale: s = lora_alpha / lora_rank.
        batch_size: m, a scalar tensor.

    Returns:
        (the A term, the B term), in `left`'s dtype.

    Example:
    ```python
    a_term, b_term = factor_terms(x, g, layer.lora_kernel_a, layer.lora_kernel_b,
                                  layer.lora_alpha / layer.lora_rank, m)
    ```
    """
    rank, last = lora_kernel_b.shape
    dtype = left.dtype
    groups = right.shape[-1] // last  # S: the trailing axes before the last
    tokens = left.shape[1]
    grouped = tokens * groups if tokens is not None else -1
    right = tf.reshape(right, [batch_size, -1, groups, last])
    # s G B^T: the output gradient brought down to the rank, per group.
    lowered = scale * tf.einsum("mtgl,rl->mtgr", right, tf.cast(lora_kernel_b, dtype))
    a_term = Outer(left, tf.reshape(lowered, [batch_size, -1 if tokens is None else tokens,
                                              groups * rank]),
                   lora_kernel_a.shape)
    # s X A: the input brought down to the rank; each group is a token of B.
    factor_a = tf.reshape(tf.cast(lora_kernel_a, dtype), [left.shape[-1], groups, rank])
    raised = scale * tf.einsum("mtf,fgr->mtgr", left, factor_a)
    b_term = Outer(tf.reshape(raised, [batch_size, grouped, rank]),
                   tf.reshape(right, [batch_size, grouped, last]), lora_kernel_b.shape)
    return a_term, b_term


def _lora_plain(layer, cls) -> bool:
    """`layer` is a `cls` running Keras's own call and merged kernel, with LoRA, unquantized."""
    return (isinstance(layer, cls) and type(layer).call is cls.call
            and type(layer).kernel is cls.kernel
            and getattr(layer, "lora_enabled", False)
            and getattr(layer, "quantization_mode", None) is None
            and _base_kernel(layer) is not None)


class _LoraRecords:
    """The kernel records of a LoRA layer: A, B, and W where the model trains it."""

    def kernel_records(self, inputs, gradient, batch_size):
        layer = self.layer
        factors = layer.lora_kernel_a, layer.lora_kernel_b
        sides = self.kernel_sides(inputs, gradient, batch_size, compute_dtype(factors[0]))
        records = list(zip(factors, factor_terms(*sides, *factors,
                                                 layer.lora_alpha / layer.lora_rank,
                                                 batch_size)))
        base = _base_kernel(layer)
        if base.trainable:  # frozen by enable_lora; a user may unfreeze it
            records.append((base, Outer(*self.kernel_sides(inputs, gradient, batch_size,
                                                           compute_dtype(base)), base.shape)))
        return records


def _base_kernel(layer) -> keras.Variable | None:
    """W: the layer's one own variable that is neither the bias nor a LoRA factor, or None."""
    others = {id(layer.lora_kernel_a), id(layer.lora_kernel_b), id(layer.bias)}
    rest = [v for v in _keras_compat.own_trainable_variables(layer) if id(v) not in others]
    return rest[0] if len(rest) == 1 else None


@builtin_rule(keras.layers.Dense)
class LoraDenseRule(_LoraRecords, DenseRule):
    """`keras.layers.Dense` with LoRA: Outer(x, s δ B^T) for A, Outer(s x A, δ) for B, the bias."""

    @classmethod
    def matches(cls, layer):
        return _lora_plain(layer, keras.layers.Dense)


@builtin_rule(keras.layers.EinsumDense)
class LoraEinsumDenseRule(_LoraRecords, EinsumDenseRule):
    """`keras.layers.EinsumDense` with LoRA (keras-hub attention projections).

    Covers the equations `EinsumDenseRule` covers whose kernel ends with an
    output axis, or lists its output axes first (every projection of Keras
    and keras-hub attention); others fall back (auto) or are refused (ghost).
    """

    @classmethod
    def matches(cls, layer):
        if not _lora_plain(layer, keras.layers.EinsumDense):
            return False
        plan = einsum_plan(layer.equation)
        # The last kernel axis must be on the right-hand side of the Outer.
        return plan is not None and (plan.swap or bool(plan.produced))
