"""`AutoClipping`: ghost norms where a rule exists, exact per-example gradients elsewhere."""

from __future__ import annotations

import warnings
import weakref

from tf_megadp.clipping import independence
from tf_megadp.clipping.ghost import GhostClipping
from tf_megadp.clipping.vectorized import VectorizedClipping
from tf_megadp.errors import GhostClippingUnsupportedError

__all__ = ["AutoClipping"]


class AutoClipping(GhostClipping):
    """The `clipping="auto"` strategy: ghost norms where possible, exact elsewhere.

    Layers with a ghost rule get ghost norms; every other layer gets exact
    per-example gradients for its own variables only (`fallback="any"`). A
    model that ghost clipping cannot attribute at all (weight regularizers,
    `add_loss`, a weight read outside its layer, a layer applied off the
    example axis: `GhostClippingUnsupportedError`) is clipped with
    `VectorizedClipping` instead, with a warning naming the reason. Both
    give each example's exact clipped gradient; only time and memory differ.
    Errors that mean examples are mixed are raised, never worked around.

    Example:
    ```python
    optimizer = tf_megadp.DPOptimizer(keras.optimizers.Adam(1e-3), l2_norm_clip=1.0,
                                      noise_multiplier=1.1, clipping="auto")
    ```
    """

    name = "auto"

    # Args: as `GhostClipping`'s `jit_compile` and `recheck_probability`.
    def __init__(self, jit_compile: bool = True,
                 recheck_probability: float = independence.RECHECK_PROBABILITY):
        super().__init__(fallback="any", jit_compile=jit_compile,
                         recheck_probability=recheck_probability)
        self._vectorized = weakref.WeakKeyDictionary()

    def clip_and_sum(self, model, x, y, sample_weight, l2_norm_clip,
                     automatic_stability=None, examples_per_unit=1, loss_scale=None):
        """See `GhostClipping.clip_and_sum`; falls back per model as described above."""
        vectorized = self._vectorized.get(model)
        if vectorized is None:
            try:
                return super().clip_and_sum(model, x, y, sample_weight, l2_norm_clip,
                                            automatic_stability, examples_per_unit, loss_scale)
            except GhostClippingUnsupportedError as error:
                warnings.warn(
                    f"clipping='auto': ghost norms cannot attribute part of model "
                    f"'{model.name}' to examples ({error}). This model is clipped with "
                    "exact per-example gradients (clipping='vectorized') instead: the "
                    "same clipped sums, more time and memory.",
                    stacklevel=2,
                )
                vectorized = VectorizedClipping(jit_compile=self.jit_compile)
                self._vectorized[model] = vectorized
        return vectorized.clip_and_sum(model, x, y, sample_weight, l2_norm_clip,
                                       automatic_stability, examples_per_unit, loss_scale)
