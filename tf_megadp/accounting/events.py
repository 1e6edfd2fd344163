"""Sampling kinds, the registry that turns a ledger entry into a `dp_accounting` event.

A ledger entry names how its steps drew their examples: its sampling kind.
Each kind is one `SamplingKind`, registered once, with the event of one step, whether its steps
may be truncated, the warning its epsilon carries, and what the ledger keeper
needs to know of its steps (whether they follow the sampler's schedule, end
at a new pass over the data, give a proven guarantee). A kind without an
event is refused by the accountant, never accounted as Poisson by default.

Every built-in kind is registered here, with its event, and nowhere else:
the library's samplers' kinds "poisson" (`PoissonSampler` and
`PrivacyUnitSampler`) and "shuffle" (`ShuffleSampler`), whose samplers only
name their kind (`sampling_kind`). They live with the accounting and not
with the samplers: `tf-megadp epsilon` and `calibrate` account Poisson and
shuffled runs without importing the data pipeline (nor TensorFlow, which it
needs).

Two kinds are accounted by noise segment, not step by step: "cyclic_poisson"
(a Poisson sampler with `cycle_length` L > 1: step t draws from group
t mod L only) and "fixed_order" (`FixedOrderSampler`: one secret order,
the same slot every epoch). They are what correlated noise needs for a
proof, and their `segment_event` composes the steps of one segment of noise
(`LedgerEntry.segment_start`) at once. Which sampling a noise has a proof
for is the noise mechanism's to say (`NoiseMechanism.check_sampling`,
`tf_megadp.accounting.noise`, which reads the kinds' names from here).

Two kinds belong to the ledger itself, not to a sampler: `NOISELESS` (steps
applied with noise multiplier 0, which make epsilon infinite) and
`UNACCOUNTED` (steps whose data is unknown). Their entries record a count of
steps only, so the ledger holds every step the weights received, and the
accountant refuses them, each with its own message.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Sequence

import dp_accounting

from tf_megadp.accounting import mechanisms
from tf_megadp.errors import PrivacyConfigurationError

__all__ = [
    "CYCLIC_POISSON",
    "FIXED_ORDER",
    "POISSON",
    "SHUFFLE",
    "FIXED_ORDER_WARNING",
    "NOISELESS",
    "SHUFFLE_WARNING",
    "UNACCOUNTED",
    "SamplingKind",
    "check_segment_fields",
    "cyclic_poisson_segment_event",
    "fixed_order_segment_event",
    "refusal_error",
    "entry_event",
    "ledger_event",
    "poisson_step_event",
    "shuffle_step_event",
    "register_sampling_kind",
    "sampling_kind",
    "sampling_kinds",
]


@dataclasses.dataclass(frozen=True)
class SamplingKind:
    """How one kind of step draws its examples, and how its steps are accounted.

    Args:
        name: the kind's name in ledgers, reports and `DataSource`s.
        step_event: the `dp_accounting` event of one step of a ledger entry
            of this kind, `step_event(entry, num_examples)`; None for a kind
            the accountant must refuse.
        truncates: whether its steps may be truncated at `max_batch_size`.
        warning: what the epsilon of such steps does not cover, raised once
            per accountant and published in the report; None if nothing.
        follows_schedule: the steps are a sampler's draws of its
            `BatchSizeSchedule`: each step's q_t and capacity are the
            schedule's, which the ledger keeper checks every step against.
            Otherwise a step's q is the rows it held over N.
        proven_guarantee: the epsilon of such steps is a proven guarantee
            (not an estimate); `require_poisson_sampling` accepts only these.
        ends_step_at_pass: a new pass over the data (a `fit` epoch) must end
            a partial logical step, or the step could hold an example twice;
            False for kinds whose steps are drawn whole by a sampler.
        steps_only: entries of this kind record a count of steps only
            (sampling rate, noise multiplier, truncation and count noise all
            0): the ledger kinds that no sampler draws.
        infinite_epsilon: the steps were released without noise, so epsilon
            is infinite: reports say so and a budget is spent, where the
            steps of another refused kind make every report refuse.
        refusal: why the accountant refuses such steps and what to do,
            formatted with `steps` (their count); None for the generic text.
        segment_event: instead of `step_event`, for kinds whose steps are
            accounted by noise segment: the event of one segment's entries
            (`segment_event(entries, num_examples)`).
        check_noise: checks the segment fields of an entry of this kind
            (`cycle_length`, `steps_per_epoch`, ...); None for a kind
            accounted step by step, whose entries have none.

    Example:
    ```python
    register_sampling_kind(SamplingKind("balls_in_bins", step_event=None))
    ```
    """

    name: str
    step_event: Callable[[Any, int], dp_accounting.DpEvent] | None
    truncates: bool = False
    warning: str | None = None
    follows_schedule: bool = False
    proven_guarantee: bool = False
    ends_step_at_pass: bool = True
    steps_only: bool = False
    infinite_epsilon: bool = False
    refusal: str | None = None
    segment_event: Callable[[Sequence[Any], int], dp_accounting.DpEvent] | None = None
    check_noise: Callable[[Any], None] | None = None

    @property
    def accounted(self) -> bool:
        """Whether the accountant has a rule for its steps (step by step or by segment)."""
        return self.step_event is not None or self.segment_event is not None


_KINDS: dict[str, SamplingKind] = {}


def register_sampling_kind(kind: SamplingKind) -> SamplingKind:
    """Adds `kind` to the kinds that ledgers record and the accountant reads.

    Raises:
        ValueError: another kind has its name.
    """
    if kind.name in _KINDS:
        raise ValueError(
            f"Sampling kind {kind.name!r} clashes with the registered one of that name: "
            "each kind needs its own name."
        )
    _KINDS[kind.name] = kind
    return kind


def sampling_kinds() -> tuple[str, ...]:
    """The registered kinds that say how a step draws its examples, in registration order.

    The ledger's own steps-only kinds (`NOISELESS`, `UNACCOUNTED`) are left
    out: no run can be planned or drawn with them.
    """
    return tuple(name for name, kind in _KINDS.items() if not kind.steps_only)


def sampling_kind(name: str) -> SamplingKind:
    """The registered kind `name`; a ValueError naming the kinds otherwise."""
    try:
        return _KINDS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"sampling must be one of {sampling_kinds()}, got {name!r}."
        ) from None


def refusal_error(name: str, steps: int) -> PrivacyConfigurationError:
    """The error that refuses `steps` steps of kind `name`, which has no accounting rule.

    Args:
        name: a registered kind whose `step_event` is None.
        steps: how many of its steps are refused.

    Returns:
        A `PrivacyConfigurationError` with the kind's own `refusal` text, or
        the generic one for a kind registered without it.
    """
    kind = sampling_kind(name)
    if kind.refusal is not None:
        return PrivacyConfigurationError(kind.refusal.format(steps=steps))
    accounted = [other for other in sampling_kinds() if _KINDS[other].accounted]
    return PrivacyConfigurationError(
        f"No accounting rule for sampling kind {name!r}: tf_megadp "
        f"accounts only {accounted} ('shuffle' as Poisson, with a warning). "
        "Draw the batches with tf_megadp.PoissonSampler, or record the steps "
        "with sampling='shuffle'."
    )


def entry_event(entry: Any, num_examples: int) -> dp_accounting.DpEvent:
    """The `dp_accounting` event of `entry`'s steps (`entry` a `LedgerEntry`, which imports this module).

    Every sampling kind brings its own event: a kind registered without one
    must not be accounted as Poisson by default, which could understate what
    it spends.

    Args:
        entry: the `LedgerEntry`.
        num_examples: N.

    Returns:
        Its steps' event, self-composed `entry.steps` times.

    Raises:
        PrivacyConfigurationError: `entry.sampling` has no accounting rule
            (with the kind's own message).
    """
    kind = sampling_kind(entry.sampling)
    if kind.segment_event is not None:
        return kind.segment_event((entry,), num_examples)
    if kind.step_event is None:
        raise refusal_error(entry.sampling, entry.steps)
    return dp_accounting.SelfComposedDpEvent(kind.step_event(entry, num_examples), entry.steps)


def _segment_fields(entry: Any) -> tuple:
    """What every entry of one noise segment shares: its sampling and its mechanism."""
    return (entry.sampling, entry.noise, entry.cycle_length, entry.steps_per_epoch,
            entry.participations, entry.sensitivity)


def _segments(entries: Iterable[Any]) -> Iterable[list[Any]]:
    """The ledger's entries in order: one list per segment, a single entry for the others.

    A segment is the entries of a kind with a `segment_event` from one that
    opens it (`segment_start`, or the first of a run of such entries) up to
    the next that opens one or is of another kind.

    Raises:
        ValueError: an entry continues a segment with another mechanism.
    """
    segment: list[Any] = []
    for entry in entries:
        if sampling_kind(entry.sampling).segment_event is None:
            if segment:
                yield segment
                segment = []
            yield [entry]
            continue
        if segment and not entry.segment_start:
            if _segment_fields(entry) != _segment_fields(segment[0]):
                raise ValueError(
                    f"A ledger entry continues a noise segment with another mechanism or "
                    f"sampling ({entry!r} after {segment[0]!r}): a change of either opens a "
                    "new segment (segment_start=True).")
            segment.append(entry)
            continue
        if segment:
            yield segment
        segment = [entry]
    if segment:
        yield segment


def ledger_event(entries: Iterable[Any], num_examples: int) -> dp_accounting.DpEvent:
    """The `dp_accounting` event of a whole run: its ledger entries' events, in order.

    Entries of the kinds accounted step by step each give `entry_event`;
    those of the kinds accounted by noise segment give one
    `SamplingKind.segment_event` per segment. Segments use independent
    noise draws, so their events compose like any others.

    Args:
        entries: the `LedgerEntry`s of a ledger.
        num_examples: N.

    Returns:
        A `ComposedDpEvent` of those events, in order.

    Raises:
        PrivacyConfigurationError: an entry's kind has no accounting rule,
            or a segment has no proof (as its kind's event says).
    """
    events = []
    for group in _segments(entries):
        kind = sampling_kind(group[0].sampling)
        if kind.segment_event is None:
            events.append(entry_event(group[0], num_examples))
        else:
            events.append(kind.segment_event(tuple(group), num_examples))
    return dp_accounting.ComposedDpEvent(events)


# The ledger's own kinds.
NOISELESS = "noiseless"
UNACCOUNTED = "unaccounted"
register_sampling_kind(SamplingKind(
    NOISELESS, step_event=None, steps_only=True, infinite_epsilon=True,
    refusal=(
        "{steps} logical steps were applied with noise_multiplier 0: they released "
        "exact gradients, so epsilon is infinite and the run is NOT differentially "
        "private. No accountant bounds them. Train with noise_multiplier > 0 (or "
        "calibrate it: tf_megadp.calibrate_noise_multiplier); to report a finite "
        "epsilon, restore a checkpoint taken before those steps.")))
register_sampling_kind(SamplingKind(
    UNACCOUNTED, step_event=None, steps_only=True,
    refusal=(
        "{steps} logical steps of this model were taken on data whose size was "
        "unknown (or outside fit, e.g. train_on_batch, or by a PrivateStep whose data "
        "was not the one it was given), so their privacy cannot be accounted. Train "
        "with a PrivacyCallback from the first step (with num_examples=N for data of "
        "unknown size), or a PrivateStep fed its own data; to report an epsilon, "
        "restore a checkpoint taken before those steps.")))


def poisson_step_event(entry, num_examples: int) -> dp_accounting.DpEvent:
    """One Poisson step: a sampled Gaussian, truncated at `entry.max_batch_size` if set.

    When truncation is rare, the accountant accounts a truncated step by a
    coupling bound at the cost of the untruncated one (and works with RDP);
    otherwise dp_accounting's exact PLD of the truncated mechanism is used
    (see `tf_megadp.accounting.engines.TruncationAwareAccountant`).

    Args:
        entry: a `LedgerEntry` of kind "poisson".
        num_examples: N.

    Returns:
        The `dp_accounting` event of one of its steps.
    """
    if entry.max_batch_size:
        # dp_accounting's truncated event holds one Gaussian: the equivalent
        # one of the step's releases (see `mechanisms.as_single_gaussian`).
        return dp_accounting.TruncatedSubsampledGaussianDpEvent(
            dataset_size=num_examples,
            sampling_probability=entry.sampling_rate,
            truncated_batch_size=entry.max_batch_size,
            noise_multiplier=entry.equivalent_noise_multiplier,
        )
    return dp_accounting.PoissonSampledDpEvent(
        entry.sampling_rate,
        mechanisms.step_mechanism(entry.noise_multiplier, entry.count_noise_multiplier),
    )


def shuffle_step_event(entry, num_examples: int) -> dp_accounting.DpEvent:
    """One shuffled step, as if Poisson-sampled: no accountant covers shuffling (`SHUFFLE_WARNING`).

    Args:
        entry: a `LedgerEntry` of kind "shuffle".
        num_examples: N (unused: the event is the Poisson one of the same q).

    Returns:
        The `dp_accounting` event the report uses for one of its steps.
    """
    return dp_accounting.PoissonSampledDpEvent(
        entry.sampling_rate,
        mechanisms.step_mechanism(entry.noise_multiplier, entry.count_noise_multiplier),
    )


SHUFFLE_WARNING = (
    "Shuffled fixed-size batches are accounted as if they were Poisson-sampled. "
    "This UNDERSTATES the real privacy loss: shuffling does not give the "
    "amplification that the accountant assumes (Chua et al., 2024, 'How Private "
    "are DP-SGD Implementations?'). Report the epsilon as a Poisson-sampling "
    "estimate, or train with Poisson sampling (the tf_megadp Poisson sampler) to "
    "get a guarantee that matches the number."
)

# The samplers' kinds.
POISSON = "poisson"
SHUFFLE = "shuffle"
register_sampling_kind(SamplingKind(POISSON, poisson_step_event, truncates=True,
                                    follows_schedule=True, proven_guarantee=True,
                                    ends_step_at_pass=False))
register_sampling_kind(SamplingKind(SHUFFLE, shuffle_step_event, warning=SHUFFLE_WARNING))


# -- Correlated noise's kinds: cyclic Poisson and fixed order (issue 39) --------------

CYCLIC_POISSON = "cyclic_poisson"
FIXED_ORDER = "fixed_order"


FIXED_ORDER_WARNING = (
    "Fixed-order epochs are accounted without amplification by sampling, for adding or "
    "removing one example that leaves every other example in its slot (zero-out "
    "adjacency, as in Kairouz et al. 2021 and Choquette-Choo et al. 2023): the sampler "
    "keeps every slot of its secret order, a removed example's slot then holds padding."
)


def check_segment_fields(entry: Any) -> None:
    """Checks an entry's segment fields against its sampling kind (`LedgerEntry` calls it).

    Raises:
        ValueError: numbers the kind does not take (a cycle or a
            participation on a kind accounted step by step, or a kind's own
            check).
    """
    kind = sampling_kind(entry.sampling)
    if kind.check_noise is not None:
        kind.check_noise(entry)
        return
    given = {name: getattr(entry, name) for name in (
        "cycle_length", "cycle_position", "steps_per_epoch", "participations", "sensitivity",
        "segment_start")}
    if any(given.values()):
        raise ValueError(
            f"{entry.sampling!r} steps are accounted step by step: they have no cycle, "
            f"participation or noise segment, got {given}.")


def _check_cyclic_entry(entry: Any) -> None:
    cycle = int(entry.cycle_length)
    if cycle < 1 or not 0 <= int(entry.cycle_position) < cycle:
        raise ValueError(
            f"A cyclic Poisson entry needs cycle_length L >= 1 and 0 <= cycle_position < L, "
            f"got L = {entry.cycle_length}, position {entry.cycle_position}.")
    if entry.steps_per_epoch or entry.participations or entry.sensitivity:
        raise ValueError(
            "A cyclic Poisson entry has no fixed-order participation: steps_per_epoch, "
            "participations and sensitivity are 0.")


def _check_fixed_order_entry(entry: Any) -> None:
    if int(entry.steps_per_epoch) < 1 or int(entry.participations) < 1:
        raise ValueError(
            "A fixed-order entry needs steps_per_epoch >= 1 and participations >= 1, got "
            f"{entry.steps_per_epoch} and {entry.participations}.")
    if not (math.isfinite(entry.sensitivity) and entry.sensitivity > 0):
        raise ValueError(
            f"A fixed-order entry needs its segment's sensitivity > 0, got {entry.sensitivity}.")
    if entry.cycle_length or entry.cycle_position:
        raise ValueError("A fixed-order entry has no cycle: cycle_length and position are 0.")


def _round_key(entry: Any) -> tuple:
    """What one round of a cyclic Poisson segment releases: q, the noise, the truncation."""
    return (entry.sampling_rate, entry.noise_multiplier, entry.count_noise_multiplier,
            entry.max_batch_size)


def cyclic_poisson_segment_event(entries: Sequence[Any], num_examples: int
                                 ) -> dp_accounting.DpEvent:
    """The event of one noise segment of cyclic Poisson steps (an amplified banded strategy).

    The examples are split into L = `cycle_length` groups of at most
    ceil(N / L); step t Poisson-samples group t mod L at q = B L / N. The
    windows of L consecutive steps that start at a multiple of L each hold
    one step of every group, so an example can join at most one step per
    window, and with a b-banded unit-norm C (b <= L) the columns of two of
    its steps never overlap: the segment is the adaptive composition of its
    windows, each a Poisson-sampled Gaussian (truncated at the step's
    capacity, over a group, if it is), as in Choquette-Choo et al. 2023,
    Theorem 4, and `matrix_factorization.cyclic_poisson_event` (a segment
    starting at step 0 gives exactly that event). Independent noise is the
    case b = 0.

    Args:
        entries: the segment's ledger entries, in order (its first one's
            `cycle_position` is the group of its first step).
        num_examples: N.

    Returns:
        The composition, per run of identical windows, of SelfComposed(round, windows).

    Raises:
        PrivacyConfigurationError: one window mixes two sampling rates,
            noises or truncations (its groups' guarantees would differ).
    """
    first = entries[0]
    cycle = first.cycle_length
    offset = first.cycle_position
    group_size = -(-num_examples // cycle)
    runs: list[tuple[int, int, Any]] = []  # [start, end) of the segment's steps, entry.
    start = 0
    for entry in entries:
        if runs and _round_key(runs[-1][2]) == _round_key(entry):
            runs[-1] = (runs[-1][0], start + entry.steps, runs[-1][2])
        else:
            runs.append((start, start + entry.steps, entry))
        start += entry.steps
    events = []
    for index, (begin, end, entry) in enumerate(runs):
        first_window = (begin + offset) // cycle
        last_window = (end - 1 + offset) // cycle
        if index and (runs[index - 1][1] - 1 + offset) // cycle == first_window:
            raise PrivacyConfigurationError(
                f"Steps {begin - 1} and {begin} of a cyclic Poisson noise segment "
                f"(cycle_length {cycle}) belong to one round but differ in sampling rate, "
                "noise or truncation: a round must sample every group alike, or the groups' "
                f"guarantees differ. Start each batch-size phase at a multiple of "
                f"cycle_length = {cycle}, or keep the batch size constant.")
        events.append(dp_accounting.SelfComposedDpEvent(
            poisson_step_event(entry, group_size), last_window - first_window + 1))
    return events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events)


def fixed_order_segment_event(entries: Sequence[Any], num_examples: int
                              ) -> dp_accounting.DpEvent:
    """The event of one noise segment of fixed-order epochs: one Gaussian mechanism.

    The segment releases C x + sigma C_clip z over its planned steps, each
    example in the same slot of every epoch: the Gaussian mechanism of
    sensitivity sens * C_clip (`LedgerEntry.sensitivity`, the minsep
    sensitivity for s = `steps_per_epoch` and k' = `participations`), so
    Gaussian(sigma / sens) (`matrix_factorization.fixed_order_event`). It is
    counted in full from the segment's first step: a prefix of it releases
    less. With adaptive clipping each of the k' steps an example joins also
    releases a count of multiplier sigma_count, and Gaussians compose into
    one: (sens^2 / sigma^2 + k' / sigma_count^2)^-1/2.

    Args:
        entries: the segment's ledger entries.
        num_examples: N (unused: no sampling).

    Returns:
        A `GaussianDpEvent`.

    Raises:
        ValueError: the entries differ in noise, or hold more steps than the
            participation accounted (s * k').
    """
    first = entries[0]
    if any((e.noise_multiplier, e.count_noise_multiplier) != (
            first.noise_multiplier, first.count_noise_multiplier) for e in entries):
        raise ValueError(
            "A fixed-order noise segment must keep one noise multiplier: the strategy's "
            "noise is sigma C^-1 z for one sigma.")
    steps = sum(e.steps for e in entries)
    if steps > first.steps_per_epoch * first.participations:
        raise ValueError(
            f"A fixed-order noise segment holds {steps} steps, more than the "
            f"{first.participations} epochs of {first.steps_per_epoch} steps it was accounted "
            "for: an example could join more steps than the sensitivity counts.")
    precision = (first.sensitivity / first.noise_multiplier) ** 2
    if first.count_noise_multiplier:
        precision += first.participations / first.count_noise_multiplier ** 2
    return dp_accounting.GaussianDpEvent(precision ** -0.5)


register_sampling_kind(SamplingKind(
    CYCLIC_POISSON, step_event=None, truncates=True, follows_schedule=True,
    proven_guarantee=True, ends_step_at_pass=False,
    segment_event=cyclic_poisson_segment_event, check_noise=_check_cyclic_entry))
register_sampling_kind(SamplingKind(
    FIXED_ORDER, step_event=None, warning=FIXED_ORDER_WARNING, follows_schedule=True,
    proven_guarantee=True, ends_step_at_pass=False,
    segment_event=fixed_order_segment_event, check_noise=_check_fixed_order_entry))
