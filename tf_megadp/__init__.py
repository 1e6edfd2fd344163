"""tf_megadp: differentially private training for TensorFlow / Keras 3 at mega-batch scale.

The public API is re-exported here; everything else is private to its module.
`import tf_megadp` loads the library only: TensorFlow and Keras, never
keras-hub, matplotlib or scikit-learn. The audit library, which scores
membership with scikit-learn, is resolved on first use (PEP 562), from the
modules named in `_LAZY`. The BERT job (`tf_megadp.jobs.bert`) is an
application of the library, not part of it: this namespace names nothing of
it; import its corpus and batching helpers from `tf_megadp.jobs.bert.text`.

Every other export is named in `_LIBRARY` and imported here, at the end of
this file, because importing them registers `DPOptimizer` and
`BatchScaledSchedule` with Keras: `keras.models.load_model` of a private run
then works after a bare `import tf_megadp`. One process defers them: the
`tf-megadp` launcher (tf_megadp_cli.py), whose accounting commands
(`--help`, `epsilon`, `calibrate`, `plan`) must answer without waiting for
TensorFlow. It imports the package with `DEFER_LIBRARY_IMPORT` set; the
exports are then resolved on first use, like the audit's, and
`tf_megadp.accounting` (NumPy, SciPy and dp_accounting) loads without
TensorFlow.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from tf_megadp._version import __version__

# name -> (module, attribute or None for the module itself), imported on first access.
_LAZY = {
    "audit": ("tf_megadp.audit", None),
    "AuditCallback": ("tf_megadp.audit", "AuditCallback"),
    "run_audit": ("tf_megadp.audit", "run_audit"),
}

# The library's exports, imported at the end of this file (or on first
# access, under the launcher): name -> (module, attribute or None).
_LIBRARY = {
    "distribute": ("tf_megadp.distribute", None),
    "AdaptiveClipping": ("tf_megadp.adaptive_clipping", "AdaptiveClipping"),
    # The noise mechanisms a user names (`noise=`); the registry is `accounting.noise`.
    **{name: ("tf_megadp.accounting.noise", name) for name in ("BLT", "BandMF", "LambdaCGD")},
    **{name: ("tf_megadp.accounting", name)
       for name in ("LedgerEntry", "PrivacyAccountant", "PrivacyLedger",
                    "calibrate_noise_multiplier", "compute_epsilon", "ledger_from_schedule")},
    "PrivacyCallback": ("tf_megadp.run.callbacks", "PrivacyCallback"),
    "export_model": ("tf_megadp.run.export", "export_model"),
    **{name: ("tf_megadp.run.training_state", name)
       for name in ("has_training_state", "restore_training_state", "save_training_state")},
    **{name: ("tf_megadp.clipping", name)
       for name in ("AutoClipping", "ClippingStrategy", "GhostClipping", "VectorizedClipping")},
    "PrivateStep": ("tf_megadp.training", "PrivateStep"),
    **{name: ("tf_megadp.data", name)
       for name in ("DataSource", "FixedOrderSampler", "PoissonSampler", "PrivacyUnitSampler",
                    "ShuffleSampler", "TokenShards", "write_token_shards")},
    **{name: ("tf_megadp.errors", name)
       for name in ("GhostClippingUnsupportedError", "PrivacyConfigurationError")},
    "BatchScaledSchedule": ("tf_megadp.learning_rate", "BatchScaledSchedule"),
    "DPOptimizer": ("tf_megadp.optimizer", "DPOptimizer"),
    "PrivacyReport": ("tf_megadp.training", "PrivacyReport"),
    **{name: ("tf_megadp.prompts", name)
       for name in ("PromptClassifier", "PromptTemplate", "Verbalizer")},
    "model_ledger": ("tf_megadp.run.state", "model_ledger"),
    "read_ledger": ("tf_megadp.optimizer", "read_ledger"),
    **{name: ("tf_megadp.steps", name) for name in ("BatchSizeSchedule", "Phase")},
    **{name: ("tf_megadp.training", name)
       for name in ("extend_schedule", "is_private", "make_private",
                    "make_private_with_epsilon")},
    **{name: ("tf_megadp.run.weights_origin", name)
       for name in ("continue_from_release", "declare_disjoint_data",
                    "declare_public_weights")},
}

__all__ = [
    "AdaptiveClipping",
    "AuditCallback",
    "AutoClipping",
    "BLT",
    "BandMF",
    "LambdaCGD",
    "BatchScaledSchedule",
    "BatchSizeSchedule",
    "ClippingStrategy",
    "DPOptimizer",
    "DataSource",
    "FixedOrderSampler",
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
    "PromptClassifier",
    "PromptTemplate",
    "ShuffleSampler",
    "TokenShards",
    "VectorizedClipping",
    "Verbalizer",
    "audit",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "continue_from_release",
    "declare_disjoint_data",
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
    """The exports not imported yet (PEP 562): see `_LAZY` and `_LIBRARY`."""
    try:
        module_name, attribute = _LAZY.get(name) or _LIBRARY[name]
    except KeyError:
        raise AttributeError(f"module 'tf_megadp' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # Resolved once; later lookups skip __getattr__.
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _library_deferred() -> bool:
    """Whether the `tf-megadp` launcher asked for the library to be imported on first use."""
    launcher = sys.modules.get("tf_megadp_cli")
    return bool(getattr(launcher, "DEFER_LIBRARY_IMPORT", False))


if not _library_deferred():
    for _name in _LIBRARY:
        __getattr__(_name)
    del _name
