"""The cost model of a causal-LM step: a keras-hub GPT-2 or Llama decoder, in plain arithmetic.

`DecoderSpec` describes one row of the job's model to the shared cost
model (`tf_megadp.jobs.common.cost_model`: FLOPs and memory of the
non-private step and of DP clipping), for `tf-megadp causal-lm --plan`.
The model reads T = sequence_length - 1 tokens and scores every one of
them through the vocabulary head, so the head is a [T, h] x [h, V] kernel
(where the masked-LM head sees only its P masked positions).

* GPT-2 (`GPT2Backbone`): token table [V, h] and position table [P, h]
  (two Gather records), per layer query, key, value and output
  projections (h x h, with biases), MLP h -> i -> h (with biases), two
  LayerNorms (scale and offset), a final LayerNorm; the head is the token
  table (`ReversibleEmbedding`, tied): its Outer record's left factor is
  the V-wide logit gradient, and it crosses the token lookup (2 T^2 (h +
  1) FLOPs).
* Llama (`LlamaBackbone`, as the job builds it): token table [V, h] (one
  Gather record), per layer query, key, value and output projections (no
  biases, as many key/value heads as query heads), a gated MLP (gate and
  up h -> i, down i -> h, no biases), RMS norms (one scale each, ghost's
  Explicit records), a final RMS norm, and an untied head [h, V]
  (`reverse_embeddings`), an ordinary Outer record.
* `--lora-rank r` (keras-hub's `backbone.enable_lora(r)`): every backbone
  weight frozen, the head included (it lives in the backbone's token
  embedding), LoRA factors on the query and value projections, whose
  biases (GPT-2's) stay trained.

Activations per layer and example, in bytes under 16-bit compute (twice
in float32): 18 T h for the attention block's tensors and the MLP input
(Korthikanti et al.'s 34 T h with i = 4 h, less the MLP's 16 T h), 4 T i
for the MLP's pre- and post-activation (8 T i for the gated MLP's gate,
up, activation and product), 5 S T^2 for scores, softmax and its mask;
plus the float32 logits, 4 T V bytes. Dropout is 0 in the job (no masks).
Not counted: the per-example loss gradients beyond the head's record, and
TensorFlow's and XLA's own memory (docs/benchmarks.md compares the plan
with a measured step).

Example:
```python
spec = DecoderSpec(family="gpt2", num_layers=2, hidden_dim=64, num_heads=2,
                   intermediate_dim=256, vocabulary_size=512, sequence_length=63)
example_flops(spec, "auto"), memory(spec, 64, "auto")["total"]
```
"""

from __future__ import annotations

import dataclasses

from tf_megadp.jobs.common.cost_model import Architecture, Kernel

__all__ = ["DecoderSpec", "decoder_spec"]


@dataclasses.dataclass(frozen=True)
class DecoderSpec(Architecture):
    """A causal-LM decoder of the job, one row of `sequence_length` tokens read.

    Args:
        num_layers, hidden_dim, num_heads, intermediate_dim, vocabulary_size,
            sequence_length: the decoder (`Architecture`); T is the tokens
            the model reads (and scores) per row.
        family: "gpt2" or "llama" (`tf_megadp.jobs.causal_lm.families`).
        position_embeddings: GPT-2's position table's rows (None: T).
        lora_rank: r of `backbone.enable_lora(r)` (0: every weight trains).
    """

    family: str
    position_embeddings: int | None = None
    lora_rank: int = 0

    def __post_init__(self):
        if self.family not in ("gpt2", "llama"):
            raise ValueError(f"family must be 'gpt2' or 'llama', got {self.family!r}.")
        self.check_sizes()
        if self.sequence_length > self.rows_of_position_table():
            raise ValueError(f"sequence_length {self.sequence_length} exceeds the position "
                             f"table's {self.position_embeddings} rows.")

    @property
    def tied_head(self) -> bool:
        """Whether the head is the token table (GPT-2) or its own kernel (Llama)."""
        return self.family == "gpt2"

    def rows_of_position_table(self) -> int:
        """GPT-2's learned positions (Llama's rotary ones take any length)."""
        return self.position_embeddings or self.sequence_length

    def kernels(self) -> list[Kernel]:
        """The projections, the MLP (gated for Llama) and the head over all T positions."""
        t, h, v = self.sequence_length, self.hidden_dim, self.vocabulary_size
        kernels = self.layer_kernels(self.lora_rank, gated_mlp=self.family == "llama")
        trained = not self.lora_rank  # The head is the backbone's: frozen under LoRA.
        if self.tied_head:
            # logits = x E^T: the record's left factor is the logit gradient.
            return kernels + [Kernel(t, v, h, "head", trained, gradient="left")]
        return kernels + [Kernel(t, h, v, "head", trained)]

    def embedding_lookups(self) -> list[tuple[int, int]]:
        """The token lookup, and GPT-2's position lookup, while the backbone trains."""
        if self.lora_rank:
            return []
        t, h = self.sequence_length, self.hidden_dim
        return [(t, h)] * (2 if self.family == "gpt2" else 1)

    def tied_cross_term_flops(self) -> float:
        """GPT-2's head record against the token lookup, both over T tokens: 2 T^2 (h + 1)."""
        if not self.tied_head or self.lora_rank:
            return 0.0
        return 2.0 * self.sequence_length**2 * (self.hidden_dim + 1)

    def small_parameter_count(self) -> int:
        """Trained biases and norm parameters: GPT-2's, or Llama's RMS scales.

        Under LoRA only GPT-2's query and value biases train (Llama's
        projections have none).
        """
        h, i, n = self.hidden_dim, self.intermediate_dim, self.num_layers
        if self.family == "llama":
            return 0 if self.lora_rank else n * 2 * h + h
        if self.lora_rank:
            return n * 2 * h
        return n * (4 * h + i + h + 2 * 2 * h) + 2 * h

    def parameter_count(self) -> int:
        """Every weight: the frozen ones and the LoRA factors too."""
        h, i, v, n = self.hidden_dim, self.intermediate_dim, self.vocabulary_size, self.num_layers
        lora = 2 * (h * self.num_heads * self.lora_rank + self.lora_rank * h // self.num_heads)
        if self.family == "llama":
            layer = 4 * h * h + 3 * h * i + 2 * h
            return 2 * v * h + n * (layer + lora) + h
        layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h
        return (v + self.rows_of_position_table()) * h + n * (layer + lora) + 2 * h

    def trainable_parameter_count(self) -> int:
        """Every weight, or under LoRA the factors (and GPT-2's query and value biases)."""
        if not self.lora_rank:
            return self.parameter_count()
        h, heads, r = self.hidden_dim, self.num_heads, self.lora_rank
        factors = self.num_layers * 2 * (h * heads * r + r * h // heads)
        return factors + self.small_parameter_count()

    def activation_bytes(self, bytes_per_value: int = 2) -> float:
        """Activation memory of one row kept for the backward pass (module docstring)."""
        t, h, i = self.sequence_length, self.hidden_dim, self.intermediate_dim
        mlp = (8.0 if self.family == "llama" else 4.0) * t * i
        per_layer = (18.0 * t * h + mlp + 5.0 * self.num_heads * t * t) * bytes_per_value / 2
        # x A of the query and value projections' LoRA paths.
        per_layer += 2.0 * t * self.num_heads * self.lora_rank * bytes_per_value
        return self.num_layers * per_layer + 4.0 * t * self.vocabulary_size


def decoder_spec(family: str, model: str, vocabulary_size: int, sequence_length: int,
                 context: int, lora_rank: int | None = None) -> DecoderSpec:
    """The `DecoderSpec` of the job's model.

    Args:
        family: a `FAMILIES` name.
        model: a `MODEL_PRESETS` size.
        vocabulary_size: V.
        sequence_length: L, tokens per row (the model reads L - 1).
        context: GPT-2's position table's rows (ignored for Llama).
        lora_rank: `--lora-rank`, or None.
    """
    from tf_megadp.jobs.bert.config import MODEL_PRESETS

    layers, hidden, heads, intermediate = MODEL_PRESETS[model]
    return DecoderSpec(
        family=family, num_layers=layers, hidden_dim=hidden, num_heads=heads,
        intermediate_dim=intermediate, vocabulary_size=vocabulary_size,
        sequence_length=sequence_length - 1,
        position_embeddings=context if family == "gpt2" else None,
        lora_rank=lora_rank or 0)
