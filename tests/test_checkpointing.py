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
from tf_megadp import checkpointing
from tf_megadp.checkpointing import restore_training_state, save_training_state
from tf_megadp.optimizer_ledger import write_ledger
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
    real_write = checkpointing.atomic_write

    def killed_after_writing(path, write):
        real_write(path, write)
        raise Killed

    monkeypatch.setattr(checkpointing, "atomic_write", killed_after_writing)
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


# -- Checkpoints written before issue 29 keep their ledger ---------------------------
#
# Two older layouts of the DPOptimizer's saved variables: ledger rows of 5
# columns (before count_noise_multiplier), and the counters unaccounted_steps
# and noiseless_steps saved right after carried_steps (their steps are ledger
# entries now). Before, loading either raised a count or shape error, or (a
# tf.train.Checkpoint, which restores by name) dropped the counters' steps.

OLD_N = 64
LEDGER_AT = 2  # privacy_ledger's position among the optimizer's saved variables.


def _run_of_every_kind():
    """A model whose ledger is [noiseless 2, shuffle 2, unaccounted 2]: every kind."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(OLD_N, 3)).astype("float32")
    y = rng.normal(size=(OLD_N, 2)).astype("float32")
    schedule = tf_megadp.BatchSizeSchedule(
        [tf_megadp.Phase(2, 16, 2), tf_megadp.Phase(4, 16, 2, noise_multiplier=1.0)],
        num_examples=OLD_N, micro_batch_size=8)
    keras.utils.set_random_seed(0)
    model = tf_megadp.make_private(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.compile(optimizer=tf_megadp.DPOptimizer(
            keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=0.0,
            schedule=schedule, seed=3), loss="mse")
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        # Data of unknown size and no PrivacyCallback: unaccounted steps.
        model.fit(tf.data.Dataset.from_tensor_slices((x[:32], y[:32])).batch(8), verbose=0)
    ledger = tf_megadp.read_ledger(model.optimizer)
    assert [(e.sampling, e.steps) for e in ledger] == [
        ("noiseless", 2), ("shuffle", 2), ("unaccounted", 2)]
    return model, ledger


def _old_layout(values, five_columns, counters):
    """The optimizer's saved variables (a list by position) as an earlier release saved them.

    The steps-only entries leave the ledger rows for the counters, and/or the
    rows (and the applied-step buffer) lose their last column.
    """
    values = [np.asarray(value) for value in values]
    rows = int(values[LEDGER_AT + 1])
    table = values[LEDGER_AT][:rows]
    kinds = {code: name for name, code in (("noiseless", -1), ("unaccounted", -2))}
    counts = {name: int(table[table[:, 4] == code, 0].sum()) for code, name in kinds.items()}
    if counters:
        kept = table[table[:, 4] >= 0]
        full = np.zeros_like(values[LEDGER_AT])
        full[: len(kept)] = kept
        values[LEDGER_AT], values[LEDGER_AT + 1] = full, np.int64(len(kept))
        values[LEDGER_AT + 3: LEDGER_AT + 3] = [np.int64(counts["unaccounted"]),
                                                np.int64(counts["noiseless"])]
    if five_columns:
        applied = LEDGER_AT + 3 + (2 if counters else 0)
        assert not values[LEDGER_AT][:, 5].any() and not values[applied][:, 5].any()
        values[LEDGER_AT], values[applied] = values[LEDGER_AT][:, :5], values[applied][:, :5]
    return values


def _rewrite_weights_file(path, five_columns, counters):
    with h5py.File(path, "r+") as handle:
        group = handle["optimizer"]["vars"]
        values = [group[str(i)][()] for i in range(len(group))]
        for key in list(group):
            del group[key]
        for index, value in enumerate(_old_layout(values, five_columns, counters)):
            group.create_dataset(str(index), data=value)


def _rewrite_keras_file(path, five_columns, counters):
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    weights = path.parent / "model.weights.h5"
    weights.write_bytes(members["model.weights.h5"])
    _rewrite_weights_file(weights, five_columns, counters)
    members["model.weights.h5"] = weights.read_bytes()
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def _same_entries(ledger, expected):
    # Migrated steps-only entries follow the rows; the ledger's order does not
    # change epsilon (composition commutes), so compare entries as a multiset.
    return sorted(map(repr, ledger)) == sorted(map(repr, expected))


LAYOUTS = [(True, False), (False, True), (True, True)]  # (five columns, counters)


@pytest.mark.parametrize("five_columns, counters", LAYOUTS)
@pytest.mark.parametrize("suffix", [".keras", ".weights.h5"])
def test_a_file_of_an_earlier_layout_loads_with_its_whole_ledger(
        tmp_path, suffix, five_columns, counters):
    model, ledger = _run_of_every_kind()
    path = tmp_path / f"run{suffix}"
    if suffix == ".keras":
        model.save(path)
        _rewrite_keras_file(path, five_columns, counters)
        loaded = keras.models.load_model(path)
    else:
        model.save_weights(path)
        _rewrite_weights_file(path, five_columns, counters)
        keras.utils.set_random_seed(0)
        loaded = tf_megadp.make_private(
            keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded.compile(optimizer=tf_megadp.DPOptimizer.from_config(
                model.optimizer.get_config()), loss="mse")
        loaded.load_weights(path)
    optimizer = loaded.optimizer
    assert _same_entries(tf_megadp.read_ledger(optimizer), ledger)
    assert optimizer.logical_steps_recorded == optimizer.logical_steps_applied == 6
    # As before the change: the unaccounted steps make every epsilon refuse.
    with pytest.raises(tf_megadp.PrivacyConfigurationError, match="2 logical steps.*cannot be"):
        tf_megadp.model_ledger(loaded)


@pytest.mark.parametrize("five_columns, counters", LAYOUTS)
def test_a_training_state_of_an_earlier_layout_restores_with_its_whole_ledger(
        tmp_path, five_columns, counters):
    model, ledger = _run_of_every_kind()
    directory = tmp_path / "ckpt"
    save_training_state(model, str(directory))
    (path,) = directory.glob("optimizer-*.npz")
    with np.load(path) as saved:
        values = [saved[f"v{i:05d}"] for i in range(len(saved.files))]
    old = _old_layout(values, five_columns, counters)
    with open(path, "wb") as handle:
        np.savez(handle, **{f"v{i:05d}": value for i, value in enumerate(old)})
    resumed = tf_megadp.make_private(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        restore_training_state(resumed, str(directory), {"loss": "mse"})
    assert _same_entries(tf_megadp.read_ledger(resumed.optimizer), ledger)
    assert resumed.optimizer.logical_steps_recorded == 6


def test_a_tf_checkpoint_of_an_earlier_release_keeps_its_counters_steps(tmp_path):
    # A tf.train.Checkpoint restores by name: the counters, which no variable
    # has now, were skipped, and their steps left the ledger silently.
    model, ledger = _run_of_every_kind()
    optimizer = model.optimizer
    old_ledger = tf_megadp.accounting.PrivacyLedger(
        [entry for entry in ledger if entry.sampling == "shuffle"])
    write_ledger(optimizer, old_ledger)
    counters = {"unaccounted_steps": tf.Variable(np.int64(2)),
                "noiseless_steps": tf.Variable(np.int64(2))}
    old = tf.train.Checkpoint(model=model, optimizer=tf.train.Checkpoint(
        privacy_ledger=optimizer.privacy_ledger,
        privacy_ledger_rows=optimizer.privacy_ledger_rows, **counters))
    path = old.write(str(tmp_path / "old"))
    step = tf_megadp.PrivateStep(model, optimizer, loss="mse")
    step.checkpoint().read(path)
    assert _same_entries(tf_megadp.read_ledger(optimizer), ledger)


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
