"""Float16 compute under DP: Keras's `LossScaleOptimizer` replaced by a fixed loss scale.

Under the `mixed_float16` policy `model.compile` wraps the optimizer in a
`keras.optimizers.LossScaleOptimizer`, whose scale halves after any step
with a non-finite gradient and doubles after a run of finite ones. Under
DP-SGD that decision would be taken on the exact, un-noised question "did
any example of this step overflow", so one example could move the scale,
and with it every later update: it is not private. The private step scales
the loss itself instead, example by example, with the `DPOptimizer`'s
fixed `loss_scale` (`tf_megadp.clipping.base.scaled_loss`,
`unscaled_gradient`): an example whose scaled gradient overflows is
non-finite and contributes zero, which is that example's own outcome, so
the sensitivity stays C. `make_private` (and the private `compile`) unwrap
the Keras wrapper here; its `initial_scale` becomes the `DPOptimizer`'s
`loss_scale` when that was not given.
"""

from __future__ import annotations

import keras

from tf_megadp import _keras_compat
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.optimizer import DPOptimizer

__all__ = ["unwrap_loss_scale_optimizer"]

# What `model.compile` gives the wrapper it adds itself (Keras 3.x default).
_KERAS_DEFAULT_SCALE = 2.0**15


def unwrap_loss_scale_optimizer(model: keras.Model) -> None:
    """Replaces a `LossScaleOptimizer` around the model's `DPOptimizer` by the `DPOptimizer`.

    The `DPOptimizer` then scales each example's loss by its fixed
    `loss_scale`: the one it was given, else the wrapper's `initial_scale`.
    The wrapper's dynamic scaling is never used (see the module docstring).
    The model's saved compile config is marked so that `load_model` does
    not wrap the `DPOptimizer` again.

    Args:
        model: a compiled (or not yet compiled) Keras model.

    Raises:
        PrivacyConfigurationError: the wrapper's `initial_scale` is neither
            Keras's default nor the `DPOptimizer`'s `loss_scale` (two scales
            were asked for), or the `DPOptimizer` already took steps with
            another scale.
    """
    wrapper = getattr(model, "optimizer", None)
    if isinstance(wrapper, keras.optimizers.LossScaleOptimizer) and isinstance(
            wrapper.inner_optimizer, DPOptimizer):
        optimizer = wrapper.inner_optimizer
        scale = float(wrapper.initial_scale)
        if optimizer.loss_scale is None:
            optimizer.adopt_loss_scale(scale)
        elif scale not in (optimizer.loss_scale, _KERAS_DEFAULT_SCALE):
            raise PrivacyConfigurationError(
                f"The LossScaleOptimizer around the DPOptimizer asks for "
                f"initial_scale={scale:g}, the DPOptimizer for "
                f"loss_scale={optimizer.loss_scale:g}. Private training scales the loss by "
                "one fixed value: pass it once, as DPOptimizer(..., loss_scale=...), and "
                "compile with the DPOptimizer itself."
            )
        model.optimizer = optimizer
    if isinstance(getattr(model, "optimizer", None), DPOptimizer):
        # `load_model` then compiles the saved DPOptimizer without a wrapper,
        # so that its state (the ledger) loads.
        _keras_compat.compile_without_loss_scaling_on_load(model)
