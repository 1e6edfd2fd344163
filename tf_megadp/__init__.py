"""tf_megadp: differentially private training for TensorFlow / Keras 3 at mega-batch scale.

The public API is re-exported here; everything else is private to its module.
`import tf_megadp` loads the library only: TensorFlow and Keras, never
keras-hub, matplotlib or scikit-learn. The audit library, which scores
membership with scikit-learn, is resolved on first use (PEP 562), from the
modules named in `_LAZY`. The BERT job (`tf_megadp.jobs.bert`) is an
application of the library, not part of it: this namespace names nothing of
it; import its corpus and batching helpers from `tf_megadp.jobs.bert.text`.
"""

from __future__ import annotations

import importlib
from typing import Any

from tf_megadp import distribute
from tf_megadp._version import __version__
from tf_megadp.adaptive_clipping import AdaptiveClipping
from tf_megadp.accounting import (
    LedgerEntry,
    PrivacyAccountant,
    PrivacyLedger,
    calibrate_noise_multiplier,
    compute_epsilon,
    ledger_from_schedule,
)
from tf_megadp.callbacks import PrivacyCallback
from tf_megadp.checkpointing import (
    export_model,
    has_training_state,
    restore_training_state,
    save_training_state,
)
from tf_megadp.clipping import AutoClipping, ClippingStrategy, GhostClipping, VectorizedClipping
from tf_megadp.custom_loop import PrivateStep
from tf_megadp.data import (
    DataSource,
    PoissonSampler,
    PrivacyUnitSampler,
    ShuffleSampler,
    TokenShards,
    write_token_shards,
)
from tf_megadp.errors import GhostClippingUnsupportedError, PrivacyConfigurationError
from tf_megadp.learning_rate import BatchScaledSchedule
from tf_megadp.optimizer import DPOptimizer
from tf_megadp.privacy_report import PrivacyReport
from tf_megadp.run_state import model_ledger, read_ledger
from tf_megadp.steps import BatchSizeSchedule, Phase
from tf_megadp.train_step import extend_schedule, is_private, make_private, make_private_with_epsilon
from tf_megadp.weights_origin import continue_from_release, declare_public_weights

# name -> (module, attribute or None for the module itself), imported on first access.
_LAZY = {
    "audit": ("tf_megadp.audit", None),
    "AuditCallback": ("tf_megadp.audit", "AuditCallback"),
    "run_audit": ("tf_megadp.audit", "run_audit"),
}

__all__ = [
    "AdaptiveClipping",
    "AuditCallback",
    "AutoClipping",
    "BatchScaledSchedule",
    "BatchSizeSchedule",
    "ClippingStrategy",
    "DPOptimizer",
    "DataSource",
    "GhostClipping",
    "GhostClippingUnsupportedError",
    "LedgerEntry",
    "Phase",
    "PoissonSampler",
    "PrivacyUnitSampler",
    "PrivacyAccountant",
    "PrivacyCallback",
    "PrivacyConfigurationError",
    "PrivacyLedger",
    "PrivacyReport",
    "PrivateStep",
    "ShuffleSampler",
    "TokenShards",
    "VectorizedClipping",
    "audit",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "continue_from_release",
    "declare_public_weights",
    "distribute",
    "export_model",
    "extend_schedule",
    "has_training_state",
    "is_private",
    "ledger_from_schedule",
    "make_private",
    "make_private_with_epsilon",
    "model_ledger",
    "read_ledger",
    "restore_training_state",
    "run_audit",
    "save_training_state",
    "write_token_shards",
]


def __getattr__(name: str) -> Any:
    """The lazily imported exports (PEP 562): see `_LAZY`."""
    try:
        module_name, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'tf_megadp' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # Resolved once; later lookups skip __getattr__.
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
