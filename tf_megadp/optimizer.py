"""`DPOptimizer`: accumulate clipped gradients, add Gaussian noise once per logical step.

The optimizer never sees per-example gradients: the private train step (see
`tf_megadp.make_private`) clips them and hands over each micro-batch's clipped
sum. This module owns what happens next: the accumulators, the micro-step
counter, the secret noise key, the single noisy update per logical step, and
the privacy ledger that travels with every checkpoint.

What is saved and what is not is a privacy decision, not a convenience:

* saved (`model.save`, `save_weights`, `ModelCheckpoint`,
  `keras.callbacks.BackupAndRestore` in a private `fit`,
  `tf_megadp.save_training_state`): the inner optimizer's state, the
  logical-step counter, the privacy ledger, the record of the steps the
  compiled step applied and, with adaptive clipping, the clip norm C (a
  function of noisy releases only);
* never saved, held only in memory: the noise key (whoever holds it can
  regenerate the noise and subtract it from the released update) and the
  mid-step state (the accumulators hold the exact, un-noised clipped sum,
  and adaptive clipping's the exact count of unclipped examples).
  A restored optimizer therefore resumes at a logical-step boundary with a
  fresh key (a new process) or, restored in the same process, in a new draw
  generation for every step it repeats (`tf_megadp.accumulators`): no noise
  is drawn twice. The discarded partial step was never released, so it cost
  no privacy, and fresh noise is as private as the old.

Privacy spent is a property of the trained weights, not of one optimizer
object: a `DPOptimizer` marks the model variables it trains (or whose
saved state it loads) as covered by its ledger, and a new `DPOptimizer`
built for variables that carry another one's ledger continues that ledger
(see `DPOptimizer.build`), whatever the order of `load_model`, `compile`,
`make_private` and `load_weights` that led there.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_megadp import _keras_compat
from tf_megadp import adaptive_clipping as adaptive
from tf_megadp.accounting import LEDGER_COLUMNS
from tf_megadp.accumulators import Accumulators, accumulation_dtype
from tf_megadp.clipping import ClippingStrategy, get_clipping_strategy
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.optimizer_ledger import (
    _APPLIED_CAPACITY,
    APPLIED_STEP_COLUMNS,
    LEDGER_CAPACITY,
    LedgerOfWeights,
)
from tf_megadp.optimizer_settings import (
    _FROZEN_SETTINGS,
    _PER_EXAMPLE_SCALINGS,
    _check_adaptive_clipping,
    _check_adaptive_pair,
    _check_inner_does_not_rescale,
    _check_schedule_layout,
    _check_takes_automatic_stability,
    _positive_finite,
)
from tf_megadp.steps import BatchSizeSchedule, noise_multiplier_of, step_capacity

__all__ = ["DPOptimizer", "accumulation_dtype"]# Only the private train step may hand clipped sums to the optimizer.
_PRIVATE_STEP = object()


@keras.saving.register_keras_serializable(package="tf_megadp")
class DPOptimizer(LedgerOfWeights, Accumulators, keras.optimizers.Optimizer):
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

    Weight averaging (De et al. 2022) comes from the inner optimizer:
    `keras.optimizers.AdamW(..., use_ema=True, ema_momentum=0.999)` averages
    the weights after each noisy update (post-processing: no privacy cost),
    `fit` leaves the average in the model at its end, and
    `keras.callbacks.SwapEMAWeights` evaluates with it.

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
            reproducible, and the run not private against anyone who can guess
            it (a warning says so). The key lives only in memory: no saved
            file holds it.
        schedule: a `tf_megadp.BatchSizeSchedule`; then accumulation steps,
            divisor and (where a phase sets it) the noise multiplier of each
            logical step come from the schedule.
        clipping: per-example clipping strategy: "auto" (default: ghost norms
            where a layer has a rule, exact per-example gradients elsewhere,
            vectorized for a model ghost norms cannot attribute), "ghost" or
            "vectorized" (docs/clipping.md: all three give the same clipped
            sums and differ in time and memory), or a `ClippingStrategy`
            instance (not restored by `from_config`).
        per_example_scaling: "clip" (flat clipping, g_i * min(1, C / ||g_i||))
            or "automatic" (automatic clipping, Bu et al. 2022: g_i * C /
            (||g_i|| + gamma), every gradient normalized to norm just below C,
            so the sensitivity is still C and C only rescales the update).
        automatic_scaling_stability: gamma > 0 of automatic clipping (Bu et
            al. use 0.01); small norms are scaled up at most by C / gamma.
        examples_per_unit: k, the rows of one privacy unit (user-level
            privacy): 1 (the default) clips every example; k > 1 clips the
            SUMMED gradient of each slot of k rows that a
            `tf_megadp.PrivacyUnitSampler` lays out (pass
            `sampler.examples_per_unit`), and the schedule counts units
            (micro-batch size m in unit slots). The private `fit` refuses
            data whose unit layout differs.
        adaptive_clipping: a `tf_megadp.AdaptiveClipping` (or its dict) to
            move C after every logical step towards a quantile of the
            per-example norms (Andrew et al. 2021), `l2_norm_clip` being the
            initial C; the count it uses is paid from the same
            `noise_multiplier` (docs/clipping.md, "Adaptive clipping").
            None (default): C stays `l2_norm_clip`.
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
        clipping: str | ClippingStrategy = "auto",
        per_example_scaling: str = "clip",
        automatic_scaling_stability: float = 0.01,
        examples_per_unit: int = 1,
        adaptive_clipping: adaptive.AdaptiveClipping | dict | None = None,
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
        _check_inner_does_not_rescale(optimizer)
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
        if per_example_scaling not in _PER_EXAMPLE_SCALINGS:
            raise ValueError(
                f"per_example_scaling must be one of {sorted(_PER_EXAMPLE_SCALINGS)}, "
                f"got {per_example_scaling!r}."
            )
        automatic_scaling_stability = _positive_finite(
            "automatic_scaling_stability", automatic_scaling_stability)
        if (isinstance(examples_per_unit, bool) or not isinstance(examples_per_unit, int)
                or examples_per_unit < 1):
            raise ValueError(
                f"examples_per_unit must be an integer >= 1, got {examples_per_unit!r}.")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be None or an int, got {seed!r}.")
        adaptive_clipping = _check_adaptive_clipping(
            adaptive_clipping, per_example_scaling, noise_multiplier, schedule, normalize_by,
            l2_norm_clip)
        if seed is not None:
            warnings.warn(
                f"DPOptimizer(seed={seed}) makes the noise reproducible: anyone who "
                "can guess the seed can regenerate the noise and subtract it from "
                "the released model, so the run is NOT private against them. The "
                "privacy report marks it 'seeded noise: not for release'. Use "
                "seed=None (the default, OS entropy) for any run you publish.",
                UserWarning,
                stacklevel=2,
            )
        super().__init__(learning_rate=0.0, name=name or "dp_optimizer")
        self.inner_optimizer = optimizer
        self.l2_norm_clip = l2_norm_clip
        self.noise_multiplier = noise_multiplier
        self.accumulation_steps = accumulation_steps
        self.normalize_by = normalize_by
        self.seed = seed
        self.schedule = schedule
        self.per_example_scaling = per_example_scaling
        self.automatic_scaling_stability = automatic_scaling_stability
        self.examples_per_unit = examples_per_unit
        self.adaptive_clipping = adaptive_clipping
        # (logical step, C) at every ledger update of this process (the report's).
        self.clip_norm_trajectory: list[tuple[int, float]] = []
        if isinstance(clipping, ClippingStrategy):
            if per_example_scaling == "automatic":
                _check_takes_automatic_stability(clipping)
            self.clipping_strategy = clipping
            self.clipping = type(clipping).__name__
        else:
            self.clipping_strategy = get_clipping_strategy(clipping)
            self.clipping = clipping
        # The number of steps taken over from another optimizer when built,
        # until the private fit has warned about it (see `_continue_ledger_of`).
        self._carried_from: int | None = None
        self._settings_frozen = True
        if self.noise_multiplier == 0 or any(
            p.noise_multiplier == 0 for p in (schedule.phases if schedule else ())
        ):
            warnings.warn(
                "DPOptimizer with noise_multiplier=0 adds no noise: training is "
                "NOT differentially private (epsilon is infinite). Use this only "
                "as a clipped, non-private baseline.",
                stacklevel=2,
            )

    def __setattr__(self, name, value):
        if name in _FROZEN_SETTINGS and getattr(self, "_settings_frozen", False):
            raise PrivacyConfigurationError(
                f"DPOptimizer.{name} cannot change after construction: Keras "
                "compiles the train step once, so a new value would be recorded "
                "but not used. Build a new DPOptimizer with the new setting and "
                "compile the model again (the privacy ledger carries over)."
            )
        super().__setattr__(name, value)

    def _extend_schedule(self, phases, truncation_probability: float) -> BatchSizeSchedule:
        """Continues the schedule with more phases (see `tf_megadp.extend_schedule`).

        The steps already taken keep their phases; the model's compiled step
        must be traced again afterwards, since it holds the phases as
        constants.
        """
        if self.schedule is None:
            raise PrivacyConfigurationError(
                "This DPOptimizer has no schedule, so its run has no end to extend: "
                "call fit again for more steps. For another batch size, compile with "
                "a new DPOptimizer that wraps the same inner optimizer "
                "(model.optimizer.inner_optimizer): the ledger and the inner "
                "optimizer's state carry over."
            )
        schedule = self.schedule.extended(phases, truncation_probability=truncation_probability)
        # Bypasses the freeze: the caller retraces the step that uses it.
        super().__setattr__("schedule", schedule)
        return schedule

    @property
    def automatic_stability(self) -> float | None:
        """gamma of automatic clipping, or None for flat clipping (what strategies take)."""
        if self.per_example_scaling == "automatic":
            return self.automatic_scaling_stability
        return None

    @property
    def seeded_noise(self) -> bool:
        """Whether the noise comes from an explicit seed (not for release)."""
        return self.seed is not None

    def take_nonfinite_updates(self) -> int:
        """Adaptively clipped updates that left the weights or C non-finite since the last call.

        Counted in the graph, in memory only; reading resets the count.
        """
        if self.adaptive_clipping is None or not self.built:
            return 0
        counter = self._in_memory.nonfinite_updates
        count = int(counter.numpy())
        if count:
            counter.assign(0)
        return count

    # -- Keras plumbing -------------------------------------------------------

    def build(self, var_list):
        if self.built:
            return
        self._build_in_memory_state(var_list)
        self.privacy_ledger = self.add_variable(
            shape=(LEDGER_CAPACITY, len(LEDGER_COLUMNS)),
            dtype="float64",
            name="privacy_ledger",
        )
        self.privacy_ledger_rows = self.add_variable(
            shape=(), dtype="int64", name="privacy_ledger_rows"
        )
        # Ledger steps taken by earlier optimizers of the same model.
        self.carried_steps = self.add_variable(shape=(), dtype="int64", name="carried_steps")
        self.applied_steps = self.add_variable(
            shape=(_APPLIED_CAPACITY, len(APPLIED_STEP_COLUMNS)),
            dtype="float64",
            aggregation="only_first_replica",
            name="applied_steps",
        )
        self.applied_rows = self.add_variable(
            shape=(), dtype="int64", aggregation="only_first_replica", name="applied_rows"
        )
        if self.adaptive_clipping is not None:
            # C_t, a DP release: saved and restored with the optimizer.
            self.clip_norm = self.add_variable(
                shape=(), dtype="float64", aggregation="only_first_replica", name="clip_norm",
                # Not keras.initializers.Constant, which rounds through float32.
                initializer=lambda shape, dtype: tf.fill(
                    shape, tf.constant(self.l2_norm_clip, tf.float64)))
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        elif [id(v) for v in _keras_compat.optimizer_trainable_variables(self.inner_optimizer)] != [id(v) for v in var_list]:
            raise ValueError(
                "The inner optimizer was built for other variables than this model's "
                "trainable variables. Wrap a fresh inner optimizer, or the inner "
                "optimizer of the DPOptimizer that trained this model."
            )
        super().build(var_list)
        # Built eagerly also when the first private step builds it in its trace.
        with tf.init_scope():
            self._continue_ledger_of(var_list)

    @property
    def variables(self):
        return _keras_compat.optimizer_own_variables(self) + self.inner_optimizer.variables

    def load_own_variables(self, store):
        saved = len(store.keys())
        if saved and saved != len(self.variables):
            # Keras would skip them with a warning: the ledger of the steps
            # already taken would be lost and epsilon under-reported.
            raise PrivacyConfigurationError(
                f"The saved DPOptimizer has {saved} variables, with the privacy "
                "ledger of the steps already taken, but this one has "
                f"{len(self.variables)}{' (it is not built)' if not self.built else ''}. "
                "Loading would drop that ledger. Call tf_megadp.make_private(model) "
                "before load_weights (it builds the optimizer first), or "
                "model.optimizer.build(model.trainable_variables); compile with the "
                "same DPOptimizer settings; or resume with "
                "tf_megadp.restore_training_state."
            )
        for index, variable in enumerate(self.variables if saved else ()):
            if tuple(variable.shape) != tuple(np.shape(store[str(index)])):
                raise PrivacyConfigurationError(
                    f"Saved DPOptimizer variable {index} ({variable.name}) has shape "
                    f"{tuple(np.shape(store[str(index)]))} but this optimizer's is "
                    f"{tuple(variable.shape)}: the state was not saved by this model with "
                    "these DPOptimizer settings, so its ledger cannot be loaded whole. "
                    "Compile with the settings the file was saved with, or start a new run."
                )
        super().load_own_variables(store)
        if self.built and saved:
            # A restored optimizer resumes at a logical-step boundary, and its
            # ledger is the one of the weights loaded with it.
            self.discard_partial_step()
            self._carried_from = None
            self._claim(_keras_compat.optimizer_trainable_variables(self))

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
            "`keras.models.load_model`). A custom training loop calls a "
            "`tf_megadp.PrivateStep` once per micro-batch instead of "
            "`apply_gradients`."
        )

    apply = _fail_aggregated
    apply_gradients = _fail_aggregated
    stateless_apply = _fail_aggregated

    def accumulate(self, *args, **kwargs):
        """Not public: only the private train step may add clipped sums.

        Raises:
            PrivacyConfigurationError: always. Gradients from user code are
                not clipped per example; use `tf_megadp.make_private(model)`
                and `model.fit` / `model.train_step` instead.
        """
        raise PrivacyConfigurationError(
            "DPOptimizer.accumulate is not public: gradients from user code are "
            "not clipped per example, so their sum has no sensitivity bound. Call "
            "`model = tf_megadp.make_private(model)` and train with `model.fit`, "
            "or with a `tf_megadp.PrivateStep` in a custom loop; the private step "
            "clips each example before it reaches the optimizer."
        )

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- Schedule look-ups (Python) -------------------------------------------

    def accumulation_steps_at(self, step: int) -> int:
        if self.schedule is None:
            return self.accumulation_steps
        return self.schedule.phase_at(step).accumulation_steps

    def noise_multiplier_at(self, step: int) -> float:
        if self.schedule is None:
            return self.noise_multiplier
        return noise_multiplier_of(self.schedule.phase_at(step), self.noise_multiplier)

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
        return float(step_capacity(self.accumulation_steps, micro_batch_size, num_replicas))

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
        return self.schedule.phase_tensors(step, self.noise_multiplier)

    def _accumulate_clipped(self, token, gradient_sum, trainable_variables, micro_batch_size,
                            nonfinite, centred_count=None):
        """Adds one micro-batch's clipped sum; applies the noisy update when due.

        Called by the private train step in a replica context, with its token.

        Args:
            gradient_sum: clipped per-example gradient sum per trainable
                variable (None where the loss does not reach the variable).
            trainable_variables: the model's trainable variables, aligned.
            micro_batch_size: m (a Python int or scalar tensor).
            nonfinite: count of examples dropped for non-finite gradients.
            centred_count: with adaptive clipping, the micro-batch's
                `adaptive_clipping.centred_count` at the step's C.
        """
        if token is not _PRIVATE_STEP:
            self.accumulate()  # Raises, naming make_private.
        if not self.built:
            self.build(trainable_variables)
        if self.schedule is not None:
            _check_schedule_layout(self.schedule, micro_batch_size)
        state = self._in_memory
        for accumulator, gradient in zip(state.accumulators, gradient_sum):
            if gradient is not None:
                accumulator.assign_add(tf.cast(gradient, accumulator.dtype))
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        state.micro_steps.assign_add(1)
        state.step_rows.assign_add(tf.cast(micro_batch_size, tf.int64) * replicas)
        state.nonfinite_examples.assign_add(tf.cast(nonfinite, tf.int64))
        if self.adaptive_clipping is not None:
            if centred_count is None:
                raise PrivacyConfigurationError(
                    "This DPOptimizer clips adaptively but the step gave it no count of "
                    "unclipped examples. Train through tf_megadp.make_private or a "
                    "tf_megadp.PrivateStep.")
            if isinstance(micro_batch_size, int) and self.schedule is None and (
                    self.normalize_by is None):
                _check_adaptive_pair(self.adaptive_clipping, self.noise_multiplier,
                                     float(micro_batch_size * self.accumulation_steps * replicas))
            state.centred_count.assign_add(tf.cast(centred_count, tf.float64))
        step = tf.cast(self.iterations, tf.int64)
        accumulation_steps, divisor, noise_multiplier = self._phase_values(step)
        if divisor is None:
            divisor = tf.cast(step_capacity(
                accumulation_steps, tf.cast(micro_batch_size, tf.int64), replicas), tf.float32)
        connected = [g is not None for g in gradient_sum]

        def noisy_update(step, divisor, noise_multiplier):
            count_multiplier = tf.constant(0.0, tf.float32)
            if self.adaptive_clipping is not None:
                noise_multiplier, count_multiplier, count_stddev = adaptive.step_noise_multipliers(
                    self.adaptive_clipping, noise_multiplier, divisor)
            # A state restored inside the step (without its micro-step counter)
            # is caught here: the noise never repeats a drawn step's.
            generation = self.draw_generation(True)
            # Every noise of the step (gradient and count) uses this step's C.
            self._noisy_update(trainable_variables, connected, step, generation, divisor,
                               noise_multiplier)
            if self.adaptive_clipping is not None:
                adaptive.release_count_and_update(
                    self.adaptive_clipping, self.clip_norm, state.centred_count.value,
                    count_stddev, divisor, tf.random.experimental.stateless_fold_in(
                        self._step_key(step, generation), len(state.accumulators)),
                    tf.distribute.get_strategy().num_replicas_in_sync,
                    self.adaptive_clipping.clip_norm_bounds(self.l2_norm_clip))
                state.centred_count.assign(0.0)
                # Read by the ledger keeper, which stops the run once the
                # step is in the ledger.
                finite = adaptive.all_finite(self.clip_norm.value, trainable_variables)
                state.nonfinite_updates.assign_add(tf.cast(tf.logical_not(finite), tf.int64))
            self._record_applied_step(noise_multiplier, accumulation_steps, divisor,
                                      count_multiplier)
            return tf.constant(True)

        def skip():
            return tf.constant(False)

        if _keras_compat.strategy_supports_no_merge_call():
            return tf.cond(
                state.micro_steps >= accumulation_steps,
                lambda: noisy_update(step, divisor, noise_multiplier),
                skip,
            )

        # MirroredStrategy and MultiWorkerMirroredStrategy (unless XLA on GPUs)
        # and TPUStrategy all-reduce through merge_call, which TensorFlow
        # forbids inside a tf.cond taken in a replica context. Decide in the
        # cross-replica context instead, as keras' LossScaleOptimizer does:
        # every replica holds the same micro-step count, so replica 0 decides.
        def cross_replica(distribution, accumulation_steps, *values):
            due = state.micro_steps.value >= distribution.experimental_local_results(
                accumulation_steps)[0]

            def update_every_replica():
                distribution.extended.call_for_each_replica(noisy_update, args=values)
                return tf.constant(True)

            return tf.cond(due, update_every_replica, skip)

        return tf.distribute.get_replica_context().merge_call(
            cross_replica, args=(accumulation_steps, step, divisor, noise_multiplier)
        )

    # -- Serialization ---------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self.noise_multiplier,
            "accumulation_steps": None if self.schedule else self.accumulation_steps,
            "normalize_by": self.normalize_by,
            "seed": self.seed,
            "schedule": self.schedule.to_dict() if self.schedule else None,
            "clipping": self.clipping,
            "per_example_scaling": self.per_example_scaling,
            "automatic_scaling_stability": self.automatic_scaling_stability,
            "examples_per_unit": self.examples_per_unit,
            "adaptive_clipping": (None if self.adaptive_clipping is None
                                  else self.adaptive_clipping.to_dict()),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["optimizer"] = keras.saving.deserialize_keras_object(
            config["optimizer"], custom_objects=custom_objects
        )
        return cls(**config)
