"""Privacy accounting: what a DP-SGD run spent, as (epsilon, delta).

Every logical step of DP-SGD is one subsampled Gaussian mechanism: each of the
N training examples joins the step's batch with probability q_t = B_t / N, the
clipped gradients are summed and Gaussian noise of standard deviation
sigma_t * C is added once. The guarantee covers one training example (one
sequence) under add/remove-one adjacency.

This package turns a run into `dp_accounting` events and asks an accountant for
epsilon at a given delta. A run is described by a `PrivacyLedger`: a list of
phases of identical logical steps (steps, q, sigma, truncation, sampling kind),
the same numbers the `DPOptimizer` stores in its `privacy_ledger` variable, so
a checkpoint carries what the run has spent.

Sampling kinds:

* ``"poisson"``: every example joins every step independently with
  probability q. If the sampler truncates a step at a static maximum batch
  (`max_batch_size > 0`), the step is a `TruncatedSubsampledGaussianDpEvent`.
  When truncation is rare, a coupling bound accounts it at the cost of the
  untruncated step (and works with RDP); otherwise dp_accounting's exact PLD
  of the truncated mechanism is used (see `engines.TruncationAwareAccountant`).
* ``"shuffle"``: fixed-size batches from a shuffled dataset. No accountant in
  dp_accounting covers them; they are reported *as if* Poisson-sampled, with a
  warning, because that understates the real privacy loss (Chua et al., 2024,
  "How Private are DP-SGD Implementations?"). The honest alternative is Poisson
  sampling.
* ``"noiseless"`` and ``"unaccounted"``: the ledger's own kinds, which record
  a count of steps only (`LedgerEntry.steps_only`): steps applied with noise
  multiplier 0 (epsilon is infinite) and steps whose data is unknown. The
  accountant refuses both, each with its own message, so the ledger holds
  every step the weights received and no epsilon leaves one out.

Two accountants are registered (`register_accountant`): ``"pld"`` (privacy
loss distributions, the default: essentially exact, 0.3-5 s per evaluation)
and ``"rdp"`` (Renyi DP, about 0.1 s, 6-135 % looser). See docs/privacy.md
for the measurements.

The package, by concept: `mechanisms` (what one step releases: the
Gaussian, adaptive clipping's gradient-and-count pair), `events` (sampling
kinds and their DpEvents, every built-in kind registered there), `ledger`
(the ledger, its row format, a schedule's ledger), `run_description`
(`RunDescription`, a planned run described once), `engines` (the accountant
registry and the cached epsilon), `accountant` (`PrivacyAccountant`, budget
search), `calibration` (`compute_epsilon`, `calibrate_noise_multiplier`),
`report` (the published report), `matrix_factorization` (correlated noise:
Toeplitz strategies, their error, sensitivity and events) and `noise` (the
noise mechanisms: a registry, one module per mechanism). It needs numpy, scipy and
dp_accounting, never TensorFlow: `tf-megadp epsilon` and `calibrate` run
without it.
"""

from tf_megadp.accounting.accountant import PrivacyAccountant
from tf_megadp.accounting.calibration import calibrate_noise_multiplier, compute_epsilon
from tf_megadp.accounting.engines import (
    DEFAULT_ACCOUNTANT,
    accountant_names,
    register_accountant,
)
from tf_megadp.accounting.events import (
    SamplingKind,
    register_sampling_kind,
    sampling_kinds,
)
from tf_megadp.accounting.ledger import (
    LedgerEntry,
    PrivacyLedger,
    ledger_from_schedule,
)
from tf_megadp.accounting.noise import noise_kinds, register_noise
from tf_megadp.accounting.run_description import RunDescription
from tf_megadp.steps import steps_for_epochs

__all__ = [
    "DEFAULT_ACCOUNTANT",
    "accountant_names",
    "register_accountant",
    "SamplingKind",
    "register_sampling_kind",
    "sampling_kinds",
    "noise_kinds",
    "register_noise",
    "LedgerEntry",
    "PrivacyLedger",
    "PrivacyAccountant",
    "RunDescription",
    "ledger_from_schedule",
    "steps_for_epochs",
    "compute_epsilon",
    "calibrate_noise_multiplier",
]
