"""Specification of `DPOptimizer`: noise, seeds, settings, schedules, persistence."""

import math
import warnings

import keras
import numpy as np
import pytest
from scipy import stats

import tf_megadp
from tf_megadp import BatchSizeSchedule, Phase, PrivacyConfigurationError
from tests import reference

CLIP, SIGMA, DIVISOR = 0.5, 2.0, 10.0


def wide_model(seed=0):
    """100,250 parameters: enough coordinates for a tight variance test."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((400,)), keras.layers.Dense(250)])


def noise_update(*, seed, accumulation_steps=1, micro_batch=2):
    """The update of one logical step in which every example is padding.

    All sample weights are zero, so every clipped gradient is zero and the
    whole update is -noise / B with SGD(learning_rate=1).
    """
    model = wide_model()
    optimizer = tf_megadp.DPOptimizer(
        keras.optimizers.SGD(1.0),
        l2_norm_clip=CLIP,
        noise_multiplier=SIGMA,
        accumulation_steps=accumulation_steps,
        normalize_by=DIVISOR,
        seed=seed,
    )
    tf_megadp.make_private(model)
    model.compile(optimizer=optimizer, loss="mse")
    n = micro_batch * accumulation_steps
    x = np.ones((n, 400), "float32")
    y = np.ones((n, 250), "float32")
    before = reference.weights(model)
    model.fit(x, y, sample_weight=np.zeros(n, "float32"), batch_size=micro_batch,
              shuffle=False, verbose=0)
    assert int(optimizer.iterations.numpy()) == 1
    return np.concatenate([(a - b).ravel() for a, b in zip(reference.weights(model), before)])


def assert_std_is(values, expected_std, alpha=1e-6):
    """Two-sided chi-square test of a zero-mean normal sample's variance."""
    statistic = np.sum((values / expected_std) ** 2)
    p_low = stats.chi2.cdf(statistic, df=values.size)
    assert alpha / 2 < p_low < 1 - alpha / 2, (
        f"sample std {values.std():.6g} vs expected {expected_std:.6g} "
        f"(chi-square cdf {p_low:.3g}, n={values.size})"
    )


@pytest.fixture(scope="module")
def seeded_update():
    return noise_update(seed=42)


class TestNoise:
    def test_std_is_sigma_clip_over_batch(self, seeded_update):
        assert seeded_update.size >= 100_000
        assert abs(seeded_update.mean()) < 5 * SIGMA * CLIP / DIVISOR / math.sqrt(seeded_update.size)
        assert_std_is(seeded_update, SIGMA * CLIP / DIVISOR)

    def test_the_variance_test_can_fail(self, seeded_update):
        with pytest.raises(AssertionError):
            assert_std_is(seeded_update, 1.02 * SIGMA * CLIP / DIVISOR)

    def test_std_does_not_grow_with_accumulation_steps(self):
        update = noise_update(seed=7, accumulation_steps=4)
        assert_std_is(update, SIGMA * CLIP / DIVISOR)

    def test_same_seed_same_noise(self, seeded_update):
        np.testing.assert_array_equal(noise_update(seed=42), seeded_update)

    def test_no_seed_draws_fresh_noise(self):
        first, second = noise_update(seed=None), noise_update(seed=None)
        assert not np.allclose(first, second)


class TestSettings:
    @pytest.mark.parametrize(
        "kwargs, message",
        [
            ({"l2_norm_clip": 0.0}, "l2_norm_clip"),
            ({"l2_norm_clip": -1.0}, "l2_norm_clip"),
            ({"l2_norm_clip": float("inf")}, "l2_norm_clip"),
            ({"noise_multiplier": -0.1}, "noise_multiplier"),
            ({"noise_multiplier": float("nan")}, "noise_multiplier"),
            ({"accumulation_steps": 0}, "accumulation_steps"),
            ({"accumulation_steps": 2.5}, "accumulation_steps"),
            ({"normalize_by": 0}, "normalize_by"),
            ({"seed": "abc"}, "seed"),
        ],
    )
    def test_invalid_values_raise(self, kwargs, message):
        settings = {"l2_norm_clip": 1.0, "noise_multiplier": 1.0, **kwargs}
        with pytest.raises(ValueError, match=message):
            tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), **settings)

    def test_zero_noise_warns_that_training_is_not_private(self):
        with pytest.warns(UserWarning, match="NOT differentially private"):
            tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 0.0)

    def test_positive_noise_does_not_warn(self):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 0.5)

    def test_wrapping_a_dp_optimizer_is_rejected(self):
        inner = tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0)
        with pytest.raises(PrivacyConfigurationError, match="twice"):
            tf_megadp.DPOptimizer(inner, 1.0, 1.0)

    def test_inner_loss_scale_factor_is_rejected(self):
        with pytest.raises(PrivacyConfigurationError, match="loss_scale_factor"):
            tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1, loss_scale_factor=8.0), 1.0, 1.0)

    def test_schedule_excludes_fixed_accumulation(self):
        schedule = BatchSizeSchedule([Phase(2, 8, 2)], num_examples=100, micro_batch_size=4)
        with pytest.raises(ValueError, match="schedule"):
            tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0,
                                  accumulation_steps=2, schedule=schedule)

    def test_config_round_trip(self):
        schedule = BatchSizeSchedule(
            [Phase(2, 8, 2), Phase(3, 12, 3, noise_multiplier=0.7)],
            num_examples=100, micro_batch_size=4)
        optimizer = tf_megadp.DPOptimizer(keras.optimizers.Adam(3e-4), 0.8, 1.3,
                                          seed=11, schedule=schedule)
        config = optimizer.get_config()
        clone = tf_megadp.DPOptimizer.from_config(config)
        assert clone.get_config() == config
        assert clone.schedule == schedule
        assert isinstance(clone.inner_optimizer, keras.optimizers.Adam)
        restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
        assert isinstance(restored, tf_megadp.DPOptimizer)
        assert restored.get_config() == config


@pytest.mark.filterwarnings("ignore:DPOptimizer with noise_multiplier=0")
class TestSchedule:
    def test_accumulation_steps_and_divisor_follow_the_phases(self):
        schedule = BatchSizeSchedule(
            [Phase(1, 4, 2), Phase(2, 6, 3, noise_multiplier=0.5)],
            num_examples=50, micro_batch_size=2)
        optimizer = tf_megadp.DPOptimizer(keras.optimizers.SGD(1.0), 1.0, 0.0,
                                          schedule=schedule, seed=0)
        assert [optimizer.accumulation_steps_at(t) for t in range(4)] == [2, 3, 3, 3]
        assert [optimizer.batch_size_at(t) for t in range(3)] == [4.0, 6.0, 6.0]
        assert [optimizer.noise_multiplier_at(t) for t in range(3)] == [0.0, 0.5, 0.5]
        keras.utils.set_random_seed(0)
        model = tf_megadp.make_private(
            keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
        model.compile(optimizer=optimizer, loss="mse")
        x = np.ones((16, 3), "float32")
        y = np.ones((16, 1), "float32")
        counts = []
        for micro_batch in range(8):
            model.train_on_batch(x[:2], y[:2])
            counts.append((int(optimizer.iterations.numpy()), int(optimizer.micro_steps.numpy())))
        assert counts == [(0, 1), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2), (3, 0)]


def _train_micro_batches(model, x, y, batch, callbacks=()):
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0, callbacks=list(callbacks))


def _private_dense(seed=3):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                              keras.layers.Dense(2)])
    optimizer = tf_megadp.DPOptimizer(keras.optimizers.Adam(0.05), l2_norm_clip=0.7,
                                      noise_multiplier=0.8, accumulation_steps=3, seed=5)
    tf_megadp.make_private(model)
    model.compile(optimizer=optimizer, loss="mse")
    return model


class TestPersistence:
    def test_save_and_load_mid_accumulation_continue_the_same_run(self, tmp_path):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(24, 4)).astype("float32")
        y = rng.normal(size=(24, 2)).astype("float32")
        straight = _private_dense()
        _train_micro_batches(straight, x, y, batch=4)  # 6 micro-batches = 2 steps

        resumed = _private_dense()
        _train_micro_batches(resumed, x[:16], y[:16], batch=4)  # 1 step + 1 micro
        accumulators = [a.numpy() for a in resumed.optimizer._accumulators]
        path = tmp_path / "mid.keras"
        resumed.save(path)
        loaded = keras.models.load_model(path)
        optimizer = loaded.optimizer
        assert isinstance(optimizer, tf_megadp.DPOptimizer)
        assert int(optimizer.iterations.numpy()) == 1
        assert int(optimizer.micro_steps.numpy()) == 1
        for a, b in zip(optimizer._accumulators, accumulators):
            np.testing.assert_array_equal(a.numpy(), b)
        np.testing.assert_array_equal(optimizer.noise_key.numpy(),
                                      resumed.optimizer.noise_key.numpy())
        tf_megadp.make_private(loaded)
        _train_micro_batches(loaded, x[16:], y[16:], batch=4)
        assert int(optimizer.iterations.numpy()) == 2
        for a, b in zip(reference.weights(loaded), reference.weights(straight)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

    def test_loaded_model_without_make_private_refuses_to_train(self, tmp_path):
        model = _private_dense()
        x = np.zeros((4, 4), "float32")
        y = np.zeros((4, 2), "float32")
        _train_micro_batches(model, x, y, batch=4)
        model.save(tmp_path / "m.keras")
        loaded = keras.models.load_model(tmp_path / "m.keras")
        with pytest.raises(PrivacyConfigurationError, match="make_private"):
            loaded.fit(x, y, verbose=0)

    def test_model_checkpoint_keeps_micro_step_and_accumulators(self, tmp_path):
        model = _private_dense()
        rng = np.random.default_rng(1)
        x = rng.normal(size=(16, 4)).astype("float32")
        y = rng.normal(size=(16, 2)).astype("float32")
        path = tmp_path / "ckpt.keras"
        checkpoint = keras.callbacks.ModelCheckpoint(path, save_freq=4)
        _train_micro_batches(model, x, y, batch=4, callbacks=[checkpoint])
        loaded = keras.models.load_model(path)
        assert int(loaded.optimizer.iterations.numpy()) == 1
        assert int(loaded.optimizer.micro_steps.numpy()) == 1
        for a, b in zip(loaded.optimizer._accumulators, model.optimizer._accumulators):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
