"""The noise stage of a logical step: the secret key, the draw generation and the mechanism's stream.

The noise of logical step t is sigma * C_clip * (C^{-1} z)_t for the run's
noise mechanism (`tf_megadp.accounting.noise`): z_t is drawn from
(key, t, generation, replica, variable) and streamed through the
mechanism's `NoiseStrategy.stream`, which this stage looks up by the
run's strategy and never branches on. Independent noise (DP-SGD) is the
stream that returns z_t, with no buffer.

Secrets: the noise key, the draw generation and the buffers live in this
stage's `InMemoryState` (`tf_megadp.optimizer.memory`), never in a file.
The generation is a draw counter that only grows: a logical step that
starts at or below the last step whose noise this optimizer drew (a
rollback in the same process: a restored `tf.train.Checkpoint`,
`load_weights`, a `BackupAndRestore` resume) opens a new generation.
Within a generation noisy steps strictly increase, so no (t, generation)
pair, and no noise sample, is drawn twice in a process, whatever is
restored; an uninterrupted run stays in generation 0, so a seeded run
resumed in a new process draws the same noise as one never interrupted.
The private step folds the same generation into the keys of the model's
in-step randomness (dropout).

A noise segment is a run of steps that stream through the same buffers
(or, for a mechanism that draws a past z again, the same generation). A
segment ends when the stream no longer follows the steps released: a new
optimizer, a restore (the generation grows, or a step other than the next
one comes), other data (a sampler with another secret assignment of
examples) or a changed schedule. The next step opens a new segment with
zeroed buffers and no past draw, and its ledger row says so
(`segment_start`), so that the accountant composes the segments.

Under a `tf.distribute` strategy every replica draws its own z_r, of
variance 1/R, through its own buffers: C^{-1} is linear, so the all-reduced
sum carries C^{-1} z with z ~ N(0, I), the noise added once in total.
"""

from __future__ import annotations

import math
import secrets

import tensorflow as tf

from tf_megadp.accounting.noise import NoiseStrategy
from tf_megadp.gaussian import fold_in, standard_normal
from tf_megadp.optimizer.memory import InMemoryState, InMemoryVariables

__all__ = ["NoiseStage", "TensorStreamOps"]




class NoiseStage:
    """Adds the noise of a logical step to its clipped sums (the second stage of a `DPOptimizer`).

    Its in-memory state (`state`): `noise_key`, `draw_generation`,
    `last_drawn_step` (-1: none yet), the open segment's `segment_generation`
    and `segment_next_step` (-1: none open), `segment_first_step`,
    `noise_buffers` (per trainable variable, the strategy's buffers) and
    `segment_data` (the token of the data the segment draws, Python).

    Args:
        strategy: the run's resolved noise strategy.
        seed: None (the key from OS entropy) or an int (seeded noise: tests).
    """

    def __init__(self, strategy: NoiseStrategy, seed: int | None):
        self.strategy = strategy
        self._seed = seed
        self.state = InMemoryState("noise key, draw generation and noise buffers")

    def __repr__(self) -> str:
        return f"<DPOptimizer noise stage: {self.strategy.kind}>"

    def build(self, variables: InMemoryVariables, var_list) -> None:
        """Draws the key and makes the counters and the strategy's buffers (zero)."""
        state = self.state
        key = ([secrets.randbits(63), secrets.randbits(63)] if self._seed is None
               else [self._seed, 0])
        state.noise_key = variables.scalar("noise_key", "int64", key, shape=(2,))
        state.draw_generation = variables.scalar("draw_generation", "int64")
        state.last_drawn_step = variables.scalar("last_drawn_step", "int64", -1)
        # The segment counters exist for every run: cyclic and fixed-order
        # samplers are accounted by segment with independent noise too.
        state.segment_generation = variables.scalar("segment_generation", "int64", -1)
        state.segment_next_step = variables.scalar("segment_next_step", "int64", -1)
        state.segment_first_step = variables.scalar("segment_first_step", "int64", -1)
        state.noise_buffers = [
            [variables.replica_sum(v, name=f"noise_buffer_{slot}")
             for slot in range(self.strategy.noise_buffers)]
            for v in var_list]
        state.segment_data = None

    # -- Draws (graph) ----------------------------------------------------------

    def draw_generation(self, step, starts_step) -> tf.Tensor:
        """The draw generation of logical step `step`; opens a new one on a replay.

        A step at or below the last one whose noise was drawn is a replay of
        the steps after a restored state: the generation grows, so that
        neither its noise nor its in-step randomness repeats a draw. Every
        replica sees the same steps, so all open the same generation.

        Args:
            step: the logical step (int64 scalar tensor).
            starts_step: bool scalar: whether this call starts the step.
        """
        state = self.state
        replay = tf.logical_and(tf.convert_to_tensor(starts_step, tf.bool),
                                step <= state.last_drawn_step.value)
        state.last_drawn_step.assign(
            tf.where(replay, tf.constant(-1, tf.int64), state.last_drawn_step.value))
        state.draw_generation.assign_add(tf.cast(replay, tf.int64))
        return tf.convert_to_tensor(state.draw_generation.value)

    def step_key(self, step, generation) -> tf.Tensor:
        """The secret key of logical step `step` in draw `generation` on this replica.

        Each noise of the step folds in its own stream: 0..n-1 for the n
        trainable variables, n for adaptive clipping's count.
        """
        replica_context = tf.distribute.get_replica_context()
        replica_id = 0 if replica_context is None else replica_context.replica_id_in_sync_group
        key = fold_in(self.state.noise_key.value, step)
        key = fold_in(key, generation)
        return fold_in(key, tf.cast(replica_id, tf.int64))

    # -- Segments ---------------------------------------------------------------

    def open_segment(self, step, generation) -> tf.Tensor:
        """Whether logical step `step` of draw `generation` opens a new noise segment (graph).

        It does unless it is the step after the last one noised, in the same
        generation (a replay after a restore always grows the generation).
        A new segment starts from zeroed buffers and no past draw.
        """
        state = self.state
        new = tf.logical_or(tf.not_equal(state.segment_generation.value, generation),
                            tf.not_equal(state.segment_next_step.value, step))
        state.segment_generation.assign(generation)
        state.segment_next_step.assign(step + 1)
        state.segment_first_step.assign(
            tf.where(new, step, state.segment_first_step.value))
        buffers = [buffer for slots in state.noise_buffers for buffer in slots]
        if buffers:
            def reset():
                for buffer in buffers:
                    buffer.assign(tf.zeros_like(buffer.value))
                return tf.constant(True)

            tf.cond(new, reset, lambda: tf.constant(False))
        return new

    def end_segment(self) -> None:
        """Closes the open segment: the next noisy step opens a new one (eager)."""
        self.state.segment_generation.assign(-1)

    def continue_segment(self, data) -> None:
        """Keeps the open segment only if `data` is what it was drawing (eager)."""
        if data is None or data != self.state.segment_data:
            self.end_segment()
        self.state.segment_data = data

    def segment_continues(self, step: int) -> bool:
        """Whether logical step `step`, taken next, would continue the open segment (eager)."""
        state = self.state
        return (int(state.segment_generation.numpy()) >= 0
                and int(state.segment_next_step.numpy()) == step)

    # -- The noise (graph) ------------------------------------------------------

    def noisy_sums(self, sums, connected, step, generation, stddev) -> list:
        """Each connected sum plus its noise: stddev * (C^{-1} z)_t, streamed by the strategy.

        Args:
            sums: the accumulators (this replica's).
            connected: per accumulator, whether the loss reaches its variable.
            step: t.
            generation: this step's draw generation.
            stddev: sigma C_clip / sqrt(replicas), a scalar tensor.

        Returns:
            The noisy sums of the connected variables, in order, in the
            accumulators' dtype.
        """
        key = self.step_key(step, generation)
        noisy = []
        for index, (accumulator, is_connected) in enumerate(zip(sums, connected)):
            if not is_connected:
                continue
            ops = TensorStreamOps(self, index, accumulator, step, generation, key)
            noise = self.strategy.stream(ops)
            noisy.append(accumulator.value + tf.cast(stddev, accumulator.dtype) * noise)
        self.state.last_drawn_step.assign(step)
        return noisy

    def draw(self, index: int, like, key) -> tf.Tensor:
        """z of variable `index` under `key` (a step's key): N(0, I) of `like`'s shape and dtype."""
        return standard_normal(tf.shape(like), fold_in(key, index), like.dtype)


class TensorStreamOps:
    """The `StreamOps` of one variable at one step, on TensorFlow (what a strategy streams with).

    Args:
        stage: the noise stage.
        index: the variable's index (its stream of the step's key).
        accumulator: its accumulator (shape and dtype of the noise).
        step: t.
        generation: this step's draw generation.
        key: the step's key (`NoiseStage.step_key`).
    """

    def __init__(self, stage: NoiseStage, index: int, accumulator, step, generation, key):
        self._stage = stage
        self._index = index
        self._like = accumulator.value
        self._generation = generation
        self.step = step
        self.draw = stage.draw(index, self._like, key)
        self.buffers = stage.state.noise_buffers[index]
        self._last = [self.draw]  # What the next write waits for.

    def previous_draw(self, lag: int) -> tf.Tensor:
        """z_(t - lag) of this variable, drawn again from the key of that step and this generation.

        Zero when step t - lag precedes the open segment's first step: a
        new segment (a restore, other data) has no past draw, so no noise
        of an abandoned branch is ever drawn again into a released one.
        """
        past = self.step - lag
        key = self._stage.step_key(past, self._generation)
        in_segment = past >= self._stage.state.segment_first_step.value
        return self._stage.draw(self._index, self._like, key) * tf.cast(in_segment,
                                                                         self._like.dtype)

    def read(self, buffer) -> tf.Tensor:
        with tf.control_dependencies(self._last):
            return tf.convert_to_tensor(buffer.value)

    def write(self, buffer, value) -> None:
        with tf.control_dependencies(self._last + [value]):
            buffer.assign(value)
            self._last = [tf.convert_to_tensor(buffer.value)]

    def weighted_sum(self, weights, buffers) -> tf.Tensor:
        # Each product waits for the partial sum before it: one or two
        # model-sized temporaries, never one per buffer (`tf.add_n` would
        # materialise all of them at once).
        total = tf.cast(weights[0], self._like.dtype) * buffers[0].value
        for weight, buffer in zip(weights[1:], buffers[1:]):
            with tf.control_dependencies([total]):
                total = total + tf.cast(weight, self._like.dtype) * buffer.value
        self._last = [total]
        return total

    def ring_weights(self, coefficients) -> list:
        slots = len(self.buffers)
        table = tf.constant(coefficients, self._like.dtype)
        # Slot s holds the output of the last step u < t with u = s mod slots,
        # j = t - u = ((t - 1 - s) mod slots) + 1 steps ago.
        lags = tf.math.floormod(self.step - 1 - tf.range(slots, dtype=tf.int64), slots) + 1
        weights = tf.gather(table, lags - 1)
        return [weights[slot] for slot in range(slots)]

    def ring_write(self, value) -> None:
        slots = len(self.buffers)
        if slots == 1:
            self.write(self.buffers[0], value)
            return

        def assigned(buffer):
            buffer.assign(value)
            return tf.constant(True)

        with tf.control_dependencies(self._last + [value]):
            # Only the slot of step t is written.
            done = tf.switch_case(tf.cast(tf.math.floormod(self.step, slots), tf.int32), [
                (lambda buffer=buffer: assigned(buffer)) for buffer in self.buffers])
        self._last = [done]


def replica_stddev(noise_multiplier, clip_norm, replicas: int):
    """sigma C / sqrt(R): each replica's share, so that the all-reduced sum carries sigma C."""
    return noise_multiplier * clip_norm / math.sqrt(replicas)
