"""Private training: the micro-step, `make_private` (fit, evaluate), `PrivateStep`, `PrivacyReport`.

* `step`: the private micro-step, the one implementation that `fit` and a
  custom loop run (clip every example, hand the clipped sum to the
  `DPOptimizer`);
* `make_private`: `make_private`, `make_private_with_epsilon`,
  `extend_schedule`, and the private `fit`, `evaluate`, `compile`, `save`
  and `load_weights` they install;
* `loss_scaling`: `mixed_float16`, Keras's `LossScaleOptimizer` replaced by
  the `DPOptimizer`'s fixed loss scale;
* `custom_loop`: `PrivateStep`, the step of a custom training loop;
* `privacy_report`: `PrivacyReport`, a custom loop's epsilon and budget.
"""

from tf_megadp.run.state import is_private
from tf_megadp.training.custom_loop import PrivateStep
from tf_megadp.training.make_private import (
    extend_schedule,
    make_private,
    make_private_with_epsilon,
)
from tf_megadp.training.privacy_report import PrivacyReport

__all__ = ["PrivacyReport", "PrivateStep", "extend_schedule", "is_private", "make_private",
           "make_private_with_epsilon"]
