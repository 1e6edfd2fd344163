"""What `fit` (or a custom loop) is fed, measured where it can be.

A tf_megadp sampler's dataset carries its `DataSource`; for arrays, N is the
number of distinct real examples (rows with a non-zero sample weight,
copies counted once), and the batches are fixed-size.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import warnings

import keras
import numpy as np
import tensorflow as tf

from tf_megadp.data import sources

__all__ = ["array_micro_batch_size", "data_identity", "distinct_real_examples", "fit_source",
           "is_array_input"]


def is_array_input(x) -> bool:
    """Whether `x` is arrays (a nest of array-likes with a leading dimension), not a dataset."""
    if x is None or isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)):
        return False
    leaves = tf.nest.flatten(x)
    return bool(leaves) and all(
        hasattr(leaf, "shape") and hasattr(leaf, "dtype") and len(leaf.shape) > 0
        and not isinstance(leaf, tf.data.Dataset)
        for leaf in leaves
    )


def fit_source(arguments) -> sources.DataSource | None:
    """What `fit` is fed, measured where it can be (see `tf_megadp.data.sources`)."""
    x = arguments.get("x")
    source = sources.source_of(x)
    if source is None:
        sources.refuse_repeated(x)
    if source is not None or not is_array_input(x):
        return source
    rows = int(tf.nest.flatten(x)[0].shape[0])
    split = float(arguments.get("validation_split") or 0.0)
    if split:
        # Keras trains on the first floor(N * (1 - split)) rows.
        rows = int(math.floor(rows * (1.0 - split)))
    examples = distinct_real_examples(x, arguments.get("y"), arguments.get("sample_weight"), rows)
    counted = f"{examples} examples"
    if examples != rows:
        counted += (f" (the distinct rows with a non-zero sample weight, of {rows} rows: "
                    "padding and repeated rows are not examples)")
        warnings.warn(
            f"The arrays passed to fit have {rows} rows but {examples} distinct examples: "
            "rows whose sample weights are all zero (padding) and copies of a row are not "
            "counted in N. If they are a sampler's output collected into arrays, feed "
            "sampler.as_dataset() to fit instead: its steps are Poisson draws.",
            UserWarning, stacklevel=3)
    batch_size = array_micro_batch_size(arguments)
    order = "shuffled" if arguments.get("shuffle", True) else "in order"
    return sources.DataSource(
        sampling=sources.FIXED_SIZE_SAMPLING,
        num_examples=examples,
        num_examples_measured=True,
        description=f"arrays passed to fit: {counted} in fixed-size batches "
                    f"of {batch_size}, {order}",
    )


# Rows are hashed in blocks, so that measuring N never copies the whole data.
_HASH_BLOCK_ROWS = 4096


def distinct_real_examples(x, y, sample_weight, rows: int) -> int:
    """N of array inputs: distinct rows among the first `rows` with a non-zero weight.

    A row whose sample weights are all zero is padding (it contributes
    nothing to any step), and a copy of a row is the same example again (a
    sampler's steps collected into arrays repeat the examples they drew).
    Counting either would overstate N and understate epsilon. Rows are
    compared through a 64-bit hash of all their values: a collision can
    only merge two examples, which makes N smaller and epsilon larger, never
    the reverse.
    """
    leaves = [np.asarray(leaf) for leaf in tf.nest.flatten((x, y, sample_weight))
              if leaf is not None]
    weights = [np.asarray(w) for w in tf.nest.flatten(sample_weight) if w is not None]
    factors = {}  # per leaf: one odd multiplier per 8-byte word of a row
    digests = []
    for start in range(0, rows, _HASH_BLOCK_ROWS):
        stop = min(start + _HASH_BLOCK_ROWS, rows)
        real = np.ones(stop - start, bool)
        if weights:
            real[:] = False
            for w in weights:
                real |= np.any(w[start:stop].reshape(stop - start, -1) != 0, axis=1)
        digest = np.zeros(stop - start, np.uint64)
        for index, leaf in enumerate(leaves):
            block = leaf[start:stop]
            if block.dtype.kind == "O":
                block = block.astype(str)
            raw = np.ascontiguousarray(block).reshape(stop - start, -1).view(np.uint8)
            words = np.pad(raw, [(0, 0), (0, -raw.shape[1] % 8)]).view(np.uint64)
            if index not in factors:
                factors[index] = np.random.default_rng(index).integers(
                    0, 2**63, words.shape[1], dtype=np.uint64) * np.uint64(2) + np.uint64(1)
            # Wraps modulo 2**64 on purpose: a random linear hash of the row's words.
            with np.errstate(over="ignore"):
                digest = digest * np.uint64(0x9E3779B97F4A7C15) + (
                    words * factors[index]).sum(axis=1, dtype=np.uint64)
        digests.append(digest[real])
    return int(np.unique(np.concatenate(digests)).size) if digests else 0


def array_micro_batch_size(arguments) -> int | None:
    """The micro-batch size `fit` cuts arrays into (None for other data)."""
    if not is_array_input(arguments.get("x")):
        return None
    # Keras's default batch size for arrays.
    return int(arguments.get("batch_size") or 32)


# The attribute that names a dataset object for `data_identity`.
_IDENTITY = "_tf_megadp_data_identity"


def data_identity(arguments) -> bytes | None:
    """Which data a `fit` reads, for `clipping.verdicts`: equal only for the same data.

    Arrays (NumPy or tensors, nested): a digest of every value, shape and
    dtype of `x`, `y` and `sample_weight` with the batch size and the
    validation split, so arrays changed in place are other data. A
    `tf.data.Dataset` (a sampler's or not) or a distributed dataset: the
    object itself (a random name set on it once; a dataset built again,
    even of the same arrays, is other data). Anything else (a Python
    generator, a `PyDataset`): None, which equals nothing.

    Args:
        arguments: `fit`'s arguments by name.

    Returns:
        A digest, or None.
    """
    x = arguments.get("x")
    if is_array_input(x):
        digest = hashlib.blake2b(digest_size=16)
        digest.update(f"{array_micro_batch_size(arguments)} "
                      f"{arguments.get('validation_split') or 0.0};".encode())
        for part in ("x", "y", "sample_weight"):
            for leaf in tf.nest.flatten(arguments.get(part)):
                value = np.ascontiguousarray(np.asarray(leaf))
                digest.update(f"{part} {value.dtype} {value.shape};".encode())
                digest.update(value.astype(str).tobytes() if value.dtype.kind == "O"
                              else value.tobytes())
        return b"arrays" + digest.digest()
    if isinstance(x, (tf.data.Dataset, tf.distribute.DistributedDataset)):
        identity = getattr(x, _IDENTITY, None)
        if identity is None:
            identity = secrets.token_bytes(16)
            setattr(x, _IDENTITY, identity)
        return b"dataset" + identity
    return None
