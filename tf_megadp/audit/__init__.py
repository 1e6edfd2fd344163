"""Privacy auditing: what an attacker can actually learn from a trained model.

* `canaries`: secret-sharer canaries and their exposure.
* `membership`: loss-based membership inference metrics.
* `empirical`: Clopper-Pearson lower bounds on epsilon from attack guesses.
* `scoring`: log-likelihoods and losses from a masked LM.
* `runner.run_audit`: the whole audit of one model, as a dict of numbers.
* `callback.AuditCallback`: the audit at epoch ends, written into `logs`.
* `job.audit_pretraining_run`: the audit of a `tf-megadp pretrain` run
  (`tf-megadp audit RUN_DIR`).
"""

from tf_megadp.audit.callback import AuditCallback
from tf_megadp.audit.canaries import (
    Canary,
    CanaryFormat,
    canary_exposure,
    exposure,
    insert_canaries,
    load_canaries,
    make_canaries,
    save_canaries,
)
from tf_megadp.audit.empirical import (
    clopper_pearson,
    epsilon_lower_bound,
    epsilon_lower_bound_from_scores,
)
from tf_megadp.audit.job import audit_pretraining_run
from tf_megadp.audit.membership import membership_metrics, membership_scores
from tf_megadp.audit.runner import run_audit
from tf_megadp.audit.scoring import MaskedLMScorer
