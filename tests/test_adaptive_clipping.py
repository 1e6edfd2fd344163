"""Specification of adaptive clipping (Andrew et al., NeurIPS 2021) in `DPOptimizer`.

Every number is checked against `andrew_reference`, an independent numpy
implementation of the paper's rule written from the paper (one example at a
time), against per-example gradients from `tests.reference` (one tape per
example), and against direct dp_accounting calls.
"""

import json
import math

import dp_accounting
import keras
import numpy as np
import pytest
from dp_accounting import pld, rdp
from scipy import stats

import tf_megadp
from tf_megadp import AdaptiveClipping, LedgerEntry, PrivacyAccountant, PrivacyConfigurationError
from tf_megadp import adaptive_clipping, cli, clipping
from tf_megadp.accounting import mechanisms
from tests import reference

STRATEGIES = sorted(clipping._STRATEGIES)  # every registered strategy


# -- The independent reference ----------------------------------------------------


def andrew_reference_step(clip, norms, real, *, target_quantile, learning_rate, batch_size,
                          count_noise=0.0):
    """One round of Andrew et al.'s rule, as the paper writes it.

    b_i = 1 if example i's norm is at most C (real examples only); the released
    estimate is ((sum_i (b_i - 1/2)) + noise) / B + 1/2 (the centred form the
    paper uses for sensitivity 1/2); C <- C exp(-eta (estimate - gamma)).

    Returns:
        (next C, the exact number of unclipped real examples, the estimate).
    """
    unclipped = 0
    centred = 0.0
    for norm, is_real in zip(norms, real):
        if not is_real:
            continue
        b = 1.0 if norm <= clip else 0.0
        unclipped += int(b)
        centred += b - 0.5
    estimate = (centred + count_noise) / batch_size + 0.5
    return clip * math.exp(-learning_rate * (estimate - target_quantile)), unclipped, estimate


def andrew_noise_multipliers(sigma, count_stddev):
    """The paper's z_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2 and the count's 2 sigma_b."""
    return (sigma ** -2 - (2 * count_stddev) ** -2) ** -0.5, 2 * count_stddev


def example_norms(model, loss, x, y, sample_weight):
    grads = reference.naive_per_example_gradients(model, loss, x, y, sample_weight)
    return np.array([math.sqrt(sum(float(np.sum(g ** 2)) for g in example)) for example in grads])


class Recorder(keras.callbacks.Callback):
    """C (from the logs) and the weights after every micro-batch."""

    def on_train_begin(self, logs=None):
        self.clip_norms, self.weights = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.clip_norms.append(float(logs["clip_norm"]))
        self.weights.append(reference.weights(self.model))


def small_model(seed=0, inputs=3, outputs=2):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(outputs)])


def compiled(model, loss="mse", **settings):
    tf_megadp.make_private(model)
    inner = settings.pop("inner", None) or keras.optimizers.SGD(0.5)
    optimizer = tf_megadp.DPOptimizer(inner, **settings)
    model.compile(optimizer=optimizer, loss=loss)
    return optimizer


def zero_loss(y_true, y_pred):
    """A loss whose every per-example gradient is exactly 0 (norm 0: never clipped)."""
    return 0.0 * keras.ops.mean(y_pred, axis=-1)


# -- C's update against the reference, under every strategy ---------------------------

MICRO, STEPS_K, B, C0 = 4, 2, 8.0, 0.9
GAMMA, ETA = 0.5, 0.7


def drifting_data(steps=3, seed=1):
    rng = np.random.default_rng(seed)
    n = steps * STEPS_K * MICRO
    x = rng.normal(size=(n, 3)).astype("float32")
    y = rng.normal(size=(n, 2)).astype("float32") * np.linspace(0.3, 3.0, n)[:, None]
    weight = np.ones(n, "float32")
    weight[[1, 6, 7, 13]] = 0.0  # padding rows, in several positions
    weight[16:20] = 0.0  # a micro-batch of padding only
    return x, y.astype("float32"), weight


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_clip_norm_and_clipped_updates_follow_the_reference(strategy):
    """sigma = 0 and an exact count: C_t and every update equal the rule on the real norms."""
    x, y, weight = drifting_data()
    model = small_model()
    reference_model = small_model()
    optimizer = compiled(
        model, l2_norm_clip=C0, noise_multiplier=0.0, accumulation_steps=STEPS_K,
        normalize_by=B, clipping=strategy, seed=0,
        adaptive_clipping=AdaptiveClipping(GAMMA, ETA, count_stddev=0.0))
    recorder = Recorder()
    model.fit(x, y, sample_weight=weight, batch_size=MICRO, shuffle=False, verbose=0,
              callbacks=[recorder])

    loss = keras.losses.MeanSquaredError()
    clip, rows = C0, STEPS_K * MICRO
    moved = 0
    for step in range(len(x) // rows):
        part = slice(step * rows, (step + 1) * rows)
        norms = example_norms(reference_model, loss, x[part], y[part], weight[part])
        update = reference.naive_clipped_update(
            reference_model, loss, x[part], y[part], clip, B, sample_weight=weight[part])
        for variable, delta in zip(reference_model.trainable_variables, update):
            variable.assign(variable.numpy() + 0.5 * delta)
        new_clip, unclipped, _ = andrew_reference_step(
            clip, norms, weight[part] > 0, target_quantile=GAMMA, learning_rate=ETA,
            batch_size=B)
        moved += 0 < unclipped < np.sum(weight[part] > 0)
        clip = new_clip
        last = (step + 1) * STEPS_K - 1
        assert recorder.clip_norms[last] == pytest.approx(clip, rel=1e-6)
        for got, want in zip(recorder.weights[last], reference.weights(reference_model)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert moved >= 2, "the data must have norms on both sides of C"
    assert float(optimizer.clip_norm.numpy()) == pytest.approx(clip, rel=1e-12)
    # A micro-batch inside a logical step leaves C where it was.
    assert recorder.clip_norms[0] == pytest.approx(C0)


# -- The noise multipliers, the ledger, the logs and the report -----------------------


@pytest.fixture(scope="module")
def private_run():
    """sigma = 0.8 with the default count noise B / 20, two logical steps."""
    x, y, _ = drifting_data(steps=2)
    model = small_model()
    optimizer = compiled(
        model, l2_norm_clip=0.5, noise_multiplier=0.8, accumulation_steps=2, normalize_by=16.0,
        clipping="vectorized", seed=3, adaptive_clipping=AdaptiveClipping())
    privacy = tf_megadp.PrivacyCallback(delta=1e-3)
    history = model.fit(x, y, batch_size=4, shuffle=False, verbose=0, epochs=1,
                        callbacks=[privacy])
    return model, optimizer, privacy, history


def test_the_ledger_records_both_noise_multipliers_of_the_reference(private_run):
    model, _, _, _ = private_run
    (entry,) = tf_megadp.model_ledger(model).entries
    gradient, count = andrew_noise_multipliers(0.8, 16.0 / 20)
    assert entry.steps == 2
    assert entry.noise_multiplier == pytest.approx(gradient, rel=1e-6)
    assert entry.count_noise_multiplier == pytest.approx(count, rel=1e-6)
    assert entry.equivalent_noise_multiplier == pytest.approx(0.8, rel=1e-6)


def test_clip_norm_is_in_the_logs_and_its_trajectory_in_the_report(private_run):
    _, optimizer, privacy, history = private_run
    assert history.history["clip_norm"][-1] == pytest.approx(
        float(optimizer.clip_norm.numpy()), rel=1e-6)
    section = privacy.report()["settings"]["adaptive_clipping"]
    assert section["target_quantile"] == 0.5 and section["learning_rate"] == 0.2
    assert section["initial_clip_norm"] == 0.5
    assert [step for step, _ in section["trajectory"]] == [1, 2]
    assert section["trajectory"][-1][1] == section["clip_norm"] == pytest.approx(
        float(optimizer.clip_norm.numpy()))
    assert section["trajectory"][0][1] != 0.5  # C moved after the first step


def test_the_reported_epsilon_is_the_one_of_sigma(private_run):
    _, _, privacy, _ = private_run
    entry = privacy.report()["ledger"][0]
    plain = PrivacyAccountant(privacy.report()["num_examples"], 1e-3, ledger=tf_megadp.PrivacyLedger(
        [LedgerEntry(2, entry["sampling_rate"], 0.8, 0, entry["sampling"])]))
    assert privacy.epsilon == pytest.approx(plain.epsilon(), rel=1e-6)


@pytest.mark.parametrize("sigma, stddev", [(1.1, 3.0), (0.6, 0.31), (2.0, 40.0)])
def test_noise_multipliers_equal_the_papers_formula(sigma, stddev):
    assert mechanisms.gradient_noise_multiplier(sigma, stddev) == pytest.approx(
        andrew_noise_multipliers(sigma, stddev), rel=1e-12)


# -- Epsilon against dp_accounting -------------------------------------------------------


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_epsilon_of_the_pair_equals_dp_accountings_for_sigma(accountant):
    n, q, steps, sigma, delta = 50_000, 0.01, 400, 1.1, 1e-6
    gradient, count = mechanisms.gradient_noise_multiplier(sigma, 3.0)
    ours = PrivacyAccountant(n, delta, accountant=accountant, ledger=tf_megadp.PrivacyLedger(
        [LedgerEntry(steps, q, gradient, count_noise_multiplier=count)])).epsilon()
    equivalent = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    if accountant == "pld":
        direct = pld.PLDAccountant(value_discretization_interval=1e-4).compose(equivalent)
        assert ours == pytest.approx(direct.get_epsilon(delta), rel=1e-6)
    else:
        assert ours == pytest.approx(rdp.RdpAccountant().compose(equivalent).get_epsilon(delta),
                                     rel=1e-9)
        # dp_accounting's RDP composes the two Gaussians of the step itself.
        pair = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(gradient),
                                              dp_accounting.GaussianDpEvent(count)])), steps)
        assert ours == pytest.approx(rdp.RdpAccountant().compose(pair).get_epsilon(delta),
                                     rel=1e-9)
    # Accounting the gradient alone would under-report.
    alone = PrivacyAccountant(n, delta, accountant=accountant, ledger=tf_megadp.PrivacyLedger(
        [LedgerEntry(steps, q, gradient)])).epsilon()
    assert alone < ours * (1 - 1e-3)


def test_truncated_steps_are_accounted_at_the_equivalent_sigma():
    n, q, sigma, delta = 100_000, 0.002, 0.9, 1e-6
    gradient, count = mechanisms.gradient_noise_multiplier(sigma, 2.5)
    entry = LedgerEntry(300, q, gradient, max_batch_size=400, count_noise_multiplier=count)
    plain = LedgerEntry(300, q, sigma, max_batch_size=400)
    epsilon = lambda e: PrivacyAccountant(n, delta, ledger=tf_megadp.PrivacyLedger([e])).epsilon()
    assert epsilon(entry) == pytest.approx(epsilon(plain), rel=1e-6)


# -- The count's noise -------------------------------------------------------------------


def test_the_count_noise_has_the_stated_std():
    """20,000 keys: the released count minus the exact one is N(0, s^2)."""
    import tensorflow as tf

    stddev, keys = 2.5, tf.random.stateless_uniform(
        [20_000, 2], seed=[1, 2], minval=0, maxval=2 ** 31 - 1, dtype=tf.int64)
    draws = tf.vectorized_map(
        lambda key: adaptive_clipping.noisy_count(tf.constant(-3.5, tf.float64), stddev, key, 1),
        keys).numpy() + 3.5
    for expected, holds in ((stddev, True), (1.05 * stddev, False)):
        p = stats.chi2.cdf(np.sum((draws / expected) ** 2), df=draws.size)
        assert (1e-6 < p < 1 - 1e-6) == holds


def test_the_optimizer_noises_the_count_once_per_step_with_count_stddev():
    """Recovers each step's count noise from C's trajectory (all norms 0, so all unclipped)."""
    steps, micro, stddev, eta = 400, 2, 3.0, 0.01
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * micro, 2)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    optimizer = compiled(
        model, loss=zero_loss, inner=keras.optimizers.SGD(1.0), l2_norm_clip=1.0,
        noise_multiplier=1.0,
        normalize_by=float(micro), seed=5,
        adaptive_clipping=AdaptiveClipping(0.5, eta, count_stddev=stddev))
    recorder = Recorder()
    before = reference.weights(model)
    model.fit(x, np.zeros((len(x), 1), "float32"), batch_size=micro, shuffle=False, verbose=0,
              callbacks=[recorder])
    clips = np.array([1.0] + [c for _, c in optimizer.clip_norm_trajectory])
    assert len(clips) == steps + 1
    estimate = 0.5 - np.log(clips[1:] / clips[:-1]) / eta  # the released b_t
    noise = (estimate - 0.5) * micro - micro / 2  # minus the exact centred count, +m/2
    p = stats.chi2.cdf(np.sum((noise / stddev) ** 2), df=noise.size)
    assert 1e-4 < p < 1 - 1e-4, noise.std()
    assert abs(noise.mean()) < 5 * stddev / math.sqrt(steps)
    # The count's noise is a draw of its own: independent of every coordinate's
    # gradient noise (the updates, since every gradient is 0).
    weights = [np.concatenate([w.ravel() for w in step]) for step in [before] + recorder.weights]
    updates = np.diff(np.array(weights), axis=0)
    correlations = [np.corrcoef(noise, updates[:, i])[0, 1] for i in range(updates.shape[1])]
    assert max(abs(c) for c in correlations) < 5 / math.sqrt(steps)


# -- The gradient's noise uses sigma_grad and this step's C ------------------------------


def test_the_gradient_noise_std_is_sigma_grad_times_the_steps_clip_norm():
    """Zero gradients: each update is noise * lr / B, of std sigma_grad * C_t / B."""
    sigma, stddev, divisor, clip = 2.0, 1.25, 10.0, 0.5
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((400,)), keras.layers.Dense(250)])
    compiled(
        model, loss=zero_loss, inner=keras.optimizers.SGD(1.0), l2_norm_clip=clip,
        noise_multiplier=sigma, normalize_by=divisor, seed=12,
        adaptive_clipping=AdaptiveClipping(0.5, 5.0, count_stddev=stddev))
    x = np.random.default_rng(0).normal(size=(4, 400)).astype("float32")
    recorder = Recorder()
    before = reference.weights(model)
    model.fit(x, np.zeros((4, 250), "float32"), batch_size=2, shuffle=False, verbose=0,
              callbacks=[recorder])
    gradient_sigma, _ = andrew_noise_multipliers(sigma, stddev)
    clip_after_first = recorder.clip_norms[0]
    assert abs(math.log(clip_after_first / clip)) > 0.1  # the two steps' C differ
    steps = [before, recorder.weights[0], recorder.weights[1]]
    for t, expected_clip in enumerate([clip, clip_after_first]):
        update = np.concatenate([(a - b).ravel() for a, b in zip(steps[t + 1], steps[t])])
        expected = gradient_sigma * expected_clip / divisor
        other_clip = clip_after_first if t == 0 else clip
        for std, holds in ((expected, True), (1.03 * expected, False),
                           (sigma * expected_clip / divisor, False),
                           (gradient_sigma * other_clip / divisor, False)):
            p = stats.chi2.cdf(np.sum((update / std) ** 2), df=update.size)
            assert (1e-6 < p < 1 - 1e-6) == holds, (t, std, update.std())


# -- Convergence ---------------------------------------------------------------------


@pytest.mark.parametrize("target", [0.5, 0.8])
def test_clip_norm_converges_to_the_target_quantile_of_drifting_norms(target):
    """Norms 2|y| (zero weights, x = 1) grow 5x in 100 steps, then hold; C follows."""
    steps, drifting, batch, start = 160, 100, 64, 0.05
    rng = np.random.default_rng(2)
    drift = np.exp(np.minimum(np.arange(steps), drifting) * math.log(5.0) / drifting)
    y = (rng.lognormal(0.0, 0.5, size=(steps, batch)) * drift[:, None]).reshape(-1, 1)
    x = np.ones((steps * batch, 1), "float32")
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(
        1, use_bias=False, kernel_initializer="zeros")])
    optimizer = compiled(
        model, inner=keras.optimizers.SGD(0.0), l2_norm_clip=start, noise_multiplier=1.0,
        normalize_by=float(batch), seed=4, adaptive_clipping=AdaptiveClipping(target, 0.2))
    model.fit(x, y.astype("float32"), batch_size=batch, shuffle=False, verbose=0)
    clips = np.array([start] + [c for _, c in optimizer.clip_norm_trajectory])
    norms = 2 * np.abs(y.reshape(steps, batch))
    unclipped = np.mean(norms <= clips[:-1, None], axis=1)
    assert unclipped[0] == 0.0  # it started far below every norm
    # While the norms drift, C tracks them (it lags by a few per cent of quantile).
    quantile = lambda t: np.quantile(norms[t - 10:t], target)  # noqa: E731
    assert 0.5 < clips[drifting] / quantile(drifting) < 1.5
    # Once they hold, the fraction of unclipped examples settles at the target.
    assert abs(np.mean(unclipped[-40:]) - target) < 0.05
    assert clips[-1] == pytest.approx(quantile(steps), rel=0.25)


# -- Sensitivity: the attack ---------------------------------------------------------


@pytest.mark.parametrize("strategy", ["vectorized", "ghost"])
def test_one_example_moves_the_count_by_one_and_the_sum_by_at_most_the_steps_clip(strategy):
    """D and D' differ in one example (anywhere in the micro-batch, any norm)."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(6, 3)).astype("float32")
    y = rng.normal(size=(6, 2)).astype("float32")
    model = small_model()
    optimizer = compiled(
        model, l2_norm_clip=1.0, noise_multiplier=1.0, accumulation_steps=2, normalize_by=400.0,
        clipping=strategy, adaptive_clipping=AdaptiveClipping())
    optimizer.build(model.trainable_variables)
    clip = 0.37  # C_t of some later step
    optimizer.clip_norm.assign(clip)

    def unnoised(weight):
        model.train_on_batch(x, y, sample_weight=weight)
        state = optimizer.accumulation_stage.state
        count = float(state.centred_count.value.numpy())
        total = np.concatenate([a.value.numpy().ravel() for a in state.accumulators])
        assert optimizer.discard_partial_step() == 1
        return count, total

    moves = set()
    for position in (0, 3, 5):
        original = y[position].copy()
        # The added example is unclipped (its label is the model's prediction:
        # gradient 0) or clipped (a label far away).
        for label in (model(x[position:position + 1]).numpy()[0], np.full(2, 1e3)):
            y[position] = label
            absent = np.ones(6, "float32")
            absent[position] = 0.0
            count_without, sum_without = unnoised(absent)
            count_with, sum_with = unnoised(np.ones(6, "float32"))
            moves.add(count_with - count_without)
            assert abs(count_with - count_without) == 0.5  # the centred count
            unclipped = lambda centred, real: centred + real / 2  # noqa: E731
            assert 0 <= unclipped(count_with, 6) - unclipped(count_without, 5) <= 1
            assert np.linalg.norm(sum_with - sum_without) <= clip * (1 + 1e-5)
        y[position] = original
    assert moves == {0.5, -0.5}
    assert float(optimizer.clip_norm.numpy()) == clip  # no step was applied


# -- A run lives across processes ----------------------------------------------------


def test_clip_norm_is_saved_restored_and_continues_after_resume(tmp_path):
    x, y, weight = drifting_data(steps=4)
    settings = dict(l2_norm_clip=C0, noise_multiplier=0.0, accumulation_steps=STEPS_K,
                    normalize_by=B, clipping="vectorized", seed=0,
                    adaptive_clipping=AdaptiveClipping(GAMMA, ETA, count_stddev=0.0))
    whole = small_model()
    compiled(whole, **settings)
    whole.fit(x, y, sample_weight=weight, batch_size=MICRO, shuffle=False, verbose=0)

    first = small_model()
    compiled(first, **settings)
    half = len(x) // 2
    first.fit(x[:half], y[:half], sample_weight=weight[:half], batch_size=MICRO, shuffle=False,
              verbose=0)
    first.save(tmp_path / "run.keras")
    resumed = tf_megadp.make_private(keras.models.load_model(tmp_path / "run.keras"))
    assert resumed.optimizer.adaptive_clipping == settings["adaptive_clipping"]
    assert float(resumed.optimizer.clip_norm.numpy()) == float(first.optimizer.clip_norm.numpy())
    assert float(first.optimizer.clip_norm.numpy()) != C0
    resumed.fit(x[half:], y[half:], sample_weight=weight[half:], batch_size=MICRO,
                shuffle=False, verbose=0)
    assert float(resumed.optimizer.clip_norm.numpy()) == pytest.approx(
        float(whole.optimizer.clip_norm.numpy()), rel=1e-9)
    for a, b in zip(reference.weights(resumed), reference.weights(whole)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

    # save_training_state / restore_training_state carry C too.
    tf_megadp.save_training_state(first, str(tmp_path / "state"))
    restored = tf_megadp.make_private(small_model())
    tf_megadp.restore_training_state(restored, str(tmp_path / "state"), {"loss": "mse"})
    assert float(restored.optimizer.clip_norm.numpy()) == float(first.optimizer.clip_norm.numpy())


def test_a_checkpoint_without_adaptive_clipping_does_not_load_into_one(tmp_path):
    plain = small_model()
    compiled(plain, l2_norm_clip=1.0, noise_multiplier=1.0)
    plain.optimizer.build(plain.trainable_variables)
    plain.save_weights(tmp_path / "plain.weights.h5")
    adaptive = small_model()
    compiled(adaptive, l2_norm_clip=1.0, noise_multiplier=1.0, normalize_by=64.0,
             adaptive_clipping=AdaptiveClipping())
    with pytest.raises(PrivacyConfigurationError, match="same settings"):
        adaptive.load_weights(tmp_path / "plain.weights.h5")


def test_the_config_round_trips():
    optimizer = tf_megadp.DPOptimizer(
        keras.optimizers.SGD(0.1), 1.0, 1.0, normalize_by=100.0,
        adaptive_clipping=AdaptiveClipping(0.7, 0.1, count_stddev=4.0))
    again = tf_megadp.DPOptimizer.from_config(optimizer.get_config())
    assert again.adaptive_clipping == AdaptiveClipping(0.7, 0.1, 4.0)
    with pytest.raises(PrivacyConfigurationError, match="cannot change"):
        optimizer.adaptive_clipping = None


# -- C stays in its range, and a diverging run stops ----------------------------------


def diverging_run(**adaptive):
    """eta = 5000: one step's count moves C by a factor exp(2500) (inf) or exp(-2500) (0).

    Two logical steps of 8 rows; targets 30 times the inputs' scale give
    every example a norm above C = 1 (C grows; then, at C_max, below it).
    Returns (model, C after each step, privacy callback,
    the error that stopped fit or None).
    """
    model = small_model()
    compiled(model, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0,
             adaptive_clipping=AdaptiveClipping(learning_rate=5000.0, count_stddev=0.6,
                                                **adaptive))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = (30.0 * rng.normal(size=(16, 2))).astype("float32")
    privacy = tf_megadp.PrivacyCallback(delta=1e-3, accountant="rdp")
    clips = []
    trace = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: clips.append(float(logs["clip_norm"])))
    try:
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[privacy, trace])
    except PrivacyConfigurationError as error:
        return model, clips, privacy, error
    return model, clips, privacy, None


def test_a_clip_norm_that_runs_to_inf_or_0_is_held_at_its_bounds_with_one_warning():
    # Before (issue 37), on 3 such steps: C = nan after the first step (inf,
    # then inf * 0), the weights non-finite, and epsilon 3.47 still reported;
    # with a loss whose norms are all 0, C = 0.0 without a word.
    with pytest.warns(UserWarning, match="reached max_clip_norm=1000") as caught:
        model, clips, privacy, error = diverging_run()
    assert error is None
    # The initial C * 1000 after the first step; from there every norm is
    # below C, and C falls to the initial C / 1000 (not 0): bound to bound.
    assert clips == pytest.approx([1e3, 1e-3], rel=1e-6)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert sum("reached max_clip_norm" in str(w.message) for w in caught) == 1
    section = privacy.report()["settings"]["adaptive_clipping"]
    assert section["clip_norm_bounds"] == [1e-3, 1e3]


def test_an_update_that_leaves_the_weights_nonfinite_stops_the_run_and_its_steps_count():
    # C = 1e300 is allowed and finite, but the next step's noise sigma C
    # overflows float32: the weights become inf.
    with pytest.warns(UserWarning, match="max_clip_norm"):
        model, clips, privacy, error = diverging_run(max_clip_norm=1e300)
    trajectory = privacy.report()["settings"]["adaptive_clipping"]["trajectory"]
    assert trajectory[0] == [1, 1e300]  # held at the user's bound after the first step
    assert error is not None and "learning_rate" in str(error)
    assert "ledger counts every step applied" in str(error)
    assert not all(np.isfinite(w).all() for w in model.get_weights())
    applied = model.optimizer.logical_steps_applied
    assert applied == 2  # stopped after the step that diverged, not at the end
    assert tf_megadp.model_ledger(model).total_steps == applied
    assert privacy.report()["steps"] == applied
    # The weights are still non-finite: the next fit refuses before its first step.
    with pytest.raises(PrivacyConfigurationError, match="non-finite"):
        model.fit(np.zeros((8, 3), "float32"), np.zeros((8, 2), "float32"), batch_size=8,
                  verbose=0)
    assert model.optimizer.logical_steps_applied == applied


@pytest.mark.parametrize("kwargs, message", [
    ({"min_clip_norm": 0.0}, "min_clip_norm must be a finite number > 0"),
    ({"max_clip_norm": -1.0}, "max_clip_norm must be a finite number > 0"),
    ({"max_clip_norm": float("inf")}, "max_clip_norm must be finite"),
    ({"min_clip_norm": float("nan")}, "min_clip_norm must be finite"),
    ({"min_clip_norm": 2.0, "max_clip_norm": 1.0}, "swap them"),
])
def test_clip_norm_bounds_that_are_not_finite_positive_and_ordered_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveClipping(**kwargs)


def test_an_initial_clip_norm_outside_the_range_is_refused():
    with pytest.raises(PrivacyConfigurationError, match=r"outside adaptive clipping's range"):
        tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0, normalize_by=64.0,
                              adaptive_clipping=AdaptiveClipping(min_clip_norm=2.0))
    assert AdaptiveClipping().clip_norm_bounds(0.5) == (0.5e-3, 0.5e3)
    assert AdaptiveClipping.from_dict({"target_quantile": 0.5, "learning_rate": 0.2,
                                       "count_stddev": None}) == AdaptiveClipping()


# -- Refusals --------------------------------------------------------------------------


@pytest.mark.parametrize("settings, adaptive, message", [
    ({"noise_multiplier": 1.0, "normalize_by": 8.0}, AdaptiveClipping(), "count_stddev"),
    ({"noise_multiplier": 1.0}, AdaptiveClipping(count_stddev=0.5), "count_stddev"),
    ({"noise_multiplier": 1.0}, AdaptiveClipping(count_stddev=0.0), "count_stddev"),
    ({"noise_multiplier": 0.0}, AdaptiveClipping(count_stddev=1.0), "count_stddev=0"),
    ({"noise_multiplier": 1.0, "normalize_by": 800.0, "per_example_scaling": "automatic"},
     AdaptiveClipping(), "automatic"),
])
def test_settings_that_spend_more_than_sigma_are_refused(settings, adaptive, message):
    with pytest.raises(PrivacyConfigurationError, match=message):
        tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, adaptive_clipping=adaptive,
                              **settings)


def test_a_schedule_phase_too_small_for_the_default_count_noise_is_refused():
    schedule = tf_megadp.BatchSizeSchedule.for_poisson(
        [(10, 400), (10, 8)], num_examples=1000, micro_batch_size=8)
    with pytest.raises(PrivacyConfigurationError, match="count_stddev"):
        tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0, schedule=schedule,
                              adaptive_clipping=AdaptiveClipping())


def test_a_batch_known_only_in_the_step_is_refused_before_it_trains():
    """B = 8 examples per step: the default count noise B / 20 is below sigma / 2."""
    model = small_model()
    compiled(model, l2_norm_clip=1.0, noise_multiplier=1.0, adaptive_clipping=AdaptiveClipping())
    x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
    with pytest.raises(PrivacyConfigurationError, match="count_stddev"):
        model.fit(x, np.zeros((16, 2), "float32"), batch_size=8, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_a_batch_known_only_at_run_time_is_refused_after_its_first_step():
    """A dataset of unknown batch size and N: the step records the impossible pair as NaN."""
    import tensorflow as tf

    model = small_model()
    compiled(model, l2_norm_clip=1.0, noise_multiplier=1.0, adaptive_clipping=AdaptiveClipping())
    x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, np.zeros((16, 2), "float32"))).batch(8)
    with pytest.raises(PrivacyConfigurationError, match="count_stddev"):
        with pytest.warns(UserWarning):
            model.fit(data, verbose=0)


@pytest.mark.parametrize("kwargs", [{"target_quantile": 0.0}, {"target_quantile": 1.0},
                                    {"learning_rate": 0.0}, {"count_stddev": -1.0},
                                    {"learning_rate": float("nan")}])
def test_invalid_adaptive_settings_raise(kwargs):
    with pytest.raises(ValueError):
        AdaptiveClipping(**kwargs)



# -- The command line ------------------------------------------------------------------


def test_cli_epsilon_accounts_the_count_with_the_gradient(capsys):
    run = ["epsilon", "--num-examples", "60000", "--batch-size", "1000", "--steps", "300",
           "--delta", "1e-5", "--accountant", "rdp", "--json"]
    gradient, count = andrew_noise_multipliers(1.0, 50.0)
    assert cli.main(run + ["--noise-multiplier", str(gradient), "--count-stddev", "50"]) == 0
    pair = json.loads(capsys.readouterr().out)
    assert pair["ledger"][0]["count_noise_multiplier"] == count
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(1000 / 60000, dp_accounting.GaussianDpEvent(1.0)), 300)
    assert pair["epsilon"] == pytest.approx(
        rdp.RdpAccountant().compose(event).get_epsilon(1e-5), rel=1e-9)


def test_cli_calibrate_gives_the_gradients_multiplier_and_refuses_a_small_count(capsys):
    run = ["calibrate", "--num-examples", "60000", "--batch-size", "1000", "--steps", "300",
           "--delta", "1e-5", "--accountant", "rdp", "--target-epsilon", "2", "--json"]
    assert cli.main(run + ["--count-stddev", "50"]) == 0
    report = json.loads(capsys.readouterr().out)
    section = report["adaptive_clipping"]
    assert (section["gradient_noise_multiplier"], section["count_noise_multiplier"]) == (
        pytest.approx(andrew_noise_multipliers(report["noise_multiplier"], 50.0), rel=1e-12))
    assert cli.main(run + ["--count-stddev", "0.3"]) == 2
    assert "count_stddev" in capsys.readouterr().err


def test_the_example_grows_c_from_far_below_the_norms(capsys):
    """examples/adaptive_clipping.py at test size: half an epoch of B = 64 (11 steps)."""
    import runpy
    import warnings

    example = runpy.run_path("examples/adaptive_clipping.py")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = example["main"](["--epochs", "0.5", "--batch-size", "64",
                                  "--micro-batch-size", "64"])
    section = result["report"]["settings"]["adaptive_clipping"]
    clips = [clip for _, clip in section["trajectory"]]
    assert len(clips) == 11
    assert clips[-1] > 2 * 0.01  # every norm was above the initial C: C grew
    assert result["report"]["ledger"][0]["count_noise_multiplier"] == pytest.approx(6.4)
    assert "C after logical step" in capsys.readouterr().out


def test_the_white_box_audit_refuses_a_moving_clip_norm():
    """Its scores assume each update moves by lr * C / B with C fixed."""
    import types

    from tf_megadp.audit import white_box

    model = small_model()
    compiled(model, l2_norm_clip=1.0, noise_multiplier=1.0, normalize_by=64.0,
             adaptive_clipping=AdaptiveClipping())
    scoring = white_box.WhiteBoxScoring(types.SimpleNamespace(model=model), None, 1.0)
    with pytest.raises(PrivacyConfigurationError, match="adaptive_clipping=None"):
        scoring.scores()


def test_the_main_job_takes_adaptive_clipping_from_its_flags():
    import argparse

    from tf_megadp.cli import run_config_from_args
    from tf_megadp.jobs.bert.config import PretrainError

    def config(**flags):
        return run_config_from_args(argparse.Namespace(**flags), None)

    adaptive = config(adaptive_clipping_quantile=0.5, adaptive_clipping_count_stddev=20.0)
    adaptive.validate()
    assert adaptive.adaptive_clipping() == AdaptiveClipping(0.5, 0.2, 20.0)
    assert config().adaptive_clipping() is None  # off by default
    with pytest.raises(PretrainError, match="target_quantile"):
        config(adaptive_clipping_quantile=1.5).validate()
    with pytest.raises(PretrainError, match="needs a private run"):
        config(adaptive_clipping_quantile=0.5, non_private=True).validate()


_REPLICAS_SCRIPT = """
import sys
import tensorflow as tf
replicas = int(sys.argv[1])
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import numpy as np, keras, tf_megadp
strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 3)).astype("float32")
y = (rng.normal(size=(64, 2)) * np.linspace(0.2, 3, 64)[:, None]).astype("float32")
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = tf_megadp.make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    optimizer = tf_megadp.DPOptimizer(
        keras.optimizers.SGD(0.1), 0.5, 0.0, normalize_by=16.0, clipping="vectorized",
        accumulation_steps=3 - replicas,
        adaptive_clipping=tf_megadp.AdaptiveClipping(0.5, 0.5, count_stddev=0.0))
    model.compile(optimizer=optimizer, loss="mse")
model.fit(x, y, batch_size=16 if replicas == 2 else 8, shuffle=False, verbose=0)
print([c for _, c in optimizer.clip_norm_trajectory])
"""


@pytest.mark.slow
def test_replicas_sum_their_counts_before_c_moves():
    """Two MirroredStrategy replicas (CPU devices) move C as one replica with k = 2 does.

    Slow (two interpreters, about 30 CPU-seconds): `pytest -m slow -k replicas`.
    """
    import os
    import subprocess
    import sys

    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    runs = [subprocess.run([sys.executable, "-c", _REPLICAS_SCRIPT, str(replicas)],
                           capture_output=True, text=True, timeout=300, env=environment)
            for replicas in (1, 2)]
    one, two = (json.loads(run.stdout.strip().splitlines()[-1]) for run in runs)
    assert len(one) == 4 and one[-1] != 0.5
    np.testing.assert_allclose(two, one, rtol=1e-12)


def test_a_custom_loop_moves_c_records_the_pair_and_checkpoints_c(tmp_path):
    """PrivateStep runs the same step: C in its logs, the pair in its ledger, C in step.checkpoint()."""
    import tensorflow as tf

    from tf_megadp import PrivacyReport, PrivateStep

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(256, 3)).astype("float32"), rng.normal(size=(256, 2)).astype("float32")
    sampler = tf_megadp.PoissonSampler.from_arrays(x, y, batch_size=64, micro_batch_size=32,
                                                   epochs=0.5, seed=5)

    def private_step():
        return PrivateStep(small_model(), tf_megadp.DPOptimizer(
            keras.optimizers.SGD(0.1), l2_norm_clip=0.05, noise_multiplier=1.0,
            schedule=sampler.schedule, seed=3, adaptive_clipping=AdaptiveClipping()), loss="mse")

    step = private_step()
    step.begin(sampler)
    train = tf.function(step.run)
    logs = [{k: v.numpy() for k, v in train(batch).items()} for batch in sampler.as_dataset(tagged=True)]
    report = PrivacyReport(step, 1e-3, accountant="rdp").report()
    clip = float(step.optimizer.clip_norm.numpy())
    assert clip > 0.05 and float(logs[-1]["clip_norm"]) == pytest.approx(clip, rel=1e-6)
    entry = report["ledger"][0]
    assert entry["count_noise_multiplier"] == pytest.approx(6.4)
    assert entry["noise_multiplier"] == pytest.approx(andrew_noise_multipliers(1.0, 3.2)[0])
    assert report["settings"]["adaptive_clipping"]["clip_norm"] == pytest.approx(clip)
    path = step.checkpoint().write(str(tmp_path / "loop"))
    restored = private_step()
    restored.checkpoint().read(path).assert_consumed()
    assert float(restored.optimizer.clip_norm.numpy()) == clip
