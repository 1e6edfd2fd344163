"""Checks that a batched forward pass treats every example independently.

Ghost clipping (and `auto`) run the model once on the whole micro-batch and
read row i of every layer's inputs and output gradients as example i's. That
is only the per-example gradient if nothing in the forward pass combines
examples: a `Lambda` subtracting the batch mean, `ops.roll` over axis 0, a
transpose that puts another axis first, batch statistics, MixUp. Such a model
trains without any error, and one example's data then reaches every other
example's clipped gradient (measured: a clipped-sum sensitivity of up to 8 C
instead of C). `VectorizedClipping` is immune: each example runs alone.

The check here compares, in the same compiled step, the batched forward pass
of the DP step with a per-example forward pass of the same inputs
(`vectorized_map`, every example as a batch of one, the definition of
per-example independence). Every Keras layer call is tapped in both passes;
the first tapped tensor whose example rows differ names the layer. Two parts:

- **At trace time, from shapes.** A layer with a ghost or per-layer rule must
  see the example axis first: run alone, an example gives it a tensor of
  shape [1, ...] with the batched tensor's other dimensions. A transpose that
  puts the sequence first gives [T, 1, ...] instead, even when T equals the
  micro-batch size and the batched shapes cannot tell. Refused with
  `PrivacyConfigurationError` while the step is traced.
- **At run time, from values.** For every tapped tensor, row i of the batched
  pass must equal example i's own pass (relative tolerance `RTOL` of the
  tensor's largest entry, `HALF_RTOL` for 16-bit tensors; a non-finite entry
  must be non-finite in both). The result is an int32 code: -1 when all rows
  agree, else the first differing layer. The strategy gives every example a
  NaN norm when it is not -1, so the micro-batch adds nothing, and raises
  `PrivacyConfigurationError` (`mixing_error`) wherever Python sees the code.

Randomness. Dropout draws one mask for the batch in the batched pass and
other masks in a per-example pass, which would look like mixing. The
per-example pass therefore takes the outputs of the library's element-wise
random layers (Dropout and its spatial variants, GaussianDropout,
GaussianNoise, AlphaDropout) from the batched pass, row by row, after
checking that their inputs agree; what those layers do to one element never
depends on another example. Any other layer that draws random numbers (a
custom layer with a SeedGenerator, `keras.layers.MixUp`) runs in both passes
with different draws and is refused: the check cannot tell its randomness
from mixing.

Cost: one extra forward pass of the model (vectorized over examples, no
backward pass), plus element-wise comparisons of the tapped activations. The
ghost strategy runs it on the first call of each traced input signature only
(`ghost._CheckedSignatures`); see docs/clipping.md for the measured step time. What it does
not see: a layer whose gradient is not the derivative of its forward pass
(`tf.custom_gradient`, `stop_gradient` tricks) can mix examples in the
backward pass only; such code is trusted.
"""

from __future__ import annotations

import contextlib
import re
from typing import NamedTuple

import keras
import tensorflow as tf

from tf_megadp import _keras_compat
from tf_megadp.clipping import base
from tf_megadp.errors import GhostClippingUnsupportedError, PrivacyConfigurationError

__all__ = ["BACKWARD_CHECK_EXAMPLES", "BACKWARD_MIXES", "LayerTaps", "MIXING_OK", "MODEL_MIXES", "RECHECK_PROBABILITY",
           "check_independence", "error_from_assertion", "mixing_code", "mixing_error",
           "rows_differ", "without_elementwise_randomness"]

MIXING_OK = -1
MODEL_MIXES = 1  # mixing_code of the outputs of the model itself (layer 0)
# The per-example gradient norms of the batched pass differ from each
# example's own: mixing in the backward pass only. Above every layer code,
# so that the maximum over replicas keeps it.
BACKWARD_MIXES = 2**30
RTOL = 1e-3
HALF_RTOL = 5e-2
# The chance that a call after a signature's first check runs the forward
# check again (see `ghost._CheckedSignatures`); measured in docs/benchmarks.md.
RECHECK_PROBABILITY = 1 / 32
# Examples whose gradient norms the backward check recomputes alone.
BACKWARD_CHECK_EXAMPLES = 8

# Library layers whose randomness acts element by element: the per-example
# pass may reuse their batched outputs row by row.
_ELEMENTWISE_RANDOM = (
    keras.layers.Dropout,  # and SpatialDropout1D/2D/3D
    keras.layers.GaussianDropout,
    keras.layers.GaussianNoise,
    keras.layers.AlphaDropout,
)


def _elementwise_random(layer) -> bool:
    return (isinstance(layer, _ELEMENTWISE_RANDOM)
            and _keras_compat.is_keras_own_call(layer))


def _tensor_leaves(structure):
    """Leaves that are numeric tensors, with their positions in `tf.nest.flatten`."""
    leaves = []
    for position, leaf in enumerate(tf.nest.flatten(structure)):
        if tf.is_tensor(leaf) and not isinstance(leaf, tf.Variable) and (
                leaf.dtype.is_floating or leaf.dtype.is_integer or leaf.dtype.is_bool):
            leaves.append((position, leaf))
    return leaves


class Key(NamedTuple):
    """One tapped tensor: leaf `leaf` of the inputs or outputs of a layer call."""

    layer: int  # index into LayerTaps.layers
    call: int  # the layer's how-many-th call in this forward pass
    output: bool
    leaf: int


class LayerTaps:
    """Records the inputs and outputs of every layer call of one forward pass.

    Args:
        model: the model; every layer below it (and the model itself) is tapped.
        recorder: in the batched pass of ghost clipping, its `Recorder`: calls
            made while it is suspended (inside a per-example fallback, whose
            tensors live in a `vectorized_map` body) are counted, so that
            call numbers agree with the per-example pass, but not recorded.
        static_batch_size: m, or None where the trace does not know it.
        transplant: in the per-example pass, {(layer, call): output rows} for
            the element-wise random layers; those calls return the rows
            (with a batch axis of one) instead of drawing new randomness.
    """

    def __init__(self, model, recorder=None, static_batch_size=None, transplant=None):
        self.layers = list(_keras_compat.flatten_layers(model))
        self.recorder = recorder
        self.static_batch_size = static_batch_size
        self.transplant = transplant
        self.records: dict[Key, tf.Tensor] = {}
        self.outputs: dict[tuple, object] = {}
        self._calls: dict[int, int] = {}

    def _batched(self, tensor) -> bool:
        # In the batched pass only tensors that can lead with the example axis
        # have rows to compare; the per-example pass records everything.
        if self.transplant is not None:
            return True
        if not tensor.shape.rank:
            return False
        leading = tensor.shape[0]
        return leading is None or self.static_batch_size is None or (
            leading == self.static_batch_size)

    def _record(self, index, call, output, structure):
        for position, leaf in _tensor_leaves(structure):
            if self._batched(leaf):
                self.records[Key(index, call, output, position)] = leaf

    @contextlib.contextmanager
    def installed(self):
        """Taps every layer for the duration of the block."""
        with contextlib.ExitStack() as stack:
            for index, layer in enumerate(self.layers):
                stack.enter_context(base.override_call(layer, self._tap(index, layer)))
            yield

    def _tap(self, index, layer):
        original = layer.call

        def tapped(*args, **kwargs):
            call = self._calls.get(index, 0)
            self._calls[index] = call + 1
            if self.recorder is not None and self.recorder.suspended:
                return original(*args, **kwargs)
            self._record(index, call, False, (args, kwargs))
            rows = None if self.transplant is None else self.transplant.get((index, call))
            if rows is not None:
                structure, leaves = rows
                outputs = tf.nest.pack_sequence_as(
                    structure, [tf.expand_dims(leaf, 0) for leaf in leaves])
            else:
                outputs = original(*args, **kwargs)
            if self.transplant is None and _elementwise_random(layer):
                self.outputs[(index, call)] = outputs
            self._record(index, call, True, outputs)
            return outputs

        return tapped


def _rtol(dtype) -> float:
    return HALF_RTOL if dtype in (tf.float16, tf.bfloat16) else RTOL


@contextlib.contextmanager
def without_elementwise_randomness(model):
    """The library's element-wise random layers (Dropout, GaussianNoise, ...) pass inputs through.

    For checks that compare two passes of one computation: what these
    layers do to one element never depends on another example.
    """
    with contextlib.ExitStack() as stack:
        for layer in _keras_compat.flatten_layers(model):
            if _elementwise_random(layer):
                stack.enter_context(base.override_call(
                    layer, lambda inputs, *args, **kwargs: inputs))
        yield


def rows_differ(batched_row, alone) -> tf.Tensor:
    """Whether a tensor of the batched pass differs from its per-example counterpart.

    Relative tolerance `RTOL` (`HALF_RTOL` for 16-bit tensors) of the
    counterpart's largest finite entry; a non-finite entry must be
    non-finite in both.
    """
    rtol = _rtol(batched_row.dtype)
    a = tf.cast(batched_row, tf.float32)
    b = tf.cast(alone, tf.float32)
    finite_a, finite_b = tf.math.is_finite(a), tf.math.is_finite(b)
    both = tf.logical_and(finite_a, finite_b)
    difference = tf.reduce_max(tf.where(both, tf.abs(a - b), tf.zeros_like(a)))
    scale = tf.reduce_max(tf.where(finite_b, tf.abs(b), tf.zeros_like(b)))
    return tf.logical_or(tf.reduce_any(tf.not_equal(finite_a, finite_b)),
                         difference > rtol * scale)


def mixing_code(key: Key) -> int:
    """The stable code of the first differing tensor: layer index and side."""
    return 2 * key.layer + int(key.output)


def _describe_layer(layer) -> str:
    return f"'{layer.name}' ({type(layer).__name__})"


def mixing_error(model, code: int, strategy: str = "ghost") -> PrivacyConfigurationError:
    """The error for a failed run-time check, from its code."""
    if int(code) == BACKWARD_MIXES:
        return PrivacyConfigurationError(
            f"clipping={strategy!r} needs every example's gradient to depend on that "
            f"example alone, but in model '{model.name}' the per-example gradient norms "
            "of the batched backward pass differ from each example's own backward pass "
            "(its forward pass agreed): an operation mixes examples in the backward pass "
            "only (tf.custom_gradient, x + k * (mean - stop_gradient(mean)) over the "
            "batch, ...), so one example's data would reach the others' clipped "
            "gradients and the sensitivity bound C would not hold. Use "
            "clipping='vectorized', which runs every example alone, or remove the "
            "operation. This micro-batch contributed nothing to the update."
        )
    layers = list(_keras_compat.flatten_layers(model))
    layer = layers[int(code) // 2]
    if int(code) == MODEL_MIXES:
        where = (f"the predictions of model '{model.name}' for some example differ "
                 "between the micro-batch and that example run alone, so a layer or "
                 "operation in it mixes examples (`GhostClipping.locate_mixing(model, "
                 "x, y)` on one batch names the first layer whose output differs)")
    elif int(code) % 2:
        where = (f"the output of layer {_describe_layer(layer)} differs, for some example, "
                 "between the micro-batch and that example run alone, so this layer (or "
                 "an operation it calls) mixes examples")
    else:
        where = (f"the input of layer {_describe_layer(layer)} differs, for some example, "
                 "between the micro-batch and that example run alone, so an operation "
                 "before it that is not a Keras layer (e.g. a keras.ops call in a "
                 "functional model) mixes examples")
    random = ""
    if base.draws_random_numbers(layer):
        random = (f" Layer {_describe_layer(layer)} also draws random numbers of its own, "
                  "which the check cannot tell from mixing (only Keras's element-wise "
                  "Dropout/GaussianNoise layers are reproduced example by example).")
    return PrivacyConfigurationError(
        f"clipping={strategy!r} needs every example's forward pass to depend on that "
        f"example alone, but {where}: one example's data would reach the others' "
        "clipped gradients and the per-example sensitivity bound C would not hold "
        "(batch statistics, ops over axis 0, MixUp-style augmentation)."
        f"{random} Use clipping='vectorized', which runs every example alone, or "
        "remove the operation that mixes examples. This micro-batch contributed "
        "nothing to the update."
    )


def _structural_error(layer, batched, alone, source) -> PrivacyConfigurationError:
    origin = ""
    if source is not layer:
        origin = (f" The first layer whose tensors stop being per-example is "
                  f"{_describe_layer(source)}.")
    return PrivacyConfigurationError(
        f"Layer {_describe_layer(layer)} works on a tensor of shape {batched.shape} "
        f"whose first axis is not the example axis: run alone, one example gives "
        f"shape {alone.shape} there instead of (1, ...) (a transpose or reshape put "
        f"another axis first, or an operation depends on the batch size).{origin} "
        "Ghost clipping reads axis 0 of a layer's inputs and output gradients as the "
        "example axis, so it would attribute gradients to the wrong examples. Use "
        "clipping='vectorized', or keep the example axis first."
    )


def check_independence(model, batched: LayerTaps, x, trainable_values, state_values,
                       batch_size, rule_layers, locate: bool = False,
                       vectorize: bool = True) -> tf.Tensor:
    """Runs the per-example pass and compares it with the batched one.

    Args:
        model: the model.
        batched: the taps of the batched pass (already run).
        x: the micro-batch inputs.
        trainable_values, state_values: the variable values the batched pass
            read (one per `model.trainable_variables` and
            `model.non_trainable_variables` entry).
        batch_size: m, a scalar tensor.
        rule_layers: ids of the layers that ghost rules intercept; their
            tensors must lead with the example axis (checked from shapes).
        locate: compare every tapped tensor, to name the first layer whose
            output differs; otherwise only the model's outputs and the inputs
            of Dropout-like layers (enough to detect mixing, cheaper).
        vectorize: run the examples with `tf.vectorized_map` (for a caller
            compiled with XLA), or one after another with `tf.map_fn`.
            Without XLA, TensorFlow 2.21's vectorization of a keras-hub BERT
            crashes the process (segmentation fault); the loop is slower,
            but the check runs once per traced input signature.

    Returns:
        int32 scalar: `MIXING_OK`, or the `mixing_code` of the first compared
        tensor whose example rows differ.

    Raises:
        PrivacyConfigurationError: at trace time, a rule's layer sees a tensor
            whose first axis is not the example axis.
    """
    static_batch_size = batched.static_batch_size
    # One comparison per distinct tensor (a layer's output is usually the
    # next layer's input), under the key where it first appeared.
    keys, tensors, representative = [], [], {}
    for key, tensor in batched.records.items():
        if tensor.ref() not in representative:
            representative[tensor.ref()] = key
            keys.append(key)
            tensors.append(tensor)
    # Tensors whose leading dimension is statically m are mapped; others (an
    # unknown leading dimension) are gathered by the example's index, clamped,
    # so that a tensor that turns out not to have m rows is compared (and
    # differs) instead of failing the map.
    mapped = [static_batch_size is not None and t.shape[0] == static_batch_size
              for t in tensors]
    transplant_keys = {}
    for (index, call), outputs in batched.outputs.items():
        leaves = _tensor_leaves(outputs)
        structure = tf.nest.flatten(outputs)
        if len(leaves) != len(structure):
            continue
        wanted = [Key(index, call, True, position) for position, _ in leaves]
        if all(k in batched.records for k in wanted):
            transplant_keys[(index, call)] = (
                outputs, [representative[batched.records[k].ref()] for k in wanted])
    elements = {
        "x": x,
        "index": tf.range(batch_size),
        "rows": [t for t, is_mapped in zip(tensors, mapped) if is_mapped],
    }
    layers = batched.layers
    position = {key: i for i, key in enumerate(keys)}
    # What every step compares: the model's outputs, and the inputs of the
    # random layers whose outputs the per-example pass reuses. If those agree
    # for every example, each example's predictions (hence its loss and every
    # gradient reaching it) depend on that example alone. Comparing every
    # tapped tensor names the layer, but cost about 45 % of a BERT step, so
    # only `locate=True` (run after a failure, outside the training step)
    # does that.
    outputs_of_model = [k for k in batched.records if k.layer == 0 and k.output]
    if not outputs_of_model:
        raise GhostClippingUnsupportedError(
            f"No output of model '{model.name}' has the micro-batch as its first "
            "axis; ghost clipping needs one prediction per example along axis 0. "
            "Use clipping='vectorized'."
        )
    random_inputs = [k for k in batched.records
                     if (k.layer, k.call) in transplant_keys and not k.output]
    essential = sorted({position[representative[batched.records[k].ref()]]
                        for k in outputs_of_model + random_inputs})
    essential_set = set(essential)
    transplanted = sorted({position[k] for _, wanted in transplant_keys.values()
                           for k in wanted})

    def per_example_pass(selected):
        """fn(example) -> bool [len(selected)]: which selected tensors differ."""
        selected = set(selected)

        def one_example(e):
            index = e["index"]
            mapped_rows = iter(e["rows"])
            rows = {}
            for i, (tensor, is_mapped) in enumerate(zip(tensors, mapped)):
                row = next(mapped_rows) if is_mapped else None
                if i not in selected and i not in transplanted:
                    continue
                if row is None:
                    last = tf.maximum(tf.shape(tensor)[0] - 1, 0)
                    row = tf.gather(tensor, tf.minimum(index, last))
                rows[i] = row
            transplant = {call_key: (outputs, [rows[position[k]] for k in wanted])
                          for call_key, (outputs, wanted) in transplant_keys.items()}
            alone = LayerTaps(model, transplant=transplant)
            mapping = list(zip(model.trainable_variables, trainable_values))
            mapping += list(zip(model.non_trainable_variables, state_values))
            with alone.installed(), keras.StatelessScope(state_mapping=mapping):
                x_i = base.add_batch_axis(e["x"])
                if _keras_compat.call_has_training_arg(model):
                    model(x_i, training=True)
                else:
                    model(x_i)
            own = [alone.records.get(key) for key in keys]
            consistent = [
                o is not None and o.shape.is_compatible_with(
                    tf.TensorShape([1]).concatenate(t.shape[1:]))
                for o, t in zip(own, tensors)]
            for i, (key, tensor, o, ok) in enumerate(zip(keys, tensors, own, consistent)):
                # The essential tensors must have per-example rows: without
                # them nothing would be compared (fail closed).
                needs_rows = id(layers[key.layer]) in rule_layers or i in essential_set
                if not ok and needs_rows:
                    first = next((k for k, oo, okk in zip(keys, own, consistent)
                                  if not okk and oo is not None), key)
                    raise _structural_error(layers[key.layer], tensor,
                                            own[i] if own[i] is not None else tensor,
                                            layers[first.layer])
            # A tensor without a per-example counterpart (not batch-major) has
            # no rows to compare; the layers after it are compared instead.
            differs = [rows_differ(rows[i], own[i][0]) if consistent[i] else tf.constant(False)
                       for i in sorted(selected)]
            return tf.stack(differs)

        return one_example

    selected = list(range(len(keys))) if locate else essential
    if vectorize:
        per_example = tf.vectorized_map(per_example_pass(selected), elements)
    else:
        per_example = tf.map_fn(per_example_pass(selected), elements,
                                fn_output_signature=tf.TensorSpec([len(selected)], tf.bool))
    differs = tf.reduce_any(per_example, axis=0)
    # Without `locate` a difference only says that the model mixes examples
    # somewhere (a difference at the outputs says nothing about where): the
    # code of the model's own output.
    codes = tf.constant([mixing_code(keys[i]) if locate else MODEL_MIXES
                         for i in selected], tf.int32)
    first = tf.argmax(tf.cast(differs, tf.int32), output_type=tf.int32)
    return tf.where(tf.reduce_any(differs), tf.gather(codes, first),
                    tf.constant(MIXING_OK, tf.int32))


# The first datum of the in-graph assertion, so that an InvalidArgumentError
# raised by it can be recognised and turned back into `mixing_error`.
ASSERTION_MARKER = "tf_megadp: examples mixed in the batched forward pass; code"


def error_from_assertion(model, error: Exception,
                         strategy: str = "ghost") -> PrivacyConfigurationError | None:
    """The `mixing_error` behind an `InvalidArgumentError` of the step's assertion.

    Returns None for any other error. For callers that run the step inside
    `fit`, where the assertion surfaces as a TensorFlow error.
    """
    message = str(error)
    if ASSERTION_MARKER not in message:
        return None
    found = re.search(re.escape(ASSERTION_MARKER) + r"\W*\[?(-?\d+)", message)
    if found is None:
        return None
    return mixing_error(model, int(found.group(1)), strategy)


LOG_KEY = "example_mixing"


class RefuseMixingCallback(keras.callbacks.Callback):
    """Raises the named error when a step's `logs[LOG_KEY]` reports mixing.

    For a train step compiled whole with XLA (`model.compile(jit_compile=True)`),
    where the step's assertion is dropped: the step then only zeroes the
    failing micro-batch. The train step must put `ClippedBatch.mixing` into
    its logs under `LOG_KEY` (the maximum over replicas).
    """

    def on_train_batch_end(self, batch, logs=None):
        # Popped: a check result, not a training statistic for the progress bar.
        code = (logs if logs is not None else {}).pop(LOG_KEY, None)
        if code is None or int(code) == MIXING_OK:
            return
        strategy = getattr(getattr(self.model, "optimizer", None), "clipping_strategy", None)
        raise mixing_error(self.model, int(code), getattr(strategy, "name", "ghost"))

    def on_epoch_end(self, epoch, logs=None):
        self.on_train_batch_end(None, logs)
