"""Samplers that build logical batches from a memory-mapped corpus of token rows.

The accountant assumes Poisson sampling: in every logical step each of the N
examples joins the batch independently with probability q_t. `PoissonSampler`
does exactly that, in two exact stages: the step size b ~ Binomial(N, q_t),
then a uniformly random b-subset of the N rows. Rows are read by random access
from memory-mapped shard files, so a step costs memory in proportion to its
batch, never to N.

Accelerators need static shapes, so every step is emitted as exactly k_t
micro-batches of M = m * R rows (the schedule's capacity), the unused slots
filled with all-zero rows of weight 0. A step that samples more than capacity
rows keeps a uniformly random subset of capacity rows: that is the truncated
Poisson mechanism, which the accountant covers with
`TruncatedSubsampledGaussianDpEvent(max_batch_size=schedule.capacity(phase))`.
The schedule sizes capacity so that this almost never happens; when it does,
the sampler counts it and warns.

`ShuffleSampler` gives fixed-size batches from shuffled epochs for users who
want them. Its privacy is *not* what Poisson accounting reports (Chua et al.,
2024): see its docstring.

The shard store (`write_token_shards`, `TokenShards`) lives here because the
samplers are its only readers; `tf_megadp.text` writes it from raw text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import mmap
import os
import warnings
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from tf_megadp.files import atomic_write, write_json_atomically
from tf_megadp.schedules import BatchSizeSchedule

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


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


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
            `tf_megadp.text` compares it to decide whether shards can be reused.
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
        shards.append({"file": name, "rows": int(block.shape[0]), "sha256": _sha256_file(path)})

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
            if verify and _sha256_file(shard_path) != entry["sha256"]:
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


class _Sampler:
    """Shared machinery: phases from the schedule, static micro-batches, tf.data."""

    sampling_kind: str = ""

    def __init__(
        self,
        shards: TokenShards,
        schedule: BatchSizeSchedule,
        *,
        seed: int | None,
        start_step: int,
        start_micro_step: int,
        end_step: int | None,
    ):
        if not isinstance(shards, TokenShards):
            raise TypeError(f"shards must be a TokenShards, got {shards!r}.")
        if not isinstance(schedule, BatchSizeSchedule):
            raise TypeError(f"schedule must be a BatchSizeSchedule, got {schedule!r}.")
        if schedule.num_examples != len(shards):
            # The accountant's N comes from the schedule; a mismatch would
            # report the wrong sampling rate.
            raise ValueError(
                f"schedule.num_examples = {schedule.num_examples} but the corpus in "
                f"{shards.directory} has {len(shards)} sequences. Build the schedule "
                f"with num_examples=len(shards)."
            )
        end_step = schedule.total_steps if end_step is None else end_step
        if not 0 <= start_step <= end_step:
            raise ValueError(
                f"Need 0 <= start_step <= end_step, got start_step={start_step}, "
                f"end_step={end_step}."
            )
        first_k = schedule.phase_at(start_step).accumulation_steps
        if not 0 <= start_micro_step < max(first_k, 1):
            raise ValueError(
                f"start_micro_step must be in [0, {first_k}) for step {start_step}, "
                f"got {start_micro_step}."
            )
        if seed is None:
            seed = np.random.SeedSequence().entropy
        self.shards = shards
        self.schedule = schedule
        self.seed = int(seed)
        self.start_step = int(start_step)
        self.start_micro_step = int(start_micro_step)
        self.end_step = int(end_step)
        self.micro_batch_rows = schedule.micro_batch_size * schedule.num_replicas
        self._consumed = False

    def _rng(self, *key: int) -> np.random.Generator:
        # One independent stream per (kind of draw, step): resuming at any step
        # reproduces exactly the draws an uninterrupted run would have made.
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(self.seed, spawn_key=key)))

    def draw(self, step: int) -> StepDraw:
        raise NotImplementedError

    @property
    def total_micro_steps(self) -> int:
        """Micro-batches from (start_step, start_micro_step) to end_step."""
        total = sum(
            self.schedule.phase_at(step).accumulation_steps
            for step in range(self.start_step, self.end_step)
        )
        return total - self.start_micro_step if self.end_step > self.start_step else 0

    def step_micro_batches(self, draw: StepDraw) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Splits a step into its k_t static micro-batches.

        Yields:
            (rows int32 [M, L], weights float32 [M]) with M = m * R; padding
            rows are all zeros with weight 0.
        """
        size = self.micro_batch_rows
        # Read per micro-batch, so memory is O(m * R * L) however big the step.
        for start in range(0, draw.capacity, size):
            chosen = draw.indices[start : start + size]
            rows = np.zeros((size, self.shards.sequence_length), np.int32)
            rows[: chosen.size] = self.shards.read(chosen)
            weights = np.zeros(size, np.float32)
            weights[: chosen.size] = 1.0
            yield rows, weights

    def micro_batches(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """All micro-batches from the start position, in training order.

        A sampler can be consumed once: replaying its draws would reuse the
        same random batches, which the accountant does not cover.
        """
        if self._consumed:
            raise RuntimeError(
                "This sampler's batches were already consumed. Create a new sampler "
                "with start_step=int(optimizer.iterations) (and start_micro_step="
                "int(optimizer.micro_steps)) to continue; never replay draws."
            )
        self._consumed = True
        skip = self.start_micro_step
        for step in range(self.start_step, self.end_step):
            for batch in self.step_micro_batches(self.draw(step)):
                if skip:
                    skip -= 1
                    continue
                yield batch

    def as_dataset(
        self,
        map_fn: Callable[..., Any] | None = None,
        *,
        prefetch: int | None = None,
    ):
        """The micro-batches as a `tf.data.Dataset` with static shapes.

        Args:
            map_fn: optional `(rows, weights) -> element` applied per
                micro-batch (e.g. `tf_megadp.MaskedLMBatcher(...)`, which
                returns `(x, y, sample_weight)`). Without it, elements are
                `(rows int32 [M, L], weights float32 [M])`.
            prefetch: micro-batches to prepare ahead (default: AUTOTUNE).

        Returns:
            A `tf.data.Dataset` of `total_micro_steps` elements that can be
            iterated once (see `micro_batches`).
        """
        import tensorflow as tf

        rows, length = self.micro_batch_rows, self.shards.sequence_length
        dataset = tf.data.Dataset.from_generator(
            self.micro_batches,
            output_signature=(
                tf.TensorSpec([rows, length], tf.int32),
                tf.TensorSpec([rows], tf.float32),
            ),
        )
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(self.total_micro_steps))
        if map_fn is not None:
            dataset = dataset.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return dataset.prefetch(tf.data.AUTOTUNE if prefetch is None else prefetch)


class PoissonSampler(_Sampler):
    """Exact Poisson sampling of logical batches, emitted as static micro-batches.

    For logical step t with rate q_t = schedule.sampling_rate(t), the step size
    is b ~ Binomial(N, q_t) and its rows are a uniform b-subset of the corpus:
    together, every row joins every step independently with probability q_t.
    The step becomes k_t micro-batches of m * R rows; padding rows have weight
    0. If b exceeds the capacity k_t * m * R, a uniform subset of capacity rows
    is kept (truncated Poisson sampling, accounted with
    `max_batch_size = schedule.capacity(phase)`); `truncated_steps` counts
    such steps and each one raises a warning.

    The draws of step t depend only on (seed, t), so a run resumed with
    `start_step=int(optimizer.iterations)` sees exactly the batches an
    uninterrupted run would have, and the sampler, optimizer and accountant
    stay in the same phase. Randomness comes from NumPy's PCG64, which is not
    a cryptographic generator.

    Args:
        shards: the corpus, a `TokenShards`; N = len(shards) must equal
            `schedule.num_examples`.
        schedule: the `BatchSizeSchedule` shared with the optimizer and accountant.
        seed: int for reproducible draws; None draws fresh OS entropy
            (available afterwards as `sampler.seed`).
        start_step: first logical step to draw (`optimizer.iterations` on resume).
        start_micro_step: micro-batches of `start_step` already consumed
            (`optimizer.micro_steps` on resume).
        end_step: logical step to stop before; default `schedule.total_steps`.

    Example:
    ```python
    shards = tf_megadp.TokenShards("corpus/")
    schedule = tf_megadp.BatchSizeSchedule.for_poisson(
        [(50, 256), (50, 1024)], num_examples=len(shards), micro_batch_size=32)
    sampler = tf_megadp.PoissonSampler(shards, schedule, seed=0)
    dataset = sampler.as_dataset(tf_megadp.MaskedLMBatcher.from_shards(shards))
    ```
    """

    sampling_kind = "poisson"

    def __init__(
        self,
        shards: TokenShards,
        schedule: BatchSizeSchedule,
        *,
        seed: int | None = None,
        start_step: int = 0,
        start_micro_step: int = 0,
        end_step: int | None = None,
    ):
        super().__init__(
            shards,
            schedule,
            seed=seed,
            start_step=start_step,
            start_micro_step=start_micro_step,
            end_step=end_step,
        )
        self.steps_drawn = 0
        self.truncated_steps = 0
        self.truncated_examples = 0

    def draw(self, step: int) -> StepDraw:
        """The examples of logical step `step` (deterministic given the seed).

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
            warnings.warn(
                f"Poisson step {step} sampled {size} examples, more than its capacity "
                f"{capacity}; kept a uniform subset of {capacity} (truncated steps so "
                f"far: {self.truncated_steps}). The accountant covers this through "
                f"max_batch_size={capacity}; if it recurs, build the schedule with a "
                "smaller truncation_probability.",
                RuntimeWarning,
                stacklevel=2,
            )
        self.steps_drawn += 1
        return StepDraw(step, indices, size, capacity)


class ShuffleSampler(_Sampler):
    """Fixed-size batches from shuffled epochs. NOT what Poisson accounting assumes.

    Each epoch is a fresh random permutation of the corpus; logical step t
    takes the next B_t = phase.batch_size rows of it (a step never straddles
    two epochs: the leftover rows of an epoch are skipped). Every example
    appears exactly once per epoch, so the batches are neither independent
    across steps nor of random size. Accountants (including tf_megadp's) can
    only report such a run *as if* it were Poisson-sampled, which understates
    its real privacy loss (Chua et al., 2024, "How Private are DP-SGD
    Implementations?"). Prefer `PoissonSampler`; use this one to compare, and
    record it with `sampling=sampler.sampling_kind` so the report says so.

    Holds one permutation of the corpus (4 bytes per example below 2**32
    examples).

    Args:
        shards, schedule, seed, start_step, start_micro_step, end_step: as in
            `PoissonSampler`.
    """

    sampling_kind = "shuffle"

    def __init__(
        self,
        shards: TokenShards,
        schedule: BatchSizeSchedule,
        *,
        seed: int | None = None,
        start_step: int = 0,
        start_micro_step: int = 0,
        end_step: int | None = None,
    ):
        super().__init__(
            shards,
            schedule,
            seed=seed,
            start_step=start_step,
            start_micro_step=start_micro_step,
            end_step=end_step,
        )
        warnings.warn(
            "ShuffleSampler: fixed-size shuffled batches do not satisfy the Poisson "
            "sampling assumption of DP-SGD accounting; the reported epsilon "
            "understates the privacy loss (Chua et al., 2024). Use PoissonSampler "
            "for a guarantee that matches the number.",
            UserWarning,
            stacklevel=2,
        )
        self._epoch = -1
        self._permutation: np.ndarray | None = None
        # (step, epoch, offset) of the next step's first row; steps are drawn in
        # order, so positions advance incrementally from here.
        self._cursor = (0, 0, 0)

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
        """The rows of logical step `step`: B_t consecutive rows of its epoch's permutation."""
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
