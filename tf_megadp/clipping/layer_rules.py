"""Layer rules for ghost clipping: what each layer records while the model runs.

Ghost clipping runs the model ONCE on the whole micro-batch. While that trace
runs, every layer that owns trainable variables is intercepted by a rule (its
`call` is replaced on the instance, and restored when the trace ends). A rule
records, per call, what the per-example gradient of its variables is made of:

- `Outer(left, right)`: the gradient of example i is `left_i^T right_i`, with
  `left` [m, T, P] and `right` [m, T, D] (Dense, EinsumDense, the reverse
  projection of a `ReversibleEmbedding`). `right` (or `left`) is an output
  gradient: the rule adds a zero "probe" to the layer's pre-activation output,
  and the gradient of the summed loss with respect to the probe is that output
  gradient, example by example.
- `Gather(ids, values)`: the gradient of example i scatters `values_i` [T, D]
  into the rows `ids_i` [T] of the variable (embeddings, position embeddings).
- `Explicit(value)`: the per-example gradients themselves, [m, *shape] (biases,
  and layers that have no ghost rule: their forward pass runs per example under
  `vectorized_map` with one copy of their variables per example).

`tf_megadp.clipping.ghost` turns the records into norms and clipped sums.
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import keras
import keras_hub
import numpy as np
import tensorflow as tf
from keras.src import backend as keras_backend
from keras.src.backend.common import masking

from tf_megadp.clipping import base
from tf_megadp.errors import PrivacyConfigurationError

__all__ = ["Explicit", "Gather", "Outer", "Recorder", "Rule", "plan_rules",
           "register_ghost_rule", "unregister_ghost_rule"]


class Outer(NamedTuple):
    """Per-example gradient `left_i^T right_i`, reshaped to the variable."""

    left: tf.Tensor  # [m, T, P]
    right: tf.Tensor  # [m, T, D]


class Gather(NamedTuple):
    """Per-example gradient: `values_i[t]` added to row `ids_i[t]`."""

    ids: tf.Tensor  # int32 [m, T]
    values: tf.Tensor  # [m, T, D]


class Explicit(NamedTuple):
    """Per-example gradients, [m, *variable.shape]."""

    value: tf.Tensor


# Layers with few parameters whose per-example gradients are cheap to
# materialise; `clipping="ghost"` accepts these without ghost rules
# (LayerNormalization has one; a subclass overriding `call` lands here).
SMALL_LAYERS = (
    keras.layers.LayerNormalization,
    keras.layers.RMSNormalization,
    keras.layers.GroupNormalization,
    keras_hub.layers.RMSNormalization,
)


class Recorder:
    """Collects the probes, records and variable reads of one traced forward pass.

    Args:
        tape: the `tf.GradientTape` recording the forward pass.
        batch_size: m, the micro-batch size (a scalar tensor).
        trainable_variables: the model's trainable variables.
        static_batch_size: m where the trace knows it (the static leading
            dimension of the inputs), else None. `tf.get_static_value` of
            `tf.shape(x)[0]` is None even for static shapes, which let a layer
            run on a transposed tensor reach a shape error at the norm sum
            instead of the refusal in `check_batch_axis`.
    """

    def __init__(self, tape, batch_size, trainable_variables, static_batch_size=None):
        self.tape = tape
        self.batch_size = batch_size
        if static_batch_size is None:
            static_batch_size = tf.get_static_value(batch_size)
        self.static_batch_size = static_batch_size
        self._runtime_checks = []
        self.watched = []
        self._finishers = []
        self._trainable = {id(v): v for v in trainable_variables}
        self._covering = [frozenset()]
        self.suspended = 0
        self.violations = []

    def watch(self, tensor) -> int:
        """Watches `tensor`; returns the index of its gradient."""
        self.tape.watch(tensor)
        self.watched.append(tensor)
        return len(self.watched) - 1

    def probe(self, tensor, layer):
        """Returns (tensor + zero probe, index of the probe's gradient)."""
        self.check_batch_axis(tensor, layer)
        probe = tf.zeros_like(tensor)
        index = self.watch(probe)
        probed = tensor + probe
        mask = masking.get_keras_mask(tensor)
        if mask is not None:
            masking.set_keras_mask(probed, mask)
        return probed, index

    def has_batch_axis(self, tensor) -> bool:
        """Whether `tensor` may lead with the example axis (checked at run time if unknown)."""
        if not tf.is_tensor(tensor) or not tensor.shape.rank:
            return False
        leading = tensor.shape[0]
        if leading is not None and self.static_batch_size is not None:
            return leading == self.static_batch_size
        self._runtime_checks.append(tf.equal(tf.shape(tensor)[0], self.batch_size))
        return True

    def check_batch_axis(self, tensor, layer):
        # Rules read axis 0 as the example axis; a layer applied to reshaped
        # or transposed activations would get wrong norms, so refuse it.
        if not self.has_batch_axis(tensor):
            raise PrivacyConfigurationError(
                f"Layer '{layer.name}' was called on a tensor of shape "
                f"{tensor.shape} whose first axis is not the micro-batch axis "
                f"(size {self.static_batch_size}); ghost clipping cannot "
                "attribute its gradient to examples. Use clipping='vectorized'."
            )

    def batch_axes_consistent(self) -> tf.Tensor:
        """False if a layer ran on a tensor whose first axis was not the batch.

        Shapes unknown when tracing are checked here, when the step runs; the
        strategy then gives every example a NaN norm, so nothing is added.
        """
        if not self._runtime_checks:
            return tf.constant(True)
        return tf.reduce_all(tf.stack(self._runtime_checks))

    def on_gradients(self, finisher: Callable):
        """Registers `finisher(gradient_of) -> [(variable, term), ...]`."""
        self._finishers.append(finisher)

    def terms(self, gradients):
        """All (variable, term) records, given the gradients of `watched`."""
        gradient_of = lambda index: gradients[index]
        records = []
        for finisher in self._finishers:
            records.extend(finisher(gradient_of))
        return records

    @contextlib.contextmanager
    def covering(self, variables):
        """Marks reads of `variables` as accounted for by the running rule."""
        self._covering.append(frozenset(id(v) for v in variables))
        try:
            yield
        finally:
            self._covering.pop()

    def note_read(self, variable):
        if self.suspended or id(variable) not in self._trainable:
            return
        if id(variable) not in self._covering[-1]:
            self.violations.append(variable.path)


class ReadCheckingScope(keras_backend.StatelessScope):
    """A stateless scope that reports every trainable-variable read to a recorder.

    A trainable variable read outside the rule that accounts for it (e.g. a
    custom layer multiplying by another layer's kernel) would be missing from
    the norms; the strategy refuses such models instead of under-clipping.
    """

    def __init__(self, recorder: Recorder, state_mapping=None):
        super().__init__(state_mapping=state_mapping, collect_losses=True)
        self.recorder = recorder

    def get_current_value(self, variable):
        self.recorder.note_read(variable)
        return super().get_current_value(variable)

    def updated_value(self, variable):
        return super().get_current_value(variable)


@contextlib.contextmanager
def _swapped(layer, name, value):
    original = getattr(layer, name)
    object.__setattr__(layer, name, value)
    try:
        yield
    finally:
        object.__setattr__(layer, name, original)


def _call_with_probed_activation(recorder, layer, original, *args, **kwargs):
    """Runs `original` with a zero probe before `layer.activation`.

    Returns:
        (outputs, index of the probe's gradient): that gradient is the output
        gradient with respect to the pre-activation values.
    """
    activation, slot = layer.activation, {}

    def probed_activation(x):
        x, slot["index"] = recorder.probe(x, layer)
        return x if activation is None else activation(x)

    with _swapped(layer, "activation", probed_activation):
        outputs = original(*args, **kwargs)
    return outputs, slot["index"]


def _as_float(tensor):
    return tf.cast(tensor, tf.float32)


def _flat_tokens(tensor, batch_size):
    """[m, ..., D] -> [m, T, D], with T static whenever the inner axes are."""
    inner = tensor.shape[1:-1]
    tokens = inner.num_elements() if inner.is_fully_defined() else -1
    return tf.reshape(_as_float(tensor), [batch_size, tokens, tensor.shape[-1]])


def _bias_gradient(output_gradient, bias):
    """Per-example gradient of a bias broadcast (right-aligned) onto the output."""
    gradient = _as_float(output_gradient)
    rank = gradient.shape.rank
    shape = list(bias.shape)
    offset = rank - len(shape)
    axes = [a for a in range(1, rank)
            if a < offset or (shape[a - offset] == 1 and gradient.shape[a] != 1)]
    gradient = tf.reduce_sum(gradient, axis=axes, keepdims=True)
    return Explicit(tf.reshape(gradient, [tf.shape(gradient)[0]] + shape))


class Rule:
    """Intercepts one layer. Subclasses set `variables` and implement `call`.

    Args:
        layer: the layer to intercept.
    """

    # Whether the rule accounts for all variables below the layer (then its
    # sublayers get no rules of their own).
    covers_sublayers = False

    def __init__(self, layer):
        self.layer = layer
        self.variables = list(layer._trainable_variables)

    @classmethod
    def matches(cls, layer) -> bool:
        """Whether this rule applies to `layer` (already an instance of the registered class).

        The default accepts a layer that runs the `call` of the class the
        rule was registered for, so a subclass overriding `call` falls back
        (exact per-example gradients under "auto", refusal under "ghost").
        """
        registered = [c for c, rule in _REGISTRY if rule is cls and isinstance(layer, c)]
        return any(type(layer).call is c.call for c in registered)

    def call(self, recorder, original, *args, **kwargs):
        """Runs `original` (the layer's own call), recording what the gradients need.

        Register a `finisher(gradient_of)` with `recorder.on_gradients` that
        returns [(variable, term), ...]; `recorder.probe(tensor, layer)`
        gives an index whose gradient is dL/d(tensor) per example.
        """
        raise NotImplementedError

    @contextlib.contextmanager
    def installed(self, recorder: Recorder):
        original = self.layer.call

        def intercepted(*args, **kwargs):
            if recorder.suspended:
                return original(*args, **kwargs)
            with recorder.covering(self.variables):
                return self.call(recorder, original, *args, **kwargs)

        with base.override_call(self.layer, intercepted):
            yield


def _plain(layer, cls) -> bool:
    """`layer` runs `cls.call` unmodified, unquantized and without LoRA."""
    return (isinstance(layer, cls) and type(layer).call is cls.call
            and not getattr(layer, "lora_enabled", False)
            and layer.quantization_mode is None)


class DenseRule(Rule):
    """`keras.layers.Dense` on inputs of any rank: Outer(inputs, dL/dpre-activation)."""

    @classmethod
    def matches(cls, layer):
        return _plain(layer, keras.layers.Dense)

    def call(self, recorder, original, inputs, *args, **kwargs):
        layer = self.layer
        recorder.check_batch_axis(inputs, layer)
        outputs, index = _call_with_probed_activation(
            recorder, layer, original, inputs, *args, **kwargs)

        def finish(gradient_of):
            gradient = gradient_of(index)
            if gradient is None:
                return []
            m = recorder.batch_size
            records = [(layer.kernel, Outer(_flat_tokens(inputs, m), _flat_tokens(gradient, m)))]
            if layer.bias is not None:
                records.append((layer.bias, _bias_gradient(gradient, layer.bias)))
            return records

        recorder.on_gradients(finish)
        return outputs


class EinsumPlan(NamedTuple):
    """How an EinsumDense equation maps to [m, T, P] x [m, T, D] per example."""

    to_left: str  # einsum taking the input to batch + tokens + P letters
    to_right: str  # einsum taking the output gradient to batch + tokens + D letters
    kernel: str  # the kernel's letters
    contracted: str  # P: kernel letters summed against the input
    produced: str  # D: kernel letters that appear in the output
    swap: bool  # kernel letters are D then P (the gradient is right^T left)


def einsum_plan(equation: str) -> EinsumPlan | None:
    """Splits an EinsumDense equation into token, contracted and output letters.

    Returns None for equations ghost norms do not cover (ellipses, kernel
    letters kept in both input and output, batch axis in the kernel, or
    kernel letters whose order interleaves input and output axes).
    """
    if "..." in equation:
        return None
    inputs, rest = equation.split(",")
    kernel, outputs = rest.split("->")
    batch = inputs[0]
    if outputs[:1] != batch or batch in kernel:
        return None
    contracted = [c for c in kernel if c in inputs and c not in outputs]
    produced = [c for c in kernel if c in outputs and c not in inputs]
    if len(contracted) + len(produced) != len(kernel):
        return None
    tokens = "".join(c for c in inputs[1:] if c in outputs and c not in kernel)
    p, d = "".join(contracted), "".join(produced)
    if kernel == p + d:
        swap = False
    elif kernel == d + p:
        swap = True
    else:
        return None
    return EinsumPlan(f"{inputs}->{batch}{tokens}{p}", f"{outputs}->{batch}{tokens}{d}",
                      kernel, p, d, swap)


class EinsumDenseRule(Rule):
    """`keras.layers.EinsumDense` (MultiHeadAttention, transformer encoders)."""

    @classmethod
    def matches(cls, layer):
        return (_plain(layer, keras.layers.EinsumDense)
                and einsum_plan(layer.equation) is not None)

    def call(self, recorder, original, inputs, *args, **kwargs):
        layer = self.layer
        plan = einsum_plan(layer.equation)
        recorder.check_batch_axis(inputs, layer)
        outputs, index = _call_with_probed_activation(
            recorder, layer, original, inputs, *args, **kwargs)

        def finish(gradient_of):
            gradient = gradient_of(index)
            if gradient is None:
                return []
            m = recorder.batch_size
            left = tf.einsum(plan.to_left, _as_float(inputs))
            right = tf.einsum(plan.to_right, _as_float(gradient))
            sizes = dict(zip(plan.kernel, layer.kernel.shape))
            size = lambda letters: int(np.prod([sizes[c] for c in letters]))
            left = tf.reshape(left, [m, -1, size(plan.contracted)])
            right = tf.reshape(right, [m, -1, size(plan.produced)])
            term = Outer(right, left) if plan.swap else Outer(left, right)
            records = [(layer.kernel, term)]
            if layer.bias is not None:
                records.append((layer.bias, _bias_gradient(gradient, layer.bias)))
            return records

        recorder.on_gradients(finish)
        return outputs


class EmbeddingRule(Rule):
    """`keras.layers.Embedding`: Gather(token ids, dL/doutput)."""

    @classmethod
    def matches(cls, layer):
        return _plain(layer, keras.layers.Embedding)

    def call(self, recorder, original, inputs, *args, **kwargs):
        layer = self.layer
        outputs, index = recorder.probe(original(inputs, *args, **kwargs), layer)
        ids = tf.cast(inputs, tf.int32)

        def finish(gradient_of):
            gradient = gradient_of(index)
            if gradient is None:
                return []
            m = recorder.batch_size
            return [(layer.embeddings, Gather(tf.reshape(ids, [m, -1]),
                                              _flat_tokens(gradient, m)))]

        recorder.on_gradients(finish)
        return outputs


class PositionEmbeddingRule(Rule):
    """`keras_hub.layers.PositionEmbedding`: Gather(positions, dL/doutput)."""

    @classmethod
    def matches(cls, layer):
        cls_ = keras_hub.layers.PositionEmbedding
        return isinstance(layer, cls_) and type(layer).call is cls_.call

    def call(self, recorder, original, inputs, start_index=0, positions=None):
        layer = self.layer
        if positions is not None:
            raise PrivacyConfigurationError(
                f"Ghost clipping does not cover '{layer.name}' called with explicit "
                "`positions`. Use clipping='vectorized'."
            )
        outputs, index = recorder.probe(original(inputs, start_index=start_index), layer)
        length = outputs.shape[-2]
        ids = tf.cast(start_index, tf.int32) + tf.range(length, dtype=tf.int32)
        ids = tf.broadcast_to(ids[:, None], outputs.shape[1:-1] + [1])[..., 0]

        def finish(gradient_of):
            gradient = gradient_of(index)
            if gradient is None:
                return []
            m = recorder.batch_size
            tiled = tf.broadcast_to(ids, tf.concat([[m], tf.shape(ids)], 0))
            return [(layer.position_embeddings,
                     Gather(tf.reshape(tiled, [m, -1]), _flat_tokens(gradient, m)))]

        recorder.on_gradients(finish)
        return outputs


class ReversibleEmbeddingRule(Rule):
    """`ReversibleEmbedding`: Gather for the lookup, Outer for the projection.

    With tied weights both calls record a term for the SAME matrix; the
    strategy includes their cross term in each example's norm.
    """

    @classmethod
    def matches(cls, layer):
        return (_plain(layer, keras.layers.ReversibleEmbedding)
                and layer.reverse_dtype is None and layer.logit_soft_cap is None)

    def call(self, recorder, original, inputs, reverse=False):
        layer = self.layer
        outputs, index = recorder.probe(original(inputs, reverse=reverse), layer)
        ids = None if reverse else tf.cast(inputs, tf.int32)
        recorder.check_batch_axis(inputs, layer)

        def finish(gradient_of):
            gradient = gradient_of(index)
            if gradient is None:
                return []
            m = recorder.batch_size
            gradient = _flat_tokens(gradient, m)
            if not reverse:
                return [(layer.embeddings, Gather(tf.reshape(ids, [m, -1]), gradient))]
            hidden = _flat_tokens(inputs, m)
            if layer.tie_weights:
                # logits = h E^T: dE = (dlogits)^T h, an [input_dim, output_dim] matrix.
                return [(layer.embeddings, Outer(gradient, hidden))]
            return [(layer.reverse_embeddings, Outer(hidden, gradient))]

        recorder.on_gradients(finish)
        return outputs


class MaskedLMHeadRule(Rule):
    """keras-hub `MaskedLMHead` tied to a token embedding: its output bias.

    The intermediate Dense, LayerNormalization and the tied projection are
    sublayers with rules of their own.
    """

    @classmethod
    def matches(cls, layer):
        cls_ = keras_hub.layers.MaskedLMHead
        return (isinstance(layer, cls_) and type(layer).call is cls_.call
                and layer.token_embedding is not None)

    def call(self, recorder, original, *args, **kwargs):
        layer = self.layer
        outputs, index = _call_with_probed_activation(recorder, layer, original, *args, **kwargs)

        def finish(gradient_of):
            gradient = gradient_of(index)
            return [] if gradient is None else [(layer._bias, _bias_gradient(gradient, layer._bias))]

        recorder.on_gradients(finish)
        return outputs


class LayerNormalizationRule(Rule):
    """`keras.layers.LayerNormalization`: closed-form per-example gradients.

    The layer is `normalized(x) * gamma + beta`; example i's gradients are
    `sum(normalized(x_i) * g_i)` and `sum(g_i)` over its non-normalized axes,
    with `g` the output gradient. Much cheaper than `PerExampleRule`, which
    would run the layer per example with per-example copies of gamma and beta.
    """

    @classmethod
    def matches(cls, layer):
        cls_ = keras.layers.LayerNormalization
        return isinstance(layer, cls_) and type(layer).call is cls_.call

    def call(self, recorder, original, inputs):
        layer = self.layer
        recorder.check_batch_axis(inputs, layer)
        rank = inputs.shape.rank
        axes = sorted(a % rank for a in layer.axis)
        if 0 in axes:
            raise PrivacyConfigurationError(
                f"Layer '{layer.name}' normalizes over the micro-batch axis, which "
                "mixes examples; no per-example gradient exists. Normalize over "
                "feature axes only."
            )
        shape = [1] * rank
        for a in axes:
            shape[a] = inputs.shape[a]
        normalized = keras.ops.layer_normalization(
            _as_float(inputs), None, None, axes, layer.epsilon, rms_scaling=layer.rms_scaling)
        outputs = normalized
        if layer.gamma is not None:
            outputs = outputs * tf.reshape(_as_float(layer.gamma), shape)
        if layer.beta is not None:
            outputs = outputs + tf.reshape(_as_float(layer.beta), shape)
        outputs, index = recorder.probe(outputs, layer)
        summed = [a for a in range(1, rank) if a not in axes]

        def finish(gradient_of):
            gradient = gradient_of(index)
            if gradient is None:
                return []
            per_example = lambda t: Explicit(tf.reduce_sum(t, axis=summed))
            records = []
            if layer.gamma is not None:
                records.append((layer.gamma, per_example(normalized * gradient)))
            if layer.beta is not None:
                records.append((layer.beta, per_example(gradient)))
            return records

        recorder.on_gradients(finish)
        return tf.cast(outputs, layer.compute_dtype)


class PerExampleRule(Rule):
    """Any layer: its forward pass runs per example with per-example variables.

    Each example gets its own copy of the layer's variables (a broadcast,
    watched by the tape), so the gradient with respect to the copies is the
    per-example gradient; memory is m times the layer's parameters. Dropout
    seeds get one distinct seed per example, as in `VectorizedClipping`.
    """

    covers_sublayers = True

    def __init__(self, layer):
        self.layer = layer
        self.variables = list(layer.trainable_variables)

    @classmethod
    def matches(cls, layer):
        return True

    def call(self, recorder, original, *args, **kwargs):
        layer, m = self.layer, recorder.batch_size
        # tf.tile, not tf.broadcast_to(tf.shape(v)): XLA would need the
        # variable as a compile-time constant and recompile whenever it changes.
        copies = [tf.tile(tf.expand_dims(v.value, 0), [m] + [1] * v.shape.rank)
                  for v in self.variables]
        indices = [recorder.watch(c) for c in copies]
        leaves = tf.nest.flatten((args, kwargs))
        batched = [recorder.has_batch_axis(t) for t in leaves]
        if not any(batched):
            raise PrivacyConfigurationError(
                f"Layer '{layer.name}' was called without any input carrying "
                f"the micro-batch axis (size {m}). Use clipping='vectorized'."
            )
        states, per_example = base.example_state_values(layer, m)
        varying = [s for s, varies in zip(states, per_example) if varies]

        def one_example(elements):
            example_leaves, example_copies, example_states = elements
            example_leaves = iter(example_leaves)
            rebuilt = [tf.expand_dims(next(example_leaves), 0) if is_batched else leaf
                       for leaf, is_batched in zip(leaves, batched)]
            example_args, example_kwargs = tf.nest.pack_sequence_as((args, kwargs), rebuilt)
            example_states = iter(example_states)
            state_values = [next(example_states) if varies else s
                            for s, varies in zip(states, per_example)]
            mapping = list(zip(self.variables, example_copies))
            mapping += list(zip(layer.non_trainable_variables, state_values))
            scope = _OwnVariablesScope(recorder, layer, self.variables, mapping)
            with scope:
                outputs = original(*example_args, **example_kwargs)
            return tf.nest.map_structure(lambda t: t[0], outputs)

        mapped = [_dense_gradient_boundary(leaf)
                  for leaf, is_batched in zip(leaves, batched) if is_batched]
        recorder.suspended += 1
        try:
            outputs = tf.vectorized_map(
                one_example, (mapped, [_dense_gradient_boundary(c) for c in copies], varying))
        finally:
            recorder.suspended -= 1
        base.advance_seed_states(layer)

        def finish(gradient_of):
            records = []
            for variable, index in zip(self.variables, indices):
                gradient = gradient_of(index)  # dense: it comes through the boundary
                if gradient is not None:
                    records.append((variable, Explicit(_as_float(gradient))))
            return records

        recorder.on_gradients(finish)
        return outputs


class ReplayRule(Rule):
    """Any deterministic layer: run batched, then replayed per example for its gradients.

    The layer runs once on the whole micro-batch, with a zero probe on every
    floating-point output, so the backward pass yields its output gradient G
    example by example. Example i's gradient is then the vector-Jacobian
    product of the layer at example i with G_i: the layer is re-run on
    example i alone under `vectorized_map` and differentiated there, with its
    variables loop-invariant, which is the structure `VectorizedClipping`
    uses. `PerExampleRule` instead gives every example its own copy of the
    variables; for a convolution that makes the filter loop-variant, which
    pfor cannot vectorize, and XLA then rejected the while-loop fallback
    ("XLA compilation requires a fixed tensor list size", Conv2D under
    `clipping="auto"`). The replay is exact only if the layer is a
    deterministic function of its inputs and variables, so layers that draw
    random numbers keep `PerExampleRule`.
    """

    covers_sublayers = True

    def __init__(self, layer):
        self.layer = layer
        self.variables = list(layer.trainable_variables)

    @classmethod
    def matches(cls, layer) -> bool:
        return not base.draws_random_numbers(layer)

    def call(self, recorder, original, *args, **kwargs):
        layer = self.layer
        leaves = tf.nest.flatten((args, kwargs))
        batched = [recorder.has_batch_axis(t) for t in leaves]
        if not any(batched):
            raise PrivacyConfigurationError(
                f"Layer '{layer.name}' was called without any input carrying "
                f"the micro-batch axis (size {recorder.static_batch_size}). Use "
                "clipping='vectorized'."
            )
        # The replay accounts for every variable below the layer; rules of
        # sublayers it shares with the rest of the model (a tied embedding)
        # must not record this call a second time.
        recorder.suspended += 1
        try:
            outputs = original(*args, **kwargs)
        finally:
            recorder.suspended -= 1
        output_leaves = tf.nest.flatten(outputs)
        probed, indices = [], []
        for leaf in output_leaves:
            if tf.is_tensor(leaf) and leaf.dtype.is_floating:
                leaf, index = recorder.probe(leaf, layer)
            else:
                index = None
            probed.append(leaf)
            indices.append(index)
        outputs = tf.nest.pack_sequence_as(outputs, probed)
        states = [tf.convert_to_tensor(v.value) for v in layer.non_trainable_variables]

        def finish(gradient_of):
            cotangents = [None if i is None else gradient_of(i) for i in indices]
            if all(g is None for g in cotangents):
                return []
            values = [tf.convert_to_tensor(v.value) for v in self.variables]
            reached = [g is not None for g in cotangents]
            connected = []

            def one_example(elements):
                example_leaves, example_cotangents = elements
                example_leaves = iter(example_leaves)
                rebuilt = [tf.expand_dims(next(example_leaves), 0) if is_batched else leaf
                           for leaf, is_batched in zip(leaves, batched)]
                example_args, example_kwargs = tf.nest.pack_sequence_as((args, kwargs), rebuilt)
                mapping = list(zip(self.variables, values))
                mapping += list(zip(layer.non_trainable_variables, states))
                with tf.GradientTape() as tape:
                    tape.watch(values)
                    with _OwnVariablesScope(recorder, layer, self.variables, mapping):
                        replayed = tf.nest.flatten(original(*example_args, **example_kwargs))
                    example_cotangents = iter(example_cotangents)
                    total = tf.add_n([
                        tf.reduce_sum(_as_float(out) * _as_float(next(example_cotangents))[None])
                        for out, is_reached in zip(replayed, reached) if is_reached
                    ])
                gradients = [base.dense_gradient(g) for g in tape.gradient(total, values)]
                # Which variables the layer's outputs reach is fixed at trace time.
                connected[:] = [g is not None for g in gradients]
                return [g for g in gradients if g is not None]

            mapped = [leaf for leaf, is_batched in zip(leaves, batched) if is_batched]
            per_example = iter(tf.vectorized_map(
                one_example, (mapped, [g for g in cotangents if g is not None])))
            return [(variable, Explicit(_as_float(next(per_example))))
                    for variable, is_connected in zip(self.variables, connected) if is_connected]

        recorder.on_gradients(finish)
        return outputs


def fallback_rule(layer) -> Rule:
    """The exact per-example rule for a layer without a ghost rule."""
    return ReplayRule(layer) if ReplayRule.matches(layer) else PerExampleRule(layer)


def _dense_gradient_boundary(tensor):
    """Identity whose gradient is made dense here, against `tensor`'s own shape.

    Differentiating through `vectorized_map` yields IndexedSlices whose dense
    shape is computed inside pfor's backward function. When the micro-batch
    axis is not static (e.g. `fit` on arrays with a partial last batch), XLA
    cannot see through that function, so it would treat every input and
    weight as a compile-time constant and recompile at every step. The shape
    of `tensor`, taken outside, is one XLA can resolve.
    """
    if not tensor.dtype.is_floating:
        return tensor

    @tf.custom_gradient
    def boundary(value):
        def gradient(upstream):
            if isinstance(upstream, tf.IndexedSlices):
                return tf.math.unsorted_segment_sum(
                    upstream.values, upstream.indices, tf.shape(value)[0])
            return upstream

        return tf.identity(value), gradient

    return boundary(tensor)


class _OwnVariablesScope(keras_backend.StatelessScope):
    """Inside a per-example forward: reads of foreign trainable variables are refused."""

    def __init__(self, recorder, layer, variables, mapping):
        super().__init__(state_mapping=mapping)
        self._recorder, self._layer = recorder, layer
        self._own = {id(v) for v in variables}

    def get_current_value(self, variable):
        if id(variable) in self._recorder._trainable and id(variable) not in self._own:
            self._recorder.violations.append(variable.path)
        return super().get_current_value(variable)


# (layer class, rule class), newest first: a rule registered later for the
# same or a more specific class is tried before the built-in ones.
_REGISTRY: list[tuple[type, type]] = []


def register_ghost_rule(layer_class: type):
    """Class decorator: makes a `Rule` subclass handle `layer_class` under ghost and auto.

    The rule is tried for every instance of `layer_class` (or a subclass)
    whose `rule.matches(layer)` is true, before the built-in rules; the most
    recently registered rule wins. It must record, for every trainable
    variable of the layer, terms whose sum over a call is example i's
    gradient (`Outer`, `Gather`, `Explicit`); `tests/test_clipping.py`'s
    `assert_same_clipping` compares them with materialised per-example
    gradients, and a new rule should pass it before it is trusted: ghost
    clipping uses its records as the per-example gradients they claim to be.

    Example:
    ```python
    @register_ghost_rule(MyScale)
    class MyScaleRule(Rule):
        def call(self, recorder, original, inputs):
            outputs, index = recorder.probe(original(inputs), self.layer)
            def finish(gradient_of):
                g = gradient_of(index)
                return [] if g is None else [
                    (self.layer.scale, Explicit(tf.reduce_sum(inputs * g, axis=1)))]
            recorder.on_gradients(finish)
            return outputs
    ```
    """
    if not isinstance(layer_class, type) or not issubclass(layer_class, keras.layers.Layer):
        raise TypeError(f"register_ghost_rule needs a keras Layer class, got {layer_class!r}.")

    def register(rule_class):
        if not isinstance(rule_class, type) or not issubclass(rule_class, Rule):
            raise TypeError(f"{rule_class!r} is not a subclass of layer_rules.Rule.")
        _REGISTRY.insert(0, (layer_class, rule_class))
        return rule_class

    return register


def unregister_ghost_rule(rule_class: type) -> None:
    """Removes every registration of `rule_class` (e.g. at the end of a test)."""
    _REGISTRY[:] = [(layer, rule) for layer, rule in _REGISTRY if rule is not rule_class]


def rule_for(layer) -> Rule | None:
    """The registered ghost rule for `layer`, or None."""
    for layer_class, rule_class in _REGISTRY:
        if isinstance(layer, layer_class) and rule_class.matches(layer):
            return rule_class(layer)
    return None


# The built-in rules, registered like user rules; order here is priority
# order (a ReversibleEmbedding is also an Embedding).
for _layer_class, _rule_class in reversed([
    (keras.layers.Dense, DenseRule),
    (keras.layers.EinsumDense, EinsumDenseRule),
    (keras.layers.ReversibleEmbedding, ReversibleEmbeddingRule),
    (keras.layers.Embedding, EmbeddingRule),
    (keras_hub.layers.PositionEmbedding, PositionEmbeddingRule),
    (keras_hub.layers.MaskedLMHead, MaskedLMHeadRule),
    (keras.layers.LayerNormalization, LayerNormalizationRule),
]):
    register_ghost_rule(_layer_class)(_rule_class)


def plan_rules(model: keras.Model, fallback: str) -> list[Rule]:
    """Assigns a rule to every layer that owns trainable variables.

    Args:
        model: a built model.
        fallback: "small" (layers without a ghost rule must be in
            `SMALL_LAYERS`) or "any" (every such layer gets `PerExampleRule`).

    Returns:
        The rules, one per intercepted layer.

    Raises:
        PrivacyConfigurationError: a layer has no rule under `fallback`, or a
            trainable variable is owned by no intercepted layer.
    """
    rules, seen = [], set()
    unsupported = []

    def visit(layer):
        if id(layer) in seen:
            return
        seen.add(id(layer))
        rule = rule_for(layer)
        if rule is None and layer._trainable_variables:
            if fallback == "any" or isinstance(layer, SMALL_LAYERS):
                rule = fallback_rule(layer)
            else:
                unsupported.append(f"'{layer.name}' ({type(layer).__name__})")
        if rule is not None:
            rules.append(rule)
            if rule.covers_sublayers:
                return
        for child in layer._layers:
            visit(child)

    visit(model)
    if unsupported:
        raise PrivacyConfigurationError(
            "clipping='ghost' has no ghost-norm rule for layer(s) "
            f"{', '.join(unsupported)}. Use clipping='auto' (exact per-example "
            "gradients for those layers, ghost norms for the rest) or "
            "clipping='vectorized'."
        )
    covered = {id(v) for rule in rules for v in rule.variables}
    missing = [v.path for v in model.trainable_variables if id(v) not in covered]
    if missing:
        raise PrivacyConfigurationError(
            f"Trainable variables {missing} belong to no layer that ghost "
            "clipping can intercept. Use clipping='vectorized'."
        )
    return rules
