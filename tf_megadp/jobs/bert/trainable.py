"""What a pretraining run trains: every weight, LoRA factors (`--lora-rank`), or all but the embeddings.

`--lora-rank r` is keras-hub's `backbone.enable_lora(r)`: every backbone
weight frozen, LoRA factors A and B of rank r on each layer's attention
query and value projections (their biases train too), the MLM head
trained. `--freeze-embeddings` freezes the token, position and segment
tables, and so the tied MLM decoder. Frozen weights are never clipped,
noised nor counted (docs/clipping.md, "LoRA"); they stay bit for bit as
they started.

Keras saves a LoRA layer as its merged kernel W + s A B and, on load,
puts that into W and zeros both factors, which leaves A and B without
gradient (each one's gradient is a product with the other). So a LoRA
run's checkpoint keeps W, A and B themselves beside the training state
(`save_lora_factors`), and a resume sets them back (`restore_lora_factors`).
The release (`model.keras`) is the merged model, as Keras writes it.
"""

from __future__ import annotations

import os

import numpy as np

from tf_megadp.files import atomic_write
from tf_megadp.jobs.bert.config import PretrainConfig

__all__ = ["LORA_FACTORS_KEY", "describe", "remove_other_lora_factors", "restore_lora_factors",
           "restrict_training", "save_lora_factors"]

# The key of the LoRA factors' file in the checkpoint's `extra`.
LORA_FACTORS_KEY = "lora_factors"
_PREFIX = "lora-"


def restrict_training(model, config: PretrainConfig) -> None:
    """Freezes what `config` keeps as it starts: call on the built model, after its weights are set.

    Args:
        model: the job's `BertMaskedLM`, its weights loaded (LoRA zeros
            nothing here, but a later `load_weights` would).
        config: the run's settings (`lora_rank`, `freeze_embeddings`).
    """
    backbone = model.backbone
    if config.freeze_embeddings:
        for layer in (backbone.token_embedding, backbone.position_embedding,
                      backbone.segment_embedding):
            layer.trainable = False
    if config.lora_rank:
        backbone.enable_lora(config.lora_rank)


def describe(config: PretrainConfig) -> str:
    """What the run trains, in a few words (the log and report.json)."""
    if config.lora_rank:
        return (f"LoRA rank {config.lora_rank} on the attention query and value projections "
                "and the MLM head; the rest frozen")
    if config.freeze_embeddings:
        return "every weight but the token, position and segment embeddings"
    return "every weight"


def _lora_variables(model) -> dict[str, object]:
    """W, A and B of every LoRA layer, by variable path."""
    from tf_megadp import _keras_compat

    variables = {}
    for layer in _keras_compat.flatten_layers(model, include_self=False):
        if getattr(layer, "lora_enabled", False):
            for variable in (_keras_compat.lora_base_kernel(layer), layer.lora_kernel_a,
                             layer.lora_kernel_b):
                variables[variable.path] = variable
    return variables


def save_lora_factors(model, directory: str, steps: int) -> str | None:
    """Writes W, A and B of the LoRA layers into the checkpoint folder; returns the file's name.

    The name goes into the checkpoint's `extra` (committed with it); the
    files of other checkpoints are removed by `remove_other_lora_factors`
    once it is committed.

    Args:
        model: the trained model.
        directory: the checkpoint folder.
        steps: the logical step (part of the name, so a committed file is
            never overwritten).

    Returns:
        The file name, or None for a model without LoRA.
    """
    import keras

    variables = _lora_variables(model)
    if not variables:
        return None
    values = {f"v{index:05d}": keras.ops.convert_to_numpy(variable)
              for index, variable in enumerate(variables.values())}
    values["paths"] = np.array(list(variables))
    name = f"{_PREFIX}{steps:08d}-{os.urandom(4).hex()}.npz"
    os.makedirs(directory, exist_ok=True)

    def write(path):
        with open(path, "wb") as handle:
            np.savez(handle, **values)

    atomic_write(os.path.join(directory, name), write)
    return name


def remove_other_lora_factors(directory: str, keep: str | None) -> None:
    """Removes the LoRA factor files of earlier checkpoints (all but `keep`)."""
    for name in os.listdir(directory):
        if name.startswith(_PREFIX) and name.endswith(".npz") and name != keep:
            os.remove(os.path.join(directory, name))


def restore_lora_factors(model, directory: str, name: str | None) -> None:
    """Sets W, A and B of the LoRA layers from the checkpoint's file (after its weights are restored).

    Raises:
        ValueError: the model has LoRA layers and the checkpoint no factors
            (or other ones).
    """
    variables = _lora_variables(model)
    if not variables and name is None:
        return
    if name is None:
        raise ValueError(
            f"The checkpoint in {directory} holds no LoRA factors but the run trains LoRA: "
            "it was not written by a --lora-rank run of this release.")
    with np.load(os.path.join(directory, name)) as saved:
        paths = [str(path) for path in saved["paths"]]
        if paths != list(variables):
            raise ValueError(
                f"The LoRA factors in {directory}/{name} are of other layers ({paths[:2]}...) "
                f"than the model's ({list(variables)[:2]}...).")
        for index, variable in enumerate(variables.values()):
            variable.assign(saved[f"v{index:05d}"])
