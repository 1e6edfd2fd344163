"""User-level privacy: Poisson sampling of privacy units, each clipped as a whole.

In the corpora this library exists for (emails, chats, clinical notes,
support tickets) one person writes many sequences. With the sequence as
the privacy unit, epsilon bounds what one sequence risks; one person who
wrote n of them risks up to about n times that. `PrivacyUnitSampler` makes
the unit a person (a user, an account: any id the examples carry):

* every logical step Poisson-samples UNITS, each independently with
  q_t = B_t / U (B_t the expected units per step, U the number of units),
  with the exact two-stage draw and the truncation of `PoissonSampler`;
* of each sampled unit it takes at most k = `examples_per_unit` examples, a
  secret uniform choice when the unit has more (keyed by the step and the
  unit alone), and lays them out in a slot of k consecutive rows, padded
  with rows of weight 0: every micro-batch is m * R slots, m * R * k rows,
  static shapes;
* a `DPOptimizer(examples_per_unit=k)` clips each slot's SUMMED gradient to
  C (`tf_megadp.clipping.units`), so adding or removing a whole unit moves
  the un-noised sum by at most C, and the accountant composes the unit
  sampler's event over U units (`dp_event`).

Randomness follows `PoissonSampler`: secret OS entropy held in a
`tf_megadp.secret.Secret`, `seed=` warns and marks the run, `shared_secret=`
for several hosts. Examples are read by random access as in `PoissonSampler`;
the sampler holds one int64 per example (the unit order), O(N) memory.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Iterator, Self

import dp_accounting
import numpy as np

from tf_megadp.accounting.run_description import RunDescription
from tf_megadp.data.base import StepDraw
from tf_megadp.data.samplers import PoissonSampler
from tf_megadp.data.shards import TokenShards
from tf_megadp.data.sources import DataSource
from tf_megadp.data.sampler_settings import SamplerSettings
from tf_megadp.data.stores import (
    ArrayStore,
    IndexableStore,
    RecordStore,
    TokenShardStore,
    record_store,
)
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.steps import BatchSizeSchedule

__all__ = ["PrivacyUnitSampler", "units_of"]

# The spawn key of the per-unit example choice in the sampler's secret
# streams (PoissonSampler uses 0 to 3).
_EXAMPLE_CHOICE = 4


def units_of(unit_ids: Any, num_examples: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups examples by privacy unit.

    Args:
        unit_ids: one id per example (ints or strings), length N.
        num_examples: N, the examples of the data the ids describe.

    Returns:
        (order, starts, ids): the examples of unit u are
        `order[starts[u]:starts[u + 1]]` (ascending), `ids[u]` its id, for
        units in sorted id order.

    Raises:
        ValueError: the ids are not one per example.
        TypeError: the ids are not all integers or all strings (bytes): numpy
            would turn the user 1 and the user "1" into the one id "1".
    """
    ids = _unit_id_array(unit_ids)
    if ids.ndim != 1 or ids.shape[0] != num_examples:
        raise ValueError(
            f"unit_ids must hold one privacy-unit id per example: shape [{num_examples}], "
            f"got {list(ids.shape)}."
        )
    if ids.dtype.kind not in "iuUS":
        raise TypeError(
            f"unit_ids must be integers or strings (a user or account id), got dtype "
            f"{ids.dtype}."
        )
    unique, inverse = np.unique(ids, return_inverse=True)
    order = np.argsort(inverse, kind="stable").astype(np.int64)
    counts = np.bincount(inverse, minlength=unique.size)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return order, starts, unique


# The Python types a unit id may have, by the name an error shows; bool is
# refused (numpy reads True as the id 1).
_ID_TYPES = (("bool", (bool, np.bool_)), ("int", (numbers.Integral,)), ("str", (str,)),
             ("bytes", (bytes,)))


def _unit_id_array(unit_ids: Any) -> np.ndarray:
    """The ids as one numpy array of one type, or a TypeError that names the ids that clash.

    A numpy array of integers or strings is taken as it is. The ids of a list,
    a tuple or an object array are checked one by one first: `np.asarray`
    would convert mixed ints and strings to strings (and bools to ints)
    without a word, merging the distinct units 1 and "1" into one.
    """
    if isinstance(unit_ids, np.ndarray) and unit_ids.dtype != object:
        return unit_ids
    values = unit_ids.tolist() if isinstance(unit_ids, np.ndarray) else list(unit_ids)
    first_of_type: dict[str, Any] = {}
    types_by_key: dict[str, dict[str, Any]] = {}
    for value in values:
        kind = next((name for name, types in _ID_TYPES if isinstance(value, types)), None)
        if kind is None:
            raise TypeError(
                f"unit_ids must be integers or strings (a user or account id), got "
                f"{value!r} ({type(value).__name__}).")
        first_of_type.setdefault(kind, value)
        # The id numpy would make of it in an array of mixed types.
        key = value.decode("utf-8", "replace") if kind == "bytes" else (
            value if kind == "str" else str(int(value)))
        types_by_key.setdefault(key, {}).setdefault(kind, value)
    if len(first_of_type) > 1 or "bool" in first_of_type:
        clashes = [" and ".join(f"{value!r} ({kind})" for kind, value in kinds.items())
                   for kinds in types_by_key.values() if len(kinds) > 1][:5]
        found = ("; ".join(clashes) + " would become one unit" if clashes else
                 ", ".join(f"{value!r} ({kind})" for kind, value in first_of_type.items()))
        raise TypeError(
            f"unit_ids mix id types ({found}): as one array they would be converted to "
            "one type, and distinct units could merge (U too small). Give every unit id "
            "the same type, e.g. [str(i) for i in unit_ids], and no bools.")
    return np.asarray(values)


class _UnitStore(RecordStore):
    """The examples of a store grouped by unit: `num_examples` counts UNITS.

    The sampler draws units from range(num_examples); `members(u)` are the
    example rows of unit u, and `read` / `arrange` take example rows, as the
    wrapped store's do.
    """

    def __init__(self, examples: RecordStore, unit_ids: Any, privacy_unit: str):
        self.examples = examples
        self._order, self._starts, self.unit_ids = units_of(unit_ids, examples.num_examples)
        self.num_examples = int(self.unit_ids.size)
        self.noun = f"privacy units ({privacy_unit}) of {examples.num_examples:,} {examples.noun}"
        self.leaves = examples.leaves

    def members(self, unit: int) -> np.ndarray:
        return self._order[self._starts[unit]:self._starts[unit + 1]]

    def sizes(self) -> np.ndarray:
        """Examples per unit, [U]."""
        return np.diff(self._starts)

    def read(self, indices: np.ndarray) -> list[np.ndarray]:
        return self.examples.read(indices)

    def arrange(self, leaves: list[Any], weights: Any) -> Any:
        return self.examples.arrange(leaves, weights)


def _positive_integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)


class PrivacyUnitSampler(PoissonSampler):
    """Poisson sampling of privacy units (users), at most k examples of each per step.

    Logical step t samples every unit independently with probability
    q_t = schedule.sampling_rate(t) (the schedule counts UNITS: N = U units,
    B_t expected units per step, m unit slots per micro-batch and replica).
    Each sampled unit enters the step with at most `examples_per_unit` = k
    of its examples: all of them when it has at most k, otherwise a uniformly
    random k-subset drawn from the sampler's secret for (step, unit) alone.
    A unit's examples fill one slot of k consecutive rows; unused rows and
    slots are zeros of weight 0. An element of `as_dataset()` therefore has
    m * R * k rows, and `DPOptimizer(examples_per_unit=k)` clips the summed
    gradient of each slot: the privacy report then bounds what one UNIT
    risks (N = U, the unit named by `privacy_unit`).

    Choose k near a typical unit's size: examples beyond k are never used in
    a step (their unit is capped, never over-counted), and every slot costs
    k rows of compute whether the unit fills it or not.

    Args:
        shards: the corpus, a `TokenShards` (for arrays and collections of
            records use `from_arrays` / `from_records`).
        schedule: the `BatchSizeSchedule` in units: `num_examples` must be the
            number of distinct unit ids.
        unit_ids: one id per example (ints or strings), e.g. the author of
            each sequence.
        examples_per_unit: k, the most examples of one unit in a step.
        privacy_unit: the name of the unit for the report ("user", the JSONL
            field the ids came from, ...).
        seed, shared_secret, start_step, end_step: as in `PoissonSampler`.

    Example:
    ```python
    sampler = tf_megadp.PrivacyUnitSampler.from_arrays(
        x, y, unit_ids=authors, examples_per_unit=4,
        batch_size=64, epochs=3, micro_batch_size=8)   # B, m in units
    optimizer = tf_megadp.DPOptimizer(
        keras.optimizers.Adam(1e-3), l2_norm_clip=1.0, noise_multiplier=1.1,
        schedule=sampler.schedule, examples_per_unit=sampler.examples_per_unit)
    ```
    """

    def __init__(
        self,
        shards: TokenShards,
        schedule: BatchSizeSchedule,
        *,
        unit_ids: Any,
        examples_per_unit: int,
        privacy_unit: str = "user",
        **randomness: Any,
    ):
        examples_per_unit = _positive_integer("examples_per_unit", examples_per_unit)
        if not isinstance(privacy_unit, str) or not privacy_unit or privacy_unit == "example":
            raise ValueError(
                f"privacy_unit names the unit for the report (e.g. 'user'), got "
                f"{privacy_unit!r}; for the example as the unit use PoissonSampler."
            )
        examples = record_store(shards, "PrivacyUnitSampler", unit_argument=", unit_ids=...")
        store = _UnitStore(examples, unit_ids, privacy_unit)
        if isinstance(schedule, BatchSizeSchedule) and schedule.num_examples != store.num_examples:
            # The accountant's N is the number of units: any other N reports
            # the wrong sampling rate.
            raise PrivacyConfigurationError(
                f"schedule.num_examples = {schedule.num_examples} but the data has "
                f"{store.num_examples:,} privacy units ({privacy_unit}) in "
                f"{examples.num_examples:,} {examples.noun}. Build the schedule in "
                f"units: num_examples={store.num_examples}, batch_size = expected units "
                "per step, micro_batch_size = unit slots per micro-batch."
            )
        super().__init__(store, schedule, **randomness)
        self.shards = examples.shards if isinstance(examples, TokenShardStore) else None
        self.examples_per_unit = examples_per_unit
        self.privacy_unit = privacy_unit
        self.micro_batch_rows = schedule.micro_batch_size * schedule.num_replicas * examples_per_unit
        # Examples left out of their step by the cap k, over the steps drawn.
        self.capped_examples = 0

    @classmethod
    def from_arrays(
        cls,
        x: Any,
        y: Any,
        sample_weight: Any = None,
        *,
        unit_ids: Any,
        examples_per_unit: int,
        privacy_unit: str = "user",
        **settings: Any,
    ) -> Self:
        """A unit sampler over in-memory arrays; one example is one row of every array.

        Args:
            x, y, sample_weight: as in `PoissonSampler.from_arrays`.
            unit_ids, examples_per_unit, privacy_unit: as in the constructor.
            **settings: as in `PoissonSampler.from_arrays` (`batch_size`,
                `epochs`, `micro_batch_size`, `num_replicas`,
                `truncation_probability` or `schedule`; `seed`,
                `shared_secret`, `start_step`, `end_step`), in UNITS:
                `batch_size` is B, the expected units per logical step
                (q = B / U), `epochs` passes over the units (ceil(E U / B)
                steps), `micro_batch_size` unit slots per micro-batch and
                replica (m k rows).

        Returns:
            The sampler; its `as_dataset()` yields `(x, y, sample_weight)`.
        """
        return cls._over(ArrayStore(x, y, sample_weight), unit_ids, examples_per_unit,
                         privacy_unit, SamplerSettings(**settings))

    @classmethod
    def from_records(
        cls,
        records: Any,
        *,
        unit_ids: Any,
        examples_per_unit: int,
        privacy_unit: str = "user",
        **settings: Any,
    ) -> Self:
        """A unit sampler over an indexable collection of examples, read lazily.

        Args:
            records: as in `PoissonSampler.from_records`.
            unit_ids: one id per record, `len(records)` of them.
            examples_per_unit, privacy_unit, **settings: as in `from_arrays`.

        Returns:
            The sampler; its `as_dataset()` yields `(x, y, sample_weight)`.
        """
        return cls._over(IndexableStore(records), unit_ids, examples_per_unit, privacy_unit,
                         SamplerSettings(**settings))

    @classmethod
    def _over(cls, examples: RecordStore, unit_ids, examples_per_unit, privacy_unit,
              settings: SamplerSettings) -> Self:
        # The schedule counts units: N = U, B = expected units per step.
        schedule = settings.resolve_schedule(
            int(units_of(unit_ids, examples.num_examples)[2].size), cls._schedule_for,
            cls.__name__)
        return cls(examples, schedule, unit_ids=unit_ids, examples_per_unit=examples_per_unit,
                   privacy_unit=privacy_unit, **settings.randomness())

    # -- What the accountant is told ---------------------------------------------

    @property
    def num_units(self) -> int:
        """U, the number of privacy units (the accountant's N)."""
        return self._store.num_examples

    def unit_sizes(self) -> np.ndarray:
        """Examples per unit, [U], in the order of sorted unit ids."""
        return self._store.sizes()

    @property
    def description(self) -> str:
        return (f"{type(self).__name__} over {self._store.num_examples:,} "
                f"{self._store.noun}, at most {self.examples_per_unit} per unit and step")

    @property
    def source(self) -> DataSource:
        """The `DataSource`: N is the number of units, and it names the unit and k."""
        return dataclasses.replace(super().source, privacy_unit=self.privacy_unit,
                                   examples_per_unit=self.examples_per_unit)

    def dp_event(self, noise_multiplier: float | None = None,
                 steps: int | None = None, noise=None) -> dp_accounting.DpEvent:
        """The run's `dp_accounting` event over units.

        Each step is Poisson sampling of the U units with q_t (of one group
        of U / L at q_t L with `cycle_length` L), truncated at the step's
        capacity in units, followed by the Gaussian mechanism of sensitivity
        C (a unit's clipped summed gradient), independent or correlated.

        Args:
            noise_multiplier: sigma for phases that set none.
            steps: logical steps (default: the schedule's).
            noise: None (independent noise), or the run's `tf_megadp.BandMF`.

        Returns:
            A `dp_accounting.ComposedDpEvent`.
        """
        return RunDescription(schedule=self.schedule, noise_multiplier=noise_multiplier,
                              steps=steps, cycle_length=self.cycle_length,
                              noise=noise).dp_event()

    # -- Micro-batches -------------------------------------------------------------

    def unit_examples(self, step: int, unit: int) -> np.ndarray:
        """The examples of `unit` that enter logical step `step` (at most k, ascending).

        A unit with more than k examples gets a uniform k-subset drawn from
        the sampler's secret for (step, unit): it depends on no other unit.
        """
        members = self._store.members(unit)
        k = self.examples_per_unit
        if members.size <= k:
            return members
        choice = self._step_rng(_EXAMPLE_CHOICE, step, unit).choice(
            members.size, size=k, replace=False, shuffle=False)
        return members[np.sort(choice)]

    def step_micro_batches(self, draw: StepDraw) -> Iterator[Any]:
        """Splits a step into k_t micro-batches of m * R unit slots of k rows each.

        Yields:
            As `PoissonSampler.step_micro_batches`, with m * R * k rows: slot
            s is rows [s k, (s + 1) k), its unit's examples first, then
            padding rows (zeros, weight 0).
        """
        k = self.examples_per_unit
        rows = self.micro_batch_rows
        slots = rows // k
        for start in range(0, draw.capacity, slots):
            chosen = draw.indices[start:start + slots]
            example_rows = np.full(rows, -1, np.int64)
            for slot, unit in enumerate(chosen):
                members = self.unit_examples(draw.step, int(unit))
                self.capped_examples += self._store.members(int(unit)).size - members.size
                example_rows[slot * k: slot * k + members.size] = members
            yield self._padded_element(example_rows)

