"""The accumulation stage of a logical step: the clipped sums of its micro-batches, in memory only.

Each replica adds its clipped sums to its own copy of an accumulator (ON_READ,
SUM); the noise stage reads their sum once per logical step. The
accumulators hold the exact, un-noised clipped sum, so they live in an
`InMemoryState` that no file sees (`tf_megadp.optimizer.memory`); a
restored optimizer resumes at a logical-step boundary, the partial step
discarded (nothing computed from it was released).
"""

from __future__ import annotations

import tensorflow as tf

from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.optimizer.memory import InMemoryState, InMemoryVariables

__all__ = ["AccumulationStage"]


class AccumulationStage:
    """Accumulates a logical step's clipped sums and counts (the first stage of a `DPOptimizer`).

    Its in-memory state (`state`): `accumulators` (one per trainable
    variable), `micro_steps` (micro-batches in the current logical step),
    `step_rows` (rows they held), `nonfinite_examples` (examples dropped
    for a non-finite gradient since the build) and, with adaptive clipping,
    `centred_count` (the un-noised centred count of unclipped examples).

    Args:
        counts_unclipped: whether the step also accumulates adaptive
            clipping's centred count.
    """

    def __init__(self, counts_unclipped: bool):
        self._counts_unclipped = counts_unclipped
        self.state = InMemoryState("accumulators, the un-noised clipped sum")

    def __repr__(self) -> str:
        return "<DPOptimizer accumulation stage>"

    def build(self, variables: InMemoryVariables, var_list) -> None:
        """Makes the accumulators of `var_list` and the counters, zero."""
        state = self.state
        state.accumulators = [variables.replica_sum(v) for v in var_list]
        state.micro_steps = variables.scalar("micro_steps", "int64")
        state.step_rows = variables.scalar("step_rows", "int64")
        state.nonfinite_examples = variables.replica_sum(
            shape=(), dtype="int64", name="nonfinite_examples")
        state.centred_count = (variables.replica_sum(shape=(), dtype="float64",
                                                     name="centred_count")
                               if self._counts_unclipped else None)

    def add(self, gradient_sum, micro_batch_size, nonfinite, centred_count, replicas: int) -> None:
        """Adds a micro-batch's clipped sums and counts to this replica's accumulators (graph).

        Raises:
            PrivacyConfigurationError: adaptive clipping without a count.
        """
        state = self.state
        for accumulator, gradient in zip(state.accumulators, gradient_sum):
            if gradient is not None:
                accumulator.assign_add(tf.cast(gradient, accumulator.dtype))
        state.micro_steps.assign_add(1)
        state.step_rows.assign_add(tf.cast(micro_batch_size, tf.int64) * replicas)
        state.nonfinite_examples.assign_add(tf.cast(nonfinite, tf.int64))
        if self._counts_unclipped:
            if centred_count is None:
                raise PrivacyConfigurationError(
                    "This DPOptimizer clips adaptively but the step gave it no count of "
                    "unclipped examples. Train through tf_megadp.make_private or a "
                    "tf_megadp.PrivateStep.")
            state.centred_count.assign_add(tf.cast(centred_count, tf.float64))

    def sums(self) -> list:
        """The accumulated clipped sums (ON_READ variables: each replica reads its own)."""
        return self.state.accumulators

    def take_rows(self) -> tf.Tensor:
        """The rows the logical step held (what its ledger row records); the count starts again."""
        rows = tf.convert_to_tensor(self.state.step_rows.value)
        with tf.control_dependencies([rows]):
            self.state.step_rows.assign(0)
        return rows

    def take_centred_count(self) -> tf.Tensor:
        """Adaptive clipping's un-noised centred count of the step; it starts again from 0."""
        count = tf.convert_to_tensor(self.state.centred_count.value)
        with tf.control_dependencies([count]):
            self.state.centred_count.assign(0.0)
        return count

    def reset(self) -> None:
        """Zeroes the sums and the micro-step count after the noisy update (graph)."""
        for accumulator in self.state.accumulators:
            accumulator.assign(tf.zeros_like(accumulator.value))
        self.state.micro_steps.assign(0)

    def discard(self) -> int:
        """Drops the micro-batches accumulated since the last noisy update (eager).

        Returns:
            The number of micro-batches discarded.
        """
        state = self.state
        discarded = int(state.micro_steps.numpy())
        for accumulator in state.accumulators:
            accumulator.assign(tf.zeros_like(accumulator.value))
        if state.centred_count is not None:
            state.centred_count.assign(0.0)
        state.micro_steps.assign(0)
        state.step_rows.assign(0)
        return discarded
