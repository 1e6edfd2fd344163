"""A logical batch of 1,048,576 examples is one exact update on this machine.

256 micro-batches of 4,096 examples on a linear model; the reference is the
closed-form per-example gradient of the squared error, computed in float64.
"""

import keras
import numpy as np
import pytest

import tf_megadp

MICRO_BATCH, STEPS, FEATURES, CLIP = 4096, 256, 8, 0.5


@pytest.mark.filterwarnings("ignore:DPOptimizer with noise_multiplier=0")
def test_one_update_from_a_million_examples():
    n = MICRO_BATCH * STEPS
    assert n == 1_048_576
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    model = tf_megadp.make_private(keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)]))
    optimizer = tf_megadp.DPOptimizer(keras.optimizers.SGD(1.0), l2_norm_clip=CLIP,
                                      noise_multiplier=0.0, accumulation_steps=STEPS, seed=0)
    model.compile(optimizer=optimizer, loss="mse")
    kernel, bias = (v.numpy().astype(np.float64) for v in model.trainable_variables)

    # d/dw (w.x + b - y)^2 = 2 r x and d/db = 2 r, with r the residual.
    residual = 2.0 * (x.astype(np.float64) @ kernel + bias - y)
    per_example = np.concatenate([residual * x, residual], axis=1)
    norms = np.linalg.norm(per_example, axis=1, keepdims=True)
    clipped_sum = (per_example * np.minimum(1.0, CLIP / norms)).sum(axis=0)
    expected = -clipped_sum / n

    model.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    assert int(optimizer.iterations.numpy()) == 1
    assert int(optimizer.micro_steps.numpy()) == 0
    new_kernel, new_bias = (v.numpy().astype(np.float64) for v in model.trainable_variables)
    update = np.concatenate([(new_kernel - kernel).ravel(), new_bias - bias])
    np.testing.assert_allclose(update, expected, rtol=1e-4, atol=1e-7)
