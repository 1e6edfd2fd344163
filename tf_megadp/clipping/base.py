"""The per-example clipping interface and the pieces every strategy shares.

A clipping strategy turns one micro-batch into the sum of its clipped
per-example gradients. Strategies differ only in how they find each example's
gradient norm (materialised per-example gradients, or ghost norms); the
definition of an example's loss, of its clip factor, and of which examples
count is the same for all of them and lives here.
"""

from __future__ import annotations

import abc
import contextlib
import secrets
import weakref
from typing import Any, Callable, NamedTuple

import keras
import tensorflow as tf

from tf_megadp import _keras_compat
from tf_megadp.errors import PrivacyConfigurationError

__all__ = [
    "ClippedBatch",
    "ClippingStrategy",
    "clip_factors",
    "clipped_batch",
    "example_axis_guards",
    "example_weights_present",
    "override_call",
    "per_example_loss",
    "scaled_loss",
    "secret_seed_draws",
    "set_draw_generation",
    "set_randomness_seed",
    "unscaled_gradient",
]


class ClippedBatch(NamedTuple):
    """What a clipping strategy returns for one micro-batch.

    Attributes:
        gradient_sum: one tensor per `model.trainable_variables` entry, the sum
            over examples of c_i * g_i; `None` for variables the loss does not
            reach (they are neither noised nor updated).
        losses: per-example losses, shape [m]; zero for padding examples.
        y_pred: the model's predictions for the micro-batch (for metrics).
        norms: per-example gradient norms ||g_i|| before clipping, shape [m].
        is_real: float mask, 1 for real examples and 0 for padding, shape [m].
        nonfinite: number of real examples whose gradient was not finite and
            therefore contributed zero.
        mixing: int32 scalar from the per-example independence check of
            ghost and auto (`tf_megadp.clipping.independence`): -1 when the
            batched forward pass treated every example independently, else a
            code that `independence.mixing_error(model, code)` turns into the
            error naming the layer. A failed check has already zeroed the
            micro-batch's contribution. None for strategies that run every
            example alone (vectorized), where examples cannot mix.
    """

    gradient_sum: list
    losses: Any
    y_pred: Any
    norms: Any
    is_real: Any
    nonfinite: Any
    mixing: Any = None


class ClippingStrategy(abc.ABC):
    """Computes the sum of clipped per-example gradients of a micro-batch.

    Subclasses implement `clip_and_sum`. They must give every example the
    loss of `per_example_loss`, and the clip factor of `clip_factors`.
    """

    name: str = "abstract"

    @abc.abstractmethod
    def clip_and_sum(
        self, model: keras.Model, x, y, sample_weight, l2_norm_clip: float,
        automatic_stability: float | None = None, examples_per_unit: int = 1,
        loss_scale: float | None = None,
    ) -> ClippedBatch:
        """Returns the clipped gradient sum of one micro-batch.

        Args:
            model: a built Keras model.
            x, y, sample_weight: one micro-batch as `model.fit` passes it.
            l2_norm_clip: C.
            automatic_stability: None for flat clipping; a float gamma for
                automatic clipping (see `clip_factors`).
            loss_scale: None, or the fixed loss scale S of float16 compute:
                each example's loss is `scaled_loss`, and its gradient (or
                whatever its norm is formed from) `unscaled_gradient` before
                the norm. The private step passes it only when set.
            examples_per_unit: k, the rows of one privacy unit: rows
                [u k, (u + 1) k) are unit u, whose SUMMED gradient is clipped
                (`tf_megadp.clipping.units`); every row of a unit reports the
                unit's norm. The private step passes it only when k > 1.

        Returns:
            A `ClippedBatch`.
        """


def clipped_batch(gradient_sum, losses, y_pred, norms, is_real, nonfinite,
                  mixing=None) -> ClippedBatch:
    """Assembles a strategy's result; reported losses count real, finite examples only."""
    losses = tf.where(tf.logical_and(is_real > 0, tf.math.is_finite(losses)),
                      losses, tf.zeros_like(losses))
    return ClippedBatch(
        gradient_sum=gradient_sum,
        losses=losses,
        y_pred=y_pred,
        norms=norms,
        is_real=is_real,
        nonfinite=nonfinite,
        mixing=mixing,
    )


def example_weights_present(sample_weight, batch_size) -> tf.Tensor:
    """Float mask [m]: 1 where an example has any non-zero weight.

    An example whose sample weights are all zero is padding (Poisson steps are
    padded to a static shape this way) and must contribute exactly nothing.
    """
    if sample_weight is None:
        return tf.ones([batch_size], tf.float32)
    flat = [tf.reshape(tf.cast(w, tf.float32), [batch_size, -1])
            for w in tf.nest.flatten(sample_weight) if w is not None]
    if not flat:
        return tf.ones([batch_size], tf.float32)
    any_weight = tf.reduce_any(tf.concat(flat, axis=1) != 0.0, axis=1)
    return tf.cast(any_weight, tf.float32)


def clip_factors(norms: tf.Tensor, l2_norm_clip, is_real: tf.Tensor,
                 automatic_stability: float | None = None):
    """Per-example scale factors, zero for padding and non-finite norms.

    Flat clipping (the default): c_i = min(1, C / ||g_i||). Automatic
    clipping (Bu et al. 2022, "Automatic clipping"), with gamma =
    `automatic_stability`: c_i = C / (||g_i|| + gamma), which normalizes
    every gradient to norm just below C, so the sensitivity stays C and C
    only rescales the update (the learning rate absorbs it).

    Args:
        norms: per-example gradient norms [m].
        l2_norm_clip: C.
        is_real: float mask [m] of real examples.
        automatic_stability: None (flat clipping) or gamma > 0.

    Returns:
        (factors [m], nonfinite count): examples with a non-finite norm get
        factor 0, and the caller must zero their gradients with `tf.where`
        (0 * NaN is NaN).
    """
    # float64 models clip in float64; every other dtype (bfloat16 and
    # float16 included) in float32, so that a factor is never rounded to bf16.
    dtype = tf.float64 if norms.dtype == tf.float64 else tf.float32
    norms = tf.cast(norms, dtype)
    l2_norm_clip = tf.cast(l2_norm_clip, dtype)
    finite = tf.math.is_finite(norms)
    safe_norms = tf.where(finite, norms, tf.ones_like(norms))
    if automatic_stability is None:
        factors = tf.minimum(tf.ones([], dtype), l2_norm_clip / tf.maximum(safe_norms, 1e-12))
    else:
        factors = l2_norm_clip / (safe_norms + automatic_stability)
    keep = tf.logical_and(finite, is_real > 0)
    factors = tf.where(keep, factors, tf.zeros_like(factors))
    nonfinite = tf.reduce_sum(
        tf.cast(tf.logical_and(tf.logical_not(finite), is_real > 0), tf.int64)
    )
    return factors, nonfinite


def scaled_loss(loss: tf.Tensor, loss_scale: float | None) -> tf.Tensor:
    """One example's float32 loss times the fixed loss scale S (None: unchanged).

    Float16 backward passes flush gradients below 6e-8 to zero; scaling the
    loss by S scales every gradient of the pass by S, above that floor.
    """
    if loss_scale is None:
        return loss
    return loss * tf.constant(loss_scale, loss.dtype)


def unscaled_gradient(gradient, loss_scale: float | None):
    """A gradient of a `scaled_loss`, cast to float32 (float64 stays) and divided by S.

    Cast first: divided in float16, a gradient the scale lifted above the
    float16 floor would fall back under it. A gradient that overflowed in
    float16 stays non-finite, and its example contributes zero
    (`clip_factors`). Without a loss scale the gradient is returned as it
    is. With S a power of two the division is exact.
    """
    if loss_scale is None or gradient is None:
        return gradient
    gradient = dense_gradient(gradient)
    wide = tf.float64 if gradient.dtype == tf.float64 else tf.float32
    return tf.cast(gradient, wide) / tf.constant(loss_scale, wide)


def per_example_loss(model: keras.Model, x_i, y_i, y_pred_i, w_i) -> tf.Tensor:
    """The loss of ONE example: the compiled loss on a batch of one.

    Per-token sample weights apply inside the example's loss. Under a
    `tf.distribute` strategy Keras divides every loss by the number of
    replicas; that scaling is undone here because the DP step sums clipped
    gradients itself and divides by the global logical batch once.

    Args:
        model: the compiled model.
        x_i, y_i, y_pred_i, w_i: one example each, WITH a leading batch axis
            of size 1 (`w_i` may be None).

    Returns:
        A scalar float32 tensor.
    """
    loss = model.compute_loss(
        x=x_i, y=y_i, y_pred=y_pred_i, sample_weight=w_i, training=True
    )
    if loss is None:
        raise PrivacyConfigurationError(
            "The model has no loss to differentiate. Pass `loss=` to "
            "`model.compile()` (it is evaluated per example by the DP step)."
        )
    loss = _keras_compat.unscale_loss_for_distribution(loss)
    if loss.shape.rank not in (0, None) and loss.shape.num_elements() != 1:
        raise PrivacyConfigurationError(
            f"The compiled loss returned shape {loss.shape} for a single "
            "example; DP-SGD needs one scalar loss per example. Use a loss "
            "reduction such as 'sum_over_batch_size' (the Keras default) "
            "instead of 'none'."
        )
    return tf.reshape(tf.cast(loss, tf.float32), [])


# -- Secret randomness inside the private step --------------------------------
#
# Keras layers draw their randomness (Dropout, GaussianNoise, augmentation)
# from `keras.random.SeedGenerator`s whose states start from Python's
# `random` (which `keras.utils.set_random_seed` fixes) and are saved in every
# model file: anyone could recompute each step's masks, and a mask that
# follows its row (not its example) then moves the clipped sum of the
# examples after an added one (issue 28). Inside the private step every
# draw's seed is instead a keyed function of the generator's state, with a
# key held in memory only: the states stay public counters, the draws are
# secret and i.i.d. across rows, and the coupling that gives each example
# its own draw bounds the sensitivity by C. A rollback in the same process
# restores the generator states, so the draw generation of the optimizer
# (which only grows, in memory) is folded in as well: a replayed step draws
# new masks (issue 37).


class _RandomnessKey:
    """The in-memory key of a model's in-step randomness (never a trackable, never saved)."""

    __slots__ = ("variable", "seeded", "generation", "owner")

    def __repr__(self) -> str:
        return "<in-step randomness key: not shown>"

    def __reduce_ex__(self, protocol):
        raise TypeError("The in-step randomness key cannot be pickled or copied.")


def _randomness_key(model) -> _RandomnessKey:
    holder = getattr(model, "_tf_megadp_randomness_key", None)
    if holder is None:
        holder = _RandomnessKey()
        with tf.init_scope():
            # A plain resource variable, created outside any trace or
            # distribution strategy, like the independence check's flags.
            holder.variable = _keras_compat.plain_resource_variable(
                [secrets.randbits(63), secrets.randbits(63)], dtype=tf.int64,
                trainable=False, name="in_step_randomness_key")
            holder.generation = _keras_compat.plain_resource_variable(
                tf.constant(0, tf.int64), trainable=False, name="in_step_draw_generation")
        holder.seeded = False
        holder.owner = None
        object.__setattr__(model, "_tf_megadp_randomness_key", holder)
    return holder


def set_randomness_seed(model, seed: int | None, owner: Any = None) -> None:
    """Keys the model's in-step randomness by `seed` (tests only), or by OS entropy.

    The private step calls it with the `DPOptimizer`'s `seed` and the
    optimizer itself (`owner`): a seeded run (marked "seeded noise: not for
    release") is reproducible, dropout included; an unseeded one draws a
    fresh key from OS entropy whenever the previous key came from a seed or
    served another optimizer, whose draw generations (see
    `set_draw_generation`) are not this one's.
    """
    holder = _randomness_key(model)
    with tf.init_scope():
        if seed is not None:
            holder.variable.assign(tf.constant([seed, 0x5EED], tf.int64))
        elif holder.seeded or (holder.owner is not None and holder.owner() is not owner):
            holder.variable.assign(tf.constant([secrets.randbits(63), secrets.randbits(63)],
                                               tf.int64))
    holder.seeded = seed is not None
    holder.owner = None if owner is None else weakref.ref(owner)


def set_draw_generation(model, generation) -> None:
    """Folds the optimizer's draw `generation` (a tensor) into the model's in-step draws.

    The private step calls it before each micro-batch's forward pass: a
    logical step replayed after a rollback (its seed-generator states
    restored with the weights) is in a new generation, so it draws new
    masks instead of the ones of its first run.
    """
    _randomness_key(model).generation.assign(tf.cast(generation, tf.int64))


def _seed_generators(model) -> list:
    generators = {}
    for layer in _keras_compat.flatten_layers(model):
        for generator in getattr(layer, "_seed_generators", ()):
            generators[id(generator)] = generator
    return list(generators.values())


@contextlib.contextmanager
def secret_seed_draws(model):
    """Every `SeedGenerator` draw of `model` inside the block is keyed by its secret key.

    Active while a strategy traces the model's forward passes. Each draw's
    seed becomes PRF(key, state) (two Philox fold-ins), so the model's
    seed-generator states, saved in its files and derived from public
    seeds, no longer predict any mask. Randomness not drawn through a
    layer's `SeedGenerator` (integer seeds, `tf.random` stateful ops) is
    not covered.
    """
    holder = _randomness_key(model)
    with contextlib.ExitStack() as stack:
        for generator in _seed_generators(model):
            stack.enter_context(_keyed_next(generator, holder.variable, holder.generation))
        yield


@contextlib.contextmanager
def _keyed_next(generator, key, generation):
    previous = generator.__dict__.get("next", _MISSING)
    original = generator.next

    def keyed(ordered=True):
        state = original(ordered)
        folded = tf.random.experimental.stateless_fold_in(
            tf.convert_to_tensor(key), tf.convert_to_tensor(generation))
        folded = tf.random.experimental.stateless_fold_in(folded, tf.cast(state[0], tf.int64))
        folded = tf.random.experimental.stateless_fold_in(folded, tf.cast(state[1], tf.int64))
        return tf.cast(folded, state.dtype)

    generator.next = keyed
    try:
        yield
    finally:
        if previous is _MISSING:
            del generator.__dict__["next"]
        else:
            generator.next = previous


def _is_seed_state(variable) -> bool:
    return variable.name == "seed_generator_state"


def example_state_values(model: keras.Model, batch_size):
    """Non-trainable state for a stateless per-example forward pass.

    Returns (values, per_example): `values` is one tensor per
    `model.non_trainable_variables` entry; `per_example[j]` says whether entry j
    carries a leading [m] axis. Dropout seed states get one distinct seed per
    example, so every example draws its own dropout mask under
    `vectorized_map` exactly as it would in a batched forward pass.
    """
    values, per_example = [], []
    offsets = tf.range(1, batch_size + 1, dtype=tf.int64)
    for variable in model.non_trainable_variables:
        value = tf.convert_to_tensor(variable.value)
        if _is_seed_state(variable):
            state = tf.cast(value, tf.int64)
            seeds = tf.stack(
                [(state[0] + offsets) % (2**32), tf.fill([batch_size], state[1])],
                axis=1,
            )
            values.append(tf.cast(seeds, value.dtype))
            per_example.append(True)
        else:
            values.append(value)
            per_example.append(False)
    return values, per_example


def advance_seed_states(model: keras.Model):
    """Moves every dropout seed forward once per micro-batch."""
    for variable in model.non_trainable_variables:
        if _is_seed_state(variable):
            variable.assign(
                tf.cast(
                    tf.cast(variable.value, tf.int64) + tf.constant([0, 1], tf.int64),
                    variable.dtype,
                )
            )


def stateless_loss(model, trainable_values, state_values, x_i, y_i, w_i):
    """Forward pass and loss of one example (batch axis of 1) without side effects.

    Returns (loss scalar, y_pred_i with its batch axis).
    """
    mapping = list(zip(model.trainable_variables, trainable_values))
    mapping += list(zip(model.non_trainable_variables, state_values))
    with keras.StatelessScope(state_mapping=mapping):
        if _keras_compat.call_has_training_arg(model):
            y_pred_i = model(x_i, training=True)
        else:
            y_pred_i = model(x_i)
        check_one_example_output(model, y_pred_i)
        loss = per_example_loss(model, x_i, y_i, y_pred_i, w_i)
    return loss, y_pred_i


def check_one_example_output(model, y_pred_i):
    """Run on one example (batch axis of 1), the model must predict for one example.

    A model whose output has another leading size here depends on the size of
    the batch (a constant-size permutation or gather over axis 0): its output
    for an example is defined by the other examples of the batch.
    """
    for leaf in tf.nest.flatten(y_pred_i):
        if tf.is_tensor(leaf) and leaf.shape.rank and leaf.shape[0] not in (1, None):
            raise PrivacyConfigurationError(
                f"Run on one example, model '{model.name}' returns a prediction of "
                f"shape {leaf.shape} instead of (1, ...): its output depends on the "
                "size of the batch (e.g. a fixed-size permutation, gather or reshape "
                "over axis 0), so examples are mixed and no per-example gradient "
                "exists. Remove the operation over the batch axis."
            )


def add_batch_axis(structure):
    return tf.nest.map_structure(
        lambda t: None if t is None else tf.expand_dims(t, 0), structure
    )


def dense_gradient(gradient):
    """Per-example gradients must be dense tensors to be normed and summed."""
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.convert_to_tensor(gradient)
    return gradient


def is_seed_state(variable) -> bool:
    """Whether `variable` is the state of a Keras `SeedGenerator` (dropout, noise)."""
    return _is_seed_state(variable)


def draws_random_numbers(layer) -> bool:
    """Whether `layer` or one of its sublayers owns a `SeedGenerator`."""
    return any(_is_seed_state(v) for v in layer.non_trainable_variables)


_MISSING = object()


@contextlib.contextmanager
def override_call(layer, call: Callable):
    """Replaces `layer.call` on the instance for the duration of the block.

    Keras's `Layer.__call__` looks `call` up on the instance, so this
    intercepts one layer without touching its class. Whatever instance
    override was there before (another interception) is restored afterwards,
    so interceptions nest in any order.
    """
    previous = layer.__dict__.get("call", _MISSING)
    object.__setattr__(layer, "call", call)
    try:
        yield
    finally:
        if previous is _MISSING:
            del layer.__dict__["call"]
        else:
            object.__setattr__(layer, "call", previous)


# Normalization layers whose `axis` argument may name the micro-batch axis.
_AXIS_NORMALIZATIONS = (
    keras.layers.LayerNormalization,
    keras.layers.RMSNormalization,
    keras.layers.UnitNormalization,
)


# Augmentation layers that mix pairs of examples by design.
_MIXING_AUGMENTATIONS = tuple(
    getattr(keras.layers, name) for name in ("MixUp", "CutMix") if hasattr(keras.layers, name))


def refuse_layers_without_xla(model: keras.Model):
    """Strategies compiled with XLA refuse layers that declare they cannot be.

    Otherwise the step fails inside tf2xla with an op name and no layer.
    Recurrent layers are exempt: Keras marks them supports_jit=False once
    they have run on cuDNN (a GPU), and `example_axis_guards` unrolls them,
    which takes them off cuDNN.
    """
    layers = [f"'{layer.name}' ({type(layer).__name__})"
              for layer in _keras_compat.flatten_layers(model)
              if getattr(layer, "supports_jit", True) is False
              and not isinstance(layer, keras.layers.RNN)]
    if layers:
        raise PrivacyConfigurationError(
            f"Layer(s) {', '.join(layers)} declare supports_jit=False, but the "
            "per-example clipping step is compiled with XLA. Remove them from the "
            "trained model (run them in the data pipeline instead)."
        )


def _normalized_axes(axis, rank):
    axes = axis if isinstance(axis, (list, tuple)) else [axis]
    return sorted(int(a) % rank for a in axes)


def _guard_normalization(layer):
    original = layer.call

    def guarded(inputs, *args, **kwargs):
        rank = getattr(inputs, "shape", tf.TensorShape(None)).rank
        if rank and 0 in _normalized_axes(layer.axis, rank):
            raise PrivacyConfigurationError(
                f"Layer '{layer.name}' ({type(layer).__name__}) normalizes over "
                f"axis {layer.axis!r} of a rank-{rank} input, which includes axis 0, the "
                "micro-batch axis: every example's output would depend on the "
                "others, so no per-example gradient exists. Normalize over feature "
                "axes only (e.g. axis=-1)."
            )
        return original(inputs, *args, **kwargs)

    return override_call(layer, guarded)


def _guard_rnn(layer):
    original = layer.call

    def guarded(sequences, *args, **kwargs):
        # Keras's RNN loop is a symbolic while_loop over TensorArrays when
        # `unroll=False`; `vectorized_map` cannot vectorize it (XLA rejects
        # the variant tensors, or the loop's shapes), so every per-example
        # pass runs the same recurrence unrolled: the same arithmetic.
        steps = sequences.shape[1] if sequences.shape.rank and sequences.shape.rank > 1 else None
        if steps is None:
            raise PrivacyConfigurationError(
                f"Recurrent layer '{layer.name}' ({type(layer).__name__}) is called on "
                f"sequences of unknown length (shape {sequences.shape}). Per-example "
                "clipping unrolls recurrent layers, which needs a static number of "
                "steps: give the model's Input a fixed sequence length, e.g. "
                "keras.Input((T, features)), and pad sequences to it."
            )
        with _swapped_attribute(layer, "unroll", True):
            return original(sequences, *args, **kwargs)

    return override_call(layer, guarded)


@contextlib.contextmanager
def _swapped_attribute(obj, name, value):
    before = getattr(obj, name)
    object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        object.__setattr__(obj, name, before)


@contextlib.contextmanager
def example_axis_guards(model: keras.Model):
    """Layers whose configuration ties examples together are refused; RNNs are unrolled.

    Active while a strategy traces its per-example computation:

    - `LayerNormalization`, `RMSNormalization` and `UnitNormalization` over an
      axis set that includes axis 0 mix examples: refused with the layer's
      name (instead of the reshape error a batch of one example gave).
    - Recurrent layers (`keras.layers.RNN` and its subclasses LSTM, GRU,
      SimpleRNN, also inside `Bidirectional`) run unrolled, so that
      `vectorized_map` can vectorize them; `stateful=True` is refused, since
      it carries one example's final state into another example of the next
      batch.

    Raises:
        PrivacyConfigurationError: a stateful recurrent layer (at once), or,
            when traced, a normalization over the batch axis or a recurrent
            layer on sequences of unknown length.
    """
    layers = list(_keras_compat.flatten_layers(model))
    mixing = [f"'{layer.name}' ({type(layer).__name__})" for layer in layers
              if isinstance(layer, _MIXING_AUGMENTATIONS)]
    if mixing:
        raise PrivacyConfigurationError(
            f"Layer(s) {', '.join(mixing)} blend each example with another example "
            "of the batch (MixUp/CutMix): one example's data then reaches another "
            "example's gradient, and the per-example sensitivity bound of DP-SGD "
            "fails. Remove them; under DP-SGD, augment each example on its own "
            "(e.g. random crops or flips)."
        )
    stateful = [f"'{layer.name}'" for layer in layers
                if isinstance(layer, keras.layers.RNN) and layer.stateful]
    if stateful:
        raise PrivacyConfigurationError(
            f"Recurrent layer(s) {', '.join(stateful)} are stateful: the final state of "
            "row i of one batch becomes the initial state of row i of the next, so one "
            "example's data reaches another example's gradient and the per-example "
            "sensitivity bound fails. Use stateful=False (the default)."
        )
    with contextlib.ExitStack() as stack:
        for layer in layers:
            if isinstance(layer, _AXIS_NORMALIZATIONS):
                stack.enter_context(_guard_normalization(layer))
            elif isinstance(layer, keras.layers.RNN):
                stack.enter_context(_guard_rnn(layer))
        yield
