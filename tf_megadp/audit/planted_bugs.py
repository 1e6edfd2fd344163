"""Deliberately broken DP steps, to show that a one-run audit can fail a run.

NEVER train anything you release with these. Each reproduces a bug that
real DP-SGD code has had, and each keeps reporting the privacy of the
correct step (the ledger records what the broken step claims), which is
what makes such bugs dangerous: the accountant's epsilon looks fine. The
tests and `benchmarks/one_run_audit_study.py` train with them and check
that the one-run lower bound then exceeds the claimed epsilon.

* `HalvedNoiseDPOptimizer`: adds noise of sigma / 2 while the ledger
  records sigma (e.g. a standard deviation computed as sigma * C / 2 from a
  misread "sensitivity 2C" formula).
* `UnclippedFirstExample`: the first example of every micro-batch keeps
  its full gradient (an off-by-one in the clip factors).
* `DoubleCountingDPOptimizer`: every micro-batch's clipped sum enters the
  noisy sum twice (as when two replicas read the same shard and the
  all-reduce adds both): each example counts twice in one noisy sum.
"""

from __future__ import annotations

import tensorflow as tf

from tf_megadp.clipping import base
from tf_megadp.clipping.vectorized import VectorizedClipping
from tf_megadp.optimizer import DPOptimizer
from tf_megadp.optimizer.accumulators import AccumulationStage
from tf_megadp.optimizer.noise import NoiseStage

__all__ = ["DoubleCountingDPOptimizer", "HalvedNoiseDPOptimizer", "UnclippedFirstExample", "PLANTED_BUGS"]


class _HalvedNoiseStage(NoiseStage):
    def noisy_sums(self, sums, connected, step, generation, stddev) -> list:
        return super().noisy_sums(sums, connected, step, generation, stddev * 0.5)


class _DoubleCountingStage(AccumulationStage):
    def add(self, gradient_sum, *args, **kwargs) -> None:
        doubled = [None if g is None else 2.0 * g for g in gradient_sum]
        super().add(doubled, *args, **kwargs)


def _with_broken_stage(optimizer: DPOptimizer, name: str, stage) -> None:
    # The stages are frozen once DPOptimizer.__init__ returns (a real user
    # cannot swap one); a planted bug goes around the freeze on purpose.
    object.__setattr__(optimizer, name, stage)


class HalvedNoiseDPOptimizer(DPOptimizer):
    """BROKEN: noise of sigma / 2, ledger of sigma. For audit tests only."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _with_broken_stage(self, "noise_stage", _HalvedNoiseStage(
            self.settings.noise_strategy(), self.settings.seed))


class DoubleCountingDPOptimizer(DPOptimizer):
    """BROKEN: every clipped sum is accumulated twice. For audit tests only."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _with_broken_stage(self, "accumulation_stage", _DoubleCountingStage(
            counts_unclipped=self.settings.adaptive_clipping is not None))


class UnclippedFirstExample(base.ClippingStrategy):
    """BROKEN: example 0 of every micro-batch is not clipped. For audit tests only.

    Otherwise exactly `VectorizedClipping` (same per-example gradients,
    norms and clip factors for the other examples).
    """

    name = "unclipped-first-example"

    def __init__(self):
        self._vectorized = VectorizedClipping(jit_compile=False)

    def clip_and_sum(self, model, x, y, sample_weight, l2_norm_clip):
        gradients, losses, y_pred = self._vectorized.per_example_gradients(
            model, x, y, sample_weight)
        batch_size = tf.shape(losses)[0]
        present = [g for g in gradients if g is not None]
        norms = tf.sqrt(tf.add_n([
            tf.reduce_sum(tf.reshape(tf.square(g), [batch_size, -1]), axis=1) for g in present]))
        is_real = base.example_weights_present(sample_weight, batch_size)
        factors, nonfinite = base.clip_factors(norms, l2_norm_clip, is_real)
        # The bug: the first example keeps factor 1 (when it is a real example).
        first = tf.one_hot(0, batch_size, dtype=factors.dtype) * is_real
        factors = factors * (1.0 - first) + first
        gradient_sum = [None if g is None else tf.tensordot(factors, g, axes=1) for g in gradients]
        return base.clipped_batch(gradient_sum, losses, y_pred, norms, is_real, nonfinite)


# name -> (what it breaks, optimizer class, clipping strategy factory or None)
PLANTED_BUGS = {
    "halved-noise": ("noise multiplier silently halved", HalvedNoiseDPOptimizer, None),
    "unclipped-example": ("the clip not applied to one example per micro-batch", DPOptimizer,
                          UnclippedFirstExample),
    "double-counted": ("every example twice in one noisy sum", DoubleCountingDPOptimizer, None),
}
