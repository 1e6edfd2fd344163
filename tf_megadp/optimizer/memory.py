"""Variables that live in memory only: what a `DPOptimizer` stage keeps and no file may hold.

The accumulators (the exact, un-noised clipped sum), the noise key, the
draw generation and the correlated noise's buffers are secret: whoever
holds them can remove the noise from a released update or predict the
noise still to come. Each stage of the optimizer keeps its share in an
`InMemoryState`, a plain object that neither Keras saving (which walks
`optimizer.variables`) nor `tf.train.Checkpoint` (which walks trackable
attributes) can see through, and whose repr shows no value. Its variables
are made by `InMemoryVariables`, never by the optimizer's `add_variable`.
"""

from __future__ import annotations

import contextlib

import keras

from tf_megadp import _keras_compat

__all__ = ["InMemoryState", "InMemoryVariables", "accumulation_dtype"]


def accumulation_dtype(variable_dtype) -> str:
    """float64 for float64 variables, float32 for every other dtype.

    A bfloat16 accumulator would round each clipped sum to 8 bits of
    mantissa, and bfloat16 noise would be a coarser distribution than the
    Gaussian the accountant assumes; the update is cast to the variable's
    dtype only after the noise is added and the sum divided.
    """
    return "float64" if keras.backend.standardize_dtype(variable_dtype) == "float64" else "float32"


class InMemoryState:
    """A stage's in-memory variables, as attributes; its repr (and so `vars(optimizer)`'s) shows none.

    Not a Keras or TensorFlow trackable: saving and checkpoints never see
    what it holds. Debuggers and experiment trackers print `vars(optimizer)`;
    this shows neither the noise key nor an un-noised sum.
    """

    def __init__(self, what: str):
        # What it holds, in words: the only plain attribute besides the variables.
        self._what = what

    def __repr__(self) -> str:
        return f"<DPOptimizer in-memory state: {self._what}, not shown>"


class InMemoryVariables:
    """Makes the in-memory variables of one optimizer (never in `optimizer.variables`).

    Args:
        optimizer: the `DPOptimizer` (its name scopes the variables; its
            distribution strategy places the replica-local ones).
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer):
        self._optimizer = optimizer

    def __repr__(self) -> str:
        return "<DPOptimizer in-memory variable factory>"

    def scalar(self, name: str, dtype: str, initial=0, shape=()) -> keras.Variable:
        """A variable of `shape` holding `initial`, the same on every replica."""
        with keras.name_scope(self._optimizer.name, caller=self._optimizer):
            return keras.Variable(
                initializer=keras.initializers.Constant(initial), shape=shape, dtype=dtype,
                trainable=False, aggregation="none", name=name)

    def replica_sum(self, reference=None, *, shape=None, dtype=None,
                    name: str = "dp_accumulator") -> keras.Variable:
        """A variable each replica updates locally; it reads as the sum of the replicas'.

        Under a `tf.distribute` strategy every replica clips and accumulates
        its own examples (and streams its own share of the noise). A plain
        mirrored variable would make each replica write its own copy;
        ON_READ/SUM keeps one local copy per replica and reads as their sum.

        Args:
            reference: a model variable whose shape it takes, in
                `accumulation_dtype`, placed with it; or None with `shape`
                and `dtype`.
            shape, dtype: without a reference.
            name: the variable's name (after the reference's path).
        """
        colocate = contextlib.nullcontext()
        if reference is not None:
            shape, dtype = reference.shape, accumulation_dtype(reference.dtype)
            name = f"{reference.path.replace('/', '_')}_{name}"
            colocate = _keras_compat.optimizer_strategy(
                self._optimizer).extended.colocate_vars_with(reference.value)
        with colocate, keras.name_scope(self._optimizer.name, caller=self._optimizer):
            return keras.Variable(
                initializer="zeros", shape=shape, dtype=dtype, trainable=False,
                aggregation="sum", synchronization="on_read", name=name)
