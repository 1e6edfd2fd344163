"""Every use of private Keras, keras-hub and TensorFlow API in tf_megadp, behind one door.

tf_megadp uses public API wherever it exists (`keras.StatelessScope`,
`keras.saving.serialize_keras_object`, `model.trainable_variables`, ...).
What follows has no public equivalent; each entry says why, or what public
API would replace it, so that a Keras or TensorFlow upgrade that moves one
breaks here, in one file, and `tests/test_jobs_layering.py` checks that no
other module of the library reaches into `keras.src`, `tensorflow.python`,
`tf.__internal__` or a private attribute this file names.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import keras
import tensorflow as tf
# No public module exposes XLA's own ops (`dynamic_update_slice` with XLA's
# semantics); the pfor converter below must emit exactly that op.
from tensorflow.compiler.tf2xla.python import xla  # noqa: F401  (re-exported)
# Keras keeps an op's mask on the tensor; `get_keras_mask`/`set_keras_mask`
# are what its layers call, and no public API reads or sets it.
from keras.src.backend.common import masking as _masking
# `unscale_loss_for_distribution` undoes the loss scaling Keras applies under
# a distribution strategy; `Model.compute_loss` scales, nothing public unscales.
from keras.src.losses import loss as _keras_loss
# See `plain_resource_variable`.
from tensorflow.python.ops import resource_variable_ops as _resource_variable_ops
# pfor's registry of op converters is not public API; it is the only way to
# teach `vectorized_map` an op. Registration is checked at import, so a
# TensorFlow that moves it fails loudly here, not silently in a step.
from tensorflow.python.ops.parallel_for import pfor  # noqa: F401  (re-exported)

__all__ = [
    "call_has_training_arg",
    "checkpoint_calling_before_write",
    "child_layers",
    "compiled_loss_and_metrics",
    "concrete_functions",
    "flatten_layers",
    "get_keras_mask",
    "is_keras_own_call",
    "keras_hub_bias",
    "keras_hub_pretokenize",
    "lora_base_kernel",
    "loss_tracker",
    "model_strategy",
    "observe_weights_files",
    "optimizer_learning_rate",
    "optimizer_own_variables",
    "optimizer_strategy",
    "optimizer_trainable_variables",
    "own_trainable_variables",
    "pfor",
    "pfor_converter_registered",
    "plain_resource_variable",
    "replace_symbolic_build",
    "set_keras_mask",
    "strategy_supports_no_merge_call",
    "symbolic_build",
    "unscale_loss_for_distribution",
    "xla",
]


# -- Layers and models ------------------------------------------------------------


def flatten_layers(layer: keras.layers.Layer, *, include_self: bool = True,
                   recursive: bool = True) -> Iterator[keras.layers.Layer]:
    """Every layer inside `layer`, nested ones included.

    Public `Model.layers` lists direct children only, and a subclassed
    layer's sublayers are not listed at all; Keras itself walks
    `_flatten_layers`, the one traversal that sees every tracked layer.
    """
    return layer._flatten_layers(include_self=include_self, recursive=recursive)


def child_layers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The layers `layer` tracks directly (no public list for a plain Layer)."""
    return layer._layers


def own_trainable_variables(layer: keras.layers.Layer) -> list[keras.Variable]:
    """The trainable variables `layer` creates itself, without its sublayers'.

    Public `trainable_variables` includes every sublayer's.
    """
    return layer._trainable_variables


def lora_base_kernel(layer: keras.layers.Layer) -> keras.Variable:
    """W of a Dense or EinsumDense with LoRA enabled (its public `kernel` is W + s A B)."""
    return layer._kernel


def call_has_training_arg(model: keras.layers.Layer) -> bool:
    """Whether `call` takes `training` (Keras inspects the signature once and caches it)."""
    return model._call_has_training_arg


def is_keras_own_call(layer: keras.layers.Layer) -> bool:
    """Whether `layer`'s `call` is Keras's own implementation (not a user override).

    Reads the module of the implementation, which lives under `keras.src`.
    """
    return type(layer).call.__module__.startswith("keras.src.layers.")


def get_keras_mask(tensor: Any) -> Any:
    return _masking.get_keras_mask(tensor)


def set_keras_mask(tensor: Any, mask: Any) -> None:
    _masking.set_keras_mask(tensor, mask)


def unscale_loss_for_distribution(loss: Any) -> Any:
    return _keras_loss.unscale_loss_for_distribution(loss)


def loss_tracker(model: keras.Model) -> keras.metrics.Mean:
    """The "loss" metric `fit` reports; a custom `train_step` must update it (no public handle)."""
    return model._loss_tracker


def compiled_loss_and_metrics(model: keras.Model) -> tuple[Any, Any]:
    """(compiled loss, compiled metrics) containers, to see whether they are built.

    `model.metrics` builds nothing and says nothing about the containers.
    """
    return model._compile_loss, model._compile_metrics


def compile_without_loss_scaling_on_load(model: keras.Model) -> None:
    """Makes the compile config `load_model` replays pass `auto_scale_loss=False`.

    Keras saves `compile`'s arguments but not `auto_scale_loss`, so loading
    a `mixed_float16` model wraps its saved optimizer in a new
    `LossScaleOptimizer`, under which the saved optimizer state does not load.
    """
    config = getattr(model, "_compile_config", None)
    if config is not None:
        config.config["auto_scale_loss"] = False


def model_strategy(model: keras.Model) -> tf.distribute.Strategy | None:
    """The strategy `model` was created under, or None.

    Public `model.distribute_strategy` falls back to the current default
    strategy, which hides whether the model was built under one.
    """
    return getattr(model, "_distribute_strategy", None)


def symbolic_build(model: keras.Model, data_batch: Any) -> None:
    """Builds the model's compiled metrics and loss from `data_batch`'s specs.

    `fit` does this from its first batch; a custom loop that never calls
    `fit` has no public way to.
    """
    model._symbolic_build(data_batch=data_batch)


def replace_symbolic_build(model: keras.Model, build: Callable[..., None]) -> None:
    """Makes `fit` build the compiled metrics with `build(iterator=None, data_batch=None)`.

    `fit` calls `_maybe_symbolic_build` with the global batch; under a
    strategy the metrics need the per-replica one. No public hook exists.
    """
    model._maybe_symbolic_build = build


# -- Optimizers and strategies ---------------------------------------------------


def optimizer_strategy(optimizer: keras.optimizers.Optimizer) -> tf.distribute.Strategy:
    """The strategy the optimizer's variables were created under (Keras keeps it privately)."""
    return optimizer._distribution_strategy


def optimizer_trainable_variables(optimizer: keras.optimizers.Optimizer) -> list[keras.Variable]:
    """The model variables an optimizer was built for (no public list)."""
    return optimizer._trainable_variables


def optimizer_own_variables(optimizer: keras.optimizers.Optimizer) -> list[keras.Variable]:
    """The variables an optimizer created itself (public `variables` may be overridden)."""
    return optimizer._variables


def optimizer_learning_rate(optimizer: keras.optimizers.Optimizer) -> Any:
    """The learning rate as set: a value, a variable or a schedule.

    Public `learning_rate` evaluates a schedule at the current iteration.
    """
    return optimizer._learning_rate


def strategy_supports_no_merge_call() -> bool:
    """Whether the current strategy lets a replica update variables without `merge_call`.

    Keras's own optimizers branch on this; TensorFlow exports it only under
    `tf.__internal__`.
    """
    return tf.__internal__.distribute.strategy_supports_no_merge_call()


def plain_resource_variable(initial_value: Any, **kwargs: Any) -> tf.Variable:
    """A resource variable created outside every variable creator scope.

    `tf.Variable` goes through the distribution strategy's creator (a
    mirrored or replica-local variable) and Keras's tracking; bookkeeping
    that must stay one plain, never-saved variable per process has no
    public constructor.
    """
    return _resource_variable_ops.ResourceVariable(initial_value, **kwargs)


class _CheckpointCallingBeforeWrite(tf.train.Checkpoint):
    """A `tf.train.Checkpoint` that calls a function before each write (see below)."""

    def __init__(self, before_write: Callable[[], None], **trackables: Any):
        super().__init__(**trackables)
        self._tf_megadp_before_write = before_write

    # `write`, `save` and `tf.train.CheckpointManager.save` all write through it.
    def _write(self, file_prefix, options=None):
        self._tf_megadp_before_write()
        return super()._write(file_prefix, options=options)


def checkpoint_calling_before_write(before_write: Callable[[], None],
                                    **trackables: Any) -> tf.train.Checkpoint:
    """A `tf.train.Checkpoint` of `trackables` that calls `before_write()` before each write.

    `write`, `save` and `tf.train.CheckpointManager.save` each write through
    the private `Checkpoint._write`: overriding it is the one hook every way
    of writing passes (a custom loop's `PrivateStep` records its applied
    steps there, so that the file's ledger is complete). No public hook
    exists.
    """
    return _CheckpointCallingBeforeWrite(before_write, **trackables)


def concrete_functions(function: Any) -> list:
    """Every concrete function a `tf.function` has traced so far.

    `get_concrete_function` traces for given arguments; only the private
    `_list_all_concrete_functions` lists the traces that already exist
    (those made while a caller's step was traced included).
    """
    return function._list_all_concrete_functions()


def pfor_converter_registered(op_type: str) -> bool:
    """Whether pfor already converts `op_type` (its converter registry is private)."""
    return op_type in pfor._pfor_converter_registry


# -- Weights files ----------------------------------------------------------------


def observe_weights_files(on_save: Callable[[Any, Any], None],
                          on_load: Callable[[Any, Any], None]) -> None:
    """Calls `on_save(saveable, h5_file)` before Keras writes the weights of `saveable`,
    and `on_load(saveable, h5_file)` before it reads them into `saveable`.

    `h5_file` is the open HDF5 file of the weights (None for Keras's npz
    format). Every way Keras writes or reads weights (`Model.save`,
    `save_weights`, `keras.models.load_model`, `load_weights`, and keras-hub's
    presets through them) walks the object's state with
    `keras.src.saving.saving_lib._save_state` / `_load_state`, whose outermost
    call has the empty inner path; no public hook exists around them, so the
    two module functions are wrapped (once; they call themselves through the
    module, which the wrappers pass through).
    """
    from keras.src.saving import saving_lib

    if getattr(saving_lib._save_state, "_tf_megadp_observed", False):
        return
    original_save, original_load = saving_lib._save_state, saving_lib._load_state

    def save_state(saveable, weights_store, assets_store, inner_path, *args, **kwargs):
        if not inner_path and weights_store is not None:
            on_save(saveable, getattr(weights_store, "h5_file", None))
        return original_save(saveable, weights_store, assets_store, inner_path,
                             *args, **kwargs)

    def load_state(saveable, weights_store, assets_store, inner_path, *args, **kwargs):
        if not inner_path and weights_store is not None:
            on_load(saveable, getattr(weights_store, "h5_file", None))
        return original_load(saveable, weights_store, assets_store, inner_path,
                             *args, **kwargs)

    save_state._tf_megadp_observed = load_state._tf_megadp_observed = True
    saving_lib._save_state, saving_lib._load_state = save_state, load_state


# -- keras-hub (imported on use: the library never loads keras-hub itself) ---------


def keras_hub_bias(layer: keras.layers.Layer) -> keras.Variable:
    """The bias variable of a keras-hub layer that keeps it privately (no public attribute)."""
    return layer._bias


def keras_hub_pretokenize(text: Any, lowercase: bool) -> Any:
    """The exact split `keras_hub.tokenizers.WordPieceTokenizer` applies before word pieces.

    Learning a vocabulary on any other split would learn pieces the
    tokenizer never looks for; keras-hub exports the tokenizer, not its split.
    """
    from keras_hub.src.tokenizers.word_piece_tokenizer import pretokenize

    return pretokenize(text, lowercase, False, True, True)
