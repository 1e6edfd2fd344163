"""Adaptive clipping: a clip norm C that follows a quantile of the per-example norms.

Andrew, Thakkar, McMahan and Ramaswamy, "Differentially Private Learning with
Adaptive Clipping" (NeurIPS 2021). At every logical step t, besides the
clipped gradient sum, the step releases a noisy count of the examples whose
gradient norm is at most C_t and moves C geometrically towards the target
quantile gamma of the norms:

    b_t = (sum_i (1[||g_i|| <= C_t] - 1/2) + N(0, s^2)) / B + 1/2
    C_{t+1} = C_t * exp(-eta * (b_t - gamma))

The sum runs over the real examples of the logical step (every micro-batch,
no padding, no example without weight) and B is the *expected* batch size
(the divisor of the gradient sum). Centring each indicator at 1/2 halves the
sensitivity of the count to 1/2 (adding or removing one example moves the
centred sum by exactly 1/2 either way), so the count is a Gaussian mechanism
of noise multiplier 2 s. The gradient sum gets the noise multiplier

    sigma_grad = (sigma^-2 - (2 s)^-2)^-1/2,

so that the pair, released together, is exactly one Gaussian mechanism of
the user's multiplier sigma: the privacy loss of two Gaussians on the same
example adds in quadrature (1/sigma_grad^2 + 1/(2 s)^2 = 1/sigma^2), and the
sampling is shared. The accountant composes the two Gaussians inside the
sampling event of the step, so the reported epsilon is the one of sigma:
the pair is an accounting concept, `tf_megadp.accounting.mechanisms`
(`gradient_noise_multiplier`, `step_mechanism`); this module holds the
rule's settings and its graph side.

C is held in a range [C_min, C_max] (`AdaptiveClipping(min_clip_norm=,
max_clip_norm=)`, by default 1/1000 and 1000 times the initial C):

    C_{t+1} = min(C_max, max(C_min, C_t * exp(-eta * (b_t - gamma))))

The clamp is post-processing of the noised count b_t with public constants,
so it costs no privacy. Without it a large eta drove C to infinity (the next
step's noise, sigma C, made the weights non-finite while epsilon was still
reported) or to 0 (every gradient clipped to nothing) without a word. A C
held at a bound warns once; an update that leaves the weights (or C)
non-finite stops the run at the next ledger update, after the ledger has
counted every step that was applied.

C_t is optimizer state: a `DPOptimizer` variable saved with every
checkpoint (it is a function of noisy releases only, so saving it spends
nothing); the count's un-noised accumulator lives in memory only, like the
gradient accumulators.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import numpy as np

from tf_megadp.accounting.mechanisms import COUNT_SENSITIVITY
from tf_megadp.errors import PrivacyConfigurationError

__all__ = [
    "AdaptiveClipping",
    "DEFAULT_CLIP_NORM_RANGE",
    "DEFAULT_COUNT_STDDEV_FRACTION",
]

# Andrew et al.'s default noise on the count: the expected batch size / 20.
DEFAULT_COUNT_STDDEV_FRACTION = 1.0 / 20.0
# How far C may move from the initial C by default, either way (a factor).
DEFAULT_CLIP_NORM_RANGE = 1000.0


@dataclasses.dataclass(frozen=True)
class AdaptiveClipping:
    """The settings of adaptive clipping, a `DPOptimizer` option.

    The optimizer's `l2_norm_clip` is the initial C; after every logical
    step C moves towards the `target_quantile` of the per-example gradient
    norms. The noise of the count is paid out of the same budget: the
    gradient's noise multiplier is raised so that gradient and count
    together are one Gaussian mechanism of the optimizer's
    `noise_multiplier` (epsilon does not change).

    Args:
        target_quantile: gamma in (0, 1), the fraction of examples whose
            gradient should not be clipped (0.5: the median norm, Andrew et
            al.'s default).
        learning_rate: eta > 0 of the geometric update C <- C exp(-eta (b -
            gamma)) (0.2, Andrew et al.'s default).
        count_stddev: s, the standard deviation of the Gaussian noise on the
            count of unclipped examples (in examples). None (default): the
            expected batch size of each step / 20, as Andrew et al.
            recommend (0, an exact count, when noise_multiplier=0). The
            count's noise multiplier is 2 s (its sensitivity is 1/2) and
            must exceed sigma; 0 is allowed only for a non-private run.
        min_clip_norm: C_min > 0, the smallest C the rule may reach. None
            (default): the initial C (`l2_norm_clip`) / 1000.
        max_clip_norm: C_max > C_min, the largest C. None (default): the
            initial C * 1000.

    Why 1000 either way: the initial C is the user's guess of the norms'
    scale, and Andrew et al.'s rule reaches the quantile from a guess that
    is off by orders of magnitude (C moves by up to a factor exp(eta) per
    step). A C that must move further than 1000 times from the guess either
    follows a guess that was far off (restart from a better l2_norm_clip)
    or diverges because eta is too large; both stop at the bound with a
    warning instead of running to infinity, where the noise sigma C
    overflows and the weights become non-finite, or to 0, where every
    gradient is clipped to nothing. Six orders of magnitude stay far inside
    float32's range for the noise and the sums. Holding C in the range is
    post-processing of the noisy count: it costs no privacy.

    Example:
    ```python
    optimizer = tf_megadp.DPOptimizer(
        keras.optimizers.Adam(1e-3), l2_norm_clip=0.1, noise_multiplier=1.1,
        accumulation_steps=64,
        adaptive_clipping=tf_megadp.AdaptiveClipping(target_quantile=0.5))
    # logs["clip_norm"] shows C after every step.
    ```
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_stddev: float | None = None
    min_clip_norm: float | None = None
    max_clip_norm: float | None = None

    def __post_init__(self):
        quantile = _number("target_quantile", self.target_quantile)
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"target_quantile must be in (0, 1), got {self.target_quantile!r}.")
        rate = _number("learning_rate", self.learning_rate)
        if rate <= 0.0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}.")
        object.__setattr__(self, "target_quantile", quantile)
        object.__setattr__(self, "learning_rate", rate)
        if self.count_stddev is not None:
            stddev = _number("count_stddev", self.count_stddev)
            if stddev < 0.0:
                raise ValueError(f"count_stddev must be >= 0 or None, got {self.count_stddev!r}.")
            object.__setattr__(self, "count_stddev", stddev)
        for name in ("min_clip_norm", "max_clip_norm"):
            value = getattr(self, name)
            if value is None:
                continue
            bound = _number(name, value)
            if bound <= 0.0:
                raise ValueError(
                    f"{name} must be a finite number > 0 or None (default: the initial C "
                    f"{'/' if name == 'min_clip_norm' else '*'} {DEFAULT_CLIP_NORM_RANGE:g}), "
                    f"got {value!r}.")
            object.__setattr__(self, name, bound)
        if (self.min_clip_norm is not None and self.max_clip_norm is not None
                and self.min_clip_norm >= self.max_clip_norm):
            raise ValueError(
                f"min_clip_norm={self.min_clip_norm:g} must be below max_clip_norm="
                f"{self.max_clip_norm:g}: swap them, or leave one at None (its default "
                "is relative to the initial C).")

    def clip_norm_bounds(self, initial_clip_norm: float) -> tuple[float, float]:
        """(C_min, C_max) for a run whose initial C is `initial_clip_norm`.

        Raises:
            PrivacyConfigurationError: the initial C lies outside the range.
        """
        initial = float(initial_clip_norm)
        low = (initial / DEFAULT_CLIP_NORM_RANGE if self.min_clip_norm is None
               else self.min_clip_norm)
        high = (initial * DEFAULT_CLIP_NORM_RANGE if self.max_clip_norm is None
                else self.max_clip_norm)
        if not low <= initial <= high:
            raise PrivacyConfigurationError(
                f"The initial clip norm l2_norm_clip={initial:g} lies outside adaptive "
                f"clipping's range [{low:g}, {high:g}] (min_clip_norm, max_clip_norm). "
                "Choose a range that holds l2_norm_clip, or leave the bounds at None "
                f"(the initial C / {DEFAULT_CLIP_NORM_RANGE:g} and * "
                f"{DEFAULT_CLIP_NORM_RANGE:g}).")
        return low, high

    def count_stddev_for(self, batch_size: float, noise_multiplier: float) -> float:
        """s of a step of expected batch size `batch_size` and multiplier sigma.

        The default is B / 20 for a private step and 0 (an exact count) for a
        non-private one.
        """
        if self.count_stddev is not None:
            return self.count_stddev
        if not noise_multiplier:
            return 0.0
        return float(batch_size) * DEFAULT_COUNT_STDDEV_FRACTION

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "AdaptiveClipping":
        return cls(**config)


def _number(name: str, value) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}.") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value!r}.")
    return number


# -- The graph side (called by DPOptimizer and the private step) -----------------
# TensorFlow is imported here, in each graph function, not at the top: the
# BERT job's configuration checks the settings above in `tf-megadp plan`,
# which must not load TensorFlow.


def centred_count(norms, is_real, clip_norm) -> tf.Tensor:
    """sum_i (1[||g_i|| <= C] - 1/2) over the real examples of a micro-batch (float64).

    Padding and examples without weight (is_real = 0) count nothing; a
    non-finite norm counts as clipped.
    """
    import tensorflow as tf

    real = tf.cast(is_real, tf.float64) > 0
    below = tf.cast(norms, tf.float64) <= tf.cast(clip_norm, tf.float64)
    indicator = tf.where(below, tf.constant(0.5, tf.float64), tf.constant(-0.5, tf.float64))
    return tf.reduce_sum(tf.where(real, indicator, tf.zeros_like(indicator)))


def step_noise_multipliers(config: AdaptiveClipping, noise_multiplier, divisor):
    """(sigma_grad, count noise multiplier, s) of one step, as float32 tensors.

    The graph twin of `tf_megadp.accounting.mechanisms.gradient_noise_multiplier`
    for steps whose expected batch is a tensor (`count_stddev=None`). An
    impossible pair (2 s <= sigma) gives sigma_grad = NaN, which the ledger
    keeper refuses; the optimizer refuses every pair it can see before
    training.
    """
    import tensorflow as tf

    sigma = tf.cast(noise_multiplier, tf.float64)
    if config.count_stddev is None:
        stddev = tf.where(sigma > 0, tf.cast(divisor, tf.float64) * DEFAULT_COUNT_STDDEV_FRACTION,
                          tf.zeros([], tf.float64))
    else:
        stddev = tf.constant(config.count_stddev, tf.float64)
    count_multiplier = stddev / COUNT_SENSITIVITY
    private = sigma > 0
    safe_sigma = tf.where(private, sigma, tf.ones_like(sigma))
    safe_count = tf.where(count_multiplier > 0, count_multiplier, tf.ones_like(count_multiplier))
    inverse = safe_sigma ** -2 - safe_count ** -2
    valid = tf.logical_and(count_multiplier > sigma, inverse > 0)
    gradient = tf.where(valid, tf.math.rsqrt(tf.where(valid, inverse, tf.ones_like(inverse))),
                        tf.constant(float("nan"), tf.float64))
    gradient = tf.where(private, gradient, tf.zeros_like(gradient))
    # A non-private run (sigma = 0) may count exactly (s = 0) only.
    count_multiplier = tf.where(
        tf.logical_or(private, count_multiplier == 0), count_multiplier,
        tf.constant(float("nan"), tf.float64))
    return tf.cast(gradient, tf.float32), tf.cast(count_multiplier, tf.float32), stddev


def updated_clip_norm(config: AdaptiveClipping, clip_norm, noisy_centred_count, divisor,
                      bounds: tuple[float, float]):
    """C_{t+1} = C_t exp(-eta (b_t - gamma)) held in `bounds`, b_t = noisy centred count / B + 1/2.

    The clamp is post-processing of the noisy count (no privacy cost); a NaN
    stays NaN, for the ledger keeper to stop the run.
    """
    import tensorflow as tf

    clip_norm = tf.cast(clip_norm, tf.float64)
    fraction = noisy_centred_count / tf.cast(divisor, tf.float64) + 0.5
    moved = clip_norm * tf.exp(-config.learning_rate * (fraction - config.target_quantile))
    low, high = (tf.constant(bound, tf.float64) for bound in bounds)
    return tf.where(tf.math.is_nan(moved), moved, tf.minimum(tf.maximum(moved, low), high))


def noisy_count(centred_sum, stddev, key, replicas: int) -> tf.Tensor:
    """The released centred count: the sum over replicas plus N(0, s^2), once (float64).

    Called in a replica context: each replica adds noise of variance
    s^2 / R to its own partial count, drawn from `key` (the step's secret
    noise key, already folded with the step and the replica), so the
    all-reduced sum carries exactly N(0, s^2).
    """
    import tensorflow as tf

    from tf_megadp.gaussian import standard_normal

    noise = standard_normal([], key, tf.float64)
    noisy = tf.cast(centred_sum, tf.float64) + tf.cast(stddev, tf.float64) / math.sqrt(
        replicas) * noise
    if replicas > 1:
        noisy = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, noisy)
    return noisy


def release_count_and_update(config: AdaptiveClipping, clip_norm_variable, centred_sum, stddev,
                             divisor, key, replicas: int, bounds: tuple[float, float]) -> None:
    """Releases the step's noisy count (`noisy_count`) and moves C with it, within `bounds`."""
    import tensorflow as tf

    noisy = noisy_count(centred_sum, stddev, key, replicas)
    clip_norm_variable.assign(tf.cast(
        updated_clip_norm(config, clip_norm_variable.value, noisy, divisor, bounds),
        clip_norm_variable.dtype))


def all_finite(clip_norm, variables) -> tf.Tensor:
    """Whether C and every variable are finite after a step (a scalar bool, in the graph)."""
    import tensorflow as tf

    checks = [tf.reduce_all(tf.math.is_finite(tf.cast(clip_norm, tf.float64)))]
    checks += [tf.reduce_all(tf.math.is_finite(variable.value)) for variable in variables]
    return tf.reduce_all(tf.stack(checks))


# -- The report ------------------------------------------------------------------


def note_clip_norm(optimizer) -> None:
    """Appends (logical step, C) to the optimizer's trajectory when C moved on (Python).

    Warns once per optimizer when C sits at a bound of its range.

    Raises:
        PrivacyConfigurationError: an update left the weights or C
            non-finite (the caller has recorded its steps in the ledger).
    """
    if getattr(optimizer, "adaptive_clipping", None) is None or not optimizer.built:
        return
    step = optimizer.logical_steps_applied
    trajectory = optimizer.clip_norm_trajectory
    clip_norm = float(optimizer.clip_norm.numpy())
    if not trajectory or trajectory[-1][0] != step:
        trajectory.append((step, clip_norm))
    check_updates_finite(optimizer)
    low, high = optimizer.adaptive_clipping.clip_norm_bounds(optimizer.l2_norm_clip)
    if clip_norm in (low, high) and not getattr(optimizer, "_warned_clip_norm_bound", False):
        optimizer._warned_clip_norm_bound = True
        name = "max_clip_norm" if clip_norm == high else "min_clip_norm"
        warnings.warn(
            f"Adaptive clipping's C reached {name}={clip_norm:g} at logical step {step} "
            "and is held there (no privacy cost: it is post-processing of the noisy "
            f"count). The {optimizer.adaptive_clipping.target_quantile:g} quantile of the "
            "norms may lie beyond it: start from an l2_norm_clip nearer the norms, widen "
            f"AdaptiveClipping({name}=...), or lower AdaptiveClipping(learning_rate=...) "
            "if C jumps from bound to bound.", UserWarning, stacklevel=2)


def check_updates_finite(optimizer, variables=None) -> None:
    """Refuses to go on after a step that left the weights or C non-finite.

    Args:
        optimizer: the adaptively clipped `DPOptimizer`.
        variables: also check these variables' values here (Python, once
            before a run); otherwise only the count the graph kept.

    Raises:
        PrivacyConfigurationError: naming the fix.
    """
    if getattr(optimizer, "adaptive_clipping", None) is None or not optimizer.built:
        return
    clip_norm = float(optimizer.clip_norm.numpy())
    diverged = optimizer.take_nonfinite_updates() > 0
    if variables is not None:
        diverged = diverged or not math.isfinite(clip_norm) or not all(
            np.isfinite(np.asarray(variable)).all() for variable in variables)
    if diverged:
        raise PrivacyConfigurationError(
            f"A noisy update of this adaptively clipped run left the weights or the clip "
            f"norm non-finite (C = {clip_norm:g}); training stops. The privacy ledger "
            "counts every step applied, this one included. Lower the learning rate of "
            "the optimizer or AdaptiveClipping(learning_rate=...), or narrow "
            "AdaptiveClipping(max_clip_norm=...); then restore a checkpoint from before "
            "the divergence (its ledger continues) or start from fresh weights.")


def report_section(optimizer) -> dict[str, Any] | None:
    """What the privacy report says of adaptive clipping (None when it is off)."""
    config = getattr(optimizer, "adaptive_clipping", None)
    if config is None:
        return None
    section = config.to_dict()
    section["count_sensitivity"] = COUNT_SENSITIVITY
    section["initial_clip_norm"] = optimizer.l2_norm_clip
    section["clip_norm"] = float(optimizer.clip_norm.numpy()) if optimizer.built else None
    section["clip_norm_bounds"] = list(config.clip_norm_bounds(optimizer.l2_norm_clip))
    section["trajectory"] = [list(point) for point in optimizer.clip_norm_trajectory]
    section["note"] = (
        "C moves towards the target quantile of the per-example norms after every logical "
        "step, from a noisy count of unclipped examples; the ledger's noise_multiplier is "
        "the gradient's, count_noise_multiplier the count's, and the pair is accounted as "
        "one Gaussian of the run's noise multiplier. The trajectory lists (logical step, C) "
        "at every ledger update of this process.")
    return section
