"""Clipping by privacy unit: each unit's SUMMED gradient is clipped to C.

With a privacy unit larger than one example (a user, an account), the
quantity DP-SGD must bound is a unit's whole contribution to the noisy sum,
not each example's. A `tf_megadp.PrivacyUnitSampler` lays every micro-batch
out as consecutive slots of k rows, one unit per slot (padding rows have
weight 0), so rows `[u k, (u + 1) k)` are unit u. The strategies then

- compute the norm of each unit's summed gradient, ||G_u|| = ||sum_{i in u} g_i||,
  by regrouping the per-example terms of every variable (`regrouped`): for
  `Outer` and `Gather` terms a unit is one longer sequence (its rows'
  tokens side by side, [U, k T, d]), so the Gram forms include every cross
  term between the unit's examples and stay exact without per-example
  gradients; an `Explicit` term (and any term kind this module does not
  know, through its `dense()` per-example gradients) is summed over the
  unit's rows;
- give every row of unit u the unit's factor c_u = min(1, C / ||G_u||), so
  that the clipped sum of the rows, sum_i c_{u(i)} g_i, is sum_u c_u G_u.

With k = 1 both steps are the identity: per-example clipping is the unit of
one example.
"""

from __future__ import annotations

import tensorflow as tf

from tf_megadp.clipping.terms import Explicit, Gather, Outer, Term
from tf_megadp.errors import PrivacyConfigurationError

__all__ = ["check_unit_layout", "regrouped", "unit_rows"]


def check_unit_layout(rows, examples_per_unit: int) -> None:
    """Refuses a micro-batch that is not a whole number of unit slots.

    Args:
        rows: the micro-batch's rows (a Python int, or None when unknown).
        examples_per_unit: k.

    Raises:
        PrivacyConfigurationError: `rows` is not a multiple of k.
    """
    if (isinstance(examples_per_unit, bool) or not isinstance(examples_per_unit, int)
            or examples_per_unit < 1):
        raise ValueError(f"examples_per_unit must be an integer >= 1, got {examples_per_unit!r}.")
    if isinstance(rows, int) and rows % examples_per_unit:
        raise PrivacyConfigurationError(
            f"A micro-batch of {rows} rows is not a whole number of privacy-unit slots "
            f"of {examples_per_unit} rows: some unit would be split between two "
            "clipped sums. Feed the micro-batches of a tf_megadp.PrivacyUnitSampler "
            "unchanged, with DPOptimizer(examples_per_unit=sampler.examples_per_unit)."
        )


def _joined(tensor, examples_per_unit: int):
    """[m, T, ...] -> [m / k, k T, ...]: the rows of a unit side by side along axis 1."""
    k = examples_per_unit
    static = tensor.shape.as_list()
    if all(d is not None for d in static[1:]):
        return tf.reshape(tensor, [-1, k * static[1]] + static[2:])
    dynamic = tf.shape(tensor)
    joined = tf.reshape(tensor, tf.concat([[-1, k * dynamic[1]], dynamic[2:]], axis=0))
    joined.set_shape([None, None if static[1] is None else k * static[1]] + static[2:])
    return joined


def regrouped(term: Term, examples_per_unit: int) -> Term:
    """The term whose "examples" are units: unit u's gradient is its rows' sum.

    Args:
        term: a record of one variable, rows [m] (m a multiple of k).
        examples_per_unit: k, consecutive rows per unit.

    Returns:
        A term of m / k rows. `Outer` and `Gather` keep their compact forms
        (a unit is a sequence of k T tokens), everything else becomes
        `Explicit` (the per-unit sums of its per-example gradients).
    """
    k = examples_per_unit
    if k == 1:
        return term
    if type(term) is Outer:
        return Outer(_joined(term.left, k), _joined(term.right, k), term.shape)
    if type(term) is Gather:
        return Gather(_joined(term.ids, k), _joined(term.values, k), term.shape)
    # Explicit, and kinds registered elsewhere: exact through the per-example
    # gradients (no kind can be clipped wrongly for want of a unit form).
    per_example = term.dense()
    per_unit = tf.reduce_sum(
        tf.reshape(per_example, tf.concat([[-1, k], tf.shape(per_example)[1:]], axis=0)), axis=1)
    per_unit = tf.ensure_shape(per_unit, [None] + list(term.shape))
    return Explicit(per_unit, term.shape)


def unit_rows(per_unit, examples_per_unit: int):
    """[U] per-unit values -> [U k]: each row gets its unit's value."""
    if examples_per_unit == 1:
        return per_unit
    return tf.repeat(per_unit, examples_per_unit, axis=0)
