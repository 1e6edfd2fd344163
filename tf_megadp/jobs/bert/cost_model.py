"""The cost model of a BERT masked-LM step: FLOPs and per-core memory, in plain arithmetic.

`tf_megadp.jobs.bert.plan` (`tf-megadp plan`) prices a run with it; nothing
here imports TensorFlow.

All estimates are arithmetic on the BERT architecture:

* FLOPs: a multiply-add counts 2. Forward F per sequence = dense layers
  (2 T p d each) + attention scores and context (4 T^2 H per layer) + the
  MLM head on the P masked positions. Training = 3 F (backward = 2 F: the
  gradients of the layer inputs and the weight-gradient products).
  Static shapes compute padding slots too, so a step costs its capacity
  k m R, not its expected batch B. Per example:
  - vectorized: 3 F + 4 per parameter (squared norm, scaled sum).
  - ghost (book-keeping, `tf_megadp.clipping.ghost`; auto is the same
    step for BERT, every layer having a ghost rule): ONE forward and ONE
    backward pass. The backward gives every layer's output gradients, no
    weight gradients; each Outer record (a dense kernel: T tokens, p inputs,
    d outputs, `tf_megadp.clipping.terms.Outer`) then takes the form the
    code picks from its shapes. Materialised (p d <= T (p + d)): the
    per-example gradient is built once (2 T p d, which replaces the
    ordinary weight-gradient product, so it is inside the 3 F), and its
    norm (2 p d) and clipped sum (2 p d) are read off it: + 4 p d. Gram
    (otherwise): the norm costs 2 T^2 (p + d) for the two Grams and 2 T^2
    for their product and sum; the clipped sum is the ordinary
    weight-gradient product (inside the 3 F) on the left factor scaled by
    the clip factors (+ T p). The token, position and segment embeddings
    are Gather records: 2 T^2 (h + 1) for each norm (token-equality Gram;
    the equality mask is compares, no FLOPs) and 2 T h for each clipped
    sum (scaling, segment sum); the tied MLM decoder adds the cross term of
    its Outer record with the token lookup, 2 P T (h + 1). Biases and
    LayerNorm parameters are per-example gradients (Explicit records):
    + 4 per parameter (norm, clipped sum). The pooler gets no gradient from
    the MLM loss and costs nothing. Not counted: the independence check (a
    per-example forward pass on the first call of each traced input
    signature only, not in the steady state) and the per-example loss
    gradients (elementwise, as in non-private training).
* Memory per core: float32 parameters; optimizer state = inner optimizer
  slots + the DP accumulator + with `ema_momentum` the moving average of
  the weights (float32, one copy per parameter each); step
  buffers = two float32 gradients the DP step holds besides its state (the
  micro-batch's clipped sum before it enters the accumulator, and the noisy
  mean gradient handed to the inner optimizer); activations with 16-bit
  compute (precision mixed_bfloat16, or mixed_float16 on GPUs without
  bfloat16: 2 bytes per value either way) about 34 T H + 5 heads T^2 bytes per
  layer per sequence (no rematerialisation), twice that in float32, plus
  float32 MLM logits. Vectorized clipping materialises m float32
  per-example gradients (m * 4 * params bytes). Ghost clipping (and auto,
  which for BERT is ghost: every layer has a rule) holds, per example, what
  the book-keeping step keeps from its backward pass until the clip factors
  exist and the clipped sums are formed (`_ghost_held_floats`), all
  float32 (`terms.compute_dtype`), summed as if held at once and on top of
  all activations (an upper bound: by the end of the backward pass only
  the recorded inputs among the activations are still needed):
  - a materialised Outer record: its built p x d gradient (its factors are
    not needed after it is built);
  - a Gram-form Outer record: its output-gradient factor, T d values (T V
    for the tied decoder, whose gradient factor is the V-wide logit
    gradient), and its two T x T Grams (XLA may free each pair after its
    reduction). Its other factor is the layer's input (`flat_tokens`): in
    float32 that is the activation itself, already counted above; under
    mixed_bfloat16 it is a float32 cast of the bfloat16 input, T p values,
    counted once per input tensor (the query, key and value kernels cast
    the same input, which XLA computes once);
  - the token, position and segment Gather records: T h values each;
  - the Explicit records of biases and LayerNorm parameters: their
    per-example gradients.
  For BERT-Large (T = 128, all Gram form) that is 131 MiB per sequence in
  float32 and 215 MiB under mixed_bfloat16 (110 MiB of output gradients,
  84 MiB of input casts, 18 MiB of Grams). Not counted: the per-example
  loss gradients ([P, V] per example, the same values as the decoder's
  record), the clip-factor-scaled factors of each clipped sum (one layer
  at a time), the independence check (first call of each traced input
  signature only; compiled as its own function run before the step, it
  holds nothing beside the records), the bfloat16 copies of the
  weights under mixed_bfloat16 (as in non-private training), and
  TensorFlow's and XLA's own memory.
  Checked against one measured DP step of BERT-Large on a CPU
  (benchmarks/bert_large_check.py, docs/tpu.md): the measured peak exceeds
  the plan by 2.10 GiB for ghost and 2.43 GiB for vectorized (measured/plan
  1.25 and 1.23), about the same for both clippings, i.e. memory outside
  the modelled buffers rather than a missing ghost buffer. The measured
  ghost step also ran the independence check inside the step, beside its
  records: by the tensors the check compares (the model's outputs and its
  Dropout layers' inputs, in the per-example and the batched pass) about
  0.15 GiB of that peak.

* Frozen weights and LoRA (`--freeze-embeddings`, `--lora-rank r`): the
  forward pass and the input gradients run through every layer as before;
  a frozen kernel skips its weight-gradient product (2 T p d), its ghost
  record, its optimizer slots, DP accumulator and step buffers.
  `--freeze-embeddings` freezes the token, position and segment tables
  (the tied decoder too: its weight is the token table). `--lora-rank r`
  is keras-hub's `backbone.enable_lora(r)`: every backbone weight frozen,
  LoRA on each layer's query and value projections (kernel [h, S, L], S
  heads of L = h / S; factors A [h, S, r] and B [r, L], their biases
  trainable), the MLM head trainable. A LoRA kernel adds x A and (x A) B
  to the forward pass (2 T p S r + 2 T r d), as much to the input
  gradients and to its factors' weight gradients (3 (2 T p S r + 2 T r d)
  in all), and its ghost records are Outer(x, s G B^T) for A ([T, p] x
  [T, S r]) and Outer(s x A, G) for B ([T S, r] x [T S, L]), each in the
  form `outer_is_materialised` picks (docs/clipping.md, "LoRA"); its
  activations keep x A (T S r values). Parameters count every weight (the
  frozen ones and the factors); optimizer state, step buffers and
  vectorized clipping count the trainable ones.
"""

from __future__ import annotations

import dataclasses
import math

from tf_megadp.jobs.common.cost_model import (
    CLIPPING,
    GIB,
    Architecture,
    Kernel,
    example_flops,
    memory,
    outer_is_materialised,
)

__all__ = ["CLIPPING", "GIB", "ModelSpec", "example_flops", "memory", "model_spec",
           "outer_is_materialised"]

@dataclasses.dataclass(frozen=True)
class ModelSpec(Architecture):
    """A BERT masked-LM architecture and what of it is trained.

    Args:
        num_layers, hidden_dim, num_heads, intermediate_dim, vocabulary_size,
            sequence_length: the encoder (`Architecture`); T is the tokens
            of one sequence (one privacy unit).
        max_predictions: P, masked positions per sequence.
        type_vocabulary_size: segment ids.
        position_embeddings: rows of the position table (None: T).
        lora_rank: r of keras-hub's `backbone.enable_lora(r)` (0: off): the
            backbone frozen, LoRA on the query and value projections.
        freeze_embeddings: the token, position and segment tables frozen.
    """

    max_predictions: int
    type_vocabulary_size: int = 2
    position_embeddings: int | None = None
    lora_rank: int = 0
    freeze_embeddings: bool = False

    def __post_init__(self):
        if not isinstance(self.freeze_embeddings, bool):
            raise ValueError(
                f"model.freeze_embeddings must be a bool, got {self.freeze_embeddings!r}.")
        self.check_sizes("model.")
        if self.max_predictions > self.sequence_length:
            raise ValueError(
                f"model.max_predictions {self.max_predictions} exceeds sequence_length "
                f"{self.sequence_length}."
            )
        if self.sequence_length > (self.position_embeddings or self.sequence_length):
            raise ValueError(
                f"model.sequence_length {self.sequence_length} exceeds the position table's "
                f"{self.position_embeddings} rows.")

    @property
    def embeddings_trainable(self) -> bool:
        """Whether the token, position and segment tables (and the tied decoder) train."""
        return not (self.freeze_embeddings or self.lora_rank)

    def kernels(self) -> list[Kernel]:
        """Every dense kernel of the forward pass, head and tied decoder included.

        With LoRA, the query and value projections carry the factors and
        every other backbone kernel is frozen; the head's transform trains.
        The tied decoder (logits = h E^T) trains with the token table.
        """
        h, p = self.hidden_dim, self.max_predictions
        return self.layer_kernels(self.lora_rank) + [
            Kernel(p, h, h, "head"),
            Kernel(p, self.vocabulary_size, h, "decoder", self.embeddings_trainable,
                   gradient="left")]

    def tied_cross_term_flops(self) -> float:
        """The tied decoder's record (P positions) against the token lookup (T): 2 P T (h + 1)."""
        if not self.embeddings_trainable:
            return 0.0
        return 2.0 * self.max_predictions * self.sequence_length * (self.hidden_dim + 1)

    def embedding_lookups(self) -> list[tuple[int, int]]:
        """(tokens, width) of the trained token, position and segment lookups (Gather records)."""
        if not self.embeddings_trainable:
            return []
        return [(self.sequence_length, self.hidden_dim)] * 3

    def small_parameter_count(self) -> int:
        """Trained biases and LayerNorm scales and offsets that get a gradient from the MLM loss.

        Ghost clipping records their per-example gradients explicitly. With
        LoRA only the query and value biases of the backbone train.
        """
        h, i = self.hidden_dim, self.intermediate_dim
        head = h + 2 * h + self.vocabulary_size  # transform bias, its LayerNorm, output bias
        if self.lora_rank:
            return self.num_layers * 2 * h + head
        layer = 4 * h + i + h + 2 * 2 * h  # attention and MLP biases, two LayerNorms
        return 2 * h + self.num_layers * layer + head  # embedding LayerNorm first

    def parameter_count(self) -> int:
        """Every weight: frozen ones and LoRA factors too (the decoder shares the token table)."""
        h, i, v = self.hidden_dim, self.intermediate_dim, self.vocabulary_size
        embeddings = self._table_parameters() + 2 * h
        layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h
        head = (h * h + h) + 2 * h + v  # transform, its LayerNorm, output bias
        pooler = h * h + h
        return (embeddings + self.num_layers * (layer + self._lora_parameters()) + head
                + pooler)

    def trainable_parameter_count(self) -> int:
        """The weights the optimizer trains (slots, DP accumulator, per-example gradients)."""
        h, v = self.hidden_dim, self.vocabulary_size
        if self.lora_rank:
            head = (h * h + h) + 2 * h + v
            return self.num_layers * (self._lora_parameters() + 2 * h) + head
        frozen = self._table_parameters() if self.freeze_embeddings else 0
        return self.parameter_count() - frozen

    def _table_parameters(self) -> int:
        rows = (self.vocabulary_size + (self.position_embeddings or self.sequence_length)
                + self.type_vocabulary_size)
        return rows * self.hidden_dim

    def _lora_parameters(self) -> int:
        """A [h, S, r] and B [r, h / S] of a layer's query and value projections."""
        h, heads, r = self.hidden_dim, self.num_heads, self.lora_rank
        return 2 * (h * heads * r + r * h // heads)

    def activation_bytes(self, bytes_per_value: int = 2) -> float:
        """Activation memory of one sequence kept for the backward pass.

        Args:
            bytes_per_value: 2 for 16-bit compute (mixed_bfloat16, mixed_float16),
                4 for float32.
        """
        t, h = self.sequence_length, self.hidden_dim
        per_layer = (34.0 * t * h + 5.0 * self.num_heads * t * t) * bytes_per_value / 2
        # x A of the query and value projections' LoRA paths.
        per_layer += 2.0 * t * self.num_heads * self.lora_rank * bytes_per_value
        logits = 4.0 * self.max_predictions * self.vocabulary_size
        return self.num_layers * per_layer + logits


def model_spec(config, vocabulary_size: int | None = None) -> ModelSpec:
    """The architecture a `PretrainConfig` trains (V from the config unless given)."""
    layers, hidden, heads, intermediate = config.architecture()
    return ModelSpec(
        num_layers=layers, hidden_dim=hidden, num_heads=heads, intermediate_dim=intermediate,
        vocabulary_size=vocabulary_size or config.vocabulary_size,
        sequence_length=config.sequence_length,
        max_predictions=config.max_predictions or math.ceil(0.15 * config.sequence_length),
        position_embeddings=config.max_sequence_length,
        lora_rank=config.lora_rank or 0,
        freeze_embeddings=config.freeze_embeddings,
    )
