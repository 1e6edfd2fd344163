"""The checks of a `DPOptimizer`'s privacy settings, which are fixed at construction."""

from __future__ import annotations

import inspect
import math

import keras
import tensorflow as tf

from tf_megadp import adaptive_clipping as adaptive
from tf_megadp.accounting.mechanisms import gradient_noise_multiplier
from tf_megadp.clipping import ClippingStrategy
from tf_megadp.distribute import check_schedule_matches_strategy
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.steps import noise_multiplier_of

# Settings that fix the privacy of every step; they cannot change after
# construction (Keras caches the compiled step, so a change would be recorded
# but not used).
_FROZEN_SETTINGS = frozenset({
    "l2_norm_clip", "noise_multiplier", "accumulation_steps", "normalize_by",
    "seed", "schedule", "clipping", "clipping_strategy", "inner_optimizer",
    "per_example_scaling", "automatic_scaling_stability", "examples_per_unit",
    "adaptive_clipping",
})
_PER_EXAMPLE_SCALINGS = frozenset({"clip", "automatic"})


def _positive_finite(name: str, value, allow_zero: bool = False) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}.") from None
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}.")
    return number


def _check_inner_does_not_rescale(optimizer: keras.optimizers.Optimizer) -> None:
    """Refuses inner optimizers that rescale the loss or average updates.

    The DP step clips unscaled per-example gradients and never calls
    `scale_loss`, so a loss-scaling wrapper (LossScaleOptimizer and its kin)
    would divide every noisy update by its scale; Keras's own gradient
    accumulation would average several noisy steps into one update that the
    ledger counts as several.
    """
    if getattr(optimizer, "loss_scale_factor", None):
        raise PrivacyConfigurationError(
            "The inner optimizer has loss_scale_factor set; the DP step does "
            "not scale losses, so the update would be rescaled after "
            "clipping. Remove loss_scale_factor."
        )
    if type(optimizer).scale_loss is not keras.optimizers.Optimizer.scale_loss:
        raise PrivacyConfigurationError(
            f"{type(optimizer).__name__} rescales the loss (a loss-scaling "
            "wrapper such as LossScaleOptimizer): the DP step clips unscaled "
            "gradients, so every update would be divided by the loss scale. Wrap "
            "the plain optimizer (e.g. DPOptimizer(keras.optimizers.SGD(...))); "
            "for mixed precision use the 'mixed_bfloat16' policy, which needs no "
            "loss scaling."
        )
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise PrivacyConfigurationError(
            "The inner optimizer has gradient_accumulation_steps set: Keras would "
            "average several noisy updates into one. Accumulate with "
            "DPOptimizer(accumulation_steps=...) or a BatchSizeSchedule instead."
        )


def _check_takes_automatic_stability(strategy: ClippingStrategy) -> None:
    """Automatic clipping needs a strategy whose `clip_and_sum` takes `automatic_stability`.

    The DP step passes the keyword only for automatic clipping, so a strategy
    written for flat clipping would otherwise fail with a bare TypeError at
    the first step.
    """
    parameters = inspect.signature(strategy.clip_and_sum).parameters.values()
    if not any(p.name == "automatic_stability" or p.kind is p.VAR_KEYWORD for p in parameters):
        raise TypeError(
            f"per_example_scaling='automatic' needs a clipping strategy whose "
            f"clip_and_sum accepts `automatic_stability`; {type(strategy).__name__}."
            "clip_and_sum does not. Add the argument (pass it to "
            "tf_megadp.clipping.base.clip_factors), or use per_example_scaling='clip'."
        )


def _check_adaptive_clipping(config, per_example_scaling, noise_multiplier, schedule,
                             normalize_by, l2_norm_clip) -> adaptive.AdaptiveClipping | None:
    """The `AdaptiveClipping` of a DPOptimizer, refused where it cannot hold.

    Every (sigma, expected batch) pair known before training is checked
    here: the count's noise must leave room for the gradient's.
    """
    if config is None:
        return None
    if isinstance(config, dict):
        config = adaptive.AdaptiveClipping.from_dict(config)
    if not isinstance(config, adaptive.AdaptiveClipping):
        raise TypeError(
            f"adaptive_clipping must be a tf_megadp.AdaptiveClipping, got {config!r}.")
    if per_example_scaling == "automatic":
        raise PrivacyConfigurationError(
            "adaptive_clipping with per_example_scaling='automatic': automatic clipping "
            "normalizes every gradient to norm C, so C only rescales the update and has no "
            "quantile to follow. Use per_example_scaling='clip' with adaptive clipping.")
    config.clip_norm_bounds(l2_norm_clip)  # The initial C lies in C's range.
    if schedule is not None:
        for phase in schedule.phases:
            sigma = noise_multiplier_of(phase, noise_multiplier)
            gradient_noise_multiplier(
                sigma, config.count_stddev_for(phase.batch_size, sigma))
    elif normalize_by is not None or config.count_stddev is not None:
        gradient_noise_multiplier(
            noise_multiplier, config.count_stddev_for(normalize_by or 0.0, noise_multiplier))
    return config


def _check_adaptive_pair(config, noise_multiplier: float, batch_size: float) -> None:
    """Refuses, before training, adaptive clipping whose count spends more than sigma."""
    gradient_noise_multiplier(
        noise_multiplier, config.count_stddev_for(batch_size, noise_multiplier))


def _check_schedule_layout(schedule, micro_batch_size) -> None:
    """A logical step is k_t micro-steps of one m-sized micro-batch per replica.

    A schedule planned for another micro-batch size or replica count would
    make each logical step hold other examples than the sampler drew and the
    accountant composed.
    """
    check_schedule_matches_strategy(schedule, tf.distribute.get_strategy())
    if isinstance(micro_batch_size, int) and micro_batch_size != schedule.micro_batch_size:
        raise PrivacyConfigurationError(
            f"Each replica's micro-batch has {micro_batch_size} examples but the "
            f"schedule was planned for micro_batch_size="
            f"{schedule.micro_batch_size}. Feed micro-batches of that size "
            "per replica, or rebuild the schedule."
        )

