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
gradient: a run's checkpoint keeps the factors themselves beside its
training state (`tf_megadp.jobs.common.run_folder.Checkpointer`). The
release (`model.keras`) is the merged model, as Keras writes it.
"""

from __future__ import annotations

from tf_megadp.jobs.bert.config import PretrainConfig

__all__ = ["describe", "restrict_training"]


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
