"""The privacy ledger: the logical steps a run has taken, as phases of identical steps.

The `DPOptimizer` stores a ledger in its `privacy_ledger` variable as the
JSON of `PrivacyLedger.to_list` (`to_json`), so a checkpoint carries what
the run has spent in the same form as a report or a weights file's record
(`tf_megadp.run.provenance`); `ledger_from_schedule` describes a planned
run the same way (`tf_megadp.accounting.run_description.RunDescription.ledger`).

The format does not depend on the noise mechanism: an entry's noise is one
serialized record (`NoiseStrategy.record`) that its mechanism reads back
(`noise.read_noise_record`), whatever the mechanism's numbers are.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Iterable, Iterator

import numpy as np

from tf_megadp.accounting import mechanisms
from tf_megadp.accounting.events import check_segment_fields, sampling_kind
from tf_megadp.accounting.noise import NoiseMechanism, default_noise, read_noise_record
from tf_megadp.steps import BatchSizeSchedule, noise_multiplier_of, sampling_rate_of

__all__ = ["DEFAULT_NOISE_RECORD", "LedgerEntry", "PrivacyLedger", "ledger_from_schedule"]

# The record of the noise of a run that names none (DP-SGD's), and of the
# steps-only kinds' entries.
DEFAULT_NOISE_RECORD = default_noise().resolve(1).record()
# The fields of a noise segment's sampling, with their values for the kinds
# accounted step by step and for the steps-only kinds.
_SEGMENT_DEFAULTS = {"cycle_length": 0, "cycle_position": 0, "steps_per_epoch": 0,
                     "participations": 0, "sensitivity": 0.0, "segment_start": False}


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    """A run of identical logical steps, as the accountant sees them.

    Args:
        steps: number of logical steps (>= 0).
        sampling_rate: q = B / N, the probability that one example joins a
            step; in (0, 1] (0 for a steps-only kind).
        noise_multiplier: sigma, the noise standard deviation divided by the
            clipping norm; > 0 (0 for a steps-only kind).
        max_batch_size: the static maximum at which a Poisson step is
            truncated, or 0 for an untruncated Poisson step.
        sampling: a registered kind (`tf_megadp.accounting.events`):
            ``"poisson"`` or ``"shuffle"``, or one of the ledger's
            steps-only kinds ``"noiseless"`` (steps without noise) and
            ``"unaccounted"`` (steps on unknown data), which the accountant
            refuses and `LedgerEntry.steps_only` builds.
        count_noise_multiplier: with adaptive clipping, the noise
            multiplier of the count of unclipped examples each step also
            releases (its noise over its sensitivity 1/2; see
            `tf_megadp.accounting.mechanisms`), and `noise_multiplier` is the
            gradient's; 0 when the step releases the gradient only.
        noise: the gradient noise's record (`NoiseStrategy.record`, JSON
            text): its mechanism's kind and parameters and, for a strategy
            other than C = I, the hash of the strategy it streamed
            (`tf_megadp.accounting.noise`; `noise_multiplier` is sigma on
            the unit-norm C). Read back, and its sampling checked, by its
            mechanism. Default: DP-SGD's (`DEFAULT_NOISE_RECORD`).
        cycle_length: L of cyclic Poisson sampling ("cyclic_poisson"); 0
            for every other kind.
        cycle_position: cyclic Poisson: the group (t mod L) of the entry's
            first step.
        steps_per_epoch: s of a fixed-order pass ("fixed_order"); 0 otherwise.
        participations: a fixed-order segment's planned epochs k' (the most
            steps one example joins in it); 0 otherwise.
        sensitivity: a fixed-order segment's sensitivity of C over its
            planned steps (units of C_clip); 0 otherwise.
        segment_start: the entry's first step opened a new noise segment
            (fresh buffers: the first step of a run, after a restart or a
            restore, or with other data); the kinds accounted by segment
            (`SamplingKind.segment_event`) compose the segments. False for
            the kinds accounted step by step.
    """

    steps: int
    sampling_rate: float
    noise_multiplier: float
    max_batch_size: int = 0
    sampling: str = "poisson"
    count_noise_multiplier: float = 0.0
    noise: str = DEFAULT_NOISE_RECORD
    cycle_length: int = 0
    cycle_position: int = 0
    steps_per_epoch: int = 0
    participations: int = 0
    sensitivity: float = 0.0
    segment_start: bool = False

    def __post_init__(self):
        if isinstance(self.steps, bool) or not isinstance(
            self.steps, (int, np.integer)
        ):
            raise ValueError(f"steps must be an integer, got {self.steps!r}.")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}.")
        if sampling_kind(self.sampling).steps_only:
            self._check_steps_only()
        else:
            self._check_mechanism()
        # Normalise numpy scalars so that entries compare and serialise alike.
        for name in ("cycle_length", "cycle_position", "steps_per_epoch", "participations"):
            object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "sensitivity", float(self.sensitivity))
        object.__setattr__(self, "segment_start", bool(self.segment_start))
        object.__setattr__(self, "count_noise_multiplier", float(self.count_noise_multiplier))
        object.__setattr__(self, "steps", int(self.steps))
        object.__setattr__(self, "sampling_rate", float(self.sampling_rate))
        object.__setattr__(self, "noise_multiplier", float(self.noise_multiplier))
        object.__setattr__(self, "max_batch_size", int(self.max_batch_size))

    @classmethod
    def steps_only(cls, steps: int, sampling: str) -> "LedgerEntry":
        """`steps` steps of a steps-only kind (`events.NOISELESS`, `events.UNACCOUNTED`).

        Args:
            steps: how many logical steps.
            sampling: the kind.

        Returns:
            The entry, with every number but `steps` 0.
        """
        return cls(steps, 0.0, 0.0, 0, sampling)

    def _check_steps_only(self) -> None:
        """A steps-only kind's entry has no mechanism: any number but steps would be invented."""
        numbers = (self.sampling_rate, self.noise_multiplier, self.max_batch_size,
                   self.count_noise_multiplier) + tuple(
            getattr(self, name) for name in _SEGMENT_DEFAULTS)
        if any(float(value) != 0.0 for value in numbers) or self.noise != DEFAULT_NOISE_RECORD:
            raise ValueError(
                f"A {self.sampling!r} ledger entry records a count of steps only; its "
                "sampling_rate, noise_multiplier, max_batch_size and "
                f"count_noise_multiplier are 0, got {numbers}. Use "
                f"LedgerEntry.steps_only(steps, {self.sampling!r}).")

    def _check_mechanism(self) -> None:
        """The numbers of a subsampled Gaussian step: q in (0, 1], sigma > 0, truncation."""
        q = float(self.sampling_rate)
        if not math.isfinite(q) or q <= 0.0:
            raise ValueError(
                f"sampling_rate must be in (0, 1], got {self.sampling_rate!r}."
            )
        if q > 1.0:
            raise ValueError(
                f"sampling_rate q = B / N = {q:g} is larger than 1: the batch size "
                "cannot exceed the number of examples. Check num_examples and "
                "batch_size."
            )
        sigma = float(self.noise_multiplier)
        if not math.isfinite(sigma) or sigma <= 0.0:
            raise ValueError(
                f"noise_multiplier must be a finite number > 0 for a private run, "
                f"got {self.noise_multiplier!r}. With noise_multiplier = 0 the run "
                "is not differentially private (epsilon is infinite)."
            )
        if (
            isinstance(self.max_batch_size, bool)
            or not isinstance(self.max_batch_size, (int, np.integer))
            or self.max_batch_size < 0
        ):
            raise ValueError(
                "max_batch_size must be an integer >= 0 (0 = no truncation), got "
                f"{self.max_batch_size!r}."
            )
        if not sampling_kind(self.sampling).truncates and self.max_batch_size:
            raise ValueError(
                f"max_batch_size only applies to Poisson sampling; {self.sampling} "
                "batches have a fixed size. Pass max_batch_size=0."
            )
        count = float(self.count_noise_multiplier)
        if not math.isfinite(count) or count < 0.0:
            raise ValueError(
                "count_noise_multiplier must be a finite number >= 0 (0: no count), got "
                f"{self.count_noise_multiplier!r}.")
        # The noise record is read back by its own mechanism, which refuses a
        # sampling it has no proof for; the sampling kind checks its fields.
        mechanism, _ = read_noise_record(self.noise)
        mechanism.check_sampling(self.sampling, max(1, int(self.cycle_length)))
        check_segment_fields(self)

    @property
    def equivalent_noise_multiplier(self) -> float:
        """The one Gaussian multiplier the step's releases (gradient, count) amount to."""
        return mechanisms.equivalent_noise_multiplier(
            self.noise_multiplier, self.count_noise_multiplier)

    def same_mechanism(self, other: "LedgerEntry") -> bool:
        """Whether `other` describes steps identical to these (any count).

        Where a segment starts and a cyclic entry's group are positions, not
        the mechanism: `PrivacyLedger.append` merges an entry that does not
        open a segment into the last one when this holds.
        """
        def mechanism(entry):
            return dataclasses.replace(entry, steps=0, segment_start=False, cycle_position=0)

        return mechanism(self) == mechanism(other)

    @property
    def mechanism(self) -> NoiseMechanism:
        """The noise mechanism its record describes (read back by the mechanism)."""
        return read_noise_record(self.noise)[0]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class PrivacyLedger:
    """The logical steps a run has taken, as phases of identical steps.

    Consecutive identical steps are merged into one `LedgerEntry`, so a run
    that follows a `BatchSizeSchedule` has one entry per phase.

    Args:
        entries: the entries in training order.

    Example:
    ```python
    ledger = PrivacyLedger()
    ledger.record(100, sampling_rate=0.01, noise_multiplier=1.1)
    ledger.record(50, sampling_rate=0.01, noise_multiplier=1.1)
    len(ledger), ledger.total_steps     # (1, 150)
    ```
    """

    def __init__(self, entries: Iterable[LedgerEntry] = ()):
        self._entries: list[LedgerEntry] = []
        for entry in entries:
            self.append(entry)

    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        return tuple(self._entries)

    @property
    def total_steps(self) -> int:
        """Every logical step recorded, of every kind (noiseless and unaccounted too)."""
        return sum(entry.steps for entry in self._entries)

    @property
    def infinite_epsilon_steps(self) -> int:
        """Steps of kinds released without noise (`SamplingKind.infinite_epsilon`): epsilon is infinite."""
        return sum(entry.steps for entry in self._entries
                   if sampling_kind(entry.sampling).infinite_epsilon)

    def unreportable_steps(self) -> tuple[str, int] | None:
        """The first kind in the ledger whose steps make any epsilon a lie, and its steps.

        A kind the accountant refuses (no accounting rule) and whose epsilon is
        not simply infinite: no report may state an epsilon while such
        steps are in the ledger.

        Returns:
            (kind name, its steps in the whole ledger), or None.
        """
        counts: dict[str, int] = {}
        for entry in self._entries:
            kind = sampling_kind(entry.sampling)
            if not kind.accounted and not kind.infinite_epsilon:
                counts[entry.sampling] = counts.get(entry.sampling, 0) + entry.steps
        return next(iter(counts.items()), None)

    def append(self, entry: LedgerEntry) -> None:
        """Adds `entry`, merging it into the last entry if the steps match.

        An entry that opens a noise segment (`segment_start`) is never
        merged: the segments are accounted one by one.
        """
        if not isinstance(entry, LedgerEntry):
            raise TypeError(f"Expected a LedgerEntry, got {entry!r}.")
        if entry.steps == 0:
            return
        if (self._entries and not entry.segment_start
                and self._entries[-1].same_mechanism(entry)):
            last = self._entries[-1]
            self._entries[-1] = dataclasses.replace(
                last, steps=last.steps + entry.steps
            )
        else:
            self._entries.append(entry)

    def record(self, steps: int, **numbers: Any) -> None:
        """Records `steps` identical logical steps.

        Args:
            steps: how many.
            **numbers: the other fields of `LedgerEntry`, by name
                (`sampling_rate` and `noise_multiplier`, and optionally
                `max_batch_size`, `sampling`, `count_noise_multiplier`).
        """
        self.append(LedgerEntry(steps, **numbers))

    def copy(self) -> "PrivacyLedger":
        return PrivacyLedger(self._entries)

    def starts_with(self, prefix: "PrivacyLedger") -> bool:
        """Whether this ledger's first steps are exactly `prefix`'s (a run that continued it).

        Entries merge steps of one mechanism, so `prefix`'s last entry may
        be only the beginning of this ledger's entry at its place.
        """
        mine, theirs = self._entries, prefix.entries
        if len(theirs) > len(mine):
            return False
        for index, entry in enumerate(theirs):
            other = mine[index]
            if index < len(theirs) - 1:
                if other != entry:
                    return False
            elif not (other.same_mechanism(entry) and other.steps >= entry.steps
                      and other.segment_start == entry.segment_start
                      and other.cycle_position == entry.cycle_position):
                return False
        return True

    def to_list(self) -> list[dict[str, Any]]:
        """The entries as JSON-serializable dicts (`from_list` rebuilds the ledger exactly)."""
        return [entry.to_dict() for entry in self._entries]

    @classmethod
    def from_list(cls, entries: Iterable[dict[str, Any]]) -> "PrivacyLedger":
        """Inverse of `to_list`.

        Raises:
            ValueError: an entry without the required fields or with a field
                no entry has, or any number or record an entry refuses.
        """
        try:
            return cls(LedgerEntry(**entry) for entry in entries)
        except TypeError as error:
            raise ValueError(
                f"A ledger entry needs the fields {_REQUIRED_FIELDS} and may have "
                f"the others of {[f.name for f in dataclasses.fields(LedgerEntry)]}: {error}"
            ) from error

    def to_json(self) -> str:
        """`to_list` as compact JSON text (what the optimizer's `privacy_ledger` variable holds).

        Python's JSON writes every float so that it reads back exactly.
        """
        return json.dumps(self.to_list(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "PrivacyLedger":
        """Inverse of `to_json`.

        Raises:
            ValueError: text that is not a JSON list of entries, or an entry
                refused as in `from_list` (a malformed or foreign noise record
                is refused by name).
        """
        try:
            entries = json.loads(text)
        except ValueError as error:
            raise ValueError(f"A privacy ledger must be JSON text: {error}") from None
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ValueError(
                f"A privacy ledger is a JSON list of entries, got {str(text)[:80]!r}.")
        return cls.from_list(entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[LedgerEntry]:
        return iter(self._entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PrivacyLedger) and self._entries == other._entries

    def __repr__(self) -> str:
        return f"PrivacyLedger({self._entries!r})"


# The fields every ledger entry states.
_REQUIRED_FIELDS = ("steps", "sampling_rate", "noise_multiplier")


def ledger_from_schedule(
    schedule: BatchSizeSchedule,
    noise_multiplier: float | None = None,
    *,
    sampling: str = "poisson",
    steps: int | None = None,
) -> PrivacyLedger:
    """The ledger of a run that follows `schedule`.

    Poisson steps are truncated at the schedule's static capacity
    (`schedule.capacity(phase)`), as the tf_megadp Poisson sampler does.

    Args:
        schedule: the `BatchSizeSchedule`.
        noise_multiplier: sigma for phases that do not set their own.
        sampling: ``"poisson"`` or ``"shuffle"``.
        steps: number of logical steps to take; defaults to
            `schedule.total_steps`. Steps past the end stay in the last phase.

    Returns:
        A `PrivacyLedger` with one entry per phase.
    """
    if not isinstance(schedule, BatchSizeSchedule):
        raise TypeError(f"schedule must be a BatchSizeSchedule, got {schedule!r}.")
    total = schedule.total_steps if steps is None else steps
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}.")
    ledger = PrivacyLedger()
    remaining = total
    for index, phase in enumerate(schedule.phases):
        last = index == len(schedule.phases) - 1
        count = remaining if last else min(remaining, phase.steps)
        if count == 0:
            break
        sigma = noise_multiplier_of(phase, noise_multiplier)
        if sigma is None:
            raise ValueError(
                f"Phase {index} of the schedule sets no noise_multiplier; pass "
                "noise_multiplier for phases that do not set their own."
            )
        ledger.record(
            count,
            sampling_rate=sampling_rate_of(phase.batch_size, schedule.num_examples),
            noise_multiplier=sigma,
            max_batch_size=schedule.capacity(phase) if sampling_kind(sampling).truncates else 0,
            sampling=sampling,
        )
        remaining -= count
    return ledger
