"""The decoder families of the causal-LM job: keras-hub's GPT-2 and Llama, built from constructors.

A family is chosen with `--family` for pretraining and read from the
start's file (its registered keras-hub task) for fine-tuning. Both are
built from the job's `MODEL_PRESETS` sizes (layers, hidden, heads,
intermediate) with dropout 0, so that a DP step and its non-private
baseline compare at the same cost (dropout doubles the XLA step on a CPU).

* GPT-2 (`GPT2CausalLM`): learned position table of `context` rows, head
  tied to the token embedding.
* Llama (`LlamaCausalLM`): rotary position embedding (RoPE, no position
  table: any length runs, but positions beyond those it trained on were
  never seen), untied head, RMS norms, SwiGLU MLP, as many key/value
  heads as query heads (no grouped-query attention at these sizes).

keras-hub's `backbone.enable_lora` targets the layers named "query" and
"value", the attention projections of both families, so `--lora-rank`
works for either.
"""

from __future__ import annotations

import dataclasses

from tf_megadp.jobs.common.errors import JobError

__all__ = ["DEFAULT_FAMILY", "FAMILIES", "Family", "build_model", "family_of_task"]


@dataclasses.dataclass(frozen=True)
class Family:
    """One decoder family the job builds.

    Attributes:
        name: its `--family` value.
        label: its name in logs and reports.
        task: the registered name of its keras-hub task (a `model.keras`'s
            config.json names it).
        tied_head: whether the output head reuses the token embedding.
        position_table: whether it learns a table of positions (then its
            context is that table's rows; else the tokens it was trained on).
    """

    name: str
    label: str
    task: str
    tied_head: bool
    position_table: bool

    def description(self) -> str:
        """report.json's `model.family`: the family, its keras-hub task, its head tied or not."""
        return (f"{self.label} (keras_hub.models.{self.task.split('>')[-1]}, "
                f"{'tied' if self.tied_head else 'untied'} head)")


FAMILIES = {
    "gpt2": Family("gpt2", "GPT-2", "keras_hub>GPT2CausalLM", tied_head=True,
                   position_table=True),
    "llama": Family("llama", "Llama", "keras_hub>LlamaCausalLM", tied_head=False,
                    position_table=False),
}
DEFAULT_FAMILY = "gpt2"


def family_of_task(registered_name: str) -> Family:
    """The family whose keras-hub task is `registered_name`.

    Raises:
        JobError: no family of the job has it.
    """
    for family in FAMILIES.values():
        if family.task == registered_name:
            return family
    raise JobError(f"{registered_name} is the task of none of the job's families "
                   f"({', '.join(f.task for f in FAMILIES.values())}).")


def build_model(family: str, model: str, vocabulary_size: int, context: int):
    """The run's keras-hub causal LM of `family`, from constructors (nothing is downloaded).

    Args:
        family: a `FAMILIES` name.
        model: a `MODEL_PRESETS` name (layers, hidden, heads, intermediate).
        vocabulary_size: V.
        context: the most tokens it reads: GPT-2's position table's rows
            (Llama has none; its rotary embedding takes any length).

    Returns:
        A `keras_hub.models.GPT2CausalLM` or `LlamaCausalLM`, without
        preprocessor (the job feeds token ids and padding masks).
    """
    import keras_hub

    from tf_megadp.jobs.bert.config import MODEL_PRESETS

    layers, hidden, heads, intermediate = MODEL_PRESETS[model]
    if family == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=vocabulary_size, num_layers=layers, num_heads=heads,
            hidden_dim=hidden, intermediate_dim=intermediate, max_sequence_length=context,
            dropout=0.0)
        return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    if family == "llama":
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=vocabulary_size, num_layers=layers, num_query_heads=heads,
            num_key_value_heads=heads, hidden_dim=hidden, intermediate_dim=intermediate,
            dropout=0.0, tie_word_embeddings=FAMILIES["llama"].tied_head)
        return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    raise JobError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}.")
