"""Specification of `save_training_state` / `restore_training_state`."""

import re
import zipfile

import h5py
import keras
import numpy as np
import pytest

import tf_megadp
from tf_megadp.accounting import LedgerEntry, PrivacyLedger
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
    # A ledger variable of another size (no tf_megadp release wrote it): loading
    # it in part would lose the ledger's steps, so the load refuses.
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
        width = model.optimizer.ledger_stage.privacy_ledger.shape[0]
        at = next(key for key in group if group[key].shape == (width,))
        narrow = group[at][()][:width - 1]
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


def _cells(text, count):
    """`text` as the ledger variable stores it: UTF-8, 6 bytes to a float64 cell, big-endian."""
    data = text.encode() + bytes(6 * count - len(text.encode()))
    return np.array([int.from_bytes(data[i:i + 6], "big") for i in range(0, len(data), 6)],
                    np.float64)


def test_a_file_whose_ledger_holds_a_foreign_noise_record_is_refused_by_name(tmp_path):
    """A ledger entry whose noise no registered mechanism reads back is never loaded."""
    model = private_model()
    model.optimizer.build(model.trainable_variables)
    path = tmp_path / "run.weights.h5"
    model.save_weights(path)
    honest = PrivacyLedger([LedgerEntry(3, 0.1, 1.0)]).to_json()
    foreign = honest.replace('\\"independent\\"', '\\"laplace\\"')
    assert "laplace" in foreign and len(foreign) == len(honest) - 4
    width = model.optimizer.ledger_stage.privacy_ledger.shape[0]
    with h5py.File(path, "r+") as handle:
        group = handle["optimizer"]["vars"]
        at = next(key for key in group if group[key].shape == (width,))
        group[at][...] = _cells(foreign, width)
        # The ledger's length is the variable declared right after it.
        group[str(int(at) + 1)][()] = len(foreign.encode())
    fresh = private_model()
    fresh.optimizer.build(fresh.trainable_variables)
    with pytest.raises(ValueError, match="privacy_ledger variable holds no ledger.*"
                                         "names no registered noise"):
        fresh.load_weights(path)
    # Control: the honest ledger, written the same way, loads.
    with h5py.File(path, "r+") as handle:
        group = handle["optimizer"]["vars"]
        group[at][...] = _cells(honest, width)
        group[str(int(at) + 1)][()] = len(honest.encode())
    fresh.load_weights(path)
    assert tf_megadp.read_ledger(fresh.optimizer).total_steps == 3
