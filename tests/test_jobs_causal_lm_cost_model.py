"""The causal-LM cost model: a `DecoderSpec` counts what the job's keras-hub decoders hold and record.

Independent references: keras-hub's own models (their weights, their
trainable weights) and the ghost records tf_megadp's clipping makes for
them; the arithmetic of one tiny spec by hand.
"""

import math

import numpy as np
import pytest

from tf_megadp.jobs.causal_lm import cost_model
from tf_megadp.jobs.causal_lm.families import build_model
from tf_megadp.jobs.common.cost_model import example_flops, memory

# pico: 1 layer, hidden 32, 2 heads, intermediate 64; V = 37, rows of 12 tokens
# (the model reads 11, GPT-2's table has 11 rows).
V, ROW = 37, 12


def job_model(family, lora_rank):
    model = build_model(family, "pico", V, ROW - 1)
    model({"token_ids": np.zeros((1, ROW - 1), "int32"),
           "padding_mask": np.ones((1, ROW - 1), "int32")})
    if lora_rank:
        model.backbone.enable_lora(lora_rank)
    return model


def records_of(model, clipping):
    """(Outer shapes, Gather shapes, Explicit values, rule types) of one ghost pass."""
    import keras
    import tensorflow as tf

    from tf_megadp.clipping import ghost
    from tf_megadp.clipping.ghost_rules import plan_rules
    from tf_megadp.clipping.terms import Explicit, Gather, Outer

    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    m, t = 2, ROW - 1
    x = {"token_ids": tf.constant(rng.integers(0, V, (m, t)), tf.int32),
         "padding_mask": tf.ones((m, t), tf.int32)}
    y = tf.constant(rng.integers(0, V, (m, t)), tf.int32)
    rules = plan_rules(model, "small" if clipping == "ghost" else "any")
    records, *_ = ghost._forward(model, rules, x, y, None)
    outer = sorted((term.left.shape[1], term.left.shape[2], term.right.shape[2])
                   for _, term in records if isinstance(term, Outer))
    gather = sorted((term.values.shape[1], term.values.shape[2])
                    for _, term in records if isinstance(term, Gather))
    explicit = sum(math.prod(term.shape) for _, term in records
                   if isinstance(term, Explicit))
    return outer, gather, explicit, {type(term).__name__ for _, term in records}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("lora_rank", [0, 2], ids=["full", "lora"])
def test_weights_and_trained_weights_are_the_models(family, lora_rank):
    model = job_model(family, lora_rank)
    spec = cost_model.decoder_spec(family, "pico", V, ROW, ROW - 1, lora_rank)
    assert spec.parameter_count() == model.count_params()
    assert spec.trainable_parameter_count() == sum(
        math.prod(v.shape) for v in model.trainable_variables)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("lora_rank", [0, 2], ids=["full", "lora"])
def test_the_records_ghost_clipping_makes_are_the_ones_costed(family, lora_rank):
    """Outer records of every trained kernel and the head, Gather lookups, Explicit rest.

    Llama's RMS norms have no ghost rule: under `auto` the per-layer
    fallback gives their per-example gradients, costed as Explicit records.
    """
    spec = cost_model.decoder_spec(family, "pico", V, ROW, ROW - 1, lora_rank)
    outer, gather, explicit, kinds = records_of(job_model(family, lora_rank), "auto")
    assert outer == sorted(spec.dense_layers())
    assert gather == sorted(spec.embedding_lookups())
    assert explicit == spec.small_parameter_count()
    assert kinds <= {"Outer", "Gather", "Explicit"}


def test_gpt2_by_hand():
    """L=1, h=8, S=2, i=32, V=20, T=6 (a row of 7), table of 6 rows, head tied.

    Kernels (6, 8, 8) x 4: p d = 64 <= T (p + d) = 96, materialised. MLP (6, 8, 32)
    and (6, 32, 8): 256 > 240, Gram. Tied head, left = the 20-wide logit
    gradient, right = the 8-wide hidden state, (6, 20, 8): 160 <= 168,
    materialised.
    """
    spec = cost_model.DecoderSpec(family="gpt2", num_layers=1, hidden_dim=8, num_heads=2,
                                  intermediate_dim=32, vocabulary_size=20, sequence_length=6)
    forward = (4 * 2 * 6 * 8 * 8 + 2 * 6 * 8 * 32 + 2 * 6 * 32 * 8 + 2 * 6 * 20 * 8
               + 4 * 6 * 6 * 8)
    assert spec.forward_flops() == forward == 12288
    parameters = ((20 + 6) * 8 + 4 * (8 * 8 + 8) + (8 * 32 + 32) + (32 * 8 + 8) + 4 * 8
                  + 2 * 8)
    assert spec.parameter_count() == parameters == 1096
    small = 4 * 8 + 32 + 8 + 4 * 8 + 2 * 8
    ghost_extra = (4 * (4 * 8 * 8)                                 # materialised projections
                   + 2 * (2 * 36 * (8 + 32) + 2 * 36) + 6 * 8 + 6 * 32  # MLP, Gram
                   + 4 * 20 * 8                                     # tied head, materialised
                   + 2 * (2 * 36 * (8 + 1) + 2 * 6 * 8)             # token, position lookups
                   + 2 * 6 * 6 * (8 + 1)                            # head x token cross term
                   + 4 * small)
    assert example_flops(spec, "ghost") == 3 * forward + ghost_extra
    assert example_flops(spec, "vectorized") == 3 * forward + 4 * parameters
    floats = (4 * 8 * 8 + (6 * 32 + 2 * 36) + (6 * 8 + 2 * 36) + 20 * 8 + 2 * 6 * 8 + small)
    assert memory(spec, 3, "auto")["clipping"] == 3 * 4 * floats


def test_llama_by_hand():
    """L=1, h=8, S=2, i=32, V=20, T=6, untied head (6, 8, 20): 160 <= 168, materialised."""
    spec = cost_model.DecoderSpec(family="llama", num_layers=1, hidden_dim=8, num_heads=2,
                                  intermediate_dim=32, vocabulary_size=20, sequence_length=6)
    forward = (4 * 2 * 6 * 8 * 8 + 2 * (2 * 6 * 8 * 32) + 2 * 6 * 32 * 8 + 2 * 6 * 8 * 20
               + 4 * 6 * 6 * 8)
    assert spec.forward_flops() == forward
    assert spec.parameter_count() == 2 * 20 * 8 + 4 * 64 + 3 * 8 * 32 + 2 * 8 + 8 == 1368
    ghost_extra = (4 * (4 * 8 * 8) + 3 * (2 * 36 * 40 + 2 * 36) + 2 * 6 * 8 + 6 * 32
                   + 4 * 8 * 20 + (2 * 36 * 9 + 2 * 6 * 8) + 4 * (2 * 8 + 8))
    assert example_flops(spec, "auto") == 3 * forward + ghost_extra


def test_the_non_private_step_holds_one_gradient_and_no_clipping():
    spec = cost_model.decoder_spec("gpt2", "nano", 512, 64, 63)
    private, plain = memory(spec, 64, "auto"), memory(spec, 64, None)
    trained = 4 * spec.trainable_parameter_count()
    assert plain["clipping"] == 0 and plain["step_buffers"] == trained
    assert private["optimizer_state"] - plain["optimizer_state"] == trained  # DP accumulator
    assert private["activations"] == plain["activations"]


@pytest.mark.parametrize("field, value, message", [
    ("family", "bert", "family must be 'gpt2' or 'llama'"),
    ("num_layers", 0, "num_layers must be an integer >= 1"),
    ("lora_rank", -1, "lora_rank must be an integer >= 0"),
    ("vocabulary_size", True, "vocabulary_size must be an integer >= 1"),
    ("hidden_dim", 9, "hidden_dim 9 is not divisible by num_heads 2"),
    ("position_embeddings", 5, "sequence_length 6 exceeds the position table's 5 rows"),
])
def test_a_bad_spec_is_refused_by_name(field, value, message):
    sizes = dict(family="gpt2", num_layers=1, hidden_dim=8, num_heads=2, intermediate_dim=32,
                 vocabulary_size=20, sequence_length=6)
    with pytest.raises(ValueError, match=message):
        cost_model.DecoderSpec(**{**sizes, field: value})
