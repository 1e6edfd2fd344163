"""Specification of `keras.callbacks.BackupAndRestore` in a private `fit` (`tf_megadp.run.backup`).

Issue #27 ("Found"): a private run that crashed after its first backup
restored to step 8, trained one more logical step, then raised "The
optimizer's privacy ledger records 1 logical steps but 9 were applied": Keras
restored the backup after the ledger keeper had read the ledger, and a
sampler's dataset restarted at its first step. Each test here is that run,
crashed or killed, that now ends with the epsilon dp_accounting gives for the
steps it applied, and, for a Poisson sampler, with exactly the weights of
the uninterrupted run (seeded draws and noise: every noisy sum held the same
examples, none twice).

The kill loop runs `tests/preempted_run.py` in subprocesses, killed with
SIGKILL at random logical steps (and random moments after them) and started
again with the same command, under a hard timeout per child.
"""

import json
import pathlib
import signal
import subprocess
import sys
import threading
import time

import dp_accounting
import keras
import numpy as np
import pytest
from dp_accounting import rdp

import tf_megadp
from tests import preempted_run, reference
from tf_megadp import PrivacyConfigurationError

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
CHILD_TIMEOUT_S = 60

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*fixed-size batches, not Poisson draws"),
    pytest.mark.filterwarnings("ignore:Shuffled fixed-size batches"),
]


def dp_accounting_epsilon(steps, q=preempted_run.BATCH / preempted_run.N):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(preempted_run.SIGMA)),
        steps)
    return rdp.RdpAccountant().compose(event).get_epsilon(preempted_run.DELTA)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference runs, one per mode, never interrupted."""
    return {mode: preempted_run.train(mode, str(tmp_path_factory.mktemp(mode)))
            for mode in ("poisson", "arrays")}


def assert_same_weights(result, reference):
    for mine, theirs in zip(result["weights"], reference["weights"]):
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-7)


def assert_honest(result):
    """Epsilon is dp_accounting's on the logical steps the run applied."""
    assert sum(entry["steps"] for entry in result["ledger"]) == result["steps"]
    # Poisson steps are truncated at a capacity exceeded with probability
    # below 1e-9, which moves epsilon by far less than 1 %.
    assert result["epsilon"] == pytest.approx(dp_accounting_epsilon(result["steps"]), rel=1e-2)


def test_a_crashed_array_run_charges_no_step_twice(tmp_path, uninterrupted):
    # Issue 47: Keras restarts the epoch of the backup, so a backup taken
    # inside it held steps the restart took again (12 steps became 15 after
    # one crash; two kills turned 48 into 52). A backup due inside an epoch
    # of arrays is written at its end: the crash at step 5 (epoch 1 of 4
    # steps each) resumes from the backup at step 4, and the run ends with
    # the uninterrupted run's 12 steps and epsilon.
    with pytest.raises(preempted_run.Crash):
        preempted_run.train("arrays", str(tmp_path), crash_at=5)
    result = preempted_run.train("arrays", str(tmp_path))
    assert result["steps"] == uninterrupted["arrays"]["steps"] == 12
    assert result["epsilon"] == pytest.approx(uninterrupted["arrays"]["epsilon"], rel=1e-12)
    assert_honest(result)
    assert not (tmp_path / "backup").exists()  # Deleted at the end, as Keras does.


def _run_with_kills(mode, folder, kills, seed, outcome):
    """Starts the run, kills it `kills` times at random points, lets it finish.

    Stores (result, launches killed) in `outcome[mode]`, or the exception.
    """
    try:
        outcome[mode] = _kill_loop(mode, folder, kills, np.random.default_rng(seed))
    except BaseException as error:  # Raised again in the test's thread.
        outcome[mode] = error


def _kill_loop(mode, folder, kills, rng):
    command = [sys.executable, "-m", "tests.preempted_run", mode, str(folder)]
    killed, launches = [], 0
    while True:
        launches += 1
        with open(folder / f"stderr-{launches}.txt", "w") as stderr:
            child = subprocess.Popen(command, cwd=REPOSITORY, stdout=subprocess.PIPE,
                                     stderr=stderr, text=True)
            watchdog = threading.Timer(CHILD_TIMEOUT_S, child.kill)
            watchdog.start()
            try:
                if len(killed) < kills:
                    after = int(rng.integers(1, 4))
                    seen = 0
                    for line in child.stdout:
                        seen += line.startswith("step ")
                        if seen == after:
                            # Anywhere in the next logical step, or in its backup.
                            time.sleep(float(rng.uniform(0.0, 0.12)))
                            child.send_signal(signal.SIGKILL)
                            break
                child.communicate()
            finally:
                watchdog.cancel()
        if child.returncode == -signal.SIGKILL and len(killed) < kills:
            killed.append(launches)
            continue
        assert child.returncode == 0, (folder / f"stderr-{launches}.txt").read_text()[-3000:]
        return json.loads((folder / "result.json").read_text()), killed


POISSON_KILLS = 2


def test_runs_killed_at_random_points_end_as_if_never_interrupted(tmp_path, uninterrupted):
    # Both loops run at once, one child each: the CI machine has two cores.
    outcome, threads = {}, []
    # Two kills of the Poisson run: a resume that itself resumes (CI time,
    # issue 26; the job's three-kill test is `slow`, tests/test_pretraining.py).
    for mode, kills, seed in (("poisson", POISSON_KILLS, 0), ("arrays", 2, 1)):
        folder = tmp_path / mode
        folder.mkdir()
        threads.append(threading.Thread(target=_run_with_kills,
                                        args=(mode, folder, kills, seed, outcome)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in outcome.values():
        if isinstance(result, BaseException):
            raise result

    poisson, poisson_kills = outcome["poisson"]
    assert len(poisson_kills) == POISSON_KILLS
    assert poisson["steps"] == 8
    assert_honest(poisson)
    assert_same_weights(poisson, uninterrupted["poisson"])

    arrays, array_kills = outcome["arrays"]
    assert len(array_kills) == 2
    # A kill costs the progress of its epoch, never a step charged twice.
    assert arrays["steps"] == uninterrupted["arrays"]["steps"]
    assert_honest(arrays)


def _private_dense():
    keras.utils.set_random_seed(0)
    model = tf_megadp.make_private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    model.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.SGD(0.1), 1.0, 1.0, accumulation_steps=2, normalize_by=16, seed=1),
        loss="mse")
    return model


def test_a_backup_that_no_private_fit_wrote_is_refused_before_any_step(tmp_path):
    x, y = preempted_run.data()
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    plain.compile(optimizer="sgd", loss="mse")
    backup = tmp_path / "backup"
    plain.fit(x, y, epochs=1, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    model = _private_dense()
    with pytest.raises(PrivacyConfigurationError, match="not written by a private fit"):
        model.fit(x, y, batch_size=8, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert int(model.optimizer.iterations.numpy()) == 0


def test_a_run_restored_after_its_last_step_trains_nothing_and_reports(tmp_path):
    # Killed after the backup of its last step, before fit returned.
    x, y = preempted_run.data()
    sampler = tf_megadp.PoissonSampler.from_arrays(x, y, batch_size=16, epochs=0.5,
                                                   micro_batch_size=8, seed=0)
    model = _poisson_dense(sampler)
    model.fit(sampler.as_dataset(), verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=1,
                                         delete_checkpoint=False)])
    again = _poisson_dense(sampler)
    callback = tf_megadp.PrivacyCallback(preempted_run.DELTA, accountant="rdp")
    again.fit(tf_megadp.PoissonSampler.from_arrays(x, y, batch_size=16, epochs=0.5,
                                                   micro_batch_size=8, seed=0).as_dataset(),
              verbose=0, callbacks=[callback, keras.callbacks.BackupAndRestore(tmp_path / "backup")])
    assert int(again.optimizer.iterations.numpy()) == sampler.schedule.total_steps == 2
    assert callback.epsilon == pytest.approx(dp_accounting_epsilon(2), rel=1e-2)


def _poisson_dense(sampler):
    keras.utils.set_random_seed(0)
    model = tf_megadp.make_private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    model.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.SGD(0.1), 1.0, 1.0, schedule=sampler.schedule, seed=1), loss="mse")
    return model


def test_a_step_trained_again_after_an_in_process_crash_draws_new_noise(tmp_path):
    """Issue 37: fit with BackupAndRestore raises after step 2 and is called again.

    The backup is of step 1 (the end of epoch 0), so the second fit trains
    step 2 again from the same weights. Before, it drew its first run's
    noise bit for bit (the key outlived the restore). Every gradient is zero
    here, so the two updates differ by their noise alone.
    """
    clip, sigma = 0.5, 2.0
    x, y = reference.rollback_examples(2)
    model = tf_megadp.make_private(reference.rollback_model())
    model.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.SGD(1.0), l2_norm_clip=clip, noise_multiplier=sigma,
        normalize_by=len(x)), loss=reference.zero_loss)
    seen = {}

    class CrashAtStep2(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 2:
                seen.setdefault("first", reference.weights(self.model))
                raise preempted_run.Crash("preempted inside epoch 1, after logical step 2")

    class Step2(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 2:
                seen["second"] = reference.weights(self.model)

    backup = str(tmp_path / "backup")
    with pytest.raises(preempted_run.Crash):
        model.fit(x, y, batch_size=len(x), epochs=2, verbose=0, callbacks=[
            keras.callbacks.BackupAndRestore(backup, save_freq="epoch"), CrashAtStep2()])
    model.fit(x, y, batch_size=len(x), epochs=2, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(backup, save_freq="epoch"), Step2()])
    assert int(model.optimizer.iterations.numpy()) == 2
    reference.assert_replayed_noise_is_fresh(seen["first"], seen["second"],
                                             sigma * clip / len(x))
