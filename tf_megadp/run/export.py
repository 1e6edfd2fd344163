"""`export_model`: the file of a DP run that may be published.

The release holds the model alone: architecture and weights, no optimizer
variables (so no ledger, no inner optimizer's moments) and no compile
configuration (so no clipping, noise or seed settings). Its privacy is the
report saved with it (`PrivacyCallback.save_report`), which names the
weights by their fingerprint so that `tf_megadp.continue_from_release` can
compose its ledger with a later run's.
"""

from __future__ import annotations

import os

import keras

from tf_megadp.files import atomic_write
from tf_megadp.run import weights_origin
from tf_megadp.run.state import is_private, run_notes

__all__ = ["export_model"]


def export_model(model: keras.Model, path: str | os.PathLike) -> None:
    """Writes the model for release: architecture and weights, no optimizer state.

    The file holds no optimizer variables, no compile configuration (so no
    clipping, noise or seed settings) and no training state; it is what a
    DP run may publish. Written atomically. A private fit that starts an
    empty ledger on the exported weights refuses, in this process, until
    `tf_megadp.continue_from_release` composes the release's ledger (pass it
    the report saved with the release, which names the weights by their
    `weights_fingerprint`). A private model whose trainable
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
    # A private fit that starts an empty ledger on these weights refuses.
    weights_origin.note_release(model, path)
