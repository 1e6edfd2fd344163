"""A private model's `save`, `save_weights` and `load_weights`: atomic, and never without the ledger.

`tf_megadp.make_private` installs these wrappers on the model:

* `save` and `save_weights` write through a temporary file renamed into
  place (`atomic_save`), so a run killed while `ModelCheckpoint` (or the
  user) writes keeps the previous file whole; they record a custom loop's
  applied steps in the ledger first; and `save` refuses a model whose
  `compile` Keras would not replay on load (its DPOptimizer, and ledger,
  would be lost).
* `load_weights` builds the `DPOptimizer` first, so that the ledger in the
  file is loaded with the weights, and refuses a file with a ledger that
  the model's optimizer cannot take; weights without a ledger are noted as
  set from outside (`tf_megadp.run.weights_origin`).
"""

from __future__ import annotations

import functools
import os
import zipfile

import h5py
import keras

from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.files import atomic_write
from tf_megadp.optimizer import DPOptimizer
from tf_megadp.run import weights_origin
from tf_megadp.run.training_state import record_custom_loop

__all__ = ["atomic_save", "ledger_preserving_load", "ledger_preserving_save"]


def _saved_dp_optimizer_variables(path) -> int:
    """How many DPOptimizer variables a Keras weights or model file holds (0 if none)."""
    path = str(path)
    try:
        if path.endswith(".keras"):
            with zipfile.ZipFile(path) as archive, archive.open("model.weights.h5") as stream:
                with h5py.File(stream, "r") as handle:
                    return _dp_variable_count(handle)
        with h5py.File(path, "r") as handle:
            return _dp_variable_count(handle)
    except (OSError, KeyError, zipfile.BadZipFile):
        return 0  # Not a Keras weights file: Keras itself will say so.


def _dp_variable_count(handle) -> int:
    # A DPOptimizer saves its own variables and, as a child, its inner optimizer's.
    group = handle.get("optimizer")
    if group is None or "inner_optimizer" not in group:
        return 0
    return len(group.get("vars", {}))


def ledger_preserving_load(model: keras.Model, original_load):
    """`load_weights` for a private model: the optimizer's ledger is loaded with the weights.

    Args:
        model: the private model.
        original_load: its class's `load_weights`, bound to it.

    Returns:
        The wrapper, with `original_load`'s signature.
    """

    @functools.wraps(original_load)
    def load_weights(filepath, *args, **kwargs):
        saved = _saved_dp_optimizer_variables(filepath)
        optimizer = getattr(model, "optimizer", None)
        if saved and isinstance(optimizer, DPOptimizer) and not optimizer.built and model.built:
            # Keras skips the state of an unbuilt optimizer: build it, so
            # that the ledger in the file is loaded with the weights.
            optimizer.build(model.trainable_variables)
        if saved and not (isinstance(optimizer, DPOptimizer) and optimizer.built
                          and saved == len(optimizer.variables)):
            raise PrivacyConfigurationError(
                f"{filepath} holds a DPOptimizer's state, with the privacy ledger of "
                "the steps already taken, but this model is not compiled with a "
                "DPOptimizer of the same settings: Keras would load the weights and "
                "drop that ledger, and epsilon would be under-reported. Compile with "
                "the DPOptimizer first, then load_weights; or load the run with "
                "keras.models.load_model or tf_megadp.restore_training_state."
            )
        if not saved:  # Weights from outside a DP run: the ones they replace started it.
            weights_origin.note_starting_weights(model)
        loaded = original_load(filepath, *args, **kwargs)
        if saved:
            weights_origin.note_ledger_loaded(model)
        return loaded

    return load_weights


def atomic_save(original_save, model=None):
    """`save` / `save_weights` through a temporary file renamed into place.

    A run killed while `ModelCheckpoint` (or the user) writes a checkpoint
    keeps the previous file whole instead of a truncated one. Given the
    model, the steps a custom loop applied are recorded in its ledger first.
    """

    @functools.wraps(original_save)
    def save(filepath, *args, **kwargs):
        if model is not None:
            record_custom_loop(model)
        path = os.fspath(filepath)
        if "://" in path or kwargs.get("overwrite", True) is False:
            # Remote files have no atomic rename; overwrite=False asks first.
            return original_save(filepath, *args, **kwargs)
        kwargs["overwrite"] = True
        atomic_write(path, lambda temporary: original_save(temporary, *args, **kwargs))

    return save


def ledger_preserving_save(model: keras.Model, original_save):
    """`save` for a private model: atomic, and refused where loading would lose the ledger.

    Args:
        model: the private model.
        original_save: its class's `save`, bound to it.

    Returns:
        The wrapper, with `original_save`'s signature.
    """
    save_atomically = atomic_save(original_save, model)

    @functools.wraps(original_save)
    def save(filepath, *args, **kwargs):
        # Keras replays only its own compile on load (keras-hub tasks override it).
        compile_replayed = type(model).compile is keras.Model.compile
        if isinstance(getattr(model, "optimizer", None), DPOptimizer) and not compile_replayed:
            raise PrivacyConfigurationError(
                f"{type(model).__name__} overrides compile, so keras.models.load_model "
                "skips it and the DPOptimizer (its privacy ledger) would be lost on "
                "load. Use tf_megadp.save_training_state(model, directory) to resume a "
                "run and tf_megadp.export_model(model, path) to publish the model."
            )
        return save_atomically(filepath, *args, **kwargs)

    return save
