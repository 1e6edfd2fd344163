"""Data: where examples come from and how each logical step draws them.

The token-shard store (`shards`), record stores over arrays and indexable
collections (`stores`), the samplers' secret entropy (`entropy`), the
samplers that emit each step's examples as static micro-batches and own the
`dp_accounting` event of their steps (`samplers`; `privacy_units` samples
privacy units, k rows each, for user-level privacy), the `DataSource` a
dataset carries to `fit` (`sources`), and the check that a sampler's
`map_fn` keeps examples independent (`map_independence`).
"""

from tf_megadp.data.base import StepDraw
from tf_megadp.data.privacy_units import PrivacyUnitSampler
from tf_megadp.data.samplers import FixedOrderSampler, PoissonSampler, ShuffleSampler
from tf_megadp.data.shards import MANIFEST_NAME, TokenShards, token_dtype, write_token_shards
from tf_megadp.data.sources import DataSource, attach_source, resumed_at, source_of

__all__ = [
    "MANIFEST_NAME",
    "DataSource",
    "FixedOrderSampler",
    "PoissonSampler",
    "PrivacyUnitSampler",
    "ShuffleSampler",
    "StepDraw",
    "TokenShards",
    "attach_source",
    "resumed_at",
    "source_of",
    "token_dtype",
    "write_token_shards",
]
