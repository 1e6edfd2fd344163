"""Independent references for the DP step: one example at a time, eagerly.

Nothing here uses tf_megadp: each example runs its own forward pass under its
own GradientTape, exactly as the DP-SGD definition reads.
"""

import math

import keras
import numpy as np
import tensorflow as tf
import keras_hub
from scipy import stats


def example(structure, i):
    return tf.nest.map_structure(lambda t: t[i : i + 1], structure)


def naive_per_example_gradients(model, loss_fn, x, y, sample_weight=None):
    """List over examples of lists (one array per trainable variable)."""
    n = len(tf.nest.flatten(x)[0])
    gradients = []
    for i in range(n):
        with tf.GradientTape() as tape:
            prediction = model(example(x, i), training=True)
            weight = None if sample_weight is None else sample_weight[i : i + 1]
            loss = loss_fn(y[i : i + 1], prediction, sample_weight=weight)
        grads = tape.gradient(loss, model.trainable_variables)
        gradients.append([
            np.zeros(v.shape, np.float64) if g is None
            else np.asarray(tf.convert_to_tensor(g), np.float64)
            for g, v in zip(grads, model.trainable_variables)
        ])
    return gradients


def naive_clipped_update(model, loss_fn, x, y, clip, divisor, sample_weight=None,
                         automatic_stability=None):
    """-(1/B) * sum_i g_i * min(1, C/||g_i||): the sigma = 0, SGD(lr=1) update.

    With `automatic_stability` gamma: automatic clipping (Bu et al. 2022),
    factor C / (||g_i|| + gamma).
    """
    total = None
    for grads in naive_per_example_gradients(model, loss_fn, x, y, sample_weight):
        norm = np.sqrt(sum(np.sum(g**2) for g in grads))
        if automatic_stability is not None:
            factor = clip / (norm + automatic_stability)
        else:
            factor = min(1.0, clip / norm) if norm > 0 else 1.0
        clipped = [g * factor for g in grads]
        total = clipped if total is None else [a + b for a, b in zip(total, clipped)]
    return [-t / divisor for t in total]


def weights(model):
    return [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]


def tiny_bert(vocabulary_size=50, sequence_length=8, dropout=0.0, seed=0):
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=vocabulary_size,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=sequence_length,
        dropout=dropout,
    )
    return keras_hub.models.BertMaskedLM(backbone, preprocessor=None)


def bert_batch(n, vocabulary_size=50, sequence_length=8, masks=3, seed=0):
    rng = np.random.default_rng(seed)
    x = {
        "token_ids": rng.integers(0, vocabulary_size, (n, sequence_length)).astype("int32"),
        "segment_ids": np.zeros((n, sequence_length), "int32"),
        "padding_mask": np.ones((n, sequence_length), "int32"),
        "mask_positions": np.stack(
            [np.sort(rng.choice(sequence_length, masks, replace=False)) for _ in range(n)]
        ).astype("int32"),
    }
    y = rng.integers(0, vocabulary_size, (n, masks)).astype("int32")
    w = (rng.random((n, masks)) < 0.8).astype("float32")
    w[:, 0] = 1.0
    return x, y, w


def assert_std_is(values, expected_std, alpha=1e-6):
    """Two-sided chi-square test of a zero-mean normal sample's variance."""
    statistic = np.sum((values / expected_std) ** 2)
    p_low = stats.chi2.cdf(statistic, df=values.size)
    assert alpha / 2 < p_low < 1 - alpha / 2, (
        f"sample std {values.std():.6g} vs expected {expected_std:.6g} "
        f"(chi-square cdf {p_low:.3g}, n={values.size})"
    )


# -- Replayed steps (issue 37) --------------------------------------------------
#
# A step run twice from the same restored weights, on examples whose loss is
# zero (every clipped gradient exactly zero), moves the weights of an
# SGD(learning_rate=1) model by -noise / B each time: the difference of the two
# updates is the difference of the two noises, nothing else.

ROLLBACK_INPUTS = 64  # A Dense(64) on 64 inputs: 4,160 noisy coordinates.


def rollback_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((ROLLBACK_INPUTS,)),
                             keras.layers.Dense(ROLLBACK_INPUTS)])


def zero_loss(y_true, y_pred):
    """A loss of zero whatever the prediction: every clipped gradient is zero."""
    return keras.ops.sum(y_pred * 0.0, axis=-1)


def rollback_examples(n):
    """n distinct examples (identical rows would be one example)."""
    x = np.arange(n * ROLLBACK_INPUTS, dtype="float32").reshape(n, ROLLBACK_INPUTS) / n
    return x, np.zeros((n, ROLLBACK_INPUTS), "float32")


def flat(arrays):
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])


def assert_replayed_noise_is_fresh(first, second, noise_std):
    """The two runs of one step differ by two independent noises: std sqrt(2) sigma C / B.

    On code that replays the noise they are bit-identical (difference 0).
    """
    difference = flat(second) - flat(first)
    assert np.any(difference != 0), "the replayed step drew exactly the noise of its first run"
    assert_std_is(difference, math.sqrt(2) * noise_std)


# -- Correlated noise (issue 39) --------------------------------------------------


def noise_draws(seed, step, shapes, generation=0, replica=0):
    """z_t of a `DPOptimizer(seed=seed)`: the standard normals it draws at logical step `step`.

    The key is (seed, 0), folded with the step, the draw generation, the
    replica and each variable's index, as `Accumulators._step_key` does.
    """
    key = tf.constant([seed, 0], tf.int64)
    for value in (step, generation, replica):
        key = tf.random.experimental.stateless_fold_in(key, tf.constant(value, tf.int64),
                                                       alg="philox")
    return [box_muller(tf.random.experimental.stateless_fold_in(key, index, alg="philox"), shape)
            for index, shape in enumerate(shapes)]


def box_muller(key, shape):
    """The standard normals of `gaussian.standard_normal`, by NumPy in float64 from Philox's words."""
    pairs = -(-int(np.prod(shape)) // 2)
    return box_muller_of_words(tf.random.stateless_uniform(
        [2, pairs], seed=key, minval=None, maxval=None, dtype=tf.uint32, alg="philox").numpy(),
        shape)


def box_muller_of_words(words, shape):
    """Box-Muller in float64 of Philox's uint32 words [..., 2, pairs]: normals [..., *shape].

    Pair i gives element i (its cosine) and element i + pairs (its sine).
    """
    words = np.asarray(words).astype(np.float64)
    radius = np.sqrt(-2.0 * np.log((words[..., 0, :] + 0.5) * 2.0 ** -32))
    angle = 2.0 * np.pi * words[..., 1, :] * 2.0 ** -32
    normals = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)], axis=-1)
    size = int(np.prod(shape))
    return normals[..., :size].reshape(words.shape[:-2] + tuple(shape))


def assert_covariance_is(samples, covariance, z_bound=6.0):
    """Each row of `samples` (P x T) is a draw of N(0, covariance): whiten and test against I.

    W = L^{-1} x (L the Cholesky factor) must have identity covariance; each
    entry of the empirical covariance of P draws has standard error 1/sqrt(P)
    off the diagonal and sqrt(2/P) on it, so the test allows `z_bound` of
    them (at P = 100,000 and T = 10: 0.019 and 0.027).
    """
    samples = np.asarray(samples, np.float64)
    count = samples.shape[0]
    whitened = np.linalg.solve(np.linalg.cholesky(covariance), samples.T)
    empirical = whitened @ whitened.T / count
    error = np.abs(empirical - np.eye(len(covariance)))
    scale = np.where(np.eye(len(covariance), dtype=bool), math.sqrt(2 / count), 1 / math.sqrt(count))
    worst = float(np.max(error / scale))
    assert worst < z_bound, f"whitened covariance is {worst:.2f} standard errors from I"
