"""Sampling kinds, the registry that turns a ledger entry into a `dp_accounting` event.

A ledger entry names how its steps drew their examples: its sampling kind.
Each kind is one `SamplingKind`, registered once, with the event of one step, its code in the optimizer's ledger rows, whether its steps
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

Two kinds belong to the ledger itself, not to a sampler: `NOISELESS` (steps
applied with noise multiplier 0, which make epsilon infinite) and
`UNACCOUNTED` (steps whose data is unknown). Their entries record a count of
steps only, so the ledger holds every step the weights received, and the
accountant refuses them, each with its own message.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import dp_accounting

from tf_megadp.accounting import mechanisms
from tf_megadp.errors import PrivacyConfigurationError

__all__ = [
    "NOISELESS",
    "SHUFFLE_WARNING",
    "UNACCOUNTED",
    "SamplingKind",
    "refusal_error",
    "entry_event",
    "ledger_event",
    "poisson_step_event",
    "shuffle_step_event",
    "register_sampling_kind",
    "sampling_kind",
    "sampling_kind_of_code",
    "sampling_kinds",
]


@dataclasses.dataclass(frozen=True)
class SamplingKind:
    """How one kind of step draws its examples, and how its steps are accounted.

    Args:
        name: the kind's name in ledgers, reports and `DataSource`s.
        code: its number in the optimizer's `privacy_ledger` rows; stored in
            checkpoints, so it never changes once released.
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

    Example:
    ```python
    register_sampling_kind(SamplingKind("balls_in_bins", 2, step_event=None))
    ```
    """

    name: str
    code: int
    step_event: Callable[[Any, int], dp_accounting.DpEvent] | None
    truncates: bool = False
    warning: str | None = None
    follows_schedule: bool = False
    proven_guarantee: bool = False
    ends_step_at_pass: bool = True
    steps_only: bool = False
    infinite_epsilon: bool = False
    refusal: str | None = None


_KINDS: dict[str, SamplingKind] = {}


def register_sampling_kind(kind: SamplingKind) -> SamplingKind:
    """Adds `kind` to the kinds that ledgers record and the accountant reads.

    Raises:
        ValueError: another kind has its name or its code.
    """
    for other in _KINDS.values():
        if other.name == kind.name or other.code == kind.code:
            raise ValueError(
                f"Sampling kind {kind.name!r} (code {kind.code}) clashes with the "
                f"registered {other.name!r} (code {other.code}): each kind needs its "
                "own name and ledger code."
            )
    _KINDS[kind.name] = kind
    return kind


def sampling_kinds() -> tuple[str, ...]:
    """The registered kinds that say how a step draws its examples, by code.

    The ledger's own steps-only kinds (`NOISELESS`, `UNACCOUNTED`) are left
    out: no run can be planned or drawn with them.
    """
    return tuple(sorted((name for name, kind in _KINDS.items() if not kind.steps_only),
                        key=lambda name: _KINDS[name].code))


def sampling_kind(name: str) -> SamplingKind:
    """The registered kind `name`; a ValueError naming the kinds otherwise."""
    try:
        return _KINDS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"sampling must be one of {sampling_kinds()}, got {name!r}."
        ) from None


def sampling_kind_of_code(code: float) -> SamplingKind:
    """The registered kind whose ledger code is `code`."""
    for kind in _KINDS.values():
        if kind.code == code:
            return kind
    raise ValueError(f"Unknown sampling kind code {code} in a ledger row.")


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
    accounted = [other for other in sampling_kinds() if _KINDS[other].step_event]
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
    step_event = sampling_kind(entry.sampling).step_event
    if step_event is None:
        raise refusal_error(entry.sampling, entry.steps)
    return dp_accounting.SelfComposedDpEvent(step_event(entry, num_examples), entry.steps)


def ledger_event(entries: Iterable[Any], num_examples: int) -> dp_accounting.DpEvent:
    """The `dp_accounting` event of a whole run: its ledger entries' events, in order.

    Args:
        entries: the `LedgerEntry`s of a ledger.
        num_examples: N.

    Returns:
        A `ComposedDpEvent` of `entry_event` of each entry.

    Raises:
        PrivacyConfigurationError: an entry's kind has no accounting rule.
    """
    return dp_accounting.ComposedDpEvent([entry_event(entry, num_examples) for entry in entries])


# The ledger's own kinds. Their codes are stored in checkpoints and never
# change; they are negative so that samplers keep the codes from 0 up.
NOISELESS = "noiseless"
UNACCOUNTED = "unaccounted"
register_sampling_kind(SamplingKind(
    NOISELESS, -1, step_event=None, steps_only=True, infinite_epsilon=True,
    refusal=(
        "{steps} logical steps were applied with noise_multiplier 0: they released "
        "exact gradients, so epsilon is infinite and the run is NOT differentially "
        "private. No accountant bounds them. Train with noise_multiplier > 0 (or "
        "calibrate it: tf_megadp.calibrate_noise_multiplier); to report a finite "
        "epsilon, restore a checkpoint taken before those steps.")))
register_sampling_kind(SamplingKind(
    UNACCOUNTED, -2, step_event=None, steps_only=True,
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

# The samplers' kinds. Their ledger codes are stored in checkpoints: they never change.
register_sampling_kind(SamplingKind("poisson", 0, poisson_step_event, truncates=True,
                                    follows_schedule=True, proven_guarantee=True,
                                    ends_step_at_pass=False))
register_sampling_kind(SamplingKind("shuffle", 1, shuffle_step_event, warning=SHUFFLE_WARNING))
