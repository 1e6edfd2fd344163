"""`DPOptimizer`: the Keras optimizer of a private run, and its logical step.

One micro-batch at a time, the private step hands over its clipped sum
(`add_micro_batch`). The optimizer is a composition of named stages, each
owning its slice of the state:

* `accumulation_stage` (`accumulators.AccumulationStage`): the clipped
  sums of the logical step, in memory only;
* `noise_stage` (`noise.NoiseStage`): the secret key, the draw generation
  and the run's noise mechanism's stream;
* `ledger_stage` (`ledger.LedgerStage`): the privacy ledger and the buffer
  of steps the graph applied.

After the last micro-batch of a logical step the chain runs once:
accumulate -> noise -> inner apply -> ledger (`_end_logical_step`). The
decision "is the logical step due" is taken in the replica context or,
under strategies that all-reduce through `merge_call`, in the
cross-replica context, as Keras's `LossScaleOptimizer` separates its two
paths.
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
from tf_megadp.accounting import PrivacyLedger
from tf_megadp.accounting.noise import NoiseMechanism, NoiseStrategy
from tf_megadp.optimizer.accumulators import AccumulationStage
from tf_megadp.optimizer.ledger import (
    APPLIED_STEP_COLUMNS,
    LedgerStage,
    claim,
    ledger_owner,
    read_ledger,
)
from tf_megadp.optimizer.memory import InMemoryState, InMemoryVariables
from tf_megadp.gaussian import fold_in
from tf_megadp.optimizer.noise import NoiseStage, replica_stddev
from tf_megadp.optimizer.settings import SETTING_NAMES, DPSettings, check_inner_optimizer
from tf_megadp.steps import BatchSizeSchedule, noise_multiplier_of, step_capacity

__all__ = ["DPOptimizer", "PRIVATE_STEP_TOKEN"]

# Passed by tf_megadp's private step (`tf_megadp.training`) with every clipped
# sum: a guard against handing the optimizer gradients by accident, not a
# secret. Gradients from user code are not clipped per example.
PRIVATE_STEP_TOKEN = object()
# What cannot change once built: the settings, and the objects built from them.
_FROZEN = frozenset(SETTING_NAMES) | {"settings", "inner_optimizer", "clipping_strategy",
                                      "accumulation_stage", "noise_stage", "ledger_stage"}


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
            every step. A registered noise mechanism
            (`tf_megadp.accounting.noise`, `noise_kinds()`): correlated
            noise, sigma C (C^{-1} z)_t for the mechanism's unit-norm
            strategy C (matrix-factorization DP-FTRL), streamed by the
            mechanism through the model-sized buffers it needs (possibly
            none), in memory only; sigma is then the noise multiplier on that C.
            A strategy optimized for the run's steps needs the run's
            `schedule`, and the sampler must be one the mechanism's
            accounting has a proof for (its `check_sampling`); the private
            fit refuses any other (docs/privacy.md, "Correlated noise").
        settings: instead of the settings above, a `DPSettings` (then
            give none of them).
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
        l2_norm_clip: float | None = None,
        noise_multiplier: float | None = None,
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
        noise: NoiseMechanism | dict | None = None,
        settings: DPSettings | None = None,
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
        check_inner_optimizer(optimizer)
        arguments = {
            "l2_norm_clip": l2_norm_clip, "noise_multiplier": noise_multiplier,
            "accumulation_steps": accumulation_steps, "normalize_by": normalize_by,
            "seed": seed, "schedule": schedule, "clipping": clipping,
            "per_example_scaling": per_example_scaling,
            "automatic_scaling_stability": automatic_scaling_stability,
            "examples_per_unit": examples_per_unit, "adaptive_clipping": adaptive_clipping,
            "loss_scale": loss_scale, "noise": noise,
        }
        settings = _settings_of(settings, arguments)
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
        # The stages of the logical step, each with its slice of the state.
        self.accumulation_stage = AccumulationStage(
            counts_unclipped=settings.adaptive_clipping is not None)
        self.noise_stage = NoiseStage(settings.noise_strategy(), settings.seed)
        self.ledger_stage = LedgerStage()
        # Adaptive clipping's noisy updates that left the weights or C
        # non-finite, counted in the graph (in memory only).
        self._apply_state = InMemoryState("count of non-finite updates")
        # (logical step, C) at every ledger update of this process (the report's).
        self.clip_norm_trajectory: list[tuple[int, float]] = []
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
        self.noise_stage.strategy = settings.noise_strategy()
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

    # -- The settings, each read as an attribute --------------------------------

    @property
    def l2_norm_clip(self) -> float:
        """C, the per-example gradient norm bound (`DPSettings`)."""
        return self.settings.l2_norm_clip

    @property
    def noise_multiplier(self) -> float:
        """sigma (`DPSettings`)."""
        return self.settings.noise_multiplier

    @property
    def accumulation_steps(self) -> int | None:
        """Micro-batches per logical step; None with a schedule (`DPSettings`)."""
        return self.settings.accumulation_steps

    @property
    def normalize_by(self) -> float | None:
        """The divisor B of the noisy sum, or None (`DPSettings`)."""
        return self.settings.normalize_by

    @property
    def seed(self) -> int | None:
        """The noise seed (None: OS entropy) (`DPSettings`)."""
        return self.settings.seed

    @property
    def schedule(self) -> BatchSizeSchedule | None:
        """The run's `BatchSizeSchedule`, or None (`DPSettings`)."""
        return self.settings.schedule

    @property
    def clipping(self) -> str | ClippingStrategy:
        """The clipping strategy's name or instance (`DPSettings`)."""
        return self.settings.clipping

    @property
    def per_example_scaling(self) -> str:
        """"clip" or "automatic" (`DPSettings`)."""
        return self.settings.per_example_scaling

    @property
    def automatic_scaling_stability(self) -> float:
        """gamma of automatic clipping (`DPSettings`)."""
        return self.settings.automatic_scaling_stability

    @property
    def examples_per_unit(self) -> int:
        """Rows per privacy unit (`DPSettings`)."""
        return self.settings.examples_per_unit

    @property
    def adaptive_clipping(self) -> adaptive.AdaptiveClipping | None:
        """Adaptive clipping's rule, or None (`DPSettings`)."""
        return self.settings.adaptive_clipping

    @property
    def loss_scale(self) -> float | None:
        """The fixed loss scale, or None (`DPSettings`)."""
        return self.settings.loss_scale

    @property
    def noise(self) -> NoiseMechanism | None:
        """The noise mechanism as given (None: independent noise) (`DPSettings`)."""
        return self.settings.noise

    @property
    def noise_strategy(self) -> NoiseStrategy:
        """The strategy this optimizer's noise streams (C = I without `noise`)."""
        return self.noise_stage.strategy

    def take_nonfinite_updates(self) -> int:
        """Adaptively clipped updates that left the weights or C non-finite since the last call.

        Counted in the graph, in memory only; reading resets the count.
        """
        if self.adaptive_clipping is None or not self.built:
            return 0
        counter = self._apply_state.nonfinite_updates
        count = int(counter.numpy())
        if count:
            counter.assign(0)
        return count

    # -- Keras plumbing -------------------------------------------------------

    # -- The stages' state, as the rest of tf_megadp reads it ------------------

    @property
    def micro_steps(self):
        """Micro-batches accumulated in the current logical step (a variable, in memory only)."""
        return self.accumulation_stage.state.micro_steps

    @property
    def micro_step(self) -> int:
        """The number of micro-batches accumulated in the current logical step (Python)."""
        return int(keras.ops.convert_to_numpy(self.micro_steps)) if self.built else 0

    @property
    def nonfinite_examples(self):
        """Examples dropped for a non-finite gradient since the optimizer was built (in memory)."""
        return self.accumulation_stage.state.nonfinite_examples

    @property
    def current_clip_norm(self):
        """C of the current logical step: the `clip_norm` variable's value with
        adaptive clipping (a tensor), else `l2_norm_clip`."""
        if self.adaptive_clipping is None:
            return self.l2_norm_clip
        return tf.convert_to_tensor(self.clip_norm.value)

    def discard_partial_step(self) -> int:
        """Drops the micro-batches accumulated since the last noisy update.

        Nothing computed from them was released, so discarding them spends
        no privacy, and no example of theirs can reach a later noisy sum.

        Returns:
            The number of micro-batches discarded.
        """
        return self.accumulation_stage.discard() if self.built else 0

    def draw_generation(self, starts_step) -> tf.Tensor:
        """The draw generation of the current logical step; opens a new one on a replay.

        Called by the private step before a micro-batch's forward pass
        (`starts_step`: whether it is the first of its logical step) and by
        the noisy update (`starts_step` True); see `NoiseStage.draw_generation`.

        Returns:
            The generation, an int64 scalar tensor.
        """
        return self.noise_stage.draw_generation(tf.cast(self.iterations, tf.int64), starts_step)

    def end_noise_segment(self) -> None:
        """Closes the open noise segment: the next noisy step opens a new one, with zeroed buffers.

        Called when what the noise stream follows changes outside the graph:
        other data, a restored state, an extended schedule.
        """
        if self.built:
            self.noise_stage.end_segment()

    def continue_noise_segment(self, data) -> None:
        """Keeps the open segment only if `data` is what it was drawing (at a run's start).

        Args:
            data: the public token of the data's secret assignment of
                examples to steps (`DataSource.assignment`), None if the
                data has none: then a new segment starts.
        """
        self.noise_stage.continue_segment(data)

    def noise_segment_continues(self, step: int) -> bool:
        """Whether logical step `step`, taken next, would continue the open segment."""
        return self.built and self.noise_stage.segment_continues(step)

    # -- The ledger of the weights ---------------------------------------------

    @property
    def steps_carried(self) -> int:
        """Logical steps that earlier optimizers of the same weights applied (in the ledger)."""
        return self.ledger_stage.steps_carried if self.built else 0

    @property
    def logical_steps_applied(self) -> int:
        """Noisy updates these weights received: this optimizer's and those it took over."""
        return self.ledger_stage.steps_applied if self.built else 0

    @property
    def logical_steps_recorded(self) -> int:
        """Logical steps in the ledger, of every kind (noiseless and unaccounted ones too)."""
        return self.ledger_stage.steps_recorded if self.built else 0

    @property
    def unrecorded_steps(self) -> int:
        """Applied logical steps that no ledger entry records (taken outside `fit`).

        The private `fit` records every step it applies after each batch,
        and a custom loop's `tf_megadp.PrivateStep` when its `record` runs;
        steps applied by `train_on_batch` or a loop that calls `train_step`
        itself stay unrecorded, and epsilon cannot be reported while there
        are any.
        """
        return self.logical_steps_applied - self.logical_steps_recorded

    @property
    def pending_applied_steps(self) -> int:
        """Logical steps the compiled step applied that no one has taken from its buffer yet."""
        return self.ledger_stage.pending_applied_steps if self.built else 0

    def take_applied_steps(self) -> np.ndarray:
        """The rows (`APPLIED_STEP_COLUMNS`) the compiled step appended since the last take.

        They leave the buffer: the caller (the run's ledger recorder) turns
        them into ledger entries (see `LedgerStage.take_applied_steps`).
        """
        if not self.built:
            return np.zeros((0, len(APPLIED_STEP_COLUMNS)))
        return self.ledger_stage.take_applied_steps()

    def take_carried_over_steps(self) -> int | None:
        """The steps this optimizer took over from another when built, reported once.

        Returns:
            The previous optimizer's applied steps the first time it is
            asked after `build` took them over (the private run warns), else None.
        """
        return self.ledger_stage.take_carried_over_steps()

    def start_ledger(self, ledger: PrivacyLedger) -> None:
        """Makes `ledger` the start of this optimizer's, as steps it applied (a release's).

        Args:
            ledger: the ledger of the weights' earlier steps.
        """
        self.ledger_stage.start(ledger)

    def check_ledger_covers(self, variables) -> None:
        """Checks, before a private step, that this optimizer's ledger covers `variables`.

        Args:
            variables: the model's trainable variables.

        Raises:
            PrivacyConfigurationError: another DPOptimizer trained them
                after this one (for example the model was compiled with a
                new DPOptimizer, trained, and compiled again with this one),
                so this ledger misses its steps.
        """
        owner = ledger_owner(variables)
        if owner is not None and owner is not self and owner.built and (
                owner.ledger_stage.has_history()) and (
            owner.logical_steps_applied != self.logical_steps_applied
            or read_ledger(owner) != read_ledger(self)
        ):
            raise PrivacyConfigurationError(
                f"This model's weights were trained further by another DPOptimizer "
                f"({owner.logical_steps_applied} logical steps in all, this optimizer "
                f"records {self.logical_steps_applied}): its ledger misses those steps. "
                "Compile with a fresh DPOptimizer (it takes the ledger of the weights "
                "over), or restore the run with keras.models.load_model or "
                "tf_megadp.restore_training_state."
            )
        claim(self, variables)

    def _continue_ledger_of(self, variables) -> None:
        """Takes over the ledger of the DPOptimizer whose ledger covers `variables`.

        The new optimizer continues exactly where the previous one stopped:
        its ledger (with the steps it could not account and those without
        noise), and the count of steps applied (`carried_steps` plus this
        optimizer's `iterations`). Wrapping the previous optimizer's inner
        optimizer continues its state (moments, iterations) as well.
        """
        previous = ledger_owner(variables)
        self.ledger_stage.forget_carried_over_steps()
        if (previous is not None and previous is not self and previous.built
                and previous.ledger_stage.has_history()):
            same_inner = previous.inner_optimizer is self.inner_optimizer
            if not same_inner and int(keras.ops.convert_to_numpy(self.iterations)) != 0:
                raise PrivacyConfigurationError(
                    f"The inner optimizer has already taken "
                    f"{int(keras.ops.convert_to_numpy(self.iterations))} "
                    "steps that no privacy ledger recorded, and this model's weights "
                    "carry the ledger of another DPOptimizer. Wrap a fresh inner "
                    "optimizer, or the inner optimizer of the DPOptimizer that trained "
                    "the model (model.optimizer.inner_optimizer) to continue its state."
                )
            # Steps the previous optimizer applied outside fit were never
            # recorded: they join the ledger as unaccounted steps.
            self.ledger_stage.take_over(previous.ledger_stage, continues_iterations=same_inner,
                                        unrecorded_steps=previous.unrecorded_steps)
        claim(self, variables)

    def build(self, var_list):
        if self.built:
            return
        memory = InMemoryVariables(self)
        self.accumulation_stage.build(memory, var_list)
        self.noise_stage.build(memory, var_list)
        self.ledger_stage.build(self.add_variable, self.inner_optimizer.iterations)
        if self.adaptive_clipping is not None:
            self._apply_state.nonfinite_updates = memory.scalar("nonfinite_updates", "int64")
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
            # A file whose ledger this tf_megadp cannot read is refused by name.
            self.ledger_stage.read()
            self.ledger_stage.forget_carried_over_steps()
            claim(self, _keras_compat.optimizer_trainable_variables(self))

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
        self.accumulation_stage.add(gradient_sum, micro_batch_size, nonfinite, centred_count,
                                    replicas)
        step = tf.cast(self.iterations, tf.int64)
        accumulation_steps, divisor, noise_multiplier = self._phase(step, micro_batch_size,
                                                                    replicas)
        end_step = functools.partial(self._end_logical_step, trainable_variables,
                                     [g is not None for g in gradient_sum], accumulation_steps)
        if _keras_compat.strategy_supports_no_merge_call():
            return tf.cond(self.micro_steps >= accumulation_steps,
                           lambda: end_step(step, divisor, noise_multiplier), _not_applied)
        # `end_step` is bound to the merge function, not passed as one of its
        # arguments: merge_call groups each argument into one value per replica.
        return tf.distribute.get_replica_context().merge_call(
            functools.partial(self._end_step_in_cross_replica_context, end_step),
            args=(accumulation_steps, step, divisor, noise_multiplier))

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
        due = self.micro_steps.value >= distribution.experimental_local_results(
            accumulation_steps)[0]

        def end_on_every_replica():
            distribution.extended.call_for_each_replica(end_step, args=values)
            return tf.constant(True)

        return tf.cond(due, end_on_every_replica, _not_applied)

    def _end_logical_step(self, trainable_variables, connected, accumulation_steps, step,
                          divisor, noise_multiplier) -> tf.Tensor:
        """The chain of a logical step's end: accumulated sums -> noise -> inner apply -> ledger."""
        count_multiplier = tf.constant(0.0, tf.float32)
        count_stddev = None
        if self.adaptive_clipping is not None:
            noise_multiplier, count_multiplier, count_stddev = adaptive.step_noise_multipliers(
                self.adaptive_clipping, noise_multiplier, divisor)
        # A state restored inside the step (without its micro-step counter)
        # is caught here: the noise never repeats a drawn step's.
        generation = self.noise_stage.draw_generation(step, True)
        new_segment = self.noise_stage.open_segment(step, generation)
        # Noise: every noise of the step (gradient and count) uses this step's C.
        clip_norm = self.current_clip_norm
        if tf.is_tensor(clip_norm):  # Adaptive clipping: this step's C.
            clip_norm = tf.cast(clip_norm, noise_multiplier.dtype)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        noisy_sums = self.noise_stage.noisy_sums(
            self.accumulation_stage.sums(), connected, step, generation,
            replica_stddev(noise_multiplier, clip_norm, replicas))
        # Inner apply: the noisy sums over B.
        variables = [v for v, is_connected in zip(trainable_variables, connected) if is_connected]
        self.inner_optimizer.apply(
            [tf.cast(noisy / tf.cast(divisor, noisy.dtype), variable.dtype)
             for noisy, variable in zip(noisy_sums, variables)], variables)
        self.accumulation_stage.reset()
        if self.adaptive_clipping is not None:
            self._release_count(trainable_variables, step, generation, divisor, count_stddev)
        # Ledger.
        self.ledger_stage.record_applied_step(
            noise_multiplier, accumulation_steps, self.accumulation_stage.take_rows(), divisor,
            count_multiplier, new_segment)
        return tf.constant(True)

    def _release_count(self, trainable_variables, step, generation, divisor, count_stddev) -> None:
        """Adaptive clipping: releases the noisy count of unclipped examples and moves C."""
        adaptive.release_count_and_update(
            self.adaptive_clipping, self.clip_norm, self.accumulation_stage.take_centred_count(),
            count_stddev, divisor, fold_in(self.noise_stage.step_key(step, generation),
                                           len(trainable_variables)),
            tf.distribute.get_strategy().num_replicas_in_sync,
            self.adaptive_clipping.clip_norm_bounds(self.l2_norm_clip))
        # Read by the ledger recorder, which stops the run once the step is
        # in the ledger.
        finite = adaptive.all_finite(self.clip_norm.value, trainable_variables)
        self._apply_state.nonfinite_updates.assign_add(tf.cast(tf.logical_not(finite), tf.int64))

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


# Each setting's value when DPOptimizer is not given it.
_UNSET = {field.name: (None if field.default is dataclasses.MISSING else field.default)
          for field in dataclasses.fields(DPSettings)}


def _settings_of(settings: DPSettings | None, arguments: dict[str, Any]) -> DPSettings:
    """The `DPSettings` of a DPOptimizer: the one given, or those its arguments describe.

    Raises:
        TypeError: `settings` is not a `DPSettings`, or comes with settings
            given one by one as well (which of them would hold?).
    """
    if settings is None:
        return DPSettings(**arguments)
    if not isinstance(settings, DPSettings):
        raise TypeError(f"settings must be a tf_megadp.optimizer.DPSettings, got {settings!r}.")
    also = sorted(name for name, value in arguments.items() if value != _UNSET[name])
    if also:
        raise TypeError(
            f"DPOptimizer got settings=DPSettings(...) and {also} as well: pass each setting "
            "once, in the DPSettings (dataclasses.replace(settings, ...) changes one).")
    return settings


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

