"""Correlated noise in streaming form: the buffers of a `BandMF` or `BLT` strategy, in memory only.

With `DPOptimizer(noise=BandMF(...) | BLT(...))` the noise added to the
clipped sum of logical step t is sigma * C_clip * (C^{-1} z)_t, C the
strategy's unit-norm lower-triangular Toeplitz matrix and z_t ~ N(0, I)
fresh per step (`tf_megadp.accounting.matrix_factorization` states the
conventions). C^{-1} z is streamed one step at a time:

* BandMF, b bands: x_t = (z_t - sum_{j=1..b-1} c_j x_{t-j}) / c_0, with
  b - 1 model-sized buffers holding the last outputs (a ring: step t writes
  slot t mod (b - 1), the only buffer it writes);
* BLT, d buffers: x_t = z_t - sum_i omega_i s_i, then s_i <- theta_i s_i +
  x_t, scaled by ||c|| to the unit-norm strategy.

The buffers are as secret as the noise key: whoever holds them can predict
the noise still to come, and they are functions of the noise already added.
They live in the optimizer's `_InMemoryState` with the accumulators, which
neither Keras saving nor `tf.train.Checkpoint` can see, and never appear in
`get_config` (which holds the mechanism's public description only).

Under a `tf.distribute` strategy every replica streams its own z_r, of
variance 1/R, through its own buffers, as the independent noise is split
today: C^{-1} is linear, so the all-reduced sum carries sum_r C^{-1} z_r =
C^{-1} z with z ~ N(0, I), the correlated noise added once in total. Each
replica therefore holds the b - 1 (or d) buffers of every trainable variable.

A noise segment is a run of steps that stream through the same buffers.
A segment ends when its buffers no longer follow the steps released: a new
optimizer (a new process, a restart), a restore in the same process (the
draw generation grows, or a step other than the next one comes), other
data (a sampler with another secret assignment of examples) or a changed
schedule. The next step opens a new segment with zeroed buffers and fresh
noise, and the ledger row of that step says so (`segment_start`), so that
the accountant composes the segments, each on its own steps.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_megadp.accounting.correlated_noise import NoiseStrategy

__all__ = ["NoiseBuffers"]


class NoiseBuffers:
    """The part of `DPOptimizer` that correlates its noise and keeps its segments."""

    def _build_noise_buffers(self, state, var_list) -> None:
        """The segment's counters and the strategy's buffers, in `state` (the in-memory state).

        The counters exist for every run: cyclic and fixed-order samplers
        are accounted by segment with independent noise too.
        """
        # The draw generation and the next step of the open segment; -1: none
        # is open, so the next noisy step opens one.
        state.segment_generation = self._in_memory_variable(
            "segment_generation", (), "int64", initializer=keras.initializers.Constant(-1))
        state.segment_next_step = self._in_memory_variable(
            "segment_next_step", (), "int64", initializer=keras.initializers.Constant(-1))
        strategy = self.noise_strategy
        state.noise_buffers = [
            [self._replica_sum_variable(v, name=f"noise_buffer_{slot}")
             for slot in range(strategy.noise_buffers)]
            for v in var_list
        ] if strategy.noise_buffers else []

    @property
    def noise_strategy(self) -> NoiseStrategy:
        """The strategy this optimizer's noise streams (`INDEPENDENT` without `noise`)."""
        strategy = getattr(self, "_noise_strategy", None)
        if strategy is None:
            strategy = self.settings.noise_strategy()
            self._noise_strategy = strategy
        return strategy

    @property
    def _noise_scale(self) -> float:
        """The factor of the streamed output that makes the strategy unit norm (BLT: ||c||)."""
        return 1.0 / self.noise_strategy.unit_scale

    # -- Segments (Python) ----------------------------------------------------

    def end_noise_segment(self) -> None:
        """Closes the open noise segment: the next noisy step opens a new one, with zeroed buffers.

        Called when what the buffers follow changes outside the graph: other
        data, a restored state, an extended schedule.
        """
        if self.built:
            self._in_memory.segment_generation.assign(-1)

    def continue_noise_segment(self, data) -> None:
        """Keeps the open segment only if `data` is what it was drawing (at a run's start).

        Args:
            data: the public token of the data's secret assignment of
                examples to steps (`DataSource.assignment`), None if the
                data has none: then a new segment starts.
        """
        state = self._in_memory
        if data is None or data != getattr(state, "segment_data", None):
            self.end_noise_segment()
        state.segment_data = data

    def noise_segment_continues(self, step: int) -> bool:
        """Whether logical step `step`, taken next, would continue the open segment."""
        if not self.built:
            return False
        state = self._in_memory
        return (int(state.segment_generation.numpy()) >= 0
                and int(state.segment_next_step.numpy()) == step)

    # -- The step (graph) -----------------------------------------------------

    def _open_noise_segment(self, step, generation):
        """Whether logical step `step` of draw `generation` opens a new noise segment.

        It does unless it is the step after the last one noised, in the same
        generation (a replay after a restore always grows the generation).
        A new segment starts from zeroed buffers.

        Returns:
            A bool scalar tensor.
        """
        state = self._in_memory
        new = tf.logical_or(tf.not_equal(state.segment_generation.value, generation),
                            tf.not_equal(state.segment_next_step.value, step))
        state.segment_generation.assign(generation)
        state.segment_next_step.assign(step + 1)
        buffers = [buffer for slots in state.noise_buffers for buffer in slots]
        if buffers:
            def reset():
                for buffer in buffers:
                    buffer.assign(tf.zeros_like(buffer.value))
                return tf.constant(True)

            tf.cond(new, reset, lambda: tf.constant(False))
        return new

    def _correlate(self, index: int, noise, step):
        """(C^{-1} z)_t for variable `index`, from this step's draw z_t; updates its buffers.

        Independent noise returns z_t itself. The result has the noise's
        dtype; multiplied by sigma C_clip `_noise_scale` it is the step's noise.
        """
        strategy = self.noise_strategy
        if not strategy.noise_buffers:
            return noise
        buffers = self._in_memory.noise_buffers[index]
        dtype = noise.dtype
        if strategy.kind == "blt":
            scales = [tf.constant(v, dtype) for v in strategy.output_scales]
            output = noise - _weighted_sum(scales, buffers)
            previous = [output]
            for decay, buffer in zip(strategy.buffer_decays, buffers):
                # One buffer at a time: one or two model-sized temporaries, not d.
                with tf.control_dependencies(previous):
                    updated = tf.constant(decay, dtype) * buffer.value + output
                buffer.assign(updated)
                previous = [updated]
            return output
        # BandMF: slot s holds x_u for the u < t with u = s mod (b - 1), so
        # its coefficient is c_j with j = t - u = ((t - 1 - s) mod (b - 1)) + 1.
        slots = len(buffers)
        coefficients = tf.constant(strategy.coefficients, dtype)
        lags = tf.math.floormod(step - 1 - tf.range(slots, dtype=tf.int64), slots) + 1
        weights = tf.gather(coefficients, lags)
        output = (noise - _weighted_sum([weights[slot] for slot in range(slots)], buffers)
                  ) / coefficients[0]
        if slots == 1:
            buffers[0].assign(output)
        else:
            # Only the slot of step t is written.
            tf.switch_case(tf.cast(tf.math.floormod(step, slots), tf.int32), [
                (lambda buffer=buffer: _assigned(buffer, output)) for buffer in buffers])
        return output


def _weighted_sum(weights, buffers) -> tf.Tensor:
    """sum_i weights[i] * buffers[i], one product at a time.

    Each product waits for the partial sum before it, so that the step holds
    one or two model-sized temporaries, never one per buffer (`tf.add_n`
    would materialise all b - 1 products at once: b - 1 more model copies
    at the peak).
    """
    total = weights[0] * buffers[0].value
    for weight, buffer in zip(weights[1:], buffers[1:]):
        with tf.control_dependencies([total]):
            total = total + weight * buffer.value
    return total


def _assigned(buffer, value) -> tf.Tensor:
    buffer.assign(value)
    return tf.constant(True)
