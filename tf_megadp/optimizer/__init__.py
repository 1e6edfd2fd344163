"""`DPOptimizer`, whole: accumulate clipped gradients, add Gaussian noise once per logical step.

The optimizer never sees per-example gradients: the private train step (see
`tf_megadp.make_private`) clips them and hands over each micro-batch's clipped
sum. This package owns what happens next: the accumulators, the micro-step
counter, the secret noise key, the single noisy update per logical step, and
the privacy ledger that travels with every checkpoint.

What is saved and what is not is a privacy decision, not a convenience:

* saved (`model.save`, `save_weights`, `ModelCheckpoint`,
  `keras.callbacks.BackupAndRestore` in a private `fit`,
  `tf_megadp.save_training_state`): the inner optimizer's state, the
  logical-step counter, the privacy ledger, the record of the steps the
  compiled step applied and, with adaptive clipping, the clip norm C (a
  function of noisy releases only);
* never saved, held only in memory: the noise key (whoever holds it can
  regenerate the noise and subtract it from the released update) and the
  mid-step state (the accumulators hold the exact, un-noised clipped sum,
  and adaptive clipping's the exact count of unclipped examples).
  A restored optimizer therefore resumes at a logical-step boundary with a
  fresh key (a new process) or, restored in the same process, in a new draw
  generation for every step it repeats (`tf_megadp.optimizer.accumulators`): no noise
  is drawn twice. The discarded partial step was never released, so it cost
  no privacy, and fresh noise is as private as the old.

Privacy spent is a property of the trained weights, not of one optimizer
object: a `DPOptimizer` marks the model variables it trains (or whose
saved state it loads) as covered by its ledger, and a new `DPOptimizer`
built for variables that carry another one's ledger continues that ledger
(see `DPOptimizer.build`), whatever the order of `load_model`, `compile`,
`make_private` and `load_weights` that led there.

The modules, one concept each:

* `settings`: `DPSettings`, the privacy settings, validated once and frozen;
* `memory`: the variables no file sees, and the in-memory state each stage keeps;
* `accumulators`: the accumulation stage (the clipped sums of a logical step);
* `noise`: the noise stage (the secret key, the draw generation, and the
  run's noise mechanism's stream, looked up by the mechanism);
* `ledger`: the ledger stage, its variables declared, read and written there only;
* `dp_optimizer`: `DPOptimizer`, the Keras optimizer: a composition of the
  three stages, its logical step the chain accumulate -> noise -> inner
  apply -> ledger.
"""

from __future__ import annotations

from tf_megadp.optimizer.memory import accumulation_dtype
from tf_megadp.optimizer.dp_optimizer import PRIVATE_STEP_TOKEN, DPOptimizer
from tf_megadp.optimizer.ledger import (
    APPLIED_STEP_COLUMNS,
    LEDGER_CAPACITY,
    ledger_owner,
    read_ledger,
    read_weights_origin,
    write_ledger,
    write_weights_origin,
)
from tf_megadp.optimizer.settings import SETTING_NAMES, DPSettings

__all__ = ["APPLIED_STEP_COLUMNS", "DPOptimizer", "DPSettings", "LEDGER_CAPACITY",
           "PRIVATE_STEP_TOKEN", "SETTING_NAMES", "accumulation_dtype", "ledger_owner",
           "read_ledger", "read_weights_origin", "write_ledger", "write_weights_origin"]
