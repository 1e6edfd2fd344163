"""Record stores: what a sampler reads examples from.

One sampler implementation serves every kind of data. A store says how many
examples there are (N, measured), the per-example shape and dtype of each of
its leaves, how to read some examples, and how a padded micro-batch is laid
out as the element `fit` receives. The sampler does everything else (the
draw, truncation, padding, tf.data), so the privacy-relevant code exists once.
"""

from __future__ import annotations

import abc
from typing import Any, Callable

import numpy as np

from tf_megadp.data.shards import TokenShards
from tf_megadp.errors import PrivacyConfigurationError

__all__ = ["ArrayStore", "IndexableStore", "RecordStore", "TokenShardStore", "record_store"]


class RecordStore(abc.ABC):
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


class TokenShardStore(RecordStore):
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


def record_store(data: Any, sampler: str, unit_argument: str = "") -> RecordStore:
    """The store a sampler's constructor reads: `TokenShards`, or a store `from_arrays`/`from_records` built.

    Args:
        data: what the constructor was given.
        sampler: the sampler's class name, for the error.
        unit_argument: a required argument the error names (", unit_ids=...").

    Returns:
        The `RecordStore`.

    Raises:
        TypeError: anything else, naming `from_arrays` and `from_records`.
    """
    if isinstance(data, TokenShards):
        return TokenShardStore(data)
    if isinstance(data, RecordStore):
        return data
    raise TypeError(
        f"{sampler} takes a TokenShards; got {type(data).__name__}. For arrays use "
        f"{sampler}.from_arrays(x, y{unit_argument}, ...), for a collection of examples "
        f"{sampler}.from_records(records{unit_argument}, ...)."
    )


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


class _ExampleStore(RecordStore):
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


class ArrayStore(_ExampleStore):
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


class IndexableStore(_ExampleStore):
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
