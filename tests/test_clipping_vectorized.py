"""Vectorized clipping: fully vectorized per-example passes, and the model's dtype.

- Tracing the DP step of a keras-hub BertMaskedLM with dropout must not make
  pfor fall back to a while_loop over the examples (it did for the gradient of
  `tf.slice` under XLA and for dropout's per-example seeds).
- Dropout still gives every example its own mask, with Keras's arithmetic.
- float64 models clip and sum in float64 (checked against the naive reference
  at a tolerance float32 cannot meet); bfloat16 models norm and sum in float32.
"""

import contextlib
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_megadp
from tf_megadp.clipping import vectorized
from tf_megadp.clipping.vectorized import VectorizedClipping
from tests import reference
from tests.log_records import logged_messages

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# A Keras loss computes in floatx (float32) unless told otherwise.
LOSS64 = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")
FALLBACK = "Using a while_loop for converting"


@contextlib.contextmanager
def pfor_fallbacks():
    """Collects pfor's fallback messages (TensorFlow's 'tensorflow' logger)."""
    fallbacks = []
    with logged_messages("tensorflow", logging.DEBUG) as messages:
        try:
            yield fallbacks
        finally:
            fallbacks.extend(m for m in messages if FALLBACK in m)


def test_the_fallback_detector_sees_a_fallback():
    # Negative control: tf.linalg.global_norm has no pfor converter.
    with pfor_fallbacks() as fallbacks:
        tf.function(lambda t: tf.vectorized_map(lambda r: tf.linalg.global_norm([r]), t))(
            tf.ones([3, 2]))
    assert fallbacks, "the log handler did not see pfor's fallback warning"


@pytest.mark.filterwarnings("ignore:DPOptimizer with noise_multiplier=0")
def test_bert_dp_step_has_no_while_loop_fallback():
    model = reference.tiny_bert(dropout=0.1)
    x, y, w = reference.bert_batch(4)
    tf_megadp.make_private(model)
    model.compile(
        optimizer=tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
                                        noise_multiplier=0.0, clipping="vectorized",
                                        seed=0),
        loss=LOSS)
    with pfor_fallbacks() as fallbacks:
        model.train_on_batch(x, y, sample_weight=w)
    assert not fallbacks, fallbacks


def test_bert_per_example_gradients_match_naive_reference():
    # Covers the batched XlaDynamicUpdateSlice (PositionEmbedding's slice
    # gradient under XLA) numerically.
    model = reference.tiny_bert(dropout=0.0)
    x, y, w = reference.bert_batch(3)
    model.compile(loss=LOSS)
    naive = reference.naive_per_example_gradients(model, LOSS, x, y, w)
    norms = np.array([np.sqrt(sum(np.sum(g**2) for g in gs)) for gs in naive])
    clip = float(np.median(norms))
    batch = VectorizedClipping().clip_and_sum(model, x, y, w, clip)
    np.testing.assert_allclose(batch.norms.numpy(), norms, rtol=1e-4)
    for j, variable in enumerate(model.trainable_variables):
        want = sum(gs[j] * min(1.0, clip / n) for gs, n in zip(naive, norms))
        got = batch.gradient_sum[j]
        got = np.zeros(variable.shape) if got is None else got.numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=variable.path)


def dropout_model(noise_shape=None):
    inputs = keras.Input((4, 16))
    dropped = keras.layers.Dropout(0.5, noise_shape=noise_shape)(inputs)
    outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")(
        keras.layers.Flatten()(dropped))
    model = keras.Model(inputs, outputs)
    model.compile(loss=keras.losses.MeanSquaredError())
    return model


@pytest.mark.parametrize("noise_shape", [None, (None, 1, 16)])
def test_dropout_masks_are_per_example_with_keras_arithmetic(noise_shape):
    keras.utils.set_random_seed(0)
    model = dropout_model(noise_shape)
    m = 32
    x = np.ones((m, 4, 16), "float32")
    y = np.zeros((m, 1), "float32")
    strategy = VectorizedClipping()
    (kernel,), _, y_pred = strategy.per_example_gradients(model, x, y)
    kernel = kernel.numpy().reshape(m, 4, 16)
    keep = kernel != 0
    # Kept inputs are scaled by 1 / (1 - rate) = 2: prediction = 2 * kept,
    # and d(pred^2)/d kernel_j = 2 * pred * 2 on kept positions.
    prediction = 2.0 * keep.reshape(m, -1).sum(axis=1)
    np.testing.assert_allclose(y_pred.numpy()[:, 0], prediction, rtol=1e-6)
    np.testing.assert_allclose(kernel, 4.0 * prediction[:, None, None] * keep, rtol=1e-6)
    assert 0.4 < keep.mean() < 0.6
    assert len({row.tobytes() for row in keep}) == m, "two examples shared a mask"
    if noise_shape is not None:
        assert np.all(keep == keep[:, :1, :]), "noise_shape did not broadcast over axis 1"
    # The next micro-batch draws fresh masks.
    (again,), _, _ = strategy.per_example_gradients(model, x, y)
    assert not np.array_equal(again.numpy().reshape(m, 4, 16) != 0, keep)


def float_model(dtype, loss=LOSS):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((5,), dtype=dtype),
        keras.layers.Dense(6, activation="tanh", dtype=dtype),
        keras.layers.Dense(3, dtype=dtype),
    ])
    model.compile(loss=loss)
    return model


def float_data(n=6, dtype="float32"):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 5)).astype(dtype), rng.integers(0, 3, n).astype("int32")


def test_float64_model_clips_and_sums_in_float64():
    model = float_model("float64", LOSS64)
    x, y = float_data(dtype="float64")
    naive = reference.naive_per_example_gradients(model, LOSS64, x, y)
    norms = np.array([np.sqrt(sum(np.sum(g**2) for g in gs)) for gs in naive])
    # A clip that is not a float32 number, between the norms: some examples
    # are clipped, some not.
    clip = float(np.median(norms)) + 1e-9
    batch = VectorizedClipping().clip_and_sum(model, x, y, None, clip)
    assert batch.norms.dtype == tf.float64
    # float32 arithmetic anywhere (norms, factors, C, sums) fails 1e-12.
    np.testing.assert_allclose(batch.norms.numpy(), norms, rtol=1e-12)
    for j, got in enumerate(batch.gradient_sum):
        assert got.dtype == tf.float64
        want = sum(gs[j] * min(1.0, clip / n) for gs, n in zip(naive, norms))
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-15)


@pytest.mark.filterwarnings("ignore:DPOptimizer with noise_multiplier=0")
@pytest.mark.filterwarnings("ignore:arrays passed to fit")
def test_float64_model_trains_through_fit_like_the_naive_reference():
    model = float_model("float64", LOSS64)
    # Keras's fit casts float inputs to floatx (float32): give it inputs that
    # float32 holds exactly, so that fit and the reference see the same data.
    x, y = float_data(dtype="float32")
    x = x.astype("float64")
    clip = 0.3
    expected = reference.naive_clipped_update(model, LOSS64, x, y, clip, divisor=6)
    before = reference.weights(model)
    tf_megadp.make_private(model)
    model.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.SGD(1.0), l2_norm_clip=clip, noise_multiplier=0.0,
        clipping="vectorized", seed=0), loss=LOSS64)
    model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    for after, b, e in zip(reference.weights(model), before, expected):
        np.testing.assert_allclose(after - b, e, rtol=1e-10, atol=1e-14)


def test_bfloat16_model_norms_and_sums_in_float32(monkeypatch):
    model = float_model("bfloat16")
    x, y = float_data()
    gradients, losses, y_pred = VectorizedClipping().per_example_gradients(model, x, y)
    per_example = [g.numpy().astype(np.float64) for g in gradients]
    norms = np.sqrt(sum(np.sum(g.reshape(len(x), -1) ** 2, axis=1) for g in per_example))
    clip = float(np.median(norms))
    # Exactly these bfloat16 gradients enter the norms and the sum (XLA and
    # eager round bfloat16 differently, so they are not recomputed).
    monkeypatch.setattr(vectorized, "_per_example_gradients",
                        lambda *args: (gradients, losses, y_pred))
    batch = vectorized._clip_and_sum(model, x, y, None, tf.constant(clip, tf.float64))
    assert batch.norms.dtype == tf.float32
    # A bfloat16 sum of squares is off by ~1e-2; float32 by ~1e-7.
    np.testing.assert_allclose(batch.norms.numpy(), norms, rtol=1e-5)
    factors = np.minimum(1.0, clip / norms)
    for g, got in zip(per_example, batch.gradient_sum):
        assert got.dtype == tf.float32
        want = np.tensordot(factors, g, axes=1)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
