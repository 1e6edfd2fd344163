"""Specification of the private train step installed by `make_private`.

With sigma = 0 and SGD(learning_rate=1), one logical step must move the
weights by exactly -(1/B) * sum_i clip(g_i), where g_i comes from a naive
reference that handles one example at a time with its own GradientTape.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_megadp
from tf_megadp import PrivacyConfigurationError
from tests import reference

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def dense_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(5, activation="tanh"),
        keras.layers.Dense(3),
    ])


def embedding_model(seed=0):
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((4,), dtype="int32")
    hidden = keras.layers.Embedding(20, 4)(tokens)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    return keras.Model(tokens, keras.layers.Dense(3)(hidden))


class DictInputModel(keras.Model):
    """Subclassed model with dict inputs and dropout."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.left = keras.layers.Dense(4)
        self.right = keras.layers.Dense(4)
        self.dropout = keras.layers.Dropout(dropout)
        self.head = keras.layers.Dense(3)

    def call(self, inputs, training=False):
        hidden = keras.ops.tanh(self.left(inputs["a"]) + self.right(inputs["b"]))
        return self.head(self.dropout(hidden, training=training))


def dense_data(n=12, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32") * 2
    y = rng.integers(0, 3, n).astype("int32")
    return x, y


def median_norm(model, x, y, sample_weight=None):
    grads = reference.naive_per_example_gradients(model, LOSS, x, y, sample_weight)
    return float(np.median([np.sqrt(sum(np.sum(g**2) for g in gs)) for gs in grads]))


def train_private(model, x, y, *, clip, micro_batch, steps, sample_weight=None,
                  normalize_by=None, noise_multiplier=0.0, seed=0):
    optimizer = tf_megadp.DPOptimizer(
        keras.optimizers.SGD(learning_rate=1.0),
        l2_norm_clip=clip,
        noise_multiplier=noise_multiplier,
        accumulation_steps=steps,
        normalize_by=normalize_by,
        seed=seed,
    )
    tf_megadp.make_private(model)
    model.compile(optimizer=optimizer, loss=LOSS)
    model.fit(x, y, sample_weight=sample_weight, batch_size=micro_batch,
              epochs=1, shuffle=False, verbose=0)
    return optimizer


def assert_update_matches(model, before, expected):
    after = reference.weights(model)
    for a, b, e in zip(after, before, expected):
        np.testing.assert_allclose(a - b, e, rtol=1e-5, atol=2e-6)


@pytest.mark.filterwarnings("ignore:DPOptimizer with noise_multiplier=0")
class TestMatchesNaiveReference:
    def test_dense_model(self):
        model = dense_model()
        x, y = dense_data()
        clip = median_norm(model, x, y)
        expected = reference.naive_clipped_update(model, LOSS, x, y, clip, divisor=12)
        before = reference.weights(model)
        optimizer = train_private(model, x, y, clip=clip, micro_batch=4, steps=3)
        assert int(optimizer.iterations.numpy()) == 1
        assert_update_matches(model, before, expected)

    def test_embedding_model(self):
        model = embedding_model()
        rng = np.random.default_rng(1)
        x = rng.integers(0, 20, (8, 4)).astype("int32")
        y = rng.integers(0, 3, 8).astype("int32")
        clip = median_norm(model, x, y)
        expected = reference.naive_clipped_update(model, LOSS, x, y, clip, divisor=8)
        before = reference.weights(model)
        train_private(model, x, y, clip=clip, micro_batch=8, steps=1)
        assert_update_matches(model, before, expected)

    def test_subclassed_model_with_dict_inputs(self):
        keras.utils.set_random_seed(3)
        model = DictInputModel()
        rng = np.random.default_rng(3)
        x = {"a": rng.normal(size=(6, 2)).astype("float32"),
             "b": rng.normal(size=(6, 3)).astype("float32")}
        y = rng.integers(0, 3, 6).astype("int32")
        model(x)
        clip = median_norm(model, x, y)
        expected = reference.naive_clipped_update(model, LOSS, x, y, clip, divisor=6)
        before = reference.weights(model)
        train_private(model, x, y, clip=clip, micro_batch=3, steps=2)
        assert_update_matches(model, before, expected)

    def test_tiny_bert_masked_lm_with_tied_embedding(self):
        model = reference.tiny_bert()
        x, y, w = reference.bert_batch(6)
        model(x)
        clip = median_norm(model, x, y, w)
        expected = reference.naive_clipped_update(model, LOSS, x, y, clip, divisor=6,
                                                  sample_weight=w)
        before = reference.weights(model)
        train_private(model, x, y, sample_weight=w, clip=clip, micro_batch=3, steps=2)
        assert_update_matches(model, before, expected)
        pooler = [i for i, v in enumerate(model.trainable_variables) if "pooled" in v.path]
        assert pooler, "the pooler gets no MLM gradient and must stay unchanged"
        for i in pooler:
            np.testing.assert_array_equal(reference.weights(model)[i], before[i])


@pytest.mark.filterwarnings("ignore:DPOptimizer with noise_multiplier=0")
class TestAccumulation:
    def test_k_micro_batches_equal_one_big_micro_batch(self):
        x, y = dense_data(n=12, seed=5)
        small, big = dense_model(seed=7), dense_model(seed=7)
        clip = median_norm(small, x, y)
        before = reference.weights(small)
        train_private(small, x, y, clip=clip, micro_batch=3, steps=4)
        train_private(big, x, y, clip=clip, micro_batch=12, steps=1)
        for s, b, w0 in zip(reference.weights(small), reference.weights(big), before):
            np.testing.assert_allclose(s - w0, b - w0, rtol=1e-5, atol=1e-7)

    def test_no_update_until_the_logical_step_is_complete(self):
        model = dense_model()
        x, y = dense_data(n=8)
        before = reference.weights(model)
        # Two micro-batches of a three-micro-batch step: fit ends inside the
        # logical step, which is discarded, never applied in part.
        with pytest.warns(UserWarning, match="Discarded the last 2 micro-batches"):
            optimizer = train_private(model, x, y, clip=1.0, micro_batch=4, steps=3)
        assert int(optimizer.iterations.numpy()) == 0
        assert int(optimizer.micro_steps.numpy()) == 0
        for a, b in zip(reference.weights(model), before):
            np.testing.assert_array_equal(a, b)

    def test_padding_examples_contribute_exactly_zero(self):
        x, y = dense_data(n=8, seed=2)
        weight = np.ones(8, "float32")
        weight[[1, 6]] = 0.0
        padded, trimmed = dense_model(seed=4), dense_model(seed=4)
        x_padded = x.copy()
        x_padded[[1, 6]] = 1e3  # would dominate the sum if not masked
        before = reference.weights(padded)
        train_private(padded, x_padded, y, sample_weight=weight, clip=0.5,
                      micro_batch=4, steps=2, normalize_by=8)
        keep = weight > 0
        train_private(trimmed, x[keep], y[keep], clip=0.5, micro_batch=6, steps=1,
                      normalize_by=8)
        for p, t, w0 in zip(reference.weights(padded), reference.weights(trimmed), before):
            np.testing.assert_allclose(p - w0, t - w0, rtol=1e-5, atol=1e-7)

    def test_micro_batch_of_only_padding_skips_the_per_example_pass(self):
        class CountingClipping(tf_megadp.VectorizedClipping):
            calls = tf.Variable(0)

            def clip_and_sum(self, *args):
                self.calls.assign_add(1)
                return super().clip_and_sum(*args)

        x, y = dense_data(n=8, seed=2)
        weight = np.array([1, 1, 1, 1, 0, 0, 0, 0], "float32")
        padded, trimmed = dense_model(seed=4), dense_model(seed=4)
        before = reference.weights(padded)
        optimizer = tf_megadp.DPOptimizer(keras.optimizers.SGD(1.0), l2_norm_clip=0.5,
                                          noise_multiplier=0.0, accumulation_steps=2,
                                          normalize_by=4, clipping=CountingClipping())
        tf_megadp.make_private(padded)
        padded.compile(optimizer=optimizer, loss=LOSS)
        padded.fit(x, y, sample_weight=weight, batch_size=4, shuffle=False, verbose=0)
        assert int(CountingClipping.calls.numpy()) == 1
        assert int(optimizer.iterations.numpy()) == 1
        train_private(trimmed, x[:4], y[:4], clip=0.5, micro_batch=4, steps=1, normalize_by=4)
        for p, t, w0 in zip(reference.weights(padded), reference.weights(trimmed), before):
            np.testing.assert_allclose(p - w0, t - w0, rtol=1e-5, atol=1e-7)

    def test_nonfinite_example_is_dropped_and_counted(self):
        model = dense_model()
        x, y = dense_data(n=4)
        x[2] = np.inf
        optimizer = train_private(model, x, y, clip=1.0, micro_batch=4, steps=1)
        assert int(optimizer.nonfinite_examples.numpy()) == 1
        assert all(np.all(np.isfinite(w)) for w in reference.weights(model))

    def test_dropout_masks_differ_between_examples(self):
        keras.utils.set_random_seed(0)
        model = DictInputModel(dropout=0.5)
        x = {"a": np.ones((8, 2), "float32"), "b": np.ones((8, 3), "float32")}
        y = np.zeros(8, "int32")
        model(x)
        model.compile(loss=LOSS)
        gradients, _, _ = tf_megadp.VectorizedClipping().per_example_gradients(model, x, y)
        head = gradients[-2].numpy().reshape(8, -1)
        distinct = {tuple(np.round(row, 5)) for row in head}
        assert len(distinct) > 1, "identical examples got identical dropout masks"


def dropout_clipped_sum(x, y, sample_weight, clipping, seed=None, clip=0.05):
    """The un-noised clipped sum of one private step of a fresh Dropout model.

    Built after `keras.utils.set_random_seed(0)`, as an adversary who knows
    the code and its public seed would rebuild it.
    """
    keras.utils.set_random_seed(0)
    inputs = keras.Input(x.shape[1:])
    hidden = keras.layers.Dropout(0.5)(keras.layers.Dense(8, activation="tanh")(inputs))
    model = tf_megadp.make_private(keras.Model(inputs, keras.layers.Dense(3)(hidden)))
    strategy = {"auto": tf_megadp.AutoClipping, "vectorized": tf_megadp.VectorizedClipping}[
        clipping](jit_compile=False)  # a tiny dense model: no XLA compilation to wait for
    model.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.SGD(1.0), l2_norm_clip=clip, noise_multiplier=0.0, normalize_by=1.0,
        clipping=strategy, seed=seed), loss=LOSS)
    before = reference.weights(model)
    model.fit(x, y, sample_weight=sample_weight, batch_size=len(x), shuffle=False, verbose=0)
    return np.concatenate([np.ravel(b - a) for b, a in zip(before, reference.weights(model))])


@pytest.mark.filterwarnings("ignore:DPOptimizer with noise_multiplier=0")
@pytest.mark.filterwarnings("ignore:arrays passed to fit")
@pytest.mark.parametrize("clipping", ["auto", "vectorized"])
def test_dropout_masks_are_secret_not_a_function_of_the_public_seed(clipping):
    """Issue 28, case 1 for library models.

    Before, Dropout drew its masks from seed-generator states that
    `keras.utils.set_random_seed` fixes (and model files hold): the
    adversary replayed the private step exactly (error 0.0 C) and so knew
    that adding one example at row 0 of 8 moved the clipped sum by 2.8 C
    (every later example got another row's mask). Now every draw of the
    private step is keyed by a secret in-memory key: the replay misses the
    run by about 3 C, and since the secret masks are i.i.d. across rows,
    coupling each example with its own mask bounds the sensitivity by C.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5, 4)).astype("float32")
    y = rng.integers(0, 3, (8, 5)).astype("int32")
    weights = np.ones((8, 5), "float32")
    run = dropout_clipped_sum(x, y, weights, clipping)
    replay = dropout_clipped_sum(x, y, weights, clipping)
    assert np.linalg.norm(run - replay) / 0.05 > 1.0
    # Control: a test-only seed (marked "seeded noise: not for release")
    # makes the masks reproducible, so the comparison can see equal runs.
    seeded = [dropout_clipped_sum(x, y, weights, clipping, seed=5) for _ in range(2)]
    np.testing.assert_array_equal(*seeded)


class TestFailClosed:
    def test_batch_normalization_is_rejected(self):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2),
                                  keras.layers.BatchNormalization()])
        with pytest.raises(PrivacyConfigurationError, match="LayerNormalization"):
            tf_megadp.make_private(model)

    def test_batch_normalization_nested_in_a_submodel_is_rejected(self):
        inner = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization()])
        model = keras.Sequential([keras.Input((3,)), inner, keras.layers.Dense(1)])
        with pytest.raises(PrivacyConfigurationError, match="mixes examples"):
            tf_megadp.make_private(model)

    def test_model_not_made_private_cannot_train_with_dp_optimizer(self):
        model = dense_model()
        model.compile(optimizer=tf_megadp.DPOptimizer(
            keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=1.0), loss=LOSS)
        x, y = dense_data(n=4)
        with pytest.raises(PrivacyConfigurationError, match="make_private"):
            model.fit(x, y, verbose=0)

    def test_apply_gradients_on_dp_optimizer_raises(self):
        optimizer = tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0)
        variable = keras.Variable(np.zeros(2, "float32"))
        with pytest.raises(PrivacyConfigurationError, match="aggregated"):
            optimizer.apply_gradients([(np.ones(2, "float32"), variable)])

    def test_private_model_with_plain_optimizer_raises(self):
        model = tf_megadp.make_private(dense_model())
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
        x, y = dense_data(n=4)
        with pytest.raises(PrivacyConfigurationError, match="DPOptimizer"):
            model.fit(x, y, verbose=0)

    def test_class_weight_is_rejected(self):
        model = tf_megadp.make_private(dense_model())
        model.compile(optimizer=tf_megadp.DPOptimizer(
            keras.optimizers.SGD(0.1), 1.0, 1.0), loss=LOSS)
        x, y = dense_data(n=4)
        with pytest.raises(PrivacyConfigurationError, match="sample_weight"):
            model.fit(x, y, class_weight={0: 1.0, 1: 2.0, 2: 1.0}, verbose=0)

    def test_loss_without_per_example_scalar_is_rejected(self):
        # A sequence output with reduction="none" leaves one loss per position.
        model = tf_megadp.make_private(keras.Sequential(
            [keras.Input((5, 6)), keras.layers.Dense(3)]))
        model.compile(
            optimizer=tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"),
        )
        x = np.zeros((4, 5, 6), "float32")
        y = np.zeros((4, 5), "int32")
        with pytest.raises(PrivacyConfigurationError, match="one scalar loss per example"):
            model.fit(x, y, verbose=0)

    def test_model_overriding_train_step_is_rejected(self):
        class Custom(keras.Model):
            def train_step(self, data):
                return {}

        inputs = keras.Input((2,))
        model = Custom(inputs, keras.layers.Dense(1)(inputs))
        with pytest.raises(PrivacyConfigurationError, match="compute_loss"):
            tf_megadp.make_private(model)

    def test_make_private_returns_the_same_model(self):
        model = dense_model()
        assert tf_megadp.make_private(model) is model
        assert tf_megadp.is_private(model)


def test_make_private_with_epsilon_spends_the_target_over_the_samplers_run():
    import dp_accounting
    from dp_accounting import rdp

    x, y = dense_data(n=64)
    sampler = tf_megadp.PoissonSampler.from_arrays(
        x, y, batch_size=16, epochs=2, micro_batch_size=8)
    model = tf_megadp.make_private_with_epsilon(
        dense_model(), keras.optimizers.SGD(0.1), sampler, target_epsilon=4.0, delta=1e-3,
        l2_norm_clip=1.0, accountant="rdp", loss=LOSS)
    callback = tf_megadp.PrivacyCallback(1e-3, accountant="rdp")
    model.fit(sampler.as_dataset(), callbacks=[callback], verbose=0)
    assert int(model.optimizer.iterations.numpy()) == sampler.schedule.total_steps == 8
    assert 0.99 * 4.0 <= callback.epsilon <= 4.0
    sigma = model.optimizer.noise_multiplier
    untruncated = rdp.RdpAccountant().compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(16 / 64, dp_accounting.GaussianDpEvent(sigma)),
        8)).get_epsilon(1e-3)
    assert callback.epsilon == pytest.approx(untruncated, rel=1e-3)


def test_make_private_with_epsilon_calibrates_correlated_noise_for_the_samplers_cycles():
    import dp_accounting
    from dp_accounting import rdp

    from tf_megadp.accounting import matrix_factorization as mf

    x, y = dense_data(n=64)
    sampler = tf_megadp.PoissonSampler.from_arrays(
        x, y, batch_size=8, epochs=1, micro_batch_size=8, cycle_length=2)
    model = tf_megadp.make_private_with_epsilon(
        dense_model(), keras.optimizers.SGD(0.1), sampler, target_epsilon=4.0, delta=1e-3,
        l2_norm_clip=1.0, accountant="rdp", noise=tf_megadp.BandMF(num_bands=2), loss=LOSS)
    callback = tf_megadp.PrivacyCallback(1e-3, accountant="rdp")
    model.fit(sampler.as_dataset(), callbacks=[callback], verbose=0)
    assert model.optimizer.noise == tf_megadp.BandMF(2)
    assert 0.99 * 4.0 <= callback.epsilon <= 4.0
    # 8 steps in 4 rounds of 2, each a Poisson-sampled Gaussian at q = 2 * 8 / 64.
    sigma = model.optimizer.noise_multiplier
    untruncated = rdp.RdpAccountant().compose(mf.cyclic_poisson_event(
        sigma, num_examples=64, batch_size=8, steps=8, cycle_length=2,
        num_bands=2)).get_epsilon(1e-3)
    assert callback.epsilon == pytest.approx(untruncated, rel=1e-3)
    with pytest.raises(PrivacyConfigurationError, match="BLT.*no privacy proof under Poisson"):
        tf_megadp.make_private_with_epsilon(
            dense_model(), keras.optimizers.SGD(0.1), tf_megadp.PoissonSampler.from_arrays(
                x, y, batch_size=8, epochs=1, micro_batch_size=8), target_epsilon=4.0,
            delta=1e-3, l2_norm_clip=1.0, noise=tf_megadp.BLT(2), loss=LOSS)


def test_make_private_with_epsilon_refuses_data_no_poisson_sampler_drew():
    with pytest.raises(PrivacyConfigurationError, match="Poisson sampler"):
        tf_megadp.make_private_with_epsilon(
            dense_model(), keras.optimizers.SGD(0.1), np.zeros((8, 6)), target_epsilon=1.0,
            delta=1e-3, l2_norm_clip=1.0, loss=LOSS)


class TestTrainingFurther:
    """Issue #27: after a schedule ended, the errors led in a circle and no call trained further."""

    @pytest.fixture(scope="class")
    def finished_run(self):
        """A private run whose 2-step Poisson schedule is complete."""
        x, y = dense_data(n=64)
        sampler = tf_megadp.PoissonSampler.from_arrays(
            x, y, batch_size=16, epochs=0.5, micro_batch_size=8, seed=0)
        model = tf_megadp.make_private(dense_model())
        model.compile(optimizer=tf_megadp.DPOptimizer(
            keras.optimizers.Adam(0.01), 1.0, 1.0, schedule=sampler.schedule, seed=1), loss=LOSS)
        model.fit(sampler.as_dataset(), verbose=0,
                  callbacks=[tf_megadp.PrivacyCallback(1e-3, accountant="rdp")])
        assert int(model.optimizer.iterations.numpy()) == sampler.schedule.total_steps == 2
        return model, sampler.schedule, (x, y)

    def test_an_exhausted_schedule_says_so_and_names_the_call(self, finished_run):
        # Before: "Create the sampler with start_step=...", then "fit consumed
        # no micro-batch ... Under a tf.distribute strategy", then "Build the
        # DPOptimizer with schedule=sampler.schedule".
        model, schedule, (x, y) = finished_run
        attempts = [
            dict(batch_size=16, epochs=0.5, micro_batch_size=8),
            dict(schedule=schedule, start_step=2),
            dict(batch_size=16, epochs=1, micro_batch_size=8, start_step=2),
        ]
        for attempt in attempts:
            sampler = tf_megadp.PoissonSampler.from_arrays(x, y, seed=1, **attempt)
            with pytest.raises(PrivacyConfigurationError,
                               match=r"schedule is exhausted.*tf_megadp.extend_schedule"):
                model.fit(sampler.as_dataset(), verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 2

    def test_extend_schedule_continues_the_ledger_and_the_inner_optimizer(self, finished_run):
        import dp_accounting
        from dp_accounting import rdp

        model, schedule, (x, y) = finished_run
        inner = model.optimizer.inner_optimizer
        longer = tf_megadp.extend_schedule(model, [(3, 32)])
        assert longer.phases[0] == schedule.phases[0] and longer.total_steps == 5
        sampler = tf_megadp.PoissonSampler.from_arrays(
            x, y, schedule=longer, start_step=int(model.optimizer.iterations.numpy()), seed=2)
        callback = tf_megadp.PrivacyCallback(1e-3, accountant="rdp")
        model.fit(sampler.as_dataset(), verbose=0, callbacks=[callback])
        assert model.optimizer.inner_optimizer is inner
        assert int(inner.iterations.numpy()) == 5
        assert [(e.steps, e.sampling_rate) for e in callback.ledger] == [(2, 16 / 64), (3, 32 / 64)]
        composed = dp_accounting.ComposedDpEvent([
            dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
                q, dp_accounting.GaussianDpEvent(1.0)), steps)
            for steps, q in ((2, 16 / 64), (3, 32 / 64))])
        assert callback.epsilon == pytest.approx(
            rdp.RdpAccountant().compose(composed).get_epsilon(1e-3), rel=1e-2)

    def test_a_run_without_schedule_is_told_how_to_train_further(self):
        model = tf_megadp.make_private(dense_model())
        model.compile(optimizer=tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0),
                      loss=LOSS)
        with pytest.raises(PrivacyConfigurationError, match="call fit again.*inner_optimizer"):
            tf_megadp.extend_schedule(model, [(3, 32)])


def test_data_whose_every_row_is_padding_is_refused_before_any_step():
    # All sample weights zero: N = 0 examples. Before, fit failed after its
    # first step with "some example entered one noisy sum twice".
    x, y = dense_data(n=8)
    model = dense_model()
    tf_megadp.make_private(model)
    model.compile(optimizer=tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0),
                  loss=LOSS)
    with pytest.raises(PrivacyConfigurationError, match="holds no example"):
        model.fit(x, y, sample_weight=np.zeros(8, "float32"), batch_size=4, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


class TestAKeptTrainFunctionOutlivesNoOptimizer:
    """Attack (issue 37, 2): fit's train function, kept across compile or make_private.

    Before the fix a train function held from before `compile` trained on
    through the old DPOptimizer (6 more noisy steps, outside every ledger
    the model reports), and `make_private` applied again left fit's cached
    train function, traced with the earlier settings, in place.
    """

    @pytest.mark.filterwarnings("ignore:.*fixed-size batches, not Poisson draws")
    def test_it_refuses_at_run_time_and_fit_traces_again(self):
        x, y = dense_data(n=16)

        def dp_optimizer():
            return tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0, seed=1)

        model = tf_megadp.make_private(dense_model())
        model.compile(optimizer=dp_optimizer(), loss=LOSS)
        model.fit(x, y, batch_size=8, verbose=0)
        kept, old = model.train_function, model.optimizer
        batches = iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True))
        model.compile(optimizer=dp_optimizer(), loss=LOSS)
        with pytest.raises(tf.errors.InvalidArgumentError, match="outlived its optimizer"):
            kept(batches)
        assert int(old.iterations.numpy()) == 2
        model.fit(x, y, batch_size=8, verbose=0)
        assert tf_megadp.model_ledger(model).total_steps == 4

        kept = model.train_function
        tf_megadp.make_private(model, log_nonfinite_examples=True)
        assert model.train_function is None
        with pytest.raises(tf.errors.InvalidArgumentError, match="outlived its optimizer"):
            kept(iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)))
        assert tf_megadp.model_ledger(model).total_steps == 4


def count_traces(model):
    """A list whose length grows by one each time Keras traces (and XLA compiles) the step."""
    traces = []
    step = model.train_step

    def train_step(data):
        traces.append(tf.nest.map_structure(lambda t: tuple(t.shape), data))
        return step(data)

    model.train_step = train_step
    return traces


@pytest.mark.filterwarnings("ignore:.*fixed-size batches, not Poisson draws")
@pytest.mark.filterwarnings("ignore:.*noise_multiplier")
class TestCompiledWhole:
    """The DP step compiled whole with XLA (what TPUStrategy always does) traces once (issue 49).

    A step that traced again at each fit call, or whose shapes were not
    static, would be compiled by XLA again: on a TPU, minutes per call.
    """

    def test_it_traces_once_across_steps_fit_calls_and_other_models_fits(self):
        x, y = dense_data(n=16)
        model = tf_megadp.make_private(embedding_model())
        model.compile(optimizer=tf_megadp.DPOptimizer(
            keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=1.0,
            accumulation_steps=2), loss=LOSS, jit_compile=True)
        traces = count_traces(model)
        other = embedding_model(seed=1)
        other.compile(optimizer="sgd", loss=LOSS, jit_compile=True)
        tokens = (np.abs(x[:, :4]) * 5).astype("int32") % 20
        for _ in range(3):
            model.fit(tokens, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
            other.fit(tokens, y, batch_size=4, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 12
        assert traces == [((4, 4), (4,))]
        # The count can fail: another batch shape is another trace.
        model.fit(tokens[:6], y[:6], batch_size=6, shuffle=False, verbose=0)
        assert len(traces) == 2
