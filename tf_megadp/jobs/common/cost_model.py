"""What a DP step of a transformer costs, from its dense kernels: FLOPs and memory in plain arithmetic.

Every job's planner prices its architecture here: an `Architecture`
subclass lists the dense kernels of one example's forward pass
(`Kernel`), its embedding lookups, its small parameters (biases and
normalization scales) and its activations, and `example_flops` and
`memory` add what DP clipping costs on top of training. The BERT
masked-LM spec and its full arithmetic are in
`tf_megadp.jobs.bert.cost_model`; the causal-LM decoders in
`tf_megadp.jobs.causal_lm.cost_model`. Nothing here imports TensorFlow.

Conventions: a multiply-add counts 2; training a kernel costs its product
three times (forward, input gradient, weight gradient), a frozen one
twice. Ghost clipping (book-keeping, `tf_megadp.clipping.ghost`) runs one
forward and one backward pass; each Outer record takes the form
`outer_is_materialised` picks: materialised (+ 4 p d: norm and clipped sum
read off the built gradient) or Gram (+ 2 T^2 (p + d) + 2 T^2 + T p); a
Gather record (an embedding lookup of T tokens, width h) adds 2 T^2 (h + 1)
+ 2 T h; a tied head's record adds its cross term with the token lookup
(`Architecture.tied_cross_term_flops`); Explicit records (biases,
normalization parameters) + 4 per parameter. Vectorized clipping adds 4
per trained parameter.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import NamedTuple

from tf_megadp.clipping_memory import outer_is_materialised

__all__ = ["CLIPPING", "GIB", "OPTIMIZER_SLOTS", "STEP_BUFFERS", "Architecture", "Kernel",
           "OuterRecord", "example_flops", "memory", "outer_is_materialised"]

GIB = 2**30
# Float32 slots the jobs' inner optimizer (AdamW: two moments) keeps per parameter.
OPTIMIZER_SLOTS = 2
# The clipping methods a plan accepts, each with the cost model it follows.
# Under "auto" a layer with a ghost rule takes it; a job's spec counts the
# per-layer fallback's layers (normalization scales) as Explicit records.
CLIPPING = {"vectorized": "vectorized", "ghost": "ghost", "auto": "ghost"}
# Float32 gradients the DP step holds besides its state: the micro-batch's
# clipped sum (before it enters the accumulator) and the noisy mean gradient
# handed to the inner optimizer.
STEP_BUFFERS = 2


class OuterRecord(NamedTuple):
    """The shape of one ghost Outer record (`tf_megadp.clipping.terms.Outer`).

    Args:
        tokens: T, the rows of both factors.
        left: p, the width of the left factor.
        right: d, the width of the right factor.
        gradient: which factor is the output gradient, "left" or "right";
            the other is a layer input.
        input: a name of that layer input; records with the same name read
            the same tensor. None: the rule computes the factor itself (a
            LoRA B record's s x A), a float32 tensor held in any precision.
    """

    tokens: int
    left: int
    right: int
    gradient: str
    input: str | None


class Kernel(NamedTuple):
    """One dense kernel of the forward pass, [p, d] applied to T tokens.

    Args:
        tokens: T.
        inputs: p.
        outputs: d.
        input: the name of the layer input it reads (shared by the query,
            key and value kernels of a layer).
        trainable: whether its own weight is trained.
        lora_rank: r of its LoRA factors (0: none).
        heads: S, the output's heads (the LoRA A factor is [p, S, r]).
        gradient: which factor of its ghost record is the output gradient
            ("left" only for a head tied to the token table,
            `ReversibleEmbeddingRule`).
    """

    tokens: int
    inputs: int
    outputs: int
    input: str
    trainable: bool = True
    lora_rank: int = 0
    heads: int = 1
    gradient: str = "right"

    def lora_flops(self) -> float:
        """FLOPs of x A and (x A) B, the LoRA path's forward products."""
        t, r = self.tokens, self.lora_rank
        return 2.0 * t * self.inputs * self.heads * r + 2.0 * t * r * self.outputs


@dataclasses.dataclass(frozen=True)
class Architecture(abc.ABC):
    """One example's transformer, as the cost model reads it; subclasses describe their layers.

    A subclass (a frozen dataclass adding its own fields) defines `kernels`,
    `embedding_lookups`, `small_parameter_count`, `tied_cross_term_flops`,
    `parameter_count`, `trainable_parameter_count` and `activation_bytes`;
    the records and the FLOPs of training follow from them here.

    Args:
        num_layers, hidden_dim, num_heads, intermediate_dim, vocabulary_size:
            the transformer's sizes.
        sequence_length: T, the tokens one example runs through its layers.
    """

    num_layers: int
    hidden_dim: int
    num_heads: int
    intermediate_dim: int
    vocabulary_size: int
    sequence_length: int

    def check_sizes(self, prefix: str = "") -> None:
        """Raises ValueError unless every integer field is one (>= 1; `lora_rank` >= 0).

        For the dataclass subclasses: a field annotated `int | None` may be
        None; the hidden width must split into the heads.

        Args:
            prefix: put before a field's name in the message ("model.").
        """
        for field in dataclasses.fields(self):
            if not str(field.type).startswith("int"):
                continue
            value = getattr(self, field.name)
            if value is None and "None" in str(field.type):
                continue
            least = 0 if field.name == "lora_rank" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{prefix}{field.name} must be an integer >= {least}, got "
                                 f"{value!r}.")
        if self.hidden_dim % self.num_heads:
            raise ValueError(f"{prefix}hidden_dim {self.hidden_dim} is not divisible by "
                             f"num_heads {self.num_heads}.")

    @abc.abstractmethod
    def kernels(self) -> list[Kernel]:
        """Every dense kernel of the forward pass, the output head included."""

    def layer_kernels(self, lora_rank: int, gated_mlp: bool = False) -> list[Kernel]:
        """The dense kernels of every layer: query, key, value, context, MLP in and out.

        Args:
            lora_rank: r of keras-hub's `enable_lora` (0: off): every layer
                kernel frozen, LoRA factors on the query and value ones.
            gated_mlp: two MLP input kernels (SwiGLU's gate and up), reading
                the same input.

        The query, key and value kernels read the same input.
        """
        t, h, i, heads = self.sequence_length, self.hidden_dim, self.intermediate_dim, self.num_heads
        r = lora_rank
        trained = not r
        kernels = []
        for n in range(self.num_layers):
            for name in ("query", "key", "value"):
                adapted = r if name != "key" else 0
                kernels.append(Kernel(t, h, h, f"{n}.attention", trained, adapted, heads))
            kernels.append(Kernel(t, h, h, f"{n}.context", trained))
            kernels += [Kernel(t, h, i, f"{n}.mlp", trained)] * (2 if gated_mlp else 1)
            kernels.append(Kernel(t, i, h, f"{n}.intermediate", trained))
        return kernels

    def attention_flops(self) -> float:
        """Scores and contexts of every position, 4 T^2 h per layer (a causal mask skips none)."""
        return self.num_layers * 4.0 * self.sequence_length**2 * self.hidden_dim

    @abc.abstractmethod
    def embedding_lookups(self) -> list[tuple[int, int]]:
        """(tokens, width) of each trained embedding lookup (a Gather record)."""

    @abc.abstractmethod
    def small_parameter_count(self) -> int:
        """Trained biases and normalization parameters with a gradient (Explicit records)."""

    @abc.abstractmethod
    def tied_cross_term_flops(self) -> float:
        """FLOPs of the cross term of a trained tied head's record with the token lookup."""

    @abc.abstractmethod
    def parameter_count(self) -> int:
        """Every weight, frozen ones and LoRA factors too."""

    @abc.abstractmethod
    def trainable_parameter_count(self) -> int:
        """The weights the optimizer trains (slots, DP accumulator, per-example gradients)."""

    @abc.abstractmethod
    def activation_bytes(self, bytes_per_value: int = 2) -> float:
        """Activation memory of one example kept for the backward pass."""

    def outer_records(self) -> list[OuterRecord]:
        """The ghost Outer records of the trained kernels.

        Returns:
            Per record: tokens T, width p of its left factor and d of its
            right one, which factor is the output gradient and the layer
            input the other factor is. For a dense layer the left factor is
            its input and the right one its output gradient; the query, key
            and value kernels of a layer read the same input. For a head
            tied to the token table the left factor is the V-wide logit
            gradient and the right one the h-wide hidden state
            (`ReversibleEmbeddingRule`). A LoRA kernel gives two:
            Outer(x, s G B^T) for A, [T, p] x [T, S r], and Outer(s x A, G)
            for B, [T S, r] x [T S, L].
        """
        records = []
        for kernel in self.kernels():
            t, p, d = kernel.tokens, kernel.inputs, kernel.outputs
            if kernel.lora_rank:
                r, heads = kernel.lora_rank, kernel.heads
                records += [OuterRecord(t, p, heads * r, "right", kernel.input),
                            OuterRecord(t * heads, r, d // heads, "right", None)]
            if kernel.trainable:
                records.append(OuterRecord(t, p, d, kernel.gradient, kernel.input))
        return records

    def dense_layers(self) -> list[tuple[int, int, int]]:
        """(T, p, d) of every `outer_records` record: the shapes of the ghost norms."""
        return [(r.tokens, r.left, r.right) for r in self.outer_records()]

    def forward_flops(self) -> float:
        """FLOPs of one example's forward pass."""
        dense = sum(2.0 * k.tokens * k.inputs * k.outputs + k.lora_flops()
                    for k in self.kernels())
        return dense + self.attention_flops()

    def training_flops(self) -> float:
        """FLOPs of one example's forward and backward pass, as non-private training runs it.

        Every kernel's product in the forward pass and for the input
        gradient; the weight-gradient product of trained kernels only; a
        LoRA path three times (forward, input gradient, its factors'
        gradients); attention three times.
        """
        flops = 3.0 * self.attention_flops()
        for kernel in self.kernels():
            product = 2.0 * kernel.tokens * kernel.inputs * kernel.outputs
            flops += (3.0 if kernel.trainable else 2.0) * product + 3.0 * kernel.lora_flops()
        return flops


def _ghost_clipping_flops(model: Architecture) -> float:
    """FLOPs per example ghost clipping adds to training (module docstring)."""
    flops = 0.0
    for t, p, d in model.dense_layers():
        if outer_is_materialised(t, p, d):
            flops += 4.0 * p * d  # norm and clipped sum read off the built [p, d] gradient
        else:
            # Two Grams, their product and sum; the clip factors scale the left factor.
            flops += 2.0 * t * t * (p + d) + 2.0 * t * t + t * p
    for t, width in model.embedding_lookups():
        flops += 2.0 * t * t * (width + 1) + 2.0 * t * width
    return flops + model.tied_cross_term_flops() + 4.0 * model.small_parameter_count()


def example_flops(model: Architecture, clipping: str) -> float:
    """FLOPs of one example's private training step under `clipping` (a `CLIPPING` name).

    Args:
        model: the architecture.
        clipping: "vectorized", "ghost" or "auto".

    Returns:
        Training FLOPs plus what the clipping adds: per trained parameter
        a squared norm and a scaled sum (vectorized), or the ghost norms and
        clipped sums of the records.

    Example:
    ```python
    example_flops(model_spec(PretrainConfig(model="large")), "ghost")
    ```
    """
    training = model.training_flops()
    if CLIPPING[clipping] == "vectorized":
        return training + 4.0 * model.trainable_parameter_count()
    return training + _ghost_clipping_flops(model)


def _ghost_held_floats(model: Architecture, precision: str) -> float:
    """Float32 values per example ghost clipping holds until its clipped sums.

    A materialised record holds its built [p, d] gradient; a Gram-form one
    its output-gradient factor, its two T x T Grams, and (under 16-bit
    compute) a float32 cast of its input, once per input tensor; a Gather
    record its T h values; Explicit records their per-example gradients.
    """
    floats = 0.0
    copied_inputs = {}
    for record in model.outer_records():
        t, p, d = record.tokens, record.left, record.right
        if outer_is_materialised(t, p, d):
            floats += p * d  # the built [p, d] gradient; its factors are no longer needed
            continue
        gradient, layer_input = (d, p) if record.gradient == "right" else (p, d)
        floats += t * gradient + 2.0 * t * t  # the output-gradient factor; the two Grams
        if record.input is None:
            floats += t * layer_input  # computed by the rule, not an activation
        else:
            copied_inputs[record.input] = t * layer_input  # one cast per input tensor
    if precision != "float32":
        # The float32 casts of 16-bit layer inputs (`flat_tokens`); in
        # float32 the factor is the activation itself, counted there.
        floats += sum(copied_inputs.values())
    floats += sum(t * width for t, width in model.embedding_lookups())  # Gather values
    return floats + model.small_parameter_count()  # Explicit records


def memory(model: Architecture, m: int, clipping: str | None, precision: str = "float32",
           ema: bool = False) -> dict[str, float]:
    """Per-core bytes of a step of m examples, by part, and their total.

    Args:
        model: the architecture.
        m: examples per micro-batch and core.
        clipping: "vectorized", "ghost" or "auto" for a private step; None
            for the non-private step (one gradient, no DP accumulator, no
            clipping).
        precision: "float32", "mixed_bfloat16" or "mixed_float16" (the
            16-bit policies cost the same bytes).
        ema: the inner optimizer keeps a moving average of the weights.

    Returns:
        {"parameters", "optimizer_state", "step_buffers", "activations",
        "clipping", "total"} in bytes.

    Example:
    ```python
    memory(model_spec(PretrainConfig(model="large")), 32, "ghost", "mixed_bfloat16")
    ```
    """
    trained = model.trainable_parameter_count()
    # Keras's use_ema keeps one more float32 copy of every trained weight.
    slots = OPTIMIZER_SLOTS + (1 if ema else 0)
    private = clipping is not None
    parts = {
        "parameters": 4.0 * model.parameter_count(),
        # A private step adds the DP accumulator to the inner optimizer's slots.
        "optimizer_state": 4.0 * trained * (slots + (1 if private else 0)),
        "step_buffers": 4.0 * trained * (STEP_BUFFERS if private else 1),
        "activations": m * model.activation_bytes(4 if precision == "float32" else 2),
    }
    if not private:
        parts["clipping"] = 0.0
    elif CLIPPING[clipping] == "vectorized":
        parts["clipping"] = m * 4.0 * trained
    else:
        parts["clipping"] = m * 4.0 * _ghost_held_floats(model, precision)
    parts["total"] = sum(parts.values())
    return parts
