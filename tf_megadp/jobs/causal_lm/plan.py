"""`tf-megadp causal-lm --plan`: a causal-LM run checked and priced, without training it.

`make_plan` runs every check the job runs before it trains
(`run.prepare_run`: the settings, the data and N, a start and its ledger,
a resume's saved settings), then states what the run would do and cost:
the model and what of it trains, the data and the privacy unit, the
schedule (expected batch, micro-batches per logical step, the static
capacity and its truncation probability), the privacy plan (sigma,
epsilon at delta, a composed start), the learning rate, and from
`tf_megadp.jobs.causal_lm.cost_model` the FLOPs and memory of a
micro-batch for the non-private step and for DP with vectorized and
ghost clipping (float32, the job's precision). Nothing is written but the
prepared corpus's cache, which the run would write too.

Example:
```python
plan = make_plan(CausalLMConfig(steps=100, batch_size=128))
print(format_plan(plan))
```
"""

from __future__ import annotations

import math
from typing import Any, Callable

from tf_megadp.jobs.causal_lm.config import CausalLMConfig
from tf_megadp.jobs.causal_lm.cost_model import decoder_spec
from tf_megadp.jobs.causal_lm.families import FAMILIES
from tf_megadp.jobs.common.cost_model import CLIPPING, example_flops, memory
from tf_megadp.steps import sampling_rate_of

__all__ = ["format_plan", "make_plan"]

MIB = 2**20


def make_plan(config: CausalLMConfig, *, log: Callable[[str], None] = print
              ) -> dict[str, Any]:
    """The plan of a causal-LM run; raises `JobError` where the run would refuse.

    Args:
        config: the run, as `run_causal_lm` would take it.
        log: where the data preparation's progress lines go.

    Returns:
        A JSON-ready dict: model, data, schedule, privacy, learning rate,
        FLOPs per example and per logical step, memory per micro-batch by
        part ("non_private", "vectorized", "ghost") and the DP / non-private
        ratios of the run's clipping.
    """
    from tf_megadp.jobs.causal_lm.run import prepare_run

    run = prepare_run(config, log=log)
    config, data, schedule = run.config, run.data, run.schedule
    private = not config.non_private
    spec = decoder_spec(data.family, data.model, data.vocabulary_size, config.sequence_length,
                        data.context, config.lora_rank)
    phase = schedule.phases[0]
    capacity = schedule.capacity(phase)
    # A unit's k rows fill one slot of the sampler's micro-batch.
    rows_per_slot = config.rows_per_unit
    rows = config.micro_batch_size * rows_per_slot
    clippings = ("vectorized", "ghost")
    flops = {"non_private": spec.training_flops(),
             **{c: example_flops(spec, c) for c in clippings}}
    bytes_ = {"non_private": memory(spec, rows, None),
              **{c: memory(spec, rows, c) for c in clippings}}
    chosen = CLIPPING[config.clipping] if private else "non_private"
    learning_rate, learning_rate_source = config.learning_rate_choice()
    return {
        "output_dir": run.output_dir,
        "private": private,
        "objective": ("next token of the completion (fine-tuning)" if config.fine_tuning
                      else "next token (pretraining)"),
        "init": data.init.report(config) if data.init is not None else None,
        "model": {"family": FAMILIES[data.family].description(), "preset": data.model,
                  "layers": spec.num_layers, "hidden": spec.hidden_dim,
                  "heads": spec.num_heads, "intermediate": spec.intermediate_dim,
                  "vocabulary_size": spec.vocabulary_size, "tokens_read": spec.sequence_length,
                  "context": data.context, "lora_rank": config.lora_rank},
        "parameters": spec.parameter_count(),
        "trainable_parameters": spec.trainable_parameter_count(),
        "data": data.description,
        "privacy_unit": data.privacy_unit,
        "num_examples": schedule.num_examples,
        "training_sequences": len(data.train[1]),
        "heldout_target_tokens": float(data.test[2].sum()),
        "schedule": schedule.to_dict(),
        "logical_steps": schedule.total_steps,
        "resumed_from_step": run.logical_done,
        "batch_size": phase.batch_size,
        "sampling_rate": sampling_rate_of(phase.batch_size, schedule.num_examples),
        "micro_batch_size": config.micro_batch_size,
        "rows_per_micro_batch": rows,
        "accumulation_steps": phase.accumulation_steps,
        "capacity": capacity,
        "truncation_probability": schedule.truncation_probability(phase),
        "noise_multiplier": run.sigma if private else None,
        "epsilon": run.epsilon if private else None,
        "delta": run.delta if private else None,
        "target_epsilon": config.target_epsilon if private else None,
        "accountant": config.accountant if private else None,
        "l2_norm_clip": config.l2_norm_clip if private else None,
        "clipping": config.clipping if private else None,
        "learning_rate": learning_rate,
        "learning_rate_source": learning_rate_source,
        "flops_per_row": flops,
        # Every static slot is computed, sampled or padding.
        "flops_per_logical_step": capacity * rows_per_slot * flops[chosen],
        "memory_bytes": bytes_,
        "dp_over_non_private": {
            "flops": flops[chosen] / flops["non_private"],
            "memory": bytes_[chosen]["total"] / bytes_["non_private"]["total"],
        },
    }


def format_plan(plan: dict[str, Any]) -> str:
    """A human-readable rendering of `make_plan`'s result."""
    model = plan["model"]
    trains = (f"LoRA rank {model['lora_rank']} on query and value" if model["lora_rank"]
              else "every weight")
    lines = [
        f"plan: {plan['output_dir']} ({plan['objective']})",
        f"  model         : {model['family']} {model['preset']} ({model['layers']} layers, "
        f"hidden {model['hidden']}, {model['heads']} heads, V = {model['vocabulary_size']:,}), "
        f"reads {model['tokens_read']} tokens; {plan['parameters']:,} parameters, "
        f"{plan['trainable_parameters']:,} trained ({trains})",
        f"  data          : {plan['data']}: N = {plan['num_examples']:,} privacy units "
        f"({plan['training_sequences']:,} training rows), "
        f"{plan['heldout_target_tokens']:,.0f} held-out target tokens",
        f"  privacy unit  : {plan['privacy_unit']}",
    ]
    if plan["init"]:
        lines.append(f"  start         : {plan['init']['path']}: {plan['init']['epsilon']}")
    lines.append(
        f"  schedule      : {plan['logical_steps']:,} logical steps x B = "
        f"{plan['batch_size']:,} (q = {plan['sampling_rate']:.4g}), k = "
        f"{plan['accumulation_steps']} micro-batches of {plan['micro_batch_size']} "
        f"(capacity {plan['capacity']:,}, P[truncate] = "
        f"{plan['truncation_probability']:.2g})"
        + (f"; resumed at step {plan['resumed_from_step']:,}" if plan["resumed_from_step"]
           else ""))
    if plan["private"]:
        lines.append(
            # Rounded up: the printed epsilon is never below the accountant's.
            f"  privacy       : epsilon = {math.ceil(plan['epsilon'] * 1e4) / 1e4:.4f} at "
            f"delta = {plan['delta']:.3g} ({plan['accountant']}; target "
            f"{plan['target_epsilon']}), sigma = {plan['noise_multiplier']:.4f}, C = "
            f"{plan['l2_norm_clip']:g}, clipping {plan['clipping']}")
    else:
        lines.append("  privacy       : NON-PRIVATE baseline (no clipping, no noise)")
    lines.append(f"  learning rate : {plan['learning_rate']:g} "
                 f"({plan['learning_rate_source']})")
    flops = plan["flops_per_row"]
    lines.append(
        f"  FLOPs per row : non-private {flops['non_private']:.4g}, DP vectorized "
        f"{flops['vectorized']:.4g}, DP ghost {flops['ghost']:.4g}; "
        f"{plan['flops_per_logical_step']:.4g} per logical step")
    for name, parts in plan["memory_bytes"].items():
        lines.append(
            f"  memory        : {name.replace('_', '-')}, {plan['rows_per_micro_batch']} rows: "
            f"parameters {parts['parameters'] / MIB:.1f} + optimizer state "
            f"{parts['optimizer_state'] / MIB:.1f} + step buffers "
            f"{parts['step_buffers'] / MIB:.1f} + activations "
            f"{parts['activations'] / MIB:.1f} + clipping {parts['clipping'] / MIB:.1f} = "
            f"{parts['total'] / MIB:.1f} MiB")
    if plan["private"]:
        ratio = plan["dp_over_non_private"]
        lines.append(f"  DP / non-private: {ratio['flops']:.2f}x the FLOPs, "
                     f"{ratio['memory']:.2f}x the modelled memory")
    return "\n".join(lines)
