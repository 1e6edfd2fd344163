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
    DP run may publish. Written atomically. Its weights carry their privacy
    ledger (public, like the report): a private run that trains them
    further, in any process that imports tf_megadp, composes it before its
    first step, unless its user declares the new data disjoint
    (`tf_megadp.declare_disjoint_data`). A private model whose trainable
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
        atomic_write(path, model.save)
    finally:
        model.optimizer = optimizer
        model.compiled = compiled
