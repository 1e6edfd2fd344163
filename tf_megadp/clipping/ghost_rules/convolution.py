"""Ghost rule for convolutions (`Conv1D`, `Conv2D`, `Conv3D`): unfold, then Outer.

A convolution is a matmul of each output position's input window with the
kernel: unfolding example i's (padded) input into its windows ("im2col"),
A_i [T, k C] with T output positions, the kernel gradient is A_i^T G_i with
G_i [T, filters] the output gradient, reshaped to [k..., C, filters]. That is
an `Outer` term: its norm takes the Gram form <A_i A_i^T, G_i G_i^T> when
k C filters > T (k C + filters), and otherwise A_i^T G_i is built per example
and gives both the norm and the clipped sum (the per-layer choice of "mixed
ghost clipping", Bu et al. 2022; see `terms.Outer`).

The windows are gathered by strided slices of the padded input, one per
kernel offset (no [k C, k C] identity convolution), with TensorFlow's padding
rule for "same" and Keras's for "causal". Covered: any strides and
dilation, bias, activation, channels_first (transposed to channels_last
first). Grouped convolutions record the per-example kernel gradients
themselves (`Explicit`, one einsum over groups: m times the kernel's size).
Depthwise, separable and transposed convolutions are other classes: they
fall back (exact per-example gradients under `auto`, a refusal naming `auto`
under `ghost`).
"""

from __future__ import annotations

import itertools

import keras
import tensorflow as tf

from tf_megadp.clipping.rules import KernelBiasRule, builtin_rule, flat_tokens
from tf_megadp.clipping.terms import Explicit, Outer
from tf_megadp.errors import GhostClippingUnsupportedError

__all__ = ["ConvolutionRule", "unfold"]


def _padding(size, kernel, stride, dilation, outputs, padding):
    """(before, after) padding of one spatial axis, as the layer pads it."""
    if padding == "valid":
        return 0, 0
    if padding == "causal":
        return dilation * (kernel - 1), 0
    # "same": TensorFlow pads (total // 2, the rest), the extra one at the end.
    total = max((outputs - 1) * stride + dilation * (kernel - 1) + 1 - size, 0)
    return total // 2, total - total // 2


def unfold(inputs, kernel_size, strides, dilation_rate, padding, output_size):
    """The input windows of a channels_last convolution, [m, T, prod(kernel_size) * C].

    Args:
        inputs: [m, *spatial, C], spatial dimensions static.
        kernel_size, strides, dilation_rate: one int per spatial axis.
        padding: "valid", "same" or "causal".
        output_size: the convolution's output spatial dimensions.

    Returns:
        Row t (output positions in row-major order) holds the window of
        output position t, ordered as the kernel's leading axes then the
        input channels: `reshape(kernel, [-1, filters])` multiplies it.
    """
    spatial = inputs.shape[1:-1]
    pads = [(0, 0)] + [
        _padding(n, k, s, d, o, padding)
        for n, k, s, d, o in zip(spatial, kernel_size, strides, dilation_rate, output_size)
    ] + [(0, 0)]
    padded = tf.pad(inputs, pads)
    windows = []
    for offset in itertools.product(*[range(k) for k in kernel_size]):
        index = (slice(None),) + tuple(
            slice(o * d, o * d + (n - 1) * s + 1, s)
            for o, d, s, n in zip(offset, dilation_rate, strides, output_size)
        ) + (slice(None),)
        windows.append(padded[index])
    patches = tf.stack(windows, axis=-2)  # [m, *output_size, K, C]
    tokens = 1
    for n in output_size:
        tokens *= n
    return tf.reshape(patches, [tf.shape(inputs)[0], tokens, len(windows) * inputs.shape[-1]])


def _channels_last(tensor):
    rank = tensor.shape.rank
    return tf.transpose(tensor, [0] + list(range(2, rank)) + [1])


def _grouped_gradients(patches, right, layer):
    """Per-example kernel gradients of a grouped convolution, [m, k * C / groups, filters].

    Group j multiplies its input channels (patch columns j C/g ... within
    each kernel offset) with its filters (output columns j F/g ...).
    """
    groups = layer.groups
    m, tokens = tf.shape(patches)[0], patches.shape[1]
    offsets = len(list(itertools.product(*[range(k) for k in layer.kernel_size])))
    channels = patches.shape[-1] // offsets // groups
    left = tf.reshape(patches, [m, tokens, offsets, groups, channels])
    left = tf.reshape(tf.transpose(left, [0, 1, 3, 2, 4]), [m, tokens, groups, -1])
    right = tf.reshape(right, [m, tokens, groups, right.shape[-1] // groups])
    per_example = tf.einsum("mtgp,mtgd->mpgd", left, right)
    return tf.reshape(per_example, [m, left.shape[-1], right.shape[-1] * groups])


@builtin_rule(keras.layers.Conv3D)
@builtin_rule(keras.layers.Conv2D)
@builtin_rule(keras.layers.Conv1D)
class ConvolutionRule(KernelBiasRule):
    """`Conv1D`/`Conv2D`/`Conv3D`: Outer(unfolded input, dL/dpre-activation), and the bias."""

    @classmethod
    def matches(cls, layer):
        return (super().matches(layer) and not getattr(layer, "lora_enabled", False)
                and getattr(layer, "quantization_mode", None) is None)

    def call(self, recorder, original, inputs):
        layer = self.layer
        if not inputs.shape[1:].is_fully_defined():
            raise GhostClippingUnsupportedError(
                f"Convolution '{layer.name}' is called on inputs of shape {inputs.shape}; "
                "its ghost rule unfolds the input windows, which needs static spatial "
                "dimensions. Give the model's Input a fixed shape (e.g. "
                "keras.Input((32, 32, 3))), or use clipping='vectorized'."
            )
        return super().call(recorder, original, inputs)

    def bias_layout(self, inputs, gradient):
        if self.layer.data_format == "channels_first":
            return _channels_last(inputs), _channels_last(gradient)
        return inputs, gradient

    def kernel_term(self, inputs, gradient, batch_size, dtype):
        layer = self.layer
        patches = unfold(tf.cast(inputs, dtype), layer.kernel_size, layer.strides,
                         layer.dilation_rate, layer.padding, gradient.shape[1:-1])
        right = flat_tokens(gradient, batch_size, dtype)
        if layer.groups == 1:
            return Outer(patches, right, layer.kernel.shape)
        return Explicit(_grouped_gradients(patches, right, layer), layer.kernel.shape)
