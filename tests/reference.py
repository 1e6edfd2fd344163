"""Independent references for the DP step: one example at a time, eagerly.

Nothing here uses tf_megadp: each example runs its own forward pass under its
own GradientTape, exactly as the DP-SGD definition reads.
"""

import keras
import numpy as np
import tensorflow as tf
import keras_hub


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
