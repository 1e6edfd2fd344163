"""`DPOptimizer`: accumulate clipped gradients, add Gaussian noise once per logical step.

The optimizer never sees per-example gradients: the private train step (see
`tf_megadp.make_private`) clips them and hands over each micro-batch's clipped
sum. This module owns what happens next: the accumulators, the micro-step
counter, the noise RNG, the single noisy update per logical step, and the
privacy ledger that travels with every checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import warnings
from typing import Any

import keras
import tensorflow as tf
from keras.src.saving import serialization_lib

from tf_megadp.accounting import LEDGER_COLUMNS
from tf_megadp.clipping import get_clipping_strategy
from tf_megadp.distribute import check_schedule_matches_strategy
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.schedules import BatchSizeSchedule

__all__ = ["DPOptimizer", "LEDGER_CAPACITY"]

# Rows of phases the ledger variable can hold; consecutive identical steps share a row.
LEDGER_CAPACITY = 256


def _positive_finite(name: str, value, allow_zero: bool = False) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}.") from None
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}.")
    return number


@keras.saving.register_keras_serializable(package="tf_megadp")
class DPOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer to perform DP-SGD with mega-batch accumulation.

    One *logical step* is `accumulation_steps` micro-batches (times the number
    of replicas). For each micro-batch the private train step computes every
    example's gradient g_i, clips it to g_i * min(1, C / ||g_i||) and sums the
    clipped gradients into this optimizer's accumulators. After the last
    micro-batch of the logical step, Gaussian noise N(0, sigma^2 C^2) is added
    once to every coordinate of the accumulated sum, the result is divided by
    the logical batch size B, and the inner optimizer applies it. The inner
    optimizer's `iterations` (also this optimizer's `iterations`) counts
    logical steps.

    Examples whose sample weights are all zero are padding and contribute
    nothing; examples whose gradient is not finite contribute nothing and are
    counted in `nonfinite_examples`.

    Args:
        optimizer: the inner Keras optimizer (Adam, AdamW, SGD, ...).
        l2_norm_clip: C, the per-example gradient norm bound.
        noise_multiplier: sigma; the noise standard deviation on the summed
            gradient is sigma * C. 0 trains WITHOUT privacy (with a warning).
        accumulation_steps: micro-batches per logical step (default 1). Not
            allowed together with `schedule`.
        normalize_by: the divisor B of the noisy sum. Default: micro-batch size
            * accumulation_steps * replicas. Use the *expected* batch size for
            Poisson-sampled steps, never the realised one. Not allowed together
            with `schedule`.
        seed: None draws the noise key from OS entropy; an int makes the noise
            reproducible. The RNG state is saved with the optimizer.
        schedule: a `tf_megadp.BatchSizeSchedule`; then accumulation steps,
            divisor and (where a phase sets it) the noise multiplier of each
            logical step come from the schedule.
        clipping: per-example clipping strategy: "vectorized", "ghost" or "auto" (docs/clipping.md).
        name: optimizer name.

    Example:
    ```python
    opt = tf_megadp.DPOptimizer(keras.optimizers.Adam(1e-3), l2_norm_clip=1.0,
                                noise_multiplier=1.1, accumulation_steps=64)
    model = tf_megadp.make_private(model)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    ```
    """

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer,
        l2_norm_clip: float,
        noise_multiplier: float,
        accumulation_steps: int | None = None,
        normalize_by: float | None = None,
        seed: int | None = None,
        schedule: BatchSizeSchedule | dict | None = None,
        clipping: str = "vectorized",
        name: str | None = None,
        **kwargs,
    ):
        if kwargs:
            raise ValueError(
                f"DPOptimizer does not take {sorted(kwargs)}: set learning-rate "
                "schedules, weight decay, EMA and gradient clipping on the inner "
                "optimizer."
            )
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                f"DPOptimizer wraps a keras.optimizers.Optimizer, got {optimizer!r}."
            )
        if isinstance(optimizer, DPOptimizer):
            raise PrivacyConfigurationError(
                "DPOptimizer cannot wrap another DPOptimizer (noise would be "
                "added twice and accounted once). Wrap the plain optimizer."
            )
        if getattr(optimizer, "loss_scale_factor", None):
            raise PrivacyConfigurationError(
                "The inner optimizer has loss_scale_factor set; the DP step does "
                "not scale losses, so the update would be rescaled after "
                "clipping. Remove loss_scale_factor."
            )
        l2_norm_clip = _positive_finite("l2_norm_clip", l2_norm_clip)
        noise_multiplier = _positive_finite("noise_multiplier", noise_multiplier, allow_zero=True)
        if isinstance(schedule, dict):
            schedule = BatchSizeSchedule.from_dict(schedule)
        if schedule is not None and not isinstance(schedule, BatchSizeSchedule):
            raise TypeError(f"schedule must be a BatchSizeSchedule, got {schedule!r}.")
        if schedule is not None and (accumulation_steps is not None or normalize_by is not None):
            raise ValueError(
                "With a schedule, accumulation_steps and normalize_by come from "
                "its phases; do not pass them to DPOptimizer as well."
            )
        if accumulation_steps is None:
            accumulation_steps = 1
        if (isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int)
                or accumulation_steps < 1):
            raise ValueError(
                f"accumulation_steps must be an integer >= 1, got {accumulation_steps!r}."
            )
        if normalize_by is not None:
            normalize_by = _positive_finite("normalize_by", normalize_by)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be None or an int, got {seed!r}.")
        super().__init__(learning_rate=0.0, name=name or "dp_optimizer")
        self.inner_optimizer = optimizer
        self.l2_norm_clip = l2_norm_clip
        self.noise_multiplier = noise_multiplier
        self.accumulation_steps = accumulation_steps
        self.normalize_by = normalize_by
        self.seed = seed
        self.schedule = schedule
        self.clipping = clipping
        self.clipping_strategy = get_clipping_strategy(clipping)
        if self.noise_multiplier == 0 or any(
            p.noise_multiplier == 0 for p in (schedule.phases if schedule else ())
        ):
            warnings.warn(
                "DPOptimizer with noise_multiplier=0 adds no noise: training is "
                "NOT differentially private (epsilon is infinite). Use this only "
                "as a clipped, non-private baseline.",
                stacklevel=2,
            )

    # -- Keras plumbing -------------------------------------------------------

    def build(self, var_list):
        if self.built:
            return
        self._accumulators = [self._add_replica_sum_variable(v) for v in var_list]
        self.micro_steps = self.add_variable(
            shape=(), dtype="int64", name="micro_steps"
        )
        if self.seed is None:
            key = [secrets.randbits(62), secrets.randbits(62)]
        else:
            key = [self.seed, 0]
        self.noise_key = self.add_variable(
            shape=(2,),
            dtype="int64",
            initializer=keras.initializers.Constant(key),
            name="noise_key",
        )
        self.nonfinite_examples = self._add_replica_sum_variable(
            None, shape=(), dtype="int64", name="nonfinite_examples"
        )
        self.privacy_ledger = self.add_variable(
            shape=(LEDGER_CAPACITY, len(LEDGER_COLUMNS)),
            dtype="float64",
            name="privacy_ledger",
        )
        self.privacy_ledger_rows = self.add_variable(
            shape=(), dtype="int64", name="privacy_ledger_rows"
        )
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    def _add_replica_sum_variable(self, reference, shape=None, dtype=None, name="dp_accumulator"):
        """A variable each replica updates locally; it reads (and saves) as the sum.

        Under a `tf.distribute` strategy every replica clips and accumulates
        its own examples. A plain optimizer variable is mirrored: each replica
        would write its own copy and a checkpoint would save replica 0's copy
        only (dropping the others' sums and, on restore, counting replica 0's
        R times). ON_READ/SUM keeps one local copy per replica, saves their
        sum and restores it split evenly, so the sum survives a checkpoint.
        """
        colocate = contextlib.nullcontext()
        if reference is not None:
            shape, dtype = reference.shape, reference.dtype
            name = f"{reference.path.replace('/', '_')}_{name}"
            colocate = self._distribution_strategy.extended.colocate_vars_with(
                reference.value
            )
        with colocate, keras.name_scope(self.name, caller=self):
            variable = keras.Variable(
                initializer="zeros", shape=shape, dtype=dtype, trainable=False,
                aggregation="sum", synchronization="on_read", name=name,
            )
        self._track_variable(variable)
        return variable

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def iterations(self):
        """Logical steps completed (noisy updates applied)."""
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def _fail_aggregated(self, *args, **kwargs):
        raise PrivacyConfigurationError(
            "DPOptimizer received already-aggregated gradients, which cannot be "
            "clipped per example: the model's train step is not private. Call "
            "`model = tf_megadp.make_private(model)` before `fit` (also after "
            "`keras.models.load_model`), and do not call `apply_gradients` on a "
            "DPOptimizer from a custom training loop."
        )

    apply = _fail_aggregated
    apply_gradients = _fail_aggregated
    stateless_apply = _fail_aggregated

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- Schedule look-ups (Python) -------------------------------------------

    def accumulation_steps_at(self, step: int) -> int:
        if self.schedule is None:
            return self.accumulation_steps
        return self.schedule.phase_at(step).accumulation_steps

    def noise_multiplier_at(self, step: int) -> float:
        if self.schedule is not None:
            sigma = self.schedule.phase_at(step).noise_multiplier
            if sigma is not None:
                return float(sigma)
        return self.noise_multiplier

    def batch_size_at(self, step: int, micro_batch_size: int | None = None,
                      num_replicas: int | None = None) -> float:
        """The divisor B of logical step `step`."""
        if self.schedule is not None:
            return float(self.schedule.phase_at(step).batch_size)
        if self.normalize_by is not None:
            return self.normalize_by
        if micro_batch_size is None:
            raise ValueError(
                "Without normalize_by or a schedule, the logical batch size "
                "depends on the micro-batch size: pass micro_batch_size."
            )
        if num_replicas is None:
            num_replicas = tf.distribute.get_strategy().num_replicas_in_sync
        return float(micro_batch_size * self.accumulation_steps * num_replicas)

    # -- The private update (graph) -------------------------------------------

    def _phase_values(self, step):
        """(accumulation steps, divisor or None, noise multiplier) as tensors."""
        if self.schedule is None:
            divisor = None if self.normalize_by is None else tf.constant(self.normalize_by, tf.float32)
            return (
                tf.constant(self.accumulation_steps, tf.int64),
                divisor,
                tf.constant(self.noise_multiplier, tf.float32),
            )
        phases = self.schedule.phases
        ends = tf.constant(self.schedule.phase_ends[:-1], tf.int64)
        index = tf.searchsorted(ends, tf.reshape(step, [1]), side="right")[0]
        pick = lambda values, dtype: tf.gather(tf.constant(values, dtype), index)
        return (
            pick([p.accumulation_steps for p in phases], tf.int64),
            pick([float(p.batch_size) for p in phases], tf.float32),
            pick([self.noise_multiplier if p.noise_multiplier is None
                  else float(p.noise_multiplier) for p in phases], tf.float32),
        )

    def accumulate(self, gradient_sum, trainable_variables, micro_batch_size, nonfinite):
        """Adds one micro-batch's clipped sum; applies the noisy update when due.

        Called by the private train step in a replica context; not public API.

        Args:
            gradient_sum: clipped per-example gradient sum per trainable
                variable (None where the loss does not reach the variable).
            trainable_variables: the model's trainable variables, aligned.
            micro_batch_size: m (a Python int or scalar tensor).
            nonfinite: count of examples dropped for non-finite gradients.
        """
        if not self.built:
            self.build(trainable_variables)
        if self.schedule is not None:
            self._check_schedule_layout(micro_batch_size)
        for accumulator, gradient in zip(self._accumulators, gradient_sum):
            if gradient is not None:
                accumulator.assign_add(tf.cast(gradient, accumulator.dtype))
        self.micro_steps.assign_add(1)
        self.nonfinite_examples.assign_add(tf.cast(nonfinite, tf.int64))
        step = tf.cast(self.iterations, tf.int64)
        accumulation_steps, divisor, noise_multiplier = self._phase_values(step)
        if divisor is None:
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            divisor = tf.cast(micro_batch_size, tf.float32) * tf.cast(
                accumulation_steps * replicas, tf.float32)
        connected = [g is not None for g in gradient_sum]

        def noisy_update(step, divisor, noise_multiplier):
            self._noisy_update(trainable_variables, connected, step, divisor, noise_multiplier)
            return tf.constant(True)

        def skip():
            return tf.constant(False)

        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            return tf.cond(
                self.micro_steps >= accumulation_steps,
                lambda: noisy_update(step, divisor, noise_multiplier),
                skip,
            )

        # MirroredStrategy and MultiWorkerMirroredStrategy (unless XLA on GPUs)
        # and TPUStrategy all-reduce through merge_call, which TensorFlow
        # forbids inside a tf.cond taken in a replica context. Decide in the
        # cross-replica context instead, as keras' LossScaleOptimizer does:
        # every replica holds the same micro-step count, so replica 0 decides.
        def cross_replica(distribution, accumulation_steps, *values):
            due = self.micro_steps.value >= distribution.experimental_local_results(
                accumulation_steps)[0]

            def update_every_replica():
                distribution.extended.call_for_each_replica(noisy_update, args=values)
                return tf.constant(True)

            return tf.cond(due, update_every_replica, skip)

        return tf.distribute.get_replica_context().merge_call(
            cross_replica, args=(accumulation_steps, step, divisor, noise_multiplier)
        )

    def _check_schedule_layout(self, micro_batch_size):
        """A logical step is k_t micro-steps of one m-sized micro-batch per replica.

        A schedule planned for another micro-batch size or replica count
        would make each logical step hold other examples than the sampler
        drew and the accountant composed.
        """
        check_schedule_matches_strategy(self.schedule, tf.distribute.get_strategy())
        if isinstance(micro_batch_size, int) and micro_batch_size != self.schedule.micro_batch_size:
            raise PrivacyConfigurationError(
                f"Each replica's micro-batch has {micro_batch_size} examples but the "
                f"schedule was planned for micro_batch_size="
                f"{self.schedule.micro_batch_size}. Feed micro-batches of that size "
                "per replica, or rebuild the schedule."
            )

    def _noisy_update(self, trainable_variables, connected, step, divisor, noise_multiplier):
        replica_context = tf.distribute.get_replica_context()
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        replica_id = 0 if replica_context is None else replica_context.replica_id_in_sync_group
        # Each replica adds independent noise of variance sigma^2 C^2 / R, so the
        # all-reduced SUM carries exactly N(0, sigma^2 C^2) per coordinate.
        stddev = noise_multiplier * self.l2_norm_clip / math.sqrt(replicas)
        key = tf.random.experimental.stateless_fold_in(self.noise_key.value, step)
        key = tf.random.experimental.stateless_fold_in(key, tf.cast(replica_id, tf.int64))
        gradients, variables = [], []
        for index, (accumulator, variable, is_connected) in enumerate(
            zip(self._accumulators, trainable_variables, connected)
        ):
            if not is_connected:
                continue
            noise = tf.random.stateless_normal(
                tf.shape(accumulator.value),
                seed=tf.random.experimental.stateless_fold_in(key, index),
                dtype=tf.float32,
            )
            noisy_sum = tf.cast(accumulator.value, tf.float32) + stddev * noise
            gradients.append(tf.cast(noisy_sum / divisor, accumulator.dtype))
            variables.append(variable)
        self.inner_optimizer.apply(gradients, variables)
        for accumulator in self._accumulators:
            accumulator.assign(tf.zeros_like(accumulator.value))
        self.micro_steps.assign(0)

    # -- Serialization ---------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "optimizer": serialization_lib.serialize_keras_object(self.inner_optimizer),
            "l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self.noise_multiplier,
            "accumulation_steps": None if self.schedule else self.accumulation_steps,
            "normalize_by": self.normalize_by,
            "seed": self.seed,
            "schedule": self.schedule.to_dict() if self.schedule else None,
            "clipping": self.clipping,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["optimizer"] = serialization_lib.deserialize_keras_object(
            config["optimizer"], custom_objects=custom_objects
        )
        return cls(**config)
