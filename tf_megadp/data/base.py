"""The sampler machinery every sampler shares: secret randomness, phases, static micro-batches, tf.data.

A sampler subclass draws the examples of one logical step (`draw`), builds
the schedule `from_arrays`/`from_records` use (`_schedule_for`) and names
its sampling kind, whose `dp_accounting` event is registered once in
`tf_megadp.accounting.events`.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import secrets
from typing import Any, Callable, Iterator, Self

import numpy as np

from tf_megadp.data.entropy import non_negative_integer, sampling_entropy
from tf_megadp.data.map_independence import checked_map
from tf_megadp.data.sampler_settings import SamplerSettings
from tf_megadp.data.shards import TokenShards
from tf_megadp.data.sources import DataSource, attach_source
from tf_megadp.data.stores import (
    ArrayStore,
    IndexableStore,
    RecordStore,
    TokenShardStore,
    record_store,
)
from tf_megadp.data.tags import attach_tag_key, row_tags
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.secret import Secret
from tf_megadp.steps import BatchSizeSchedule, step_capacity

__all__ = ["StepDraw"]


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


class _DrawGenerations:
    """Which generation of a sampler's per-step streams the next draws use (in memory only).

    A sampler and its continuations (`_continued_at`, after a preemption
    backup restored the run in the same process) share one: a step drawn
    at or below the last step already drawn is a replay, and opens a new
    generation, so that its Poisson draw, its `map_fn` key and its check
    choices are new (identical draws with fresh noise are two releases the
    accountant treats as independent). A new sampler, as in a new process,
    starts at generation 0 and draws what the first run drew.
    """

    __slots__ = ("generation", "_last_step")

    def __init__(self):
        self.generation = 0
        self._last_step = -1

    def begin(self, step: int) -> None:
        if step <= self._last_step:
            self.generation += 1
        self._last_step = step


def _takes_keyword_only(function: Callable[..., Any], name: str) -> bool:
    """Whether `function` has a keyword-only parameter `name`."""
    try:
        parameter = inspect.signature(function).parameters.get(name)
    except (TypeError, ValueError):  # no signature to read
        return False
    return parameter is not None and parameter.kind is inspect.Parameter.KEYWORD_ONLY


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    return int(value)


def _tensor_spec(shape: tuple[int, ...], dtype: np.dtype):
    import tensorflow as tf

    return tf.TensorSpec(shape, tf.string if dtype.kind in "US" else tf.as_dtype(dtype))


class Sampler(abc.ABC):
    """Shared machinery: secret randomness, phases, static micro-batches, tf.data."""

    sampling_kind: str = ""
    # Whether the sampler draws cyclically (`SamplerSettings.cycle_length`).
    takes_cycles: bool = False

    def __init__(self, shards: TokenShards, schedule: BatchSizeSchedule, **randomness: Any):
        """A sampler over `shards` that follows `schedule`.

        Args:
            shards: the corpus, a `TokenShards` (arrays and records go
                through `from_arrays` / `from_records`).
            schedule: the `BatchSizeSchedule` shared with the optimizer and
                the accountant; its N must be the data's.
            **randomness: `seed`, `shared_secret`, `start_step`, `end_step`,
                `cycle_length`, as in
                `tf_megadp.data.sampler_settings.SamplerSettings`.
        """
        store = record_store(shards, type(self).__name__)
        if not isinstance(schedule, BatchSizeSchedule):
            raise TypeError(f"schedule must be a BatchSizeSchedule, got {schedule!r}.")
        settings = SamplerSettings(schedule=schedule, **randomness)
        if schedule.num_examples != store.num_examples:
            # The accountant's N comes from the schedule; a mismatch would
            # report the wrong sampling rate.
            raise PrivacyConfigurationError(
                f"schedule.num_examples = {schedule.num_examples} but the data has "
                f"{store.num_examples:,} {store.noun}. Build the schedule with "
                f"num_examples=len(shards) (N = {store.num_examples}), or let "
                "from_arrays/from_records build it from batch_size and epochs."
            )
        start_step = non_negative_integer("start_step", settings.start_step)
        end_step = schedule.total_steps if settings.end_step is None else settings.end_step
        end_step = non_negative_integer("end_step", end_step)
        if start_step > end_step:
            raise ValueError(
                f"Need 0 <= start_step <= end_step, got start_step={start_step}, "
                f"end_step={end_step}."
            )
        self._store = store
        self.shards = store.shards if isinstance(store, TokenShardStore) else None
        self.schedule = schedule
        self.start_step = start_step
        self.end_step = end_step
        self.micro_batch_rows = step_capacity(1, schedule.micro_batch_size, schedule.num_replicas)
        self.cycle_length = 1 if settings.cycle_length is None else _positive(
            "cycle_length", settings.cycle_length)
        if self.cycle_length > 1 and not self.takes_cycles:
            raise PrivacyConfigurationError(
                f"{type(self).__name__} has no cycles (cycle_length={self.cycle_length}): "
                "cyclic sampling is Poisson sampling of one group of examples per step. Use "
                "tf_megadp.PoissonSampler (or PrivacyUnitSampler) with cycle_length, or drop "
                "cycle_length.")
        # A public name for this sampler's secret assignment of examples to
        # steps (its groups or its order), shared by its continuations: a
        # noise segment continues only over the data it was drawing. Random,
        # so it says nothing of the secret.
        self.assignment = secrets.token_hex(8)
        self._consumed = False
        self._generations = _DrawGenerations()
        entropy, self.seeded = sampling_entropy(settings.seed, settings.shared_secret)
        # The only copy of the sampling randomness, in a holder that neither
        # vars(), repr, pickles nor the DataSource show. Set last, so that no
        # traceback of a failed constructor has it in a frame's locals.
        self._entropy = Secret(entropy)

    @classmethod
    def from_arrays(cls, x: Any, y: Any, sample_weight: Any = None, **settings: Any) -> Self:
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
            **settings: the fields of
                `tf_megadp.data.sampler_settings.SamplerSettings`: `batch_size`
                (B, q = B / N), `epochs` (E > 0, may be fractional: the run has
                ceil(E * N / B) logical steps), `micro_batch_size` (m),
                `num_replicas` (R, default 1: each element holds m * R rows),
                `truncation_probability` (Poisson: per-step bound on
                P[b > capacity] that sizes k, default 1e-9), or an explicit
                `schedule` instead of those five; and `seed`,
                `shared_secret`, `start_step`, `end_step` as in the
                constructor.

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
        return cls._from_store(ArrayStore(x, y, sample_weight), SamplerSettings(**settings))

    @classmethod
    def from_records(cls, records: Any, **settings: Any) -> Self:
        """A sampler over any indexable collection of examples, read lazily.

        `records` needs `len(records)` (N) and `records[i]` returning example
        i as `(x_i, y_i)` or `(x_i, y_i, sample_weight_i)`, where x_i is an
        array or a dict/tuple of arrays. All records must have the same
        structure, shapes and dtypes as record 0. Only sampled records are read.

        Args:
            records: e.g. a list of `(x_i, y_i)` pairs or a class reading
                examples from disk. Not a `keras.utils.PyDataset` (its items
                are batches).
            **settings: as in `from_arrays`.

        Returns:
            The sampler; its `as_dataset()` yields `(x, y, sample_weight)`.

        Example:
        ```python
        pairs = [(image, label) for image, label in my_examples]
        sampler = tf_megadp.PoissonSampler.from_records(
            pairs, batch_size=256, epochs=3, micro_batch_size=32)
        ```
        """
        return cls._from_store(IndexableStore(records), SamplerSettings(**settings))

    @classmethod
    def _from_store(cls, store: RecordStore, settings: SamplerSettings) -> Self:
        schedule = settings.resolve_schedule(store.num_examples, cls._schedule_for, cls.__name__)
        return cls(store, schedule, **settings.randomness())

    @classmethod
    @abc.abstractmethod
    def _schedule_for(cls, num_examples: int, settings: SamplerSettings) -> BatchSizeSchedule:
        """The schedule `from_arrays`/`from_records` build from checked batch_size and epochs."""

    # -- Randomness ------------------------------------------------------------

    def _rng(self, *key: int) -> np.random.Generator:
        # One independent stream per key: the draws depend only on (entropy,
        # key), so hosts sharing a secret draw the same steps.
        sequence = np.random.SeedSequence(self._entropy.value, spawn_key=key)
        return np.random.Generator(np.random.PCG64(sequence))

    def _step_rng(self, kind: int, step: int, *more: int) -> np.random.Generator:
        """The stream of one kind of draw of logical step `step`, in the current generation.

        Generation 0 (every step of a run that is not replayed in the same
        process) keeps the key (kind, step, ...); a replayed step's streams
        also fold in its generation (see `_DrawGenerations`).
        """
        generation = self._generations.generation
        return self._rng(kind, step, *more, *((generation,) if generation else ()))

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
            cycle_length=self.cycle_length,
            assignment=self.assignment,
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
        # Read per micro-batch, so memory is O(m * R) rows however big the step.
        for start in range(0, draw.capacity, size):
            chosen = draw.indices[start : start + size]
            rows = np.full(size, -1, np.int64)
            rows[: chosen.size] = chosen
            yield self._padded_element(rows)

    def _padded_element(self, rows: np.ndarray) -> Any:
        """The element whose row j is example `rows[j]`, or padding (zeros, weight 0) where -1."""
        real = rows >= 0
        padded = []
        for (shape, dtype), values in zip(self._store.leaves, self._store.read(rows[real])):
            # Strings keep their own width (a narrower one would cut them).
            block = np.zeros((rows.size, *shape), values.dtype if dtype.kind in "US" else dtype)
            block[real] = values
            padded.append(block)
        return self._store.arrange(padded, real.astype(np.float32))

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
            self._generations.begin(step)
            for element in self.step_micro_batches(self.draw(step)):
                yield step, element

    def _pipeline_elements(self, mapped: bool = True, tagged: bool = False) -> Iterator[Any]:
        """Every micro-batch, with what the pipeline's maps need to ride along it as data.

        With a `map_fn` (`mapped`): its step's key and whether the `map_fn`
        check runs on it. The check runs on the first micro-batch of the
        dataset and on each later one with the model check's
        `RECHECK_PROBABILITY`, decided by the sampler's secret: no example
        can time its mixing to unchecked ones. With `tagged`: its position
        (logical step, micro-step within it) and the tag key, from which the
        pipeline computes its tags (`tf_megadp.data.tags`).
        """
        from tf_megadp.clipping.independence import RECHECK_PROBABILITY

        step = key = choices = None
        micro_step = 0
        tag_key = self.tag_key.value if tagged else None
        for position, (current, element) in enumerate(self._micro_batches_by_step()):
            if current != step:
                step, micro_step = current, 0
                if mapped:
                    key, choices = self._step_key(current), self._step_rng(3, current)
            parts = (element,)
            if mapped:
                parts += (key, position == 0 or choices.random() < RECHECK_PROBABILITY)
            if tagged:
                parts += (np.array([current, micro_step], np.int64), tag_key)
            micro_step += 1
            yield parts

    @property
    def tag_key(self) -> Secret:
        """The key of this sampler's micro-batch tags (`tf_megadp.data.tags`), int64 [2].

        Drawn from the sampler's secret (its own stream), so hosts sharing
        the secret tag alike. A `PrivateStep` begun with this sampler takes
        it; never log or store it (whoever holds it can tag other data).
        """
        return Secret(self._rng(4, 0).integers(0, 2**63, size=2, dtype=np.int64))

    def _step_key(self, step: int) -> np.ndarray:
        """The key of logical step `step` for a `map_fn`'s stateless draws: int64 [2].

        Drawn from the sampler's secret (its own stream, independent of the
        draws), so a `map_fn`'s randomness is as secret as the sampling and,
        like the draws, the same on every host sharing the secret.
        """
        return self._step_rng(2, step).integers(0, 2**63, size=2, dtype=np.int64)

    def as_dataset(
        self,
        map_fn: Callable[..., Any] | None = None,
        *,
        parallel_map: bool = False,
        prefetch: int | None = None,
        tagged: bool = False,
    ):
        """The micro-batches as a `tf.data.Dataset` with static shapes, carrying its `DataSource`.

        Pass the returned dataset to `fit` as it is: `fit` reads its
        `DataSource` (`tf_megadp.data.sources.source_of`) and refuses a dataset
        derived from it (`cache`, `repeat`, `map`, `take`, ...), which could
        replay or mix the draws. Per-micro-batch processing goes in `map_fn`.

        Args:
            map_fn: optional function applied to each element (its parts as
                arguments), e.g. the BERT job's `MaskedLMBatcher` on token
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
            tagged: for a custom loop's `tf_megadp.PrivateStep`: every
                element becomes `(batch, tag)`, `tag` int64 [m * R], the
                secret mark by which the step knows each row is this
                sampler's, unchanged, at its place in the run
                (`tf_megadp.data.tags`: a keyed hash of the row after
                `map_fn`). A step begun with this sampler refuses
                micro-batches whose rows do not match their tags, so
                per-micro-batch processing goes in `map_fn`, as for `fit`.
                `fit` takes the untagged dataset.

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
        if map_fn is None and not tagged:
            dataset = tf.data.Dataset.from_generator(self.micro_batches,
                                                     output_signature=signature)
        else:
            # The keys, the check flag and the position ride along each
            # element as data, never as constants of the dataset graph, so
            # each micro-batch gets its own however the map is scheduled.
            key_spec = tf.TensorSpec([2], tf.int64)
            extra = (key_spec, tf.TensorSpec([], tf.bool)) if map_fn is not None else ()
            extra += (key_spec, key_spec) if tagged else ()
            dataset = tf.data.Dataset.from_generator(
                lambda: self._pipeline_elements(map_fn is not None, tagged),
                output_signature=(signature, *extra))
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(self.total_micro_steps))
        if map_fn is not None:
            keyed = _takes_keyword_only(map_fn, "key")

            def call(element, key):
                return map_fn(*element, key=key) if keyed else map_fn(*element)

            function = checked_map(call, rows)
            if tagged:
                checked, function = function, lambda element, key, check, position, tag_key: (
                    checked(element, key, check), position, tag_key)
            if parallel_map:
                dataset = dataset.map(function, num_parallel_calls=tf.data.AUTOTUNE,
                                      deterministic=True)
            else:
                dataset = dataset.map(function)
        if tagged:
            # After the map_fn (and its independence check): the tags bind
            # the rows the model will read.
            dataset = dataset.map(lambda element, position, tag_key: (
                element, row_tags(tag_key, position[0], position[1], element, 0, rows)))
        dataset = dataset.prefetch(tf.data.AUTOTUNE if prefetch is None else prefetch)

        def resume(step: int):
            return self._continued_at(step).as_dataset(
                map_fn, parallel_map=parallel_map, prefetch=prefetch, tagged=tagged)

        marked = attach_source(dataset, self.source, resume=resume)
        return attach_tag_key(marked, self.tag_key) if tagged else marked

    def _continued_at(self, step: int) -> Self:
        """This sampler from logical step `step` on: same data, schedule, end and randomness.

        Used when a preemption backup restores the run at `step`
        (`tf_megadp.data.sources.resumed_at`). The steps from `step` on were
        never applied to the restored weights, so drawing them is what an
        uninterrupted run would have done. Steps this process drew already
        (the run crashed after them and `fit` was called again) are drawn
        afresh: the continuation shares this sampler's draw generations.
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
