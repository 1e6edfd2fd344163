"""Specification of ghost clipping on keras-hub causal language models (issue 51).

A causal LM scores every position through its vocabulary head: GPT-2's
head is its token embedding reused (`ReversibleEmbedding(reverse=True)`,
tied), Llama's a separate matrix (untied). Under `clipping="auto"` (the
default) and `"ghost"` every example must get exactly the norm and the
clipped contribution of a naive loop that runs one example at a time
under its own GradientTape (relative error 1e-5 in float32): with the
tied head, with the untied one, and under LoRA (keras-hub's
`backbone.enable_lora`, the tied embedding trained beside the factors).
Rows are padded at their ends with target weight 0, as packed sequences
of the causal-LM job are.
"""

import keras
import keras_hub
import numpy as np
import pytest

import tf_megadp
from tests import reference
from tf_megadp.clipping import GhostClipping
from tf_megadp.clipping.ghost_rules import plan_rules
from tf_megadp.clipping.ghost_rules.embedding import ReversibleEmbeddingRule

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
RTOL = 1e-5
M, T, V = 4, 12, 96


def tiny_gpt2(seed=0):
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=V, num_layers=1, num_heads=2, hidden_dim=32, intermediate_dim=64,
        max_sequence_length=16, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


def tiny_llama(seed=0):
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=V, num_layers=1, num_query_heads=2, num_key_value_heads=2,
        hidden_dim=32, intermediate_dim=64, dropout=0.0, tie_word_embeddings=False)
    return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)


def causal_batch(n=M, seed=0):
    """Next-token inputs, targets and weights; rows 1 and 3 end with padding (weight 0)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, V, (n, T + 1)).astype("int32")
    lengths = np.array([T + 1, 7, T + 1, 10][:n])
    valid = np.arange(T + 1)[None, :] < lengths[:, None]
    tokens = np.where(valid, tokens, 0).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": valid[:, :-1].astype("int32")}
    return x, tokens[:, 1:], valid[:, 1:].astype("float32")


def naive(model, x, y, sample_weight):
    """Per-example norms, C (their median: some clipped, some not) and the clipped sum."""
    grads = reference.naive_per_example_gradients(model, LOSS, x, y, sample_weight)
    norms = np.array([np.sqrt(sum(np.sum(g**2) for g in gs)) for gs in grads])
    clip = float(np.median(norms))
    total = [sum(gs[j] * min(1.0, clip / n) for gs, n in zip(grads, norms))
             for j in range(len(model.trainable_variables))]
    return norms, clip, total


def relative_errors(got, want):
    """(max relative error per variable, over those whose gradient is not zero; the whole's).

    The key projection's bias gets an exactly zero gradient (a softmax is
    unchanged by a constant added to each query's scores), which float32
    rounds to about 1e-11: its own relative error means nothing, so it is
    measured against the whole clipped sum, as every variable also is.
    """
    scale = max(float(np.max(np.abs(w))) for w in want)
    per_variable = [float(np.max(np.abs(np.asarray(g) - w)) / np.max(np.abs(w)))
                    for g, w in zip(got, want) if np.max(np.abs(w)) > 1e-6 * scale]
    whole = max(float(np.max(np.abs(np.asarray(g) - w))) for g, w in zip(got, want)) / scale
    return max(per_variable), whole


def assert_exact(model, fallback="any"):
    """The ghost norms and clipped sum of one micro-batch equal the naive loop at RTOL."""
    x, y, w = causal_batch()
    model(x)
    model.compile(loss=LOSS)
    norms, clip, total = naive(model, x, y, w)
    batch = GhostClipping(fallback=fallback, jit_compile=False).clip_and_sum(
        model, x, y, w, clip)
    norm_error = float(np.max(np.abs(batch.norms.numpy() - norms) / norms))
    sum_error, whole_error = relative_errors([g.numpy() for g in batch.gradient_sum], total)
    assert max(norm_error, sum_error, whole_error) <= RTOL, (norm_error, sum_error, whole_error)
    return norm_error, sum_error


def head_rule(model, fallback="any"):
    model(causal_batch()[0])
    [rule] = [r for r in plan_rules(model, fallback) if isinstance(r, ReversibleEmbeddingRule)]
    return rule


def test_gpt2_with_its_tied_head_is_exact():
    # fallback="small", the "ghost" strategy: every layer has a ghost rule
    # but LayerNormalization's exact per-example gradients (a small layer).
    # "auto" plans the same rules for this model.
    model = tiny_gpt2()
    assert head_rule(model, "small").layer.tie_weights
    assert_exact(model, fallback="small")


def test_llama_with_an_untied_head_is_exact():
    model = tiny_llama()
    assert not head_rule(model).layer.tie_weights
    assert_exact(model)


def test_gpt2_under_lora_with_the_tied_embedding_trained_is_exact():
    model = tiny_gpt2()
    model.backbone.enable_lora(2)
    model.backbone.token_embedding.trainable = True
    # keras-hub starts B at zero, where A has no gradient: B random, so
    # that both factors' share of every norm is tested.
    rng = np.random.default_rng(1)
    for layer in model.backbone._flatten_layers(include_self=False):
        if getattr(layer, "lora_enabled", False):
            layer.lora_kernel_b.assign(rng.normal(size=layer.lora_kernel_b.shape) * 0.5)
    paths = [v.path for v in model.trainable_variables]
    assert any("lora_kernel_a" in p for p in paths)
    assert any("token_embedding" in p for p in paths)
    assert not any("kernel" in p and "lora" not in p for p in paths)
    assert_exact(model)


@pytest.mark.slow  # 15 s (XLA); the clipping above is the step's, and the job runs it
@pytest.mark.filterwarnings("ignore:DPOptimizer with noise_multiplier=0")
@pytest.mark.filterwarnings("ignore:arrays passed to fit")
def test_a_private_fit_step_of_gpt2_equals_the_naive_update():
    """The whole private step (`make_private`, DPOptimizer, `fit`, default clipping)."""
    model = tiny_gpt2()
    x, y, w = causal_batch()
    model(x)
    norms, clip, _ = naive(model, x, y, w)
    expected = reference.naive_clipped_update(model, LOSS, x, y, clip, divisor=M,
                                              sample_weight=w)
    before = reference.weights(model)
    tf_megadp.make_private(model)
    model.compile(optimizer=tf_megadp.DPOptimizer(keras.optimizers.SGD(1.0), l2_norm_clip=clip,
                                                  noise_multiplier=0.0, accumulation_steps=2,
                                                  seed=0),
                  loss=LOSS)
    model.fit(x, y, sample_weight=w, batch_size=M // 2, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    changes = [after - start for after, start in zip(reference.weights(model), before)]
    # Against the whole update: the step runs under XLA, whose float32
    # reordering moves the smallest variables' entries by more than 1e-5 of
    # their own size (the key projection's, ~1e-3 of the largest).
    assert relative_errors(changes, expected)[1] <= RTOL
