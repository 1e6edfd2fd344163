"""The token-shard store: token rows as memory-mapped `.npy` shards plus a JSON manifest.

The samplers read it by random access (`TokenShards.read`); the BERT job
(`tf_megadp.jobs.bert.text`) writes it from raw text with `write_token_shards`.
"""

from __future__ import annotations

import json
import mmap
import os
from typing import Any, Iterable

import numpy as np

from tf_megadp.files import atomic_write, sha256_of_file, write_json_atomically

__all__ = ["MANIFEST_NAME", "TokenShards", "token_dtype", "write_token_shards"]

MANIFEST_NAME = "manifest.json"
_MANIFEST_FORMAT = "tf_megadp.token_shards/1"
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
                "(tf_megadp.write_token_shards, or the BERT job's "
                "tf_megadp.jobs.bert.text.prepare_corpus)."
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
