"""Specification of tf_megadp.PrivacyCallback on real DP training.

A tiny Dense model is trained with `tf_megadp.DPOptimizer` and
`tf_megadp.make_private`: 64 examples in micro-batches of 8, two micro-batches
per logical step, so one epoch is 4 logical steps. Epsilon is always checked
against dp_accounting events built here by hand.
"""

import csv
import json

import dp_accounting
import keras
import numpy as np
import pytest
from dp_accounting import pld, rdp

import tf_megadp
from tf_megadp import BatchSizeSchedule, Phase, PrivacyCallback

MICRO_BATCH = 8
ACCUMULATION = 2
STEPS_PER_EPOCH = 64 // (MICRO_BATCH * ACCUMULATION)
N = 6_400  # The accounting population; the 64 rows stand in for a sample.
BATCH = MICRO_BATCH * ACCUMULATION
DELTA = 1e-5


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(64, 4)).astype("float32"),
            rng.normal(size=(64, 2)).astype("float32"))


def private_model(noise_multiplier=1.0, schedule=None, steps_per_execution=1):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    if schedule is None:
        optimizer = tf_megadp.DPOptimizer(
            keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
            noise_multiplier=noise_multiplier, accumulation_steps=ACCUMULATION,
            normalize_by=BATCH, seed=1)
    else:
        optimizer = tf_megadp.DPOptimizer(
            keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
            noise_multiplier=noise_multiplier, schedule=schedule, seed=1)
    tf_megadp.make_private(model)
    model.compile(optimizer=optimizer, loss="mse", steps_per_execution=steps_per_execution)
    return model


def fit(model, data, epochs, callbacks):
    x, y = data
    return model.fit(x, y, batch_size=MICRO_BATCH, epochs=epochs, shuffle=False,
                     callbacks=callbacks, verbose=0)


def reference_epsilon(steps, q=BATCH / N, sigma=1.0, accountant="rdp"):
    engine = pld.PLDAccountant() if accountant == "pld" else rdp.RdpAccountant()
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)),
        steps)
    return engine.compose(event).get_epsilon(DELTA)


class BatchLogs(keras.callbacks.Callback):
    """Records what later callbacks see in the batch logs."""

    def __init__(self):
        super().__init__()
        self.epsilons = []

    def on_train_batch_end(self, batch, logs=None):
        self.epsilons.append(logs.get("epsilon"))


def test_epsilon_reaches_history_csv_batch_logs_and_the_report(data, tmp_path):
    model = private_model()
    batch_logs = BatchLogs()
    callback = PrivacyCallback(N, DELTA, accountant="rdp", log_every_steps=3,
                               report_path=tmp_path / "privacy.json")
    csv_path = tmp_path / "log.csv"
    history = fit(model, data, 2, [callback, keras.callbacks.CSVLogger(str(csv_path)), batch_logs])

    expected = [reference_epsilon(STEPS_PER_EPOCH), reference_epsilon(2 * STEPS_PER_EPOCH)]
    np.testing.assert_allclose(history.history["epsilon"], expected, rtol=1e-12)
    assert history.history["delta"] == [DELTA, DELTA]
    with open(csv_path) as stream:
        rows = list(csv.DictReader(stream))
    np.testing.assert_allclose([float(row["epsilon"]) for row in rows], expected, rtol=1e-9)
    # Logical steps 3 and 6 end at micro-batches 6 and 12 (batch indices 5, 11).
    logged = {i: e for i, e in enumerate(batch_logs.epsilons) if e is not None}
    assert sorted(logged) == [5, 11]
    assert logged[5] == pytest.approx(reference_epsilon(3), rel=1e-12)

    report = json.loads((tmp_path / "privacy.json").read_text())
    assert report["epsilon"] == pytest.approx(expected[-1], rel=1e-12)
    assert report["steps"] == 2 * STEPS_PER_EPOCH
    assert report["settings"]["l2_norm_clip"] == 1.0
    assert report["ledger"] == [dict(steps=8, sampling_rate=BATCH / N, noise_multiplier=1.0,
                                     max_batch_size=0, sampling="poisson")]


def test_resumed_run_continues_its_epsilon(data, tmp_path):
    uninterrupted = private_model()
    whole = PrivacyCallback(N, DELTA)
    fit(uninterrupted, data, 2, [whole])

    first = private_model()
    path = str(tmp_path / "checkpoint.keras")
    fit(first, data, 1, [PrivacyCallback(N, DELTA), keras.callbacks.ModelCheckpoint(path)])
    restored = keras.models.load_model(path)
    assert tf_megadp.read_ledger(restored.optimizer).total_steps == STEPS_PER_EPOCH
    tf_megadp.make_private(restored)
    resumed = PrivacyCallback(N, DELTA)
    fit(restored, data, 1, [resumed])

    assert int(restored.optimizer.iterations.numpy()) == 2 * STEPS_PER_EPOCH
    assert resumed.ledger == whole.ledger
    assert resumed.epsilon == whole.epsilon
    assert whole.epsilon == pytest.approx(
        reference_epsilon(2 * STEPS_PER_EPOCH, accountant="pld"), rel=1e-9)


def test_budget_stop_halts_exactly_at_the_last_step_that_fits(data, capsys):
    # Budget between epsilon after 5 and after 6 logical steps: the run must
    # take exactly 5 steps (10 micro-batches) of the 40 that 10 epochs offer.
    target = (reference_epsilon(5) + reference_epsilon(6)) / 2
    fits = [t for t in range(1, 41) if reference_epsilon(t) <= target]
    assert max(fits) == 5
    model = private_model()
    callback = PrivacyCallback(N, DELTA, accountant="rdp", target_epsilon=target)
    history = fit(model, data, 10, [callback])

    optimizer = model.optimizer
    assert int(optimizer.iterations.numpy()) == 5
    assert int(optimizer.micro_steps.numpy()) == 0  # Stopped at a step boundary.
    assert callback.stopped_at_step == 5
    assert callback.epsilon == pytest.approx(reference_epsilon(5), rel=1e-12)
    assert callback.epsilon <= target < reference_epsilon(6)
    assert history.history["epsilon"][-1] <= target
    assert "stopping after logical step 5" in capsys.readouterr().out

    # The budget is spent: training again must refuse before any step.
    with pytest.raises(RuntimeError, match="budget is spent"):
        fit(model, data, 1, [PrivacyCallback(N, DELTA, accountant="rdp", target_epsilon=target)])
    assert int(optimizer.iterations.numpy()) == 5


def test_budget_stop_is_exact_across_a_schedule_phase_change(data):
    # Two steps at q = 4/N, then steps at q = 8/N: the budget runs out 3
    # steps into the second phase, so the cached "steps that fit" must be
    # recomputed when the phase changes.
    schedule = BatchSizeSchedule([Phase(2, 4, 4), Phase(30, 8, 4)],
                                 num_examples=N, micro_batch_size=MICRO_BATCH)

    def epsilon(second_phase_steps):
        return rdp.RdpAccountant().compose(dp_accounting.ComposedDpEvent([
            dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
                4 / N, dp_accounting.GaussianDpEvent(1.0)), 2),
            dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
                8 / N, dp_accounting.GaussianDpEvent(1.0)), second_phase_steps),
        ])).get_epsilon(DELTA)

    target = (epsilon(3) + epsilon(4)) / 2
    model = private_model(schedule=schedule)
    callback = PrivacyCallback(delta=DELTA, accountant="rdp", target_epsilon=target, verbose=0)
    fit(model, data, 5, [callback])
    assert int(model.optimizer.iterations.numpy()) == 5
    assert callback.stopped_at_step == 5
    assert [entry.steps for entry in callback.ledger] == [2, 3]


def test_schedule_phases_are_recorded_with_their_rate_and_truncation(data):
    # One step of expected batch 4, then one of expected batch 8 with its own
    # sigma, each in 4 micro-batches of 8 (capacity 32): the 64 rows are
    # exactly the schedule's 8 micro-batches.
    schedule = BatchSizeSchedule([Phase(1, 4, 4), Phase(1, 8, 4, noise_multiplier=2.0)],
                                 num_examples=N, micro_batch_size=MICRO_BATCH)
    model = private_model(schedule=schedule)
    callback = PrivacyCallback(delta=DELTA, accountant="rdp")
    fit(model, data, 1, [callback])
    assert int(model.optimizer.iterations.numpy()) == 2
    assert [(e.steps, e.sampling_rate, e.noise_multiplier, e.max_batch_size)
            for e in callback.ledger] == [(1, 4 / N, 1.0, 32), (1, 8 / N, 2.0, 32)]
    # Truncation at 32 for batches of 4 and 8 is so rare (< 1e-9 per step)
    # that epsilon is the untruncated Poisson one at a delta smaller by a
    # negligible slack: equal to 1e-4, never below it.
    untruncated = rdp.RdpAccountant().compose(dp_accounting.ComposedDpEvent([
        dp_accounting.PoissonSampledDpEvent(4 / N, dp_accounting.GaussianDpEvent(1.0)),
        dp_accounting.PoissonSampledDpEvent(8 / N, dp_accounting.GaussianDpEvent(2.0)),
    ])).get_epsilon(DELTA)
    assert untruncated <= callback.epsilon == pytest.approx(untruncated, rel=1e-4)


def test_a_non_private_or_unsupported_setup_fails_before_training(data):
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    plain.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="DPOptimizer"):
        fit(plain, data, 1, [PrivacyCallback(N, DELTA)])

    with pytest.warns(UserWarning, match="NOT differentially private"):
        silent = private_model(noise_multiplier=0.0)
    with pytest.raises(ValueError, match="not differentially private"):
        fit(silent, data, 1, [PrivacyCallback(N, DELTA)])
    assert int(silent.optimizer.iterations.numpy()) == 0

    batched = private_model(steps_per_execution=4)
    with pytest.raises(ValueError, match="steps_per_execution=1"):
        fit(batched, data, 1, [PrivacyCallback(N, DELTA, target_epsilon=1.0)])


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(num_examples=N, delta=0.0), r"delta must be in \(0, 1\)"),
        (dict(num_examples=N, delta=DELTA, target_epsilon=-1.0), "target_epsilon"),
        (dict(num_examples=N, delta=DELTA, sampling="fixed"), "sampling"),
        (dict(num_examples=N, delta=DELTA, log_every_steps=0), "log_every_steps"),
        (dict(num_examples=N), "needs delta"),
    ],
)
def test_bad_arguments_raise_at_construction(arguments, message):
    with pytest.raises(ValueError, match=message):
        PrivacyCallback(**arguments)


def test_delta_above_one_over_n_warns():
    with pytest.warns(UserWarning, match="larger than 1/N"):
        PrivacyCallback(100, 0.05)
