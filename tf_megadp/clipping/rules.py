"""The machinery of ghost rules: the recorder, the `Rule` base class, the registry.

Ghost clipping runs the model ONCE on the whole micro-batch. While that trace
runs, every layer that owns trainable variables is intercepted by a rule (its
`call` is replaced on the instance, and restored when the trace ends). A rule
records, per call, a term (`tf_megadp.clipping.terms`) per variable that says
what example i's gradient of it is made of. `recorder.probe(tensor, layer)`
adds a zero "probe" to a layer's (pre-activation) output; the gradient of the
summed loss with respect to the probe is that output gradient, example by
example. The rules themselves live in `tf_megadp.clipping.ghost_rules`, one
module per layer family, registered with `register_ghost_rule`.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import keras
import tensorflow as tf

from tf_megadp import _keras_compat
from tf_megadp.clipping import base
from tf_megadp.clipping.terms import Explicit, Term, compute_dtype
from tf_megadp.errors import GhostClippingUnsupportedError

__all__ = ["ReadCheckingScope", "Recorder", "Rule", "accept_without_rule", "register_ghost_rule",
           "rule_for", "unregister_ghost_rule"]

# Layers with few parameters whose per-example gradients are cheap to
# materialise; `clipping="ghost"` accepts these without ghost rules
# (LayerNormalization has one; a subclass overriding `call` lands here).
SMALL_LAYERS: list[type] = [
    keras.layers.LayerNormalization,
    keras.layers.RMSNormalization,
    keras.layers.GroupNormalization,
]


def accept_without_rule(layer_class: type) -> None:
    """Lets `clipping="ghost"` give `layer_class` exact per-example gradients (small layers)."""
    if layer_class not in SMALL_LAYERS:
        SMALL_LAYERS.append(layer_class)


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
        mask = _keras_compat.get_keras_mask(tensor)
        if mask is not None:
            _keras_compat.set_keras_mask(probed, mask)
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
            raise GhostClippingUnsupportedError(
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
        """The (variable, term) records of trainable variables, given the gradients of `watched`.

        A rule records every variable of its layer; those the model does not
        train (one the user froze in a layer that trains others) are dropped
        here: they are never updated, so their gradients are neither clipped
        nor counted in the norms.
        """
        gradient_of = lambda index: gradients[index]
        records = []
        for finisher in self._finishers:
            records.extend((variable, term) for variable, term in finisher(gradient_of)
                           if id(variable) in self._trainable
                           # Anything but a variable (a tensor recorded by
                           # mistake) stays: the strategy refuses it rather
                           # than leave out a gradient.
                           or not isinstance(variable, keras.Variable))
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


class ReadCheckingScope(keras.StatelessScope):
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
def swapped(layer, name, value):
    """Sets `layer.<name>` to `value` for the duration of the block."""
    original = getattr(layer, name)
    object.__setattr__(layer, name, value)
    try:
        yield
    finally:
        object.__setattr__(layer, name, original)


def call_with_probed_activation(recorder, layer, original, *args, **kwargs):
    """Runs `original` with a zero probe before `layer.activation`.

    Returns:
        (outputs, index of the probe's gradient): that gradient is the output
        gradient with respect to the pre-activation values.
    """
    activation, slot = layer.activation, {}

    def probed_activation(x):
        x, slot["index"] = recorder.probe(x, layer)
        return x if activation is None else activation(x)

    with swapped(layer, "activation", probed_activation):
        outputs = original(*args, **kwargs)
    return outputs, slot["index"]


def flat_tokens(tensor, batch_size, dtype):
    """[m, ..., D] -> [m, T, D] in `dtype`, with T static whenever the inner axes are."""
    inner = tensor.shape[1:-1]
    tokens = inner.num_elements() if inner.is_fully_defined() else -1
    return tf.reshape(tf.cast(tensor, dtype), [batch_size, tokens, tensor.shape[-1]])


def bias_gradient(output_gradient, bias) -> Explicit:
    """Per-example gradient of a bias broadcast (right-aligned) onto the output."""
    gradient = tf.cast(output_gradient, compute_dtype(bias))
    rank = gradient.shape.rank
    shape = list(bias.shape)
    offset = rank - len(shape)
    axes = [a for a in range(1, rank)
            if a < offset or (shape[a - offset] == 1 and gradient.shape[a] != 1)]
    gradient = tf.reduce_sum(gradient, axis=axes, keepdims=True)
    return Explicit(tf.reshape(gradient, [tf.shape(gradient)[0]] + shape), shape)


def plain(layer, cls) -> bool:
    """`layer` runs `cls.call` unmodified, unquantized and without LoRA."""
    return (isinstance(layer, cls) and type(layer).call is cls.call
            and not getattr(layer, "lora_enabled", False)
            and getattr(layer, "quantization_mode", None) is None)


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
        self.variables = list(_keras_compat.own_trainable_variables(layer))

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


class KernelBiasRule(Rule):
    """Rule for a layer computing activation(f(inputs, kernel) + bias): Dense, EinsumDense.

    The pre-activation output is probed; example i's bias gradient is its
    output gradient summed over the broadcast axes, and its kernel gradient is
    the term subclasses build in `kernel_term` from the inputs and that
    output gradient.
    """

    def call(self, recorder, original, inputs, *args, **kwargs):
        layer = self.layer
        recorder.check_batch_axis(inputs, layer)
        outputs, index = call_with_probed_activation(
            recorder, layer, original, inputs, *args, **kwargs)

        def finish(gradient_of):
            gradient = gradient_of(index)
            if gradient is None:
                return []
            layer_inputs, gradient = self.bias_layout(inputs, gradient)
            records = self.kernel_records(layer_inputs, gradient, recorder.batch_size)
            if layer.bias is not None:
                records.append((layer.bias, bias_gradient(gradient, layer.bias)))
            return records

        recorder.on_gradients(finish)
        return outputs

    def bias_layout(self, inputs, gradient):
        """(inputs, output gradient) laid out so that the bias broadcasts right-aligned.

        The identity here; a channels_first convolution moves its channels last.
        """
        return inputs, gradient

    def kernel_records(self, inputs, gradient, batch_size) -> list:
        """[(variable, term)] of the variables behind the kernel: the kernel alone here.

        A LoRA layer's kernel is W + s A B, with the factors as its variables
        (`ghost_rules.lora`). Arguments as `kernel_term`'s.
        """
        kernel = self.layer.kernel
        return [(kernel, self.kernel_term(inputs, gradient, batch_size, compute_dtype(kernel)))]

    def kernel_term(self, inputs, gradient, batch_size, dtype) -> Term:
        """Example i's kernel gradient.

        Args:
            inputs: the layer's inputs, [m, ...], as `bias_layout` returns them.
            gradient: dL/d(pre-activation output), [m, ...], likewise.
            batch_size: m, a scalar tensor.
            dtype: the dtype the term computes in (the kernel's compute dtype).

        Returns:
            A term of the kernel's shape.
        """
        raise NotImplementedError


# (layer class, rule class) in the order they are tried: user rules, newest
# first, then the built-in ones in the order their modules register them.
_REGISTRY: list[tuple[type, type]] = []


def _checked(layer_class, rule_class):
    if not isinstance(layer_class, type) or not issubclass(layer_class, keras.layers.Layer):
        raise TypeError(f"register_ghost_rule needs a keras Layer class, got {layer_class!r}.")
    if not isinstance(rule_class, type) or not issubclass(rule_class, Rule):
        raise TypeError(f"{rule_class!r} is not a subclass of tf_megadp.clipping.Rule.")


def register_ghost_rule(layer_class: type):
    """Class decorator: makes a `Rule` subclass handle `layer_class` under ghost and auto.

    The rule is tried for every instance of `layer_class` (or a subclass)
    whose `rule.matches(layer)` is true, before the built-in rules; the most
    recently registered rule wins. It must record, for every trainable
    variable of the layer, terms whose sum over a call is example i's
    gradient (`Outer`, `Gather`, `Explicit` of `tf_megadp.clipping.terms`,
    or a new `Term` subclass); `tests/test_clipping.py`'s
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
    _checked(layer_class, Rule)

    def register(rule_class):
        _checked(layer_class, rule_class)
        _REGISTRY.insert(0, (layer_class, rule_class))
        return rule_class

    return register


def builtin_rule(layer_class: type):
    """Class decorator for the library's own rules: tried after every user rule."""

    def register(rule_class):
        _checked(layer_class, rule_class)
        _REGISTRY.append((layer_class, rule_class))
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

