"""Specification of `tf_megadp.clipping.loss_rules`: per-example losses computed batched.

A rule gives every example's loss exactly as `compute_loss` on a batch of
one gives it (the naive loop below), reads each example's own predictions
only, and is used only for the losses and settings it was checked for:
any other loss, loss weight or `compute_loss` falls back (None), so a rule
can make the step faster, never different.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_megadp.clipping import base
from tf_megadp.clipping.loss_rules import batched_losses

M, T, V = 5, 6, 40


def sequence_model(loss=None, **compile_settings):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((T,), dtype="int32"), keras.layers.Embedding(V, 8),
                              keras.layers.Dense(V)])
    model.compile(loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  **compile_settings)
    return model


def batch(seed=0):
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.integers(0, V, size=(M, T)), tf.int32)
    y = tf.constant(rng.integers(0, V, size=(M, T)), tf.int32)
    token_weights = tf.constant(rng.integers(0, 2, size=(M, T)), tf.float32)
    return x, y, token_weights


def naive(model, y, y_pred, weights):
    """Each example's loss and its gradient, one `compute_loss` on a batch of one at a time."""
    losses, gradients = [], []
    for i in range(M):
        logits = y_pred[i:i + 1]
        with tf.GradientTape() as tape:
            tape.watch(logits)
            loss = base.per_example_loss(model, None, y[i:i + 1], logits,
                                         None if weights is None else weights[i:i + 1])
        losses.append(loss.numpy())
        gradients.append(tape.gradient(loss, logits)[0].numpy())
    return np.array(losses), np.stack(gradients)


@pytest.mark.parametrize("weighting", ["tokens", "examples", "none"])
def test_the_cross_entropy_rule_equals_compute_loss_on_each_example(weighting):
    model = sequence_model()
    x, y, token_weights = batch()
    weights = {"tokens": token_weights, "examples": tf.constant([1.0, 0.0, 2.0, 0.5, 1.0]),
               "none": None}[weighting]
    y_pred = model(x)
    with tf.GradientTape() as tape:
        tape.watch(y_pred)
        losses = batched_losses(model, y, y_pred, weights)
        total = tf.reduce_sum(losses)
    expected_losses, expected_gradients = naive(model, y, y_pred, weights)
    np.testing.assert_allclose(losses.numpy(), expected_losses, rtol=1e-6)
    np.testing.assert_allclose(tape.gradient(total, y_pred).numpy(), expected_gradients,
                               rtol=1e-5, atol=1e-8)


def test_the_rule_stays_exact_where_logits_are_far_apart():
    """Logits spread over hundreds (a confident model): no overflow, the same losses and gradients."""
    model = sequence_model()
    x, y, weights = batch()
    y_pred = 2000.0 * model(x)
    assert float(tf.reduce_max(y_pred) - tf.reduce_min(y_pred)) > 100.0
    with tf.GradientTape() as tape:
        tape.watch(y_pred)
        losses = batched_losses(model, y, y_pred, weights)
        total = tf.reduce_sum(losses)
    expected_losses, expected_gradients = naive(model, y, y_pred, weights)
    assert np.all(np.isfinite(losses.numpy()))
    np.testing.assert_allclose(losses.numpy(), expected_losses, rtol=1e-6)
    np.testing.assert_allclose(tape.gradient(total, y_pred).numpy(), expected_gradients,
                               rtol=1e-5, atol=1e-8)


def test_a_label_outside_the_classes_makes_its_example_nan_as_the_fused_op_does():
    """Attack: a label V (or -1) must not train on the log-sum-exp alone; under XLA the
    fused cross-entropy gives NaN, which the step counts as a non-finite example."""
    model = sequence_model()
    x, y, weights = batch()
    y = tf.tensor_scatter_nd_update(y, [[1, 2], [3, 0]], [V, -1])
    y_pred = model(x)
    losses = batched_losses(model, y, y_pred, None).numpy()
    fused = tf.function(lambda logits, labels: tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits), jit_compile=True)(y_pred, y).numpy()
    assert np.isnan(fused[1, 2]) and np.isnan(fused[3, 0])
    assert np.isnan(losses[[1, 3]]).all() and np.isfinite(losses[[0, 2, 4]]).all()
    np.testing.assert_allclose(losses[[0, 2, 4]], fused[[0, 2, 4]].mean(axis=1), rtol=1e-5)


def test_an_example_loss_reads_its_own_predictions_only():
    model = sequence_model()
    x, y, weights = batch()
    y_pred = model(x)
    moved = tf.tensor_scatter_nd_add(y_pred, [[0]], 100.0 * tf.ones([1, T, V]) * tf.range(
        V, dtype=tf.float32))
    before = batched_losses(model, y, y_pred, weights).numpy()
    after = batched_losses(model, y, moved, weights).numpy()
    assert after[0] != before[0]
    np.testing.assert_array_equal(after[1:], before[1:])


class _OwnLoss(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return 2.0 * super().compute_loss(x, y, y_pred, sample_weight, training)


@pytest.mark.parametrize("settings", [
    dict(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=False)),
    dict(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)),
    dict(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")),
    dict(loss_weights=0.5),
    dict(loss="sparse_categorical_crossentropy"),
], ids=["probabilities", "ignore_class", "sum", "loss_weights", "by_name"])
def test_a_loss_no_rule_was_checked_for_falls_back(settings):
    model = sequence_model(**settings)
    x, y, weights = batch()
    assert batched_losses(model, y, model(x), weights) is None


def test_a_model_with_its_own_compute_loss_falls_back():
    inputs = keras.Input((T,), dtype="int32")
    model = _OwnLoss(inputs, keras.layers.Dense(V)(keras.layers.Embedding(V, 8)(inputs)))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y, weights = batch()
    assert batched_losses(model, y, model(x), weights) is None


def test_inside_a_compiled_step_the_rule_is_the_traced_loss():
    model = sequence_model()
    x, y, weights = batch()

    @tf.function(jit_compile=True)
    def losses(x, y, weights):
        return batched_losses(model, y, model(x), weights)

    expected, _ = naive(model, y, model(x), weights)
    np.testing.assert_allclose(losses(x, y, weights).numpy(), expected, rtol=1e-5)
