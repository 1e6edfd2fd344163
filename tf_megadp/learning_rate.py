"""Learning rates that follow the logical batch size.

`BatchScaledSchedule` multiplies a base Keras schedule by a constant factor per
phase of a `BatchSizeSchedule`, (B / reference)^power, so that a growing-batch
run takes larger steps once its batch is larger (power 1: linear scaling; 0.5:
square-root scaling). It is a registered Keras serializable, so a checkpointed
optimizer restores it. Hand it to the inner optimizer of a `DPOptimizer`, whose
`iterations` count logical steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import keras
import tensorflow as tf

if TYPE_CHECKING:
    from tf_megadp.steps import BatchSizeSchedule

__all__ = ["BatchScaledSchedule"]


@keras.saving.register_keras_serializable(package="tf_megadp")
class BatchScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """`base(step) * factors[phase of step]`: a learning rate per phase of the batch.

    Args:
        base: the shape over the whole run (e.g. warmup then cosine decay).
        boundaries: the first step of every phase after the first (increasing).
        factors: one multiplier per phase (len(boundaries) + 1).

    Example:
    ```python
    # 100 steps of B = 256 then 100 of B = 1024, lr linear in B around B = 256:
    lr = BatchScaledSchedule(keras.optimizers.schedules.CosineDecay(2e-3, 200),
                             boundaries=[100], factors=[1.0, 4.0])
    # The same from the batch schedule itself:
    lr = BatchScaledSchedule.for_batch_schedule(
        keras.optimizers.schedules.CosineDecay(2e-3, 200), batch_schedule,
        reference_batch_size=256)
    ```
    """

    def __init__(self, base, boundaries: Sequence[int], factors: Sequence[float]):
        if len(factors) != len(boundaries) + 1:
            raise ValueError(
                f"BatchScaledSchedule needs one factor per phase: {len(boundaries) + 1} for "
                f"{len(boundaries)} boundaries, got {len(factors)}.")
        if isinstance(base, dict):
            base = keras.optimizers.schedules.deserialize(base)
        self.base = base
        self.boundaries = [int(b) for b in boundaries]
        self.factors = [float(f) for f in factors]

    @classmethod
    def for_batch_schedule(
        cls,
        base,
        batch_schedule: "BatchSizeSchedule",
        *,
        reference_batch_size: float,
        power: float = 1.0,
        steps_per_logical_step: int = 1,
    ) -> "BatchScaledSchedule":
        """Factors (B_phase / reference_batch_size)^power, one per phase.

        Args:
            base: the Keras schedule (or float) over the whole run.
            batch_schedule: the run's `BatchSizeSchedule`.
            reference_batch_size: the batch at which `base` is the rate.
            power: 1 for linear scaling, 0.5 for square-root scaling.
            steps_per_logical_step: how often the optimizer advances per
                logical step: 1 under a `DPOptimizer`; k for a non-private
                baseline that accumulates with Keras's
                `gradient_accumulation_steps`.

        Returns:
            The schedule.
        """
        if not reference_batch_size > 0:
            raise ValueError(f"reference_batch_size must be > 0, got {reference_batch_size!r}.")
        if not isinstance(base, keras.optimizers.schedules.LearningRateSchedule):
            base = keras.optimizers.schedules.PolynomialDecay(float(base), 1, float(base))
        boundaries, factors, step = [], [], 0
        for phase in batch_schedule.phases:
            if factors:
                boundaries.append(step * steps_per_logical_step)
            factors.append((phase.batch_size / reference_batch_size) ** power)
            step += phase.steps
        return cls(base, boundaries, factors)

    def __call__(self, step):
        step = tf.cast(step, tf.int64)
        phase = tf.searchsorted(tf.constant(self.boundaries, tf.int64), step[None],
                                side="right")[0] if self.boundaries else 0
        factor = tf.gather(tf.constant(self.factors, tf.float32), phase)
        return self.base(step) * tf.cast(factor, tf.float32)

    def get_config(self) -> dict[str, Any]:
        return {"base": keras.optimizers.schedules.serialize(self.base),
                "boundaries": self.boundaries, "factors": self.factors}
