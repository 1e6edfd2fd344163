"""Privacy auditing: what an attacker can actually learn from a trained model.

* `canaries`: secret-sharer canaries and their exposure.
* `membership`: loss-based membership inference metrics.
* `empirical`: Clopper-Pearson lower bounds on epsilon from attack guesses.
* `one_run`: the one-run lower bound (Steinke, Nasr, Jagielski 2023) and the
  auditor's secret coins.
* `white_box`: Dirac gradient canaries injected into the DP step and scored
  from every model update (`GradientCanaryAudit`).
* `input_canaries`: canary examples in the training data, scored black-box
  from the finished model or white-box from the updates (`InputCanaries`).
* `planted_bugs`: deliberately broken DP steps that an audit must catch.
* `audit_run.one_run_audit_run`: a tiny DP-SGD run audited in one go
  (`tf-megadp audit --one-run`).
* `scoring`: log-likelihoods and losses from a masked LM.
* `runner.run_audit`: the whole audit of one model, as a dict of numbers.
* `callback.AuditCallback`: the audit at epoch ends, written into `logs`.

The audit of a `tf-megadp pretrain` run (`tf-megadp audit RUN_DIR`) is the
job's own: `tf_megadp.jobs.bert.audit.audit_pretraining_run`.
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
from tf_megadp.audit.input_canaries import (
    InputCanaries,
    dirac_canaries,
    dirac_canary_signal,
    example_losses,
    masked_lm_canary_scores,
)
from tf_megadp.audit.membership import membership_metrics, membership_scores
from tf_megadp.audit.one_run import (
    CanaryCoins,
    OneRunResult,
    default_guesses,
    guesses_from_scores,
    one_run_audit,
    one_run_epsilon_lower_bound,
    one_run_p_value,
)
from tf_megadp.audit.runner import run_audit
from tf_megadp.audit.scoring import MaskedLMScorer
from tf_megadp.audit.white_box import (
    CanaryClipping,
    CanaryCoordinates,
    GradientCanaryAudit,
    white_box_scores,
)
