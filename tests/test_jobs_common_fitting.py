"""Specification of a job's fit (`tf_megadp.jobs.common.fitting`): where its train time goes.

A job's train time holds its evaluation and checkpoint cadence; report.json
splits it into the time in `fit` (the steps) and in each of the job's
callbacks, so that a DP run's train time can be set beside its twin's.
Every job divides its micro-steps into equal `fit` epochs, one evaluation
each, and warms its learning rate up linearly, then decays it by a cosine
to a tenth.
"""

import time

import keras
import numpy as np
import tensorflow as tf

from tf_megadp.jobs.common import fitting, run_folder


class SlowEvaluation(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        time.sleep(0.2)


class SlowLogs(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.01)


def test_the_train_time_is_split_between_fit_and_each_callback():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    rows = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    dataset = tf.data.Dataset.from_tensor_slices(rows).batch(2).repeat()
    evaluation, logs = SlowEvaluation(), SlowLogs()
    started = time.perf_counter()
    train_time = fitting.fit_run(model, dataset, strategy=None, several_workers=False,
                                 callbacks=[evaluation, logs], epochs=2, initial_epoch=0,
                                 steps_per_epoch=4, verbose=0)
    wall = time.perf_counter() - started
    assert train_time.total_s <= wall
    assert 2 * 0.2 <= train_time.callbacks_s["SlowEvaluation"] < 2 * 0.2 + 0.5
    assert 8 * 0.01 <= train_time.callbacks_s["SlowLogs"] < 8 * 0.01 + 0.5
    parts = train_time.report()
    assert parts["fit"] == round(train_time.total_s - sum(train_time.callbacks_s.values()), 3)
    assert parts["fit"] > 0
    line = run_folder.train_time_line({"train_time_s": train_time.total_s,
                                       "train_time_parts_s": parts})
    assert line.startswith(f"train {train_time.total_s:.1f} s: fit {parts['fit']:.1f} s, "
                           "the job's callbacks ")
    assert line.index("SlowEvaluation") < line.index("SlowLogs")  # the costliest first


def test_the_epochs_divide_the_micro_steps_equally_and_none_are_left_for_nothing():
    assert fitting.epochs_dividing(12, 5) == 4  # 4 epochs of 3, not 5 unequal ones
    assert fitting.epochs_dividing(7, 3) == 1
    assert fitting.epochs_dividing(6, 6) == 6
    assert fitting.epochs_dividing(0, 3) == 0  # a resumed run after its last step


def test_the_learning_rate_warms_up_then_decays_to_a_tenth():
    # 10 logical steps, 2 of warm-up; the non-private twin counts 3 micro-steps a step.
    for per_update in (1, 3):
        rate = fitting.warmup_cosine_learning_rate(1e-3, 2, 10, per_update)
        at = lambda step: float(rate(step * per_update))  # noqa: E731
        assert at(0) == 0.0 and np.isclose(at(1), 5e-4) and np.isclose(at(2), 1e-3)
        assert np.isclose(at(10), 1e-4)
