"""Secret Gaussian draws from a Philox key: the same values in and out of XLA, on every device.

The DP noise, the count noise of adaptive clipping and every draw a
mechanism regenerates (lambda-CGD's z_(t-1)) come from here, so that a step
compiled whole with XLA (`compile(jit_compile=True)`, every TPU step) adds
the noise the same step adds uncompiled, and a run may resume in either mode.
"""

from __future__ import annotations

import math

import tensorflow as tf

__all__ = ["fold_in", "standard_normal"]


def fold_in(key, data) -> tf.Tensor:
    """The Philox key derived from `key` and the int64 `data` (a step, a generation, an index)."""
    return tf.random.experimental.stateless_fold_in(key, data, alg="philox")


def standard_normal(shape, key, dtype) -> tf.Tensor:
    """N(0, I) of `shape` and `dtype` from a Philox `key`, the same in and out of XLA.

    Box-Muller on Philox's 32-bit words, both outputs of each pair: a pair
    of words (u, v) gives r cos(2 pi v) and r sin(2 pi v), r = sqrt(-2 log u),
    two independent standard normals, so a draw of n values costs n words,
    n / 2 logarithms and n / 2 square roots (half of what the cosine alone
    costs: the noise of every logical step is drawn here). Element i takes
    the cosine of pair i and element i + ceil(n / 2) its sine.

    `tf.random.stateless_normal` turns the same words into other values
    under XLA than outside it, so a step compiled whole
    (`compile(jit_compile=True)`, every TPU step) would add other noise
    than the same step uncompiled: a run resumed in the other mode, or a
    mechanism that draws a past z again (lambda-CGD), would use a z that was
    never added. Its default generator under XLA on a CPU is also about 20x
    slower (216 against 9 ms for a million samples). Here the words are the
    same everywhere and only float rounding differs (at most a few ulp).
    The uniforms have 32 bits, so |z| reaches 6.8 (TensorFlow's kernel stops
    at 5.7).

    Args:
        shape: the output's shape (a 1-D int tensor or list).
        key: an int64 [2] Philox key, secret (`NoiseStage.step_key`).
        dtype: the output's float dtype; computed in float64 for float64,
            in float32 otherwise.

    Returns:
        A tensor of independent standard normals.
    """
    compute = tf.float64 if dtype == tf.float64 else tf.float32
    shape = tf.cast(shape, tf.int32)
    size = tf.reduce_prod(shape)
    words = tf.random.stateless_uniform(tf.stack([2, (size + 1) // 2]), seed=key,
                                        minval=None, maxval=None, dtype=tf.uint32,
                                        alg="philox")
    scale = tf.constant(2.0 ** -32, compute)
    radius_uniform = (tf.cast(words[0], compute) + 0.5) * scale  # in (0, 1): log is finite
    angle = tf.constant(2.0 * math.pi, compute) * tf.cast(words[1], compute) * scale
    radius = tf.sqrt(-2.0 * tf.math.log(radius_uniform))
    normal = tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], 0)[:size]
    return tf.cast(tf.reshape(normal, shape), dtype)
