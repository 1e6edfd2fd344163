"""Planning a DP pretraining run on a TPU pod slice, without running it.

`make_plan` turns a YAML run description (see tpu_configs/) into the numbers
that decide whether the run fits and what it costs: per-core micro-batch,
accumulation steps and static capacity per phase, logical steps, (epsilon,
delta) from the accountant, FLOPs per logical step, a step time at the
stated peak FLOP/s, and per-core memory for parameters, optimizer state and
activations under vectorized and ghost clipping. A run that cannot work
raises `InfeasiblePlanError` naming the number that fails.

The FLOPs and memory come from `tf_megadp.jobs.bert.cost_model` (its docstring
has the arithmetic, checked against a keras-hub BERT and one measured DP
step of BERT-Large).

Correlated noise (the job's --noise, a registered mechanism of
`tf_megadp.accounting.noise`): the plan calibrates sigma for the run's
mechanism (with --bands auto, chosen first by the run's expected error:
`noise_choice`) and states what its buffers would add per core (not
counted in the memory check), as float32 copies of the trained
parameters, and what each mechanism's `plan_examples` would (every
replica streams its own share of the noise through its own buffers:
docs/tpu.md).

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
from tf_megadp.accounting.noise import noise_class, noise_kinds
from tf_megadp.jobs.bert import cost_model, initial_weights
from tf_megadp.jobs.bert.config import Hardware, PretrainError
from tf_megadp.jobs.common.privacy import default_delta
from tf_megadp.jobs.bert.config_file import load_run_config
from tf_megadp.jobs.bert.cost_model import CLIPPING, GIB, ModelSpec, model_spec
from tf_megadp.steps import noise_multiplier_of, sampling_rate_of

__all__ = [
    "InfeasiblePlanError",
    "ModelSpec",
    "Hardware",
    "load_config",
    "model_spec",
    "make_plan",
    "format_plan",
]

# Always shown side by side in a plan's memory table (and the selected one).
COMPARED = ("vectorized", "ghost")


class InfeasiblePlanError(ValueError):
    """The configuration cannot run as stated; the message names the number."""


def load_config(path: str | os.PathLike):
    """Reads a run configuration file: the job's one `PretrainConfig` reader.

    `tf-megadp plan`, `tf-megadp pretrain --config` and
    examples/pretrain_bert_mlm.py all read files this way.
    """
    return load_run_config(path)


def make_plan(config, *, vocabulary_size: int | None = None, init=None) -> dict[str, Any]:
    """The plan of a `PretrainConfig`; raises `InfeasiblePlanError` if it cannot run.

    `tf-megadp pretrain` calls this too, with the measured N and vocabulary
    size, before it trains: a run is exactly the plan that was validated.

    Args:
        config: a `PretrainConfig` with `hardware` and `num_examples`.
        vocabulary_size: V of the model, if not `config.vocabulary_size`.
        init: the `InitialWeights` of `config.init_from`, if already read
            (its shape is the model's; a DP release's ledger is composed
            into epsilon).

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
    if init is None and config.init_from and not config.resume:
        init = initial_weights.read_initial_weights(config.init_from)
    if init is not None and not config.resume:
        config = initial_weights.configured(config, init)
    prior = init.composed_ledger(config) if init is not None else None
    try:
        schedule = config.make_schedule(config.num_examples, hardware.replicas)
        # --bands auto: the mechanism's choice for this schedule and budget.
        config, noise_choice = config.with_chosen_noise(schedule)
    except PretrainError as error:
        raise InfeasiblePlanError(str(error)) from None
    model = model_spec(config, vocabulary_size)
    delta = config.delta if config.delta is not None else default_delta(config.num_examples)
    sigma = config.noise_multiplier
    if sigma is None and not config.non_private:
        sigma = accounting.calibrate_noise_multiplier(
            config.target_epsilon, delta, schedule=schedule, accountant=config.accountant,
            prior=prior, **config.noise_accounting())
    peak = hardware.peak_tflops_per_replica * 1e12 * hardware.replicas * hardware.utilization
    shown = COMPARED + ((config.clipping,) if config.clipping not in COMPARED else ())
    flops_per_slot = {c: cost_model.example_flops(model, c) for c in shown}
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
    memory = {c: cost_model.memory(model, config.micro_batch_size, c, config.precision,
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
        prior=prior, **config.noise_accounting(),
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
                                   accountant="pld", prior=prior, **config.noise_accounting()))
    total_seconds = sum(p["steps"] * p["seconds_per_logical_step"] for p in phases)
    return {
        "name": config.name or "run",
        "hardware": dataclasses.asdict(hardware),
        "model": dataclasses.asdict(model),
        "parameters": model.parameter_count(),
        "trainable_parameters": model.trainable_parameter_count(),
        "init": init.report(config) if init is not None else None,
        "micro_batch_size": config.micro_batch_size,
        "precision": config.precision,
        # The DPOptimizer's fixed loss scale (a private mixed_float16 run only).
        "loss_scale": (config.loss_scale if config.precision == "mixed_float16"
                       and not config.non_private else None),
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
        # Per core, float32 copies of the trained weights, for each
        # mechanism's examples (the optimization does not change their number).
        "noise_buffer_bytes": {
            f"{kind}_{value}": noise_class(kind).from_option(value).noise_buffers
            * 4 * model.trainable_parameter_count()
            for kind in noise_kinds() for value in noise_class(kind).plan_examples},
        # The run's own noise (--noise): its buffers per core.
        "noise": None if config.noise is None else {
            "kind": config.noise, "bands": config.bands,
            "buffer_bytes": config.noise_mechanism().noise_buffers
            * 4 * model.trainable_parameter_count()},
        # --bands auto: each candidate's expected error, and the one chosen.
        "noise_choice": noise_choice,
    }


def _costed_as(clipping: str) -> str:
    if CLIPPING[clipping] == clipping:
        return ""
    return f" (every BERT layer has a ghost rule: costed as {CLIPPING[clipping]})"


def _trained_part(model: dict[str, Any]) -> str:
    if model["lora_rank"]:
        return f" (LoRA rank {model['lora_rank']} on query and value, and the MLM head)"
    if model["freeze_embeddings"]:
        return " (embeddings frozen)"
    return ""


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
        f"seq {plan['model']['sequence_length']}), {plan['trainable_parameters']:,} trained"
        + _trained_part(plan["model"]),
        f"  micro-batch   : {plan['micro_batch_size']} per core, clipping "
        f"{plan['clipping']}{_costed_as(plan['clipping'])}, optimizer "
        f"{plan['optimizer']['name']}",
        f"  logical steps : {plan['logical_steps']:,} "
        f"({plan['examples_processed']:,} expected examples, N = {plan['num_examples']:,})",
    ]
    if plan["init"]:
        lines.append(f"  initial       : {plan['init']['path']}: {plan['init']['epsilon']}")
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
        f"{name.rsplit('_', 1)[0]} {name.rsplit('_', 1)[1]}: {value / GIB:.2f} GiB"
        for name, value in plan["noise_buffer_bytes"].items())
    noise = plan.get("noise")
    this_run = "independent noise, none" if noise is None else (
        f"{noise['kind']} with {noise['bands']}: {noise['buffer_bytes'] / GIB:.2f} GiB")
    lines.append(
        f"  noise buffers : correlated noise would add per core {buffers} (this run: "
        f"{this_run})")
    choice = plan.get("noise_choice")
    if choice is not None:
        lines.append(
            f"  noise choice  : --bands auto chose {choice['parameter']} {choice['chosen']} "
            "by the expected prefix-sum RMSE (units of C) of each candidate: " + ", ".join(
                f"{value}: {error:.4g}" for value, error in choice["expected_errors"].items()))
    return "\n".join(lines)
