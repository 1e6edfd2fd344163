"""Specification of ghost clipping on Keras LoRA (`clipping/ghost_rules/lora.py`).

`enable_lora(rank)` makes a Dense or EinsumDense compute x (W + s A B),
s = lora_alpha / rank, with the base kernel W frozen. Under
`clipping="ghost"` and `"auto"` every example must get exactly the norm
and the clipped contribution of a naive one-example-at-a-time loop
(relative error 1e-5 in float32), from ghost records of the factors
(no per-example fallback for the LoRA layers); the frozen W is never
clipped, noised nor counted in a norm; and adding or removing one example,
at any position of the micro-batch, moves the un-noised clipped sum by at
most C. Issue 40: before the rule, "ghost" refused LoRA layers, and "auto"
crashed on a LoRA `BertMaskedLM` (KeyError in the first step's
independence check).
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_megadp
from tests import reference
from tf_megadp.clipping import GhostClipping
from tf_megadp.clipping.ghost_rules import plan_rules
from tf_megadp.clipping.ghost_rules.dense import DenseRule
from tf_megadp.clipping.ghost_rules.fallback import PerExampleRule, ReplayRule
from tf_megadp.clipping.ghost_rules.lora import LoraDenseRule, LoraEinsumDenseRule, factor_terms
from tf_megadp.clipping.terms import outer_is_materialised

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
RTOL = 1e-5
M, T, F = 5, 5, 4
# B starts random, not at Keras's zeros (A would get no gradient), and as
# large as A, so that neither factor's share of a norm is negligible. Seeded:
# an unseeded Keras initializer draws its seed when it is built (here, at
# import), so every process would test another model.
B_INITIALIZER = keras.initializers.RandomNormal(stddev=1.0, seed=0)


def sequences(n=M, length=T, features=F, seed=0):
    return np.random.default_rng(seed).normal(size=(n, length, features)).astype("float32")


def labels(shape, classes=3, seed=1):
    return np.random.default_rng(seed).integers(0, classes, shape).astype("int32")


def lora_model(layer, input_shape=(T, F), rank=2, lora_alpha=6):
    """layer -> Reshape to tokens -> Dense(3), with LoRA on `layer` (s = lora_alpha / rank)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input(input_shape)
    hidden = keras.layers.Reshape((input_shape[0], -1))(layer(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    layer.enable_lora(rank, lora_alpha=lora_alpha, b_initializer=B_INITIALIZER)
    model.compile(loss=LOSS)
    return model


def naive(model, x, y, sample_weight=None):
    """Per-example norms, C (their median) and the clipped sum, one example at a time."""
    grads = reference.naive_per_example_gradients(model, LOSS, x, y, sample_weight)
    norms = np.array([np.sqrt(sum(np.sum(g**2) for g in gs)) for gs in grads])
    clip = float(np.median(norms[norms > 0]))
    total = [sum(gs[j] * (min(1.0, clip / n) if n > 0 else 0.0) for gs, n in zip(grads, norms))
             for j in range(len(model.trainable_variables))]
    return norms, clip, total


def relative_errors(model, batch, norms, total):
    """(max relative error of the norms, of each variable's clipped sum against its largest entry)."""
    norm_error = float(np.max(np.abs(batch.norms.numpy() - norms)[norms > 0] / norms[norms > 0]))
    sum_error = max(float(np.max(np.abs(got.numpy() - want)) / np.max(np.abs(want)))
                    for got, want in zip(batch.gradient_sum, total))
    return norm_error, sum_error


def assert_exact(model, x, y, sample_weight=None, fallback="small", jit_compile=False):
    """Ghost clipping of `model` equals the naive reference at RTOL, with no per-example fallback."""
    model(x)
    assert not [r for r in plan_rules(model, fallback) if isinstance(r, (PerExampleRule,
                                                                         ReplayRule))]
    norms, clip, total = naive(model, x, y, sample_weight)
    batch = GhostClipping(fallback=fallback, jit_compile=jit_compile).clip_and_sum(
        model, x, y, sample_weight, clip)
    assert all(g is not None for g in batch.gradient_sum)
    norm_error, sum_error = relative_errors(model, batch, norms, total)
    assert norm_error <= RTOL and sum_error <= RTOL, (norm_error, sum_error)
    return batch


class TestFactorTerms:
    """The A and B terms equal s G_K B^T and s A^T G_K of the merged kernel's gradient G_K."""

    @pytest.mark.parametrize("tokens, width, rank, materialised", [
        (5, 4, 2, True),    # the per-example [p, r] and [r, d] gradients are built
        (2, 16, 4, False),  # p r = 64 > T (p + r) = 40: Gram forms
    ])
    def test_equal_the_chain_rule_through_the_merged_kernel(self, tokens, width, rank,
                                                            materialised):
        rng = np.random.default_rng(0)
        m, scale = 3, 1.5
        left = rng.normal(size=(m, tokens, width)).astype("float32")
        right = rng.normal(size=(m, tokens, width)).astype("float32")
        a = keras.Variable(rng.normal(size=(width, rank)).astype("float32"))
        b = keras.Variable(rng.normal(size=(rank, width)).astype("float32"))
        a_term, b_term = factor_terms(tf.constant(left), tf.constant(right), a, b, scale, m)
        assert a_term.materialised is b_term.materialised is materialised
        assert materialised is outer_is_materialised(tokens, width, rank)
        kernel_gradient = np.einsum("mtp,mtd->mpd", left, right)
        want_a = scale * kernel_gradient @ b.numpy().T
        want_b = scale * np.einsum("pr,mpd->mrd", a.numpy(), kernel_gradient)
        for term, want in ((a_term, want_a), (b_term, want_b)):
            np.testing.assert_allclose(term.squared_norms(), np.sum(want**2, axis=(1, 2)),
                                       rtol=1e-5)
            factors, keep = tf.constant([0.5, 1.0, 0.25]), tf.constant([True, False, True])
            np.testing.assert_allclose(term.clipped_sum(factors, keep),
                                       np.tensordot([0.5, 0.0, 0.25], want, axes=1),
                                       rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))


class TestGhostOnLoraLayersIsExact:
    """Each LoRA layer under ghost equals the naive reference (rel 1e-5, float32).

    "auto" plans the same rules for these models (no layer lacks one), so
    its clipping is the same computation: checked on the plan, run once
    (the BERT case below runs it).
    """

    def test_dense(self):
        model = lora_model(keras.layers.Dense(4, activation="tanh"))
        for fallback in ("small", "any"):  # clipping="ghost", "auto"
            assert [type(r) for r in plan_rules(model, fallback)] == [LoraDenseRule, DenseRule]
        assert_exact(model, sequences(), labels((M, T)))

    def test_dense_in_the_gram_forms_with_the_scale_below_one(self):
        model = lora_model(keras.layers.Dense(16), input_shape=(2, 16), rank=4, lora_alpha=1)
        assert not outer_is_materialised(2, 16, 4)
        assert_exact(model, sequences(length=2, features=16), labels((M, 2)))

    @pytest.mark.slow  # the same records as on sequences, with T = 1
    def test_dense_on_flat_inputs(self):
        keras.utils.set_random_seed(0)
        layer = keras.layers.Dense(4, activation="tanh")
        model = keras.Sequential([keras.Input((F,)), layer, keras.layers.Dense(3)])
        layer.enable_lora(2, b_initializer=B_INITIALIZER)
        model.compile(loss=LOSS)
        assert_exact(model, sequences()[:, 0], labels((M,)))

    # The attention projection runs by default; the others repeat its code
    # path with other letters (CI time).
    @pytest.mark.parametrize("equation, output_shape, bias_axes, input_shape", [
        ("abc,cde->abde", (T, 2, 3), "de", (T, F)),   # an attention query/key/value projection
        pytest.param("abc,cd->abd", (T, 4), "d", (T, F), marks=pytest.mark.slow),
        # an attention output projection
        pytest.param("abcd,cde->abe", (T, 4), "e", (T, 2, 2), marks=pytest.mark.slow),
        # the kernel lists its output axis first
        pytest.param("abc,dc->abd", (T, 4), None, (T, F), marks=pytest.mark.slow),
    ])
    def test_einsum_dense(self, equation, output_shape, bias_axes, input_shape):
        layer = keras.layers.EinsumDense(equation, output_shape, bias_axes=bias_axes,
                                         activation="tanh")
        model = lora_model(layer, input_shape=input_shape)
        assert isinstance(plan_rules(model, "small")[0], LoraEinsumDenseRule)
        x = np.random.default_rng(0).normal(size=(M,) + input_shape).astype("float32")
        assert_exact(model, x, labels((M, T)))

    @pytest.mark.slow  # the merged Outer records of any layer called twice
    def test_a_layer_called_twice(self):
        keras.utils.set_random_seed(0)
        layer = keras.layers.Dense(F, activation="tanh")
        inputs = keras.Input((T, F))
        model = keras.Model(inputs, keras.layers.Dense(3)(layer(layer(inputs))))
        layer.enable_lora(2, b_initializer=B_INITIALIZER)
        model.compile(loss=LOSS)
        assert_exact(model, sequences(), labels((M, T)))

    def test_a_base_kernel_the_user_unfroze_is_clipped_with_the_factors(self):
        layer = keras.layers.Dense(4, activation="tanh")
        model = lora_model(layer)
        layer.trainable = False  # Keras skips setting the flag it already has;
        layer.trainable = True  # set again, it unfreezes W as well
        assert len(model.trainable_variables) == 6
        assert_exact(model, sequences(), labels((M, T)))

    def test_a_kernel_ending_with_an_input_axis_falls_back_under_auto(self):
        # "ab,b->a": the kernel's only axis is contracted; A B adds to it
        # along an axis the rule's right-hand side does not hold.
        layer = keras.layers.EinsumDense("ab,b->a", (), activation="tanh")
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((F,)), layer, keras.layers.Reshape((1,)),
                                  keras.layers.Dense(3)])
        layer.enable_lora(2, b_initializer=B_INITIALIZER)
        model.compile(loss=LOSS)
        with pytest.raises(tf_megadp.PrivacyConfigurationError, match="clipping='auto'"):
            plan_rules(model, "small")
        assert isinstance(plan_rules(model, "any")[0], (PerExampleRule, ReplayRule))


def outlier_batches(x, y, position, outlier):
    """(D with a padding row last, D with `outlier` inserted at `position`), same shapes."""
    weights = np.ones(y.shape, "float32")
    without = (x.copy(), y.copy(), weights.copy())
    without[2][-1] = 0.0  # the last row is padding: it adds exactly zero
    with_x = np.insert(x[:-1], position, outlier[0], axis=0)
    with_y = np.insert(y[:-1], position, outlier[1], axis=0)
    return without, (with_x, with_y, weights)


def difference_norm(a, b):
    return float(np.sqrt(sum(np.sum((p.numpy().astype(np.float64) - q.numpy()) ** 2)
                             for p, q in zip(a.gradient_sum, b.gradient_sum))))


class TestOneExampleMovesTheSumByAtMostC:
    """The attack: one example added or removed, anywhere in the micro-batch, moves the
    un-noised clipped sum (factors, biases, head) by at most C, and by C exactly when its
    gradient is clipped: its own clipped gradient, nothing of the others."""

    @pytest.mark.parametrize("fallback", ["small", pytest.param("any", marks=pytest.mark.slow)])
    def test_at_every_position(self, fallback):
        model = lora_model(keras.layers.Dense(4, activation="tanh"), lora_alpha=8)
        x, y = sequences(), labels((M, T))
        clip = 0.5 * float(np.median(naive(model, x, y)[0]))
        strategy = GhostClipping(fallback=fallback, jit_compile=False)
        outlier = (100.0 * sequences(n=1, seed=7)[0], labels((T,), seed=7))
        # Its own clipped gradient's norm: C when its gradient is clipped
        # (tanh saturates on the outlier, so that is checked, not assumed).
        own = min(clip, float(naive(model, outlier[0][None], outlier[1][None])[0][0]))
        for position in range(M):
            without, added = outlier_batches(x, y, position, outlier)
            base = strategy.clip_and_sum(model, *without, clip)
            moved = difference_norm(strategy.clip_and_sum(model, *added, clip), base)
            assert moved <= clip * (1 + RTOL), (position, moved, clip)
            assert moved == pytest.approx(own, rel=1e-4), position  # its clipped gradient
            # Removing example `position` of D (its row becomes padding).
            weights = np.ones(y.shape, "float32")
            removed = weights.copy()
            removed[position] = 0.0
            full = strategy.clip_and_sum(model, x, y, weights, clip)
            moved = difference_norm(full, strategy.clip_and_sum(model, x, y, removed, clip))
            assert moved <= clip * (1 + RTOL), (position, moved, clip)


class TestFrozenWeights:
    """The frozen base kernel gets no update and no noise; the factors and the head get both."""

    def test_a_noisy_step_leaves_the_base_kernel_untouched(self):
        layer = keras.layers.Dense(4, activation="tanh")
        model = lora_model(layer)
        (frozen,) = [v for v in layer.weights if not v.trainable]  # W
        optimizer = tf_megadp.DPOptimizer(keras.optimizers.SGD(learning_rate=1.0),
                                          l2_norm_clip=1.0, noise_multiplier=1.0,
                                          clipping="ghost")
        tf_megadp.make_private(model)
        model.compile(optimizer=optimizer, loss=LOSS)
        before = [v.numpy().copy() for v in model.trainable_variables]
        kernel = frozen.numpy().copy()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "arrays passed to fit")
            model.fit(sequences(), labels((M, T)), batch_size=M, epochs=1, verbose=0)
        assert int(optimizer.iterations.numpy()) == 1
        np.testing.assert_array_equal(frozen.numpy(), kernel)
        for variable, value in zip(model.trainable_variables, before):
            assert np.all(variable.numpy() != value), variable.path  # noised


# -- A tiny keras-hub BertMaskedLM after backbone.enable_lora(4) ------------------

MICRO_BATCH, STEPS = 4, 2


def lora_bert():
    model = reference.tiny_bert()
    model.backbone.enable_lora(4)
    rng = np.random.default_rng(3)
    for variable in model.trainable_variables:
        if variable.path.endswith("lora_kernel_b"):  # zeros in keras-hub: A would get no gradient
            variable.assign(rng.normal(size=variable.shape).astype("float32"))
    return model


def test_bert_with_lora_trains_only_the_factors_and_the_head():
    model = lora_bert()
    trained = sorted(v.path.split("/")[-1] for v in model.trainable_variables)
    assert trained.count("lora_kernel_a") == trained.count("lora_kernel_b") == 2
    assert "embeddings" not in trained and "kernel" in trained  # the head's Dense
    paths = [v.path for v in model.trainable_variables]
    assert all(p.startswith("mlm_head/") or "/query/" in p or "/value/" in p for p in paths)


# Without XLA: 10 CPU-seconds each, mostly tracing; "auto" (the default)
# runs in CI, "ghost" plans the same rules.
@pytest.mark.parametrize("fallback", ["any", pytest.param("small", marks=pytest.mark.slow)])
def test_bert_with_lora_is_exact(fallback):
    model = lora_bert()
    x, y, w = reference.bert_batch(MICRO_BATCH)
    w[1] = 0.0  # a padding example
    model(x)
    model.compile(loss=LOSS)
    lora = [r for r in plan_rules(model, fallback) if isinstance(r, LoraEinsumDenseRule)]
    assert [r.layer.name for r in lora] == ["query", "value"]
    assert_exact(model, x, y, w, fallback=fallback)


# 30-40 CPU-seconds each (the XLA-compiled step): slow. In CI, the frozen
# kernel of a noisy step is checked on a Dense (TestFrozenWeights) and the
# BERT clipped sum on test_bert_with_lora_is_exact.
@pytest.mark.slow
@pytest.mark.parametrize("clipping", ["auto", "ghost"])
def test_bert_with_lora_training_matches_the_naive_update(clipping):
    """DPOptimizer after `backbone.enable_lora(4)`: sigma = 0, SGD(1) moves the weights by
    exactly -(1/B) sum_i clip(g_i) over the factors and the head, and nothing else."""
    model = lora_bert()
    x, y, w = reference.bert_batch(MICRO_BATCH * STEPS)
    model(x)
    norms = naive(model, x, y, w)[0]
    clip = float(np.median(norms))
    with pytest.warns(UserWarning, match="noise_multiplier=0"):
        optimizer = tf_megadp.DPOptimizer(
            keras.optimizers.SGD(learning_rate=1.0), l2_norm_clip=clip,
            noise_multiplier=0.0, accumulation_steps=STEPS, clipping=clipping)
    tf_megadp.make_private(model)
    model.compile(optimizer=optimizer, loss=LOSS)
    expected = reference.naive_clipped_update(model, LOSS, x, y, clip,
                                              divisor=MICRO_BATCH * STEPS, sample_weight=w)
    before = reference.weights(model)
    frozen = [v.numpy().copy() for v in model.non_trainable_variables]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, sample_weight=w, batch_size=MICRO_BATCH, epochs=1, shuffle=False,
                  verbose=0)
    assert not [c for c in caught if "exact per-example gradients" in str(c.message)]
    assert int(optimizer.iterations.numpy()) == 1
    for variable, a, b, e in zip(model.trainable_variables, reference.weights(model), before,
                                 expected):
        # The update is read off float32 weights: up to one rounding of each.
        rounding = 2 * np.spacing(np.float32(np.max(np.abs(b))))
        np.testing.assert_allclose(a - b, e, rtol=RTOL, atol=RTOL * np.max(np.abs(e)) + rounding,
                                   err_msg=variable.path)
    for variable, value in zip(model.non_trainable_variables, frozen):
        if not variable.path.endswith(("seed_generator_state", "counter")):
            np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)
