"""Samplers that build logical batches from token shards, arrays or indexable records.

The accountant assumes Poisson sampling: in every logical step each of the N
examples joins the batch independently with probability q_t. `PoissonSampler`
does exactly that, in two exact stages: the step size b ~ Binomial(N, q_t),
then a uniformly random b-subset of the N examples. The same sampler reads
from a small "record store": memory-mapped token shards (the constructor),
in-memory arrays (`PoissonSampler.from_arrays`) or any collection with
`len` and `records[i]` (`PoissonSampler.from_records`). Examples are read by
random access, so a step costs memory in proportion to its batch, never to N.

Accelerators need static shapes, so every step is emitted as exactly k_t
micro-batches of M = m * R rows (the schedule's capacity), the unused slots
filled with all-zero rows of weight 0. A step that samples more than capacity
examples keeps a uniformly random subset of capacity: that is the truncated
Poisson mechanism, which the accountant covers with
`TruncatedSubsampledGaussianDpEvent(max_batch_size=schedule.capacity(phase))`.
The schedule sizes capacity so that this almost never happens; when it does,
the sampler counts it and warns.

The DP guarantee holds only while the draws stay secret, so every sampler
takes its randomness from OS entropy by default and keeps it in memory only
(a `tf_megadp.secret.Secret`, which no `vars()`, repr or pickle shows); an explicit `seed=` warns and marks the run as seeded, and
`shared_secret=` lets several hosts draw the same steps. Every dataset a
sampler returns carries its `tf_megadp.data.sources.DataSource`.

`ShuffleSampler` gives fixed-size batches from shuffled epochs for users who
want them. Its privacy is *not* what Poisson accounting reports (Chua et al.,
2024): see its docstring.

The shard store (`write_token_shards`, `TokenShards`) lives here because the
samplers are its only readers; the BERT job (`tf_megadp.jobs.bert.text`) writes
it from raw text.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import json
import math
import mmap
import numbers
import os
import secrets
import sys
import warnings
from typing import Any, Callable, Iterable, Iterator, Self

import dp_accounting
import numpy as np

from tf_megadp.accounting.events import SamplingKind, register_sampling_kind
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.files import atomic_write, sha256_of_file, write_json_atomically
from tf_megadp.data.map_independence import checked_map
from tf_megadp.steps import BatchSizeSchedule, Phase, step_capacity, steps_for_epochs
from tf_megadp.secret import Secret
from tf_megadp.data.sources import DataSource, attach_source

__all__ = [
    "MANIFEST_NAME",
    "TokenShards",
    "write_token_shards",
    "token_dtype",
    "StepDraw",
    "PoissonSampler",
    "ShuffleSampler",
]

MANIFEST_NAME = "manifest.json"
_MANIFEST_FORMAT = "tf_megadp.token_shards/1"
# Exact uniform subsets are drawn block by block so that no step allocates
# anything proportional to N (a permutation of 1e9 rows would be 8 GB).
_SUBSET_BLOCK = 1 << 20
# `TokenShards.read` unmaps the shard pages after every this-many rows. One
# scattered row can map far more than its own bytes (the kernel maps cached
# neighbours, whole large folios, on each fault: 100-300 KiB per row measured
# on a 10M-row corpus), so unmapping often is what keeps memory flat; 16 rows
# cost 18 MiB of peak memory and ~70k rows/s (benchmarks/input_pipeline.py).
_RELEASE_EVERY_ROWS = 16


def token_dtype(vocabulary_size: int) -> np.dtype:
    """The narrowest stored dtype for token ids below `vocabulary_size`."""
    return np.dtype(np.uint16) if vocabulary_size <= 1 << 16 else np.dtype(np.int32)


def write_token_shards(
    directory: str | os.PathLike,
    rows: Iterable[np.ndarray],
    *,
    sequence_length: int,
    vocabulary_size: int,
    checksum: str,
    rows_per_shard: int = 1 << 20,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Writes token rows as memory-mappable `.npy` shards plus a JSON manifest.

    Each shard is written to a temporary file and renamed into place; the
    manifest is written last, the same way, so a reader never sees a manifest
    that names a half-written shard.

    Args:
        directory: output folder (created if missing).
        rows: arrays of shape [n, sequence_length] (any integer dtype), in order.
        sequence_length: L, the length of every row.
        vocabulary_size: V; ids must lie in [0, V). Picks uint16 (V <= 65536)
            or int32 storage.
        checksum: a digest of the inputs and settings that produced the rows;
            `tf_megadp.jobs.bert.text` compares it to decide whether shards can be reused.
        rows_per_shard: rows per shard file.
        metadata: extra JSON-serializable fields for the manifest (e.g. the
            vocabulary file and special token ids).

    Returns:
        The manifest, as written.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    dtype = token_dtype(vocabulary_size)
    shards: list[dict[str, Any]] = []
    pending: list[np.ndarray] = []
    pending_rows = 0

    def flush(block: np.ndarray) -> None:
        name = f"shard-{len(shards):05d}.npy"
        path = os.path.join(directory, name)
        atomic_write(path, lambda temporary: np.save(temporary, block, allow_pickle=False))
        shards.append({"file": name, "rows": int(block.shape[0]), "sha256": sha256_of_file(path)})

    for block in rows:
        block = np.asarray(block)
        if block.ndim != 2 or block.shape[1] != sequence_length:
            raise ValueError(
                f"Every row block must have shape [n, {sequence_length}], got {block.shape}."
            )
        if block.size and (block.min() < 0 or block.max() >= vocabulary_size):
            raise ValueError(
                f"Token ids must lie in [0, {vocabulary_size}); got values in "
                f"[{block.min()}, {block.max()}]."
            )
        pending.append(block.astype(dtype, copy=False))
        pending_rows += block.shape[0]
        while pending_rows >= rows_per_shard:
            merged = np.concatenate(pending)
            flush(merged[:rows_per_shard])
            pending = [merged[rows_per_shard:]]
            pending_rows = pending[0].shape[0]
    if pending_rows:
        flush(np.concatenate(pending))
    manifest = {
        "format": _MANIFEST_FORMAT,
        "sequence_length": int(sequence_length),
        "num_sequences": int(sum(shard["rows"] for shard in shards)),
        "vocabulary_size": int(vocabulary_size),
        "dtype": dtype.name,
        "checksum": checksum,
        "shards": shards,
        **(metadata or {}),
    }
    write_json_atomically(os.path.join(directory, MANIFEST_NAME), manifest)
    return manifest


class _Shard:
    """One `.npy` shard mapped read-only, with the page advice random access needs."""

    def __init__(self, path: str, rows: int, sequence_length: int, dtype: np.dtype):
        with open(path, "rb") as handle:
            version = np.lib.format.read_magic(handle)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, stored = read_header(handle)
            offset = handle.tell()
            if shape != (rows, sequence_length) or fortran or stored != dtype:
                raise ValueError(
                    f"Shard {path} holds {stored}{list(shape)}, but the manifest "
                    f"says {dtype}[{rows}, {sequence_length}]. Rebuild the shards."
                )
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        # Readahead only wastes I/O on scattered rows.
        self._map.madvise(mmap.MADV_RANDOM)
        self.rows = np.frombuffer(
            self._map, dtype=dtype, count=rows * sequence_length, offset=offset
        ).reshape(rows, sequence_length)

    def release_pages(self) -> None:
        # Pages of a read-only file mapping can be dropped at no risk: the next
        # access faults them back in from the page cache.
        self._map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self.rows = None
        self._map.close()


class TokenShards:
    """Read-only, random-access view of sharded token rows written by `write_token_shards`.

    Args:
        directory: the folder holding `manifest.json` and the shards.
        verify: if True, check every shard's SHA-256 against the manifest
            (reads every byte once; sizes and headers are always checked).

    Example:
    ```python
    shards = tf_megadp.TokenShards("corpus/")
    len(shards), shards.sequence_length       # N, L
    rows = shards.read(np.array([3, 17, 42]))  # uint16 [3, L]
    ```
    """

    def __init__(self, directory: str | os.PathLike, *, verify: bool = False):
        self.directory = os.fspath(directory)
        path = os.path.join(self.directory, MANIFEST_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"No {MANIFEST_NAME} in {self.directory}: build the corpus first "
                "(tf_megadp.prepare_corpus or tf_megadp.write_token_shards)."
            )
        with open(path, encoding="utf-8") as handle:
            manifest = json.load(handle)
        if manifest.get("format") != _MANIFEST_FORMAT:
            raise ValueError(
                f"{path} has format {manifest.get('format')!r}, expected "
                f"{_MANIFEST_FORMAT!r}. Rebuild the shards."
            )
        self.manifest = manifest
        self.sequence_length = int(manifest["sequence_length"])
        self.vocabulary_size = int(manifest["vocabulary_size"])
        self.dtype = np.dtype(manifest["dtype"])
        self._shards = []
        for entry in manifest["shards"]:
            shard_path = os.path.join(self.directory, entry["file"])
            if not os.path.isfile(shard_path):
                raise FileNotFoundError(
                    f"Shard {shard_path} named in the manifest is missing. Rebuild the shards."
                )
            if verify and sha256_of_file(shard_path) != entry["sha256"]:
                raise ValueError(
                    f"Shard {shard_path} does not match its SHA-256 in the manifest: "
                    "it was modified or is corrupt. Rebuild the shards."
                )
            self._shards.append(
                _Shard(shard_path, int(entry["rows"]), self.sequence_length, self.dtype)
            )
        self._starts = np.cumsum([0] + [int(e["rows"]) for e in manifest["shards"]])
        if int(self._starts[-1]) != int(manifest["num_sequences"]):
            raise ValueError(f"{path}: shard rows do not add up to num_sequences.")

    def __len__(self) -> int:
        return int(self._starts[-1])

    def read(self, indices: np.ndarray) -> np.ndarray:
        """Rows at `indices` (ascending order reads each shard front to back).

        Args:
            indices: int array of row numbers in [0, N).

        Returns:
            A new array of shape [len(indices), L] in the stored dtype.
        """
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty((indices.size, self.sequence_length), self.dtype)
        if indices.size == 0:
            return out
        if indices.min() < 0 or indices.max() >= len(self):
            raise IndexError(f"Row indices must lie in [0, {len(self)}).")
        owner = np.searchsorted(self._starts, indices, side="right") - 1
        for start in range(0, indices.size, _RELEASE_EVERY_ROWS):
            chunk = slice(start, start + _RELEASE_EVERY_ROWS)
            for shard_index in np.unique(owner[chunk]):
                where = np.flatnonzero(owner[chunk] == shard_index) + start
                shard = self._shards[shard_index]
                out[where] = shard.rows[indices[where] - self._starts[shard_index]]
                # The rows are copied out: drop the mapped pages so that the
                # resident set never grows toward the corpus size. They stay
                # in the OS page cache for the next read.
                shard.release_pages()
        return out

    def close(self) -> None:
        for shard in self._shards:
            shard.close()
        self._shards = []


def _uniform_subset(rng: np.random.Generator, population: int, size: int) -> np.ndarray:
    """A uniformly random `size`-subset of range(population), sorted.

    Exact for any population: the number of chosen rows in each block of a
    uniform subset is multivariate hypergeometric, and given those counts the
    rows within each block are a uniform subset of the block. Memory is
    O(size + block), never O(population).
    """
    if population <= _SUBSET_BLOCK:
        chosen = rng.choice(population, size=size, replace=False, shuffle=False)
        return np.sort(chosen.astype(np.int64))
    num_blocks = math.ceil(population / _SUBSET_BLOCK)
    block_sizes = np.full(num_blocks, _SUBSET_BLOCK, dtype=np.int64)
    block_sizes[-1] = population - _SUBSET_BLOCK * (num_blocks - 1)
    counts = rng.multivariate_hypergeometric(block_sizes, size, method="marginals")
    parts = []
    for block, (block_size, count) in enumerate(zip(block_sizes, counts)):
        if count:
            local = rng.choice(int(block_size), size=int(count), replace=False, shuffle=False)
            parts.append(np.sort(local.astype(np.int64)) + block * _SUBSET_BLOCK)
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


@dataclasses.dataclass(frozen=True)
class StepDraw:
    """The examples of one logical step.

    Attributes:
        step: the logical step (0-based, as `optimizer.iterations`).
        indices: sorted row numbers that enter the step (at most capacity).
        sampled_size: rows sampled before truncation (b for Poisson).
        capacity: static slots of the step, k_t * m * R.
    """

    step: int
    indices: np.ndarray
    sampled_size: int
    capacity: int

    @property
    def truncated(self) -> bool:
        return self.sampled_size > self.capacity


# -- Record stores: what a sampler reads examples from ------------------------------
#
# One sampler implementation serves every kind of data. A store says how many
# examples there are (N, measured), the per-example shape and dtype of each of
# its leaves, how to read some examples, and how a padded micro-batch is laid
# out as the element `fit` receives. The sampler does everything else (the
# draw, truncation, padding, tf.data), so the privacy-relevant code exists once.


class _RecordStore(abc.ABC):
    """N examples, each a fixed structure of fixed-shape arrays ("leaves").

    Attributes:
        num_examples: N.
        noun: what one example is, for descriptions ("token rows").
        leaves: per leaf, (shape of one example's value, emitted NumPy dtype).
    """

    num_examples: int
    noun: str
    leaves: list[tuple[tuple[int, ...], np.dtype]]

    @abc.abstractmethod
    def read(self, indices: np.ndarray) -> list[np.ndarray]:
        """One array [len(indices), *shape] per leaf, for the examples at `indices`."""

    @abc.abstractmethod
    def arrange(self, leaves: list[Any], weights: Any) -> Any:
        """The emitted element from padded leaves and the 0/1 real-row weights.

        Works alike on arrays and on `tf.TensorSpec`s (to build the signature).
        """


class _TokenShardStore(_RecordStore):
    """Token rows of a `TokenShards`; elements are `(rows int32 [M, L], weights [M])`."""

    noun = "token rows"

    def __init__(self, shards: TokenShards):
        self.shards = shards
        self.num_examples = len(shards)
        self.leaves = [((shards.sequence_length,), np.dtype(np.int32))]

    def read(self, indices: np.ndarray) -> list[np.ndarray]:
        return [self.shards.read(indices)]

    def arrange(self, leaves: list[Any], weights: Any) -> Any:
        return leaves[0], weights


def _flatten(structure: Any) -> tuple[list[Any], Any]:
    """Leaves of a nest of dicts, tuples and lists, and the tree to rebuild it.

    The tree is a hashable, comparable description (a leaf is None), so two
    records can be checked for the same structure with `==`.
    """
    if isinstance(structure, dict):
        try:
            # Sorted as tf.nest does, so that key order never makes two records differ.
            keys = tuple(sorted(structure))
        except TypeError:
            keys = tuple(structure)
        parts = [_flatten(structure[key]) for key in keys]
        tree = ("dict", keys, tuple(t for _, t in parts))
    elif isinstance(structure, (tuple, list)):
        parts = [_flatten(item) for item in structure]
        tree = ("tuple", tuple(t for _, t in parts))
    else:
        return [structure], None
    return [leaf for leaves, _ in parts for leaf in leaves], tree


def _unflatten(tree: Any, leaves: list[Any]) -> Any:
    """Inverse of `_flatten` (lists come back as tuples, as tf.data wants them)."""
    position = iter(leaves)

    def build(node):
        if node is None:
            return next(position)
        if node[0] == "dict":
            return {key: build(child) for key, child in zip(node[1], node[2])}
        return tuple(build(child) for child in node[1])

    return build(tree)


def _count_leaves(tree: Any) -> int:
    if tree is None:
        return 1
    return sum(_count_leaves(child) for child in tree[-1])


def _emitted_dtype(dtype: np.dtype, what: str, *, weight: bool) -> np.dtype:
    """The dtype a leaf is emitted in: floats as float32 (as Keras does with NumPy input)."""
    if dtype.kind == "O" or dtype.kind == "V":
        raise TypeError(
            f"{what} has dtype {dtype}: convert it to a numeric or string NumPy array "
            "(every leaf needs a fixed shape and a tf.data dtype)."
        )
    if weight:
        if dtype.kind not in "biuf":
            raise TypeError(f"{what} (a sample weight) must be numeric, got dtype {dtype}.")
        return np.dtype(np.float32)
    if dtype.kind == "f" and dtype.itemsize > 4:
        return np.dtype(np.float32)
    return dtype


class _ExampleStore(_RecordStore):
    """Shared layout of array and record stores: elements `(x, y, sample_weight)`.

    The stored structure is `(x, y)` or `(x, y, sample_weight)`; without user
    weights the emitted weight is the 0/1 real-row mask, with them it is the
    user's weights, whose padding rows are zero like every padded leaf.
    """

    _tree: Any
    _weighted: bool

    def _set_layout(
        self, tree: Any, layout: list[tuple[tuple[int, ...], np.dtype]], what: Callable[[int], str]
    ) -> None:
        """Records the structure and, per leaf, one example's shape and emitted dtype."""
        self._tree = tree
        self._weighted = len(tree[1]) == 3
        first_weight = _count_leaves(tree[1][0]) + _count_leaves(tree[1][1])
        self.leaves = [
            (tuple(shape), _emitted_dtype(dtype, what(i), weight=i >= first_weight))
            for i, (shape, dtype) in enumerate(layout)
        ]

    def arrange(self, leaves: list[Any], weights: Any) -> Any:
        rebuilt = _unflatten(self._tree, leaves)
        return rebuilt if self._weighted else (*rebuilt, weights)


class _ArrayStore(_ExampleStore):
    """In-memory (or memory-mapped) arrays: one example is one row of every array."""

    noun = "examples in arrays"

    def __init__(self, x: Any, y: Any, sample_weight: Any):
        if x is None or y is None:
            raise TypeError(
                "from_arrays needs x and y (labels). For a loss without labels, "
                "pass y=np.zeros(len(x)) and ignore it in the loss."
            )
        structure = (x, y) if sample_weight is None else (x, y, sample_weight)
        leaves, tree = _flatten(structure)
        arrays = [np.asarray(leaf) for leaf in leaves]
        for array in arrays:
            if array.ndim == 0:
                raise ValueError(
                    "Every array in x, y and sample_weight needs a leading example "
                    f"axis; got a scalar of dtype {array.dtype}."
                )
        lengths = sorted({int(array.shape[0]) for array in arrays})
        if len(lengths) != 1:
            raise ValueError(
                f"x, y and sample_weight must all have one row per example; got "
                f"leading lengths {lengths}."
            )
        if lengths[0] == 0:
            raise ValueError("from_arrays needs at least one example; the arrays are empty.")
        self._arrays = arrays
        self.num_examples = lengths[0]
        self._set_layout(
            tree,
            [(array.shape[1:], array.dtype) for array in arrays],
            lambda i: f"array {i} of (x, y, sample_weight)",
        )

    def read(self, indices: np.ndarray) -> list[np.ndarray]:
        # Fancy indexing copies only the chosen rows (also from an np.memmap).
        return [array[indices] for array in self._arrays]


class _IndexableStore(_ExampleStore):
    """Any `records` with `len(records)` and `records[i] -> (x_i, y_i[, w_i])`.

    Only the sampled records are read, so memory is O(batch) however big N
    is; every read record is checked against record 0's structure, shapes
    and dtypes (static shapes).
    """

    def __init__(self, records: Any):
        _refuse_batched(records)
        if not (hasattr(records, "__len__") and hasattr(records, "__getitem__")):
            raise TypeError(
                f"records must support len(records) and records[i] -> (x_i, y_i) or "
                f"(x_i, y_i, sample_weight_i); got {type(records).__name__}."
            )
        self._records = records
        self.num_examples = int(len(records))
        if self.num_examples == 0:
            raise ValueError("from_records needs at least one record; len(records) is 0.")
        self.noun = f"records of a {type(records).__name__}"
        leaves, tree = self._example(0)
        self._set_layout(
            tree, [(leaf.shape, leaf.dtype) for leaf in leaves], lambda i: f"leaf {i} of record 0"
        )

    def _example(self, index: int) -> tuple[list[np.ndarray], Any]:
        record = self._records[index]
        if not isinstance(record, (tuple, list)) or len(record) not in (2, 3):
            raise TypeError(
                f"records[{index}] is a {type(record).__name__}; each record must be a "
                "tuple (x_i, y_i) or (x_i, y_i, sample_weight_i), x_i an array or a "
                "dict/tuple of arrays. For whole arrays use from_arrays."
            )
        leaves, tree = _flatten(tuple(record))
        return [np.asarray(leaf) for leaf in leaves], tree

    def read(self, indices: np.ndarray) -> list[np.ndarray]:
        columns: list[list[np.ndarray]] = [[] for _ in self.leaves]
        for index in indices:
            leaves, tree = self._example(int(index))
            if tree != self._tree:
                raise ValueError(
                    f"records[{index}] has a different structure than records[0]; every "
                    "record needs the same nesting of x_i, y_i (and sample_weight_i)."
                )
            for leaf_index, (column, value, (shape, dtype)) in enumerate(
                zip(columns, leaves, self.leaves)
            ):
                strings = value.dtype.kind in "US" and dtype.kind in "US"
                if value.shape != shape or not (
                    strings or np.can_cast(value.dtype, dtype, "same_kind")
                ):
                    raise ValueError(
                        f"Leaf {leaf_index} of records[{index}] is "
                        f"{value.dtype}{list(value.shape)}, but records[0] set it to {dtype}{list(shape)}. Static shapes need "
                        "every record alike: pad or truncate them before sampling."
                    )
                column.append(value)
        return [
            np.stack(column) if column else np.empty((0, *shape), dtype)
            for column, (shape, dtype) in zip(columns, self.leaves)
        ]


def _refuse_batched(records: Any) -> None:
    """Refuses collections whose items are batches: the privacy unit would be a batch."""
    import keras
    import tensorflow as tf

    if isinstance(records, (keras.utils.PyDataset, tf.data.Dataset)):
        raise PrivacyConfigurationError(
            f"from_records got a {type(records).__name__}, whose items are batches "
            "(or which cannot be indexed per example): sampling it would make a whole "
            "batch one privacy unit. Pass a collection whose records[i] is one "
            "example, or the arrays themselves to from_arrays."
        )
    if isinstance(records, (np.ndarray, str, bytes)):
        raise TypeError(
            f"from_records got a {type(records).__name__}; pass arrays to "
            "from_arrays(x, y) instead."
        )


def _takes_keyword_only(function: Callable[..., Any], name: str) -> bool:
    """Whether `function` has a keyword-only parameter `name`."""
    try:
        parameter = inspect.signature(function).parameters.get(name)
    except (TypeError, ValueError):  # no signature to read
        return False
    return parameter is not None and parameter.kind is inspect.Parameter.KEYWORD_ONLY


def _tensor_spec(shape: tuple[int, ...], dtype: np.dtype):
    import tensorflow as tf

    return tf.TensorSpec(shape, tf.string if dtype.kind in "US" else tf.as_dtype(dtype))


# -- Secret sampling randomness -------------------------------------------------------

# Values below this cannot be a secret drawn from OS entropy (a 128-bit draw is
# below it with probability 2**-96); they are seeds passed as shared_secret.
_MIN_SHARED_SECRET = 1 << 32


def _os_entropy() -> int:
    """128 bits from the OS's cryptographic source, as `np.random.SeedSequence()` draws."""
    return secrets.randbits(128)


def _warn(message: str, category: type[Warning]) -> None:
    # Point the warning at the user's line, however deep inside this module
    # (a classmethod, a subclass constructor) it was raised.
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _non_negative_integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise TypeError(f"{name} must be a non-negative integer, got {type(value).__name__}.")
    return int(value)


def _sampling_entropy(seed: int | None, shared_secret: int | None) -> tuple[int, bool]:
    """(entropy, seeded): OS entropy by default, else the caller's seed or shared secret."""
    if seed is not None and shared_secret is not None:
        raise PrivacyConfigurationError(
            "Pass seed= or shared_secret=, not both: shared_secret keeps the draws "
            "secret across hosts, seed makes them reproducible (and public to anyone "
            "who can guess it)."
        )
    if shared_secret is not None:
        secret = _non_negative_integer("shared_secret", shared_secret)
        if secret < _MIN_SHARED_SECRET:
            # Messages never repeat the value: it is meant to be secret.
            raise PrivacyConfigurationError(
                "shared_secret is below 2**32, so it is a guessable seed, not a "
                "secret: draw it from OS entropy (secrets.randbits(128), or "
                "tf_megadp.distribute.shared_sampling_secret(strategy) on several "
                "hosts), or pass seed= for a reproducible, non-private debug run."
            )
        return secret, False
    if seed is not None:
        seed = _non_negative_integer("seed", seed)
        _warn(
            "An explicit sampling seed makes every batch computable by anyone who can "
            "guess or learn the seed: against them the draws, and with them the DP "
            "guarantee, are not private. Use seed= only for tests and debugging (the "
            "privacy report marks the run as seeded); omit it for secret OS entropy, "
            "or pass shared_secret= so that several hosts draw the same steps.",
            UserWarning,
        )
        return seed, True
    return _os_entropy(), False


# -- Samplers ----------------------------------------------------------------------


class _Sampler(abc.ABC):
    """Shared machinery: secret randomness, phases, static micro-batches, tf.data."""

    sampling_kind: str = ""

    def __init__(
        self,
        shards: TokenShards,
        schedule: BatchSizeSchedule,
        *,
        seed: int | None = None,
        shared_secret: int | None = None,
        start_step: int = 0,
        end_step: int | None = None,
    ):
        if isinstance(shards, TokenShards):
            store: _RecordStore = _TokenShardStore(shards)
        elif isinstance(shards, _RecordStore):
            store = shards  # from from_arrays / from_records
        else:
            raise TypeError(
                f"{type(self).__name__} takes a TokenShards; got {type(shards).__name__}. "
                f"For arrays use {type(self).__name__}.from_arrays(x, y, ...), for a "
                f"collection of examples {type(self).__name__}.from_records(records, ...)."
            )
        if not isinstance(schedule, BatchSizeSchedule):
            raise TypeError(f"schedule must be a BatchSizeSchedule, got {schedule!r}.")
        if schedule.num_examples != store.num_examples:
            # The accountant's N comes from the schedule; a mismatch would
            # report the wrong sampling rate.
            raise PrivacyConfigurationError(
                f"schedule.num_examples = {schedule.num_examples} but the data has "
                f"{store.num_examples:,} {store.noun}. Build the schedule with "
                f"num_examples=len(shards) (N = {store.num_examples}), or let "
                "from_arrays/from_records build it from batch_size and epochs."
            )
        start_step = _non_negative_integer("start_step", start_step)
        end_step = schedule.total_steps if end_step is None else end_step
        end_step = _non_negative_integer("end_step", end_step)
        if start_step > end_step:
            raise ValueError(
                f"Need 0 <= start_step <= end_step, got start_step={start_step}, "
                f"end_step={end_step}."
            )
        self._store = store
        self.shards = store.shards if isinstance(store, _TokenShardStore) else None
        self.schedule = schedule
        self.start_step = start_step
        self.end_step = end_step
        self.micro_batch_rows = step_capacity(1, schedule.micro_batch_size, schedule.num_replicas)
        self._consumed = False
        entropy, self.seeded = _sampling_entropy(seed, shared_secret)
        # The only copy of the sampling randomness, in a holder that neither
        # vars(), repr, pickles nor the DataSource show. Set last, so that no
        # traceback of a failed constructor has it in a frame's locals.
        self._entropy = Secret(entropy)

    @classmethod
    def from_arrays(
        cls,
        x: Any,
        y: Any,
        sample_weight: Any = None,
        *,
        batch_size: int | None = None,
        epochs: float | None = None,
        micro_batch_size: int | None = None,
        num_replicas: int | None = None,
        truncation_probability: float | None = None,
        schedule: BatchSizeSchedule | None = None,
        seed: int | None = None,
        shared_secret: int | None = None,
        start_step: int = 0,
        end_step: int | None = None,
    ) -> Self:
        """A sampler over in-memory arrays: one example is one row of every array.

        Either give `batch_size`, `epochs` and `micro_batch_size` (the sampler
        builds the schedule, N measured from the arrays) or an explicit
        `schedule`. Hand `sampler.schedule` to `DPOptimizer(schedule=...)`.

        Args:
            x: a NumPy array (or memmap, or anything `np.asarray` takes) or a
                dict/tuple/list nest of them, each with N rows.
            y: labels, an array or nest of arrays with N rows.
            sample_weight: optional per-example (or per-token) weights with N
                rows; they are kept for real rows and zero on padding rows.
            batch_size: the expected logical batch size B (q = B / N).
            epochs: passes over the data, E > 0 (may be fractional); the run
                has ceil(E * N / B) logical steps.
            micro_batch_size: m, the static per-replica micro-batch size.
            num_replicas: R (default 1): each element is a global micro-batch
                of m * R rows.
            truncation_probability: Poisson only: per-step bound on
                P[b > capacity] used to size k (default 1e-9).
            schedule: an explicit `BatchSizeSchedule` instead of the four
                settings above.
            seed, shared_secret, start_step, end_step: as in the constructor.

        Returns:
            The sampler; its `as_dataset()` yields `(x, y, sample_weight)`.

        Example:
        ```python
        sampler = tf_megadp.PoissonSampler.from_arrays(
            x_train, y_train, batch_size=256, epochs=3, micro_batch_size=32)
        optimizer = tf_megadp.DPOptimizer(keras.optimizers.Adam(1e-3), l2_norm_clip=1.0,
                                          noise_multiplier=1.1, schedule=sampler.schedule)
        ```
        """
        store = _ArrayStore(x, y, sample_weight)
        schedule = cls._resolve_schedule(
            store.num_examples, schedule, batch_size, epochs, micro_batch_size,
            num_replicas, truncation_probability,
        )
        return cls(
            store, schedule, seed=seed, shared_secret=shared_secret,
            start_step=start_step, end_step=end_step,
        )

    @classmethod
    def from_records(
        cls,
        records: Any,
        *,
        batch_size: int | None = None,
        epochs: float | None = None,
        micro_batch_size: int | None = None,
        num_replicas: int | None = None,
        truncation_probability: float | None = None,
        schedule: BatchSizeSchedule | None = None,
        seed: int | None = None,
        shared_secret: int | None = None,
        start_step: int = 0,
        end_step: int | None = None,
    ) -> Self:
        """A sampler over any indexable collection of examples, read lazily.

        `records` needs `len(records)` (N) and `records[i]` returning example
        i as `(x_i, y_i)` or `(x_i, y_i, sample_weight_i)`, where x_i is an
        array or a dict/tuple of arrays. All records must have the same
        structure, shapes and dtypes as record 0. Only sampled records are read.

        Args:
            records: e.g. a list of `(x_i, y_i)` pairs or a class reading
                examples from disk. Not a `keras.utils.PyDataset` (its items
                are batches).
            batch_size, epochs, micro_batch_size, num_replicas,
            truncation_probability, schedule, seed, shared_secret, start_step,
            end_step: as in `from_arrays`.

        Returns:
            The sampler; its `as_dataset()` yields `(x, y, sample_weight)`.

        Example:
        ```python
        pairs = [(image, label) for image, label in my_examples]
        sampler = tf_megadp.PoissonSampler.from_records(
            pairs, batch_size=256, epochs=3, micro_batch_size=32)
        ```
        """
        store = _IndexableStore(records)
        schedule = cls._resolve_schedule(
            store.num_examples, schedule, batch_size, epochs, micro_batch_size,
            num_replicas, truncation_probability,
        )
        return cls(
            store, schedule, seed=seed, shared_secret=shared_secret,
            start_step=start_step, end_step=end_step,
        )

    @classmethod
    def _resolve_schedule(
        cls, num_examples, schedule, batch_size, epochs, micro_batch_size,
        num_replicas, truncation_probability,
    ) -> BatchSizeSchedule:
        settings = {
            "batch_size": batch_size, "epochs": epochs, "micro_batch_size": micro_batch_size,
            "num_replicas": num_replicas, "truncation_probability": truncation_probability,
        }
        given = [name for name, value in settings.items() if value is not None]
        if schedule is not None:
            if given:
                raise ValueError(
                    f"Pass either schedule= or batch_size/epochs/micro_batch_size, not "
                    f"both (got schedule and {', '.join(given)})."
                )
            return schedule
        missing = [n for n in ("batch_size", "epochs", "micro_batch_size") if settings[n] is None]
        if missing:
            raise TypeError(
                f"{cls.__name__} needs batch_size, epochs and micro_batch_size to build "
                f"its schedule (missing: {', '.join(missing)}), or an explicit schedule=."
            )
        if isinstance(epochs, bool) or not isinstance(epochs, numbers.Real) or not (
            0 < epochs < math.inf
        ):
            raise ValueError(f"epochs must be a finite number > 0, got {epochs!r}.")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
        if batch_size > num_examples:
            raise ValueError(
                f"batch_size {batch_size} exceeds the {num_examples} examples: the "
                "sampling rate would exceed 1. Use a smaller batch_size."
            )
        return cls._schedule_for(
            num_examples, batch_size, float(epochs), micro_batch_size,
            1 if num_replicas is None else num_replicas, truncation_probability,
        )

    @classmethod
    @abc.abstractmethod
    def _schedule_for(cls, num_examples, batch_size, epochs, micro_batch_size, num_replicas,
                      truncation_probability) -> BatchSizeSchedule:
        """The schedule `from_arrays`/`from_records` build from batch_size and epochs."""

    # -- Randomness ------------------------------------------------------------

    def _rng(self, *key: int) -> np.random.Generator:
        # One independent stream per (kind of draw, step): the draws of a step
        # depend only on (entropy, step), so hosts sharing a secret draw the
        # same steps, and drawing a step twice gives the same examples.
        sequence = np.random.SeedSequence(self._entropy.value, spawn_key=key)
        return np.random.Generator(np.random.PCG64(sequence))

    def __reduce_ex__(self, protocol):
        # Pickling (or copying) would write the secret randomness to a file,
        # or clone a stream that must be consumed once.
        raise TypeError(
            f"A {type(self).__name__} holds secret sampling randomness and cannot be "
            "pickled or copied. To resume, create a new sampler with "
            "start_step=int(optimizer.iterations): it draws fresh, equally private steps."
        )

    def __repr__(self) -> str:
        randomness = "seeded (not private)" if self.seeded else "secret"
        return (
            f"<{self.description}: steps [{self.start_step}, {self.end_step}) of "
            f"{self.schedule!r}, {randomness} randomness>"
        )

    # -- What the accountant is told -------------------------------------------

    @property
    def description(self) -> str:
        """One line for logs and the privacy report, e.g. "PoissonSampler over 1,280 token rows"."""
        return f"{type(self).__name__} over {self._store.num_examples:,} {self._store.noun}"

    @property
    def source(self) -> DataSource:
        """The `DataSource` attached to this sampler's datasets (no secret in it)."""
        return DataSource(
            sampling=self.sampling_kind,
            num_examples=self._store.num_examples,
            num_examples_measured=True,
            description=self.description,
            schedule=self.schedule,
            start_step=self.start_step,
            seeded=self.seeded,
            end_step=self.end_step,
        )

    # -- Micro-batches -----------------------------------------------------------

    @abc.abstractmethod
    def draw(self, step: int) -> StepDraw:
        """The examples of logical step `step`."""

    @property
    def total_micro_steps(self) -> int:
        """Micro-batches from start_step to end_step (a logical step is drawn whole)."""
        return self._micro_steps(self.start_step, self.end_step)

    def _micro_steps(self, first_step: int, end_step: int) -> int:
        """Micro-batches of logical steps first_step .. end_step - 1."""
        return sum(self.schedule.phase_at(step).accumulation_steps
                   for step in range(first_step, end_step))

    def step_micro_batches(self, draw: StepDraw) -> Iterator[Any]:
        """Splits a step into its k_t static micro-batches of M = m * R rows.

        Yields:
            For token shards, `(rows int32 [M, L], weights float32 [M])`; for
            arrays and records, `(x, y, sample_weight)`. Padding rows are all
            zeros with weight 0.
        """
        size = self.micro_batch_rows
        weights_template = np.zeros(size, np.float32)
        # Read per micro-batch, so memory is O(m * R) rows however big the step.
        for start in range(0, draw.capacity, size):
            chosen = draw.indices[start : start + size]
            padded = []
            for (shape, dtype), values in zip(self._store.leaves, self._store.read(chosen)):
                # Strings keep their own width (a narrower one would cut them).
                block = np.zeros((size, *shape), values.dtype if dtype.kind in "US" else dtype)
                block[: chosen.size] = values
                padded.append(block)
            weights = weights_template.copy()
            weights[: chosen.size] = 1.0
            yield self._store.arrange(padded, weights)

    def micro_batches(self) -> Iterator[Any]:
        """All micro-batches from `start_step`, in training order.

        A sampler can be consumed once: replaying its draws would reuse the
        same random batches, which the accountant does not cover.
        """
        for _, element in self._micro_batches_by_step():
            yield element

    def _micro_batches_by_step(self) -> Iterator[tuple[int, Any]]:
        """(logical step, micro-batch) for every micro-batch, consuming the sampler."""
        if self._consumed:
            raise RuntimeError(
                "This sampler's batches were already consumed. Create a new sampler "
                "with start_step=int(optimizer.iterations) to continue (it draws "
                "fresh steps); never replay draws. With Keras, fit(dataset) once, or "
                "fit(dataset, epochs=E, steps_per_epoch=sampler.total_micro_steps // E)."
            )
        self._consumed = True
        for step in range(self.start_step, self.end_step):
            for element in self.step_micro_batches(self.draw(step)):
                yield step, element

    def _pipeline_elements(self) -> Iterator[tuple[Any, np.ndarray, bool]]:
        """Every micro-batch, with its step's key and whether the `map_fn` check runs on it.

        The check runs on the first micro-batch of the dataset and on each
        later one with the model check's `RECHECK_PROBABILITY`, decided by
        the sampler's secret: no example can time its mixing to unchecked
        ones.
        """
        from tf_megadp.clipping.independence import RECHECK_PROBABILITY

        step = key = choices = None
        for position, (current, element) in enumerate(self._micro_batches_by_step()):
            if current != step:
                step, key, choices = current, self._step_key(current), self._rng(3, current)
            yield element, key, position == 0 or choices.random() < RECHECK_PROBABILITY

    def _step_key(self, step: int) -> np.ndarray:
        """The key of logical step `step` for a `map_fn`'s stateless draws: int64 [2].

        Drawn from the sampler's secret (its own stream, independent of the
        draws), so a `map_fn`'s randomness is as secret as the sampling and,
        like the draws, the same on every host sharing the secret.
        """
        return self._rng(2, step).integers(0, 2**63, size=2, dtype=np.int64)

    def as_dataset(
        self,
        map_fn: Callable[..., Any] | None = None,
        *,
        parallel_map: bool = False,
        prefetch: int | None = None,
    ):
        """The micro-batches as a `tf.data.Dataset` with static shapes, carrying its `DataSource`.

        Pass the returned dataset to `fit` as it is: `fit` reads its
        `DataSource` (`tf_megadp.data.sources.source_of`) and refuses a dataset
        derived from it (`cache`, `repeat`, `map`, `take`, ...), which could
        replay or mix the draws. Per-micro-batch processing goes in `map_fn`.

        Args:
            map_fn: optional function applied to each element (its parts as
                arguments), e.g. `tf_megadp.MaskedLMBatcher(...)` on token
                rows, which returns `(x, y, sample_weight)`. Without it,
                token shards give `(rows int32 [M, L], weights float32 [M])`
                and arrays/records give `(x, y, sample_weight)`.
                A `map_fn` that draws random numbers (masking, augmentation)
                takes a keyword-only parameter `key` (as `MaskedLMBatcher`):
                it is passed the secret key of each micro-batch's logical
                step, int64 [2], drawn from the sampler's own secret (OS
                entropy; reproducible only for a seeded sampler, which the
                report marks), the same for every micro-batch of the step.
                Draw with stateless ops keyed by it and by the example's own
                content (e.g. `tf.fingerprint` of its row), never by its
                position: then an example's randomness does not depend on
                the others, the results depend on neither thread timing nor
                the order the calls run in, and nothing public (a
                `keras.utils.set_random_seed` seed) predicts them.
            parallel_map: run `map_fn` on several micro-batches at once.
                Only for a `map_fn` without stateful random ops: those hand
                out their numbers in the order the calls happen to run, so
                a parallel map makes a seeded run's results depend on thread
                timing. The default maps in order; `prefetch` still
                overlaps it with training.
            prefetch: micro-batches to prepare ahead (default: AUTOTUNE).

        Returns:
            A `tf.data.Dataset` of `total_micro_steps` elements that can be
            iterated once (see `micro_batches`).

        Example:
        ```python
        dataset = sampler.as_dataset()
        model.fit(dataset)   # one pass consumes every micro-batch
        ```
        """
        import tensorflow as tf

        rows = self.micro_batch_rows
        signature = self._store.arrange(
            [_tensor_spec((rows, *shape), dtype) for shape, dtype in self._store.leaves],
            tf.TensorSpec([rows], tf.float32),
        )
        if map_fn is None:
            dataset = tf.data.Dataset.from_generator(self.micro_batches,
                                                     output_signature=signature)
        else:
            # The key and the check flag ride along each element as data,
            # never as constants of the dataset graph, so each micro-batch
            # gets its own however the map is scheduled.
            dataset = tf.data.Dataset.from_generator(
                self._pipeline_elements,
                output_signature=(signature, tf.TensorSpec([2], tf.int64),
                                  tf.TensorSpec([], tf.bool)))
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(self.total_micro_steps))
        if map_fn is not None:
            keyed = _takes_keyword_only(map_fn, "key")

            def call(element, key):
                return map_fn(*element, key=key) if keyed else map_fn(*element)

            function = checked_map(call, rows)
            if parallel_map:
                dataset = dataset.map(function, num_parallel_calls=tf.data.AUTOTUNE,
                                      deterministic=True)
            else:
                dataset = dataset.map(function)
        dataset = dataset.prefetch(tf.data.AUTOTUNE if prefetch is None else prefetch)

        def resume(step: int):
            return self._continued_at(step).as_dataset(
                map_fn, parallel_map=parallel_map, prefetch=prefetch)

        return attach_source(dataset, self.source, resume=resume)

    def _continued_at(self, step: int) -> Self:
        """This sampler from logical step `step` on: same data, schedule, end and randomness.

        Used when a preemption backup restores the run at `step`
        (`tf_megadp.data.sources.resumed_at`). The steps from `step` on were
        never applied to the restored weights, so drawing them (again) is
        what an uninterrupted run would have done.
        """
        if not self.start_step <= step <= self.end_step:
            raise PrivacyConfigurationError(
                f"The run is at logical step {step}, outside this sampler's steps "
                f"[{self.start_step}, {self.end_step}]: it cannot continue it. Build the "
                "sampler the run was started with."
            )
        continued = object.__new__(type(self))
        continued.__dict__.update(self.__dict__)
        continued.start_step = step
        continued._consumed = False
        return continued


class PoissonSampler(_Sampler):
    """Exact Poisson sampling of logical batches, emitted as static micro-batches.

    For logical step t with rate q_t = schedule.sampling_rate(t), the step size
    is b ~ Binomial(N, q_t) and its examples are a uniform b-subset of the N:
    together, every example joins every step independently with probability
    q_t. The step becomes k_t micro-batches of m * R rows; padding rows are
    zeros with weight 0. If b exceeds the capacity k_t * m * R, a uniform
    subset of capacity examples is kept (truncated Poisson sampling,
    accounted with `max_batch_size = schedule.capacity(phase)`);
    `truncated_steps` counts such steps and each one raises a warning.

    The same sampler serves token shards (this constructor), in-memory arrays
    (`from_arrays`) and indexable collections of examples (`from_records`).

    Randomness is secret by default: 128 bits of OS entropy, held only in a
    `tf_megadp.secret.Secret` (never in an attribute `vars()` shows, the repr,
    a pickle or the `DataSource`). The DP guarantee holds only while the draws stay secret.
    `seed=` makes the draws reproducible, for tests and debugging: it warns,
    and the privacy report marks the run as seeded. Several hosts that must
    draw the same steps pass the same `shared_secret` (drawn from OS entropy
    and shared in memory, e.g. by `tf_megadp.distribute.shared_sampling_secret`).
    To resume, create a new sampler with `start_step=int(optimizer.iterations)`:
    it draws fresh steps, as private as the ones they replace. Randomness is
    expanded by NumPy's PCG64, which is not a cryptographic generator.

    Args:
        shards: the corpus, a `TokenShards`; N = len(shards) must equal
            `schedule.num_examples`.
        schedule: the `BatchSizeSchedule` shared with the optimizer and accountant.
        seed: a non-negative int for reproducible, non-private draws (warns).
        shared_secret: an int of at least 2**32 drawn from OS entropy and
            shared between hosts; cannot be combined with `seed`.
        start_step: first logical step to draw (`int(optimizer.iterations)`
            on resume).
        end_step: logical step to stop before; default `schedule.total_steps`.

    Example:
    ```python
    shards = tf_megadp.TokenShards("corpus/")
    schedule = tf_megadp.BatchSizeSchedule.for_poisson(
        [(50, 256), (50, 1024)], num_examples=len(shards), micro_batch_size=32)
    sampler = tf_megadp.PoissonSampler(shards, schedule)
    dataset = sampler.as_dataset(tf_megadp.MaskedLMBatcher.from_shards(shards))
    ```
    """

    sampling_kind = "poisson"

    @staticmethod
    def step_event(entry, num_examples: int) -> dp_accounting.DpEvent:
        """One step: Poisson-sampled Gaussian, truncated at `entry.max_batch_size` if set.

        When truncation is rare, the accountant accounts a truncated step by a
        coupling bound at the cost of the untruncated one (and works with RDP);
        otherwise dp_accounting's exact PLD of the truncated mechanism is used
        (see `tf_megadp.accounting.engines._TruncationAwareAccountant`).
        """
        if entry.max_batch_size:
            return dp_accounting.TruncatedSubsampledGaussianDpEvent(
                dataset_size=num_examples,
                sampling_probability=entry.sampling_rate,
                truncated_batch_size=entry.max_batch_size,
                noise_multiplier=entry.noise_multiplier,
            )
        return dp_accounting.PoissonSampledDpEvent(
            entry.sampling_rate, dp_accounting.GaussianDpEvent(entry.noise_multiplier)
        )

    def __init__(
        self,
        shards: TokenShards,
        schedule: BatchSizeSchedule,
        *,
        seed: int | None = None,
        shared_secret: int | None = None,
        start_step: int = 0,
        end_step: int | None = None,
    ):
        super().__init__(
            shards,
            schedule,
            seed=seed,
            shared_secret=shared_secret,
            start_step=start_step,
            end_step=end_step,
        )
        self.steps_drawn = 0
        self.truncated_steps = 0
        self.truncated_examples = 0

    @classmethod
    def _schedule_for(cls, num_examples, batch_size, epochs, micro_batch_size, num_replicas,
                      truncation_probability) -> BatchSizeSchedule:
        steps = steps_for_epochs(epochs, num_examples=num_examples, batch_size=batch_size)
        return BatchSizeSchedule.for_poisson(
            [(steps, batch_size)],
            num_examples=num_examples,
            micro_batch_size=micro_batch_size,
            num_replicas=num_replicas,
            truncation_probability=(
                1e-9 if truncation_probability is None else truncation_probability
            ),
        )

    def draw(self, step: int) -> StepDraw:
        """The examples of logical step `step` (the same on every call and host).

        Args:
            step: logical step, 0-based.

        Returns:
            A `StepDraw`.
        """
        phase = self.schedule.phase_at(step)
        capacity = self.schedule.capacity(phase)
        population = self.schedule.num_examples
        rng = self._rng(0, step)
        size = int(rng.binomial(population, self.schedule.sampling_rate(step)))
        indices = _uniform_subset(rng, population, size)
        if size > capacity:
            keep = rng.choice(size, size=capacity, replace=False, shuffle=False)
            indices = indices[np.sort(keep)]
            self.truncated_steps += 1
            self.truncated_examples += size - capacity
            _warn(
                f"Poisson step {step} sampled {size} examples, more than its capacity "
                f"{capacity}; kept a uniform subset of {capacity} (truncated steps so "
                f"far: {self.truncated_steps}). The accountant covers this through "
                f"max_batch_size={capacity}; if it recurs, build the schedule with a "
                "smaller truncation_probability.",
                RuntimeWarning,
            )
        self.steps_drawn += 1
        return StepDraw(step, indices, size, capacity)


class ShuffleSampler(_Sampler):
    """Fixed-size batches from shuffled epochs. NOT what Poisson accounting assumes.

    Each epoch is a fresh random permutation of the examples; logical step t
    takes the next B_t = phase.batch_size of it (a step never straddles two
    epochs: the leftover examples of an epoch are skipped). Every example
    appears exactly once per epoch, so the batches are neither independent
    across steps nor of random size. Accountants (including tf_megadp's) can
    only report such a run *as if* it were Poisson-sampled, which understates
    its real privacy loss (Chua et al., 2024, "How Private are DP-SGD
    Implementations?"). Prefer `PoissonSampler`; use this one to compare. Its
    datasets carry `sampling="shuffle"`, so the report says so.

    Randomness follows the same rule as `PoissonSampler` (secret by default,
    `seed=` warns, `shared_secret=` for several hosts). A resumed sampler
    reshuffles the interrupted epoch with its fresh randomness. Holds one
    permutation (4 bytes per example below 2**32 examples). `from_arrays` and
    `from_records` build a schedule of E * floor(N / B) steps.

    Args:
        shards, schedule, seed, shared_secret, start_step, end_step: as in
            `PoissonSampler`.
    """

    sampling_kind = "shuffle"

    @staticmethod
    def step_event(entry, num_examples: int) -> dp_accounting.DpEvent:
        """One step, as if Poisson-sampled: no accountant covers shuffling (see `SHUFFLE_WARNING`)."""
        return dp_accounting.PoissonSampledDpEvent(
            entry.sampling_rate, dp_accounting.GaussianDpEvent(entry.noise_multiplier)
        )

    def __init__(
        self,
        shards: TokenShards,
        schedule: BatchSizeSchedule,
        *,
        seed: int | None = None,
        shared_secret: int | None = None,
        start_step: int = 0,
        end_step: int | None = None,
    ):
        super().__init__(
            shards,
            schedule,
            seed=seed,
            shared_secret=shared_secret,
            start_step=start_step,
            end_step=end_step,
        )
        _warn(
            "ShuffleSampler: fixed-size shuffled batches do not satisfy the Poisson "
            "sampling assumption of DP-SGD accounting; the reported epsilon "
            "understates the privacy loss (Chua et al., 2024). Use PoissonSampler "
            "for a guarantee that matches the number.",
            UserWarning,
        )
        self._epoch = -1
        self._permutation: np.ndarray | None = None
        # (step, epoch, offset) of the next step's first row; steps are drawn in
        # order, so positions advance incrementally from here.
        self._cursor = (0, 0, 0)

    @classmethod
    def _schedule_for(cls, num_examples, batch_size, epochs, micro_batch_size, num_replicas,
                      truncation_probability) -> BatchSizeSchedule:
        if truncation_probability is not None:
            raise ValueError("ShuffleSampler never truncates: drop truncation_probability.")
        steps = steps_for_epochs(epochs, num_examples=num_examples, batch_size=batch_size,
                                 sampling="shuffle")
        slots = micro_batch_size * num_replicas
        return BatchSizeSchedule(
            [Phase(steps, batch_size, math.ceil(batch_size / slots))],
            num_examples=num_examples,
            micro_batch_size=micro_batch_size,
            num_replicas=num_replicas,
        )

    def _position(self, step: int) -> tuple[int, int]:
        """(epoch, offset in that epoch's permutation) of the first row of `step`."""
        at, epoch, offset = self._cursor if self._cursor[0] <= step else (0, 0, 0)
        population = self.schedule.num_examples
        while True:
            size = self.schedule.phase_at(at).batch_size
            if offset + size > population:
                epoch, offset = epoch + 1, 0
            if at == step:
                self._cursor = (step, epoch, offset)
                return epoch, offset
            offset += size
            at += 1

    def draw(self, step: int) -> StepDraw:
        """The examples of step `step`: B_t consecutive entries of its epoch's permutation."""
        phase = self.schedule.phase_at(step)
        epoch, offset = self._position(step)
        if epoch != self._epoch:
            population = self.schedule.num_examples
            dtype = np.uint32 if population < 1 << 32 else np.int64
            permutation = np.arange(population, dtype=dtype)
            self._rng(1, epoch).shuffle(permutation)
            self._epoch, self._permutation = epoch, permutation
        chosen = self._permutation[offset : offset + phase.batch_size]
        indices = np.sort(chosen.astype(np.int64))
        return StepDraw(step, indices, phase.batch_size, self.schedule.capacity(phase))


SHUFFLE_WARNING = (
    "Shuffled fixed-size batches are accounted as if they were Poisson-sampled. "
    "This UNDERSTATES the real privacy loss: shuffling does not give the "
    "amplification that the accountant assumes (Chua et al., 2024, 'How Private "
    "are DP-SGD Implementations?'). Report the epsilon as a Poisson-sampling "
    "estimate, or train with Poisson sampling (the tf_megadp Poisson sampler) to "
    "get a guarantee that matches the number."
)

# The ledger codes are stored in checkpoints: they never change.
register_sampling_kind(SamplingKind("poisson", 0, PoissonSampler.step_event, truncates=True))
register_sampling_kind(SamplingKind("shuffle", 1, ShuffleSampler.step_event,
                                    warning=SHUFFLE_WARNING))
