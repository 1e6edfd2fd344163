"""Specification of `DPOptimizer`: noise, seeds, settings, schedules, persistence."""

import dataclasses
import inspect
import math
import os
import pathlib
import warnings

import keras
import numpy as np
import pytest

import tf_megadp
from tf_megadp import BatchSizeSchedule, Phase, PrivacyConfigurationError
from tf_megadp.optimizer import SETTING_NAMES, DPSettings
from tests import reference
from tests.reference import assert_std_is

CLIP, SIGMA, DIVISOR = 0.5, 2.0, 10.0


def wide_model(seed=0, dtype="float32"):
    """100,250 parameters: enough coordinates for a tight variance test."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((400,), dtype=dtype),
                             keras.layers.Dense(250, dtype=dtype)])


def _zero_loss(y_true, y_pred):
    return keras.ops.sum(y_pred * 0.0, axis=-1)


def noise_update(*, seed, accumulation_steps=1, micro_batch=2, dtype="float32"):
    """The update of one logical step in which every gradient is zero.

    The loss is zero whatever the prediction, so every clipped gradient is
    exactly zero and the whole update is -noise / B with SGD(learning_rate=1).
    (All-zero sample weights would make every row padding, and data without
    an example is refused.)
    """
    model = wide_model(dtype=dtype)
    optimizer = tf_megadp.DPOptimizer(
        keras.optimizers.SGD(1.0),
        l2_norm_clip=CLIP,
        noise_multiplier=SIGMA,
        accumulation_steps=accumulation_steps,
        normalize_by=DIVISOR,
        seed=seed,
    )
    tf_megadp.make_private(model)
    model.compile(optimizer=optimizer, loss=_zero_loss)
    n = micro_batch * accumulation_steps
    x = np.arange(n * 400).reshape(n, 400).astype(dtype)
    y = np.ones((n, 250), dtype)
    before = reference.weights(model)
    model.fit(x, y, batch_size=micro_batch, shuffle=False, verbose=0)
    assert int(optimizer.iterations.numpy()) == 1
    accumulator_dtypes = {v.dtype for v in optimizer.accumulation_stage.state.accumulators}
    assert accumulator_dtypes == {"float64" if dtype == "float64" else "float32"}
    return np.concatenate([(a - b).ravel() for a, b in zip(reference.weights(model), before)])


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

    def test_a_float64_model_gets_float64_noise(self):
        update = noise_update(seed=3, dtype="float64")
        assert_std_is(update, SIGMA * CLIP / DIVISOR)
        # Float32 noise cast up would survive a round trip through float32.
        assert np.mean(update.astype(np.float32).astype(np.float64) != update) > 0.99

    def test_a_bfloat16_model_accumulates_and_draws_noise_in_float32(self):
        update = noise_update(seed=3, dtype="bfloat16")
        # Only the final update is rounded to the weights' bfloat16.
        assert abs(np.std(update) / (SIGMA * CLIP / DIVISOR) - 1) < 0.02

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

    def test_each_setting_is_one_field_of_dp_settings(self):
        # The signature names DPSettings' fields, in order and with the same
        # defaults; the saved config and the report follow the fields, so a
        # new setting cannot be left out of either.
        fields = dataclasses.fields(DPSettings)
        arguments = [parameter for parameter in
                     inspect.signature(tf_megadp.DPOptimizer).parameters.values()
                     if parameter.name not in ("optimizer", "settings", "name", "kwargs")]
        assert [p.name for p in arguments] == [f.name for f in fields] == list(SETTING_NAMES)
        for parameter, field in zip(arguments, fields):
            # The two settings without a default default to None in the
            # signature: DPOptimizer(inner, settings=DPSettings(...)) gives them.
            default = None if field.default is dataclasses.MISSING else field.default
            assert parameter.default == default, field.name
        optimizer = tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0, seed=5)
        assert set(SETTING_NAMES) <= set(optimizer.get_config())
        report = optimizer.settings_report()
        # The report says whether the noise was seeded, never the seed (it
        # regenerates the noise).
        assert set(report) >= set(SETTING_NAMES) - {"seed"} and "seed" not in report
        assert 5 not in report.values()

    def test_settings_are_frozen_and_rebuilt_from_their_config(self):
        schedule = BatchSizeSchedule([Phase(2, 8, 2)], num_examples=100, micro_batch_size=4)
        settings = DPSettings(l2_norm_clip=0.5, noise_multiplier=2.0, schedule=schedule,
                              per_example_scaling="automatic", automatic_scaling_stability=0.1)
        assert DPSettings(**settings.to_config()) == settings
        assert settings.accumulation_steps is None  # The phases set it.
        with pytest.raises(dataclasses.FrozenInstanceError):
            settings.noise_multiplier = 0.0

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


class TestCorrelatedNoiseSettings:
    """`DPOptimizer(noise=...)`: a frozen setting whose config is the mechanism's public description."""

    SCHEDULE = BatchSizeSchedule([Phase(20, 8, 2)], num_examples=100, micro_batch_size=4)

    def test_the_mechanism_is_a_setting_saved_by_its_description(self):
        optimizer = tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 2.0,
                                          schedule=self.SCHEDULE,
                                          noise=tf_megadp.BLT(num_buffers=2))
        config = optimizer.get_config()
        assert config["noise"] == {"kind": "blt", "num_buffers": 2, "buffer_decays": None,
                                   "output_scales": None}
        clone = tf_megadp.DPOptimizer.from_config(config)
        assert clone.noise == tf_megadp.BLT(2) and clone.get_config() == config
        # The strategy it streams: optimized for the schedule's 20 steps and
        # its epochs of N // B = 12 steps.
        assert clone.noise_strategy == tf_megadp.BLT(2).resolve(20, steps_per_epoch=12)
        assert optimizer.settings_report()["noise"]["kind"] == "blt"
        with pytest.raises(PrivacyConfigurationError, match="cannot change"):
            optimizer.noise = None

    @pytest.mark.parametrize("kwargs, message", [
        ({"noise_multiplier": 0.0}, "adds no noise to correlate"),
        ({"schedule": BatchSizeSchedule([Phase(2, 8, 2), Phase(2, 8, 2, noise_multiplier=3.0)],
                                        num_examples=100, micro_batch_size=4)},
         "one sigma for the run"),
        ({"schedule": None}, "which only a schedule gives"),
        ({"noise": tf_megadp.BandMF(40)}, "exceeds the run's 20 steps"),
        ({"noise": "bandmf"}, "noise must be None or a registered noise mechanism"),
    ])
    def test_noise_without_a_stream_is_refused_when_built(self, kwargs, message):
        settings = {"l2_norm_clip": 1.0, "noise_multiplier": 1.0, "schedule": self.SCHEDULE,
                    "noise": tf_megadp.BandMF(4), **kwargs}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sigma = 0 warns too.
            with pytest.raises((PrivacyConfigurationError, TypeError), match=message):
                tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), **settings)

    def test_given_coefficients_need_no_schedule(self):
        optimizer = tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0,
                                          noise=tf_megadp.BandMF(2, coefficients=[1.0, 0.5]))
        assert optimizer.noise_strategy.coefficients == pytest.approx(
            (1 / math.sqrt(1.25), 0.5 / math.sqrt(1.25)))


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


def _twelve_examples():
    """Twelve distinct examples (identical rows would be one example: N counts distinct rows)."""
    x = np.arange(48, dtype="float32").reshape(12, 4) / 48.0
    return x, np.zeros((12, 2), "float32")


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


class TestReplayedSteps:
    """Issue 37: a step run again after `load_weights` in the same process draws fresh noise.

    The noise of a step was drawn from (key, step) and the key outlives a
    restore, so the step after the loaded file drew its first run's noise
    again, bit for bit: two releases whose difference is the difference of
    their noise-free sums. Now every noise and every dropout mask of the
    replayed step is new; a run that is not rolled back draws as before.
    """

    def _private(self, noise_multiplier=SIGMA, model=None):
        model = reference.rollback_model() if model is None else model
        optimizer = tf_megadp.DPOptimizer(
            keras.optimizers.SGD(1.0), l2_norm_clip=CLIP, noise_multiplier=noise_multiplier,
            normalize_by=DIVISOR)
        tf_megadp.make_private(model)
        model.compile(optimizer=optimizer, loss=reference.zero_loss)
        return model

    @staticmethod
    def _step_twice_from_a_file(model, x, y, path):
        """Trains a step, saves, trains one more, loads the file, trains it again."""
        model.fit(x, y, batch_size=len(x), verbose=0)
        model.save_weights(path)
        model.fit(x, y, batch_size=len(x), verbose=0)
        first = reference.weights(model)
        model.load_weights(path)
        model.fit(x, y, batch_size=len(x), verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 2
        return first, reference.weights(model)

    def test_a_step_after_load_weights_draws_new_noise(self, tmp_path):
        x, y = reference.rollback_examples(2)
        first, second = self._step_twice_from_a_file(
            self._private(), x, y, str(tmp_path / "step1.weights.h5"))
        reference.assert_replayed_noise_is_fresh(first, second, SIGMA * CLIP / DIVISOR)

    @pytest.mark.filterwarnings("ignore:DPOptimizer with noise_multiplier=0")
    def test_a_step_after_its_variables_are_assigned_back_draws_new_dropout_masks(self):
        # Keras files and checkpoints do not hold a SeedGenerator's state, but
        # an in-memory rollback that assigns back every variable of the model
        # and its optimizer does. Without noise, the updates differ only
        # where the masks differ.
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16),
                                  keras.layers.Dropout(0.5), keras.layers.Dense(2)])
        tf_megadp.make_private(model)
        model.compile(optimizer=tf_megadp.DPOptimizer(
            keras.optimizers.SGD(1.0), l2_norm_clip=100.0, noise_multiplier=0.0,
            normalize_by=DIVISOR, clipping="vectorized"), loss="mse")
        x, y = _twelve_examples()
        model.fit(x, y + 1.0, batch_size=len(x), verbose=0)
        variables = model.variables + model.optimizer.variables
        snapshot = [v.numpy() for v in variables]
        model.fit(x, y + 1.0, batch_size=len(x), verbose=0)
        first = reference.weights(model)
        for variable, value in zip(variables, snapshot):
            variable.assign(value)
        model.fit(x, y + 1.0, batch_size=len(x), verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 2
        assert not np.allclose(reference.flat(first), reference.flat(reference.weights(model)))


class TestPersistence:
    def test_a_mid_step_save_resumes_at_the_step_boundary(self, tmp_path):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(16, 4)).astype("float32")
        y = rng.normal(size=(16, 2)).astype("float32")
        model = _private_dense()
        checkpoint = keras.callbacks.ModelCheckpoint(tmp_path / "mid.keras", save_freq=4)
        # 4 micro-batches of 4 with k = 3: the save happens one micro-batch
        # into logical step 2, and the fit ends by discarding it.
        with pytest.warns(UserWarning, match="Discarded the last 1 micro-batches"):
            _train_micro_batches(model, x, y, batch=4, callbacks=[checkpoint])
        assert int(model.optimizer.micro_steps.numpy()) == 0
        loaded = keras.models.load_model(tmp_path / "mid.keras")
        optimizer = loaded.optimizer
        assert isinstance(optimizer, tf_megadp.DPOptimizer)
        assert int(optimizer.iterations.numpy()) == 1
        assert int(optimizer.micro_steps.numpy()) == 0
        assert all(not np.any(a.numpy()) for a in optimizer.accumulation_stage.state.accumulators)
        assert tf_megadp.read_ledger(optimizer).total_steps == 1
        tf_megadp.make_private(loaded)
        _train_micro_batches(loaded, x[:12], y[:12], batch=4)
        assert int(optimizer.iterations.numpy()) == 2
        assert tf_megadp.read_ledger(optimizer).total_steps == 2

    def test_loaded_model_without_make_private_refuses_to_train(self, tmp_path):
        model = _private_dense()
        x, y = _twelve_examples()
        _train_micro_batches(model, x, y, batch=4)
        model.save(tmp_path / "m.keras")
        loaded = keras.models.load_model(tmp_path / "m.keras")
        with pytest.raises(PrivacyConfigurationError, match="make_private"):
            loaded.fit(x, y, verbose=0)

    def test_weights_with_a_ledger_refuse_an_unbuilt_dp_optimizer(self, tmp_path):
        # Without make_private's guard: Keras would skip the optimizer's
        # variables with a warning, and the run would restart its ledger at 0.
        model = _private_dense()
        _train_micro_batches(model, *_twelve_examples(), batch=4)
        assert tf_megadp.read_ledger(model.optimizer).total_steps == 1
        model.save_weights(tmp_path / "m.weights.h5")
        keras.utils.set_random_seed(3)
        plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                                  keras.layers.Dense(2)])
        plain.compile(optimizer=tf_megadp.DPOptimizer(keras.optimizers.Adam(0.05), 0.7, 0.8,
                                                      accumulation_steps=3), loss="mse")
        # Keras collects loading errors into one ValueError that quotes ours.
        with pytest.raises(ValueError, match="privacy ledger of the steps already taken"):
            plain.load_weights(tmp_path / "m.weights.h5")
        plain.optimizer.build(plain.trainable_variables)
        plain.load_weights(tmp_path / "m.weights.h5")
        assert tf_megadp.read_ledger(plain.optimizer).total_steps == 1


def test_read_ledger_before_the_optimizer_is_built_is_an_empty_ledger():
    # Issue #27. Before: AttributeError: 'DPOptimizer' object has no
    # attribute 'privacy_ledger_rows'.
    optimizer = tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0)
    assert tf_megadp.read_ledger(optimizer) == tf_megadp.PrivacyLedger()
    with pytest.raises(TypeError, match="keeps none"):
        tf_megadp.read_ledger(keras.optimizers.SGD(0.1))


def _h5_arrays(path):
    """Every dataset in an HDF5 file (Keras .weights.h5), as NumPy arrays."""
    import h5py

    arrays = []
    with h5py.File(path, "r") as handle:
        handle.visititems(lambda _, item: arrays.append(np.asarray(item))
                          if isinstance(item, h5py.Dataset) else None)
    return arrays


def _file_arrays(path):
    """Every array an attacker can read from a file tf_megadp or Keras wrote."""
    import zipfile

    import os

    path = str(path)
    if os.path.exists(path + ".index"):  # A tf.train.Checkpoint prefix.
        import tensorflow as tf

        reader = tf.train.load_checkpoint(path)
        return [np.asarray(reader.get_tensor(name))
                for name in reader.get_variable_to_shape_map()]
    if path.endswith(".keras"):
        with zipfile.ZipFile(path) as archive:
            archive.extract("model.weights.h5", path + ".unzipped")
        return _h5_arrays(path + ".unzipped/model.weights.h5")
    if path.endswith(".h5"):
        return _h5_arrays(path)
    with np.load(path) as saved:
        return [saved[name] for name in saved.files]


def _assert_no_file_removes_the_noise(files, key, update, clipped_sum, partial):
    """No integer pair in any file regenerates the noise; no array is an un-noised sum."""
    noise_error = np.sqrt(sum(np.sum((-DIVISOR * u - c) ** 2)
                              for u, c in zip(update, clipped_sum)))
    for name, path in files.items():
        arrays = _file_arrays(path)
        integers = np.concatenate([a.ravel() for a in arrays
                                   if np.issubdtype(a.dtype, np.integer)] or [np.zeros(0)])
        assert not np.isin(key, integers).any(), name
        candidates = [a.ravel().astype(np.int64)[i:i + 2]
                      for a in arrays if np.issubdtype(a.dtype, np.integer) and a.size >= 2
                      for i in range(a.size - 1)]
        if candidates:
            recovered = _recovered_sums(update, np.stack(candidates), DIVISOR)
            errors = np.sqrt(sum(np.sum((r - c) ** 2, axis=tuple(range(1, r.ndim)))
                                 for r, c in zip(recovered, clipped_sum)))
            assert np.all(errors > 0.1 * noise_error), (name, candidates[int(np.argmin(errors))])
        # The partial step's un-noised sum is in no file either.
        for array in arrays:
            for p in partial:
                assert not (array.shape == p.shape and np.allclose(array, p, atol=1e-5)), name


def _recovered_sum(update, key, divisor):
    """The attack: regenerate step 0's noise from `key` and remove it from the update.

    The update of SGD(learning_rate=1) is -(clipped sum + sigma C z) / B, and
    the DP step draws z from the key folded with the step (0), the draw
    generation (0: the step is not a replay), the replica (0) and the
    variable's index.
    """
    return [sums[0] for sums in _recovered_sums(update, np.asarray([key]), divisor)]


def _recovered_sums(update, keys, divisor):
    """`_recovered_sum` under each of K candidate keys at once: per variable, [K, *shape]."""
    import tensorflow as tf

    shapes = [tuple(delta.shape) for delta in update]

    @tf.function
    def words(keys):
        def of_key(key):
            folded = key
            for _ in range(3):  # step, generation, replica: all 0
                folded = tf.random.experimental.stateless_fold_in(
                    folded, tf.constant(0, tf.int64), alg="philox")
            return tuple(tf.random.stateless_uniform(
                [2, pairs], seed=tf.random.experimental.stateless_fold_in(folded, index,
                                                                         alg="philox"),
                minval=None, maxval=None, dtype=tf.uint32, alg="philox")
                for index, pairs in enumerate(pair_counts))

        return tf.map_fn(of_key, keys, fn_output_signature=tuple(
            tf.TensorSpec([2, pairs], tf.uint32) for pairs in pair_counts))

    pair_counts = [-(-int(np.prod(shape)) // 2) for shape in shapes]
    return [-divisor * delta[None] - SIGMA * CLIP * reference.box_muller_of_words(
                variable_words.numpy(), shape)
            for delta, variable_words, shape in zip(update, words(tf.constant(keys, tf.int64)),
                                                    shapes)]


class TestSecrets:
    """Attacks on what a run writes: nothing in a file may remove the noise."""

    def test_vars_of_the_optimizer_show_neither_the_key_nor_the_sums(self):
        # Before: repr(vars(optimizer)) printed the noise key and the
        # accumulators (the un-noised sum) with their values.
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = tf_megadp.DPOptimizer(keras.optimizers.SGD(1.0), l2_norm_clip=CLIP,
                                          noise_multiplier=SIGMA)
        optimizer.build(model.trainable_variables)
        state = optimizer.accumulation_stage.state
        state.accumulators[0].assign(np.full((3, 2), 0.123456, "float32"))
        shown = repr(vars(optimizer)) + repr(optimizer.__dict__)
        for stage in (optimizer.accumulation_stage, optimizer.noise_stage,
                      optimizer.ledger_stage):  # And each stage's own attributes.
            shown += repr(vars(stage))
        for word in optimizer.noise_stage.state.noise_key.numpy():
            assert str(int(word)) not in shown
        assert "0.123456" not in shown
        # Control: the value is really there, in memory.
        assert np.allclose(state.accumulators[0].numpy(), 0.123456)

    def test_no_file_holds_the_noise_key_or_the_clipped_sum(self, tmp_path):
        rng = np.random.default_rng(2)
        x = rng.normal(size=(6, 3)).astype("float32")
        y = rng.normal(size=(6, 2)).astype("float32")
        keras.utils.set_random_seed(1)
        model = tf_megadp.make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
        optimizer = tf_megadp.DPOptimizer(keras.optimizers.SGD(1.0), l2_norm_clip=CLIP,
                                          noise_multiplier=SIGMA, accumulation_steps=2,
                                          normalize_by=DIVISOR)
        model.compile(optimizer=optimizer, loss="mse")
        before = reference.weights(model)
        clipped_sum = [-DIVISOR * u for u in reference.naive_clipped_update(
            model, keras.losses.MeanSquaredError(), x[:4], y[:4], CLIP, DIVISOR)]
        files = {
            "checkpoint": tmp_path / "checkpoint.keras",
            "model": tmp_path / "model.keras",
            "weights": tmp_path / "model.weights.h5",
        }
        # Saved after 3 micro-batches: one noisy step applied, one micro-batch
        # (the un-noised sum of x[4:6]) accumulated.
        checkpoint = keras.callbacks.ModelCheckpoint(files["checkpoint"], save_freq=3)
        # The preemption backup of the private fit, asked for at every micro-batch.
        backup = keras.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=1,
                                                  delete_checkpoint=False)
        with pytest.warns(UserWarning, match="Discarded"):
            model.fit(x, y, batch_size=2, shuffle=False, verbose=0,
                      callbacks=[checkpoint, backup])
        files["backup"] = tmp_path / "backup" / "latest.weights.h5"
        update = [a - b for a, b in zip(reference.weights(model), before)]
        key = optimizer.noise_stage.state.noise_key.numpy()

        # The attack works with the real key: the test can fail.
        recovered = _recovered_sum(update, key, DIVISOR)
        for r, c in zip(recovered, clipped_sum):
            np.testing.assert_allclose(r, c, atol=1e-4)

        model.save(files["model"])
        model.save_weights(files["weights"])
        tf_megadp.save_training_state(model, str(tmp_path / "state"))
        [files["state"]] = (tmp_path / "state").glob("optimizer-*.npz")
        [files["state_weights"]] = (tmp_path / "state").glob("model-*.weights.h5")
        tf_megadp.export_model(model, tmp_path / "release.keras")
        files["release"] = tmp_path / "release.keras"
        partial = [-DIVISOR * u for u in reference.naive_clipped_update(
            model, keras.losses.MeanSquaredError(), x[4:], y[4:], CLIP, DIVISOR)]
        _assert_no_file_removes_the_noise(files, key, update, clipped_sum, partial)

    def test_no_checkpoint_of_a_custom_loop_holds_the_noise_key_or_the_clipped_sum(
            self, tmp_path):
        """The same attack on what a PrivateStep loop writes: tf.train.Checkpoint files."""
        import tensorflow as tf

        rng = np.random.default_rng(2)
        x = rng.normal(size=(6, 3)).astype("float32")
        y = rng.normal(size=(6, 2)).astype("float32")
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        step = tf_megadp.PrivateStep(
            model, tf_megadp.DPOptimizer(keras.optimizers.SGD(1.0), l2_norm_clip=CLIP,
                                         noise_multiplier=SIGMA, accumulation_steps=2,
                                         normalize_by=DIVISOR), loss="mse")
        step.begin((x, y), micro_batches_per_pass=3)
        before = reference.weights(model)
        clipped_sum = [-DIVISOR * u for u in reference.naive_clipped_update(
            model, keras.losses.MeanSquaredError(), x[:4], y[:4], CLIP, DIVISOR)]
        train = tf.function(step.run)
        for start in (0, 2, 4):  # One noisy step applied, one micro-batch accumulated.
            train((x[start:start + 2], y[start:start + 2]))
        update = [a - b for a, b in zip(reference.weights(model), before)]
        key = step.optimizer.noise_stage.state.noise_key.numpy()
        recovered = _recovered_sum(update, key, DIVISOR)
        for r, c in zip(recovered, clipped_sum):  # The attack works with the real key.
            np.testing.assert_allclose(r, c, atol=1e-4)

        files = {
            "step checkpoint": step.checkpoint().write(str(tmp_path / "step")),
            "tf.train.Checkpoint": tf.train.Checkpoint(
                model=model, optimizer=step.optimizer).write(str(tmp_path / "plain")),
        }
        manager = tf.train.CheckpointManager(step.checkpoint(), str(tmp_path / "managed"), 1)
        files["CheckpointManager"] = manager.save()
        tf_megadp.save_training_state(model, str(tmp_path / "state"))
        [files["state"]] = (tmp_path / "state").glob("optimizer-*.npz")
        partial = [-DIVISOR * u for u in reference.naive_clipped_update(
            model, keras.losses.MeanSquaredError(), x[4:], y[4:], CLIP, DIVISOR)]
        _assert_no_file_removes_the_noise(files, key, update, clipped_sum, partial)
        # Each checkpoint holds the ledger of the step applied (record ran first).
        restored = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        again = tf_megadp.PrivateStep(restored, tf_megadp.DPOptimizer(
            keras.optimizers.SGD(1.0), l2_norm_clip=CLIP, noise_multiplier=SIGMA,
            accumulation_steps=2, normalize_by=DIVISOR), loss="mse")
        again.checkpoint().read(files["CheckpointManager"]).assert_existing_objects_matched()
        assert tf_megadp.model_ledger(restored).total_steps == again.logical_step == 1

    def test_no_file_holds_the_correlated_noise_buffers(self, tmp_path):
        """Issue 39: the BandMF buffers (the last noise outputs) are in no file, log or config.

        Whoever holds them predicts the noise still to come (x_t subtracts
        c_j x_(t-j)) and holds noise already added. Every format a run
        writes is searched: the arrays of each file, and the raw bytes of
        each file (and of every member of a .keras archive) for the bytes of
        any 4 consecutive float32 buffer values.
        """
        import zipfile

        x = np.arange(64 * 3, dtype="float32").reshape(64, 3) / 64.0
        y = np.zeros((64, 2), "float32")
        schedule = BatchSizeSchedule([Phase(6, 4, 1)], num_examples=64, micro_batch_size=16)
        sampler = tf_megadp.PoissonSampler.from_arrays(x, y, schedule=schedule, cycle_length=4)
        keras.utils.set_random_seed(1)
        model = tf_megadp.make_private(keras.Sequential([keras.Input((3,)),
                                                         keras.layers.Dense(2)]))
        optimizer = tf_megadp.DPOptimizer(
            keras.optimizers.SGD(1.0), l2_norm_clip=CLIP, noise_multiplier=SIGMA,
            schedule=schedule, noise=tf_megadp.BandMF(num_bands=4))
        model.compile(optimizer=optimizer, loss="mse")
        files = {"checkpoint": tmp_path / "checkpoint.keras"}
        logged = []
        model.fit(sampler.as_dataset(), verbose=0, callbacks=[
            keras.callbacks.ModelCheckpoint(files["checkpoint"], save_freq=5),
            keras.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=1,
                                             delete_checkpoint=False),
            keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: logged.append(
                repr(logs)))])
        files["backup"] = tmp_path / "backup" / "latest.weights.h5"
        buffers = [b.numpy() for slots in optimizer.noise_stage.state.noise_buffers for b in slots]
        assert len(buffers) == 6 and all(np.any(b != 0) for b in buffers)  # In memory, live.
        files["model"] = tmp_path / "model.keras"
        model.save(files["model"])
        model.save_weights(tmp_path / "model.weights.h5")
        files["weights"] = tmp_path / "model.weights.h5"
        tf_megadp.save_training_state(model, str(tmp_path / "state"))
        [files["state"]] = (tmp_path / "state").glob("optimizer-*.npz")
        [files["state_weights"]] = (tmp_path / "state").glob("model-*.weights.h5")
        tf_megadp.export_model(model, tmp_path / "release.keras")
        files["release"] = tmp_path / "release.keras"
        import tensorflow as tf

        files["tf.train.Checkpoint"] = tf.train.Checkpoint(
            model=model, optimizer=optimizer).write(str(tmp_path / "plain"))
        patterns = [b.ravel()[i:i + 4].astype("float32").tobytes()
                    for b in buffers for i in range(0, b.size - 3)]
        for name, path in files.items():
            for array in _file_arrays(path):
                for buffer in buffers:
                    assert not (array.size >= buffer.size and np.isin(
                        buffer.ravel().astype("float32"), array.ravel()).all()), name
            blobs = []
            paths = [str(path)] if os.path.exists(str(path)) else [
                str(p) for p in pathlib.Path(str(path)).parent.glob(pathlib.Path(str(path)).name + "*")]
            for file_path in paths:
                with open(file_path, "rb") as stream:
                    blobs.append(stream.read())
                if zipfile.is_zipfile(file_path):
                    with zipfile.ZipFile(file_path) as archive:
                        blobs += [archive.read(member) for member in archive.namelist()]
            assert blobs, name
            for blob in blobs:
                assert not any(pattern in blob for pattern in patterns), name
        # Neither the logs nor the saved config show them: the config is the
        # mechanism's public description.
        config = repr(optimizer.get_config())
        assert optimizer.get_config()["noise"] == {"kind": "bandmf", "num_bands": 4,
                                                   "coefficients": None}
        for buffer in buffers:
            for value in buffer.ravel()[:8]:
                assert repr(float(value))[:8] not in config + "".join(logged)
        # The optimizer shows its noise stage, whose in-memory state shows no value.
        assert "noise stage" in repr(vars(optimizer))
        assert "noise buffers, not shown" in repr(vars(optimizer.noise_stage))

    def test_the_release_file_has_no_optimizer(self, tmp_path):
        model = _private_dense()
        _train_micro_batches(model, *_twelve_examples(), batch=4)
        tf_megadp.export_model(model, tmp_path / "release.keras")
        released = keras.models.load_model(tmp_path / "release.keras")
        assert getattr(released, "optimizer", None) is None
        import zipfile

        with zipfile.ZipFile(tmp_path / "release.keras") as archive:
            assert b"dp_optimizer" not in archive.read("config.json")
            archive.extract("model.weights.h5", tmp_path)
        import h5py

        with h5py.File(tmp_path / "model.weights.h5") as handle:
            assert "optimizer" not in handle
        for a, b in zip(reference.weights(released), reference.weights(model)):
            np.testing.assert_array_equal(a, b)
        assert isinstance(model.optimizer, tf_megadp.DPOptimizer)  # Left as it was.

    def test_an_integer_seed_warns_and_is_marked(self):
        with pytest.warns(UserWarning, match="NOT private against them"):
            optimizer = tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0, seed=3)
        assert optimizer.seeded_noise
        assert not tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0).seeded_noise

    def test_accumulation_from_user_code_raises(self):
        model = _private_dense()
        model.optimizer.build(model.trainable_variables)
        gradients = [np.full(v.shape, 100.0, "float32") for v in model.trainable_variables]
        with pytest.raises(PrivacyConfigurationError, match="make_private"):
            model.optimizer.accumulate(gradients, model.trainable_variables, 4, 0)
        with pytest.raises(PrivacyConfigurationError, match="make_private"):
            model.optimizer.add_micro_batch(object(), gradients, model.trainable_variables, 4, 0)
        assert int(model.optimizer.micro_steps.numpy()) == 0


class TestImmutableSettings:
    @pytest.mark.parametrize("name, value", [
        ("noise_multiplier", 10.0), ("l2_norm_clip", 5.0), ("accumulation_steps", 1),
        ("normalize_by", 2.0), ("schedule", None), ("clipping", "ghost"), ("seed", 1),
    ] + [(name, None) for name in SETTING_NAMES] + [
        ("settings", None), ("inner_optimizer", None), ("clipping_strategy", None),
    ])
    def test_privacy_settings_cannot_change_after_construction(self, name, value):
        optimizer = tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0,
                                          accumulation_steps=4)
        with pytest.raises(PrivacyConfigurationError, match="compile the model again"):
            setattr(optimizer, name, value)

    def test_loss_scaling_inner_optimizers_are_refused(self):
        with pytest.raises(PrivacyConfigurationError, match="rescales the loss"):
            tf_megadp.DPOptimizer(
                keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), 1.0, 1.0)
        with pytest.raises(PrivacyConfigurationError, match="gradient_accumulation_steps"):
            tf_megadp.DPOptimizer(
                keras.optimizers.SGD(0.1, gradient_accumulation_steps=4), 1.0, 1.0)


@pytest.mark.filterwarnings("ignore:DPOptimizer with noise_multiplier=0")
class TestPerExampleScaling:
    """Automatic clipping (Bu et al. 2022) against the one-example-at-a-time reference."""

    @pytest.mark.parametrize("clipping", ["vectorized", "ghost"])
    @pytest.mark.parametrize("scaling, stability", [("automatic", 0.01), ("automatic", 0.5),
                                                    ("clip", None)])
    def test_update_equals_the_naive_reference(self, clipping, scaling, stability):
        rng = np.random.default_rng(1)
        x = rng.normal(size=(6, 4)).astype("float32")
        y = rng.normal(size=(6, 2)).astype("float32")
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                                  keras.layers.Dense(2)])
        # C = 2 sits between the smallest and largest norm: flat clipping
        # leaves some gradients alone, automatic clipping rescales all.
        kwargs = {} if stability is None else {"automatic_scaling_stability": stability}
        optimizer = tf_megadp.DPOptimizer(
            keras.optimizers.SGD(1.0), l2_norm_clip=2.0, noise_multiplier=0.0,
            normalize_by=6.0, clipping=clipping, per_example_scaling=scaling, **kwargs)
        tf_megadp.make_private(model)
        model.compile(optimizer=optimizer, loss="mse")
        expected = reference.naive_clipped_update(
            model, keras.losses.MeanSquaredError(), x, y, clip=2.0, divisor=6.0,
            automatic_stability=stability)
        norms = [np.sqrt(sum(np.sum(g**2) for g in grads)) for grads in
                 reference.naive_per_example_gradients(model, keras.losses.MeanSquaredError(), x, y)]
        assert min(norms) < 2.0 < max(norms)
        before = reference.weights(model)
        model.train_on_batch(x, y)
        for after, start, update in zip(reference.weights(model), before, expected):
            np.testing.assert_allclose(after - start, update, rtol=1e-4, atol=1e-7)

    def test_every_scaled_gradient_stays_below_the_clip_norm(self):
        # The sensitivity argument: C ||g|| / (||g|| + gamma) < C for any ||g||
        # (= C in float32 once gamma is below the rounding of ||g||).
        from tf_megadp.clipping import base

        norms = np.array([0.0, 1e-6, 0.5, 3.0, 1e6, np.inf], "float32")
        factors, nonfinite = base.clip_factors(norms, 2.0, np.ones(6, "float32"),
                                               automatic_stability=0.01)
        scaled = factors.numpy()[:5] * norms[:5]
        assert np.all(scaled <= 2.0) and scaled[-1] > 1.99
        assert factors.numpy()[-1] == 0.0 and int(nonfinite) == 1

    @pytest.mark.parametrize("kwargs, message", [
        ({"per_example_scaling": "normalise"}, "per_example_scaling"),
        ({"per_example_scaling": "automatic", "automatic_scaling_stability": 0.0},
         "automatic_scaling_stability"),
    ])
    def test_invalid_scaling_settings_raise(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            tf_megadp.DPOptimizer(keras.optimizers.SGD(1.0), 1.0, 1.0, **kwargs)

    def test_a_custom_strategy_written_for_flat_clipping_is_refused_for_automatic(self):
        class FlatOnly(tf_megadp.ClippingStrategy):
            def clip_and_sum(self, model, x, y, sample_weight, l2_norm_clip):
                raise AssertionError("never called")

        with pytest.raises(TypeError, match="accepts `automatic_stability`"):
            tf_megadp.DPOptimizer(keras.optimizers.SGD(1.0), 1.0, 1.0, clipping=FlatOnly(),
                                  per_example_scaling="automatic")
        # Flat clipping never passes the keyword: the same strategy is accepted.
        tf_megadp.DPOptimizer(keras.optimizers.SGD(1.0), 1.0, 1.0, clipping=FlatOnly())

    def test_scaling_is_frozen_and_survives_the_config(self):
        optimizer = tf_megadp.DPOptimizer(keras.optimizers.SGD(1.0), 1.0, 1.0,
                                          per_example_scaling="automatic",
                                          automatic_scaling_stability=0.1)
        with pytest.raises(PrivacyConfigurationError, match="cannot change"):
            optimizer.per_example_scaling = "clip"
        clone = tf_megadp.DPOptimizer.from_config(optimizer.get_config())
        assert (clone.per_example_scaling, clone.automatic_stability) == ("automatic", 0.1)


@pytest.mark.filterwarnings("ignore:DPOptimizer with noise_multiplier=0")
class TestWeightAveraging:
    """An inner optimizer's EMA averages the noisy weights of logical steps only."""

    def _run(self, callbacks=()):
        rng = np.random.default_rng(2)
        x = rng.normal(size=(12, 4)).astype("float32")
        y = rng.normal(size=(12, 2)).astype("float32")
        keras.utils.set_random_seed(4)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        optimizer = tf_megadp.DPOptimizer(
            keras.optimizers.SGD(0.5, use_ema=True, ema_momentum=0.6),
            l2_norm_clip=1.0, noise_multiplier=0.5, accumulation_steps=2, seed=1)
        tf_megadp.make_private(model)
        model.compile(optimizer=optimizer, loss="mse")
        after_each_step = []

        class Record(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if int(optimizer.micro_steps.numpy()) == 0:
                    after_each_step.append(reference.weights(model))

        model.fit(x, y, batch_size=2, shuffle=False, verbose=0,
                  callbacks=[Record(), *callbacks])
        return model, optimizer, after_each_step

    @staticmethod
    def _ema(history, momentum=0.6):
        # Keras's rule: the first average is the first step's weights.
        average = history[0]
        for weights in history[1:]:
            average = [momentum * a + (1 - momentum) * w for a, w in zip(average, weights)]
        return average

    def test_fit_leaves_the_average_of_the_logical_steps_in_the_model(self):
        model, optimizer, history = self._run()
        assert len(history) == int(optimizer.iterations.numpy()) == 3
        for got, expected in zip(reference.weights(model), self._ema(history)):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        assert not np.allclose(reference.weights(model)[0], history[-1][0])

    def test_swap_ema_weights_evaluates_the_average(self):
        evaluated = []

        class Evaluate(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                evaluated.append(reference.weights(self.model))

        # SwapEMAWeights runs before Evaluate at epoch end: Evaluate sees the average.
        model, _, history = self._run([keras.callbacks.SwapEMAWeights(swap_on_epoch=True),
                                       Evaluate()])
        for got, expected in zip(evaluated[-1], self._ema(history)):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        for got, expected in zip(reference.weights(model), self._ema(history)):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_clipping_strategy_instance_serves_one_optimizer():
    # Issue 42's review: a GhostClipping given to a second DPOptimizer (a
    # layer swapped, the model compiled again) ran the first optimizer's
    # traced passes, which neither trained nor checked the new layer.
    from tf_megadp.clipping.ghost import GhostClipping

    strategy = GhostClipping()
    first = tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0, clipping=strategy)
    assert first.clipping_strategy is strategy
    with pytest.raises(PrivacyConfigurationError, match=r"GhostClipping\(\.\.\.\) again"):
        tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0, clipping=strategy)
    fresh = tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0, clipping="ghost")
    assert fresh.clipping_strategy is not strategy


class TestComposition:
    """Issue 50: DPOptimizer is a composition of named stages, not mixins joined by `self.` calls."""

    def test_the_optimizer_is_one_keras_optimizer_holding_its_stages(self):
        from tf_megadp.optimizer.accumulators import AccumulationStage
        from tf_megadp.optimizer.ledger import LedgerStage
        from tf_megadp.optimizer.noise import NoiseStage

        assert tf_megadp.DPOptimizer.__bases__ == (keras.optimizers.Optimizer,)
        optimizer = tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0)
        assert isinstance(optimizer.accumulation_stage, AccumulationStage)
        assert isinstance(optimizer.noise_stage, NoiseStage)
        assert isinstance(optimizer.ledger_stage, LedgerStage)

    def test_dp_settings_can_be_given_whole_and_only_once(self):
        settings = DPSettings(l2_norm_clip=0.5, noise_multiplier=2.0, accumulation_steps=3)
        optimizer = tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), settings=settings)
        assert optimizer.settings is settings
        assert (optimizer.l2_norm_clip, optimizer.accumulation_steps) == (0.5, 3)
        assert tf_megadp.DPOptimizer.from_config(optimizer.get_config()).settings == settings
        with pytest.raises(TypeError, match=r"and \['noise_multiplier'\] as well"):
            tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), noise_multiplier=1.0,
                                  settings=settings)

    def test_no_self_call_crosses_a_file_of_the_optimizer_package(self):
        """A method that calls `self.name(...)` finds `name` in its own file (or in Keras)."""
        import ast
        import os

        folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "tf_megadp", "optimizer")
        trees = {name: ast.parse(open(os.path.join(folder, name), encoding="utf-8").read())
                 for name in os.listdir(folder) if name.endswith(".py")}
        defined = {name: {node.name for node in ast.walk(tree)
                          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
                   for name, tree in trees.items()}
        crossing = []
        for name, tree in trees.items():
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "self"
                        and node.func.attr not in defined[name]):
                    crossing += [(name, node.func.attr, other) for other in defined
                                 if node.func.attr in defined[other]]
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "locals":
                    crossing.append((name, "locals", None))
        assert crossing == []
