"""What `tf.vectorized_map` cannot vectorize by itself in a per-example pass.

`vectorized_map` (pfor) converts every op of the per-example forward and
backward pass into one batched op; an op without a converter runs as a
`while_loop` over the m examples instead, with the warning "Using a
while_loop for converting <op>". Two such ops sit in the per-example pass
of a keras-hub BERT:

- `XlaDynamicUpdateSlice`: under XLA, TensorFlow's gradient of `tf.slice`
  (`keras.ops.slice`, e.g. keras-hub's `PositionEmbedding`) is a dynamic
  update slice of zeros, and pfor has no converter for it. The converter
  registered here batches it when the start indices are the same for every
  example (the case of every slice with static or loop-invariant bounds).
- `StatelessRandomGetKeyCounter` / `StatelessRandomUniformV2`: each example
  draws its dropout mask from its own seed, and a random op with a
  per-example seed has no batched kernel. `per_example_dropout` gives
  `keras.layers.Dropout` a call that draws the micro-batch's masks once, from
  the layer's own seed (the same for every example), and hands example i row
  i: every example still gets its own mask, as in a batched forward pass.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tf_megadp import _keras_compat
from tf_megadp.clipping import base

__all__ = ["dropout_seed_states", "per_example_dropout", "register_converters"]


def _convert_xla_dynamic_update_slice(pfor_input):
    """Batched `XlaDynamicUpdateSlice` for start indices shared by all examples."""
    indices, indices_stacked, _ = pfor_input.input(2)
    if indices_stacked:
        # Raising this error makes pfor fall back to its while_loop, as it
        # did before this converter existed (and warns, so the test sees it).
        raise _keras_compat.pfor.ConversionNotImplementedError(
            "XlaDynamicUpdateSlice with per-example start indices")
    pfor_input.stack_inputs([0, 1])
    operand = pfor_input.stacked_input(0)
    update = pfor_input.stacked_input(1)
    start = tf.concat([tf.zeros([1], indices.dtype), indices], axis=0)
    return _keras_compat.pfor.wrap(_keras_compat.xla.dynamic_update_slice(operand, update, start), True)


def register_converters():
    """Registers the converters above with pfor, once per process.

    An op TensorFlow itself has learned to convert keeps TensorFlow's converter.
    """
    if not _keras_compat.pfor_converter_registered("XlaDynamicUpdateSlice"):
        _keras_compat.pfor.RegisterPFor("XlaDynamicUpdateSlice")(_convert_xla_dynamic_update_slice)


def _plain_dropouts(model):
    """Dropout layers that run Keras's own `Dropout.call` (subclasses may differ).

    A Dropout of rate 0 has no seed generator and draws nothing.
    """
    return [layer for layer in _keras_compat.flatten_layers(model)
            if isinstance(layer, keras.layers.Dropout)
            and type(layer).call is keras.layers.Dropout.call
            and getattr(layer, "seed_generator", None) is not None]


def dropout_seed_states(model: keras.Model) -> set:
    """ids of the seed-state variables `per_example_dropout` draws from.

    These states must enter the per-example pass unbatched (the same value for
    every example): the masks of all examples come from one draw.
    """
    return {id(layer.seed_generator.state) for layer in _plain_dropouts(model)}


def _dropout_call(layer, example_index, batch_size):
    def call(inputs, training=False):
        if not training or layer.rate == 0:
            return inputs
        if layer.rate == 1.0:
            return tf.zeros_like(inputs)
        # One example, batch axis of 1: the noise shape of that one example,
        # with axis 0 meaning "one mask per example" whatever noise_shape says.
        shape = tf.shape(inputs)
        if layer.noise_shape is not None:
            shape = tf.stack([shape[axis] if want is None else want
                              for axis, want in enumerate(layer.noise_shape)])
        masks_shape = tf.concat([tf.reshape(batch_size, [1]), shape[1:]], axis=0)
        # Loop-invariant (seed and shape are the same for every example), so
        # pfor computes it once, as a batched dropout would; row i is example i's.
        uniform = keras.random.uniform(masks_shape, seed=layer.seed_generator,
                                       dtype=inputs.dtype)
        keep = tf.gather(uniform, example_index[None]) >= layer.rate
        # Same arithmetic as tf.nn.experimental.stateless_dropout, which
        # Keras's Dropout calls: keep with probability 1 - rate, scale up.
        scale = tf.cast(1.0 / (1.0 - layer.rate), inputs.dtype)
        return inputs * scale * tf.cast(keep, inputs.dtype)

    return call


@contextlib.contextmanager
def per_example_dropout(model: keras.Model, example_index, batch_size):
    """Dropout layers draw one mask per example without a per-example seed.

    Active inside the per-example function of `vectorized_map`.

    Args:
        model: the model whose per-example pass is traced.
        example_index: scalar int32, this example's row in the micro-batch
            (a mapped element, so pfor sees it as per-example).
        batch_size: int32 scalar, the micro-batch size m.
    """
    with contextlib.ExitStack() as stack:
        for layer in _plain_dropouts(model):
            stack.enter_context(
                base.override_call(layer, _dropout_call(layer, example_index, batch_size)))
        yield
