"""`DPOptimizer`: the Keras optimizer of a private run, and its logical step.

One micro-batch at a time, the private step hands over its clipped sum
(`add_micro_batch`); the optimizer adds it to its accumulators and, after
the last micro-batch of a logical step, adds the noise once, applies the
update through the inner optimizer and appends the step to its ledger
buffer. Each part of that is one named method, and the decision "is the
logical step due" is taken in the replica context or, under strategies that
all-reduce through `merge_call`, in the cross-replica context, as Keras's
`LossScaleOptimizer` separates its two paths.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_megadp import _keras_compat
from tf_megadp import adaptive_clipping as adaptive
from tf_megadp.clipping import ClippingStrategy, get_clipping_strategy
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.optimizer.accumulators import Accumulators
from tf_megadp.accounting.correlated_noise import BLT, BandMF
from tf_megadp.optimizer.ledger import LedgerOfWeights
from tf_megadp.optimizer.noise_buffers import NoiseBuffers
from tf_megadp.optimizer.settings import SETTING_NAMES, DPSettings, check_inner_optimizer
from tf_megadp.steps import BatchSizeSchedule, noise_multiplier_of, step_capacity

__all__ = ["DPOptimizer", "PRIVATE_STEP_TOKEN"]

# Passed by tf_megadp's private step (`tf_megadp.training`) with every clipped
# sum: a guard against handing the optimizer gradients by accident, not a
# secret. Gradients from user code are not clipped per example.
PRIVATE_STEP_TOKEN = object()
# What cannot change once built: the settings, and the objects built from them.
_FROZEN = frozenset(SETTING_NAMES) | {"settings", "inner_optimizer", "clipping_strategy"}


@keras.saving.register_keras_serializable(package="tf_megadp")
class DPOptimizer(LedgerOfWeights, NoiseBuffers, Accumulators, keras.optimizers.Optimizer):
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
        loss_scale: a fixed loss scale S for float16 compute (the
            `mixed_float16` policy, GPUs without bfloat16): each example's
            loss is multiplied by S before its backward pass, so that small
            float16 gradients do not underflow, and its gradient (or ghost
            records) divided by S in float32 before its norm. An example
            whose scaled gradient overflows is non-finite and contributes
            zero, like any other. S never moves: Keras's dynamic scaling
            reacts to whether any example overflowed, which is not private.
            None (default): no scaling, or the `initial_scale` of the
            `LossScaleOptimizer` Keras wraps a `mixed_float16` model's
            optimizer in (`tf_megadp.make_private` unwraps it). A power of
            two keeps the unscaling exact (docs/concepts.md, "Float16
            compute").
        noise: None (default): independent noise, N(0, sigma^2 C^2) fresh
            every step. A `tf_megadp.BandMF` or `tf_megadp.BLT`: correlated
            noise, sigma C (C^{-1} z)_t for the mechanism's unit-norm
            strategy C (matrix-factorization DP-FTRL), streamed through b - 1
            (BandMF) or d (BLT) model-sized buffers per replica that live in
            memory only; sigma is then the noise multiplier on that C. Needs
            the run's `schedule` (its strategy is optimized for the run's
            steps) and a sampler its accounting has a proof for: BandMF with
            cyclic Poisson sampling (`cycle_length >= num_bands`) or fixed
            order, BLT with fixed order (`tf_megadp.FixedOrderSampler`); the
            private fit refuses any other (docs/privacy.md, "Correlated
            noise").
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
        loss_scale: float | None = None,
        noise: BandMF | BLT | dict | None = None,
        name: str | None = None,
        **kwargs,
    ):
        given = locals()  # The arguments, taken before any other local exists.
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
        check_inner_optimizer(optimizer)
        settings = DPSettings(**{setting: given[setting] for setting in SETTING_NAMES})
        if settings.seed is not None:
            warnings.warn(
                f"DPOptimizer(seed={settings.seed}) makes the noise reproducible: anyone "
                "who can guess the seed can regenerate the noise and subtract it from "
                "the released model, so the run is NOT private against them. The "
                "privacy report marks it 'seeded noise: not for release'. Use "
                "seed=None (the default, OS entropy) for any run you publish.",
                UserWarning,
                stacklevel=2,
            )
        super().__init__(learning_rate=0.0, name=name or "dp_optimizer")
        self.settings = settings
        self.inner_optimizer = optimizer
        self.clipping_strategy = (_claimed(settings.clipping)
                                  if isinstance(settings.clipping, ClippingStrategy)
                                  else get_clipping_strategy(settings.clipping))
        # (logical step, C) at every ledger update of this process (the report's).
        self.clip_norm_trajectory: list[tuple[int, float]] = []
        self._carried_from: int | None = None  # See `take_carried_over_steps`.
        self._settings_frozen = True
        if settings.noiseless:
            warnings.warn(
                "DPOptimizer with noise_multiplier=0 adds no noise: training is "
                "NOT differentially private (epsilon is infinite). Use this only "
                "as a clipped, non-private baseline.",
                stacklevel=2,
            )

    def __setattr__(self, name, value):
        if name in _FROZEN and getattr(self, "_settings_frozen", False):
            raise PrivacyConfigurationError(
                f"DPOptimizer.{name} cannot change after construction: Keras "
                "compiles the train step once, so a new value would be recorded "
                "but not used. Build a new DPOptimizer with the new setting and "
                "compile the model again (the privacy ledger carries over)."
            )
        super().__setattr__(name, value)

    def extend_schedule(self, phases, truncation_probability: float = 1e-9) -> BatchSizeSchedule:
        """Continues the schedule with more phases (use `tf_megadp.extend_schedule`).

        The steps already taken keep their phases, and the settings are
        validated again with the new ones; the model's compiled step must be
        traced again afterwards, since it holds the phases as constants
        (`tf_megadp.extend_schedule` does it).

        Args:
            phases: `tf_megadp.Phase`s or (steps, expected batch size) pairs.
            truncation_probability: as in `BatchSizeSchedule.for_poisson`.

        Returns:
            The extended schedule.

        Raises:
            PrivacyConfigurationError: this optimizer follows no schedule.
        """
        if self.schedule is None:
            raise PrivacyConfigurationError(
                "This DPOptimizer has no schedule, so its run has no end to extend: "
                "call fit again for more steps. For another batch size, compile with "
                "a new DPOptimizer that wraps the same inner optimizer "
                "(model.optimizer.inner_optimizer): the ledger and the inner "
                "optimizer's state carry over."
            )
        settings = self.settings.with_schedule(
            self.schedule.extended(phases, truncation_probability=truncation_probability))
        # Bypasses the freeze: the caller retraces the step that uses it.
        super().__setattr__("settings", settings)
        # Correlated noise is optimized for the run's steps: the longer run
        # streams another strategy, from a new segment.
        self._noise_strategy = None
        self.end_noise_segment()
        return settings.schedule

    def adopt_loss_scale(self, loss_scale: float) -> None:
        """Sets the fixed loss scale of an optimizer built without one (`mixed_float16`).

        `tf_megadp.make_private` calls it with the `initial_scale` of the
        `LossScaleOptimizer` Keras wrapped this optimizer in. The scale is
        numerics, not privacy (each example's gradient is unscaled before
        its norm), but a step traced with another scale would keep it, so
        it is taken only before the first step.

        Raises:
            PrivacyConfigurationError: this optimizer already has a loss
                scale or was built.
        """
        if self.loss_scale is not None or self.built:
            raise PrivacyConfigurationError(
                "The loss scale of a DPOptimizer is fixed once it has one or took a step; "
                "build a new DPOptimizer(..., loss_scale=...) and compile the model again "
                "(the privacy ledger carries over).")
        # Bypasses the freeze: nothing was traced with the previous value.
        super().__setattr__("settings", dataclasses.replace(self.settings, loss_scale=loss_scale))

    @property
    def automatic_stability(self) -> float | None:
        """gamma of automatic clipping, or None for flat clipping (what strategies take)."""
        return self.settings.automatic_stability

    @property
    def seeded_noise(self) -> bool:
        """Whether the noise comes from an explicit seed (not for release)."""
        return self.seed is not None

    @property
    def logical_step(self) -> int:
        """Logical steps completed (`iterations`), as a Python int."""
        return int(keras.ops.convert_to_numpy(self.iterations))

    def settings_report(self) -> dict[str, Any]:
        """What the privacy report states of the settings (`DPSettings.report`).

        With the inner optimizer's class, with adaptive clipping where C
        went in this process, and with correlated noise its resolved strategy.
        """
        report = self.settings.report()
        report["optimizer"] = type(self.inner_optimizer).__name__
        report["adaptive_clipping"] = adaptive.report_section(self)
        if self.noise is not None:
            # The strategy the noise streamed: public numbers (never the buffers).
            report["noise_strategy"] = self.noise_strategy.describe()
        return report

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
        self._build_ledger_variables()
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
            # ledger is the one of the weights loaded with it; the noise
            # buffers follow other steps than the loaded weights'.
            self.discard_partial_step()
            self.end_noise_segment()
            self._ledger_loaded(_keras_compat.optimizer_trainable_variables(self))

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

    # -- The logical step (graph) ---------------------------------------------

    def add_micro_batch(self, token, gradient_sum, trainable_variables, micro_batch_size,
                        nonfinite, centred_count=None) -> tf.Tensor:
        """Adds one micro-batch's clipped sum; ends the logical step when it is due.

        Called by the private step (`tf_megadp.training`) in a replica
        context, with `PRIVATE_STEP_TOKEN`.

        Args:
            token: `PRIVATE_STEP_TOKEN`; anything else raises.
            gradient_sum: clipped per-example gradient sum per trainable
                variable (None where the loss does not reach the variable).
            trainable_variables: the model's trainable variables, aligned.
            micro_batch_size: m (a Python int or scalar tensor), in privacy units.
            nonfinite: count of examples dropped for non-finite gradients.
            centred_count: with adaptive clipping, the micro-batch's
                `adaptive_clipping.centred_count` at the step's C.

        Returns:
            A bool scalar: whether this micro-batch ended a logical step (the
            noisy update was applied).

        Raises:
            PrivacyConfigurationError: the caller is not the private step, or
                the micro-batches do not fit the settings.
        """
        if token is not PRIVATE_STEP_TOKEN:
            self.accumulate()  # Raises, naming make_private.
        if not self.built:
            self.build(trainable_variables)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        self.settings.check_step_layout(micro_batch_size, replicas)
        self._accumulate(gradient_sum, micro_batch_size, nonfinite, centred_count)
        step = tf.cast(self.iterations, tf.int64)
        accumulation_steps, divisor, noise_multiplier = self._phase(step, micro_batch_size,
                                                                    replicas)
        end_step = functools.partial(self._end_logical_step, trainable_variables,
                                     [g is not None for g in gradient_sum], accumulation_steps)
        if _keras_compat.strategy_supports_no_merge_call():
            return tf.cond(self._in_memory.micro_steps >= accumulation_steps,
                           lambda: end_step(step, divisor, noise_multiplier), _not_applied)
        # `end_step` is bound to the merge function, not passed as one of its
        # arguments: merge_call groups each argument into one value per replica.
        return tf.distribute.get_replica_context().merge_call(
            functools.partial(self._end_step_in_cross_replica_context, end_step),
            args=(accumulation_steps, step, divisor, noise_multiplier))

    def _accumulate(self, gradient_sum, micro_batch_size, nonfinite, centred_count) -> None:
        """Adds a micro-batch's clipped sums and counts to this replica's accumulators."""
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
            state.centred_count.assign_add(tf.cast(centred_count, tf.float64))

    def _phase(self, step, micro_batch_size, replicas: int):
        """(accumulation steps, divisor B, noise multiplier) of logical step `step`, as tensors."""
        if self.schedule is not None:
            return self.schedule.phase_tensors(step, self.noise_multiplier)
        accumulation_steps = tf.constant(self.accumulation_steps, tf.int64)
        if self.normalize_by is not None:
            divisor = tf.constant(self.normalize_by, tf.float32)
        else:
            divisor = tf.cast(step_capacity(
                accumulation_steps, tf.cast(micro_batch_size, tf.int64), replicas), tf.float32)
        return accumulation_steps, divisor, tf.constant(self.noise_multiplier, tf.float32)

    def _end_step_in_cross_replica_context(self, end_step, distribution, accumulation_steps,
                                           *values):
        """Ends the logical step, when due, from the cross-replica context.

        MirroredStrategy and MultiWorkerMirroredStrategy (unless XLA on GPUs)
        and TPUStrategy all-reduce through merge_call, which TensorFlow
        forbids inside a tf.cond taken in a replica context. Decide in the
        cross-replica context instead, as Keras's LossScaleOptimizer does:
        every replica holds the same micro-step count, so replica 0 decides.
        """
        due = self._in_memory.micro_steps.value >= distribution.experimental_local_results(
            accumulation_steps)[0]

        def end_on_every_replica():
            distribution.extended.call_for_each_replica(end_step, args=values)
            return tf.constant(True)

        return tf.cond(due, end_on_every_replica, _not_applied)

    def _end_logical_step(self, trainable_variables, connected, accumulation_steps, step,
                          divisor, noise_multiplier) -> tf.Tensor:
        """The end of a logical step: noise once, the update, C's update, the ledger row."""
        count_multiplier = tf.constant(0.0, tf.float32)
        count_stddev = None
        if self.adaptive_clipping is not None:
            noise_multiplier, count_multiplier, count_stddev = adaptive.step_noise_multipliers(
                self.adaptive_clipping, noise_multiplier, divisor)
        # A state restored inside the step (without its micro-step counter)
        # is caught here: the noise never repeats a drawn step's.
        generation = self.draw_generation(True)
        new_segment = self._open_noise_segment(step, generation)
        # Every noise of the step (gradient and count) uses this step's C.
        self._apply_noise(trainable_variables, connected, step, generation, divisor,
                          noise_multiplier)
        if self.adaptive_clipping is not None:
            self._release_count(trainable_variables, step, generation, divisor, count_stddev)
        self._record_applied_step(noise_multiplier, accumulation_steps, divisor, count_multiplier,
                                  new_segment)
        return tf.constant(True)

    def _release_count(self, trainable_variables, step, generation, divisor, count_stddev) -> None:
        """Adaptive clipping: releases the noisy count of unclipped examples and moves C."""
        state = self._in_memory
        adaptive.release_count_and_update(
            self.adaptive_clipping, self.clip_norm, state.centred_count.value,
            count_stddev, divisor, tf.random.experimental.stateless_fold_in(
                self._step_key(step, generation), len(state.accumulators)),
            tf.distribute.get_strategy().num_replicas_in_sync,
            self.adaptive_clipping.clip_norm_bounds(self.l2_norm_clip))
        state.centred_count.assign(0.0)
        # Read by the ledger recorder, which stops the run once the step is
        # in the ledger.
        finite = adaptive.all_finite(self.clip_norm.value, trainable_variables)
        state.nonfinite_updates.assign_add(tf.cast(tf.logical_not(finite), tf.int64))

    # -- Serialization ---------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            **self.settings.to_config(),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["optimizer"] = keras.saving.deserialize_keras_object(
            config["optimizer"], custom_objects=custom_objects
        )
        return cls(**config)


def _not_applied() -> tf.Tensor:
    return tf.constant(False)


def _setting(name: str) -> property:
    return property(lambda optimizer: getattr(optimizer.settings, name),
                    doc=f"`DPSettings.{name}`: fixed at construction.")


# Each setting reads as an attribute of the optimizer (`optimizer.l2_norm_clip`).
for _name in SETTING_NAMES:
    setattr(DPOptimizer, _name, _setting(_name))
del _name


# A strategy instance caches its traced passes per model: given to a second
# DPOptimizer (after a layer was swapped and the model compiled again, say),
# it would run the first optimizer's passes, which neither train nor check
# the new layer.
_CLAIMED = "_tf_megadp_claimed_by_an_optimizer"


def _claimed(strategy: ClippingStrategy) -> ClippingStrategy:
    """`strategy`, marked as serving one DPOptimizer; refuses one that already serves another."""
    if getattr(strategy, _CLAIMED, False):
        raise PrivacyConfigurationError(
            f"This {type(strategy).__name__} instance already serves another DPOptimizer, "
            "and it keeps that optimizer's traced passes. Give each DPOptimizer its own: "
            f"clipping={type(strategy).__name__}(...) again, or a name such as "
            f"clipping={getattr(strategy, 'name', 'auto')!r}.")
    setattr(strategy, _CLAIMED, True)
    return strategy

