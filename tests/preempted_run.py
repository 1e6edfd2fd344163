"""A tiny private run with `keras.callbacks.BackupAndRestore`, to be killed and restarted.

`python -m tests.preempted_run MODE FOLDER` trains a Dense model privately,
backing up at every logical step into FOLDER/backup, printing `step T` when
logical step T ends, and writes FOLDER/result.json when the run completes.
Started again after a SIGKILL, the same command continues the run from its
backup. MODE is `poisson` (a seeded Poisson sampler's dataset, fit in epochs
that do not line up with the logical steps) or `arrays` (fixed-size batches
of arrays). Noise and draws are seeded, so an uninterrupted run
(`train(MODE, folder)` in the test process) is the reference: a resumed run
that put the same examples in every noisy sum ends with the same weights.
"""

import json
import os
import sys
import time
import warnings

N = 64
MICRO_BATCH = 8
BATCH = 16
DELTA = 1e-5
SIGMA = 1.0
POISSON_EPOCHS = 2  # of the data: 8 logical steps of 5 micro-batches each
FIT_EPOCHS = 5  # Keras epochs of 8 micro-batches: they end inside logical steps
ARRAY_EPOCHS = 3  # 4 logical steps of 2 micro-batches per epoch
# The cheapest strategy to trace: each start of the run traces the private step.
CLIPPING = "vectorized"


def data():
    import numpy as np

    rng = np.random.default_rng(0)
    return (rng.normal(size=(N, 4)).astype("float32"),
            rng.normal(size=(N, 2)).astype("float32"))


class Crash(RuntimeError):
    """The in-process stand-in for a preemption."""


def train(mode: str, folder: str, *, pause: float = 0.0, announce: bool = False,
          crash_at: int | None = None) -> dict:
    """Runs (or continues, from `folder`'s backup) the run; returns what it ended with.

    Args:
        mode: "poisson" or "arrays".
        folder: holds the run's backup.
        pause: seconds to sleep after each micro-batch.
        announce: print `step T` when logical step T ends.
        crash_at: raise `Crash` once logical step `crash_at` ended and was backed up.
    """
    import keras
    import numpy as np

    import tf_megadp

    x, y = data()
    keras.utils.set_random_seed(0)
    model = tf_megadp.make_private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    backup = keras.callbacks.BackupAndRestore(os.path.join(folder, "backup"), save_freq=1)

    class Progress(keras.callbacks.Callback):
        """Prints each logical step's end and stretches the run so kills land inside it."""

        def on_train_batch_end(self, batch, logs=None):
            if announce and int(self.model.optimizer.micro_steps.numpy()) == 0:
                print(f"step {int(self.model.optimizer.iterations.numpy())}", flush=True)
            time.sleep(pause)

    class CrashAfterBackup(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == crash_at:
                raise Crash(f"preempted after logical step {crash_at}")

    callbacks = [Progress(), backup]
    if crash_at is not None:
        callbacks.append(CrashAfterBackup())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "poisson":
            sampler = tf_megadp.PoissonSampler.from_arrays(
                x, y, batch_size=BATCH, epochs=POISSON_EPOCHS, micro_batch_size=MICRO_BATCH,
                seed=3)
            optimizer = tf_megadp.DPOptimizer(
                keras.optimizers.SGD(0.1, momentum=0.5), l2_norm_clip=1.0,
                noise_multiplier=SIGMA, schedule=sampler.schedule, seed=1, clipping=CLIPPING)
            model.compile(optimizer=optimizer, loss="mse")
            model.fit(sampler.as_dataset(), epochs=FIT_EPOCHS,
                      steps_per_epoch=sampler.total_micro_steps // FIT_EPOCHS,
                      callbacks=callbacks, verbose=0)
        else:
            optimizer = tf_megadp.DPOptimizer(
                keras.optimizers.SGD(0.1, momentum=0.5), l2_norm_clip=1.0,
                noise_multiplier=SIGMA, accumulation_steps=BATCH // MICRO_BATCH,
                normalize_by=BATCH, seed=1, clipping=CLIPPING)
            model.compile(optimizer=optimizer, loss="mse")
            model.fit(x, y, batch_size=MICRO_BATCH, epochs=ARRAY_EPOCHS, shuffle=False,
                      callbacks=callbacks, verbose=0)
    # Once, at the end (a PrivacyCallback would compute it at every epoch):
    # the ledger of every step applied to the weights, or a refusal.
    ledger = tf_megadp.model_ledger(model)
    return {
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
        "epsilon": tf_megadp.PrivacyAccountant(N, DELTA, accountant="rdp", ledger=ledger).epsilon(),
        "steps": int(model.optimizer.iterations.numpy()),
        "ledger": ledger.to_list(),
    }


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    run_mode, run_folder = sys.argv[1], sys.argv[2]
    result = train(run_mode, run_folder, pause=0.02, announce=True)
    with open(os.path.join(run_folder, "result.json"), "w", encoding="utf-8") as stream:
        json.dump(result, stream)
