"""Specification of the BERT job under mixed_bfloat16 (the dtype policy of TPU runs).

keras-hub's BertMaskedLM cannot run under mixed_bfloat16 as built (its MLM
head adds a float32 bias to bfloat16 logits); the job's `build_model` keeps
the head in float32. One DP step of the job's pico model under
mixed_bfloat16 must agree with the float32 step on the same examples and
weights within bfloat16's precision (8-bit significand: about 0.4 % per
value), and the privacy-critical values must stay float32.
"""

import functools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_megadp
from tf_megadp.jobs.bert import pretraining, text, training

VOCABULARY = 64
LENGTH = 16
ROWS = 8
CLIP = 0.5  # below the examples' gradient norms: every example is clipped


@functools.lru_cache(maxsize=None)
def examples():
    """One masked micro-batch, drawn once: both steps must see the same masks."""
    rows = np.random.default_rng(0).integers(5, VOCABULARY, size=(ROWS, LENGTH))
    rows[-2:, LENGTH // 2:] = 0  # some [PAD]
    batcher = text.MaskedLMBatcher(VOCABULARY, LENGTH)
    return training.masked_rows(rows, batcher, seed=0)


def dp_step(precision, clipping, initial):
    """The job's model after one DP step (sigma 0, SGD lr 1): the update is -clipped mean."""
    config = pretraining.PretrainConfig(model="pico", sequence_length=LENGTH, precision=precision)
    model = pretraining.build_model(config, VOCABULARY)
    model.set_weights(initial)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "DPOptimizer with noise_multiplier=0")
        warnings.filterwarnings("ignore", ".*seed.*")
        optimizer = tf_megadp.DPOptimizer(
            keras.optimizers.SGD(1.0), l2_norm_clip=CLIP, noise_multiplier=0.0,
            accumulation_steps=1, seed=0, clipping=clipping)
    tf_megadp.make_private(model)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y, w = examples()
    logits = model(x)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "arrays passed to fit")  # one fixed step, no epsilon
        model.fit(x, y, sample_weight=w, batch_size=ROWS, epochs=1, shuffle=False, verbose=0)
    batch = optimizer.clipping_strategy.clip_and_sum(model, x, y, w, tf.constant(CLIP))
    return {
        "update": np.concatenate([(v - i).ravel()
                                  for v, i in zip(model.get_weights(), initial)]),
        "logits": logits.dtype.name,
        "compute": model.backbone.dtype_policy.compute_dtype,
        "variables": {v.dtype for v in model.trainable_variables},
        "accumulators": {a.dtype for a in optimizer._in_memory.accumulators},
        "norms": batch.norms.dtype.name,
        "clipped_sum": {g.dtype.name for g in batch.gradient_sum if g is not None},
    }


@pytest.fixture(scope="module")
def steps():
    """The job's default strategy (auto: ghost norms on every BERT layer).

    Vectorized clipping under mixed_bfloat16 is checked on a dense model
    under two replicas (tests/distributed_scenarios.py); a second BERT pair
    here cost half a minute of CI for the same dtype rules.
    """
    keras.utils.set_random_seed(0)
    initial = pretraining.build_model(
        pretraining.PretrainConfig(model="pico", sequence_length=LENGTH), VOCABULARY).get_weights()
    return (dp_step("float32", "auto", initial),
            dp_step("mixed_bfloat16", "auto", initial))


def test_keras_hub_alone_fails_under_mixed_bfloat16():
    """Why the job builds its own head policy (remove the workaround when this fails)."""
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCABULARY, num_layers=1, num_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=LENGTH, dtype="mixed_bfloat16")
    model = keras_hub.models.BertMaskedLM(backbone, preprocessor=None)
    with pytest.raises(tf.errors.InvalidArgumentError, match="bfloat16"):
        model(examples()[0])


# The pair of BERT steps costs about 55 CPU-seconds: slow (CI time, issue 26); the
# distributed scenarios check the same dtype rules on a dense model in CI.
@pytest.mark.slow
def test_the_step_computes_in_bfloat16_and_keeps_privacy_values_in_float32(steps):
    _, mixed = steps
    assert mixed["compute"] == "bfloat16"
    assert mixed["logits"] == "float32"
    assert mixed["variables"] == {"float32"}
    assert mixed["accumulators"] == {"float32"}
    assert mixed["norms"] == "float32" and mixed["clipped_sum"] == {"float32"}


@pytest.mark.slow
def test_bfloat16_update_agrees_with_float32(steps):
    full, mixed = steps
    assert np.all(np.isfinite(mixed["update"])) and np.any(mixed["update"] != 0)
    difference = np.linalg.norm(mixed["update"] - full["update"]) / np.linalg.norm(full["update"])
    cosine = np.dot(mixed["update"], full["update"]) / (
        np.linalg.norm(mixed["update"]) * np.linalg.norm(full["update"]))
    # bfloat16 rounds each activation to ~0.4 %; through one layer and the
    # head the update moves by about 0.5 % (measured), never in direction.
    assert difference < 0.02, difference
    assert cosine > 0.9995, cosine
    # And it is not float32 in disguise.
    assert difference > 1e-5
