"""Specification of tf_megadp.optimizer.noise: correlated noise, streamed in memory.

The noise of logical step t is sigma C_clip (C^{-1} z)_t for the mechanism's
unit-norm strategy C (issue 39). On a model whose every gradient is zero,
with SGD(learning_rate=1), the update of step t is -(sigma C_clip / B) (C^{-1} z)_t:
the updates of T steps are P = 100,250 draws of a T-dimensional Gaussian
whose covariance must be (sigma C_clip / B)^2 C^{-1} C^{-T}, and, for a
seeded run, exactly `matrix_factorization`'s reference stream of the draws z.
"""

import math

import keras
import numpy as np
import pytest
from scipy import linalg

import tf_megadp
from tf_megadp import BLT, BandMF, BatchSizeSchedule, LambdaCGD, Phase
from tf_megadp.accounting import matrix_factorization as mf
from tf_megadp import gaussian
from tests import preempted_run, reference

# SIGMA is no float32 number: the ledger records the step's float32 sigma.
CLIP, SIGMA, BATCH, N, STEPS, SEED = 0.5, 2.1, 4, 64, 10, 11


def _wide_model():
    """100,250 parameters: the draws of the covariance test."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((400,)), keras.layers.Dense(250)])


def _examples(n=N, width=400):
    x = np.arange(n * width, dtype="float32").reshape(n, width) / (n * width)
    return x, np.zeros((n, 250 if width == 400 else width), "float32")


def _sampler(noise, steps=STEPS, width=400, **settings):
    """A sampler the mechanism has a proof for: cyclic Poisson (L = b) for BandMF, else fixed order."""
    x, y = _examples(width=width)
    # One micro-batch of 16 per step: a group of 16 never overflows it.
    schedule = BatchSizeSchedule([Phase(steps, BATCH, 1)], num_examples=N, micro_batch_size=16)
    if isinstance(noise, BandMF):
        return tf_megadp.PoissonSampler.from_arrays(
            x, y, schedule=schedule, cycle_length=noise.num_bands, seed=3, **settings)
    return tf_megadp.FixedOrderSampler.from_arrays(x, y, schedule=schedule, seed=3, **settings)


class _Updates(keras.callbacks.Callback):
    """The weights after every logical step."""

    def __init__(self):
        super().__init__()
        self.weights = {}

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        self.weights.setdefault(step, reference.flat(reference.weights(self.model)))


def _zero_gradient_run(noise, jit_compile="auto"):
    """(u (P x T), the model, its report) of a seeded run: u_t = -(B / (sigma C)) update_t."""
    model = tf_megadp.make_private(_wide_model())
    sampler = _sampler(noise)
    optimizer = tf_megadp.DPOptimizer(
        keras.optimizers.SGD(1.0), l2_norm_clip=CLIP, noise_multiplier=SIGMA,
        schedule=sampler.schedule, noise=noise, seed=SEED)
    model.compile(optimizer=optimizer, loss=reference.zero_loss, jit_compile=jit_compile)
    updates = _Updates()
    updates.weights[0] = reference.flat(reference.weights(model))
    # batch_size=BATCH: each step's expected batch is B, also for a cyclic
    # step (one group of N / L at q = B L / N). A budget it never reaches:
    # the next step's entry continues the segment with the noise recorded.
    privacy = tf_megadp.PrivacyCallback(delta=1e-3, batch_size=BATCH, target_epsilon=1e9)
    model.fit(sampler.as_dataset(), verbose=0, callbacks=[updates, privacy])
    weights = np.stack([updates.weights[t] for t in range(STEPS + 1)])
    return -(BATCH / (SIGMA * CLIP)) * np.diff(weights, axis=0).T, model, privacy.report()


LAM = 0.6


@pytest.fixture(scope="module", params=[BandMF(num_bands=4), BLT(num_buffers=2), LambdaCGD(LAM)],
                ids=["bandmf", "blt", "lambda_cgd"])
def run(request):
    with pytest.warns(UserWarning, match="seed"):
        streamed, model, report = _zero_gradient_run(request.param)
    return request.param, streamed, model, report


def _strategy_matrix(column):
    return linalg.toeplitz(column, np.zeros_like(column))


def test_the_noise_covariance_is_sigma_c_over_b_squared_times_c_inverse_c_inverse_transposed(run):
    _, streamed, model, _ = run
    column = model.optimizer.noise_strategy.column(STEPS)
    inverse = np.linalg.inv(_strategy_matrix(column))
    assert streamed.shape == (100_250, STEPS)
    # In units of (sigma C / B): the updates' covariance is C^{-1} C^{-T}.
    reference.assert_covariance_is(streamed, inverse @ inverse.T)


def test_the_covariance_test_fails_for_a_wrong_coefficient(run):
    _, streamed, model, _ = run
    column = model.optimizer.noise_strategy.column(STEPS).copy()
    column[1] *= 1.1  # One planted coefficient, 10 % off.
    inverse = np.linalg.inv(_strategy_matrix(column))
    with pytest.raises(AssertionError, match="standard errors from I"):
        reference.assert_covariance_is(streamed, inverse @ inverse.T)


def test_the_noise_is_the_reference_stream_of_the_draws(run):
    noise, streamed, model, _ = run
    strategy = model.optimizer.noise_strategy
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    draws = np.stack([reference.flat(reference.noise_draws(SEED, t, shapes))
                      for t in range(STEPS)])
    if isinstance(noise, BandMF):
        expected = mf.banded_inverse_stream(strategy.coefficients, draws)
    elif isinstance(noise, LambdaCGD):
        # (z_t - lam z_(t-1)) / sqrt(1 - lam^2): z_(t-1) is the same draw, drawn again.
        previous = np.concatenate([np.zeros_like(draws[:1]), draws[:-1]])
        expected = (draws - LAM * previous) / math.sqrt(1 - LAM ** 2)
    else:
        expected = mf.blt_inverse_stream(strategy.buffer_decays, strategy.output_scales,
                                         draws) / strategy.unit_scale
    np.testing.assert_allclose(streamed, expected.T, rtol=1e-3, atol=1e-3)


def test_the_ledger_records_one_segment_with_the_mechanism(run):
    noise, _, model, _ = run
    [entry] = tf_megadp.model_ledger(model).entries
    strategy = model.optimizer.noise_strategy
    # The mechanism's record: its kind, its parameters and the hash of the strategy streamed.
    assert (entry.steps, entry.noise, entry.mechanism, entry.segment_start) == (
        STEPS, strategy.record(), noise, True)
    assert strategy.strategy_hash in entry.noise
    if isinstance(noise, BandMF):
        assert (entry.sampling, entry.cycle_length, entry.sampling_rate) == (
            "cyclic_poisson", 4, BATCH * 4 / N)
    else:
        s = N // BATCH
        assert (entry.sampling, entry.steps_per_epoch, entry.participations) == (
            "fixed_order", s, 1)
        assert entry.sensitivity == strategy.sensitivity(STEPS, steps_per_epoch=s).value


def test_the_report_names_the_segment_and_the_strategy_never_the_buffers(run):
    noise, _, model, report = run
    strategy = model.optimizer.noise_strategy
    kind = "cyclic_poisson" if isinstance(noise, BandMF) else "fixed_order"
    assert report["sampling"]["accounted_as"] == f"noise segments (1): {kind}"
    assert report["settings"]["noise_strategy"] == strategy.describe()
    assert report["settings"]["noise_strategy"]["strategy_hash"] == strategy.strategy_hash


def test_compiled_whole_with_xla_the_stream_draws_the_same_z_again():
    """A step compiled whole (every TPU step) draws the z that the same step draws uncompiled.

    TensorFlow's own stateless normal gives other values under XLA: a
    lambda-CGD run resumed in the other mode would subtract lam z_(t-1)
    of a z_(t-1) that was never added.
    """
    with pytest.warns(UserWarning, match="seed"):
        streamed, model, _ = _zero_gradient_run(LambdaCGD(LAM), jit_compile=True)
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    draws = np.stack([reference.flat(reference.noise_draws(SEED, t, shapes))
                      for t in range(STEPS)])
    previous = np.concatenate([np.zeros_like(draws[:1]), draws[:-1]])
    expected = (draws - LAM * previous) / math.sqrt(1 - LAM ** 2)
    np.testing.assert_allclose(streamed, expected.T, rtol=1e-3, atol=1e-3)


class TestTheStandardNormal:
    def test_it_is_the_same_in_and_out_of_xla(self):
        import tensorflow as tf

        key = tf.constant([5, 9], tf.int64)
        draw = lambda k: gaussian.standard_normal([400, 250], k, tf.float32)  # noqa: E731
        eager = tf.function(draw)(key).numpy()
        compiled = tf.function(draw, jit_compile=True)(key).numpy()
        np.testing.assert_allclose(compiled, eager, rtol=0, atol=1e-5)
        np.testing.assert_allclose(eager, reference.box_muller(key, [400, 250]), atol=1e-5)

    def test_its_standard_deviation_is_one_and_another_key_draws_anew(self):
        import tensorflow as tf

        first = gaussian.standard_normal([100_000], tf.constant([1, 2], tf.int64), tf.float32)
        second = gaussian.standard_normal([100_000], tf.constant([1, 3], tf.int64), tf.float32)
        reference.assert_std_is(first.numpy(), 1.0)
        reference.assert_std_is(second.numpy() - first.numpy(), math.sqrt(2))
        assert abs(float(np.mean(first.numpy()))) < 6 / math.sqrt(100_000)

    def test_both_outputs_of_each_pair_are_independent_normals_of_any_shape(self):
        """Cosine and sine of one Box-Muller pair: elements i and i + n/2 (n odd included)."""
        import tensorflow as tf
        from scipy import stats

        draws = gaussian.standard_normal([3, 66_667], tf.constant([4, 4], tf.int64),
                                         tf.float32).numpy().ravel()
        assert draws.size == 200_001
        pairs = draws.size // 2
        cosines, sines = draws[:pairs], draws[pairs + 1:]
        assert abs(float(np.corrcoef(cosines, sines)[0, 1])) < 6 / math.sqrt(pairs)
        assert abs(float(np.corrcoef(cosines ** 2, sines ** 2)[0, 1])) < 6 / math.sqrt(pairs)
        for half in (cosines, sines):
            assert stats.kstest(half, "norm").pvalue > 1e-6


def test_lambda_cgd_noise_has_lag_one_correlation_minus_lam_over_one_plus_lam_squared(run):
    """Kalinin et al.'s noise z_t - lam z_(t-1): corr(n_t, n_(t-1)) = -lam / (1 + lam^2), none beyond."""
    noise, streamed, _, _ = run
    if not isinstance(noise, LambdaCGD):
        pytest.skip("lambda-CGD's own correlation")
    correlation = np.corrcoef(streamed.T)
    lag1 = np.array([correlation[t, t - 1] for t in range(2, STEPS)])
    lag2 = np.array([correlation[t, t - 2] for t in range(2, STEPS)])
    # 100,250 draws per pair: a standard error of about 1 / sqrt(P) = 0.003.
    np.testing.assert_allclose(lag1, -LAM / (1 + LAM ** 2), atol=0.02)
    np.testing.assert_allclose(lag2, 0.0, atol=0.02)
    # Step 0 opens the segment: z_0 alone, variance 1 / (1 - lam^2); later
    # steps (1 + lam^2) / (1 - lam^2).
    variance = streamed.var(axis=0)
    assert variance[0] == pytest.approx(1 / (1 - LAM ** 2), rel=0.02)
    np.testing.assert_allclose(variance[1:], (1 + LAM ** 2) / (1 - LAM ** 2), rtol=0.02)


def test_the_buffers_hold_the_last_outputs_and_nothing_is_saved_of_them(run):
    noise, streamed, model, _ = run
    buffers = model.optimizer.noise_stage.state.noise_buffers
    assert len(buffers) == 2 and all(len(slots) == noise.noise_buffers for slots in buffers)
    names = {v.name for v in model.optimizer.variables}
    assert not any("noise_buffer" in name for name in names)
    if isinstance(noise, BandMF):
        # b - 1 = 3 slots; step t wrote slot t mod 3: the last three outputs.
        kernel = [buffers[0][(STEPS - j) % 3].numpy().ravel() for j in (1, 2, 3)]
        for j, values in enumerate(kernel, start=1):
            np.testing.assert_allclose(values, streamed[:100_000, STEPS - j], rtol=1e-3,
                                       atol=1e-3)


def test_a_resumed_run_opens_a_new_segment_and_reuses_no_noise(tmp_path):
    """Roll back and compare: a step trained again after an in-process crash.

    fit with BackupAndRestore (a backup every logical step) raises after
    step 5, before its backup, and is called again: it resumes from the backup of step 4 and
    trains steps 4 and 5 again. Without a new segment, step 4's noise would
    subtract the abandoned branch's buffers (x_3, x_2, x_1 of the first run:
    step 4 continued it), and the replayed steps would be correlated with
    noise that branch released. With it, step 4 is the first step of a new
    segment: x'_4 = z'_4 / c_0 with z' drawn in generation 1, and x'_5 =
    (z'_5 - c_1 x'_4) / c_0; the ledger composes both segments.
    """
    noise = BandMF(num_bands=4)
    width = reference.ROLLBACK_INPUTS
    sampler = _sampler(noise, steps=6, width=width)
    model = tf_megadp.make_private(reference.rollback_model())
    with pytest.warns(UserWarning, match="seed"):
        model.compile(optimizer=tf_megadp.DPOptimizer(
            keras.optimizers.SGD(1.0), l2_norm_clip=CLIP, noise_multiplier=SIGMA,
            schedule=sampler.schedule, noise=noise, seed=SEED), loss=reference.zero_loss)
    updates = _Updates()

    class CrashAfterStep5(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 5:
                raise preempted_run.Crash("preempted after logical step 5")

    backup = str(tmp_path / "backup")
    with pytest.raises(preempted_run.Crash):
        model.fit(sampler.as_dataset(), verbose=0, callbacks=[
            updates, CrashAfterStep5(), keras.callbacks.BackupAndRestore(backup, save_freq=1)])
    first = dict(updates.weights)
    assert sorted(first) == [1, 2, 3, 4, 5]
    replayed = _Updates()
    model.fit(sampler.as_dataset(), verbose=0, callbacks=[
        replayed, keras.callbacks.BackupAndRestore(backup, save_freq=1)])
    assert sorted(replayed.weights) == [5, 6]
    c = model.optimizer.noise_strategy.coefficients
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    z4, z5 = (reference.flat(reference.noise_draws(SEED, t, shapes, generation=1)) for t in (4, 5))
    x4 = -(BATCH / (SIGMA * CLIP)) * (replayed.weights[5] - first[4])
    x5 = -(BATCH / (SIGMA * CLIP)) * (replayed.weights[6] - replayed.weights[5])
    np.testing.assert_allclose(x4, z4 / c[0], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(x5, (z5 - c[1] * x4) / c[0], rtol=1e-3, atol=1e-3)
    ledger = tf_megadp.model_ledger(model)
    assert [(e.steps, e.segment_start, e.cycle_position) for e in ledger] == [
        (4, True, 0), (2, True, 0)]


def test_a_resumed_lambda_cgd_run_draws_no_noise_of_the_abandoned_branch(tmp_path):
    """lambda-CGD keeps no buffer: it draws z_(t-1) again. After a rollback it must not.

    As above, step 5's crash rolls the run back to step 4. The replayed
    step 4 opens a new segment in generation 1: x'_4 = z'_4 / sqrt(1 - lam^2),
    with no z_3 (drawn in generation 0, released by the abandoned branch),
    and x'_5 = (z'_5 - lam z'_4) / sqrt(1 - lam^2).
    """
    noise = LambdaCGD(LAM)
    sampler = _sampler(noise, steps=6, width=reference.ROLLBACK_INPUTS)
    model = tf_megadp.make_private(reference.rollback_model())
    with pytest.warns(UserWarning, match="seed"):
        model.compile(optimizer=tf_megadp.DPOptimizer(
            keras.optimizers.SGD(1.0), l2_norm_clip=CLIP, noise_multiplier=SIGMA,
            schedule=sampler.schedule, noise=noise, seed=SEED), loss=reference.zero_loss)
    updates = _Updates()

    class CrashAfterStep5(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 5:
                raise preempted_run.Crash("preempted after logical step 5")

    backup = str(tmp_path / "backup")
    with pytest.raises(preempted_run.Crash):
        model.fit(sampler.as_dataset(), verbose=0, callbacks=[
            updates, CrashAfterStep5(), keras.callbacks.BackupAndRestore(backup, save_freq=1)])
    first = dict(updates.weights)
    replayed = _Updates()
    model.fit(sampler.as_dataset(), verbose=0, callbacks=[
        replayed, keras.callbacks.BackupAndRestore(backup, save_freq=1)])
    assert sorted(replayed.weights) == [5, 6]
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    z4, z5 = (reference.flat(reference.noise_draws(SEED, t, shapes, generation=1)) for t in (4, 5))
    scale = math.sqrt(1 - LAM ** 2)
    x4 = -(BATCH / (SIGMA * CLIP)) * (replayed.weights[5] - first[4])
    x5 = -(BATCH / (SIGMA * CLIP)) * (replayed.weights[6] - replayed.weights[5])
    np.testing.assert_allclose(x4, z4 / scale, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(x5, (z5 - LAM * z4) / scale, rtol=1e-3, atol=1e-3)
    # Control: the abandoned branch's z_3 (generation 0) is not in the replayed step 4.
    z3 = reference.flat(reference.noise_draws(SEED, 3, shapes, generation=0))
    assert not np.allclose(x4, (z4 - LAM * z3) / scale, atol=1e-2)
    assert [(e.steps, e.segment_start) for e in tf_megadp.model_ledger(model)] == [
        (4, True), (2, True)]



@pytest.mark.slow
def test_the_example_trains_dp_sgd_bandmf_and_blt_at_one_epsilon(capsys):
    """examples/correlated_noise.py at test size: one epoch of B = 64 each (RDP).

    Slow (three models traced and fitted, 35 s at load 7 on two cores):
    `pytest -m slow -k example tests/test_noise_buffers.py`.
    """
    import runpy

    example = runpy.run_path("examples/correlated_noise.py")
    results = example["main"](["--epochs", "1", "--accountant", "rdp"])
    assert [(r["sampling"], r["noise_buffers"]) for r in results] == [
        ("poisson", 0), ("cyclic_poisson", 3), ("fixed_order", 2)]
    for result in results:
        assert 0.99 * 4.0 <= result["epsilon"] <= 4.0
    # Cycles of 4 cost amplification: BandMF needs a larger sigma than DP-SGD.
    assert results[1]["noise_multiplier"] > results[0]["noise_multiplier"]
    assert "BandMF b=4" in capsys.readouterr().out
