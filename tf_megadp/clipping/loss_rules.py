"""Per-example losses computed on the whole micro-batch, for losses whose examples provably stay apart.

Ghost clipping needs each example's loss and its gradient with respect to
the example's own predictions. In general that is `model.compute_loss` on
a batch of one, run for every example under `tf.vectorized_map`
(`base.per_example_loss`): right for any loss, but at a vocabulary head it
costs a pfor of the cross-entropy over [m, T, V] logits, whose buffers
XLA keeps beside the step's records (docs/benchmarks.md, "Where the DP
step's memory goes at the GPT-2 shape"). A *loss rule* computes the same
per-example losses with one batched op whose rows never meet, so the
gradient of their sum is every example's own gradient, stacked.

A rule is used only when both hold:

* the model's loss is one the rule knows (`LOSS_RULES`, by class and
  settings), it is the model's only loss, and `compute_loss` is Keras's;
* on one random example of the micro-batch's shapes, the rule's loss and
  gradient equal `base.per_example_loss`'s (relative 1e-5), checked
  eagerly when the step is traced (relative 1e-10 for float64
  predictions). A Keras whose reduction differs, loss
  weights, or a mask on the predictions fail it, and the step falls back
  to `vectorized_map`: a rule can make the step faster, never different.

Example:
```python
losses = batched_losses(model, y, y_pred, sample_weight)  # None: no rule applies
```
"""

from __future__ import annotations

from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from tf_megadp import _keras_compat
from tf_megadp.clipping import base

__all__ = ["LOSS_RULES", "batched_losses"]

# Relative tolerance of the agreement check, by the predictions' dtype:
# the same arithmetic in another order (float16 and bfloat16 predictions are
# cast to the loss's float32, as Keras casts them).
_AGREEMENT = {tf.float64: 1e-10}
_AGREEMENT_DEFAULT = 1e-5


def _sparse_categorical_crossentropy(loss, y, y_pred, sample_weight):
    """Keras's `SparseCategoricalCrossentropy(from_logits=True)` per example, [m].

    Per example, as Keras reduces a batch of one ("sum_over_batch_size"):
    the weighted sum of its positions' cross-entropies over its number of
    positions.
    """
    if (not loss.from_logits or loss.ignore_class is not None
            or getattr(loss, "axis", -1) not in (-1, None)):
        return None
    # Keras computes a loss in its own dtype (float32 unless it says otherwise).
    logits = tf.cast(y_pred, loss.dtype or "float32")
    labels = tf.cast(y, tf.int32)
    if labels.shape.rank == logits.shape.rank:  # a trailing axis of 1, as Keras accepts
        labels = tf.squeeze(labels, axis=-1)
    if labels.shape.rank != logits.shape.rank - 1 or labels.shape.rank < 1:
        return None
    # log-sum-exp less the label's logit, in the logits' own shape: its
    # gradient, softmax less the one-hot labels, is one elementwise pass
    # that the head's backward product and its ghost record both read. (The
    # fused op works on a [m T, V] reshape, and XLA then built the gradient
    # twice, once per shape: 125 MiB more at the GPT-2 shape.)
    classes = tf.shape(logits)[-1]
    label_logits = tf.reduce_sum(logits * tf.one_hot(labels, classes, dtype=logits.dtype),
                                 axis=-1)
    values = tf.reduce_logsumexp(logits, axis=-1) - label_logits
    # A label outside [0, V) has no one-hot row: NaN, as the fused op gives
    # under XLA, so that the step counts the example as non-finite instead
    # of training it on the log-sum-exp alone.
    values = tf.where((labels >= 0) & (labels < classes), values,
                      tf.constant(float("nan"), values.dtype))
    if sample_weight is not None:
        weights = tf.cast(sample_weight, values.dtype)
        if weights.shape.rank == 1 and values.shape.rank > 1:
            weights = tf.reshape(weights, [-1] + [1] * (values.shape.rank - 1))
        elif weights.shape.rank != values.shape.rank:
            return None
        values = values * weights
    positions = tf.cast(tf.reduce_prod(tf.shape(values)[1:]), values.dtype)
    losses = tf.reduce_sum(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1) / positions
    return tf.cast(losses, tf.float32)  # as `base.per_example_loss` returns them


# Loss class -> rule(loss, y, y_pred, sample_weight) -> per-example losses [m]
# (float32, computed in the loss's dtype), or None when the loss's settings
# are ones the rule does not cover.
LOSS_RULES: dict[type, Callable] = {
    keras.losses.SparseCategoricalCrossentropy: _sparse_categorical_crossentropy,
}


def _rule_for(model):
    """(rule, loss) for the model's only loss, or None."""
    if type(model).compute_loss is not keras.Model.compute_loss:
        return None
    loss = getattr(model, "loss", None)
    if type(loss) not in LOSS_RULES or loss.reduction != "sum_over_batch_size":
        return None
    return LOSS_RULES[type(loss)], loss


def _one_random_example(tensor, rng, integer_bound=None):
    shape = [1] + tensor.shape.as_list()[1:]
    if tensor.dtype.is_integer:
        return tf.constant(rng.integers(0, integer_bound, size=shape), tensor.dtype)
    return tf.constant(rng.normal(size=shape), tensor.dtype)


def _agrees(model, rule, loss, y, y_pred, sample_weight) -> bool:
    """Whether the rule gives `base.per_example_loss`'s loss and gradient on a random example."""
    if not (y_pred.shape[1:].is_fully_defined() and y.shape[1:].is_fully_defined()):
        return False
    if sample_weight is not None and not sample_weight.shape[1:].is_fully_defined():
        return False
    # A fixed seed: these values are no data and no secret, only a probe of
    # the formula.
    rng = np.random.default_rng(0)

    def probe(logits, labels, weights):
        # tf.gradients, not a tape: init_scope pauses every tape.
        expected = base.per_example_loss(model, None, labels, logits, weights)
        found = rule(loss, labels, logits, weights)
        if found is None:
            return None
        found = tf.reshape(found, [])
        return (expected, found) + tuple(tf.gradients(value, logits)[0]
                                         for value in (expected, found))

    try:
        with tf.init_scope():  # eager, outside the step being traced
            logits = _one_random_example(y_pred, rng)
            labels = _one_random_example(y, rng, integer_bound=y_pred.shape[-1])
            weights = (None if sample_weight is None
                       else tf.abs(_one_random_example(sample_weight, rng)))
            values = tf.function(probe, autograph=False)(logits, labels, weights)
    except (TypeError, ValueError, tf.errors.OpError):
        # compute_loss cannot run on one example outside the step (a
        # strategy's replica context, labels of another kind): no rule.
        return False
    if values is None or any(value is None for value in values):
        return False
    expected, found, expected_gradient, found_gradient = (value.numpy() for value in values)

    tolerance = _AGREEMENT.get(y_pred.dtype, _AGREEMENT_DEFAULT)

    def close(a, b):
        return bool(np.allclose(a, b, rtol=tolerance,
                                atol=tolerance * float(np.max(np.abs(a)) or 1.0)))

    return close(expected, found) and close(expected_gradient, found_gradient)


def batched_losses(model, y, y_pred, sample_weight) -> tf.Tensor | None:
    """Every example's loss [m], computed batched, or None when no rule applies.

    Args:
        model: the compiled model.
        y, y_pred, sample_weight: the micro-batch's labels, predictions (one
            tensor) and weights (or None).

    Returns:
        float32 [m] (as `base.per_example_loss`): example i's loss, a
        function of y_pred[i] alone (so the gradient of their sum with
        respect to y_pred is each example's own gradient); or None: compute
        them per example.
    """
    if not isinstance(y_pred, tf.Tensor) or not isinstance(y, tf.Tensor):
        return None
    if _keras_compat.get_keras_mask(y_pred) is not None:
        return None
    chosen = _rule_for(model)
    if chosen is None:
        return None
    rule, loss = chosen
    if not _agrees(model, rule, loss, y, y_pred, sample_weight):
        return None
    return rule(loss, y, y_pred, sample_weight)
