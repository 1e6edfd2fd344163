"""`export_model`: the file of a DP run that may be published.

The release holds the model alone: architecture and weights, no optimizer
variables (no inner optimizer's moments) and no compile configuration (so
no clipping, noise or seed settings). Its weights file carries the privacy
ledger of its values (`tf_megadp.run.provenance`), as every Keras file of
DP-trained values does, so that a private run that trains them further
composes it, however it loads them; the human-readable privacy report is
saved beside it (`PrivacyCallback.save_report`).
"""

from __future__ import annotations

import os

import keras

from tf_megadp.files import atomic_write
from tf_megadp.run.state import is_private, run_notes

__all__ = ["export_model"]


def export_model(model: keras.Model, path: str | os.PathLike) -> None:
    """Writes the model for release: architecture and weights, no optimizer state.

    The file holds no optimizer variables, no compile configuration (so no
    clipping, noise or seed settings) and no training state; it is what a
    DP run may publish. `keras.models.load_model` gives the model back
    uncompiled, a keras-hub task too (its config says compile=False: built
    with keras-hub's default optimizer, it made Keras warn on every load
    that the file holds no optimizer state). Written atomically. Its
    weights carry their privacy ledger (public, like the report): a private
    run that trains them further, in any process that imports tf_megadp,
    composes it before its first step, unless its user declares the new
    data disjoint (`tf_megadp.declare_disjoint_data`). A private model whose trainable
    weights changed outside its private steps (between private fits) is
    written with a loud warning: epsilon does not cover that change.

    Args:
        model: the trained model.
        path: the `.keras` file to write.

    Example:
    ```python
    model.fit(...)
    tf_megadp.export_model(model, "release/model.keras")
    released = keras.models.load_model("release/model.keras")
    ```
    """
    path = os.fspath(path)
    if not path.endswith(".keras"):
        raise ValueError(f"export_model writes a .keras file, got {path!r}.")
    if is_private(model):
        run_notes(model).check_weights(model)  # warns when they changed
    optimizer = getattr(model, "optimizer", None)
    compiled = getattr(model, "compiled", False)
    try:
        # Keras saves the optimizer and the compile settings of a compiled
        # model; detach both for the duration of the write.
        model.optimizer = None
        model.compiled = False
        if _compiles_when_built(model):
            # A keras-hub task compiles itself when rebuilt (default Adam),
            # and Keras then warned on every load that this file holds no
            # optimizer state (issue 47): it loads uncompiled, as it was saved.
            model.get_config = _without_compiling(type(model).get_config.__get__(model))
        atomic_write(path, model.save)
    finally:
        model.__dict__.pop("get_config", None)
        model.optimizer = optimizer
        model.compiled = compiled


def _compiles_when_built(model: keras.Model) -> bool:
    """Whether the model's class compiles itself when built from its config.

    keras-hub tasks do: `Task.__init__(..., compile=True)`, which their
    subclasses reach through `**kwargs`.
    """
    import inspect

    for cls in type(model).__mro__:
        try:
            parameter = inspect.signature(cls.__init__).parameters.get("compile")
        except (TypeError, ValueError):
            continue
        if parameter is not None:
            return parameter.default is True
    return False


def _without_compiling(get_config):
    def get_config_without_compiling():
        return {**get_config(), "compile": False}

    return get_config_without_compiling
