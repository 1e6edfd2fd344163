"""tf_megadp: differentially private training for TensorFlow / Keras 3 at mega-batch scale.

The public API is re-exported here; everything else is private to its module.
"""

from tf_megadp import audit, distribute
from tf_megadp.accounting import (
    LedgerEntry,
    PrivacyAccountant,
    PrivacyLedger,
    calibrate_noise_multiplier,
    compute_epsilon,
    ledger_from_schedule,
)
from tf_megadp.audit import AuditCallback, run_audit
from tf_megadp.callbacks import PrivacyCallback, read_ledger
from tf_megadp.checkpointing import export_model, restore_training_state, save_training_state
from tf_megadp.clipping import ClippingStrategy, GhostClipping, VectorizedClipping
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.optimizer import DPOptimizer
from tf_megadp.schedules import BatchSizeSchedule, Phase
from tf_megadp.sources import DataSource
from tf_megadp.sampling import PoissonSampler, ShuffleSampler, TokenShards, write_token_shards
from tf_megadp.text import (
    CorpusError,
    MaskedLMBatcher,
    default_corpus_documents,
    load_vocabulary,
    prepare_corpus,
    read_documents,
)
from tf_megadp.train_step import is_private, make_private, make_private_with_epsilon

__version__ = "0.1.0"
