"""Planning a DP pretraining run on a TPU pod slice, without running it.

`make_plan` turns a YAML run description (see tpu_configs/) into the numbers
that decide whether the run fits and what it costs: per-core micro-batch,
accumulation steps and static capacity per phase, logical steps, (epsilon,
delta) from the accountant, FLOPs per logical step, a step time at the
stated peak FLOP/s, and per-core memory for parameters, optimizer state and
activations under vectorized and ghost clipping. A run that cannot work
raises `InfeasiblePlanError` naming the number that fails.

All estimates are arithmetic on the BERT architecture (no TensorFlow):

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
  mean gradient handed to the inner optimizer); activations with bfloat16
  compute (precision mixed_bfloat16) about 34 T H + 5 heads T^2 bytes per
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
* Correlated noise (`tf_megadp.BandMF`, `tf_megadp.BLT`), which this job
  does not use yet: the plan states what its buffers would add per core,
  b - 1 float32 copies of the parameters for BandMF with b bands (b = 4,
  16, 64), d for a BLT with d buffers (every replica streams its own share
  of the noise through its own buffers: docs/tpu.md).

Example:
```python
plan = make_plan(load_config("tpu_configs/bert_large_v3_128.yaml"))   # a PretrainConfig
print(format_plan(plan))
```
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, NamedTuple

from tf_megadp import accounting
from tf_megadp.accounting.correlated_noise import NoiseStrategy
from tf_megadp.clipping_memory import outer_is_materialised
from tf_megadp.jobs.bert.config import Hardware, PretrainError, default_delta
from tf_megadp.jobs.bert.config_file import load_run_config
from tf_megadp.steps import noise_multiplier_of, sampling_rate_of

__all__ = [
    "InfeasiblePlanError",
    "ModelSpec",
    "OuterRecord",
    "Hardware",
    "load_config",
    "model_spec",
    "make_plan",
    "format_plan",
]

GIB = 2**30
# Float32 slots the job's inner optimizer (AdamW: two moments) keeps per parameter.
OPTIMIZER_SLOTS = 2
# The clipping methods a plan accepts, each with the cost model it follows.
# Under "auto" every layer of a BERT masked LM has a ghost rule (the test of
# the records pins that no layer gets the exact fallback), so its step is
# ghost's step.
CLIPPING = {"vectorized": "vectorized", "ghost": "ghost", "auto": "ghost"}
# The bands whose noise buffers every plan states (issue 39).
NOISE_BANDS = (4, 16, 64)
# Always shown side by side in a plan's memory table (and the selected one).
COMPARED = ("vectorized", "ghost")


class InfeasiblePlanError(ValueError):
    """The configuration cannot run as stated; the message names the number."""


class OuterRecord(NamedTuple):
    """The shape of one ghost Outer record (`tf_megadp.clipping.terms.Outer`).

    Args:
        tokens: T, the rows of both factors.
        left: p, the width of the left factor.
        right: d, the width of the right factor.
        gradient: which factor is the output gradient, "left" or "right";
            the other is a layer input.
        input: a name of that layer input; records with the same name read
            the same tensor.
    """

    tokens: int
    left: int
    right: int
    gradient: str
    input: str


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A BERT masked-LM architecture.

    Args:
        num_layers, hidden_dim, num_heads, intermediate_dim, vocabulary_size:
            the encoder.
        sequence_length: T, tokens per sequence (one privacy unit).
        max_predictions: P, masked positions per sequence.
        type_vocabulary_size: segment ids.
    """

    num_layers: int
    hidden_dim: int
    num_heads: int
    intermediate_dim: int
    vocabulary_size: int
    sequence_length: int
    max_predictions: int
    type_vocabulary_size: int = 2

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{field.name} must be a positive integer, got {value!r}.")
        if self.hidden_dim % self.num_heads:
            raise ValueError(
                f"model.hidden_dim {self.hidden_dim} is not divisible by num_heads "
                f"{self.num_heads}."
            )
        if self.max_predictions > self.sequence_length:
            raise ValueError(
                f"model.max_predictions {self.max_predictions} exceeds sequence_length "
                f"{self.sequence_length}."
            )

    def outer_records(self) -> list[OuterRecord]:
        """Every dense kernel's ghost Outer record, head included (module docstring).

        Returns:
            Per kernel: tokens T, width p of the record's left factor and d
            of its right one, which factor is the output gradient and the
            layer input the other factor is. For a dense layer the left
            factor is its input and the right one its output gradient; the
            query, key and value kernels of a layer read the same input.
            For the tied MLM decoder (logits = h E^T) the left factor is the
            V-wide logit gradient and the right one the h-wide hidden state
            (`ReversibleEmbeddingRule`).
        """
        t, h, i = self.sequence_length, self.hidden_dim, self.intermediate_dim
        records = []
        for n in range(self.num_layers):
            records += [OuterRecord(t, h, h, "right", f"{n}.attention")] * 3  # query, key, value
            records += [OuterRecord(t, h, h, "right", f"{n}.context"),
                        OuterRecord(t, h, i, "right", f"{n}.mlp"),
                        OuterRecord(t, i, h, "right", f"{n}.intermediate")]
        p = self.max_predictions
        return records + [OuterRecord(p, h, h, "right", "head"),
                          OuterRecord(p, self.vocabulary_size, h, "left", "decoder")]

    def dense_layers(self) -> list[tuple[int, int, int]]:
        """(T, p, d) of every `outer_records` record: the shapes the FLOPs follow."""
        return [(r.tokens, r.left, r.right) for r in self.outer_records()]

    def embedding_lookups(self) -> list[tuple[int, int]]:
        """(tokens, width) of the token, position and segment lookups (Gather records)."""
        return [(self.sequence_length, self.hidden_dim)] * 3

    def small_parameter_count(self) -> int:
        """Biases and LayerNorm scales and offsets that get a gradient from the MLM loss.

        Ghost clipping records their per-example gradients explicitly.
        """
        h, i = self.hidden_dim, self.intermediate_dim
        layer = 4 * h + i + h + 2 * 2 * h  # attention and MLP biases, two LayerNorms
        head = h + 2 * h + self.vocabulary_size  # transform bias, its LayerNorm, output bias
        return 2 * h + self.num_layers * layer + head  # embedding LayerNorm first

    def parameter_count(self) -> int:
        """Trainable parameters (the MLM decoder shares the token embedding)."""
        h, i, v = self.hidden_dim, self.intermediate_dim, self.vocabulary_size
        embeddings = (v + self.sequence_length + self.type_vocabulary_size) * h + 2 * h
        layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h
        head = (h * h + h) + 2 * h + v  # transform, its LayerNorm, output bias
        pooler = h * h + h
        return embeddings + self.num_layers * layer + head + pooler

    def forward_flops(self) -> float:
        """FLOPs of one sequence's forward pass."""
        dense = sum(2.0 * t * p * d for t, p, d in self.dense_layers())
        attention = self.num_layers * 4.0 * self.sequence_length**2 * self.hidden_dim
        return dense + attention

    def activation_bytes(self, bytes_per_value: int = 2) -> float:
        """Activation memory of one sequence kept for the backward pass.

        Args:
            bytes_per_value: 2 for bfloat16 compute (mixed_bfloat16), 4 for float32.
        """
        t, h = self.sequence_length, self.hidden_dim
        per_layer = (34.0 * t * h + 5.0 * self.num_heads * t * t) * bytes_per_value / 2
        logits = 4.0 * self.max_predictions * self.vocabulary_size
        return self.num_layers * per_layer + logits


def load_config(path: str | os.PathLike):
    """Reads a run configuration file: the job's one `PretrainConfig` reader.

    `tf-megadp plan`, `tf-megadp pretrain --config` and
    examples/pretrain_bert_mlm.py all read files this way.
    """
    return load_run_config(path)


def model_spec(config, vocabulary_size: int | None = None) -> ModelSpec:
    """The architecture a `PretrainConfig` trains (V from the config unless given)."""
    layers, hidden, heads, intermediate = config.architecture()
    return ModelSpec(
        num_layers=layers, hidden_dim=hidden, num_heads=heads, intermediate_dim=intermediate,
        vocabulary_size=vocabulary_size or config.vocabulary_size,
        sequence_length=config.sequence_length,
        max_predictions=config.max_predictions or math.ceil(0.15 * config.sequence_length),
    )


def _ghost_clipping_flops(model: ModelSpec) -> float:
    """FLOPs per example ghost clipping adds to the 3 F of training (module docstring)."""
    flops = 0.0
    for t, p, d in model.dense_layers():
        if outer_is_materialised(t, p, d):
            flops += 4.0 * p * d  # norm and clipped sum read off the built [p, d] gradient
        else:
            # Two Grams, their product and sum; the clip factors scale the left factor.
            flops += 2.0 * t * t * (p + d) + 2.0 * t * t + t * p
    for t, width in model.embedding_lookups():
        flops += 2.0 * t * t * (width + 1) + 2.0 * t * width
    # Cross term of the tied decoder's Outer record with the token lookup.
    flops += 2.0 * model.max_predictions * model.sequence_length * (model.hidden_dim + 1)
    return flops + 4.0 * model.small_parameter_count()


def _example_flops(model: ModelSpec, clipping: str) -> float:
    training = 3.0 * model.forward_flops()
    if CLIPPING[clipping] == "vectorized":
        return training + 4.0 * model.parameter_count()
    return training + _ghost_clipping_flops(model)


# Float32 gradients the DP step holds besides its state: the micro-batch's
# clipped sum (before it enters the accumulator) and the noisy mean gradient
# handed to the inner optimizer.
STEP_BUFFERS = 2


def _ghost_held_floats(model: ModelSpec, precision: str) -> float:
    """Float32 values per example ghost clipping holds until its clipped sums (module docstring)."""
    floats = 0.0
    copied_inputs = {}
    for record in model.outer_records():
        t, p, d = record.tokens, record.left, record.right
        if outer_is_materialised(t, p, d):
            floats += p * d  # the built [p, d] gradient; its factors are no longer needed
            continue
        gradient, layer_input = (d, p) if record.gradient == "right" else (p, d)
        floats += t * gradient + 2.0 * t * t  # the output-gradient factor; the two Grams
        copied_inputs[record.input] = t * layer_input  # one cast per input tensor
    if precision != "float32":
        # The float32 casts of bfloat16 layer inputs (`flat_tokens`); in
        # float32 the factor is the activation itself, counted there.
        floats += sum(copied_inputs.values())
    floats += sum(t * width for t, width in model.embedding_lookups())  # Gather values
    return floats + model.small_parameter_count()  # Explicit records


def _memory(model: ModelSpec, m: int, clipping: str, precision: str,
            ema: bool = False) -> dict[str, float]:
    params = model.parameter_count()
    # Keras's use_ema keeps one more float32 copy of every weight.
    slots = OPTIMIZER_SLOTS + (1 if ema else 0)
    memory = {
        "parameters": 4.0 * params,
        "optimizer_state": 4.0 * params * (slots + 1),
        "step_buffers": 4.0 * params * STEP_BUFFERS,
        "activations": m * model.activation_bytes(4 if precision == "float32" else 2),
    }
    if CLIPPING[clipping] == "vectorized":
        memory["clipping"] = m * 4.0 * params
    else:
        memory["clipping"] = m * 4.0 * _ghost_held_floats(model, precision)
    memory["total"] = sum(memory.values())
    return memory


def make_plan(config, *, vocabulary_size: int | None = None) -> dict[str, Any]:
    """The plan of a `PretrainConfig`; raises `InfeasiblePlanError` if it cannot run.

    `tf-megadp pretrain` calls this too, with the measured N and vocabulary
    size, before it trains: a run is exactly the plan that was validated.

    Args:
        config: a `PretrainConfig` with `hardware` and `num_examples`.
        vocabulary_size: V of the model, if not `config.vocabulary_size`.

    Returns:
        A JSON-ready dict: per phase k_t, capacity, expected batch, sampling
        rate and truncation probability; totals; epsilon; FLOPs; step times;
        FLOPs per example and memory for vectorized, ghost and the selected
        clipping.

    Raises:
        InfeasiblePlanError: memory over the per-core HBM, a phase whose
            static capacity truncates too often, or epsilon over the target.
    """
    hardware = config.hardware
    if hardware is None:
        raise InfeasiblePlanError(
            "the run configuration has no hardware section (replicas, "
            "hbm_gib_per_replica, peak_tflops_per_replica) to plan for.")
    if config.num_examples is None:
        raise InfeasiblePlanError(
            "the run configuration needs training.num_examples (N, the privacy units) "
            "to plan the sampling rates and epsilon.")
    if config.clipping not in CLIPPING:
        raise InfeasiblePlanError(
            f"training.clipping must be one of {', '.join(CLIPPING)} to be planned, got "
            f"{config.clipping!r}.")
    try:
        schedule = config.make_schedule(config.num_examples, hardware.replicas)
    except PretrainError as error:
        raise InfeasiblePlanError(str(error)) from None
    model = model_spec(config, vocabulary_size)
    delta = config.delta if config.delta is not None else default_delta(config.num_examples)
    sigma = config.noise_multiplier
    if sigma is None and not config.non_private:
        sigma = accounting.calibrate_noise_multiplier(
            config.target_epsilon, delta, schedule=schedule, accountant=config.accountant)
    peak = hardware.peak_tflops_per_replica * 1e12 * hardware.replicas * hardware.utilization
    shown = COMPARED + ((config.clipping,) if config.clipping not in COMPARED else ())
    flops_per_slot = {c: _example_flops(model, c) for c in shown}
    phases = []
    for index, phase in enumerate(schedule.phases):
        capacity = schedule.capacity(phase)
        truncation = schedule.truncation_probability(phase)
        if truncation > config.max_truncation_probability:
            raise InfeasiblePlanError(
                f"phase {index}: truncation probability {truncation:.3g} per step exceeds "
                f"max_truncation_probability {config.max_truncation_probability:g} "
                f"(capacity {capacity} = {phase.accumulation_steps} x "
                f"{config.micro_batch_size} x {hardware.replicas} for expected batch "
                f"{phase.batch_size}). Raise accumulation_steps."
            )
        flops = capacity * flops_per_slot[config.clipping]
        phases.append({
            "steps": phase.steps,
            "batch_size": phase.batch_size,
            "accumulation_steps": phase.accumulation_steps,
            "capacity": capacity,
            "sampling_rate": sampling_rate_of(phase.batch_size, schedule.num_examples),
            "truncation_probability": truncation,
            "noise_multiplier": noise_multiplier_of(phase, sigma),
            "flops_per_logical_step": flops,
            "seconds_per_logical_step": flops / peak,
        })
    memory = {c: _memory(model, config.micro_batch_size, c, config.precision,
                         ema=config.ema_momentum is not None) for c in shown}
    hbm = hardware.hbm_gib_per_replica * GIB
    needed = memory[config.clipping]["total"]
    if needed > hbm:
        raise InfeasiblePlanError(
            f"per-core memory {needed / GIB:.2f} GiB with {config.clipping} clipping at "
            f"micro_batch_size {config.micro_batch_size} exceeds the "
            f"{hardware.hbm_gib_per_replica:g} GiB HBM of a {hardware.name} core "
            f"(parameters {memory[config.clipping]['parameters'] / GIB:.2f}, optimizer state "
            f"{memory[config.clipping]['optimizer_state'] / GIB:.2f}, step buffers "
            f"{memory[config.clipping]['step_buffers'] / GIB:.2f}, activations "
            f"{memory[config.clipping]['activations'] / GIB:.2f}, clipping "
            f"{memory[config.clipping]['clipping'] / GIB:.2f} GiB). Lower micro_batch_size "
            "(and raise accumulation_steps)"
            + (" or use ghost clipping." if CLIPPING[config.clipping] == "vectorized" else ".")
        )
    epsilon = math.inf if config.non_private else accounting.compute_epsilon(
        delta=delta, schedule=schedule, noise_multiplier=sigma, accountant=config.accountant,
    )
    if config.target_epsilon is not None and epsilon > config.target_epsilon:
        raise InfeasiblePlanError(
            f"epsilon {epsilon:.4g} at delta {delta:g} ({config.accountant}) exceeds "
            f"target_epsilon {config.target_epsilon:g}. Raise noise_multiplier (now "
            f"{sigma:g}) or take fewer steps."
        )
    # The run reports the epsilon of its own accountant; beside an RDP figure
    # the plan gives PLD's (tighter) for the same schedule and sigma.
    epsilon_pld = epsilon if config.non_private or config.accountant == "pld" else (
        accounting.compute_epsilon(delta=delta, schedule=schedule, noise_multiplier=sigma,
                                   accountant="pld"))
    total_seconds = sum(p["steps"] * p["seconds_per_logical_step"] for p in phases)
    return {
        "name": config.name or "run",
        "hardware": dataclasses.asdict(hardware),
        "model": dataclasses.asdict(model),
        "parameters": model.parameter_count(),
        "micro_batch_size": config.micro_batch_size,
        "precision": config.precision,
        "replicas": hardware.replicas,
        "clipping": config.clipping,
        "optimizer": {"name": "adamw", "learning_rate": config.learning_rate_choice()[0],
                      "weight_decay": config.weight_decay, "beta_1": config.beta_1,
                      "beta_2": config.beta_2, "warmup_steps": config.warmup_steps},
        "schedule": schedule.to_dict(),
        "num_examples": schedule.num_examples,
        "logical_steps": schedule.total_steps,
        "examples_processed": schedule.examples_processed(),
        "phases": phases,
        "epsilon": epsilon,
        "epsilon_pld": epsilon_pld,
        "delta": delta,
        "target_epsilon": config.target_epsilon,
        "accountant": config.accountant,
        "noise_multiplier": sigma,
        "l2_norm_clip": config.l2_norm_clip,
        "flops_per_example": flops_per_slot,
        "training_seconds": total_seconds,
        "memory_bytes": memory,
        "hbm_bytes": hbm,
        # Per core, float32, for BandMF(num_bands=b) with the given
        # coefficients' shape (the optimization does not change their number).
        "noise_buffer_bytes": {
            f"bandmf_{bands}": NoiseStrategy(
                "bandmf", (1.0,) * bands).buffer_bytes(model.parameter_count())
            for bands in NOISE_BANDS},
    }


def _costed_as(clipping: str) -> str:
    if CLIPPING[clipping] == clipping:
        return ""
    return f" (every BERT layer has a ghost rule: costed as {CLIPPING[clipping]})"


def format_plan(plan: dict[str, Any]) -> str:
    """A human-readable rendering of `make_plan`'s result."""
    hw = plan["hardware"]
    lines = [
        f"plan: {plan['name']}",
        f"  hardware      : {hw['name']}, {plan['replicas']} replicas, "
        f"{hw['hbm_gib_per_replica']:g} GiB HBM and {hw['peak_tflops_per_replica']:g} "
        f"TFLOP/s peak per replica (utilization {hw['utilization']:g})",
        f"  model         : {plan['parameters']:,} parameters "
        f"({plan['model']['num_layers']} layers, hidden {plan['model']['hidden_dim']}, "
        f"seq {plan['model']['sequence_length']})",
        f"  micro-batch   : {plan['micro_batch_size']} per core, clipping "
        f"{plan['clipping']}{_costed_as(plan['clipping'])}, optimizer "
        f"{plan['optimizer']['name']}",
        f"  logical steps : {plan['logical_steps']:,} "
        f"({plan['examples_processed']:,} expected examples, N = {plan['num_examples']:,})",
    ]
    for index, phase in enumerate(plan["phases"]):
        lines.append(
            f"  phase {index}       : {phase['steps']:,} steps x B = {phase['batch_size']:,}, "
            f"k = {phase['accumulation_steps']} micro-steps (capacity {phase['capacity']:,}, "
            f"P[truncate] = {phase['truncation_probability']:.2g}), sigma = "
            f"{phase['noise_multiplier']:g}, {phase['flops_per_logical_step']:.3e} FLOPs, "
            f"{phase['seconds_per_logical_step']:.3g} s/step"
        )
    lines.append(
        # Rounded up: the printed epsilon is never below the accountant's.
        f"  privacy       : epsilon = {math.ceil(plan['epsilon'] * 1e4) / 1e4:.4f} at "
        f"delta = {plan['delta']:g} "
        f"({plan['accountant']}; target {plan['target_epsilon']}), C = {plan['l2_norm_clip']:g}"
    )
    if plan["accountant"] != "pld":
        lines.append(
            f"  privacy (PLD) : epsilon = {math.ceil(plan['epsilon_pld'] * 1e4) / 1e4:.4f} for "
            f"the same steps and sigma; the run reports its accountant's epsilon "
            f"({plan['accountant'].upper()} here: --accountant pld for the PLD figure)")
    lines.append(f"  training time : {plan['training_seconds'] / 3600:.1f} h at {hw['utilization']:.0%} of peak")
    for clipping, memory in plan["memory_bytes"].items():
        mark = " (selected)" if clipping == plan["clipping"] else ""
        lines.append(
            f"  memory/core   : {clipping}{mark}: parameters {memory['parameters'] / GIB:.2f} + "
            f"optimizer state {memory['optimizer_state'] / GIB:.2f} + step buffers "
            f"{memory['step_buffers'] / GIB:.2f} + activations "
            f"{memory['activations'] / GIB:.2f} + clipping {memory['clipping'] / GIB:.2f} = "
            f"{memory['total'] / GIB:.2f} GiB of {plan['hbm_bytes'] / GIB:g}"
        )
    buffers = ", ".join(
        f"b = {name.split('_')[1]}: {value / GIB:.2f} GiB"
        for name, value in plan["noise_buffer_bytes"].items())
    lines.append(
        f"  noise buffers : correlated noise (BandMF, b - 1 model copies) would add per core "
        f"{buffers} (this run: independent noise, none)")
    return "\n".join(lines)
