"""`DPSettings`: the privacy settings of a `DPOptimizer`, validated once and frozen.

Every setting that fixes the privacy of a step is one field of `DPSettings`.
The dataclass is frozen (Keras compiles the train step once, so a changed
setting would be recorded but not used), validated in `__post_init__`,
serialized by `to_config` (the `DPOptimizer`'s `get_config`) and reported by
`report` (the privacy report's `settings`), all from the same fields: a new
setting is one field here (and one argument of `DPOptimizer`), and cannot be
missed by the freeze, the saved config or the report.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import keras
import tensorflow as tf

from tf_megadp import adaptive_clipping as adaptive
from tf_megadp.accounting.noise import (
    NoiseMechanism,
    NoiseStrategy,
    mechanism_from_dict,
    noise_kinds,
    resolve_noise,
)
from tf_megadp.accounting.mechanisms import gradient_noise_multiplier
from tf_megadp.clipping import ClippingStrategy, get_clipping_strategy
from tf_megadp.distribute import check_schedule_matches_strategy
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.steps import BatchSizeSchedule, noise_multiplier_of

__all__ = ["DPSettings", "SETTING_NAMES", "check_inner_optimizer"]

_PER_EXAMPLE_SCALINGS = frozenset({"clip", "automatic"})


@dataclasses.dataclass(frozen=True)
class DPSettings:
    """The privacy settings of a `DPOptimizer` (its arguments but the inner optimizer).

    Validated once, at construction; frozen, so no setting can change once
    a step was compiled with it. `DPOptimizer` reads each field as an
    attribute of the same name (`optimizer.l2_norm_clip`); see `DPOptimizer`
    for what each means.

    Args:
        l2_norm_clip: C > 0.
        noise_multiplier: sigma >= 0.
        accumulation_steps: micro-batches per logical step (1 when None);
            None with a `schedule`, whose phases set it.
        normalize_by: the divisor B of the noisy sum, or None.
        seed: None (OS entropy) or an int (reproducible noise, not private).
        schedule: a `BatchSizeSchedule` (or its dict), or None.
        clipping: "auto", "ghost", "vectorized" or a `ClippingStrategy`.
        per_example_scaling: "clip" or "automatic".
        automatic_scaling_stability: gamma > 0 of automatic clipping.
        examples_per_unit: k >= 1 rows per privacy unit.
        adaptive_clipping: a `tf_megadp.AdaptiveClipping` (or its dict), or None.
        loss_scale: a fixed loss scale S > 0 (mixed_float16), or None.
        noise: None (independent noise), or a registered noise mechanism
            (`tf_megadp.accounting.noise`, or its `to_dict`).

    Raises:
        ValueError, TypeError, PrivacyConfigurationError: a setting is out of
            range or contradicts another, with a message naming the fix.

    Example:
    ```python
    settings = DPSettings(l2_norm_clip=1.0, noise_multiplier=1.1, accumulation_steps=4)
    DPSettings(**settings.to_config()) == settings  # True
    ```
    """

    l2_norm_clip: float
    noise_multiplier: float
    accumulation_steps: int | None = None
    normalize_by: float | None = None
    seed: int | None = None
    schedule: BatchSizeSchedule | None = None
    clipping: str | ClippingStrategy = "auto"
    per_example_scaling: str = "clip"
    automatic_scaling_stability: float = 0.01
    examples_per_unit: int = 1
    adaptive_clipping: adaptive.AdaptiveClipping | None = None
    loss_scale: float | None = None
    noise: NoiseMechanism | None = None

    def __post_init__(self):
        self._set("l2_norm_clip", _positive_finite("l2_norm_clip", self.l2_norm_clip))
        self._set("noise_multiplier", _positive_finite(
            "noise_multiplier", self.noise_multiplier, allow_zero=True))
        schedule = self.schedule
        if isinstance(schedule, dict):
            schedule = BatchSizeSchedule.from_dict(schedule)
        if schedule is not None and not isinstance(schedule, BatchSizeSchedule):
            raise TypeError(f"schedule must be a BatchSizeSchedule, got {schedule!r}.")
        self._set("schedule", schedule)
        if schedule is not None and (self.accumulation_steps is not None
                                     or self.normalize_by is not None):
            raise ValueError(
                "With a schedule, accumulation_steps and normalize_by come from "
                "its phases; do not pass them to DPOptimizer as well."
            )
        if schedule is None:
            steps = 1 if self.accumulation_steps is None else self.accumulation_steps
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
                raise ValueError(f"accumulation_steps must be an integer >= 1, got {steps!r}.")
            self._set("accumulation_steps", steps)
        if self.normalize_by is not None:
            self._set("normalize_by", _positive_finite("normalize_by", self.normalize_by))
        if self.per_example_scaling not in _PER_EXAMPLE_SCALINGS:
            raise ValueError(
                f"per_example_scaling must be one of {sorted(_PER_EXAMPLE_SCALINGS)}, "
                f"got {self.per_example_scaling!r}."
            )
        self._set("automatic_scaling_stability", _positive_finite(
            "automatic_scaling_stability", self.automatic_scaling_stability))
        units = self.examples_per_unit
        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise ValueError(f"examples_per_unit must be an integer >= 1, got {units!r}.")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be None or an int, got {seed!r}.")
        self._set("adaptive_clipping", self._checked_adaptive_clipping())
        if self.loss_scale is not None:
            self._set("loss_scale", _positive_finite("loss_scale", self.loss_scale))
        self._set("noise", self._checked_noise())
        if self.noise is not None:
            self.noise_strategy()  # Refuses a strategy the run cannot have (b > n) now.
        if isinstance(self.clipping, ClippingStrategy):
            if self.per_example_scaling == "automatic":
                _check_takes_argument(self.clipping, "automatic_stability",
                                      "per_example_scaling='automatic'",
                                      "pass it to tf_megadp.clipping.base.clip_factors",
                                      "use per_example_scaling='clip'")
            if self.loss_scale is not None:
                _check_takes_argument(self.clipping, "loss_scale", "loss_scale",
                                      "multiply each example's loss by it and divide its "
                                      "gradient by it in float32 before the norm",
                                      "use clipping='vectorized' or 'auto'")
        else:
            get_clipping_strategy(self.clipping)  # Raises for an unknown name.

    def _set(self, name: str, value) -> None:
        # The frozen dataclass's own way to store a normalized value.
        object.__setattr__(self, name, value)

    def _checked_adaptive_clipping(self) -> adaptive.AdaptiveClipping | None:
        """The `AdaptiveClipping`, refused where it cannot hold.

        Every (sigma, expected batch) pair known before training is checked
        here: the count's noise must leave room for the gradient's.
        """
        config = self.adaptive_clipping
        if config is None:
            return None
        if isinstance(config, dict):
            config = adaptive.AdaptiveClipping.from_dict(config)
        if not isinstance(config, adaptive.AdaptiveClipping):
            raise TypeError(
                f"adaptive_clipping must be a tf_megadp.AdaptiveClipping, got {config!r}.")
        if self.per_example_scaling == "automatic":
            raise PrivacyConfigurationError(
                "adaptive_clipping with per_example_scaling='automatic': automatic clipping "
                "normalizes every gradient to norm C, so C only rescales the update and has "
                "no quantile to follow. Use per_example_scaling='clip' with adaptive "
                "clipping.")
        config.clip_norm_bounds(self.l2_norm_clip)  # The initial C lies in C's range.
        if self.schedule is not None:
            for phase in self.schedule.phases:
                sigma = noise_multiplier_of(phase, self.noise_multiplier)
                gradient_noise_multiplier(
                    sigma, config.count_stddev_for(phase.batch_size, sigma))
        elif self.normalize_by is not None or config.count_stddev is not None:
            gradient_noise_multiplier(self.noise_multiplier, config.count_stddev_for(
                self.normalize_by or 0.0, self.noise_multiplier))
        return config

    def _checked_noise(self) -> NoiseMechanism | None:
        """The noise mechanism, refused where its noise cannot be streamed.

        Its strategy is sigma C^{-1} z for one sigma: a schedule whose phases
        set other noise multipliers, or sigma = 0, has none. A strategy
        optimized for the run's steps (`needs_run_length`) needs a schedule.
        """
        noise = self.noise
        if isinstance(noise, dict):
            noise = mechanism_from_dict(noise)
        if noise is None:
            return None
        if not isinstance(noise, NoiseMechanism):
            raise TypeError(f"noise must be None or a registered noise mechanism "
                            f"({list(noise_kinds())}), got {noise!r}.")
        if self.noise_multiplier == 0:
            raise PrivacyConfigurationError(
                f"noise={noise!r} with noise_multiplier=0 adds no noise to correlate: the "
                "run would not be private. Set noise_multiplier > 0, or noise=None for the "
                "clipped, non-private baseline.")
        phases = self.schedule.phases if self.schedule is not None else ()
        sigmas = {noise_multiplier_of(phase, self.noise_multiplier) for phase in phases}
        if len(sigmas) > 1:
            raise PrivacyConfigurationError(
                f"Correlated noise ({noise.kind}) streams sigma C^-1 z with one sigma, but the "
                f"schedule's phases set the noise multipliers {sorted(sigmas)}. Leave "
                "noise_multiplier unset on the phases (one sigma for the run), or use "
                "noise=None.")
        if self.schedule is None and noise.needs_run_length:
            raise PrivacyConfigurationError(
                f"{noise!r} is optimized (or scaled) for the run's steps, which only a "
                "schedule gives: build the DPOptimizer with schedule=sampler.schedule (the "
                "sampler's), or give the mechanism its numbers.")
        return noise

    # -- Derived values ----------------------------------------------------------

    def noise_strategy(self) -> NoiseStrategy:
        """The strategy the noise streams: the mechanism resolved for the run.

        For the schedule's n steps (and its epochs of s = N // B steps, the
        fixed-order sampler's); C = I without `noise`. Without a schedule,
        a mechanism that does not depend on the run's length (checked) is
        resolved without one.
        """
        if self.noise is None or self.schedule is None:
            return resolve_noise(self.noise, None)
        schedule = self.schedule
        steps_per_epoch = schedule.num_examples // schedule.phases[0].batch_size
        return resolve_noise(self.noise, schedule.total_steps,
                             steps_per_epoch=max(1, steps_per_epoch))

    @property
    def automatic_stability(self) -> float | None:
        """gamma of automatic clipping, or None for flat clipping (what strategies take)."""
        if self.per_example_scaling == "automatic":
            return self.automatic_scaling_stability
        return None

    @property
    def clipping_name(self) -> str:
        """The clipping strategy's name (a strategy instance's class name)."""
        if isinstance(self.clipping, ClippingStrategy):
            return type(self.clipping).__name__
        return self.clipping

    @property
    def noiseless(self) -> bool:
        """Whether some step adds no noise (sigma = 0 here or in a phase): no privacy."""
        phases = self.schedule.phases if self.schedule is not None else ()
        return self.noise_multiplier == 0 or any(p.noise_multiplier == 0 for p in phases)

    def with_schedule(self, schedule: BatchSizeSchedule) -> "DPSettings":
        """These settings on an extended schedule, validated again (its new phases too)."""
        return dataclasses.replace(self, schedule=schedule)

    def check_step_layout(self, micro_batch_size, replicas: int) -> None:
        """Checks, when a step is traced, that its micro-batches fit these settings.

        A schedule planned for another micro-batch size or replica count would
        make each logical step hold other examples than the sampler drew and
        the accountant composed; adaptive clipping's count must leave room for
        the gradient's noise at the batch the step divides by.

        Args:
            micro_batch_size: m, a Python int when the shape is static.
            replicas: the strategy's replicas in sync.

        Raises:
            PrivacyConfigurationError: naming the fix.
        """
        if self.schedule is not None:
            check_schedule_matches_strategy(self.schedule, tf.distribute.get_strategy())
            if (isinstance(micro_batch_size, int)
                    and micro_batch_size != self.schedule.micro_batch_size):
                raise PrivacyConfigurationError(
                    f"Each replica's micro-batch has {micro_batch_size} examples but the "
                    f"schedule was planned for micro_batch_size="
                    f"{self.schedule.micro_batch_size}. Feed micro-batches of that size "
                    "per replica, or rebuild the schedule."
                )
        elif (self.adaptive_clipping is not None and isinstance(micro_batch_size, int)
              and self.normalize_by is None):
            batch_size = float(micro_batch_size * self.accumulation_steps * replicas)
            gradient_noise_multiplier(self.noise_multiplier, self.adaptive_clipping
                                               .count_stddev_for(batch_size,
                                                                 self.noise_multiplier))

    # -- What is saved and what is reported ---------------------------------------

    def to_config(self) -> dict[str, Any]:
        """The settings as JSON-serializable values (`DPOptimizer.get_config`).

        `DPSettings(**settings.to_config())` rebuilds them, except a clipping
        strategy instance, saved by its class name.
        """
        return {field.name: _serialized(getattr(self, field.name))
                for field in dataclasses.fields(self)}

    def report(self) -> dict[str, Any]:
        """The settings as the privacy report states them.

        The saved config, but: the seed is left out (the report says whether
        the noise was seeded, never the seed, which regenerates it); a
        schedule's accumulation steps are listed phase by phase; gamma is
        None for flat clipping, where it plays no part.
        """
        report = self.to_config()
        del report["seed"]
        if self.schedule is not None:
            report["accumulation_steps"] = [
                phase.accumulation_steps for phase in self.schedule.phases]
        report["automatic_scaling_stability"] = self.automatic_stability
        return report


# The settings' names, in the order of `DPOptimizer`'s arguments.
SETTING_NAMES = tuple(field.name for field in dataclasses.fields(DPSettings))


def _serialized(value):
    if isinstance(value, (BatchSizeSchedule, adaptive.AdaptiveClipping, NoiseMechanism)):
        return value.to_dict()
    if isinstance(value, ClippingStrategy):
        return type(value).__name__
    return value


def _positive_finite(name: str, value, allow_zero: bool = False) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}.") from None
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}.")
    return number


def check_inner_optimizer(optimizer: keras.optimizers.Optimizer) -> None:
    """Refuses inner optimizers that rescale the loss or average updates.

    The DP step clips unscaled per-example gradients and never calls
    `scale_loss`, so a loss-scaling wrapper (LossScaleOptimizer and its kin)
    would divide every noisy update by its scale; Keras's own gradient
    accumulation would average several noisy steps into one update that the
    ledger counts as several.

    Args:
        optimizer: the optimizer a `DPOptimizer` wraps.

    Raises:
        PrivacyConfigurationError: it rescales the loss, or accumulates
            gradients itself.
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
            "for float16 compute ('mixed_float16') give the DPOptimizer a fixed "
            "DPOptimizer(..., loss_scale=...), which unscales each example's "
            "gradient before its norm."
        )
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise PrivacyConfigurationError(
            "The inner optimizer has gradient_accumulation_steps set: Keras would "
            "average several noisy updates into one. Accumulate with "
            "DPOptimizer(accumulation_steps=...) or a BatchSizeSchedule instead."
        )


def _check_takes_argument(strategy: ClippingStrategy, argument: str, setting: str,
                          how: str, instead: str) -> None:
    """A setting needs a strategy whose `clip_and_sum` takes `argument`.

    The DP step passes such keywords only when the setting is used, so a
    strategy written without it would otherwise fail with a bare TypeError
    at the first step.
    """
    parameters = inspect.signature(strategy.clip_and_sum).parameters.values()
    if not any(p.name == argument or p.kind is p.VAR_KEYWORD for p in parameters):
        raise TypeError(
            f"{setting} needs a clipping strategy whose clip_and_sum accepts "
            f"`{argument}`; {type(strategy).__name__}.clip_and_sum does not. Add the "
            f"argument ({how}), or {instead}."
        )
