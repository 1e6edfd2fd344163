"""Training checkpoints that keep the DP state: `save_training_state`, `restore_training_state`.

Which files of a run may be published:

* `export_model(model, path)` (`tf_megadp.run.export`) writes the model
  alone (architecture and weights, no optimizer, no compile settings): the
  file to release.
* A training checkpoint (`save_training_state`, `model.save`,
  `ModelCheckpoint`) holds the optimizer state as well: the inner
  optimizer's moments are functions of the noisy updates, like the weights,
  but keep such files like the training data unless you need to publish
  them. None of them holds the noise key or a mid-step (un-noised) sum: the
  `DPOptimizer` keeps those in memory only, so a restored run resumes at a
  logical-step boundary with fresh noise.

`model.save` / `keras.models.load_model` restore a `DPOptimizer` (its
inner optimizer, logical-step counter and privacy ledger) for models whose
`compile` Keras can replay. keras-hub tasks such as `BertMaskedLM` override
`compile`, so Keras skips it on load and the optimizer state is lost.
`save_training_state` / `restore_training_state` keep that state in files of
their own: the model weights and the optimizer's saved variables, under names
no earlier checkpoint used, each written to a temporary file and renamed into
place, then a small JSON index that names them, with the optimizer's config,
written last in the same way. Renaming the index is the one step that
commits a checkpoint: a run killed at any moment (SIGKILL) leaves the
previous checkpoint whole, never weights of one step with the ledger of
another.
"""

from __future__ import annotations

import json
import os
import secrets
from typing import Any

import numpy as np

from tf_megadp.files import atomic_write, write_json_atomically

__all__ = ["has_training_state", "record_custom_loop", "restore_training_state",
           "save_training_state", "training_state_extra"]

# Keras (so TensorFlow) and the optimizer are imported by the functions that
# save or load a model, not here: `has_training_state` and
# `training_state_extra` read the index alone, so that `tf-megadp pretrain
# --resume` checks a run's saved settings before TensorFlow loads.

_INDEX = "training_state.json"
_WEIGHTS = "model-{tag}.weights.h5"
_OPTIMIZER = "optimizer-{tag}.npz"


def save_training_state(model: keras.Model, directory: str, extra: dict[str, Any] | None = None) -> None:
    """Writes model weights, optimizer variables and optimizer config, committed atomically.

    Args:
        model: a compiled, built model.
        directory: the checkpoint folder (created if missing). The files of
            the checkpoint it held before are removed once this one is
            committed.
        extra: JSON-serializable data stored in the index (e.g. run state).

    Example:
    ```python
    tf_megadp.save_training_state(model, "run/checkpoint", extra={"epoch": 3})
    ```
    """
    import keras

    os.makedirs(directory, exist_ok=True)
    record_custom_loop(model)
    optimizer = model.optimizer
    # A name no earlier checkpoint used: the committed files are never
    # overwritten, so a kill mid-save leaves them whole.
    tag = f"{int(keras.ops.convert_to_numpy(optimizer.iterations)):08d}-{secrets.token_hex(4)}"
    files = {"weights": _WEIGHTS.format(tag=tag), "optimizer_variables": _OPTIMIZER.format(tag=tag)}
    atomic_write(os.path.join(directory, files["weights"]), type(model).save_weights.__get__(model))
    # The optimizer's own choice of what is saved: a DPOptimizer leaves out
    # its noise key and mid-step accumulators.
    store: dict[str, Any] = {}
    optimizer.save_own_variables(store)
    values = {f"v{int(key):05d}": np.asarray(value) for key, value in store.items()}

    def write_variables(path):
        with open(path, "wb") as handle:
            np.savez(handle, **values)

    atomic_write(os.path.join(directory, files["optimizer_variables"]), write_variables)
    index = {
        "optimizer": keras.saving.serialize_keras_object(optimizer),
        "variable_paths": [v.path for v in optimizer.variables],
        "files": files,
        "extra": extra or {},
    }
    write_json_atomically(os.path.join(directory, _INDEX), index, default=str)
    # Files of earlier checkpoints, and temporary files a killed save left.
    for name in os.listdir(directory):
        base = name.split("-", 2)[-1] if name.startswith(".tmp-") else name
        ours = ((base.startswith("model-") and base.endswith(".weights.h5"))
                or (base.startswith("optimizer-") and base.endswith(".npz")))
        if ours and name not in files.values():
            os.remove(os.path.join(directory, name))


def record_custom_loop(model: keras.Model) -> None:
    """Records the steps a custom loop's `tf_megadp.PrivateStep` applied, before a save.

    The compiled step leaves each noisy update in the optimizer's buffer of
    applied steps; the ledger entry (with N and the sampling) is written in
    Python. A file saved in between would hold steps that a restored run
    can only count as unaccounted.
    """
    step = getattr(model, "_tf_megadp_step", None)
    # A release export detaches the optimizer: it saves no ledger.
    if step is not None and getattr(model, "optimizer", None) is step.optimizer:
        step.record()


def restore_training_state(model: keras.Model, directory: str, compile_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Restores what `save_training_state` wrote into a freshly built `model`.

    The optimizer is rebuilt from its saved config, `model.compile(optimizer,
    **compile_kwargs)` is called, and every optimizer variable is restored.

    Args:
        model: the same architecture, freshly built.
        directory: the checkpoint folder.
        compile_kwargs: loss, metrics etc. for `model.compile`.

    Returns:
        The `extra` dict saved with the checkpoint.

    Raises:
        FileNotFoundError: no complete checkpoint in `directory`.
        ValueError: the optimizer variables do not match.
    """
    import keras

    # The classes the saved optimizer config names, registered with Keras on import.
    from tf_megadp import learning_rate, optimizer as _optimizer  # noqa: F401

    index_path = os.path.join(directory, _INDEX)
    if not os.path.exists(index_path):
        raise FileNotFoundError(f"No checkpoint ({_INDEX}) in {directory}.")
    with open(index_path, encoding="utf-8") as handle:
        index = json.load(handle)
    files = index["files"]
    optimizer = keras.saving.deserialize_keras_object(index["optimizer"])
    model.compile(optimizer=optimizer, **compile_kwargs)
    # Built before the weights are loaded, so that a private model's guard
    # (and Keras) see an optimizer that can take the saved state.
    optimizer.build(model.trainable_variables)
    model.load_weights(os.path.join(directory, files["weights"]))
    with np.load(os.path.join(directory, files["optimizer_variables"])) as saved:
        values = [saved[f"v{i:05d}"] for i in range(len(saved.files))]
    expected: dict[str, Any] = {}
    optimizer.save_own_variables(expected)
    if len(values) != len(expected):
        raise ValueError(
            f"The checkpoint holds {len(values)} optimizer variables but the rebuilt "
            f"optimizer has {len(expected)}: it was saved from another model."
        )
    for index_, (current, value) in enumerate(zip(expected.values(), values)):
        if np.shape(current) != value.shape:
            raise ValueError(
                f"Optimizer variable {index_} has shape {np.shape(current)} but the "
                f"checkpoint has {value.shape}: it was saved from another model."
            )
    optimizer.load_own_variables({str(i): value for i, value in enumerate(values)})
    return index["extra"]


def has_training_state(directory: str) -> bool:
    """Whether `directory` holds a committed `save_training_state` checkpoint."""
    return os.path.exists(os.path.join(directory, _INDEX))


def training_state_extra(directory: str) -> dict[str, Any]:
    """The `extra` dict of the committed checkpoint in `directory`, read without loading it.

    Args:
        directory: the checkpoint folder.

    Returns:
        What `save_training_state(..., extra=...)` stored (e.g. a run's settings).

    Raises:
        FileNotFoundError: no committed checkpoint in `directory`.
        ValueError: its index is not a checkpoint index.

    Example:
    ```python
    from tf_megadp.run.training_state import training_state_extra

    training_state_extra("run/checkpoint")["epoch"]
    ```
    """
    index_path = os.path.join(directory, _INDEX)
    try:
        with open(index_path, encoding="utf-8") as handle:
            index = json.load(handle)
    except FileNotFoundError:
        raise FileNotFoundError(f"No checkpoint ({_INDEX}) in {directory}.") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{index_path} is not a checkpoint index: {error}") from None
    if not isinstance(index, dict) or not isinstance(index.get("extra", {}), dict):
        raise ValueError(f"{index_path} is not a checkpoint index.")
    return index.get("extra", {})
