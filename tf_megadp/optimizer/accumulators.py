"""The accumulators of a logical step and its noisy update: in memory only, never in a file.

Each replica adds its clipped sums to its own copy of an accumulator (ON_READ,
SUM); the noisy update reads their sum once per logical step, adds Gaussian
noise from the secret key and hands it to the inner optimizer. The noise key
and the accumulators live in `_InMemoryState`, which neither Keras saving
nor `tf.train.Checkpoint` can see.

The noise of logical step t is drawn from (key, t, generation, replica,
variable). The generation is a draw counter that also lives only in memory
and only grows: a logical step that starts at or below the last step whose
noise this optimizer drew (a rollback in the same process: a restored
`tf.train.Checkpoint`, `load_weights`, a `BackupAndRestore` resume) opens a
new generation. Within a generation noisy steps strictly increase, so no
(t, generation) pair, and no noise sample, is drawn twice in a process,
whatever is restored; an uninterrupted run stays in generation 0, so a
seeded run resumed in a new process draws the same noise as one never
interrupted. The private step folds the same generation into the keys of
the model's in-step randomness (dropout), which the restored seed-generator
states would otherwise replay.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import dataclasses
from typing import Any

import keras
import tensorflow as tf

from tf_megadp import _keras_compat

__all__ = ["Accumulators", "accumulation_dtype"]


def accumulation_dtype(variable_dtype) -> str:
    """float64 for float64 variables, float32 for every other dtype.

    A bfloat16 accumulator would round each clipped sum to 8 bits of
    mantissa, and bfloat16 noise would be a coarser distribution than the
    Gaussian the accountant assumes; the update is cast to the variable's
    dtype only after the noise is added and the sum divided.
    """
    return "float64" if keras.backend.standardize_dtype(variable_dtype) == "float64" else "float32"


@dataclasses.dataclass(repr=False)
class _InMemoryState:
    """Optimizer state that must never reach a file.

    A plain object, not a Keras or TensorFlow trackable: neither Keras saving
    (which walks `optimizer.variables`) nor `tf.train.Checkpoint` (which walks
    trackable attributes) can see through it. Its repr shows no value, so
    that `vars(optimizer)`, which debuggers and experiment trackers print,
    shows neither the noise key nor an un-noised sum.
    """

    def __repr__(self) -> str:
        return ("<DPOptimizer in-memory state: noise key, accumulators and noise buffers, "
                "not shown>")

    noise_key: Any = None
    # The draw generation and the last logical step whose noise it drew (-1:
    # none yet). Never saved, never restored: a rollback cannot lower them.
    draw_generation: Any = None
    last_drawn_step: Any = None
    accumulators: list = dataclasses.field(default_factory=list)
    micro_steps: Any = None
    step_rows: Any = None
    nonfinite_examples: Any = None
    # Adaptive clipping's un-noised centred count of unclipped examples.
    centred_count: Any = None
    # Adaptive clipping's noisy updates that left the weights or C non-finite.
    nonfinite_updates: Any = None
    # Correlated noise (`noise_buffers`): the open segment's draw generation
    # and next step, the strategy's buffers (per trainable variable), and the
    # token of the data the segment draws (Python).
    segment_generation: Any = None
    segment_next_step: Any = None
    noise_buffers: list = dataclasses.field(default_factory=list)
    segment_data: Any = None


class Accumulators:
    """The part of `DPOptimizer` that holds a logical step's in-memory state."""

    def _build_in_memory_state(self, var_list) -> None:
        """The accumulators, counters and the secret noise key, in memory only."""
        state = _InMemoryState()
        state.accumulators = [self._replica_sum_variable(v) for v in var_list]
        state.micro_steps = self._in_memory_variable("micro_steps", (), "int64")
        state.step_rows = self._in_memory_variable("step_rows", (), "int64")
        state.nonfinite_examples = self._replica_sum_variable(
            None, shape=(), dtype="int64", name="nonfinite_examples"
        )
        if self.adaptive_clipping is not None:
            state.centred_count = self._replica_sum_variable(
                None, shape=(), dtype="float64", name="centred_count")
            state.nonfinite_updates = self._in_memory_variable("nonfinite_updates", (), "int64")
        if self.seed is None:
            key = [secrets.randbits(63), secrets.randbits(63)]
        else:
            key = [self.seed, 0]
        state.noise_key = self._in_memory_variable(
            "noise_key", (2,), "int64", initializer=keras.initializers.Constant(key)
        )
        state.draw_generation = self._in_memory_variable("draw_generation", (), "int64")
        state.last_drawn_step = self._in_memory_variable(
            "last_drawn_step", (), "int64", initializer=keras.initializers.Constant(-1))
        self._build_noise_buffers(state, var_list)
        self._in_memory = state

    @property
    def current_clip_norm(self):
        """C of the current logical step: the `clip_norm` variable's value with
        adaptive clipping (a tensor), else `l2_norm_clip`."""
        if self.adaptive_clipping is None:
            return self.l2_norm_clip
        return tf.convert_to_tensor(self.clip_norm.value)

    def _in_memory_variable(self, name, shape, dtype, initializer="zeros"):
        """An optimizer variable that `variables`, saving and checkpoints never see."""
        with keras.name_scope(self.name, caller=self):
            return keras.Variable(
                initializer=initializer, shape=shape, dtype=dtype, trainable=False,
                aggregation="none", name=name,
            )

    def _replica_sum_variable(self, reference, shape=None, dtype=None, name="dp_accumulator"):
        """An in-memory variable each replica updates locally; it reads as the sum.

        Under a `tf.distribute` strategy every replica clips and accumulates
        its own examples. A plain mirrored variable would make each replica
        write its own copy; ON_READ/SUM keeps one local copy per replica and
        reads as their sum.
        """
        colocate = contextlib.nullcontext()
        if reference is not None:
            shape, dtype = reference.shape, accumulation_dtype(reference.dtype)
            name = f"{reference.path.replace('/', '_')}_{name}"
            colocate = _keras_compat.optimizer_strategy(self).extended.colocate_vars_with(
                reference.value
            )
        with colocate, keras.name_scope(self.name, caller=self):
            return keras.Variable(
                initializer="zeros", shape=shape, dtype=dtype, trainable=False,
                aggregation="sum", synchronization="on_read", name=name,
            )

    @property
    def micro_steps(self):
        """Micro-batches accumulated in the current logical step (in memory only)."""
        return self._in_memory.micro_steps

    @property
    def micro_step(self) -> int:
        """The number of micro-batches accumulated in the current logical step (Python)."""
        return int(keras.ops.convert_to_numpy(self._in_memory.micro_steps)) if self.built else 0

    @property
    def nonfinite_examples(self):
        """Examples dropped for a non-finite gradient since the optimizer was built (in memory)."""
        return self._in_memory.nonfinite_examples

    def discard_partial_step(self) -> int:
        """Drops the micro-batches accumulated since the last noisy update.

        Nothing computed from them was released, so discarding them spends
        no privacy, and no example of theirs can reach a later noisy sum.

        Returns:
            The number of micro-batches discarded.
        """
        if not self.built:
            return 0
        state = self._in_memory
        discarded = int(state.micro_steps.numpy())
        for accumulator in state.accumulators:
            accumulator.assign(tf.zeros_like(accumulator.value))
        if state.centred_count is not None:
            state.centred_count.assign(0.0)
        state.micro_steps.assign(0)
        state.step_rows.assign(0)
        return discarded

    def draw_generation(self, starts_step):
        """The draw generation of the current logical step; opens a new one on a replay.

        Called by the private step before a micro-batch's forward pass
        (`starts_step`: whether it is the first of its logical step) and by
        the noisy update (`starts_step` True). A step at or below the last
        one whose noise was drawn is a replay of the steps after a restored
        state: the generation grows, so that neither its noise nor its
        in-step randomness repeats a draw. Every replica sees the same
        steps, so all open the same generation.

        Args:
            starts_step: bool scalar tensor (or Python bool).

        Returns:
            The generation, an int64 scalar tensor.
        """
        state = self._in_memory
        step = tf.cast(self.iterations, tf.int64)
        replay = tf.logical_and(tf.convert_to_tensor(starts_step, tf.bool),
                                step <= state.last_drawn_step.value)
        state.last_drawn_step.assign(
            tf.where(replay, tf.constant(-1, tf.int64), state.last_drawn_step.value))
        state.draw_generation.assign_add(tf.cast(replay, tf.int64))
        return tf.convert_to_tensor(state.draw_generation.value)

    def _step_key(self, step, generation):
        """The secret noise key of logical step `step` in draw `generation` on this replica.

        Each noise of the step folds in its own stream: 0..n-1 for the n
        accumulators, n for adaptive clipping's count.
        """
        replica_context = tf.distribute.get_replica_context()
        replica_id = 0 if replica_context is None else replica_context.replica_id_in_sync_group
        key = tf.random.experimental.stateless_fold_in(self._in_memory.noise_key.value, step)
        key = tf.random.experimental.stateless_fold_in(key, generation)
        return tf.random.experimental.stateless_fold_in(key, tf.cast(replica_id, tf.int64))

    def _apply_noise(self, trainable_variables, connected, step, generation, divisor,
                     noise_multiplier) -> None:
        """Adds the step's Gaussian noise to every sum once, divides by B, applies the update.

        Called in a replica context at the end of a logical step; the
        accumulators and the micro-step count start again from 0. With
        correlated noise the step's draw z_t goes through the strategy's
        buffers first (`noise_buffers`): the noise is sigma C (C^{-1} z)_t.
        """
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        # Each replica adds independent noise of variance sigma^2 C^2 / R, so the
        # all-reduced SUM carries exactly N(0, sigma^2 C^2) per coordinate (for
        # correlated noise: each replica streams its own share through its own
        # buffers, and C^{-1} is linear).
        clip_norm = self.current_clip_norm
        if tf.is_tensor(clip_norm):  # Adaptive clipping: this step's C.
            clip_norm = tf.cast(clip_norm, noise_multiplier.dtype)
        stddev = noise_multiplier * clip_norm * self._noise_scale / math.sqrt(replicas)
        state = self._in_memory
        key = self._step_key(step, generation)
        gradients, variables = [], []
        for index, (accumulator, variable, is_connected) in enumerate(
            zip(state.accumulators, trainable_variables, connected)
        ):
            if not is_connected:
                continue
            noise = self._correlate(index, tf.random.stateless_normal(
                tf.shape(accumulator.value),
                seed=tf.random.experimental.stateless_fold_in(key, index),
                dtype=accumulator.dtype,
            ), step)
            noisy_sum = accumulator.value + tf.cast(stddev, accumulator.dtype) * noise
            gradients.append(tf.cast(noisy_sum / tf.cast(divisor, accumulator.dtype),
                                     variable.dtype))
            variables.append(variable)
        self.inner_optimizer.apply(gradients, variables)
        for accumulator in state.accumulators:
            accumulator.assign(tf.zeros_like(accumulator.value))
        state.micro_steps.assign(0)
        state.last_drawn_step.assign(step)
