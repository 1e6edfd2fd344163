"""The job's learning rate: warmup and cosine decay, scaled with each phase's batch.

`BatchScaledSchedule` multiplies a base Keras schedule by a constant factor per
phase of the run's `BatchSizeSchedule`, (B / reference)^power, so that a
growing-batch run takes larger steps once its batch is larger. It is a
registered Keras serializable, so a checkpointed optimizer restores it.
"""

from __future__ import annotations

from typing import Any, Sequence

import keras
import tensorflow as tf

__all__ = ["BatchScaledSchedule"]


@keras.saving.register_keras_serializable(package="tf_megadp.jobs.bert")
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

    def __call__(self, step):
        step = tf.cast(step, tf.int64)
        phase = tf.searchsorted(tf.constant(self.boundaries, tf.int64), step[None],
                                side="right")[0] if self.boundaries else 0
        factor = tf.gather(tf.constant(self.factors, tf.float32), phase)
        return self.base(step) * tf.cast(factor, tf.float32)

    def get_config(self) -> dict[str, Any]:
        return {"base": keras.optimizers.schedules.serialize(self.base),
                "boundaries": self.boundaries, "factors": self.factors}
