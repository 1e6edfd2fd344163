"""Specification of the private step of custom training loops (`tf_megadp.PrivateStep`).

A loop that calls `PrivateStep` once per micro-batch inside its own
`tf.function` must be indistinguishable from the private `fit` on the same
draws: the same updates (sigma = 0, and the same seeded noise), the same
ledger and epsilon, and the same refusals. Here on one device; on 2 and 4
CPU replicas and on two loopback workers in tests/test_distribute.py (the
scenarios of tests/distributed_scenarios.py).
"""

import math
import runpy
import warnings

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf
from dp_accounting import rdp

import tf_megadp
from tests import reference
from tf_megadp import PrivacyConfigurationError, PrivacyReport, PrivateStep

N = 48
BATCH = 12
MICRO_BATCH = 4
DELTA = 1e-5

pytestmark = [
    pytest.mark.filterwarnings("ignore:DPOptimizer\\(seed="),
    pytest.mark.filterwarnings("ignore:DPOptimizer with noise_multiplier=0"),
    pytest.mark.filterwarnings("ignore:.*seed=.*recomputable"),
    pytest.mark.filterwarnings("ignore:.*fixed-size batches, not Poisson draws"),
]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(N, 4)).astype("float32"),
            rng.normal(size=(N, 2)).astype("float32"))


def dense_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                             keras.layers.Dense(2)])


def dp_optimizer(schedule=None, noise_multiplier=1.0, **kwargs):
    return tf_megadp.DPOptimizer(
        keras.optimizers.SGD(0.5, momentum=0.9), l2_norm_clip=0.5,
        noise_multiplier=noise_multiplier, schedule=schedule, seed=3, **kwargs)


def sampler_of(data, seed=5, **kwargs):
    x, y = data
    kwargs.setdefault("epochs", 1)
    return tf_megadp.PoissonSampler.from_arrays(
        x, y, batch_size=BATCH, micro_batch_size=MICRO_BATCH, seed=seed, **kwargs)


def poisson_epsilon(steps, q=BATCH / N, delta=DELTA):
    """dp_accounting's RDP epsilon of `steps` Poisson-sampled Gaussian steps (sigma 1)."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.0)), steps)
    return rdp.RdpAccountant().compose(event).get_epsilon(delta)


def train_loop(step, batches, stop=None):
    """The user's loop: one tf.function call per micro-batch; returns the logs."""
    train = tf.function(step.run)
    history = []
    for batch in batches:
        logs = {name: value.numpy() for name, value in train(batch).items()}
        history.append(logs)
        if stop is not None and stop(logs):
            break
    step.record()
    return history


def weights(model):
    return [v.numpy() for v in model.trainable_variables]


@pytest.mark.parametrize("noise_multiplier", [0.0, 1.0])
def test_the_loop_applies_fits_updates_on_the_same_draws(data, noise_multiplier):
    """sigma = 0 and the same seeded noise: the loop's weights are fit's, bit for bit."""
    fit_sampler, loop_sampler = sampler_of(data), sampler_of(data)
    reference = tf_megadp.make_private(dense_model())
    reference.compile(optimizer=dp_optimizer(fit_sampler.schedule, noise_multiplier), loss="mse")
    callback = tf_megadp.PrivacyCallback(DELTA, accountant="rdp")
    reference.fit(fit_sampler.as_dataset(), callbacks=[callback], verbose=0)

    model = dense_model()
    initial = weights(model)
    step = PrivateStep(model, dp_optimizer(loop_sampler.schedule, noise_multiplier), loss="mse")
    step.begin(loop_sampler)
    history = train_loop(step, loop_sampler.as_dataset(tagged=True))

    steps = loop_sampler.schedule.total_steps
    assert step.logical_step == steps == int(reference.optimizer.iterations.numpy()) == 4
    for mine, theirs, start in zip(weights(model), weights(reference), initial):
        np.testing.assert_array_equal(mine, theirs)
        assert np.any(mine != start)
    # The logs say which micro-batch applied the update, and the step count after it.
    k = loop_sampler.schedule.phases[0].accumulation_steps
    assert [logs["applied"] for logs in history] == [(i + 1) % k == 0 for i in range(steps * k)]
    assert [logs["logical_step"] for logs in history] == [(i + 1) // k for i in range(steps * k)]
    assert all(np.isfinite(logs["loss"]) for logs in history)
    assert tf_megadp.model_ledger(model) == tf_megadp.model_ledger(reference)
    if noise_multiplier:
        report = PrivacyReport(step, DELTA, accountant="rdp")
        assert report.epsilon == callback.epsilon
        # Truncation at the capacity costs at most half of delta.
        assert poisson_epsilon(steps) <= report.epsilon <= poisson_epsilon(steps, delta=DELTA / 2)
        assert report.report()["data"]["sampling"] == "poisson"
    else:
        assert PrivacyReport(step, DELTA).epsilon == math.inf


def test_the_budget_stops_the_loop_at_the_last_step_that_fits(data):
    sampler = sampler_of(data, epochs=2)
    model = dense_model()
    step = PrivateStep(model, dp_optimizer(sampler.schedule), loss="mse")
    step.begin(sampler)
    budget = (poisson_epsilon(3, delta=DELTA / 2) + poisson_epsilon(4)) / 2
    privacy = PrivacyReport(step, DELTA, accountant="rdp", target_epsilon=budget)
    train_loop(step, sampler.as_dataset(tagged=True),
               stop=lambda logs: logs["applied"] and not privacy.within_budget())
    # Epsilon is dp_accounting's on the 3 steps applied, not on the 8 planned.
    assert step.logical_step == privacy.ledger.total_steps == 3 < sampler.schedule.total_steps
    assert poisson_epsilon(3) <= privacy.epsilon <= poisson_epsilon(3, delta=DELTA / 2)
    assert privacy.epsilon <= budget and privacy.report()["epsilon"] == privacy.epsilon
    with pytest.raises(RuntimeError, match="budget is spent"):
        PrivacyReport(step, DELTA, accountant="rdp", target_epsilon=budget)


class TestRefusedAsInFit:
    def test_a_layer_that_mixes_examples(self):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2),
                                  keras.layers.BatchNormalization()])
        with pytest.raises(PrivacyConfigurationError, match="mixes examples"):
            PrivateStep(model, dp_optimizer(accumulation_steps=1), loss="mse")

    def test_aggregated_gradients_inside_the_loop(self, data):
        model = dense_model()
        step = PrivateStep(model, dp_optimizer(accumulation_steps=1), loss="mse")

        @tf.function
        def aggregated(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            gradients = tape.gradient(loss, model.trainable_variables)
            step.optimizer.apply_gradients(zip(gradients, model.trainable_variables))

        with pytest.raises(PrivacyConfigurationError, match="PrivateStep"):
            aggregated(*data)
        assert step.logical_step == 0

    def test_a_plain_optimizer(self):
        with pytest.raises(PrivacyConfigurationError, match="DPOptimizer"):
            PrivateStep(dense_model(), keras.optimizers.SGD(0.1), loss="mse")

    def test_a_second_private_optimizer(self, data):
        with pytest.raises(PrivacyConfigurationError, match="cannot wrap another"):
            tf_megadp.DPOptimizer(dp_optimizer(), l2_norm_clip=1.0, noise_multiplier=1.0)
        x, y = data
        batches = [(x[i:i + MICRO_BATCH], y[i:i + MICRO_BATCH]) for i in range(0, 16, MICRO_BATCH)]
        model = dense_model()
        first = dp_optimizer(accumulation_steps=1)
        old = PrivateStep(model, first, loss="mse")
        old.begin(num_examples=N, micro_batches_per_pass=N // MICRO_BATCH)
        train_loop(old, batches[:2])
        # A new DPOptimizer takes the weights' ledger over and trains further...
        with pytest.warns(UserWarning, match="the 2 logical steps of the previous one"):
            new = PrivateStep(model, dp_optimizer(accumulation_steps=1), loss="mse")
            new.begin(num_examples=N, micro_batches_per_pass=N // MICRO_BATCH)
        train_loop(new, batches[2:])
        assert tf_megadp.model_ledger(model).total_steps == 4
        # ...so the old step and the old optimizer, whose ledger misses those steps, refuse.
        with pytest.raises(PrivacyConfigurationError, match="newer PrivateStep"):
            tf.function(old.run)(batches[0])
        with pytest.raises(PrivacyConfigurationError, match="trained further"):
            PrivateStep(model, first, loss="mse").begin(
                num_examples=N, micro_batches_per_pass=N // MICRO_BATCH)

    def test_steps_not_yet_recorded_and_settings_changed_after_the_first_step(self, data):
        sampler = sampler_of(data)
        model = dense_model()
        step = PrivateStep(model, dp_optimizer(sampler.schedule), loss="mse")
        step.begin(sampler)
        train = tf.function(step.run)
        for _, batch in zip(range(sampler.schedule.phases[0].accumulation_steps),
                            sampler.as_dataset(tagged=True)):
            train(batch)
        assert step.logical_step == 1
        with pytest.raises(PrivacyConfigurationError, match="record"):
            tf_megadp.model_ledger(model)
        step.record()
        assert tf_megadp.model_ledger(model).total_steps == 1
        for name, value in [("noise_multiplier", 0.0), ("l2_norm_clip", 10.0), ("schedule", None)]:
            with pytest.raises(PrivacyConfigurationError, match="cannot change"):
                setattr(step.optimizer, name, value)

    def test_a_logical_step_spanning_two_passes(self, data):
        """Data no sampler drew: 3 micro-batches per pass, 2 per logical step."""
        x, y = data[0][:12], data[1][:12]
        passes = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 12, 4)]
        model = dense_model()
        step = PrivateStep(model, dp_optimizer(accumulation_steps=2, normalize_by=8), loss="mse")
        step.begin((x, y), micro_batches_per_pass=3)
        train = tf.function(step.run)
        for batch in passes + passes:  # Step 2 = the last batch of pass 1 + the first of pass 2.
            train(batch)
        with pytest.raises(PrivacyConfigurationError, match="spanned the end of a pass"):
            step.record()
        with pytest.raises(PrivacyConfigurationError, match="cannot be accounted"):
            tf_megadp.model_ledger(model)

        model = dense_model()
        step = PrivateStep(model, dp_optimizer(accumulation_steps=2, normalize_by=8), loss="mse")
        step.begin((x, y), micro_batches_per_pass=3)
        train = tf.function(step.run)
        for _ in range(2):
            for batch in passes:
                train(batch)
            with pytest.warns(UserWarning, match="Discarded the last 1 micro-batches"):
                step.end_pass()
        (entry,) = PrivacyReport(step, DELTA).ledger
        assert (entry.steps, entry.sampling_rate, entry.sampling) == (2, 8 / 12, "shuffle")

    def test_steps_something_else_applied_in_between(self, data):
        x, y = data
        model = dense_model()
        step = PrivateStep(model, dp_optimizer(accumulation_steps=1), loss="mse")
        step.begin((x, y), micro_batches_per_pass=N // MICRO_BATCH)
        train = tf.function(step.run)
        train((x[:4], y[:4]))
        model.train_on_batch(x[4:8], y[4:8])  # Data the step never saw.
        train((x[8:12], y[8:12]))
        with pytest.raises(PrivacyConfigurationError, match="trained by something else"):
            step.record()
        with pytest.raises(PrivacyConfigurationError, match="cannot be accounted"):
            PrivacyReport(step, DELTA).epsilon

    @pytest.mark.parametrize("case, message", [
        ("other schedule", "follows"),
        ("other start step", "starts at logical step 1"),
        ("stated N differs", "num_examples=40"),
        ("no N", "state it"),
        ("no passes", "micro_batches_per_pass"),
        ("strict", "require_poisson_sampling"),
    ])
    def test_data_fit_would_refuse(self, data, case, message):
        sampler = sampler_of(data)
        step = PrivateStep(dense_model(), dp_optimizer(sampler.schedule), loss="mse",
                           require_poisson_sampling=case == "strict")
        arguments = {
            "other schedule": (sampler_of(data, epochs=2), {}),
            "other start step": (sampler_of(data, start_step=1), {}),
            "stated N differs": (sampler, {"num_examples": 40}),
            "no N": (None, {"micro_batches_per_pass": 3}),
            "no passes": (None, {"num_examples": N}),
            "strict": (None, {"num_examples": N, "micro_batches_per_pass": 3}),
        }
        source, keywords = arguments[case]
        with pytest.raises(PrivacyConfigurationError, match=message):
            step.begin(source, **keywords)
        with pytest.raises(RuntimeError, match="begin"):
            tf.function(step.run)(next(iter(sampler.as_dataset(tagged=True))))


class TestATracedStepOutlivesNoOptimizer:
    """Attack (issue 37, 2): a step traced before a compile trains on through the old optimizer.

    Before the fix the old traced function applied every further call's
    noisy step through the old DPOptimizer (12 in all here), while the
    model's ledger and `PrivacyReport` counted 2: its checks ran when it
    was traced, not when it ran.
    """

    @pytest.mark.parametrize("recompile", [
        "compile", pytest.param("new PrivateStep", marks=pytest.mark.slow)])
    def test_the_old_traced_step_refuses_at_run_time(self, data, recompile):
        x, y = data
        batches = [(x[i:i + MICRO_BATCH], y[i:i + MICRO_BATCH]) for i in range(0, N, MICRO_BATCH)]
        model = dense_model()
        step = PrivateStep(model, dp_optimizer(accumulation_steps=1), loss="mse")
        step.begin((x, y), micro_batches_per_pass=len(batches))
        train = tf.function(step.run)
        for batch in batches[:2]:
            train(batch)
        step.record()
        old = model.optimizer
        # A new learning rate: a new DPOptimizer (its ledger continues the weights').
        new = dp_optimizer(accumulation_steps=1)
        if recompile == "compile":
            model.compile(optimizer=new, loss="mse")
        else:
            PrivateStep(model, new, loss="mse")
        trained = weights(model)
        with pytest.raises(tf.errors.InvalidArgumentError, match="outlived its optimizer"):
            for batch in batches[2:]:
                train(batch)
        assert int(old.iterations.numpy()) == 2
        for now, before in zip(weights(model), trained):
            np.testing.assert_array_equal(now, before)
        if recompile != "compile":
            assert tf_megadp.model_ledger(model).total_steps == 2


class TestOnlyTheBegunSamplersMicroBatchesAreAccounted:
    """Attack (issue 37, 3): after begin(sampler), the loop feeds rows the sampler never drew.

    Before the fix each was accounted with the sampler's N and q: the same
    8 rows fed on every micro-step of a sampler over 48 reported 7.30 for
    16 steps (honest, without sampling: >= 24.4); a sampler over 100,000
    rows with the loop feeding 64 of its own reported 0.174 (honest
    >= 17.9).
    """

    @pytest.mark.parametrize("num_examples, rows_fed", [
        (N, 8), pytest.param(100_000, 64, marks=pytest.mark.slow)])
    def test_rows_the_sampler_did_not_draw_are_refused(self, num_examples, rows_fed):
        rng = np.random.default_rng(1)
        x = rng.normal(size=(num_examples, 4)).astype("float32")
        sampler = tf_megadp.PoissonSampler.from_arrays(
            x, x[:, :2], batch_size=BATCH, micro_batch_size=rows_fed, epochs=1, seed=5)
        step = PrivateStep(dense_model(), dp_optimizer(sampler.schedule), loss="mse")
        step.begin(sampler)
        train = tf.function(step.run)
        mine = (x[:rows_fed], x[:rows_fed, :2], np.ones(rows_fed, "float32"))
        with pytest.raises(PrivacyConfigurationError, match="carry no tag.*tagged=True"):
            train(mine)
        forged = (mine, tf.constant(rng.integers(0, 2**62, rows_fed), tf.int64))
        with pytest.raises(tf.errors.InvalidArgumentError, match="not the next one of the sampler"):
            train(forged)
        assert step.logical_step == 0 and int(step.optimizer.micro_steps.numpy()) == 0

    def test_a_replayed_micro_batch_is_refused_and_a_map_fn_trains(self, data):
        sampler = sampler_of(data)
        step = PrivateStep(dense_model(), dp_optimizer(sampler.schedule), loss="mse")
        step.begin(sampler)
        # Processing goes in the sampler's map_fn: checked for mixing, then tagged.
        scaled = iter(sampler.as_dataset(lambda x, y, w: (x * 2.0, y, w), tagged=True))
        train = tf.function(step.run)
        first = next(scaled)
        train(first)
        with pytest.raises(tf.errors.InvalidArgumentError, match="not the next one of the sampler"):
            train(first)  # The same rows again, in the next micro-batch's place.
        assert int(step.optimizer.micro_steps.numpy()) == 1
        for batch in scaled:
            train(batch)
        steps = sampler.schedule.total_steps
        report = PrivacyReport(step, DELTA, accountant="rdp")
        assert report.ledger.total_steps == step.logical_step == steps
        assert poisson_epsilon(steps) <= report.epsilon <= poisson_epsilon(steps, delta=DELTA / 2)


class TestTheTagBindsTheRows:
    """Attack (issue 47, 1): a map of the tagged dataset that keeps the tag but changes the rows.

    Before the fix the tag was a keyed function of (logical step,
    micro-step) alone: a tag-keeping map that set every real row of a
    micro-batch to its largest row (MixUp at its extreme) moved the
    un-noised clipped sum by 7.0000 C for one example, and the step was
    recorded as an ordinary Poisson step. `fit` refused the same map.
    """

    @staticmethod
    def largest_row(batch, tag):
        x, y, w = batch
        real = w > 0
        norms = tf.where(real, tf.norm(x, axis=1), -1.0)
        largest = tf.argmax(norms)
        spread = lambda t: tf.where(  # noqa: E731
            tf.reshape(real, [-1] + [1] * (t.shape.rank - 1)), tf.gather(t, [largest]), t)
        return (spread(x), spread(y), w), tag

    @pytest.mark.parametrize("attack", ["largest_row", "the_same_rows_every_step",
                                        "a_row_copied_with_its_tag"])
    def test_rows_changed_after_tagging_are_refused_and_add_nothing(self, data, attack):
        sampler = sampler_of(data)
        model = dense_model()
        step = PrivateStep(model, dp_optimizer(sampler.schedule), loss="mse")
        step.begin(sampler)
        tagged = sampler.as_dataset(tagged=True)
        if attack == "largest_row":
            fed = tagged.map(self.largest_row)
        elif attack == "the_same_rows_every_step":
            rows = (data[0][:MICRO_BATCH], data[1][:MICRO_BATCH],
                    np.ones(MICRO_BATCH, "float32"))
            fed = tagged.map(lambda batch, tag: (rows, tag))
        else:  # Oversampling: row 0 and its tag written over row 1.
            copy = lambda t: tf.concat([t[:1], t[:1], t[2:]], axis=0)  # noqa: E731
            fed = tagged.map(lambda batch, tag: (tuple(copy(t) for t in batch), copy(tag)))
        before = weights(model)
        train = tf.function(step.run)
        with pytest.raises(tf.errors.InvalidArgumentError, match="rows changed since"):
            train(next(iter(fed)))
        assert int(step.optimizer.micro_steps.numpy()) == 0  # nothing accumulated
        for now, then in zip(weights(model), before):
            np.testing.assert_array_equal(now, then)

    def test_the_tags_are_the_same_in_the_pipeline_and_in_a_step_compiled_with_xla(self, data):
        from tf_megadp.data import tags

        rng = np.random.default_rng(3)
        element = (rng.normal(size=(8, 4)).astype("float32"), rng.integers(0, 9, (8, 5)),
                   rng.normal(size=(8,)).astype("float32"))
        key = tf.constant([11, 12], tf.int64)
        whole = tags.row_tags(key, 3, 1, element, 0, 8)
        halves = [tf.function(tags.row_tags, jit_compile=True)(
            key, tf.constant(3, tf.int64), tf.constant(1, tf.int64),
            tuple(t[4 * i:4 * (i + 1)] for t in element), tf.constant(4 * i), 8)
            for i in range(2)]
        np.testing.assert_array_equal(whole.numpy(), np.concatenate([h.numpy() for h in halves]))
        # Any changed bit, or another place in the run, gives other tags.
        flipped = element[0].copy()
        flipped.view(np.uint32)[5, 2] ^= 1
        assert (tags.row_tags(key, 3, 1, (flipped, *element[1:]), 0, 8).numpy()
                != whole.numpy()).tolist() == [i == 5 for i in range(8)]
        assert not np.any(tags.row_tags(key, 3, 2, element, 0, 8).numpy() == whole.numpy())
        assert not np.any(tags.row_tags(key, 4, 1, element, 0, 8).numpy() == whole.numpy())


def test_a_checkpoint_resumes_the_ledger_and_holds_no_partial_step(data, tmp_path):
    """Saved inside logical step 3 with step.checkpoint(), restored into a fresh model."""
    sampler = sampler_of(data, epochs=2)
    model = dense_model()
    step = PrivateStep(model, dp_optimizer(sampler.schedule), loss="mse")
    step.begin(sampler)
    k = sampler.schedule.phases[0].accumulation_steps
    train_loop(step, sampler.as_dataset(tagged=True),
               stop=lambda logs: logs["logical_step"] == 2 and not logs["applied"])
    assert step.logical_step == 2 and int(step.optimizer.micro_steps.numpy()) == 1
    path = step.checkpoint().write(str(tmp_path / "loop"))  # Records the 2 steps first.

    restored_model = dense_model()
    restored = PrivateStep(restored_model, dp_optimizer(sampler.schedule), loss="mse")
    restored.checkpoint().read(path).assert_consumed()
    assert restored.logical_step == 2
    assert int(restored.optimizer.micro_steps.numpy()) == 0
    assert not any(np.any(a.numpy()) for a in restored.optimizer.accumulation_stage.state.accumulators)
    for a, b in zip(weights(restored_model), weights(model)):
        np.testing.assert_array_equal(a, b)
    rest = sampler_of(data, epochs=2, seed=6, start_step=restored.logical_step)
    restored.begin(rest)
    history = train_loop(restored, rest.as_dataset(tagged=True))
    assert len(history) == (sampler.schedule.total_steps - 2) * k
    report = PrivacyReport(restored, DELTA, accountant="rdp")
    steps = sampler.schedule.total_steps
    assert report.ledger.total_steps == restored.logical_step == steps
    assert poisson_epsilon(steps) <= report.epsilon <= poisson_epsilon(steps, delta=DELTA / 2)


def test_a_checkpoint_restored_under_a_running_step_needs_begin_again(data, tmp_path):
    sampler = sampler_of(data, epochs=2)
    model = dense_model()
    step = PrivateStep(model, dp_optimizer(sampler.schedule), loss="mse")
    step.begin(sampler)
    checkpoint = step.checkpoint()
    batches = iter(sampler.as_dataset(tagged=True))
    k = sampler.schedule.phases[0].accumulation_steps
    train = tf.function(step.run)
    for _ in range(k):
        train(next(batches))
    path = checkpoint.write(str(tmp_path / "one"))
    for _ in range(k):
        train(next(batches))
    step.record()
    checkpoint.read(path)  # Back at step 1.
    # The sampler's step 2 fed at step 1's place: refused, added to no sum.
    with pytest.raises(tf.errors.InvalidArgumentError, match="not the next one of the sampler"):
        train(next(batches))
    with pytest.raises(PrivacyConfigurationError, match="replaced.*step.begin"):
        step.record()
    rest = sampler_of(data, epochs=2, seed=6, start_step=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # The refused call may have counted a micro-step.
        step.begin(rest)
    train_loop(step, rest.as_dataset(tagged=True))
    steps = sampler.schedule.total_steps
    epsilon = PrivacyReport(step, DELTA, accountant="rdp").epsilon
    assert poisson_epsilon(steps) <= epsilon <= poisson_epsilon(steps, delta=DELTA / 2)


def test_a_step_replayed_from_a_restored_checkpoint_draws_new_noise(tmp_path):
    """Issue 37: restore step.checkpoint() to step 1, begin a new sampler there, train step 2.

    Before, the replayed step drew its first run's noise bit for bit (the key
    outlived the restore), so the difference of the two releases was the
    noise-free difference of their sums. Every gradient is zero here, so the
    two updates differ by their noise alone.
    """
    x, y = reference.rollback_examples(16)
    clip, sigma = 0.5, 2.0

    def sampler(start_step):
        return tf_megadp.PoissonSampler.from_arrays(
            x, y, batch_size=4, epochs=1, micro_batch_size=4, start_step=start_step)

    first_sampler = sampler(0)
    phase = first_sampler.schedule.phases[0]
    step = PrivateStep(reference.rollback_model(), tf_megadp.DPOptimizer(
        keras.optimizers.SGD(1.0), l2_norm_clip=clip, noise_multiplier=sigma,
        schedule=first_sampler.schedule), loss=reference.zero_loss)
    train = tf.function(step.run)

    def one_logical_step(batches):
        for _ in range(phase.accumulation_steps):
            train(next(batches))

    step.begin(first_sampler)
    checkpoint = step.checkpoint()
    batches = iter(first_sampler.as_dataset(tagged=True))
    one_logical_step(batches)
    path = checkpoint.write(str(tmp_path / "step1"))
    one_logical_step(batches)
    step.record()
    first = weights(step.model)
    checkpoint.read(path)
    replay = sampler(1)
    step.begin(replay)
    one_logical_step(iter(replay.as_dataset(tagged=True)))
    assert step.logical_step == 2
    divisor = phase.batch_size
    reference.assert_replayed_noise_is_fresh(first, weights(step.model), sigma * clip / divisor)


def test_the_custom_loop_example_trains_resumes_and_reports(capsys, tmp_path):
    """examples/custom_loop.py, tiny: stopped after 2 logical steps, resumed to the end."""
    example = runpy.run_path("examples/custom_loop.py")
    flags = ["--examples", "96", "--batch-size", "24", "--epochs", "1", "--micro-batch-size",
             "8", "--hidden", "8", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = example["main"](flags + ["--stop-after-steps", "2"])
        final = example["main"](flags)
    assert (first["logical_steps"], final["logical_steps"]) == (2, 4)
    assert "resumed at logical step 2" in capsys.readouterr().out
    ledger = final["report"]["ledger"]
    assert sum(entry["steps"] for entry in ledger) == 4
    assert 0 < first["epsilon"] < final["epsilon"] < math.inf
