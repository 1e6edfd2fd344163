"""Specification of `save_training_state` / `restore_training_state`."""

import json
import re
import warnings
import zipfile

import dp_accounting
import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf
from dp_accounting import rdp

import tf_megadp
from tf_megadp import PrivacyConfigurationError
from tf_megadp.accounting import LEDGER_COLUMNS
from tf_megadp.run import training_state
from tf_megadp.run.training_state import restore_training_state, save_training_state
from tests import reference


def private_model(seed=0):
    keras.utils.set_random_seed(seed)
    model = tf_megadp.make_private(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    model.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.Adam(0.1), l2_norm_clip=1.0, noise_multiplier=1.0,
        accumulation_steps=2, seed=3), loss="mse")
    return model


def test_round_trip_at_a_step_boundary_continues_the_same_run(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    straight = private_model()
    straight.fit(x, y, batch_size=4, shuffle=False, verbose=0)

    first = private_model()
    first.fit(x[:8], y[:8], batch_size=4, shuffle=False, verbose=0)
    save_training_state(first, str(tmp_path / "ckpt"), extra={"note": "boundary"})
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert re.fullmatch(r"model-00000001-[0-9a-f]{8}\.weights\.h5", names[0]), names
    assert re.fullmatch(r"optimizer-00000001-[0-9a-f]{8}\.npz", names[1]), names
    assert names[2] == "training_state.json"

    resumed = tf_megadp.make_private(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    extra = restore_training_state(resumed, str(tmp_path / "ckpt"), {"loss": "mse"})
    assert extra == {"note": "boundary"}
    assert int(resumed.optimizer.iterations.numpy()) == 1
    assert tf_megadp.read_ledger(resumed.optimizer).total_steps == 1
    resumed.fit(x[8:], y[8:], batch_size=4, shuffle=False, verbose=0)
    assert int(resumed.optimizer.iterations.numpy()) == 2
    # Each fit measures its own data: 8 rows per step of 8 examples, q = 1.
    assert [(e.steps, e.sampling_rate) for e in tf_megadp.read_ledger(resumed.optimizer)] == [
        (2, 1.0)]
    # seed=3 makes the noise of step 2 the same in both runs (tests only).
    for a, b in zip(reference.weights(resumed), reference.weights(straight)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_mid_step_checkpoint_resumes_at_the_step_boundary(tmp_path):
    model = private_model()
    x = np.ones((8, 3), "float32")
    y = np.ones((8, 2), "float32")
    model.fit(x[:4], y[:4], batch_size=4, verbose=0)  # Half a logical step, then discarded.
    save_training_state(model, str(tmp_path / "ckpt"))
    resumed = tf_megadp.make_private(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    restore_training_state(resumed, str(tmp_path / "ckpt"), {"loss": "mse"})
    assert int(resumed.optimizer.iterations.numpy()) == 0
    assert int(resumed.optimizer.micro_steps.numpy()) == 0


def test_missing_checkpoint_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="No checkpoint"):
        restore_training_state(private_model(), str(tmp_path), {"loss": "mse"})


def test_checkpoint_from_another_model_is_refused(tmp_path):
    save_training_state(private_model(), str(tmp_path))
    other = tf_megadp.make_private(
        keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(2)]))
    with pytest.raises(ValueError):
        restore_training_state(other, str(tmp_path), {"loss": "mse"})


class Killed(BaseException):
    """A process killed in the middle of a save."""


def test_a_save_killed_after_its_first_file_leaves_the_previous_checkpoint_whole(
        tmp_path, monkeypatch):
    # Before, the weights, optimizer and index files had fixed names, each
    # renamed into place on its own: a kill after the first rename left the
    # new weights with the old optimizer (and ledger), one noisy update
    # unaccounted.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    model = private_model()
    model.fit(x[:8], y[:8], batch_size=4, shuffle=False, verbose=0)
    save_training_state(model, str(tmp_path / "ckpt"))
    saved = reference.weights(model)
    model.fit(x[8:], y[8:], batch_size=4, shuffle=False, verbose=0)
    real_write = training_state.atomic_write

    def killed_after_writing(path, write):
        real_write(path, write)
        raise Killed

    monkeypatch.setattr(training_state, "atomic_write", killed_after_writing)
    with pytest.raises(Killed):
        save_training_state(model, str(tmp_path / "ckpt"))
    monkeypatch.undo()

    resumed = tf_megadp.make_private(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    restore_training_state(resumed, str(tmp_path / "ckpt"), {"loss": "mse"})
    assert int(resumed.optimizer.iterations.numpy()) == 1
    assert tf_megadp.read_ledger(resumed.optimizer).total_steps == 1
    for a, b in zip(reference.weights(resumed), saved):
        np.testing.assert_array_equal(a, b)


# -- A file of another layout is refused, never loaded in part -------------------


@pytest.mark.parametrize("suffix", [".keras", ".weights.h5"])
def test_a_file_whose_ledger_has_another_shape_is_refused(tmp_path, suffix):
    # Ledger rows of another width (no tf_megadp release wrote them): loading
    # them in part would lose the ledger's steps, so the load refuses.
    model = private_model()
    model.optimizer.build(model.trainable_variables)
    path = tmp_path / f"run{suffix}"
    model.save(path) if suffix == ".keras" else model.save_weights(path)
    if suffix == ".keras":
        with zipfile.ZipFile(path) as archive:
            members = {name: archive.read(name) for name in archive.namelist()}
        weights = tmp_path / "model.weights.h5"
        weights.write_bytes(members["model.weights.h5"])
    else:
        weights = path
    with h5py.File(weights, "r+") as handle:
        group = handle["optimizer"]["vars"]
        width = len(LEDGER_COLUMNS)
        at = next(key for key in group if group[key].shape[1:] == (width,))
        narrow = group[at][()][:, :width - 1]
        del group[at]
        group.create_dataset(at, data=narrow)
    if suffix == ".keras":
        members["model.weights.h5"] = weights.read_bytes()
        with zipfile.ZipFile(path, "w") as archive:
            for name, data in members.items():
                archive.writestr(name, data)
        # Keras collects loading errors into one ValueError that quotes ours.
        with pytest.raises(ValueError, match=f"has shape .*{width - 1}.* cannot be loaded whole"):
            keras.models.load_model(path)
    else:
        fresh = private_model()
        with pytest.raises(ValueError, match=f"has shape .*{width - 1}.* cannot be loaded whole"):
            fresh.load_weights(path)


# -- A release's weights continue only with its ledger ------------------------------


def _continuation_data():
    rng = np.random.default_rng(4)
    return (rng.normal(size=(64, 3)).astype("float32"),
            rng.normal(size=(64, 2)).astype("float32"))


def _fit(model, x, y):
    privacy = tf_megadp.PrivacyCallback(delta=1e-3, accountant="rdp")
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[privacy])
    return privacy


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """16 logical steps (64 rows, 2 micro-batches of 2 a step), exported with their report."""
    folder = tmp_path_factory.mktemp("release")
    x, y = _continuation_data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = private_model()
        privacy = _fit(run, x, y)
        tf_megadp.export_model(run, folder / "release.keras")
        privacy.save_report(folder / "release.privacy.json")
    assert privacy.ledger.total_steps == 16
    return run, folder


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_weights_of_a_release_set_into_a_fresh_private_model_need_its_ledger(release):
    # Before (issue 37): set_weights of the 16-step release into a fresh
    # private model, 2 more steps on the same data: the report said 2 of 18.
    run, folder = release
    x, y = _continuation_data()
    fresh = private_model(seed=1)
    fresh.set_weights(run.get_weights())
    with pytest.raises(PrivacyConfigurationError, match="continue_from_release"):
        _fit(fresh, x[:8], y[:8])
    assert int(fresh.optimizer.iterations.numpy()) == 0  # refused before any step
    # Loaded from the export file in this process: refused too.
    loaded = tf_megadp.make_private(keras.models.load_model(folder / "release.keras"))
    loaded.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.Adam(0.1), 1.0, 1.0, accumulation_steps=2, seed=3), loss="mse")
    with pytest.raises(PrivacyConfigurationError, match="continue_from_release"):
        _fit(loaded, x[:8], y[:8])
    # The report of other weights does not describe these.
    other = json.loads((folder / "release.privacy.json").read_text())
    other["weights_fingerprint"] = "0" * 32
    (folder / "other.privacy.json").write_text(json.dumps(other))
    with pytest.raises(PrivacyConfigurationError, match="report of other weights"):
        tf_megadp.continue_from_release(fresh, folder / "other.privacy.json")
    with pytest.raises(PrivacyConfigurationError, match="not public weights"):
        tf_megadp.declare_public_weights(fresh, source="a release, mislabelled")

    # With the release's report, epsilon composes its 16 steps and these 2.
    taken = tf_megadp.continue_from_release(fresh, folder / "release.privacy.json")
    assert taken.total_steps == 16
    privacy = _fit(fresh, x[:8], y[:8])
    assert privacy.ledger.total_steps == tf_megadp.model_ledger(fresh).total_steps == 18
    report = privacy.report()
    assert report["steps"] == 18
    assert report["initial_weights"]["origin"] == "release"
    # Against dp_accounting: 16 steps of q = 4 / 64, then 2 of q = 4 / 8 (sigma 1).
    composed = dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.GaussianDpEvent(1.0)), steps) for q, steps in ((4 / 64, 16),
                                                                            (4 / 8, 2))])
    assert privacy.epsilon == pytest.approx(
        rdp.RdpAccountant().compose(composed).get_epsilon(1e-3), rel=1e-9)
    # A ledger that counts steps takes no declaration.
    with pytest.raises(PrivacyConfigurationError, match="already carry a privacy ledger"):
        tf_megadp.continue_from_release(fresh, folder / "release.privacy.json")


def lora_model(seed=0):
    keras.utils.set_random_seed(seed)
    dense = keras.layers.Dense(2)
    model = tf_megadp.make_private(keras.Sequential([keras.Input((3,)), dense]))
    dense.enable_lora(1)
    model.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.Adam(0.1), l2_norm_clip=1.0, noise_multiplier=1.0,
        accumulation_steps=2, seed=3), loss="mse")
    return model


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_lora_release_continues_from_its_file(tmp_path):
    # Keras writes a LoRA layer as its merged kernel W + s A B (no factors):
    # the report's fingerprint must be the file's, or the release of a LoRA
    # run could never be continued (issue 40). Enabling LoRA (B = 0) on
    # loaded weights keeps their fingerprint, so a LoRA continuation of a
    # release composes its ledger too.
    x, y = _continuation_data()
    run = lora_model()
    privacy = _fit(run, x[:8], y[:8])
    tf_megadp.export_model(run, tmp_path / "lora.keras")
    privacy.save_report(tmp_path / "lora.privacy.json")
    # The file holds W + s A B as the kernel; Keras enables LoRA again on
    # load (the layer's config names the rank), with fresh factors B = 0.
    loaded = tf_megadp.make_private(keras.models.load_model(tmp_path / "lora.keras"))
    merged = keras.ops.convert_to_numpy(loaded.layers[0].kernel)
    bias = keras.ops.convert_to_numpy(loaded.layers[0].bias)
    np.testing.assert_allclose(merged, keras.ops.convert_to_numpy(run.layers[0].kernel))
    assert not np.any(keras.ops.convert_to_numpy(loaded.layers[0].lora_kernel_b))
    loaded.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.Adam(0.1), 1.0, 1.0, accumulation_steps=2, seed=3), loss="mse")
    tf_megadp.continue_from_release(loaded, tmp_path / "lora.privacy.json")
    assert _fit(loaded, x[:8], y[:8]).ledger.total_steps == 4

    # Set into a model without LoRA, the same values are the same release.
    plain = private_model(seed=1)
    plain.set_weights([merged, bias])
    assert tf_megadp.continue_from_release(plain, tmp_path / "lora.privacy.json").total_steps == 2


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_export_the_steps_left_as_it_started_is_no_release(tmp_path):
    # Before: a run at learning rate 0 exported its initial weights; every
    # later model of the same seed in the process was refused as holding
    # that "release" (the job's tests met it across two unrelated runs).
    x, y = _continuation_data()

    def frozen_run():
        keras.utils.set_random_seed(7)
        model = tf_megadp.make_private(
            keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
        model.compile(optimizer=tf_megadp.DPOptimizer(
            keras.optimizers.SGD(0.0), 1.0, 1.0, accumulation_steps=2, seed=3), loss="mse")
        return model

    first = frozen_run()
    _fit(first, x[:8], y[:8])
    tf_megadp.export_model(first, tmp_path / "unchanged.keras")
    privacy = _fit(frozen_run(), x[:8], y[:8])
    assert privacy.ledger.total_steps == 2 and privacy.report()["initial_weights"] is None


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_weights_set_from_outside_are_declared_public_and_initial_ones_need_nothing(tmp_path):
    x, y = _continuation_data()
    public = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    public.save_weights(tmp_path / "public.weights.h5")
    model = private_model(seed=1)
    model.load_weights(tmp_path / "public.weights.h5")  # a file without a ledger
    with pytest.raises(PrivacyConfigurationError, match="declare_public_weights"):
        _fit(model, x[:8], y[:8])
    tf_megadp.declare_public_weights(model, source="public.weights.h5, trained on public data")
    privacy = _fit(model, x[:8], y[:8])
    assert privacy.ledger.total_steps == 2
    assert privacy.report()["initial_weights"]["source"].startswith("public.weights.h5")
    # Weights loaded before make_private need no declaration (nor does a
    # model's own initialisation: every other test).
    keras.utils.set_random_seed(5)
    before = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    before.load_weights(tmp_path / "public.weights.h5")
    tf_megadp.make_private(before)
    before.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.Adam(0.1), 1.0, 1.0, accumulation_steps=2, seed=3), loss="mse")
    privacy = _fit(before, x[:8], y[:8])
    assert privacy.ledger.total_steps == 2 and privacy.report()["initial_weights"] is None
